"""Helpers shared by the engine tests (and the wire tests that run real engines): tiny models, bundles
built by the real `dgr recipe build` code, GGUF rewriting for bad-input tests, and the split-vs-whole
comparison every parity test makes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from dgr.core.hashing import file_blake3
from dgr.runtime.engine import Engine
from dgr.runtime.engine_api import Step
from dgr.toolchain.parity import Schedule, compare, open_stages, run_pipeline


def b3(path: Path) -> str:
    """The blake3 a recipe's [source] names."""
    return file_blake3(path)


def synth_model(dirpath: Path, arch: str, layers: int = 6, embd: int = 64, seed: int = 7) -> Path:
    from dgr.toolchain.synth.generic import synth

    return synth(arch, layers, embd, seed, Path(dirpath) / f"{arch}-{layers}L.gguf")


def make_bundle(src: Path, ranges: list[tuple[int, int]], store: Path, name: str = "t"):
    """A bundle of `src` split at `ranges`, written by dgr.toolchain.bundle.build from a recipe."""
    from dgr.toolchain.bundle import build

    store.mkdir(parents=True, exist_ok=True)
    recipe = store / f"{name}.toml"
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    recipe.write_text(f'name = "{name}"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n'
                      f"[placement]\nstages = [{pairs}]\n")
    return build(recipe, store / "out")


def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None, set_kv: dict | None = None,
                 drop_tensors: tuple[str, ...] = ()) -> Path:
    """Copy a GGUF, optionally renaming its architecture (and its `<arch>.*` keys), overriding
    integer keys, or dropping tensors."""
    r = gguf.GGUFReader(str(src))
    old_arch = str(r.fields["general.architecture"].contents())
    new_arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), new_arch)
    set_kv = dict(set_kv or {})
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = new_arch + name[len(old_arch):] if name.startswith(old_arch + ".") else name
        vtype = f.types[0]
        if key in set_kv:
            _add(w, key, set_kv.pop(key))
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), vtype)
    for key, val in set_kv.items():
        _add(w, key, val)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # numpy order of the logical tensor
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _add(w: gguf.GGUFWriter, key: str, val) -> None:
    vtype = gguf.GGUFValueType.BOOL if isinstance(val, bool) else gguf.GGUFValueType.UINT32
    w.add_key_value(key, val, vtype)


def long_prompts(n_vocab: int, lengths=(41, 29), seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(n_vocab, 256), size=n).tolist() for n in lengths]


def baseline_and_split(whole: Path, stage_paths: list[Path], sched: Schedule, lib, *, ranges=None, perturb=None):
    """(baseline, split run, comparison) for one schedule; the baseline is the whole file alone."""
    n_ctx = max(len(p) for p in sched.prompts) + sched.steps + 8
    [w] = open_stages([whole], n_ubatch=sched.n_ubatch, n_ctx=n_ctx, max_sessions=len(sched.prompts), lib=lib)
    try:
        base = run_pipeline([w], sched)
    finally:
        w.close()
    forced = Schedule(prompts=sched.prompts, steps=sched.steps, n_ubatch=sched.n_ubatch,
                      forced=[g[: sched.steps] for g in base.generated])
    engines = open_stages(stage_paths, n_ubatch=sched.n_ubatch, n_ctx=n_ctx, max_sessions=len(sched.prompts),
                          ranges=ranges, lib=lib)
    try:
        run = run_pipeline(engines, forced, perturb=perturb)
    finally:
        for e in engines:
            e.close()
    return base, run, compare(base, run)


def assert_split_bundle_exact(whole: Path, ranges: list[tuple[int, int]], store: Path, lib, label: str,
                              n_embd: int = 64) -> None:
    """Build a bundle of `ranges`, run it stage by stage against the whole model: every logit of two
    sessions sharing each batch (prompts of 41 and 29 tokens over ubatches of 16, 4 decode steps) must be
    bit-identical, and each seam must carry [tokens, 1, n_embd] float32 per forward."""
    bundle = make_bundle(whole, ranges, store)
    sched = Schedule(prompts=long_prompts(256), steps=4, n_ubatch=16)
    base, run, c = baseline_and_split(whole, bundle.stage_paths, sched, lib)
    n_tok = sum(len(p) + sched.steps for p in sched.prompts)
    assert c.n_values == n_tok * base.prefill_logits[0].shape[1]
    assert c.first_diverging is None, f"{label}: first difference at {c.first_diverging}"
    assert c.max_abs_diff == 0.0
    assert run.generated == base.generated
    assert run.boundary_bytes == [n_tok * n_embd * 4] * (len(ranges) - 1)


