"""`dgr baseline`: a whole model run alone, its reference logits and greedy steps saved with its speed.

Parsing and printing only: what runs is dgr.toolchain.parity's.
"""

from __future__ import annotations

from pathlib import Path

from dgr.cli.shared import add_schedule_args


def register(sub) -> None:
    """Add `dgr baseline` to the `dgr` parser."""
    p = sub.add_parser("baseline", help="run a whole model alone: reference logits and greedy steps, with its speed")
    p.add_argument("model", type=Path, help="a whole-model GGUF")
    add_schedule_args(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="where to write the baseline (.npz)")
    p.set_defaults(func=cmd_baseline)


def cmd_baseline(args) -> int:
    # lazy: dgr.toolchain.parity costs 102 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.parity import (baseline_meta, make_schedule, open_tokenizer, run_baseline, save_baseline,
                                      throughput)

    with open_tokenizer(args.model, args.lib) as tok:
        sched = make_schedule(tok, args.prompt, args.steps, args.n_ubatch)
        device = tok.memory().device or "host"  # the same model and library as the baseline run
    kv_dtype = args.kv_dtype or "f16"
    res = run_baseline(args.model, sched, args.lib, args.threads, kv_dtype)
    save_baseline(args.output, sched, res, baseline_meta(args.model, sched, res, kv_dtype, device))
    print(f"baseline: {args.model} ({len(sched.prompts)} session(s), prompt {[len(p) for p in sched.prompts]} tokens, "
          f"{sched.steps} steps, weights on {device}, KV cache {kv_dtype}) -> {args.output}")
    pre, dec = throughput(sched, res)
    print(f"  prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s")
    print(f"  greedy: {res.generated}")
    print(f"  numerics: {res.numerics}")
    return 0
