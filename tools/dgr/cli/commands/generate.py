"""`dgr generate`: text through a route of stage workers (dgr.runtime.wire.client), printed as it comes."""

from __future__ import annotations

import sys

import numpy as np

from dgr.cli.shared import add_route_args
from dgr.runtime.wire.client import RouteClient, parse_route
from dgr.runtime.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from dgr.runtime.wire.stats import summarize
from dgr.runtime.wire.tls import TlsConfig


def register(sub) -> None:
    """Add `dgr generate` to the `dgr` parser."""
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


def _generate(args) -> int:
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
            gen = client.last
            pos = sorted(gen.logits)
            np.savez(args.logits_out, token_ids=np.array(gen.token_ids, np.int32),
                     prompt_ids=np.array(gen.prompt_ids, np.int32), positions=np.array(pos, np.int32),
                     logits=np.stack([gen.logits[p] for p in pos]) if pos else np.zeros((0, 0), np.float32))
        if args.stats:
            print(summarize(client.last, len(route)), file=sys.stderr)
    return 0
