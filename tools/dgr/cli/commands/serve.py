"""`dgr serve`: the OpenAI-compatible gateway (dgr.app.gateway) over a route of stage workers."""

from __future__ import annotations

import sys
from pathlib import Path

from dgr.app.gateway.limits import DEFAULT_CHAT_MAX_TOKENS
from dgr.cli.shared import add_route_args
from dgr.core.errors import WireError
from dgr.core.log import get_logger
from dgr.runtime.wire.tls import TlsConfig, is_loopback

log = get_logger(__name__)


def register(sub) -> None:
    """Add `dgr serve` to the `dgr` parser."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP gateway (/v1/chat/completions, ...) over a route")
    add_route_args(s)
    s.add_argument("--listen", default="127.0.0.1:8000",
                   help="HOST:PORT of the HTTP listener (port 0 picks a free one; default %(default)s)")
    s.add_argument("--model-name", metavar="NAME",
                   help="the model id clients ask for (default: the model the route's workers describe)")
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own tokenizer.chat_template")
    s.add_argument("--max-tokens-default", metavar="N", type=int, default=DEFAULT_CHAT_MAX_TOKENS,
                   help="tokens a chat request that gives no max_tokens may generate (default %(default)s; "
                        "0: until the context is full); /v1/completions keeps OpenAI's 16")
    s.add_argument("--speculate", choices=["none", "ngram", "mtp"], default="none",
                   help="the draft source of a request that names none (a request's own `speculate` field wins): "
                        "ngram (prompt lookup) or mtp (the model's MTP block: a bundle built with "
                        "bundle.include_mtp = true); the same tokens, fewer trips round the ring (default none)")
    s.add_argument("--draft-k", type=int, default=4, metavar="K", help="most drafts per ring (default 4)")
    s.add_argument("--https-cert", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--https-key", metavar="FILE", help="... and this key")
    s.add_argument("--insecure", action="store_true",
                   help="allow plain HTTP on a non-loopback address (e.g. behind a TLS-terminating proxy)")
    s.add_argument("--log-level", default="warning", help="uvicorn's log level (default %(default)s)")
    s.set_defaults(func=_serve)


def _serve(args) -> int:
    # lazy: dgr.app.gateway.app costs 627 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.gateway.app import create_app
    from dgr.app.gateway.route import RouteBackend
    from dgr.app.gateway.server import GatewayServer

    if bool(args.https_cert) != bool(args.https_key):
        raise WireError("give both --https-cert and --https-key (or neither)")
    host = args.listen.rpartition(":")[0].strip("[]")
    if not args.https_cert and not args.insecure and not is_loopback(host):
        raise WireError(f"refusing to serve plain HTTP on {args.listen}: give --https-cert/--https-key, or "
                        "--insecure behind a proxy that terminates TLS")
    max_tokens = args.max_tokens_default
    if max_tokens < 0:
        raise WireError(f"--max-tokens-default {max_tokens}: give a number of tokens >= 1, or 0 to let a chat "
                        "request without max_tokens run until the context is full")
    template = source = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise WireError(f"--chat-template {args.chat_template}: cannot read it ({why}); give a UTF-8 Jinja "
                            "file") from None
        if not template.strip():
            raise WireError(f"--chat-template {args.chat_template}: the file is empty; give a Jinja chat template "
                            "(or drop the flag to use the model's own)")
        source = f"--chat-template {Path(args.chat_template).resolve()}"
    tls = TlsConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    backend = RouteBackend(args.route, tls=tls, timeout=args.timeout, hop_deadline=args.hop_deadline,
                           attempts=args.attempts, model_name=args.model_name, chat_template=template,
                           chat_template_source=source, allow_mixed_numerics=args.allow_mixed_numerics)
    try:
        app = create_app(backend, max_tokens_default=max_tokens, speculate=args.speculate, draft_k=args.draft_k)
    except ValueError as err:
        backend.close()
        raise WireError(str(err)) from None
    server = GatewayServer(app, args.listen,
                           ssl_certfile=args.https_cert, ssl_keyfile=args.https_key, log_level=args.log_level)
    info = backend.info
    log.info("gateway: %d-stage route %s; a chat request without max_tokens stops after %s", info.stages,
             args.route, f"{max_tokens} tokens" if max_tokens else "the context is full")
    print(f"serving {info.name} on {server.url} (OpenAI API at {server.url}/v1, metrics at {server.url}/metrics)",
          flush=True)
    try:
        server.run()
    finally:
        backend.close()
    print("gateway stopped", file=sys.stderr)
    return 0
