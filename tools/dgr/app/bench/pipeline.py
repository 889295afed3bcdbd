"""`dgr bench`: the whole model and the pipeline side by side, on one bundle, one machine, in one run.

The whole model runs in this process on the engine (the same compute threads as each stage); the
pipeline runs in real `dgr worker serve` processes on loopback (`LocalRoute`). Rounds alternate between
the two so both see the same machine load. Measured: prefill tok/s at several prompt lengths (both
sides prefill in the route's chunks: one schedule), decode tok/s, the per-hop overhead (ring time minus
compute per boundary, from the per-token timings every worker adds), where a decode token's time goes
per stage, the bytes on the route's sockets per decode token (the kernel's TCP counters, `ss`), and the
aggregate decode tok/s of M concurrent sessions against one. The report is a plain dict (the JSON).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dgr.app.bench.loopback_floor import MESSAGES_PER_ROUND as FLOOR_MESSAGES, one_way_ms
from dgr.app.demo import ensure_bundle, long_prompt, whole_model_run
from dgr.app.local import LocalRoute, engine_library
from dgr.core.constants import DEFAULT_N_CTX
from dgr.core.errors import DgrError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.runtime.engine import Engine
from dgr.runtime.engine_abi import build_numerics
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.codec import DTYPE_NAMES
from dgr.runtime.wire.stats import concurrent_decode_tokens_per_s, decode_events
from dgr.toolchain.bundle import build, load_bundle
from dgr.toolchain.parity import bundle_source
from dgr.toolchain.synth.generic import layer_kinds
from dgr.toolchain.synth.parity import EMBD, check_arch, choose_ranges, model_layers, synth_model

log = get_logger(__name__)

PROMPT = "The capital of France is"
SESSION_PROMPTS = ("The capital of France is", "Once upon a time, in a village by the sea,",
                   "The three laws of thermodynamics are", "def fibonacci(n):")
PROMPT_LENGTHS = (32, 128, 256)


@dataclass
class Setup:
    """What one bench runs: the bundle's stages and its whole source model, on one engine library."""

    bundle: object                       # dgr.toolchain.bundle.Bundle
    source: Path                         # the unsplit GGUF (the whole-model side)
    lib: Path
    threads: int
    label: str                           # what the report calls the model
    synthetic: bool = False              # random weights, no tokenizer: prompts are random token ids
    wire_dtype: str | None = None        # None: the bundle's
    workdir: Path | None = None          # a temporary folder this setup made (synthetic bundles)

    @property
    def stages(self) -> int:
        return len(self.bundle.manifest.stages)


def prepare(*, stages: int | None = None, bundle: str | None = None, source: str | None = None,
            synth: str | None = None, lib: str | None = None, threads: int = 1,
            wire_dtype: str | None = None) -> Setup:
    """Resolve what `dgr bench` runs: `bundle` (a folder), `synth` (a fresh tiny model of that
    architecture split into `stages`), or the embedded SmolLM2 of `stages` (default 3)."""
    if bundle and synth:
        raise DgrError("dgr bench: give --bundle or --synth, not both")
    lib_path = engine_library(lib)
    workdir = None
    if synth:
        b, workdir = synth_bundle(synth, stages or 3)
        label = f"synthetic {synth}"
    elif bundle:
        b = load_bundle(bundle)
        label = b.manifest.recipe.name
    else:
        b, _ = ensure_bundle(stages or 3, progress=False)
        label = b.manifest.recipe.name
    if stages is not None and len(b.manifest.stages) != stages:
        raise DgrError(f"dgr bench: the bundle {b.root} has {len(b.manifest.stages)} stages, not --stages {stages}; "
                       "drop --stages or give a bundle of that many stages")
    return Setup(bundle=b, source=_source_of(b, source), lib=lib_path, threads=max(1, threads), label=label,
                 synthetic=bool(synth), wire_dtype=wire_dtype, workdir=workdir)


def _source_of(b, source: str | None) -> Path:
    try:
        return bundle_source(b, source or None)
    except DgrError as e:
        raise DgrError(f"dgr bench: the whole-model side needs the bundle's source GGUF: {e}") from None


