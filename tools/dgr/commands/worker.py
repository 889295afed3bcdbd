"""`dgr worker serve`: one stage of a bundle (or of the fake model) served over gRPC until SIGTERM."""

from __future__ import annotations

import signal
import threading

from dgr.constants import DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX
from dgr.errors import WireError


def register(sub) -> None:
    """Add `dgr worker ...` to the `dgr` parser."""
    from dgr.wire.codec import DEFAULT_MAX_MESSAGE_BYTES

    w = sub.add_parser("worker", help="run a shard worker")
    wsub = w.add_subparsers(dest="worker_command", metavar="ACTION", required=True)
    s = wsub.add_parser("serve", help="serve one stage of a bundle over gRPC (dgr.v1.Stage)")
    s.add_argument("--bundle", help="bundle folder (manifest.json and stage files)")
    s.add_argument("--fake-engine", metavar="SPEC",
                   help="serve a stage of the numpy fake model SPEC instead (tests), e.g. 'layers=6,cuts=2:4'")
    s.add_argument("--stage", type=int, required=True, help="stage index in the bundle")
    s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free one)")
    s.add_argument("--lane", default=None, help="backend lane to advertise; must be the engine's own (default: "
                   "the lane the engine library was built for)")
    s.add_argument("--wire-dtype", default=None, help="f32 | f16 | bf16 (default: the bundle's)")
    s.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    s.add_argument("--max-batch-tokens", type=int, default=512)
    s.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX, help="positions per session (real engine)")
    s.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                   help="concurrent sessions (real engine)")
    s.add_argument("--threads", type=int, default=0, help="engine compute threads (0: the engine's default)")
    s.set_defaults(func=_serve)


def _serve(args) -> int:
    from dgr.app import stages
    from dgr.contract import DEFAULT_WIRE_DTYPE
    from dgr.wire.worker import serve

    if bool(args.bundle) == bool(args.fake_engine):
        raise WireError("give exactly one of --bundle BUNDLE or --fake-engine SPEC")
    if args.fake_engine:
        engine, ident = stages.fake_stage(args.fake_engine, args.stage, args.wire_dtype or DEFAULT_WIRE_DTYPE)
    else:
        engine, ident = stages.bundle_stage(args.bundle, args.stage, lane=args.lane, wire_dtype=args.wire_dtype,
                                            n_ctx=args.n_ctx, max_sessions=args.max_sessions,
                                            n_threads=args.threads)
    server, worker, address = serve(engine, ident, args.listen, max_message_bytes=args.max_message_bytes,
                                    max_batch_tokens=args.max_batch_tokens)
    info = worker.info
    where = f", {ident.lane} lane, weights on {engine.memory().device or 'the host'}"
    print(f"dgr worker: stage {ident.stage_index} [{info.layer_begin}, {info.layer_end}) of bundle "
          f"{ident.bundle_id}{where} serving on {address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    worker.stop()
    server.stop(2).wait()
    engine.close()
    return 0
