"""`dgr` subcommands of the bundles area: inspect, recipe new/plan/build, bundle verify/provision, synth."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dgr.core.errors import DgrError, RecipeError
from dgr.core.log import get_logger

log = get_logger(__name__)


def _recipe_path(p: str) -> Path:
    path = Path(p)
    return path / "recipe.toml" if path.is_dir() else path


def _inspect(args) -> int:
    from dgr.toolchain.modelreport import format_report, inspect_model

    r = inspect_model(args.file)
    print(json.dumps(r, indent=2, sort_keys=True) if args.json else format_report(r))
    return 0


def _synth(args) -> int:
    from dgr.toolchain.synth.generic import ARCHS, known_archs, synth

    if args.list:
        for name in known_archs():
            print(name)
        return 0
    if args.shape:
        from dgr.toolchain.synth.shapes import synth_shape

        if args.arch or not args.output:
            raise DgrError("dgr synth --shape NAME: give -o FILE, and no --arch (the shape names its architecture)")
        print(synth_shape(args.shape, args.output, seed=args.seed, layers=args.layers_given))
        return 0
    if not args.arch or not args.output:
        raise DgrError("dgr synth: give --arch ARCH and -o FILE (or --list to see the architectures, or --shape "
                       "llama-7b for a model of a real shape)")
    args.layers = args.layers_given or 4

    agree = getattr(args, "mtp_agree", None)
    if agree is not None and args.arch != "deepseek4":
        raise DgrError(f"dgr synth: --mtp-agree is for --arch deepseek4 (its MTP block), not {args.arch}")
    embd = args.embd if args.embd is not None else 64
    if args.arch == "deepseek4" and "deepseek4" not in ARCHS:
        from dgr.toolchain.synth.deepseek4 import synth_deepseek4  # V4 has its own writer (not a table row)

        kw = {}
        if args.compress_ratios:
            kw["compress_ratios"] = [int(x) for x in args.compress_ratios.split(",")]
        if agree is not None:
            # MTP drafts that agree with the trunk at rate `agree` (lookup-table weights, orthonormal embeddings)
            from dgr.toolchain.synth.deepseek4_agree import DEFAULT_EMBD, synth_deepseek4_agreeing

            out = synth_deepseek4_agreeing(args.output, agree=agree, layers=args.layers, seed=args.seed,
                                           embd=args.embd if args.embd is not None else DEFAULT_EMBD,
                                           dtype=args.dtype, hash_layers=args.hash_layers, mtp=args.mtp, **kw)
        else:
            out = synth_deepseek4(args.output, layers=args.layers, embd=embd, seed=args.seed, dtype=args.dtype,
                                  hash_layers=args.hash_layers, mtp=args.mtp, **kw)
    else:
        opts = {k: v for k, v in (("n_ff", args.n_ff), ("n_expert", args.experts),
                                  ("n_expert_used", args.experts_used), ("swa", args.swa),
                                  ("swa_pattern", args.swa_pattern)) if v is not None}
        out = synth(args.arch, args.layers, embd, args.seed, args.output, tied=args.tied, dtype=args.dtype,
                    **opts)
    print(out)
    return 0


def _plan(args) -> int:
    from dgr.toolchain.bundle import make_plan
    from dgr.toolchain.recipe import load_recipe

    bp = make_plan(load_recipe(_recipe_path(args.recipe)), progress=True)
    print(f"{bp.recipe.recipe.name}: {bp.info.arch}, {bp.info.n_layer} layers, {len(bp.stages)} stages")
    for sp in bp.stages:
        print(f"  stage {sp.index}: layers [{sp.begin}, {sp.end})  {len(sp.tensors)} tensors  "
              f"{sp.weight_bytes} bytes ({sp.weight_bytes / 2**20:.1f} MiB)")
    if bp.quantization:
        print("  quantization:")
        for use in bp.quantization:
            print(f"    {use.line()}")
    return 0


def _build(args) -> int:
    from dgr.toolchain.bundle import build

    b = build(_recipe_path(args.recipe), args.store, progress=not args.quiet)
    m = b.manifest
    print(f"bundle {b.id}")
    print(f"  at {b.root}")
    for s in m.stages:
        print(f"  {s.file}: layers [{s.layer_begin}, {s.layer_end})  {s.tensor_count} tensors  {s.size} bytes  "
              f"blake3 {s.blake3[:16]}")
    return 0


def _verify(args) -> int:
    from dgr.toolchain.bundle import check_id, load_bundle, verify_bundle

    if args.expect_id:
        check_id(load_bundle(args.bundle), args.expect_id)  # before hashing: a wrong bundle fails at once
    rep = verify_bundle(args.bundle, resume=not args.fresh, progress=not args.quiet, stages=args.stage)
    which = f" of stage(s) {', '.join(map(str, sorted(set(args.stage))))}" if args.stage else ""
    print(f"ok: bundle {rep.bundle_id}: {rep.chunks_total} chunks{which} verified "
          f"({rep.chunks_read} read now, {rep.chunks_skipped} verified by an earlier interrupted run)")
    return 0


def _provision(args) -> int:
    from dgr.toolchain.bundle import provision

    rep = provision(args.bundle, args.to, progress=not args.quiet)
    print(f"provisioned bundle {rep.bundle_id} to {rep.dest} "
          f"({rep.chunks_copied} chunks copied, {rep.chunks_reused} already there and re-verified)")
    return 0


def _new(args) -> int:
    from dgr.toolchain.recipe import scaffold, scaffold_values

    values: dict[str, str] = {}
    for kv in args.set or []:
        if "=" not in kv:
            raise RecipeError(f"--set {kv!r}: write KEY=VALUE (the variables: dgr recipe new --help)")
        k, v = kv.split("=", 1)
        values[k.strip()] = v
    if args.name:
        values["name"] = args.name
    ctx = scaffold_values(values, stages=args.stages, from_model=args.from_model, output_dir=args.output_dir)
    path = scaffold(args.output_dir, ctx, interactive=args.interactive)
    print(path)
    if not ctx.get("source_blake3"):
        log.info("next: fill in source.uri and source.blake3 in %s (or scaffold with --from-model FILE.gguf), "
                 "then `dgr recipe plan %s`", path, path.parent)
    return 0


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    from dgr.toolchain.templates import template_help

    p = sub.add_parser("inspect", help="show a GGUF model's layers, widths, seam and bytes")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("synth", help="write a tiny random-weight GGUF model")
    p.add_argument("--arch", help="the architecture (llama.cpp's name for it); --list names them all")
    p.add_argument("--list", action="store_true", help="print every architecture --arch can write, one per line")
    p.add_argument("--shape", metavar="NAME", help="a random-weight model of a real model's shape and size (llama-7b, "
                   "qwen2-7b: dgr.toolchain.synth.shapes.SHAPES), in llama.cpp's Q4_K_M mix, written one tensor at a "
                   "time (about 4 GB for llama-7b)")
    p.add_argument("--layers", type=int, default=None, dest="layers_given",
                   help="blocks (default 4; with --shape: the shape's own, fewer for a quick try)")
    p.add_argument("--embd", type=int, help="width (default 64; 272 with --mtp-agree)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to the embedding")
    p.add_argument("--dtype", default="f32", choices=("f32", "f16"))
    p.add_argument("--n-ff", type=int, help="FFN width (default 2 x embd; expert FFN width for MoE: embd)")
    p.add_argument("--experts", type=int, help="qwen3moe: experts (default 4)")
    p.add_argument("--experts-used", type=int, help="qwen3moe: experts per token (default 2)")
    p.add_argument("--swa", type=int, help="gemma3: sliding window (default 8)")
    p.add_argument("--swa-pattern", type=int, help="gemma3: every Nth layer is full attention (default 2)")
    p.add_argument("--hash-layers", type=int, default=3, help="deepseek4: leading hash-routed layers")
    p.add_argument("--compress-ratios", help="deepseek4: per-layer ratios from {0,4,128}, e.g. 0,4,128,0")
    p.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True, help="deepseek4: MTP block")
    p.add_argument("--mtp-agree", type=float, metavar="R",
                   help="deepseek4: weights whose MTP drafts agree with the trunk's greedy tokens at rate R in [0, 1]")
    p.add_argument("-o", "--output")
    p.set_defaults(func=_synth)

    recipe = sub.add_parser("recipe", help="recipes: new, plan, build")
    rsub = recipe.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    p = rsub.add_parser("build", help="build a recipe into a bundle in a store")
    p.add_argument("recipe", help="recipe.toml or a folder holding one")
    p.add_argument("--store", required=True, help="store folder (a mounted drive; not under /home)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_build)
    p = rsub.add_parser("plan", help="show the stages a recipe would build, without building")
    p.add_argument("recipe")
    p.set_defaults(func=_plan)
    p = rsub.add_parser(
        "new", help="scaffold a recipe from the cookiecutter template",
        description="Write NAME/recipe.toml from dgr's recipe template (tools/dgr/toolchain/templates/recipe). An existing "
                    "NAME folder is refused. With --from-model the source, its hash and its layer count are "
                    "read from the file, and the stages balance the bytes each one holds and reads per token "
                    "(the first also holds the token embedding, the last the output head).",
        epilog=f"template variables (--set KEY=VALUE):\n{template_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", help="the recipe's name (the template variable `name`)")
    p.add_argument("--from-model", help="a local GGUF: fills in source_uri, source_blake3, n_layer and balanced stages")
    p.add_argument("--stages", type=int, metavar="N", help="pipeline stages (the template variable `n_stages`)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a template variable (repeatable; listed below)")
    p.add_argument("-o", "--output-dir", default=".", help="where NAME/ is written (default: here)")
    p.add_argument("--interactive", action="store_true", help="prompt for every template variable")
    p.set_defaults(func=_new)

    bundle = sub.add_parser("bundle", help="bundles: verify, provision")
    bsub = bundle.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)
    p = bsub.add_parser("verify", help="check every chunk of a bundle (resumes an interrupted check)")
    p.add_argument("bundle")
    p.add_argument("--fresh", action="store_true", help="ignore an interrupted run's progress")
    p.add_argument("--stage", type=int, action="append", metavar="N",
                   help="check only stage N's file (repeat for more; default: every stage): what a worker serving "
                   "stage N reads")
    p.add_argument("--expect-id", metavar="ID", help="fail unless this is the bundle's id: the whole id, its 12-digit "
                   "short form, any prefix of 8 or more hex digits, or the store folder's NAME-ID12")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_verify)
    p = bsub.add_parser("provision", help="copy a bundle into a store, verifying as it copies (resumable)")
    p.add_argument("bundle")
    p.add_argument("--to", required=True, help="store folder on a mounted drive (not under /home)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_provision)

