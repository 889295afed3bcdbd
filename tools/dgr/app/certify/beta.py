"""`dgr gate beta`'s MTP rows (certification/beta.toml, `[mtp]`; docs/deepseek4.md section 4).

Beta holds everything alpha checks (dgr.app.certify.gate runs those targets first) plus, for each target
in `mtp.targets` built again with `bundle.include_mtp = true` (the MTP block on the last stage), one
certificate whose rows are:

- **MTP on = MTP off**: every parity prompt of the contract, greedy, with `--speculate mtp` and without,
  through the same worker processes: equal tokens and bit-identical logits, with drafts actually sent;
- **prefix cache with MTP on**: dgr.app.certify.features' prefix-cache row with every run speculating (a
  DeepSeek V4 stage keeps no prefixes today: `refused: <why>`, not a failure);
- **kill -9 mid-draft**: the last stage has a replica; its first worker SIGKILLs itself about to compute
  the first speculative step of a session (`--test-die-at` at a drafted position: inside a draft step by
  construction); the client re-prefills on the replica and the text equals the text without the fault;
- **soak** (the first target only): `sessions` clients generating with MTP on for `seconds`: no more errors
  than `errors_max`, every repeat of a prompt the same text, and each worker's RSS growth (after a warm-up
  round) under `rss_growth_max_mib`;

and one more certificate, for the speculation rows (dgr.app.bench.speculate_mtp's measurement, loopback, MTP
against none): tokens per ring trip on a synthetic V4 whose drafts agree with its trunk at `speculation.agree` (at
least `tokens_per_trip_min`), and the rejected-draft cost, TPOT with MTP over TPOT without on one whose drafts
never agree (at most `rejected_cost_max`, with no draft accepted).
"""

from __future__ import annotations

import datetime as dt
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from dgr import __version__
from dgr.app.bench import speculate_mtp
from dgr.app.bench.soak import proc_memory
from dgr.app.certify.contract import LoadedContract, Synthetic
from dgr.app.certify.features import prefix_cache_row
from dgr.app.certify.fixtures import synthetic_bundle
from dgr.app.certify.host import host, usable_cores
from dgr.app.certify.runner import checked_identity, parity_prompts
from dgr.app.local import LocalRoute
from dgr.core.certificate import Certificate, ContractRef, Figure, StageRange
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient

log = get_logger(__name__)

KILL_SESSION = "beta-kill-mid-draft"
KILL_PROMPT = 40                          # random ids: its length is known before any worker starts


def _certificate(lc: LoadedContract, bundle, identity, figures: list[Figure]) -> Certificate:
    return Certificate(
        identity=identity, contract=ContractRef(path=lc.ref_path, blake3=lc.blake3, name=lc.contract.name),
        hardware=host(), stages=tuple(StageRange(stage=s.index, layer_begin=s.layer_begin, layer_end=s.layer_end)
                                      for s in bundle.manifest.stages),
        figures=tuple(figures), passed=all(f.passed for f in figures),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), dgr_version=__version__)


def _on_equals_off(client, prompts: list[list[int]], k: int, max_new: int) -> list[Figure]:
    equal = total = rows = 0
    worst, drafted, accepted = 0.0, 0, 0
    for ids in prompts:
        off = client.run(ids, max_new_tokens=max_new, logits="last", stop_token_ids=[])
        on = client.run(ids, max_new_tokens=max_new, logits="last", stop_token_ids=[], speculate="mtp", draft_k=k)
        total += len(off.token_ids)
        equal += sum(a == b for a, b in zip(on.token_ids, off.token_ids))
        for p in range(len(ids) - 1, len(ids) - 1 + len(off.token_ids)):
            a, b = on.logits.get(p), off.logits.get(p)
            d = float("inf") if a is None or b is None or a.shape != b.shape else float(np.max(np.abs(a - b)))
            worst, rows = max(worst, d), rows + 1
        drafted += sum(e.drafted for e in on.events)
        accepted += sum(e.accepted for e in on.events)
    sent = f"{len(prompts)} prompts x {max_new} tokens, k={k}: {drafted} drafts sent, {accepted} accepted"
    return [Figure(check="MTP on = off: greedy tokens", figure=f"{equal}/{total}", threshold="all equal, drafts sent",
                   passed=total > 0 and equal == total and drafted > 0, detail=sent),
            Figure(check="MTP on = off: max |logit diff|", figure=worst, threshold="== 0",
                   passed=rows > 0 and worst == 0.0, detail=f"{rows} rows compared")]


