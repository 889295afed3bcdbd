"""`dgr parity --synth ARCH`: a fresh tiny model of one architecture, split across its special layers, against the whole.

The cuts cross the architecture's own seams: each layer has a kind (sliding-window or global
attention, dense or MoE FFN, attention or recurrent mixer; dgr.toolchain.synth.spec's `kind`) and the cuts go where
the kind changes first, spread over the model, then evenly. Two sessions share every batch, prompts
span several ubatches, then greedy decode steps; the split must equal the whole model bit for bit.
The family suite (tests/families/test_families.py) runs this for every architecture `dgr synth --list` names, and
`--table` writes docs/families.md from such a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dgr.core.errors import DgrError
from dgr.toolchain.parity import Schedule, run_baseline, split_compare
from dgr.toolchain.synth.deepseek4 import synth_deepseek4
from dgr.toolchain.synth.generic import ARCHS, OWN_WRITERS, known_archs, layer_kinds, synth

STAGE_COUNTS = (2, 3, 4)      # what the family suite tries for every architecture
PROMPT_LENGTHS = (41, 29)     # two sessions sharing each batch, both longer than one ubatch
N_UBATCH = 16
STEPS = 4
SEED = 7
EMBD = 64
# deepseek4's compressed attention needs longer prompts to reach its 4x and 128x compressors
OWN_SCHEDULES = {"deepseek4": ((150, 133), 64)}


@dataclass
class SynthParity:
    arch: str
    stages: int
    layers: int
    kinds: list[str]
    ranges: list[tuple[int, int]]
    exact: bool
    max_abs_diff: float
    first_diverging: str
    greedy_agree: bool
    n_values: int
    seconds: float

    def line(self) -> str:
        cuts = " ".join(f"[{a},{b})" for a, b in self.ranges)
        verdict = "EXACT" if self.exact else f"DIFFERS (max |diff| {self.max_abs_diff:g}, first {self.first_diverging})"
        return f"{self.arch}: {self.stages} stages {cuts} over kinds {','.join(self.kinds)}: {verdict} ({self.seconds:.1f} s)"


def choose_ranges(kinds: list[str], n_stages: int) -> list[tuple[int, int]]:
    """Stage ranges over len(kinds) layers: cuts at kind changes first (each change taken nearest an even
    cut point), then the even points themselves (or the nearest free layer)."""
    n = len(kinds)
    if not 1 <= n_stages <= n:
        raise DgrError(f"--stages {n_stages}: a {n}-layer model splits into 1..{n} stages")
    changes = [i for i in range(1, n) if kinds[i] != kinds[i - 1]]
    even = [round(n * k / n_stages) for k in range(1, n_stages)]
    cuts: set[int] = set()
    uncovered = []
    for target in even:
        free = [c for c in changes if c not in cuts]
        if free:
            cuts.add(min(free, key=lambda c: (abs(c - target), c)))
        else:
            uncovered.append(target)
    for target in uncovered:
        free = [c for c in range(1, n) if c not in cuts]
        cuts.add(min(free, key=lambda c: (abs(c - target), c)))
    edges = [0, *sorted(cuts), n]
    return list(zip(edges[:-1], edges[1:]))


def synth_model(arch: str, path: Path, *, layers: int | None = None, seed: int = SEED, embd: int = EMBD,
                context: int | None = None) -> Path:
    """The model `dgr parity --synth` splits: the spec's parity layer count unless `layers` says; `context`:
    the training context it declares (the writer's default unless given)."""
    check_arch(arch)
    if arch in OWN_WRITERS:
        if context is not None:
            raise DgrError(f"a synthetic {arch} model is written at its own context; give another architecture "
                           "for a long context (e.g. llama, qwen2)")
        return synth_deepseek4(path, layers=layers or 6, seed=seed, hash_layers=3)
    extra = {} if context is None else {"context": context}
    return synth(arch, layers or ARCHS[arch].parity_layers, embd, seed, path, **extra)


def check_arch(arch: str) -> None:
    if arch not in known_archs():
        raise DgrError(f"dgr parity --synth: unknown architecture {arch!r}; `dgr synth --list` names "
                       f"{len(known_archs())}: {', '.join(known_archs())}")


def model_layers(arch: str) -> int:
    return ARCHS[arch].parity_layers if arch in ARCHS else 6


def run_synth_parity(arch: str, n_stages: int, workdir: Path, *, lib: str | Path | None = None,
                     n_threads: int = 1, seed: int = SEED) -> SynthParity:
    """Write a fresh `arch` model in `workdir`, run it whole and split into `n_stages`, compare."""
    check_arch(arch)
    t0 = time.perf_counter()
    layers = model_layers(arch)
    kinds = layer_kinds(arch, layers, EMBD)
    ranges = choose_ranges(kinds, n_stages)
    model = synth_model(arch, Path(workdir) / f"{arch}-{layers}L-s{seed}.gguf", layers=layers, seed=seed)
    lengths, n_ubatch = OWN_SCHEDULES.get(arch, (PROMPT_LENGTHS, N_UBATCH))
    rng = np.random.default_rng(3)
    sched = Schedule(prompts=[rng.integers(0, 256, size=n).tolist() for n in lengths], steps=STEPS,
                     n_ubatch=n_ubatch)
    base = run_baseline(model, sched, lib, n_threads)
    sched.forced = [g[: sched.steps] for g in base.generated]
    c = split_compare(model, sched, base, ranges, lib=lib, n_threads=n_threads)
    return SynthParity(arch=arch, stages=n_stages, layers=layers, kinds=kinds, ranges=ranges, exact=c.exact,
                       max_abs_diff=float(c.max_abs_diff), first_diverging=c.diverging_text(),
                       greedy_agree=bool(c.greedy_agree), n_values=int(c.n_values),
                       seconds=time.perf_counter() - t0)


def features(arch: str) -> tuple[str, ...]:
    if arch == "deepseek4":
        return ("mhc-4-streams", "hash-routing", "token-id-sideband", "compressed-attention", "moe")
    return ARCHS[arch].features


# docs/families.md: written from a run, read back by the test that keeps it true.
TABLE_HEAD = ("| architecture | features exercised | stages tried | cuts (3 stages) | result | prefix cache | rollback |\n"
              "|---|---|---|---|---|---|---|\n")
TABLE_COLUMNS = ("features", "stages", "cuts", "result", "prefix_cache", "rollback")


def table_row(arch: str, results: list[SynthParity], feats: dict[str, str]) -> str:
    stages = ", ".join(str(r.stages) for r in results)
    three = next((r for r in results if r.stages == 3), results[0])
    cuts = " ".join(f"[{a},{b})" for a, b in three.ranges)
    ok = all(r.exact for r in results)
    return (f"| {arch} | {', '.join(features(arch)) or '-'} | {stages} | {cuts} | {'exact' if ok else 'DIFFERS'} "
            f"| {feats['prefix cache']} | {feats['rollback']} |\n")


# Architectures whose results depend on the batch (docs/batching.md); the engine's own list is in
# worker/engine/dgr_engine.cpp (`shared_kv`), and tests/engine/test_engine_invariance.py checks both agree.
NOT_BATCH_INVARIANT = {
    "kimi-linear": "its graph cannot take one KV stream per session at the pin (llama.cpp aborts building it), "
                   "so its sessions share one stream and its cells land wherever there is room",
    "minimax-01": "the same (one shared KV stream); its own chunkings differ by up to 4e-7 on a tiny model",
}


# What a stage keeps in its prefix cache, per architecture (docs/worker.md "Prefix cache")
PREFIX_CACHE_NOTE = (
    "\n## Prefix cache and rollback\n\n"
    "The last two columns are `dgr.toolchain.synth.features` on the same tiny model split in three, every stage\n"
    "doing what its worker does; `exact` = every logits row bit-identical to the whole model run cold (decode\n"
    "fed its tokens).\n\n"
    "- **prefix cache**: a session loads what an earlier one's layers held, all of it and cut back to a shorter\n"
    "  prefix (24 of 48 positions, past the sliding window and the ubatch), prefills the rest and decodes.\n"
    "  Sliding-window layers are in it: a saved state keeps every cell of them (patch 0025), so the restored\n"
    "  cells sit where the run that computed them left them and the earlier window is there when a restore\n"
    "  drops later positions (docs/worker.md \"Prefix cache\").\n"
    "- **rollback** (speculative decoding, docs/speculation.md): a verification step carries four tokens, the\n"
    "  third a wrong draft; every stage drops the last two positions and decoding goes on.\n\n"
    "`refused` names what cannot be done. A stage refused the prefix cache keeps nothing and says why in\n"
    "`Describe` (`prefix_cache_off`, the same words prefixed with the architecture, and\n"
    "`prefix_cache_capacity_bytes: 0`); every session on a route through it prefills its whole prompt (a hop\n"
    "that keeps nothing bounds what the whole route restores). A recurrent or hybrid stage keeps one running\n"
    "state per session, which stands for exactly the positions it was saved at and cannot be cut back (a state\n"
    "at block boundaries would serve it; it is not kept yet); those that keep per-step snapshots (llama.cpp's\n"
    "`n_rs_seq`, `--draft-max`) roll back their last step exactly. Speculation is refused by the client and the\n"
    "worker on a route with a stage that cannot roll back (`can_roll_back: false` in `Describe`). A worker also\n"
    "keeps no prefixes with fast kernels or on a GPU lane (its results depend on the batch) or on an MTP stage.\n\n"
    "## Through real workers\n\n"
    "`tests/families/test_families_wire.py` runs every architecture above through real `dgr-worker` processes (3 stages,\n"
    "replicas of the middle and last ones) against its whole model run cold: the route cold; after a kill -9 of\n"
    "a middle replica mid-generation; restoring a kept prefix; restoring it and then losing a middle replica;\n"
    "n-gram speculation on a prompt that repeats itself (refused by name where a stage cannot roll back); a\n"
    "grammar replayed into the next last stage after the last one dies; and one lossy wire dtype per family (in\n"
    "turn), whose route must equal its own first run, cold and restored. Describe's `prefix_cache_off` must read\n"
    "as the prefix cache column. The whole matrix, this table's runs included, takes about 6 minutes on 2 cores.\n")


def write_table(path: Path, by_arch: dict[str, list[SynthParity]], seconds: float,
                feats: dict[str, dict[str, str]]) -> Path:
    """`feats`: arch -> feature -> verdict (dgr.toolchain.synth.features)."""
    rows = "".join(table_row(a, by_arch[a], feats[a]) for a in sorted(by_arch))
    text = ("# Architectures: split equals whole\n\n"
            "Generated by `dgr parity --synth all --stages 2,3,4 --table docs/families.md` (do not edit by hand;\n"
            "`tests/families/test_families.py` fails when this table and the suite disagree). Each row: a fresh tiny\n"
            "random-weight model of the architecture (`dgr synth`), split at the cuts shown (chosen across\n"
            "the layer kinds), two sessions sharing each batch over several ubatches, then greedy decode;\n"
            "`exact` = every logit bit-identical to the whole model; the prefix cache and rollback columns are\n"
            "explained below.\n\n"
            f"{len(by_arch)} architectures, {sum(len(v) for v in by_arch.values())} splits, "
            f"{seconds:.0f} s on this run's machine.\n\n" + TABLE_HEAD + rows +
            "\n## Not batch invariant\n\n"
            "Every architecture above gives a session the same logits whatever shares its forwards and however\n"
            "its tokens are batched (docs/batching.md), except these; their workers say so in `Describe`\n"
            "(`batch_invariant: false`), and a client recovering on such a route replays the history the way it\n"
            "was first computed (the prompt in the same chunks, then each generated token as its own step).\n\n"
            + "".join(f"- {a}: {why}\n" for a, why in sorted(NOT_BATCH_INVARIANT.items())) +
            "\nOn the CPU lane, that is. On a GPU lane (Vulkan, CUDA) no architecture is: the backend's kernels are\n"
            "chosen by the batch's shape (and llama.cpp offloads large batches), so those engines say\n"
            "`batch_invariant: false` too (docs/build.md's lanes are compared with tolerances, not bit for bit).\n"
            + PREFIX_CACHE_NOTE)
    Path(path).write_text(text)
    return Path(path)


def read_table(path: Path) -> dict[str, dict[str, str]]:
    """arch -> {features, stages, cuts, result, prefix_cache} from a table `write_table` wrote."""
    out = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 1 + len(TABLE_COLUMNS) or cells[0] in ("architecture", "---"):
            continue
        out[cells[0]] = dict(zip(TABLE_COLUMNS, cells[1:]))
    return out


def results_json(by_arch: dict[str, list[SynthParity]], feats: dict[str, dict[str, str]] | None = None) -> str:
    out = {a: {"splits": [asdict(r) for r in rs], "features": (feats or {}).get(a, {})}
           for a, rs in sorted(by_arch.items())}
    return json.dumps(out, indent=2)
