"""What each wire dtype costs and loses, measured per architecture: docs/wire-dtypes.md and its JSON.

For every architecture `dgr synth --list` names (a fresh tiny random-weight model, cut at its layer
kinds as dgr.toolchain.synth.parity cuts it for 3 stages) and for SmolLM2-135M (the 3-stage recipe's cuts, four
prompts), the split runs in one process, every boundary encoded and decoded by dgr.runtime.wire.codec in the
dtype under test (dgr.toolchain.parity.run_pipeline's `boundary_transform`), each prompt one session, every dtype
in the same batches as f32's run:

- *free run*: each session decodes `steps` greedy tokens of its own; `top1_agree` is the fraction of the
  tokens chosen by those steps that equal f32's at the same index (what a user sees: the same text or
  not), `first_divergence` the earliest differing token, `texts_kept` the prompts that never differ.
- *forced run*: the sessions are fed f32's tokens, so each position has the same context in every
  dtype; there: `top1_agree_forced` (argmax equal), max and mean |logit difference|, and
  KL(f32 || dtype) of the softmaxes, nats, mean over the positions.

f32 is the reference (exact by construction: the codec's f32 round trip is bit for bit). `dgr bench
--dtypes` calls `run_dtype_table`; `dgr.toolchain.recipe.boundary_dtype_warning` reads the JSON it writes.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dgr.app.demo import source_gguf
from dgr.core.contract import DEFAULT_WIRE_DTYPE, WIRE_DTYPES
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.core.paths import REPO_ROOT
from dgr.runtime.engine import Engine
from dgr.runtime.wire import codec
from dgr.toolchain.parity import Schedule, ctx_for, open_stages, run_pipeline
from dgr.toolchain.recipe import POOR_AGREEMENT, WIRE_DTYPE_TABLE, load_recipe
from dgr.toolchain.synth.generic import known_archs, layer_kinds
from dgr.toolchain.synth.parity import EMBD, OWN_SCHEDULES, SEED, check_arch, choose_ranges, model_layers, synth_model

log = get_logger(__name__)

DTYPES = tuple(WIRE_DTYPES)
STEPS = 256                 # greedy tokens per dtype (the loss is measured over 256 greedy tokens)
N_STAGES = 3                # cuts per model: 2 seams, every boundary through the codec twice per token
PROMPT_LEN = 41             # random token ids for the tiny models (dgr.toolchain.synth.parity's first prompt)
SMOLLM2_RECIPE = "smollm2-135m-3stage"
SMOLLM2_PROMPTS = (         # prose, a fact, an instruction, code: one session each
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
    "The three primary colors are",
    "Write a short story about a robot who learns to paint.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)
DEFAULT_OUT = WIRE_DTYPE_TABLE.with_suffix(".md")   # docs/wire-dtypes.md of the checkout


@dataclass
class DtypeRow:
    arch: str                       # the GGUF architecture (what a recipe's model says)
    model: str                      # "synth" (tiny random weights) or the real model's name
    dtype: str
    values_per_token: int
    bytes_per_token: int            # one seam, one token, in this dtype
    bytes_vs_f32: float
    top1_agree: float               # free run: own greedy tokens vs f32's, over every prompt
    first_divergence: int | None    # the earliest differing token of any prompt (None: none differed)
    texts_kept: int                 # prompts whose every greedy token equals f32's
    prompts: int
    top1_agree_forced: float        # forced run: argmax equal at the same context
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    kl_mean: float                  # KL(f32 || dtype), nats, mean over positions
    steps: int
    seconds: float


def _codec_transform(code: int, nbytes: list[int]):
    """The boundary_transform: every boundary through wire dtype `code` (encode, then decode); the
    bytes one decode token took on the wire land in nbytes[0]."""
    def transform(stage: int, session: int, b: np.ndarray) -> np.ndarray:
        enc = codec.encode(b, code)
        if b.shape[0] == 1:
            nbytes[0] = len(enc.data)
        return codec.decode(enc)

    return transform


def _compare(ref: np.ndarray, got: np.ndarray, chunk: int = 64) -> tuple[float, float, float, float]:
    """(argmax agreement, max |diff|, mean |diff|, mean KL(ref || got)) over the rows of two logit arrays.
    KL from the difference itself, in float64 (a tiny model's KL is ~1e-9: float32 log-probabilities
    would drown it), a few rows at a time (a real vocabulary's rows are large)."""
    agree = dmax = dsum = klsum = 0.0
    for lo in range(0, ref.shape[0], chunk):
        x, y = ref[lo:lo + chunk].astype(np.float64), got[lo:lo + chunk].astype(np.float64)
        d = x - y
        mx, my = x.max(axis=-1, keepdims=True), y.max(axis=-1, keepdims=True)
        ex = np.exp(x - mx)
        lse_x = mx + np.log(ex.sum(axis=-1, keepdims=True))
        lse_y = my + np.log(np.exp(y - my).sum(axis=-1, keepdims=True))
        p = ex / ex.sum(axis=-1, keepdims=True)
        klsum += float((p * (d - (lse_x - lse_y))).sum())       # sum p (log p - log q), per row, summed
        agree += float((x.argmax(axis=-1) == y.argmax(axis=-1)).sum())
        ad = np.abs(d)
        dmax, dsum = max(dmax, float(ad.max())), dsum + float(ad.sum())
    n = ref.shape[0]
    return agree / n, dmax, dsum / ref.size, max(0.0, klsum / n)


def _nudge(stage: int, session: int, b: np.ndarray) -> np.ndarray:
    """Every other value one float32 ulp up: a change smaller than any dtype's (the noise floor)."""
    out = b.copy()
    flat = out.reshape(-1)
    flat[::2] = np.nextafter(flat[::2], np.float32(np.inf))
    return out


def measure_model(model: Path, ranges: list[tuple[int, int]], prompts: list[list[int]], *, arch: str, name: str,
                  dtypes=DTYPES, steps: int = STEPS, lib=None, n_threads: int = 1, n_ubatch: int = 512,
                  floor: dict | None = None) -> list[DtypeRow]:
    """One row per dtype for `model` split at `ranges`, each prompt a session of every run. Each dtype's
    run has the batches of f32's run (the same sessions in the same rows), so up to a first changed
    token the codec is the only difference; sessions are never compared with each other inside one
    batch (an MoE kernel's result for a row depends on the batch's other rows). `floor`, a dict, gets
    the noise floor's numbers (`_nudge` in place of a codec, fed f32's tokens)."""
    dtypes = list(dict.fromkeys(["f32", *dtypes]))     # f32 first: the reference
    n = len(prompts)
    engines = open_stages([model] * len(ranges), ranges=ranges, n_ubatch=n_ubatch, n_ctx=ctx_for(prompts, steps),
                          max_sessions=n, lib=lib, n_threads=n_threads)
    rows = []
    try:
        info = engines[0].describe()
        width = info.n_streams * info.n_embd
        for d in dtypes:
            try:
                WIRE_DTYPES[d].check(width)
            except ValueError as e:
                raise DgrError(f"{name} ({arch}): {e}") from None
        base = ref = f32_bytes = None
        for d in dtypes:
            t0 = time.perf_counter()
            nbytes = [0]
            transform = _codec_transform(codec.dtype_code(d), nbytes)
            free = run_pipeline(engines, Schedule(prompts=prompts, steps=steps, n_ubatch=n_ubatch),
                                boundary_transform=transform)
            tokens = np.array(free.generated)                  # [sessions, steps + 1]
            if base is None:
                base, ref, f32_bytes = tokens, np.concatenate(free.decode_logits), nbytes[0]
            same = tokens == base
            logits = np.concatenate(free.decode_logits)
            if not same[:, :steps].all():       # fed other tokens somewhere: rerun on f32's, same contexts
                logits = np.concatenate(run_pipeline(
                    engines, Schedule(prompts=prompts, steps=steps, n_ubatch=n_ubatch,
                                      forced=base[:, :steps].tolist()), boundary_transform=transform).decode_logits)
            firsts = [int(np.argmin(row)) for row in same if not row.all()]
            agree_f, dmax, dmean, kl = _compare(ref, logits)
            rows.append(DtypeRow(arch=arch, model=name, dtype=d, values_per_token=width,
                                 bytes_per_token=nbytes[0], bytes_vs_f32=nbytes[0] / f32_bytes,
                                 top1_agree=float(same[:, 1:].mean()), first_divergence=min(firsts, default=None),
                                 texts_kept=n - len(firsts), prompts=n, top1_agree_forced=agree_f,
                                 max_abs_logit_diff=dmax, mean_abs_logit_diff=dmean, kl_mean=kl, steps=steps,
                                 seconds=time.perf_counter() - t0))
        if floor is not None:               # the same two runs with _nudge for a codec
            free = run_pipeline(engines, Schedule(prompts=prompts, steps=steps, n_ubatch=n_ubatch),
                                boundary_transform=_nudge)
            same = np.array(free.generated) == base
            nudged = run_pipeline(engines, Schedule(prompts=prompts, steps=steps, n_ubatch=n_ubatch,
                                                    forced=base[:, :steps].tolist()), boundary_transform=_nudge)
            agree_f, dmax, dmean, kl = _compare(ref, np.concatenate(nudged.decode_logits))
            firsts = [int(np.argmin(row)) for row in same if not row.all()]
            floor.update(top1_agree=float(same[:, 1:].mean()), texts_kept=n - len(firsts), prompts=n,
                         first_divergence=min(firsts, default=None), top1_agree_forced=agree_f,
                         max_abs_logit_diff=dmax, mean_abs_logit_diff=dmean, kl_mean=kl)
    finally:
        for e in engines:
            e.close()
    return rows


def synth_case(arch: str, workdir: Path) -> tuple[Path, list[tuple[int, int]], list[list[int]], int]:
    """(model, ranges, prompts, n_ubatch) of a fresh tiny `arch` model, cut as dgr.toolchain.synth.parity cuts it: one
    prompt of random ids (more would share batches, where an MoE kernel lets sessions touch)."""
    layers = model_layers(arch)
    ranges = choose_ranges(layer_kinds(arch, layers, EMBD), N_STAGES)
    model = synth_model(arch, Path(workdir) / f"{arch}-{layers}L-s{SEED}.gguf", layers=layers, seed=SEED)
    lengths, n_ubatch = OWN_SCHEDULES.get(arch, ((PROMPT_LEN,), 512))
    prompt = np.random.default_rng(3).integers(0, 256, size=lengths[0]).tolist()
    return model, ranges, [prompt], n_ubatch


def smollm2_case(lib=None) -> tuple[Path, list[tuple[int, int]], list[list[int]], str]:
    """(model, ranges, prompts, arch) of SmolLM2-135M as the 3-stage recipe cuts it."""
    recipe = load_recipe(REPO_ROOT / "recipes" / SMOLLM2_RECIPE / "recipe.toml")
    model = source_gguf(recipe)
    eng = Engine.open(model, n_ctx=64, max_sessions=1, lib=lib)
    try:
        prompts, arch = [eng.tokenize(t, add_special=True) for t in SMOLLM2_PROMPTS], eng.describe().arch
    finally:
        eng.close()
    return model, [tuple(r) for r in recipe.recipe.placement.stages], prompts, arch


def run_dtype_table(archs=None, dtypes=DTYPES, steps: int = STEPS, lib=None, smollm2: bool = True,
                    out: Path | None = DEFAULT_OUT, *, json_out: Path | None = None,
                    n_threads: int = 1) -> list[dict]:
    """Measure every dtype on every architecture (default: all of `dgr synth --list`) and SmolLM2;
    write the markdown table to `out` and its data to `json_out` (default: beside `out`, .json)."""
    if steps < 1:
        raise DgrError(f"the dtype table needs at least one decode step, got {steps}")
    for d in dtypes:
        if d not in WIRE_DTYPES:
            raise DgrError(f"unknown wire dtype {d!r}; use any of {', '.join(WIRE_DTYPES)}")
    archs = list(known_archs() if archs is None else archs)
    for a in archs:
        check_arch(a)
    t0 = time.perf_counter()
    rows: list[DtypeRow] = []
    floors: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="dgr-dtypes-") as tmp:
        for i, arch in enumerate(archs):
            model, ranges, prompts, n_ubatch = synth_case(arch, Path(tmp))
            got = measure_model(model, ranges, prompts, arch=arch, name="synth", dtypes=dtypes, steps=steps,
                                lib=lib, n_threads=n_threads, n_ubatch=n_ubatch)
            model.unlink()
            rows += got
            log.info("dtypes: [%d/%d] %s: %s (%.1f s)", i + 1, len(archs), arch,
                     " ".join(f"{r.dtype} {r.top1_agree:.2f}" for r in got), sum(r.seconds for r in got))
    if smollm2:
        model, ranges, prompts, arch = smollm2_case(lib)
        floors["SmolLM2-135M"] = {}
        got = measure_model(model, ranges, prompts, arch=arch, name="SmolLM2-135M", dtypes=dtypes, steps=steps,
                            lib=lib, n_threads=n_threads, floor=floors["SmolLM2-135M"])
        rows += got
        log.info("dtypes: SmolLM2-135M: %s (%.1f s); one ulp: KL %.2g", " ".join(
            f"{r.dtype} {r.top1_agree:.2f}" for r in got), sum(r.seconds for r in got),
            floors["SmolLM2-135M"]["kl_mean"])
    seconds = time.perf_counter() - t0
    data = [asdict(r) for r in rows]
    if out is not None:
        out = Path(out)
        json_out = Path(json_out) if json_out else out.with_suffix(".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"steps": steps, "stages": N_STAGES, "seconds": round(seconds, 1),
                                        "poor_agreement": POOR_AGREEMENT, "one_ulp": floors, "rows": data},
                                       indent=1) + "\n")
        write_markdown(json_out, out)
    return data


