"""`dgr demo`: SmolLM2 split over local worker processes against the whole model (dgr.app.demo)."""

from __future__ import annotations


def register(sub) -> None:
    """Add `dgr demo` to the `dgr` parser."""
    d = sub.add_parser("demo", help="SmolLM2 split over local worker processes vs the whole model")
    d.add_argument("--stages", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--prompt", default="The capital of France is")
    d.add_argument("--threads", type=int, default=0,
                   help="compute threads per worker (0: the CPU count divided by the stages)")
    d.add_argument("--prefill-tokens", type=int, default=256, help="also time prefill of a prompt this long (0: skip)")
    d.set_defaults(func=_demo)


def _demo(args) -> int:
    # lazy: dgr.app.demo costs 161 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.demo import run_demo

    return run_demo(stages=args.stages, max_tokens=args.max_tokens, prompt=args.prompt,
                    prefill_tokens=args.prefill_tokens, threads=args.threads)