def _kill_mid_draft(route, client, k: int, max_new: int) -> Figure:
    ids = np.random.default_rng(22).integers(1, 250, size=KILL_PROMPT).tolist()
    want = client.run(ids, max_new_tokens=max_new, stop_token_ids=[])
    got = client.run(ids, max_new_tokens=max_new, stop_token_ids=[], speculate="mtp", draft_k=k,
                     session_id=KILL_SESSION)
    victim = route.workers[-1][0].proc
    try:
        code = victim.wait(30)
    except subprocess.TimeoutExpired:               # still running: it never reached the step
        code = None
    ok = got.token_ids == want.token_ids and got.epochs >= 2 and code == -9
    return Figure(check="kill -9 of the last stage mid-draft, replica", figure="same text" if ok else "differs",
                  threshold="same text after a re-prefill", passed=ok,
                  detail=f"the last stage's first worker exited {code} about to compute position {KILL_PROMPT + 1} "
                         f"(a draft of the first speculative step); {got.epochs} epochs, "
                         f"{len(got.token_ids)} tokens; failures: {[f.address for f in got.failures]}")


def _soak(route, addresses, m, k: int) -> Figure:
    prompts = [np.random.default_rng(30 + i).integers(1, 250, size=24 + 8 * i).tolist() for i in range(4)]
    pids = [w.proc.pid for w in route.all if w.proc.poll() is None]
    errors: list[str] = []
    texts: dict[int, set] = {i: set() for i in range(len(prompts))}
    runs = [0]
    lock = threading.Lock()

    def one(c, i: int) -> None:
        try:
            g = c.run(prompts[i], max_new_tokens=m.max_tokens, stop_token_ids=[], speculate="mtp", draft_k=k)
            with lock:
                texts[i].add(tuple(g.token_ids))
                runs[0] += 1
        except DgrError as e:
            with lock:
                errors.append(str(e).splitlines()[0])

    with RouteClient(addresses, prefix_cache=False) as warm:
        for i in range(len(prompts)):
            one(warm, i)                           # warm-up: the baseline memory is taken after it
    start = {p: proc_memory(p).get("VmRSS", 0) for p in pids}
    deadline = time.monotonic() + m.seconds

    def loop(n: int) -> None:
        with RouteClient(addresses, prefix_cache=False) as c:
            i = n
            while time.monotonic() < deadline:
                one(c, i % len(prompts))
                i += 1

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(m.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    growth = max((proc_memory(p).get("VmRSS", 0) - start[p]) / 1024 for p in pids)
    same = all(len(v) <= 1 for v in texts.values())
    ok = len(errors) <= m.errors_max and same and growth <= m.rss_growth_max_mib and runs[0] > len(prompts)
    return Figure(check="soak with MTP on", figure=f"{len(errors)} errors, RSS +{growth:.1f} MiB",
                  threshold=f"<= {m.errors_max} errors, <= {m.rss_growth_max_mib:g} MiB, same texts", passed=ok,
                  detail=f"{m.sessions} sessions for {m.seconds:g} s: {runs[0]} generations of {m.max_tokens} tokens; "
                         f"repeats {'all equal' if same else 'DIFFER'}" + (f"; first error: {errors[0]}" if errors else ""))


def certify_mtp(spec: Synthetic, lc: LoadedContract, *, lane: str, lib: Path, root: Path | None = None,
                soak: bool = False) -> Certificate:
    """The MTP rows of one target (the module docstring), in one certificate."""
    c, m = lc.contract, lc.contract.mtp
    b = synthetic_bundle(spec, root, include_mtp=True)
    n = len(b.manifest.stages)
    threads = c.threads(n, usable_cores())
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", str(threads), "--n-ctx", str(c.parity.n_ctx)]
            for i in range(n)]
    die = ["--test-die-at", f"{KILL_SESSION}:1:{KILL_PROMPT + 1}"]     # position P+1: a draft of the first step
    log.info("gate beta: %s with MTP on its last stage, %d stages (+1 replica of the last)", spec.name, n)
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=300, replicas=[1] * (n - 1) + [2],
                    extra=lambda i, r: die if (i, r) == (n - 1, 0) else []) as route, \
            RouteClient(route.replicas, chunk_tokens=c.parity.chunk_tokens, prefix_cache=False) as client:
        descs = client.describe()
        if not descs[-1].has_mtp:
            raise DgrError(f"{spec.name}: the last stage of the include_mtp bundle {b.root} has no MTP block")
        identity = checked_identity(b, descs, lane, lib, lc.blake3)
        prompts = parity_prompts(c, client.tokenize, descs[0].n_vocab)
        figures = _on_equals_off(client, prompts, m.draft_k, c.parity.max_new_tokens)
        # the prefix cache with MTP drafting (refused where a stage keeps no prefixes: DeepSeek V4 today)
        figures.append(prefix_cache_row(client, descs, max(prompts, key=len), None, c.parity.max_new_tokens,
                                        speculate="mtp", draft_k=m.draft_k))
        if soak:
            figures.append(_soak(route, route.addresses, m.soak, m.draft_k))
        figures.append(_kill_mid_draft(route, client, m.draft_k, c.parity.max_new_tokens))
    return _certificate(lc, b, identity, figures)


