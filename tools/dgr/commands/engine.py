"""`dgr` subcommands of the engine area: baseline (whole model) and parity (split vs whole)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dgr.errors import DgrError


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    p = sub.add_parser("baseline", help="run a whole model alone: reference logits and greedy steps, with its speed")
    p.add_argument("model", type=Path, help="a whole-model GGUF")
    _schedule_args(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="where to write the baseline (.npz)")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("parity", help="run a bundle's stages in one process and compare with the whole model")
    p.add_argument("bundle", type=Path, help="a bundle folder (or a whole GGUF with --ranges)")
    p.add_argument("--baseline", type=Path, help="a baseline from `dgr baseline` (default: run the bundle's source now)")
    p.add_argument("--ranges", help="with a whole GGUF: split it in this process, e.g. 0:10,10:30")
    _schedule_args(p)
    p.add_argument("--perturb-boundary", type=int, metavar="STAGE",
                   help="negative control: add 1.0 to one value of STAGE's output boundary (parity must fail)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest |logit difference| that passes (default 0: bit-exact). For another backend "
                        "than the baseline's (Vulkan vs a CPU baseline), which rounds differently: docs/build.md")
    p.set_defaults(func=cmd_parity)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    from dgr.parity import DEFAULT_PROMPT

    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for several sessions sharing each batch "
                   f"(default: {DEFAULT_PROMPT[:30]!r}...)")
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps (default 8)")
    p.add_argument("--n-ubatch", type=int, default=512, help="physical batch size (default 512)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per engine (default: all cores; "
                   "use fewer on a shared machine, spinning threads then cost more than they give)")
    p.add_argument("--lib", type=Path, help="engine library (default: $DGR_ENGINE_LIB or the cached CPU build)")
    p.add_argument("--kv-dtype", choices=("f16", "f32"), default=None,
                   help="KV cache type (default f16, llama.cpp's; f32 with an all-F32 model makes an all-F32 "
                        "reference; parity takes the baseline's)")


def _ctx_for(prompts: list[list[int]], steps: int) -> int:
    return max(64, max(len(p) for p in prompts) + steps + 8)


def _schedule(args, engine):
    from dgr.parity import DEFAULT_PROMPT, Schedule

    if args.steps < 0:
        raise DgrError(f"--steps must be >= 0, got {args.steps}")
    texts = args.prompt or [DEFAULT_PROMPT]
    prompts = [engine.tokenize(t, add_special=True) for t in texts]
    for t, p in zip(texts, prompts):
        if not p:
            raise DgrError(f"prompt {t!r} tokenizes to nothing; give a longer prompt")
    return Schedule(prompts=prompts, steps=args.steps, n_ubatch=args.n_ubatch)


def run_baseline(model: Path, sched, lib=None, n_threads: int = 0, kv_dtype: str = "f16"):
    from dgr.parity import open_stages, run_pipeline

    [eng] = open_stages([model], n_ubatch=sched.n_ubatch, n_ctx=_ctx_for(sched.prompts, sched.steps),
                        max_sessions=len(sched.prompts), lib=lib, n_threads=n_threads, kv_dtype=kv_dtype)
    try:
        info = eng.describe()
        if info.layer_begin != 0 or info.layer_end != info.n_layer:
            raise DgrError(f"{model} is a stage file (layers [{info.layer_begin}, {info.layer_end})); a baseline needs the whole model")
        return run_pipeline([eng], sched)
    finally:
        eng.close()


def cmd_baseline(args) -> int:
    from dgr.engine import Engine
    from dgr.parity import save_baseline

    with Engine.open(args.model, n_ctx=64, max_sessions=1, lib=args.lib) as tok:
        sched = _schedule(args, tok)
        device = tok.memory().device or "host"  # the same model and library as the baseline run
    kv_dtype = args.kv_dtype or "f16"
    res = run_baseline(args.model, sched, args.lib, args.threads, kv_dtype)
    n_pre = sum(len(p) for p in sched.prompts)
    n_dec = sched.steps * len(sched.prompts)
    meta = {"model": str(args.model), "prefill_tokens": n_pre, "decode_tokens": n_dec, "kv_dtype": kv_dtype,
            "device": device,
            "prefill_seconds": res.prefill_seconds, "decode_seconds": res.decode_seconds}
    save_baseline(args.output, sched, res, meta)
    print(f"baseline: {args.model} ({len(sched.prompts)} session(s), prompt {[len(p) for p in sched.prompts]} tokens, "
          f"{sched.steps} steps, weights on {device}, KV cache {kv_dtype}) -> {args.output}")
    print(f"  prefill {n_pre / max(res.prefill_seconds, 1e-9):.1f} tok/s, decode {n_dec / max(res.decode_seconds, 1e-9):.1f} tok/s")
    print(f"  greedy: {res.generated}")
    return 0


def cmd_parity(args) -> int:
    from dgr.engine import Engine
    from dgr.parity import ParityError, compare, load_baseline, open_stages, run_pipeline

    ranges = None
    if args.ranges:
        if not args.bundle.is_file():
            raise DgrError("--ranges splits a whole GGUF file; give a .gguf path (a bundle has its own stages)")
        try:
            ranges = [tuple(int(x) for x in r.split(":")) for r in args.ranges.split(",")]
        except ValueError:
            raise DgrError(f"--ranges {args.ranges!r}: write begin:end pairs separated by commas, e.g. 0:10,10:30") from None
        paths = [args.bundle] * len(ranges)
        source = args.bundle
    else:
        from dgr.bundle import load_bundle

        b = load_bundle(args.bundle)
        paths = b.stage_paths
        source = None
        if not args.baseline:
            from dgr.source import resolve

            try:
                source = resolve(b.manifest.source.uri, b.manifest.source.blake3, base_dir=b.root, progress=False)
            except DgrError as e:
                raise DgrError(f"cannot find the bundle's source model to make a baseline ({e}); "
                               "pass --baseline FILE.npz from `dgr baseline`") from None

    kv_dtype = args.kv_dtype or "f16"
    if args.baseline:
        sched, base, meta = load_baseline(args.baseline)
        made = meta.get("kv_dtype", "f16")
        if args.kv_dtype and args.kv_dtype != made:
            raise DgrError(f"{args.baseline} was made with a {made} KV cache; compare like with like "
                           f"(drop --kv-dtype, or make the baseline with --kv-dtype {args.kv_dtype})")
        kv_dtype = made
    else:
        with Engine.open(source, n_ctx=64, max_sessions=1, lib=args.lib) as tok:
            sched = _schedule(args, tok)
        base = run_baseline(source, sched, args.lib, args.threads, kv_dtype)
        sched.forced = [g[: sched.steps] for g in base.generated]

    engines = open_stages(paths, n_ubatch=sched.n_ubatch, n_ctx=_ctx_for(sched.prompts, sched.steps),
                          max_sessions=len(sched.prompts), ranges=ranges, lib=args.lib, n_threads=args.threads,
                          kv_dtype=kv_dtype)
    try:
        perturb = None
        if args.perturb_boundary is not None:
            if not 0 <= args.perturb_boundary < len(engines) - 1:
                raise DgrError(f"--perturb-boundary must name a non-last stage, 0..{len(engines) - 2}")
            # a visible change: quantized matmuls round activations to 8 bits per block, so a tiny
            # perturbation can vanish there and prove nothing
            perturb = (args.perturb_boundary, 0, 0, 1.0)
        run = run_pipeline(engines, sched, perturb=perturb)
        stages = [f"[{e.describe().layer_begin},{e.describe().layer_end})" for e in engines]
        devices = [e.memory().device or "host" for e in engines]
    finally:
        for e in engines:
            e.close()
    c = compare(base, run)
    print(f"parity: {len(stages)} stages {' '.join(stages)}; {len(sched.prompts)} session(s), "
          f"prompt {[len(p) for p in sched.prompts]} tokens, {sched.steps} decode steps, {c.n_values} logits compared")
    print(f"  weights on: {' '.join(devices)}; KV cache {kv_dtype}")
    print(f"  max abs difference: {c.max_abs_diff:g} (largest |logit| of the baseline: {_largest(base):g})")
    print(f"  first diverging: {'none' if c.first_diverging is None else '%s (session %d, %s, position %d)' % ('yes', *c.first_diverging)}")
    print(f"  greedy tokens agree: {c.greedy_agree}")
    print(f"  boundary bytes per seam: {run.boundary_bytes}")
    n_pre = sum(len(p) for p in sched.prompts)
    n_dec = sched.steps * len(sched.prompts)
    print(f"  split run (one process): prefill {n_pre / max(run.prefill_seconds, 1e-9):.1f} tok/s, "
          f"decode {n_dec / max(run.decode_seconds, 1e-9):.1f} tok/s")
    if args.tolerance < 0:
        raise DgrError(f"--tolerance must be >= 0, got {args.tolerance:g}")
    if c.exact:
        print("parity: EXACT")
        return 0
    if args.tolerance > 0 and c.max_abs_diff <= args.tolerance:  # NaN compares false: fails
        print(f"parity: WITHIN TOLERANCE (max abs {c.max_abs_diff:g} <= {args.tolerance:g})")
        return 0
    why = "NaN in the logits" if math.isnan(c.max_abs_diff) else f"max abs {c.max_abs_diff:g}"
    if args.tolerance > 0:
        why += f" > tolerance {args.tolerance:g}"
    raise ParityError(f"parity FAILED: the split run differs from the whole model ({why})")


def _largest(res) -> float:
    return max(float(abs(x).max()) for x in [*res.prefill_logits, *res.decode_logits] if x.size)
