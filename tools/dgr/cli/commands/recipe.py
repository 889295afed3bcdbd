"""`dgr recipe new|plan|build`: scaffold a recipe, show the stages it would build, build it into a bundle in a
store (dgr.toolchain.recipe, dgr.toolchain.bundle)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dgr.core.errors import RecipeError
from dgr.core.log import get_logger
from dgr.toolchain.templates import template_help

log = get_logger(__name__)


def _recipe_path(p: str) -> Path:
    path = Path(p)
    return path / "recipe.toml" if path.is_dir() else path


def _plan(args) -> int:
    # lazy: dgr.toolchain.bundle.plan costs 99 ms at start-up (python -X importtime, 2026-12-05)
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
    # lazy: dgr.toolchain.bundle.builder costs 107 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.bundle import build

    b = build(_recipe_path(args.recipe), args.store, progress=not args.quiet)
    m = b.manifest
    print(f"bundle {b.id}")
    print(f"  at {b.root}")
    for s in m.stages:
        print(f"  {s.file}: layers [{s.layer_begin}, {s.layer_end})  {s.tensor_count} tensors  {s.size} bytes  "
              f"blake3 {s.blake3[:16]}")
    return 0


def _new(args) -> int:
    # lazy: dgr.toolchain.recipe costs 68 ms at start-up (python -X importtime, 2026-12-05)
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
    """Add `dgr recipe` to the `dgr` parser."""
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
