"""`dgr` subcommands of the wire area's client side: generate, demo, wire protoc (`dgr worker`: commands/worker.py)."""

from __future__ import annotations

import sys

from dgr.core.log import get_logger

log = get_logger(__name__)


def add_route_args(p, *, waits_for_route: bool = False) -> None:
    """What every client of a route takes (`dgr generate`, `dgr serve`): the route with its replicas,
    how long to wait, how often to recover, and TLS to the workers. `waits_for_route`: --timeout also
    bounds the wait for stages that are not up yet when the route is opened (RouteClient.connect_wait)."""
    from dgr.runtime.wire.client import DEFAULT_ATTEMPTS, DEFAULT_HOP_DEADLINE

    p.add_argument("--route", required=True,
                   help="HOST:PORT,... stage 0 first; replicas of a stage in preference order separated by "
                        "'|' (quote it: \"A,B1|B2,C\")")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for a token from a route whose hops all answer (a slow route)" +
                        ("; also how long to wait, when the route is opened, for a stage that is not up yet "
                         "(a worker starting or restarting: retried, one line on stderr says which) before "
                         "giving up naming it" if waits_for_route else "") + " (default %(default)s)")
    p.add_argument("--hop-deadline", type=float, default=DEFAULT_HOP_DEADLINE, metavar="S",
                   help="after S seconds without a reply, probe every hop with deadline S; a hop that does "
                        "not answer is routed around (default %(default)s)")
    p.add_argument("--attempts", type=int, default=DEFAULT_ATTEMPTS, metavar="N",
                   help="failed attempts (dead, stopped or emptied hops) recovered from before giving up "
                        "(default %(default)s)")
    p.add_argument("--tls-cert", metavar="FILE", help="this client's certificate (TLS to the route)")
    p.add_argument("--tls-key", metavar="FILE", help="its key")
    p.add_argument("--tls-ca", metavar="FILE", help="the CA the workers' certificates come from (mTLS)")
    p.add_argument("--allow-mixed-numerics", action="store_true",
                   help="run a route whose stages compute different bits (other builds, instruction sets or kernel "
                        "switches: docs/numerics.md) instead of refusing it; its results then match no whole-model "
                        "run, and every result says it is not exact")


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    from dgr.runtime.wire.codec import DEFAULT_MAX_MESSAGE_BYTES

    g = sub.add_parser("generate", help="generate text through a route of stage workers")
    add_route_args(g, waits_for_route=True)
    g.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate (default %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on through the model's end-of-generation ids (eos) up to --max-tokens, printing "
                        "their text (often empty) like any other token's; without it generation stops at the "
                        "first (benchmarks and parity runs want fixed lengths)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chunk-tokens", type=int, default=64,
                   help="prefill tokens per frame (smaller chunks let the stages overlap)")
    g.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    g.add_argument("--stats", action="store_true", help="print tokens/s and per-hop timing to stderr")
    g.add_argument("--logits-out", metavar="FILE.npz",
                   help="save the logits row of every sampled position (parity checks)")
    g.add_argument("--speculate", choices=["ngram", "mtp"], metavar="SOURCE",
                   help="speculative decoding: drafts from SOURCE (ngram: prompt lookup at the origin; mtp: the "
                        "model's MTP block on the last stage, a bundle built with bundle.include_mtp = true) "
                        "verified in the same trip round the ring; the same tokens, fewer rings")
    g.add_argument("--draft-k", type=int, default=4, metavar="K", help="most drafts per ring (with --speculate)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill the whole prompt and keep nothing of it in the stages' prefix caches (the text is "
                        "the same: the cache is exact)")
    g.add_argument("prompt")
    g.set_defaults(func=_generate)

    d = sub.add_parser("demo", help="SmolLM2 split over local worker processes vs the whole model")
    d.add_argument("--stages", type=int, default=3)
    d.add_argument("--max-tokens", type=int, default=32)
    d.add_argument("--prompt", default="The capital of France is")
    d.add_argument("--threads", type=int, default=0,
                   help="compute threads per worker (0: the CPU count divided by the stages)")
    d.add_argument("--prefill-tokens", type=int, default=256, help="also time prefill of a prompt this long (0: skip)")
    d.set_defaults(func=_demo)

    p = sub.add_parser("wire", help="wire protocol maintenance")
    psub = p.add_subparsers(dest="wire_command", metavar="ACTION", required=True)
    pc = psub.add_parser("protoc", help="regenerate the committed Python stubs from proto/dgr/v1")
    pc.add_argument("--check", action="store_true", help="only report drift (exit 1 on drift)")
    pc.set_defaults(func=_protoc)


def _generate(args) -> int:
    from dgr.runtime.wire.client import RouteClient, parse_route
    from dgr.runtime.wire.tls import TlsConfig

    route = parse_route(args.route)
    tls = TlsConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    # a user who just (re)started a worker gets a wait within --timeout, not "connection refused"
    with RouteClient(route, max_message_bytes=args.max_message_bytes, timeout=args.timeout,
                     chunk_tokens=args.chunk_tokens, tls=tls, hop_deadline=args.hop_deadline,
                     attempts=args.attempts, connect_wait=args.timeout,
                     allow_mixed_numerics=args.allow_mixed_numerics) as client:
        stops = [] if args.ignore_eos else list(client.hops[-1].eos_token_ids)
        for ev in client.generate(args.prompt, max_new_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                  logits="last" if args.logits_out else "none", speculate=args.speculate,
                                  draft_k=args.draft_k, stop_token_ids=stops,
                                  prefix_cache=not args.no_prefix_cache):
            if ev.token_id not in stops:        # the end-of-generation token ends the text; it is not printed
                sys.stdout.write(ev.text)       # (the gateway does the same)
                sys.stdout.flush()
        sys.stdout.write("\n")
        if not client.last.exact:
            print("dgr: not exact: this route mixes numerics (" + "; ".join(
                f"stage {i}: {n}" for i, n in enumerate(client.last.numerics)) + ")", file=sys.stderr)
        if args.logits_out:
            import numpy as np

            gen = client.last
            pos = sorted(gen.logits)
            np.savez(args.logits_out, token_ids=np.array(gen.token_ids, np.int32),
                     prompt_ids=np.array(gen.prompt_ids, np.int32), positions=np.array(pos, np.int32),
                     logits=np.stack([gen.logits[p] for p in pos]) if pos else np.zeros((0, 0), np.float32))
        if args.stats:
            from dgr.runtime.wire.stats import summarize

            print(summarize(client.last, len(route)), file=sys.stderr)
    return 0


def _demo(args) -> int:
    from dgr.app.demo import run_demo

    return run_demo(stages=args.stages, max_tokens=args.max_tokens, prompt=args.prompt,
                    prefill_tokens=args.prefill_tokens, threads=args.threads)


def _protoc(args) -> int:
    from dgr.toolchain import protogen

    if args.check:
        bad = protogen.drift()
        if bad:
            log.error("stubs out of date: %s; run `dgr wire protoc`", ", ".join(bad))
            return 1
        print("stubs match proto/")
        return 0
    for path in protogen.write():
        print(path)
    return 0
