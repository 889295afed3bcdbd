"""Two rows of every certificate that run the route's features, each against an undisturbed run on the same route:

- **prefix cache**: a prompt run cold (the prefix cache off: the parity run), a shorter prompt sharing its
  start (kept by every stage when its session closes), then the long prompt again, restoring that kept prefix
  cut back to the shared whole blocks: tokens and every logits row bit-identical to the cold run, with some
  positions restored. A stage whose Describe says it keeps no prefixes (`prefix_cache_capacity_bytes` 0, why
  in `prefix_cache_off`: a recurrent or hybrid model keeps one running state, docs/families.md) makes the row
  say `refused: <why>`, which is not a failure: that route prefills in full, and parity covers it.
- **recovery**: the route starts with a second worker (a replica) of one stage, whose first worker SIGKILLs
  itself (`--test-die-at`, Limits.die_at) about to compute a decode step of one session, half way through its
  tokens; the client re-prefills on the replica and the tokens and every logits row equal the undisturbed run.
  The stage is the middle one (`n // 2`: stage 1 of 2, 1 of 3, 6 of 12): neither the origin nor, from
  3 stages on, the last stage (beta kills the last stage mid-draft, dgr.app.certify.beta).

The rows run through dgr.runtime.wire.client.RouteClient on a dgr.app.local.LocalRoute that `dgr certify`
started (dgr.app.certify.runner); they compare Generation with Generation.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import numpy as np

from dgr.core.certificate import Figure
from dgr.core.errors import WireError
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS

RECOVERY_SESSION = "certify-recovery"
PREFIX_CHECK = "prefix cache: warm restore = cold"
RECOVERY_CHECK = "recovery: kill -9 of the middle stage mid-generation, replica"
RECOVERY_THRESHOLD = "= the undisturbed run, on a replica"
PREFIX_THRESHOLD = "restored > 0, bit-identical (or refused)"


def differs(got, want) -> str:
    """'' when two generations have the same tokens and bit-identical logits rows at the same positions, else
    the first difference."""
    if got.token_ids != want.token_ids:
        k = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                 min(len(got.token_ids), len(want.token_ids)))
        return f"token {k} differs ({len(got.token_ids)} tokens, {len(want.token_ids)} undisturbed)"
    if sorted(got.logits) != sorted(want.logits) or not want.logits:
        return f"logits rows at positions {sorted(got.logits)}, undisturbed {sorted(want.logits)}"
    for p in sorted(want.logits):
        a, b = got.logits[p], want.logits[p]
        if a.shape != b.shape or not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.shape == b.shape else None
            return f"the logits row at position {p} differs" + (f" (max |diff| {d:.3g})" if d is not None else "")
    return ""


def prefix_cache_row(client, descs, ids: list[int], cold, max_new: int, **run) -> Figure:
    """The prefix-cache row (the module docstring) on `client`'s route, whose stages said `descs` (Describe);
    `cold`: `ids` already run with the prefix cache off (tokens and logits "last"), or None to run it here;
    `run`: more arguments of every run (speculate=...)."""
    off = [i for i, d in enumerate(descs) if d.prefix_cache_capacity_bytes == 0]
    if off:
        why = descs[off[0]].prefix_cache_off or "it keeps no prefixes"
        return Figure(check=PREFIX_CHECK, figure=f"refused: {why}", threshold=PREFIX_THRESHOLD, passed=True,
                      detail=f"stage(s) {off} keep no prefixes (Describe: prefix_cache_capacity_bytes 0): every "
                             "prompt is prefilled in full, which parity covers")
    k = len(ids) // 2
    try:
        if cold is None:
            cold = client.run(ids, max_new_tokens=max_new, logits="last", stop_token_ids=[], prefix_cache=False,
                              **run)
        client.run(ids[:k], max_new_tokens=max_new, stop_token_ids=[], prefix_cache=True, **run)
        warm = client.run(ids, max_new_tokens=max_new, logits="last", stop_token_ids=[], prefix_cache=True, **run)
    except WireError as e:                          # a route that cannot run it: the row fails, the rest goes on
        return Figure(check=PREFIX_CHECK, figure="error", threshold=PREFIX_THRESHOLD, passed=False,
                      detail=str(e).splitlines()[0])
    return prefix_figure(warm, cold, len(ids), k)


def prefix_figure(warm, cold, n: int, k: int) -> Figure:
    """The prefix-cache row's decision: `warm` (an `n`-token prompt after its first `k` tokens were kept)
    must restore some positions and equal `cold` bit for bit."""
    why = differs(warm, cold)
    ok = not why and warm.cached_tokens > 0
    how = (f"{n} tokens cold (prefix cache off), the first {k} of them (kept by every stage), then all {n} "
           f"again: {warm.cached_tokens} positions restored (whole blocks of {PREFIX_BLOCK_TOKENS}), "
           f"{len(warm.token_ids)} tokens and {len(warm.logits)} logits rows compared")
    if not warm.cached_tokens:
        how += (f"; nothing restored (a prompt shorter than {2 * PREFIX_BLOCK_TOKENS + 2} tokens has no whole "
                "block to share, or a stage kept nothing)")
    return Figure(check=PREFIX_CHECK, figure=f"{warm.cached_tokens}/{n} restored, " +
                  ("same tokens and logits" if not why else "DIFFERS"),
                  threshold=PREFIX_THRESHOLD, passed=ok, detail=how + (f"; {why}" if why else ""))


@dataclass(frozen=True)
class Fault:
    """Where the recovery row's kill -9 lands: `stage`'s first worker (the stage has a replica), about to
    compute `position` of RECOVERY_SESSION's first epoch."""

    stage: int
    position: int
    tokens: int                             # generated before it (max_new // 2)

    @classmethod
    def plan(cls, n_stages: int, prompt_len: int, max_new: int) -> Fault:
        """The middle stage, half way through `max_new` tokens of a `prompt_len`-token prompt (with one token,
        in the prompt's last step)."""
        return cls(stage=n_stages // 2, position=prompt_len - 1 + max_new // 2, tokens=max_new // 2)

    def replicas(self, n_stages: int) -> list[int]:
        """Workers per stage for LocalRoute(replicas=...)."""
        return [2 if i == self.stage else 1 for i in range(n_stages)]

    def extra(self, stage: int, replica: int) -> list[str]:
        """Worker arguments for LocalRoute(extra=...): the die-at hook on the victim only."""
        if (stage, replica) != (self.stage, 0):
            return []
        return ["--test-die-at", f"{RECOVERY_SESSION}:1:{self.position}"]


def recovery_row(route, fault: Fault, ids: list[int], want, max_new: int, chunk_tokens: int, **run) -> Figure:
    """The recovery row (the module docstring): `ids` through every replica of `route` as RECOVERY_SESSION;
    `want`: the same generation undisturbed (tokens and logits "last"). Leaves the victim dead: run it last."""
    got, error = None, ""
    with RouteClient(route.replicas, chunk_tokens=chunk_tokens, prefix_cache=False) as c:
        try:
            got = c.run(ids, max_new_tokens=max_new, logits="last", stop_token_ids=[], session_id=RECOVERY_SESSION,
                        **run)
        except WireError as e:                      # it gave up: the row fails, the certificate is still written
            whys = dict.fromkeys(f"{f.hop}: {f.why}" for f in getattr(e, "failures", []))
            error = "; ".join([str(e).splitlines()[0], *whys])
    victim = route.workers[fault.stage][0].proc
    try:
        code = victim.wait(30)
    except subprocess.TimeoutExpired:               # still running: the step never came
        code = None
    return recovery_figure(got, want, code, fault, len(ids), max_new, error)


def recovery_figure(got, want, code: int | None, fault: Fault, n: int, max_new: int, error: str = "") -> Figure:
    """The recovery row's decision: the victim died of SIGKILL (`code` -9), the client moved that stage to
    another worker (a second epoch), and `got` equals `want` bit for bit. `error`: why the client gave up
    (`got` None)."""
    where = (f"stage {fault.stage}'s first worker exited {code} about to compute position {fault.position} (after "
             f"{fault.tokens} of {max_new} tokens of a {n}-token prompt)")
    if got is None:
        return Figure(check=RECOVERY_CHECK, figure="gave up" + ("" if code == -9 else ", no kill"),
                      threshold=RECOVERY_THRESHOLD, passed=False, detail=f"{where}; the client gave up: {error}")
    why = differs(got, want)
    moved = bool(got.failures) and got.failures[0].stage == fault.stage and got.epochs >= 2
    ok = not why and code == -9 and moved
    figure = ("same tokens and logits" if not why else "DIFFERS") + ("" if code == -9 else ", no kill") + \
             ("" if moved else ", not recovered")
    return Figure(check=RECOVERY_CHECK, figure=figure, threshold=RECOVERY_THRESHOLD, passed=ok,
                  detail=f"{where}; the client went on on its replica: {got.epochs} epoch(s), failures "
                         f"{[f'stage {f.stage} {f.code}' for f in got.failures]}; {len(got.logits)} logits rows "
                         "compared" + (f"; {why}" if why else ""))