def synth_bundle(arch: str, stages: int):
    """A fresh tiny `arch` model (dgr.toolchain.synth.parity's) split into `stages` across its special layers, as a
    bundle in a temporary folder: (bundle, folder)."""
    check_arch(arch)
    layers = max(model_layers(arch), stages)
    work = Path(tempfile.mkdtemp(prefix=f"dgr-bench-{arch}-"))
    model = synth_model(arch, work / f"{arch}-{layers}L.gguf", layers=layers)
    pairs = ", ".join(f"[{a}, {b}]" for a, b in choose_ranges(layer_kinds(arch, layers, EMBD), stages))
    recipe = work / "recipe.toml"
    recipe.write_text(f'name = "bench-{arch}"\n\n[source]\nuri = "{model}"\nblake3 = "{file_blake3(model)}"\n\n'
                      f"[placement]\nstages = [{pairs}]\n")
    return build(recipe, work / "store"), work


# ---------------------------------------------------------------------------------------------- figures
def pct(xs, q: float) -> float:
    """The q-th percentile (nearest rank) of xs; 0 when empty."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    return float(xs[min(len(xs) - 1, max(0, int(np.ceil(q / 100 * len(xs))) - 1))])


def _med(xs) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else 0.0


def hop_figures(gens, n_stages: int) -> dict:
    """Per boundary and per stage, over every decode token of `gens`: a boundary into stage j costs the
    sender's encode+send, the transit and stage j's queue; the ring's last boundary (last stage -> origin)
    takes the token's return and stage 0's queue for the next step; `origin` is what is left of ring minus
    compute (the origin's own handling between a token's arrival and the next step)."""
    evs = [e for g in gens for e in decode_events(g) if len(e.timings) == n_stages]
    names = [f"{k}->{k + 1}" for k in range(n_stages - 1)] + [f"{n_stages - 1}->origin"]
    per_b: list[list[float]] = [[] for _ in names]
    origin, per_hop, ring, compute, ret = [], [], [], [], []
    stage_parts = [{k: [] for k in ("transit", "queue", "compute", "send")} for _ in range(n_stages)]
    for e in evs:
        t = sorted(e.timings)                           # (stage, transit, queue, compute, send)
        cost = [t[j - 1][4] + t[j][1] + t[j][2] for j in range(1, n_stages)] + [t[-1][4] + e.return_ns + t[0][2]]
        for j, c in enumerate(cost):
            per_b[j].append(c / 1e6)
        over = (e.ring_ns - e.compute_ns) / 1e6
        origin.append(over - sum(cost) / 1e6)
        per_hop.append(over / n_stages)
        ring.append(e.ring_ns / 1e6)
        compute.append(e.compute_ns / 1e6)
        ret.append(e.return_ns / 1e6)
        for j, row in enumerate(t):
            for k, name in enumerate(("transit", "queue", "compute", "send"), start=1):
                stage_parts[j][name].append(row[k] / 1e6)
    return {
        "tokens": len(evs),
        "per_hop_ms": _med(per_hop), "per_hop_p90_ms": pct(per_hop, 90),
        "ring_ms": _med(ring), "compute_ms": _med(compute),
        "boundaries": [{"boundary": n, "median_ms": _med(v), "p90_ms": pct(v, 90)} for n, v in zip(names, per_b)],
        "origin_ms": _med(origin), "return_ms": _med(ret),
        "stages": [{"stage": j, **{k: _med(v) for k, v in parts.items()},
                    "compute_p90": pct(parts["compute"], 90)} for j, parts in enumerate(stage_parts)],
    }


def tcp_bytes(ports: set[int]) -> dict[tuple[int, str], list[int]] | None:
    """Bytes the kernel counted on every established TCP connection served on one of `ports`: (port, the peer's
    address) -> [into that server, out of it]. None when `ss` cannot say. Keyed by connection, because a
    connection can close between two readings (a worker closes a link no open session uses: prune_links) and
    its counts leave with it."""
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    res: dict[tuple[int, str], list[int]] = {}
    conn = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            cols = line.split()
            port = cols[2].rpartition(":")[2] if len(cols) >= 4 else ""
            conn = (int(port), cols[3]) if port.isdigit() and int(port) in ports else None
            continue
        if conn is None:
            continue
        kv = dict(f.split(":", 1) for f in line.split() if f.startswith(("bytes_sent:", "bytes_received:")))
        got = res.setdefault(conn, [0, 0])
        got[0] += int(kv.get("bytes_received", 0))
        got[1] += int(kv.get("bytes_sent", 0))
    return res


def carried(before: dict, after: dict, port: int, k: int) -> int:
    """What the connections served on `port` carried between two readings (direction k: 0 in, 1 out): each one
    open at the second reading, less what it had at the first (0 if it is new). One closed in between took its
    last counts with it: never a negative figure, at worst a few bytes short."""
    return sum(v[k] - before.get(c, [0, 0])[k] for c, v in after.items() if c[0] == port)


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class _Acc:
    gens: list = field(default_factory=list)
    whole_decode: list[float] = field(default_factory=list)
    pipe_decode: list[float] = field(default_factory=list)
    whole_prefill: dict[int, list[float]] = field(default_factory=dict)
    pipe_prefill: dict[int, list[float]] = field(default_factory=dict)
    single: list[float] = field(default_factory=list)
    multi: list[float] = field(default_factory=list)
    multi_unbatched: list[float] = field(default_factory=list)     # same M sessions, --max-batch-sessions 1
    whole_prefill_fast: list[float] = field(default_factory=list)  # longest prompt, llama.cpp's fast kernels
    same: list[bool] = field(default_factory=list)
    floor: list[dict] = field(default_factory=list)   # the loopback floor after each round's ring gap (loopback_floor.py)


def _concurrent(addresses: list[str], prompts: list[list[int]], tokens: int) -> float:
    """Aggregate decode tok/s of len(prompts) sessions generating at once, each on its own client, from a common
    start: the tokens that arrived while every one of them was decoding, over that time (prefill left out, as
    llama-batched-bench's S_TG leaves it out: `concurrent_decode_tokens_per_s`)."""
    clients = [RouteClient(addresses, prefix_cache=False) for _ in prompts]
    try:
        for c in clients:
            _ = c.hops                                  # described before the clock starts
        gate = threading.Barrier(len(prompts) + 1)
        out: list = [None] * len(prompts)

        def one(k: int) -> None:
            gate.wait()
            try:
                out[k] = clients[k].run(prompts[k], max_new_tokens=tokens, stop_token_ids=[])
            except Exception as e:                      # noqa: BLE001 - re-raised below, in this thread
                out[k] = e

        ts = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(prompts))]
        for t in ts:
            t.start()
        gate.wait()
        for t in ts:
            t.join()
    finally:
        for c in clients:
            c.close()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return concurrent_decode_tokens_per_s(out)


