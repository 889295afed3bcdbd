"""`dgr bench` subcommands: benchmarks that are not tests (`soak`: concurrent sessions for minutes, errors and
RSS; `tls`: what mutual TLS costs per hop against plaintext, side by side)."""

from __future__ import annotations


def _soak(args) -> int:
    from dgr.app.soak import run_soak, write_json

    rep = run_soak(args.minutes, stages=args.stages, sessions=args.sessions, fake=args.fake,
                   max_tokens=args.max_tokens, threads=args.threads)
    print(rep.table())
    if args.json:
        write_json(rep, args.json)
    return 0 if not rep.errors else 1


def _tls(args) -> int:
    import json

    from dgr.app.tlscost import measure

    rep = measure(stages=args.stages, tokens=args.max_tokens, rounds=args.rounds, threads=args.threads)
    print(rep.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.as_dict(), f, indent=2)
    return 0 if rep.same_text else 1


def register(sub) -> None:
    """Add `dgr bench` to the `dgr` parser."""
    bench = sub.add_parser("bench", help="benchmarks: soak, tls")
    bsub = bench.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    p = bsub.add_parser("soak", help="N concurrent sessions generating over a local route for M minutes; "
                                     "errors by code and every process's RSS at start and end")
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--stages", type=int, default=3, help="worker processes, one per stage (default 3)")
    p.add_argument("--sessions", type=int, default=4, help="concurrent client sessions (default 4)")
    p.add_argument("--fake", action="store_true",
                   help="the fake engine (no build, fast) instead of the SmolLM2 bundle `dgr demo` builds")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per generation (default 48)")
    p.add_argument("--threads", type=int, default=0, help="engine threads per worker (0: cores / stages)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.set_defaults(func=_soak)

    t = bsub.add_parser("tls", help="per-hop overhead of a mutual-TLS route against a plaintext one, the same "
                                    "SmolLM2 bundle, generations alternating")
    t.add_argument("--stages", type=int, default=3)
    t.add_argument("--rounds", type=int, default=5, help="generations per route, alternating (default 5)")
    t.add_argument("--max-tokens", type=int, default=48, help="tokens per generation (default 48)")
    t.add_argument("--threads", type=int, default=1, help="engine threads per worker (default 1)")
    t.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    t.set_defaults(func=_tls)