def certify_speculation(lc: LoadedContract, *, lane: str, lib: Path, root: Path) -> Certificate:
    """Tokens per trip with good drafts and the rejected-draft cost (dgr.app.bench.speculate_mtp), one certificate."""
    s, k = lc.contract.mtp.speculation, lc.contract.mtp.draft_k
    prompt = np.random.default_rng(7).integers(3, 250, size=32).tolist()
    got, identity, first = {}, None, None
    for rate in (s.agree, 0.0):
        b = speculate_mtp.mtp_bundle(speculate_mtp.source(root / "mtp", rate), s.stages, root / "mtp")
        first = first or b
        args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1"] for i in range(s.stages)]
        with LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=300) as route, \
                RouteClient(route.addresses, prefix_cache=False) as client:
            if identity is None:
                identity = checked_identity(b, client.describe(), lane, lib, lc.blake3)
            got[rate] = speculate_mtp.mode_rows(client, prompt, tokens=s.tokens, rounds=s.rounds, k=k,
                                                modes=("none", "mtp"), label=f"gate beta, agree {rate:g},")
    good, bad = got[s.agree], got[0.0]
    cost = bad["mtp"]["tpot_ms"] / bad["none"]["tpot_ms"] if bad["none"]["tpot_ms"] else float("inf")
    how = f"{s.stages} stages on loopback, k={k}, {s.rounds} rounds of {s.tokens} greedy tokens, medians"
    figures = [
        Figure(check=f"MTP tokens per ring trip (drafts agreeing at {s.agree:g})", figure=good["mtp"]["tokens_per_ring"],
               threshold=f">= {s.tokens_per_trip_min:g}, same text",
               passed=good["mtp"]["tokens_per_ring"] >= s.tokens_per_trip_min and good["mtp"]["same_text"],
               detail=f"{good['mtp']['accepted']}/{good['mtp']['drafted']} drafts accepted; TPOT "
                      f"{good['mtp']['tpot_ms']:.2f} ms with MTP, {good['none']['tpot_ms']:.2f} without; {how}"),
        Figure(check="rejected-draft cost (TPOT with MTP / without, no draft accepted)", figure=cost,
               threshold=f"<= {s.rejected_cost_max:g}, same text",
               passed=cost <= s.rejected_cost_max and bad["mtp"]["accepted"] == 0 and bad["mtp"]["drafted"] > 0
               and bad["mtp"]["same_text"],
               detail=f"{bad['mtp']['drafted']} drafts sent, {bad['mtp']['accepted']} accepted; TPOT "
                      f"{bad['mtp']['tpot_ms']:.2f} ms with MTP, {bad['none']['tpot_ms']:.2f} without; {how}"),
    ]
    return _certificate(lc, first, identity, figures)


__all__ = ["certify_mtp", "certify_speculation"]
