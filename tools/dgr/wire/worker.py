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
dgr.wire.origin (generation control at stage 0).
"""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dgr.engine_api import ShardEngine
from dgr.errors import WireError
from dgr.wire import codec
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from dgr.wire.links import channel_options
from dgr.wire.servicer import StageWorker
from dgr.wire.state import StageIdentity

__all__ = ["SERVICE_NAME", "StageIdentity", "StageWorker", "channel_options", "serve"]

SERVICE_NAME = "dgr.v1.Stage"


def serve(engine: ShardEngine, identity: StageIdentity, listen: str, *,
          max_message_bytes: int = codec.DEFAULT_MAX_MESSAGE_BYTES, max_batch_tokens: int = 512,
          threads: int | None = None) -> tuple[grpc.Server, StageWorker, str]:
    """Start serving; returns (server, worker, bound address). Port 0 picks a free port."""
    info = engine.describe()
    # no SO_REUSEPORT: a second worker on a taken port must fail, not silently share its connections
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads or info.max_sessions * 2 + 16),
                         options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)])
    host, _, port = listen.rpartition(":")
    try:
        bound = server.add_insecure_port(listen)
    except RuntimeError:
        bound = 0
    if not host or bound == 0:
        raise WireError(f"cannot listen on {listen!r}: give HOST:PORT with a free port (port 0 picks one)")
    # errors name this hop by its address; a wildcard listen address names no machine, the host name does
    address = f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{bound}"
    worker = StageWorker(engine, identity, address=address, max_message_bytes=max_message_bytes,
                         max_batch_tokens=max_batch_tokens)
    pb_grpc.add_StageServicer_to_server(worker, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, worker, address