def write_markdown(json_path: Path = WIRE_DTYPE_TABLE, out: Path = DEFAULT_OUT) -> Path:
    """docs/wire-dtypes.md from the JSON `run_dtype_table` wrote (the one source of both)."""
    d = json.loads(Path(json_path).read_text())
    rows = [DtypeRow(**r) for r in d["rows"]]
    Path(out).write_text(render_markdown(rows, d["seconds"], Path(json_path).name, d.get("one_ulp", {})))
    return Path(out)


# ------------------------------------------------------------------ the document

TABLE_HEAD = ("| architecture | model | dtype | bytes/token | vs f32 | top-1 agree | texts kept | first diverging | "
              "top-1 forced | max abs logit diff | mean abs logit diff | KL (nats) |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def table_row(r: DtypeRow) -> str:
    first = "-" if r.first_divergence is None else str(r.first_divergence)
    return (f"| {r.arch} | {r.model} | {r.dtype} | {r.bytes_per_token} | {r.bytes_vs_f32:.3f} | {r.top1_agree:.3f} | "
            f"{r.texts_kept}/{r.prompts} | {first} | {r.top1_agree_forced:.3f} | {r.max_abs_logit_diff:.3g} | "
            f"{r.mean_abs_logit_diff:.3g} | {r.kl_mean:.3g} |\n")


def summary(rows: list[DtypeRow]) -> dict[str, dict]:
    """Per dtype, over the tiny models and over the real ones: agreement (median, worst), poor rows."""
    out: dict[str, dict] = {}
    for d in dict.fromkeys(r.dtype for r in rows):
        rs = [r for r in rows if r.dtype == d]
        synth = [r for r in rs if r.model == "synth"]
        real = [r for r in rs if r.model != "synth"]
        agree = np.array([r.top1_agree for r in synth] or [np.nan])
        out[d] = {"bytes_vs_f32": max(r.bytes_vs_f32 for r in rs),
                  "synth_rows": len(synth), "synth_poor": sum(r.top1_agree < POOR_AGREEMENT for r in synth),
                  "synth_median_agree": float(np.median(agree)), "synth_worst_agree": float(agree.min()),
                  "synth_median_forced": float(np.median([r.top1_agree_forced for r in synth] or [np.nan])),
                  "synth_median_kl": float(np.median([r.kl_mean for r in synth] or [np.nan])),
                  "real": {r.model: {"top1_agree": r.top1_agree, "kl_mean": r.kl_mean, "texts_kept": r.texts_kept,
                                     "prompts": r.prompts, "first_divergence": r.first_divergence,
                                     "max_abs_logit_diff": r.max_abs_logit_diff} for r in real}}
    return out


def _default_text(s: dict[str, dict], floors: dict[str, dict]) -> str:
    """Which recipe default the numbers support, and why (the default itself lives in dgr.core.contract)."""
    lossy = [d for d in s if not WIRE_DTYPES[d].lossless]
    safe = [d for d in lossy if s[d]["synth_poor"] == 0
            and all(v["top1_agree"] >= POOR_AGREEMENT for v in s[d]["real"].values())]
    lines = [f"The recipe default (`dgr.core.contract.DEFAULT_WIRE_DTYPE`) is **{DEFAULT_WIRE_DTYPE}**. "]
    for d in lossy:
        real = "; ".join(f"{m}: {v['top1_agree']:.1%} of the greedy tokens, {v['texts_kept']} of {v['prompts']} "
                         f"texts whole{'' if v['first_divergence'] is None else ' (first change at token %d)' % v['first_divergence']}, "
                         f"KL {v['kl_mean']:.2g}" for m, v in s[d]["real"].items()) or "no real model measured"
        lines.append(f"- {d} ({s[d]['bytes_vs_f32']:.3f} of f32's bytes): {real}; tiny models: greedy tokens "
                     f"under {POOR_AGREEMENT:.0%} agreement on {s[d]['synth_poor']} of {s[d]['synth_rows']} "
                     f"architectures (median {s[d]['synth_median_agree']:.0%}, top-1 at the same context "
                     f"{s[d]['synth_median_forced']:.1%}).")
    if safe:
        best = min(safe, key=lambda d: s[d]["bytes_vs_f32"])
        lines.append(f"\n{best} kept the greedy tokens on every architecture measured: it could be the default "
                     f"at {s[best]['bytes_vs_f32']:.3f} of the bytes (a change to dgr.core.contract, weighed against "
                     f"exact parity).")
    else:
        real = {m for d in lossy for m in s[d]["real"]}
        kept = "; ".join(f"on {m} the best lossy dtype keeps {max(s[d]['real'][m]['texts_kept'] for d in lossy)} of "
                         f"{s[lossy[0]]['real'][m]['prompts']} texts whole" + (
                             f"; a one-ulp change of the boundary keeps {floors[m]['texts_kept']}" if m in floors else "")
                         for m in sorted(real))
        cheap = min(lossy, key=lambda d: s[d]["bytes_vs_f32"])
        lines.append(f"\nNo lossy dtype keeps the greedy text on every architecture measured ({kept or 'no real model'}): "
                     "a lossy boundary changes which of two near-equal tokens wins, and a changed token changes "
                     "every later one. So the default stays f32: exact, the split equal to the whole model bit for "
                     "bit, which every parity check and every greedy text relies on. A lossy dtype is a "
                     f"per-recipe choice for a link where bytes matter more than the same text: {cheap} at "
                     f"{s[cheap]['bytes_vs_f32']:.3f} of f32's bytes is the cheapest, its tokens at the same context "
                     f"still agree {s[cheap]['synth_median_forced']:.0%} (median of the tiny models). `dgr recipe "
                     f"plan` and `dgr recipe build` warn when the measured agreement of the recipe's dtype on its "
                     f"architecture is under {POOR_AGREEMENT:.0%} (a real model's row first, else the tiny model's).")
    return "\n".join(lines) + "\n"


def _floor_text(floors: dict[str, dict[str, float]], rows: list[DtypeRow]) -> str:
    out = []
    for model, f in floors.items():
        mine = [r for r in rows if r.model == model and not WIRE_DTYPES[r.dtype].lossless]
        ratios = ", ".join(f"{r.dtype} {r.kl_mean / f['kl_mean']:.1f}x" for r in mine if f["kl_mean"] > 0)
        out.append(f"The noise floor on {model}: every other boundary value moved up by one float32 ulp (less "
                   f"than any dtype changes) keeps {f['texts_kept']} of {f['prompts']} texts whole "
                   f"({f['top1_agree']:.1%} of the greedy tokens) and, fed f32's tokens, moves the logits by max "
                   f"{f['max_abs_logit_diff']:.3g}, mean {f['mean_abs_logit_diff']:.3g}, KL {f['kl_mean']:.2g} nats, "
                   f"top-1 at the same context {f['top1_agree_forced']:.1%}. Each dtype's KL against that floor's: "
                   f"{ratios}. Its weights are "
                   "quantized and the engine rounds activations to 8 bits before those matmuls, so any change of "
                   "the boundary, however small, flips some of those roundings: a lossy dtype costs about what the "
                   "smallest possible change costs, and changes the greedy text as soon as two tokens are close.")
    return "\n\n".join(out) + ("\n\n" if out else "")


def render_markdown(rows: list[DtypeRow], seconds: float, json_name: str,
                    floors: dict[str, dict[str, float]] | None = None) -> str:
    s = summary(rows)
    archs = sorted({r.arch for r in rows if r.model == "synth"})
    real = sorted({r.model for r in rows if r.model != "synth"})
    dts = list(dict.fromkeys(r.dtype for r in rows))
    steps = rows[0].steps if rows else STEPS
    fmt = "\n".join(f"- **{d}**: {WIRE_DTYPES[d].block_bytes} bytes per {WIRE_DTYPES[d].block} value"
                     f"{'s' if WIRE_DTYPES[d].block > 1 else ''}{' (exact)' if WIRE_DTYPES[d].lossless else ''}"
                     for d in dts)
    return (
        "# Wire dtypes: bytes against loss\n\n"
        "Generated by `dgr bench --dtypes --no-main` (dgr.app.bench.dtypes; do not edit by hand: "
        "`tests/wire/test_dtype_table.py` checks it has a row per architecture of `dgr synth --list` and per dtype). "
        f"The same rows as data: `{json_name}` (what `dgr recipe plan` and `dgr recipe build` check a recipe's "
        "`[boundary] dtype` against).\n\n"
        f"{fmt}\n\n"
        "q8_0 is ggml's Q8_0 block (bit for bit `quantize_row_q8_0_ref`): an f16 scale d = max|x|/127, then 32 int8 "
        "round(x/d), halves away from zero; a block never straddles two tokens, so a boundary's values per token "
        "must be a multiple of 32 (a worker or recipe asking for q8_0 otherwise is refused).\n\n"
        "## How it is measured\n\n"
        f"Each model is split into {N_STAGES} stages in one process and every boundary is encoded and decoded by "
        "`dgr.runtime.wire.codec` in the dtype of the run (dgr.toolchain.parity's `boundary_transform`): the tiny random-weight model "
        "of every architecture `dgr synth --list` names (cut at its layer kinds, as docs/families.md) and "
        f"{', '.join(real) or 'no real model'} (cut as recipes/{SMOLLM2_RECIPE}, {len(SMOLLM2_PROMPTS)} prompts: "
        "prose, a fact, an instruction, code); each prompt is one session, and every dtype runs the batches of "
        f"f32's run. *top-1 agree*: each session decodes {steps} greedy tokens of its own; the fraction equal to "
        "f32's at the same index (*texts kept*: sessions whose every token equals f32's; *first diverging*: the "
        "earliest token that differs in any session, counting the prefill's as 0). The other columns "
        "come from the same run fed f32's tokens (so every position has the same context): *top-1 forced* (argmax "
        "equal), max and mean |logit difference| and KL(f32 || dtype) of the softmaxes in nats, mean over the "
        f"{steps} positions. A tiny random-weight model has nearly flat logits, so one near-tie flips its greedy "
        "text early (its free-running agreement is the worst case, its KL tiny); the real model shows what a user "
        "sees.\n\n"
        f"{len(archs)} tiny architectures + {len(real)} real model, {len(dts)} dtypes, {len(rows)} rows, "
        f"{seconds:.0f} s on this run's machine.\n\n" + _floor_text(floors or {}, rows) +
        "## The recipe default\n\n" + _default_text(s, floors or {}) + "\n"
        "## The table\n\n" + TABLE_HEAD + "".join(table_row(r) for r in rows))


def read_table(path: Path = WIRE_DTYPE_TABLE) -> list[dict]:
    """The rows of the JSON `run_dtype_table` wrote."""
    return json.loads(Path(path).read_text())["rows"]


def parse_markdown(path: Path) -> list[dict[str, str]]:
    """The table rows of a docs/wire-dtypes.md `run_dtype_table` wrote, as {column: cell}."""
    cols = [c.strip() for c in TABLE_HEAD.splitlines()[0].strip("|").split("|")]
    out = []
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(cols) and cells[0] not in ("architecture", "---"):
            out.append(dict(zip(cols, cells)))
    return out