def run_bench(setup: Setup, *, tokens: int = 64, prompt_lengths=PROMPT_LENGTHS, sessions: int = 4,
              rounds: int = 3, n_ctx: int | None = None, kernels: str = "reference") -> dict:
    """Measure `setup` (see the module docstring); progress goes to the log (stderr). `n_ctx`: positions per
    session (default: DEFAULT_N_CTX, or what the run needs on a synthetic model)."""
    S, lengths = setup.stages, sorted(set(int(n) for n in prompt_lengths))
    need = max(lengths) + tokens + 8
    if n_ctx is not None and n_ctx < need:
        raise DgrError(f"dgr bench: --n-ctx {n_ctx} is less than the {need} positions the longest prompt and "
                       f"--tokens need; give at least {need}")
    n_ctx = n_ctx or max(need, 512 if setup.synthetic else DEFAULT_N_CTX)
    # KV for what the bench runs, not a server's default: each worker and engine allocates n_ctx cells per
    # session it may hold, which at 7B size (16 KiB per cell and layer) and 8 sessions outgrew this machine's memory
    max_sessions = sessions + 2                         # the concurrent sessions, the single one, one closing
    args = [["--bundle", str(setup.bundle.root), "--stage", str(i), "--threads", str(setup.threads),
             "--n-ctx", str(n_ctx), "--max-sessions", str(max_sessions), "--kernels", kernels,
             *(["--wire-dtype", setup.wire_dtype] if setup.wire_dtype else [])]
            for i in range(S)]
    acc = _Acc()
    log.info("bench: %s, %d stages in worker processes (%d thread(s) each) vs the whole model in this process",
             setup.label, S, setup.threads)
    t_start = time.perf_counter()
    # the cost of batch invariance: the same route with no forward shared (--max-batch-sessions 1)
    unbatched = LocalRoute([[*a, "--max-batch-sessions", "1"] for a in args],
                           env={"DGR_ENGINE_LIB": str(setup.lib)}, timeout=300) if sessions > 1 else None
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(setup.lib)}, timeout=300) as route, \
            RouteClient(route.addresses, prefix_cache=False) as c, (unbatched or contextlib.nullcontext()):
        hops = c.hops
        chunk = c.chunk_tokens
        n_vocab = max(d.n_vocab for d in hops)
        rng = np.random.default_rng(3)
        if setup.synthetic:                             # random weights: any token ids will do
            def ids_of(n, _k=0):
                return rng.integers(0, min(n_vocab, 256), size=n).tolist()
            decode_ids = ids_of(6)
            session_ids = [ids_of(6) for _ in range(sessions)]
        else:
            def ids_of(n, _k=0):
                return long_prompt(c.tokenize, n)
            decode_ids = c.tokenize(PROMPT)
            session_ids = [c.tokenize(SESSION_PROMPTS[k % len(SESSION_PROMPTS)]) for k in range(sessions)]
        long_ids = {n: ids_of(n) for n in lengths}
        # one session at a time on the whole-model side
        whole = Engine.open(setup.source, lib=setup.lib, n_threads=setup.threads, n_ctx=n_ctx, max_sessions=1,
                            kernels=kernels)
        fast = Engine.open(setup.source, lib=setup.lib, n_threads=setup.threads, n_ctx=n_ctx, max_sessions=1,
                           fast_kernels=True)
        try:
            log.info("bench: warming up both sides")
            c.run(decode_ids, max_new_tokens=4, stop_token_ids=[])
            whole_model_run(whole, decode_ids, 4, chunk_tokens=chunk)
            # per stage (stage order), the ports it serves
            ports = [[int(a.rpartition(":")[2])] for a in route.addresses]
            wire = _wire_bytes(c, decode_ids, tokens, ports)
            for r in range(rounds):
                toks = {}
                for side in (("pipe", "whole") if r % 2 == 0 else ("whole", "pipe")):
                    if side == "pipe":
                        g = c.run(decode_ids, max_new_tokens=tokens, stop_token_ids=[])
                        acc.gens.append(g)
                        acc.pipe_decode.append(g.decode_tokens_per_s)
                        # the floor under the per-hop figure, after the same idle: this round's ring time
                        acc.floor.append(one_way_ms(_med(e.ring_ns / 1e6 for e in decode_events(g)), FLOOR_MESSAGES))
                        toks[side] = g.token_ids
                        for n, ids in long_ids.items():
                            acc.pipe_prefill.setdefault(n, []).append(
                                c.run(ids, max_new_tokens=1, stop_token_ids=[]).prefill_tokens_per_s)
                    else:
                        w = whole_model_run(whole, decode_ids, tokens, chunk_tokens=chunk)
                        acc.whole_decode.append(w.decode_tokens_per_s)
                        toks[side] = w.token_ids
                        for n, ids in long_ids.items():
                            acc.whole_prefill.setdefault(n, []).append(
                                whole_model_run(whole, ids, 1, chunk_tokens=chunk).prefill_tokens_per_s)
                        acc.whole_prefill_fast.append(whole_model_run(fast, long_ids[lengths[-1]], 1,
                                                                      chunk_tokens=chunk).prefill_tokens_per_s)
                acc.same.append(toks["pipe"] == toks["whole"])
                if sessions > 1:
                    acc.single.append(_concurrent(route.addresses, session_ids[:1], tokens))
                    acc.multi.append(_concurrent(route.addresses, session_ids, tokens))
                    acc.multi_unbatched.append(_concurrent(unbatched.addresses, session_ids, tokens))
                log.info("bench: round %d/%d: decode whole %.1f / pipeline %.1f tok/s; prefill %d: whole %.1f / "
                         "pipeline %.1f tok/s%s", r + 1, rounds, acc.whole_decode[-1], acc.pipe_decode[-1],
                         lengths[-1], acc.whole_prefill[lengths[-1]][-1], acc.pipe_prefill[lengths[-1]][-1],
                         f"; {sessions} sessions {acc.multi[-1]:.1f} vs one {acc.single[-1]:.1f} tok/s"
                         if acc.multi else "")
        finally:
            whole.close()
            fast.close()
        dtype = next((d.schema_out for d in hops if d.HasField("schema_out")), None)
        payload = [int(d.seam_bytes_per_token) for d in hops[:-1]]
    return _report(setup, acc, lengths, tokens, rounds, sessions, chunk, wire, payload, dtype,
                   time.perf_counter() - t_start, kv={"n_ctx": n_ctx, "max_sessions": max_sessions,
                                                      "kernels": kernels})


