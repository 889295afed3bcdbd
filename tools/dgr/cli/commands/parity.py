"""`dgr parity`: a bundle's stages run in one process and compared with the whole model (or, with --synth,
fresh tiny models of every architecture split and compared).

Parsing and printing only: what runs and what passes is dgr.toolchain.parity's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from dgr.cli.shared import add_schedule_args
from dgr.core.errors import DgrError


def register(sub) -> None:
    """Add `dgr parity` to the `dgr` parser."""
    p = sub.add_parser("parity", help="run a bundle's stages in one process and compare with the whole model")
    p.add_argument("bundle", type=Path, nargs="?", help="a bundle folder (or a whole GGUF with --ranges)")
    p.add_argument("--synth", metavar="ARCH", help="instead of a bundle: write a fresh tiny ARCH model (dgr synth), "
                   "split it across its special layers and compare (ARCH `all`: every `dgr synth --list` name)")
    p.add_argument("--stages", default="3", help="with --synth: stage count, or several (2,3,4) (default 3)")
    p.add_argument("--table", type=Path, help="with --synth: write the markdown table of the results (docs/families.md)")
    p.add_argument("--json", type=Path, help="with --synth: write every result as JSON")
    p.add_argument("--baseline", type=Path, help="a baseline from `dgr baseline` (default: run the whole model now: "
                   "the bundle's source, or its recipe built as one stage when the recipe quantizes)")
    p.add_argument("--source", type=Path, help="the bundle's source GGUF, when its manifest's source URI does not "
                   "resolve here (a path relative to the recipe's folder); checked against the manifest's blake3")
    p.add_argument("--ranges", help="with a whole GGUF: split it in this process, e.g. 0:10,10:30")
    add_schedule_args(p)
    p.add_argument("--perturb-boundary", type=int, metavar="STAGE",
                   help="negative control: add 1.0 to one value of STAGE's output boundary (parity must fail)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest |logit difference| that passes (default 0: bit-exact). For another backend "
                        "than the baseline's (Vulkan vs a CPU baseline), which rounds differently: docs/build.md")
    p.add_argument("--allow-mixed-numerics", action="store_true",
                   help="compare with a baseline of other numerics (another lane, build or kernel switch: "
                   "docs/numerics.md), within --tolerance; refused without it, since such logits differ in the low bits")
    p.set_defaults(func=cmd_parity)


def cmd_parity(args) -> int:
    if args.synth:
        return cmd_parity_synth(args)
    if args.bundle is None:
        raise DgrError("dgr parity: give a bundle folder (or a whole GGUF with --ranges), or --synth ARCH")
    if args.source and (args.ranges or args.baseline):
        raise DgrError("--source names a bundle's source for the whole-model run; drop it with --ranges or --baseline")
    # lazy: dgr.toolchain.parity costs 102 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.parity import (ParityError, baseline_kv_dtype, bundle_source, check_baseline_numerics, compare,
                                      ctx_for, largest_logit, load_baseline, make_schedule, open_stages, open_tokenizer,
                                      parse_ranges, perturbation, run_baseline, run_pipeline, throughput, verdict)

    ranges = None
    if args.ranges:
        if not args.bundle.is_file():
            raise DgrError("--ranges splits a whole GGUF file; give a .gguf path (a bundle has its own stages)")
        ranges = parse_ranges(args.ranges)
        paths = [args.bundle] * len(ranges)
        source = args.bundle
        what = f"the whole GGUF {source}"
    else:
        # lazy: dgr.toolchain.bundle.baseline costs 120 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.toolchain.bundle import baseline_model, load_bundle

        b = load_bundle(args.bundle)
        paths = b.stage_paths
        source = None
        if not args.baseline:
            source = bundle_source(b, args.source)
            # the whole model with the bundle's weights: the source, or the recipe built as one stage
            baseline = baseline_model(b, source, progress=True)
            source, what = baseline.path, str(baseline)

    kv_dtype = args.kv_dtype or "f16"
    if args.baseline:
        sched, base, meta = load_baseline(args.baseline)
        kv_dtype = baseline_kv_dtype(args.baseline, meta, args.kv_dtype)
        what = f"{args.baseline} (`dgr baseline` of {meta.get('model', 'a model it does not name')})"
    else:
        with open_tokenizer(source, args.lib) as tok:
            sched = make_schedule(tok, args.prompt, args.steps, args.n_ubatch)
        base = run_baseline(source, sched, args.lib, args.threads, kv_dtype)
        sched.forced = [g[: sched.steps] for g in base.generated]

    engines = open_stages(paths, n_ubatch=sched.n_ubatch, n_ctx=ctx_for(sched.prompts, sched.steps),
                          max_sessions=len(sched.prompts), ranges=ranges, lib=args.lib, n_threads=args.threads,
                          kv_dtype=kv_dtype)
    try:
        made = meta.get("numerics") if args.baseline else base.numerics
        check_baseline_numerics(f"the baseline {what}", made, engines[0].numerics, allow=args.allow_mixed_numerics)
        perturb = None if args.perturb_boundary is None else perturbation(args.perturb_boundary, len(engines))
        run = run_pipeline(engines, sched, perturb=perturb)
        stages = [f"[{e.describe().layer_begin},{e.describe().layer_end})" for e in engines]
        devices = [e.memory().device or "host" for e in engines]
        warm = _warm_pass(engines, sched, run) if perturb is None else None
    finally:
        for e in engines:
            e.close()
    c = compare(base, run)
    print(f"parity: {len(stages)} stages {' '.join(stages)}; {len(sched.prompts)} session(s), "
          f"prompt {[len(p) for p in sched.prompts]} tokens, {sched.steps} decode steps, {c.n_values} logits compared")
    print(f"  baseline: {what}")
    print(f"  weights on: {' '.join(devices)}; KV cache {kv_dtype}")
    print(f"  numerics: {run.numerics}")
    print(f"  max abs difference: {c.max_abs_diff:g} (largest |logit| of the baseline: {largest_logit(base):g})")
    print(f"  first diverging: {c.diverging_text()}")
    print(f"  greedy tokens agree: {c.greedy_agree}")
    print(f"  boundary bytes per seam: {run.boundary_bytes}")
    pre, dec = throughput(sched, run)
    print(f"  split run (one process): prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s")
    if warm is not None:
        print(f"  prefix cache (restore, and cut back to {warm[0]} of {len(sched.prompts[0])} positions): {warm[1]}")
    print(f"parity: {verdict(c, args.tolerance)}")  # ParityError (exit 1) when it does not pass
    if warm is not None and not (warm[1] == "exact" or warm[1].startswith("refused")):
        raise ParityError(f"parity: a restored prefix does not reproduce the split's cold run: {warm[1]}")
    return 0


def _warm_pass(engines, sched, run) -> tuple[int, str]:
    """The prefix cache on the split (what every worker's cache does): session 0's prompt restored from a saved
    state, whole and cut back to half, against the split's own cold run of it (bit for bit, decode fed the same
    tokens). Returns (the kept positions, "exact" / "refused: ..." / "DIFFERS (...)")."""
    # lazy: dgr.toolchain.synth.features costs 138 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.synth.features import Case, check_features

    prompt = sched.prompts[0]
    keep = max(1, len(prompt) // 2)
    tokens = sched.forced[0] if sched.forced else run.generated[0]
    arch = engines[0].describe().arch
    case = Case(engines, prompt, run.prefill_logits[0], run.decode_logits[0], tokens, keep, len(prompt))
    return keep, check_features(case, arch, ("prefix cache",))["prefix cache"].verdict


def cmd_parity_synth(args) -> int:
    # lazy: dgr.toolchain.synth costs 81 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.parity import ParityError
    from dgr.toolchain.synth.features import run_features
    from dgr.toolchain.synth.generic import known_archs
    from dgr.toolchain.synth.parity import results_json, run_synth_parity, write_table

    archs = known_archs() if args.synth == "all" else [a.strip() for a in args.synth.split(",")]
    try:
        counts = [int(x) for x in args.stages.split(",")]
    except ValueError:
        raise DgrError(f"--stages {args.stages!r}: a stage count, or several separated by commas (2,3,4)") from None
    t0 = time.perf_counter()
    by_arch: dict = {}
    feats: dict[str, dict[str, str]] = {}
    failed = []
    with tempfile.TemporaryDirectory(prefix="dgr-synth-parity-") as tmp:
        for arch in archs:
            for n in counts:
                try:
                    r = run_synth_parity(arch, n, Path(tmp), lib=args.lib, n_threads=args.threads or 1)
                except DgrError as err:
                    if len(archs) == 1:
                        raise
                    print(f"parity: {arch}: {n} stages: ERROR: {err}", flush=True)  # the others still run
                    failed.append(f"{arch} x{n} (error)")
                    continue
                by_arch.setdefault(arch, []).append(r)
                print(f"parity: {r.line()}", flush=True)
                if not r.exact:
                    failed.append(f"{arch} x{n}")
            if arch not in by_arch:
                continue
            try:    # a kept prefix restored (and cut back), and a rollback, on 3 stages against the cold whole model
                rs = run_features(arch, Path(tmp), lib=args.lib, n_threads=args.threads or 1)
            except DgrError as err:
                if len(archs) == 1:
                    raise
                print(f"parity: {arch}: features: ERROR: {err}", flush=True)
                failed.append(f"{arch} features (error)")
                continue
            feats[arch] = {name: r.verdict for name, r in rs.items()}
            for name, r in rs.items():
                print(f"parity: {arch}: {name} (3 stages): {'EXACT' if r.exact else r.verdict} ({r.seconds:.1f} s)",
                      flush=True)
                if not (r.exact or r.refused):
                    failed.append(f"{arch} {name}")
    seconds = time.perf_counter() - t0
    if args.table and not failed:
        write_table(args.table, by_arch, seconds, feats)
    elif args.table:
        print(f"parity: {args.table} not written: the table lists only passing runs", flush=True)
    if args.json:
        args.json.write_text(results_json(by_arch, feats))
    total = sum(len(v) for v in by_arch.values())
    if failed:
        raise ParityError(f"{len(failed)} of {total} splits differ from the whole model: {', '.join(failed)}")
    print(f"parity: EXACT: {total} split(s) of {len(by_arch)} architecture(s) equal the whole model ({seconds:.1f} s)")
    return 0
