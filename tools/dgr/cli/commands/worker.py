"""`dgr worker serve` (one stage of a bundle, or of the fake model, served by dgr-worker until SIGTERM) and
`dgr worker describe` (what a worker advertises: its descriptor).

`dgr worker serve` is the typed front end of `dgr-worker`, the C++ worker (docs/worker.md): it checks what
Python checks best (the flags, the listen address, the bundle's hashes with the workspace's resumable verify
state, a fake model's spec), then replaces itself with `dgr-worker` and the same flags.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from dgr.app.workerbin import worker_binary
from dgr.core.constants import DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX
from dgr.core.contract import WIRE_DTYPES
from dgr.core.errors import WireError
from dgr.runtime.engine_abi import KERNELS, LIB_ENV, library_path
from dgr.runtime.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.limits import Limits
from dgr.runtime.wire.tls import TlsConfig, channel, check_listen


def register(sub) -> None:
    """Add `dgr worker ...` to the `dgr` parser."""
    d = Limits()
    w = sub.add_parser("worker", help="run a shard worker")
    wsub = w.add_subparsers(dest="worker_command", metavar="ACTION", required=True)
    s = wsub.add_parser("serve", help="serve one stage of a bundle over gRPC (dgr.v1.Stage)")
    s.add_argument("--bundle", help="bundle folder (manifest.json and stage files)")
    s.add_argument("--fake-engine", metavar="SPEC",
                   help="serve a stage of the fake model SPEC instead (tests; worker/fake), e.g. 'layers=6,cuts=2:4'")
    s.add_argument("--stage", type=int, required=True, help="stage index in the bundle")
    s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks a free one); a non-loopback "
                   "address needs --tls-cert/--tls-key or --insecure")
    s.add_argument("--lane", default=None, help="backend lane to advertise; must be the engine's own (default: "
                   "the lane the engine library was built for)")
    s.add_argument("--wire-dtype", default=None, help=f"{' | '.join(WIRE_DTYPES)} (default: the bundle's; "
                   "their measured loss: docs/wire-dtypes.md)")
    s.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    s.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens)
    s.add_argument("--max-batch-sessions", type=int, default=d.max_batch_sessions, metavar="N",
                   help=f"sessions whose steps may share one engine forward (default {d.max_batch_sessions}; "
                        "1: no sharing). A session's results do not depend on it (docs/batching.md)")
    s.add_argument("--hold-batch", type=int, default=0, metavar="N",
                   help="tests: run a forward only when steps of N sessions wait (or of every session open "
                        "here, when fewer are): makes sharing certain (default 0: off)")
    s.add_argument("--test-die-at", action="append", default=[], metavar="SESSION:EPOCH:POSITION",
                   help=argparse.SUPPRESS)   # tests: SIGKILL itself about to run that step (Limits.die_at)
    s.add_argument("--test-stop-at", action="append", default=[], metavar="SESSION:EPOCH:POSITION",
                   help=argparse.SUPPRESS)   # tests: SIGSTOP itself about to run that step (a hung worker)
    # tests, dgr-worker only (docs/worker.md "Failures, drain, speculation, metrics"): about to run that step,
    # drop the session's engine cache (the step answers CACHE_MISS there), or fail the link to the session's origin
    s.add_argument("--test-evict-at", action="append", default=[], metavar="SESSION:EPOCH:POSITION",
                   help=argparse.SUPPRESS)
    s.add_argument("--test-break-origin-link-at", action="append", default=[], metavar="SESSION:EPOCH:POSITION",
                   help=argparse.SUPPRESS)
    s.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX, help="positions per session (real engine)")
    s.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                   help="concurrent sessions (real engine)")
    s.add_argument("--threads", type=int, default=0, help="engine compute threads (0: the engine's default)")
    s.add_argument("--poll", type=int, default=0, metavar="N", help="with --threads above 1: how long the compute "
                   "threads spin waiting for the next step before they sleep, ggml's polling level 0-100 (default 0: "
                   "at once, for a stage sharing its cores; 50: llama.cpp's default, for a dedicated host)")
    s.add_argument("--session-ttl", type=float, default=d.session_ttl_s, metavar="S",
                   help=f"close sessions idle for S seconds, freeing their cache (default {d.session_ttl_s:g}; "
                        "0: never); a session opened and never used counts as idle")
    s.add_argument("--max-queued-steps", type=int, default=d.max_queued_steps, metavar="N",
                   help=f"steps queued for the engine before OVERLOADED (default {d.max_queued_steps})")
    s.add_argument("--max-session-steps", type=int, default=d.max_session_steps, metavar="N",
                   help=f"steps one session may have queued before OVERLOADED (default {d.max_session_steps})")
    s.add_argument("--rpc-timeout", type=float, default=d.rpc_timeout_s, metavar="S",
                   help=f"deadline per hop of the RPCs this worker makes (default {d.rpc_timeout_s:g})")
    s.add_argument("--link-keepalive-timeout", type=float, default=d.link_keepalive_timeout_s, metavar="S",
                   help=f"give up on the next hop S seconds after an unanswered keepalive ping (default "
                        f"{d.link_keepalive_timeout_s:g}; a ping waits behind the boundary bytes ahead of it, so "
                        "thin links carrying long prompts need more)")
    s.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s, metavar="S",
                   help=f"SIGTERM: exit within S seconds whatever the sessions and streams do "
                        f"(default {d.drain_timeout_s:g})")
    s.add_argument("--prefix-cache-mib", type=int, default=d.prefix_cache_mib, metavar="N",
                   help="keep what closed sessions' KV held, for later sessions that begin with the same tokens, "
                        "up to N MiB, least recently used out (docs/worker.md \"Prefix cache\"; 0: off)")
    s.add_argument("--draft-max", type=int, default=d.draft_max, metavar="N",
                   help=f"the drafts one step may carry and still roll back where the cache keeps per-step snapshots "
                        f"(DeepSeek V4; each is one more copy of the recurrent state): speculation and MTP drafts "
                        f"(default {d.draft_max}; 0: such a stage cannot roll back)")
    s.add_argument("--tls-cert", metavar="F", help="this worker's certificate (PEM; `dgr certs issue`)")
    s.add_argument("--tls-key", metavar="F", help="its private key (PEM)")
    s.add_argument("--tls-ca", metavar="F", help="the operator's CA (PEM): peers must present a certificate it "
                   "signed (mutual TLS)")
    s.add_argument("--insecure", action="store_true", help="allow a plaintext listener on a non-loopback address")
    # the bounds below have their defaults in dgr-worker alone (worker/server/worker.h, serve.h): not given,
    # they are not passed, and `dgr-worker --help` and docs/worker.md "Bounds" say what applies
    s.add_argument("--advertise", metavar="HOST[:PORT]", help="the address other machines reach this worker at, "
                   "advertised and named in errors (for a wildcard --listen; default: the host name)")
    s.add_argument("--max-connections", type=int, metavar="N", help="connections with a Frames stream open; the "
                   "next is refused RESOURCE_EXHAUSTED (default: dgr-worker's)")
    s.add_argument("--max-rpc-threads", type=int, metavar="N", help="unary calls (Describe, OpenSession, ...) "
                   "running at once; as many more may wait (default: dgr-worker's)")
    s.add_argument("--max-rpc-per-member", type=int, metavar="N", help="unary calls one member may have running or "
                   "waiting here; the next is refused RESOURCE_EXHAUSTED (default: dgr-worker's)")
    s.add_argument("--send-timeout", type=float, metavar="S", help="the send deadline: a write to a peer that "
                   "waits longer fails that peer's stream or link (default: dgr-worker's)")
    s.add_argument("--max-send-queue-bytes", type=int, metavar="N", help="bytes queued per reply stream and per "
                   "outgoing link before it is failed (default: dgr-worker's)")
    s.add_argument("--handshake-timeout", type=float, metavar="S", help="a connection that has not finished its "
                   "TLS handshake and HTTP/2 preface by then is closed (default: dgr-worker's)")
    s.add_argument("--check-config", action="store_true", help="check everything a start checks (flags, address and "
                   "trust, TLS files, the stage file against the manifest, the engine opening it), print one line and "
                   "exit 0 without serving; else exit 1 saying what is wrong")
    s.add_argument("--fast-kernels", action="store_true", help="llama.cpp's shape-dependent fast CPU kernels instead "
                   "of the batch-invariant reference ones: faster prefill, but a session's results depend on the batch "
                   "and the stage's numerics say \"fast\", so clients refuse to mix it into a route of reference-kernel "
                   "stages (docs/numerics.md)")
    s.add_argument("--kernels", choices=list(KERNELS), help="the CPU kernel set: reference "
                   "(dgr-worker's default: each row alone), invariant (ggml's batch-invariant dispatch: also exact "
                   "under any batching, much faster prefill; docs/batching.md) or fast (what --fast-kernels gives). "
                   "Every stage of a route needs the same set: Describe's numerics name it")
    s.add_argument("--prefix-cache-shared", action="store_true", help="under mutual TLS, let any member's "
                   "session at stage 0 start from a prefix another member's session left (keys are hashed from what "
                   "ran, so no member can poison it; a hit tells a member that someone sent that prefix: "
                   "docs/security.md). Default: each member finds only its own")
    s.add_argument("--max-grammar-bytes", type=int, metavar="N", help="the largest sampling grammar or JSON schema "
                   "a session may ask for (default: dgr-worker's)")
    s.add_argument("--max-grammar-depth", type=int, metavar="N", help="how deeply a grammar's groups or a schema's "
                   "objects and arrays may nest (default: dgr-worker's)")
    s.add_argument("--max-sessions-per-member", type=int, metavar="N", help="the sessions one member (the "
                   "certificate that opened them, under mutual TLS) may hold here at once (default: dgr-worker's, 0: "
                   "only --max-sessions bounds them)")
    s.add_argument("--max-queued-steps-per-member", type=int, metavar="N", help="the steps one member's sessions "
                   "may have queued here at once; the next is refused OVERLOADED (default: dgr-worker's, 0: only "
                   "--max-queued-steps and --max-session-steps bound them)")
    s.add_argument("--max-rpc-memory-mib", type=int, metavar="N", help="gRPC's buffers, all connections together "
                   "(default: dgr-worker's)")
    s.add_argument("--peer-allow", metavar="CIDR,...", help="the networks a route's hops and origins may be in; a "
                   "name must resolve only to addresses inside them (default: anywhere)")
    s.add_argument("--metrics-listen", metavar="HOST:PORT", help="also serve Prometheus metrics at "
                   "http://HOST:PORT/metrics (https, and client certificates under --tls-ca, with TLS)")
    s.add_argument("--certs", metavar="DIR", help="certificates (`dgr certify`, DIR/*.json) to advertise: only "
                   "those for exactly this worker's identity and the contract's current hash; others are "
                   "logged and ignored")
    s.add_argument("--contract", metavar="FILE", help="the contract file certificates must still match "
                   "(default: the path each certificate records, from the checkout)")
    s.set_defaults(func=_serve, _parser=s)

    d = wsub.add_parser("describe", help="print what a worker advertises (its descriptor)")
    d.add_argument("address", metavar="HOST:PORT")
    d.add_argument("--json", action="store_true", help="the descriptor as JSON (docs/schemas/descriptor.schema.json)")
    d.add_argument("--timeout", type=float, default=10.0, metavar="S")
    d.add_argument("--tls-cert", metavar="F", help="client certificate (a worker with mTLS)")
    d.add_argument("--tls-key", metavar="F")
    d.add_argument("--tls-ca", metavar="F", help="the CA the worker's certificate comes from")
    d.set_defaults(func=_describe)


def _die_at(text: str, flag: str = "--test-die-at") -> tuple[str, int, int]:
    sid, _, rest = text.partition(":")
    epoch, _, pos = rest.partition(":")
    if not sid or not epoch.isdigit() or not pos.isdigit():
        raise WireError(f"{flag} {text!r}: give SESSION:EPOCH:POSITION")
    return sid, int(epoch), int(pos)


def _serve(args) -> int:
    if bool(args.bundle) == bool(args.fake_engine):
        raise WireError("give exactly one of --bundle BUNDLE or --fake-engine SPEC")
    for flag in ("max_queued_steps", "max_session_steps", "max_batch_sessions"):
        if getattr(args, flag) < 1:
            raise WireError(f"--{flag.replace('_', '-')} must be at least 1")
    tls = TlsConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    host, _, port = args.listen.rpartition(":")
    if host and port.isdigit():                         # (dgr-worker names a malformed address)
        check_listen(args.listen, tls, args.insecure)   # before the bundle is read: refuse fast
    for flag in ("test_die_at", "test_stop_at", "test_evict_at", "test_break_origin_link_at"):
        for x in getattr(args, flag):
            _die_at(x, "--" + flag.replace("_", "-"))
    _exec_worker(args)
    return 0                                            # (never: the process is dgr-worker now)


# flags of `dgr worker serve` that are Python's own: never passed to dgr-worker
_FRONT_END_ONLY = {"func", "_parser", "command", "worker_command"}


def worker_argv(args) -> list[str]:
    """`dgr worker serve`'s parsed flags as dgr-worker's arguments, every value explicit (Python's defaults
    are the ones that apply)."""
    out: list[str] = []
    for action in args._parser._actions:
        if not action.option_strings or action.dest in _FRONT_END_ONLY or action.dest == "help":
            continue
        flag, value = action.option_strings[0], getattr(args, action.dest, None)
        if isinstance(action, argparse._StoreTrueAction):
            out += [flag] if value else []
        elif isinstance(action, argparse._AppendAction):
            for v in value or ():
                out += [flag, str(v)]
        elif value is not None:
            out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return out


def _exec_worker(args) -> None:
    """Check what Python checks best (the bundle's hashes, with the workspace's resumable verify state; a
    fake model's spec and stage), then become dgr-worker with the same flags and the engine library this dgr
    would load (the fake one for --fake-engine, built on demand)."""
    env = dict(os.environ)
    extra = []
    if args.fake_engine:
        # lazy: dgr.testing.fake_engine costs 68 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.testing import fake_engine

        n = len(fake_engine.FakeModel.from_spec(args.fake_engine).ranges)
        if not 0 <= args.stage < n:
            raise WireError(f"fake bundle has {n} stages; there is no stage {args.stage}")
        env[fake_engine.LIB_ENV] = str(fake_engine.library_path())
    else:
        # lazy: dgr.app.stages costs 25 ms at start-up (python -X importtime, 2026-12-05)
        from dgr.app.stages import checked_bundle

        checked_bundle(args.bundle, args.stage)       # a tampered file is named before anything else
        extra = ["--no-verify"]                         # hashed just now: not read twice
    binary = worker_binary()
    env[LIB_ENV] = str(library_path().resolve())
    argv = [str(binary), *worker_argv(args), *extra]
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(binary, argv, env)


def _describe(args) -> int:
    # lazy: dgr.core.descriptor costs 7 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.core.descriptor import Descriptor

    tls = TlsConfig.from_args(args.tls_cert, args.tls_key, args.tls_ca)
    with channel(args.address, tls) as ch:
        try:
            d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            raise WireError(f"{args.address} did not answer Describe ({err.code().name}: {err.details()}): is a "
                            "worker serving there (and TLS as it expects: --tls-cert/--tls-key/--tls-ca)?") from None
    if not d.descriptor_json:
        raise WireError(f"{args.address} sent no descriptor: it runs a dgr older than this one, or its "
                        "descriptor failed (see its log)")
    desc = Descriptor.model_validate_json(d.descriptor_json)
    if args.json:
        print(desc.model_dump_json(indent=2))
        return 0
    print(desc.summary())
    # the engine's own word on its matrices' kernels (Describe's matmul_kernels; not part of the descriptor)
    if d.matmul_kernels:
        print(f"  matmul kernels: {d.matmul_kernels}")
    return 0