def _wire_bytes(c, ids: list[int], tokens: int, ports: list[list[int]]) -> dict | None:
    """Socket bytes per decode token: a run of 1 + `tokens` tokens minus a run of 1, same prompt;
    per stage (`ports[j]`: the ports stage j serves, stage order): the bytes into it and out of it on the
    connections it serves."""
    every = {p for ps in ports for p in ps}
    b0 = tcp_bytes(every)
    c.run(ids, max_new_tokens=1, stop_token_ids=[])
    b1 = tcp_bytes(every)
    c.run(ids, max_new_tokens=1 + tokens, stop_token_ids=[])
    b2 = tcp_bytes(every)
    if b0 is None or b1 is None or b2 is None:
        return None
    per = [[sum(carried(b1, b2, p, k) - carried(b0, b1, p, k) for p in ps) / tokens for k in (0, 1)]
           for ps in ports]
    return {"into_stage": [round(v[0], 1) for v in per],
            "out_of_stage": [round(v[1], 1) for v in per],
            "total": round(sum(sum(v) for v in per), 1)}


def _ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num[r] / den[r]."""
    return _med(a / b for a, b in zip(num, den) if b)


def rounded(obj, digits: int = 4):
    """`obj` with every float rounded (the JSON a person reads; the clocks are not finer than that)."""
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def _report(setup: Setup, acc: _Acc, lengths, tokens, rounds, sessions, chunk, wire, payload, dtype,
            seconds: float, kv: dict) -> dict:
    S = setup.stages
    hop = hop_figures(acc.gens, S)
    whole_pf = {str(n): _med(acc.whole_prefill[n]) for n in lengths}
    pipe_pf = {str(n): _med(acc.pipe_prefill[n]) for n in lengths}
    wd, pd, top = _med(acc.whole_decode), _med(acc.pipe_decode), str(lengths[-1])
    return rounded({
        "bench": {"model": setup.label, "bundle": str(setup.bundle.root), "bundle_id": setup.bundle.id,
                  "arch": setup.bundle.manifest.model.arch, "stages": S, "threads": setup.threads,
                  "engine_lib": str(setup.lib), "numerics": build_numerics(setup.lib),
                  "tokens": tokens, "prompt_lengths": list(lengths),
                  "rounds": rounds, "chunk_tokens": chunk, "cpus": os.cpu_count(), "seconds": round(seconds, 1),
                  "worker": "dgr-worker", **kv,
                  "wire_dtype": DTYPE_NAMES.get(dtype.dtype) if dtype is not None else None},
        "whole": {"decode_tok_s": wd, "prefill_tok_s": whole_pf[top], "prefill_tok_s_by_len": whole_pf,
                  "decode_ms_per_token": 1e3 / wd if wd else 0.0},
        "pipeline": {"decode_tok_s": pd, "prefill_tok_s": pipe_pf[top], "prefill_tok_s_by_len": pipe_pf,
                     "per_hop_ms": hop["per_hop_ms"], "per_hop_p90_ms": hop["per_hop_p90_ms"],
                     "ring_ms": hop["ring_ms"], "compute_ms": hop["compute_ms"], "origin_ms": hop["origin_ms"],
                     "return_ms": hop["return_ms"],
                     "boundaries": hop["boundaries"], "stages": hop["stages"], "decode_tokens_timed": hop["tokens"],
                     "wire_bytes_per_token": wire["total"] if wire else sum(payload),
                     "same_tokens_as_whole": all(acc.same)},
        "wire": {"payload_bytes_per_token_per_seam": payload, "payload_bytes_per_token": sum(payload),
                 "socket_bytes_per_token": wire,
                 "how": "socket bytes: the kernel's TCP counters (ss) on the route's connections, a run of "
                        "1+N tokens minus a run of 1; payload: the boundary values each seam carries"},
        # paired: each round's pipeline over the same round's whole model (neighbours in time share the
        # machine's load), the median over rounds
        "ratios": {"decode": _ratio(acc.pipe_decode, acc.whole_decode),
                   "prefill": _ratio(acc.pipe_prefill[lengths[-1]], acc.whole_prefill[lengths[-1]]),
                   "prefill_by_len": {str(n): _ratio(acc.pipe_prefill[n], acc.whole_prefill[n]) for n in lengths}},
        "rounds": {"whole_decode_tok_s": acc.whole_decode, "pipeline_decode_tok_s": acc.pipe_decode,
                   "whole_prefill_tok_s": {str(n): v for n, v in acc.whole_prefill.items()},
                   "pipeline_prefill_tok_s": {str(n): v for n, v in acc.pipe_prefill.items()},
                   "single_tok_s": acc.single, "aggregate_tok_s": acc.multi},
        "sessions": {"m": sessions, "single_tok_s": _med(acc.single), "aggregate_tok_s": _med(acc.multi),
                     "aggregate_over_single": _ratio(acc.multi, acc.single),
                     "unbatched_aggregate_tok_s": _med(acc.multi_unbatched),
                     "batched_over_unbatched": _ratio(acc.multi, acc.multi_unbatched),
                     "how": "M sessions started at once: the tokens that arrived while all of them were decoding, over that "
                            "time (prefill left out, as llama-batched-bench's S_TG); "
                            "unbatched: the same bundle with --max-batch-sessions 1 (no forward shared)"},
        # what no worker can beat: one bare loopback message between two processes after the ring's idle
        "floor": {"gap_ms": _med(f["gap_ms"] for f in acc.floor), "one_way_ms": _med(f["one_way_ms"] for f in acc.floor),
                  "one_way_p90_ms": _med(f["one_way_p90_ms"] for f in acc.floor),
                  "per_hop_over_floor": _ratio([hop["per_hop_ms"]], [_med(f["one_way_ms"] for f in acc.floor)]),
                  "how": f"each round, {FLOOR_MESSAGES} 8-byte TCP loopback messages between two Python processes, "
                         "each sent after an idle gap of the round's median ring time (dgr.app.bench.loopback_floor)"},
        # what batch invariance costs: batching stays (its sessions are exact), the CPU backend runs its
        # reference kernels; the whole model's prefill of the longest prompt with llama.cpp's fast ones
        "invariance": {"prefill_len": lengths[-1], "whole_prefill_tok_s": _med(acc.whole_prefill[lengths[-1]]),
                       "whole_prefill_fast_kernels_tok_s": _med(acc.whole_prefill_fast),
                       "reference_over_fast": _ratio(acc.whole_prefill[lengths[-1]], acc.whole_prefill_fast),
                       "how": "the same whole model, alternating, the run's kernels (bench.kernels: reference or "
                              "invariant, both batch invariant) against fast_kernels (results depend on the batch)"},
    })


__all__ = ["PROMPT_LENGTHS", "Setup", "carried", "hop_figures", "pct", "prepare", "rounded", "run_bench", "synth_bundle",
           "tcp_bytes"]
