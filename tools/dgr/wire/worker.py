"""The stage worker: one gRPC server per stage, over a ShardEngine (real or fake); `serve` starts one.

Threads: gRPC's pool runs the handlers; one reader thread per incoming frame stream turns frames into
queued steps; one engine thread takes queued steps of different sessions into one `engine.forward`
batch and hands each result on (next hop, or sampled token to the origin); one reader thread per
outgoing link watches the peer's replies (typed errors) and notices when the peer dies.

Ring: stage 0 is the route's origin. The client streams token ids into stage 0; each stage streams its
boundary straight to the next hop; the last stage samples and sends the token straight to stage 0, which
queues the next decode step itself and streams the token to the client. Errors about a frame go back one
hop on the reply stream of the stream it came on; a worker receiving an error from its next hop sends it
to the origin, which hands it to the client. docs/wire.md says why.

Parts, one job each, composed into `StageWorker` (dgr.wire.servicer): dgr.wire.state (the stage, its
sessions, the shared records), dgr.wire.servicer (the gRPC Stage servicer: describe, open/close,
incoming frame streams and their checks), dgr.wire.scheduler (queued steps batched into engine calls),
dgr.wire.links (results into frames, and the streams to the next hop and back to the origin),
dgr.wire.origin (generation control at stage 0). Here: `serve` (listen, plaintext or TLS; the metrics
endpoint) and `drain` (SIGTERM: everything stopped within a bound).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dgr.descriptor import HeldCertificate
from dgr.engine_api import ShardEngine
from dgr.errors import WireError
from dgr.log import get_logger
from dgr.wire import codec
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.links import channel_options, server_options
from dgr.wire.native import DATA_PLANES, NativePlane
from dgr.wire.servicer import StageWorker
from dgr.wire.state import DRAIN, Limits, StageIdentity
from dgr.wire.tls import TlsConfig, add_port, check_listen

__all__ = ["SERVICE_NAME", "Limits", "StageIdentity", "StageWorker", "channel_options", "drain", "hard_exit",
           "serve", "start_metrics"]

SERVICE_NAME = "dgr.v1.Stage"
log = get_logger(__name__)


def serve(engine: ShardEngine, identity: StageIdentity, listen: str, *,
          max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, max_batch_tokens: int | None = None,
          threads: int | None = None, limits: Limits | None = None, tls: TlsConfig | None = None,
          insecure: bool = False, metrics_listen: str | None = None,
          certificates: tuple[HeldCertificate, ...] = (), data_plane: str = "grpc") -> tuple[grpc.Server, StageWorker, str]:
    """Start serving; returns (server, worker, bound address). Port 0 picks a free port. A listener other
    machines can reach needs `tls` (or `insecure=True`). `metrics_listen`: also serve Prometheus text at
    http(s)://HOST:PORT/metrics (`worker.metrics_url`; TLS as the worker's). `certificates`: those the
    worker advertises (already checked against its identity: dgr.app.stages.held_certificates).
    `data_plane`: "native" also starts the native data plane (dgr.wire.native) on the same host."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise WireError(f"cannot listen on {listen!r}: give HOST:PORT with a free port (port 0 picks one)")
    check_listen(listen, tls, insecure)
    if metrics_listen is not None:
        mhost, _, mport = metrics_listen.rpartition(":")
        if not mhost or not mport.isdigit():
            raise WireError(f"--metrics-listen {metrics_listen!r}: give HOST:PORT (port 0 picks a free one)")
        check_listen(metrics_listen, tls, insecure)
    if data_plane not in DATA_PLANES:
        raise WireError(f"--data-plane {data_plane!r}: choose one of {', '.join(DATA_PLANES)}")
    if data_plane == "native" and tls is not None:
        raise WireError("--data-plane native has no TLS yet (its frames are plaintext TCP): serve TLS routes with "
                        "--data-plane grpc")
    limits = limits or Limits()
    if max_batch_tokens is not None:
        limits = Limits(**{**limits.__dict__, "max_batch_tokens": max_batch_tokens})
    info = engine.describe()
    # no SO_REUSEPORT: a second worker on a taken port must fail, not silently share its connections
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads or info.max_sessions * 2 + 16),
                         options=[*server_options(max_message_bytes), ("grpc.so_reuseport", 0)])
    bound = add_port(server, listen, tls)
    if not host or bound == 0:
        raise WireError(f"cannot listen on {listen!r}: give HOST:PORT with a free port (port 0 picks one)")
    # errors name this hop by its address; a wildcard listen address names no machine, the host name does
    address = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{bound}"
    worker = StageWorker(engine, identity, address=address, max_message_bytes=max_message_bytes,
                         limits=limits, tls=tls)
    worker.certificates = tuple(certificates)
    if data_plane == "native":
        try:
            worker.native = NativePlane(engine, host, identity.stage_index)
            worker.native.configure(limits.max_batch_sessions, limits.hold_batch)
            for sid, epoch, pos in limits.die_at:
                worker.native.die_at(sid, epoch, pos)
        except BaseException:
            worker.stop()
            server.stop(0)
            raise
        if host in ("0.0.0.0", "[::]"):                 # advertise a name other machines can use
            worker.native.address = f"{address.rpartition(':')[0]}:{worker.native.address.rpartition(':')[2]}"
        if worker.info.is_first:
            worker.native.run_events(worker._on_native_event)
    if metrics_listen is not None:
        try:
            start_metrics(worker, metrics_listen)
        except BaseException:
            worker.stop()
            server.stop(0)
            raise
    pb_grpc.add_StageServicer_to_server(worker, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    worker.server, worker.health = server, health_servicer
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, worker, address


def start_metrics(worker: StageWorker, listen: str) -> str:
    """Serve the worker's registry as Prometheus text on `listen` (HTTPS with the worker's certificate
    under TLS, client certificates from its CA under mTLS); returns the URL, also `worker.metrics_url`."""
    from prometheus_client import start_http_server

    host, _, port = listen.rpartition(":")
    t = worker.tls
    kw = {} if t is None else dict(certfile=str(t.cert), keyfile=str(t.key),
                                   client_cafile=str(t.ca) if t.ca else None, client_auth_required=t.mutual)
    try:
        httpd, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=worker.metrics.registry, **kw)
    except OSError as err:
        raise WireError(f"cannot serve metrics on {listen}: {err.strerror or err}: give a free HOST:PORT "
                        "(port 0 picks one)") from None
    worker.metrics_server = httpd
    name = socket.gethostname() if host in ("0.0.0.0", "[::]") else host
    worker.metrics_url = f"{'https' if t else 'http'}://{name}:{httpd.server_port}/metrics"
    return worker.metrics_url


