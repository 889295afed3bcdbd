"""`dgr synth`: a tiny random-weight GGUF model of an architecture, or one of a real model's shape
(dgr.toolchain.synth)."""

from __future__ import annotations

import argparse

from dgr.core.errors import DgrError


def _synth(args) -> int:
    # lazy: dgr.toolchain.synth costs 81 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.synth.generic import ARCHS, known_archs, synth

    if args.list:
        for name in known_archs():
            print(name)
        return 0
    if args.shape:
        # lazy: dgr.toolchain.synth costs 81 ms at start-up (python -X importtime, 2026-12-05)
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
        # V4 has its own writer (not a table row)
        # lazy: dgr.toolchain.synth costs 81 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.toolchain.synth.deepseek4 import synth_deepseek4

        kw = {}
        if args.compress_ratios:
            kw["compress_ratios"] = [int(x) for x in args.compress_ratios.split(",")]
        if agree is not None:
            # MTP drafts that agree with the trunk at rate `agree` (lookup-table weights, orthonormal embeddings)
            # lazy: dgr.toolchain.synth costs 81 ms at start-up (python -X importtime, 2026-12-05)
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


def register(sub) -> None:
    """Add `dgr synth` to the `dgr` parser."""
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