def alone_and_shared(path, lib, a, b, steps=4):
    """Session a's logits per forward, run alone and with session b in every batch."""

    def run(with_b: bool):
        with Engine.open(path, n_ctx=96, max_sessions=2, n_ubatch=16, lib=lib) as e:
            e.open_session("a", 0)
            e.open_session("b", 0)
            batch = [Step("a", 0, np.arange(len(a), dtype=np.int32), token_ids=np.array(a), want_logits="all")]
            if with_b:
                batch.append(Step("b", 0, np.arange(len(b), dtype=np.int32), token_ids=np.array(b)))
            r = e.forward(batch)
            out, ta, tb = [r[0].logits], r[0].next_token, r[-1].next_token
            for t in range(steps):
                batch = [Step("a", 0, np.array([len(a) + t], np.int32), token_ids=np.array([ta]))]
                if with_b:
                    batch.append(Step("b", 0, np.array([len(b) + t], np.int32), token_ids=np.array([tb])))
                r = e.forward(batch)
                out.append(r[0].logits)
                ta, tb = r[0].next_token, r[-1].next_token
            return out

    return run(False), run(True)


def cut(n: int, sizes) -> list[int]:
    """`n` tokens cut into chunks of `sizes`, repeated (the last chunk shorter)."""
    out, i, k = [], 0, 0
    while i < n:
        out.append(min(sizes[k % len(sizes)], n - i))
        i, k = i + out[-1], k + 1
    return out


def logits_by_cuts(path, sessions, lib, *, kernels: str = "reference", n_threads: int = 0, n_ubatch: int = 512,
                   n_ctx: int = 256, poll: int = 0):
    """Every position's logits [n_tokens, n_vocab] of each session in `sessions` ((tokens, chunk sizes)),
    the sessions run side by side in one engine: forward k holds chunk k of every session that has one
    (so sessions share forwards at different positions and with different chunk sizes)."""
    with Engine.open(path, n_ctx=n_ctx, max_sessions=len(sessions), n_ubatch=n_ubatch,
                     kernels=kernels, n_threads=n_threads, poll=poll, lib=lib) as e:
        for i in range(len(sessions)):
            e.open_session(f"s{i}", 0)
        offs, outs, k = [0] * len(sessions), [[] for _ in sessions], 0
        while True:
            batch, who = [], []
            for i, (toks, cuts) in enumerate(sessions):
                if k < len(cuts):
                    o, n = offs[i], cuts[k]
                    batch.append(Step(f"s{i}", 0, np.arange(o, o + n, dtype=np.int32),
                                      token_ids=np.asarray(toks[o:o + n], np.int32), want_logits="all"))
                    who.append(i)
                    offs[i] += n
            if not batch:
                return [np.concatenate(o) for o in outs]
            for i, r in zip(who, e.forward(batch)):
                outs[i].append(r.logits)
            k += 1


def batching_differences(path, lib, *, kernels: str = "reference", n_threads: int = 0,
                         n_vocab: int = 256) -> dict[str, float]:
    """Max |logit diff| of one session (40 tokens) against its own one-batch prefill, for each way of
    batching it: its own chunkings, and with two other sessions (23 and 9 tokens) sharing its forwards.
    `kernels`: Engine.open's CPU kernels; `n_threads`: the engine's compute threads (0: its default)."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, min(n_vocab, 200), size=n).tolist() for n in (40, 23, 9))
    ways = {
        "token by token": [(a, [1] * len(a))],
        "chunks of 7": [(a, cut(len(a), [7]))],
        "chunks of 13, 1, 5": [(a, cut(len(a), [13, 1, 5]))],
        "one batch beside 2 prefills": [(a, [len(a)]), (b, [len(b)]), (c, [len(c)])],
        "mixed positions and chunks": [(a, cut(len(a), [3, 1])), (b, [10, 1, 1, 1, 1, 9]), (c, [1] * 9)],
        "behind 2 other sessions": [(b, [len(b)]), (c, cut(len(c), [2])), (a, cut(len(a), [5, 1, 8]))],
    }
    ref = logits_by_cuts(path, [(a, [len(a)])], lib, kernels=kernels, n_threads=n_threads)[0]
    out = {}
    for name, sessions in ways.items():
        got = logits_by_cuts(path, sessions, lib, kernels=kernels, n_threads=n_threads)
        mine = got[0] if sessions[0][0] is a else got[-1]
        out[name] = float(np.abs(mine - ref).max())
    return out


__all__ = ["Engine", "b3", "synth_model", "make_bundle", "rewrite_gguf", "long_prompts", "baseline_and_split",
           "assert_split_bundle_exact", "alone_and_shared", "cut", "logits_by_cuts", "batching_differences"]


def fake_split(model, ids: list[int], chunks: list[tuple[int, int]]):
    """The logits rows of every position of `ids` from the fake `model`'s stages chained in this process
    (dgr.testing.fake_engine.FakeEngine per stage), the prompt run in `chunks` ((lo, hi) position ranges)."""
    from dgr.testing.fake_engine import FakeEngine

    stages = [FakeEngine(model, i) for i in range(len(model.ranges))]
    for e in stages:
        e.open_session("s", 1)
    rows = []
    for lo, hi in chunks:
        pos, tid, b = np.arange(lo, hi), np.array(ids[lo:hi]), None
        for e in stages:
            r = e.forward([Step("s", 1, pos, tid, boundary=b, want_logits="all")])[0]
            b = r.boundary
        rows.append(r.logits)
    return np.concatenate(rows)