def drain(worker: StageWorker, timeout: float | None = None) -> None:
    """SIGTERM: stop accepting, fail open streams with a clear error, close the sessions, stop the
    server with a grace and join the threads, all within `timeout` (the caller's watchdog exits
    the process if anything still hangs)."""
    timeout = worker.limits.drain_timeout_s if timeout is None else timeout
    end = time.monotonic() + timeout
    left = lambda: max(0.0, end - time.monotonic())          # noqa: E731
    worker.stopping = True
    if worker.health is not None:
        worker.health.enter_graceful_shutdown()
    with worker.lock:
        sessions = list(worker.sessions.values())
        streams = list(worker.streams)
    bye = "is shutting down (SIGTERM): the session is closed; use another replica"
    for sess in sessions:                          # tell the clients (through the origin) first
        err = pb.Frame(session_id=sess.session_id, epoch=sess.epoch,
                       error=worker._err(pb.HOP_UNREACHABLE, f"{worker.hop} {bye}"))
        try:
            if worker.info.is_first:
                if sess.client is not None and not sess.done:
                    sess.client.put(err)
            elif sess.route[0].address != worker.address:
                worker._send(sess.route[0].address, 0, err, sess)
        except Exception:                          # noqa: BLE001  (best effort: the hop may be gone)
            log.debug("could not tell the origin of %s", sess.session_id, exc_info=True)
    time.sleep(min(0.2, left()))                   # let those errors leave before the streams end
    for out in streams:
        out.put(DRAIN)
    with worker.lock:
        worker.sessions.clear()
        worker.pending.clear()
        worker.n_pending = 0
        worker.wake.notify_all()
    if worker.engine_lock.acquire(timeout=min(1.0, left())):
        try:
            for sess in sessions:
                worker.engine.close_session(sess.session_id, sess.epoch)
        except Exception:                          # noqa: BLE001
            log.warning("closing sessions failed while draining", exc_info=True)
        finally:
            worker.engine_lock.release()
    worker.stop()
    if worker.server is not None:
        worker.server.stop(grace=min(1.0, left())).wait(left())
    for t in (worker.engine_thread, worker.reaper):
        t.join(min(1.0, left()))
    if worker.engine_lock.acquire(timeout=min(1.0, left())):
        try:
            worker.engine.close()
        finally:
            worker.engine_lock.release()
    else:
        log.warning("the engine is still busy after %.1f s of draining; exiting without closing it", timeout)


def hard_exit(code: int, why: str) -> None:
    """The last resort of a drain that hangs: leave now, whatever thread is stuck where."""
    if why:
        log.error("%s: exiting now", why)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:                              # noqa: BLE001
            pass
    os._exit(code)
