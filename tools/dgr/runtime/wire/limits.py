"""What a worker bounds, and how long it waits: the defaults of `dgr worker serve`'s flags, which the front
end passes to dgr-worker explicitly (docs/worker.md); dgr-worker's own defaults for them are generated from
`Limits` (worker/server/wire_constants.h, dgr.toolchain.cppgen: `dgr wire protoc`)."""

from __future__ import annotations

from dataclasses import dataclass

# Sampling.top_logprobs: the most alternatives a draw reports (OpenAI's bound). dgr-worker refuses more
# (MAX_TOP_LOGPROBS in worker/server/wire_constants.h, generated from this one: dgr.toolchain.cppgen).
MAX_TOP_LOGPROBS = 20

# Reconnecting to a worker (the client's channels and dgr-worker's links alike: worker/server/wire_constants.h
# is generated from these three, dgr.toolchain.cppgen). After a failed attempt the next starts
# RECONNECT_INITIAL_MS later, the pause growing to RECONNECT_MAX_MS, so a worker restarted in place is found
# again soon; one attempt (TCP, TLS, HTTP/2's SETTINGS) may take CONNECT_TIMEOUT_MS. gRPC reads that from
# "grpc.min_reconnect_backoff_ms": 200 ms there made a busy or far worker unreachable (a TSan-built worker on
# a 2-core host, CI 2026-12-05).
RECONNECT_INITIAL_MS = 200
RECONNECT_MAX_MS = 2000
CONNECT_TIMEOUT_MS = 5000


def reconnect_options() -> list[tuple[str, int]]:
    """gRPC channel options for the reconnect pauses and the connection attempt's timeout above."""
    return [("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS)]


@dataclass(frozen=True)
class Limits:
    """What a worker bounds, and how long it waits (`dgr worker serve` flags; docs/wire.md)."""

    max_batch_tokens: int = 512
    max_batch_sessions: int = 64         # sessions whose steps share one engine forward (1: none shared)
    # tests only: run a forward only when steps of this many sessions wait (or of every session open
    # here, when fewer are), so sharing is certain rather than likely (0: off). Results never depend on it.
    hold_batch: int = 0
    # tests only: the worker kills itself (SIGKILL) when about to run the step of (session, epoch) at
    # position: a kill -9 at an exact point of a generation, which no timing can move
    die_at: tuple[tuple[str, int, int], ...] = ()
    max_queued_steps: int = 512          # per worker: steps queued for the engine before OVERLOADED
    max_session_steps: int = 128         # per session (128 chunks of 64 tokens: an 8192-token prompt)
    session_ttl_s: float = 300.0         # idle sessions are reaped after this long (0: never)
    rpc_timeout_s: float = 5.0           # deadline per hop of the RPCs a worker makes (open/close chains)
    drain_timeout_s: float = 5.0         # SIGTERM: everything is stopped within this bound
    # a link gives up on a peer this long after an unanswered keepalive ping; a ping waits behind the
    # boundary bytes queued ahead of it, so a thin link carrying a long prefill needs more (docs/wan.md)
    link_keepalive_timeout_s: float = 2.0
    # the prefix cache: what closed sessions' KV held, kept for later sessions that begin with the same tokens
    # (docs/worker.md "Prefix cache"; 0: off)
    prefix_cache_mib: int = 256
    # speculation and MTP drafts (docs/speculation.md): the drafts one step may carry and still roll back where the
    # cache keeps per-step snapshots (DeepSeek V4 and other hybrids llama.cpp rolls back; 0: those cannot roll
    # back). The default is the engine's DGR_MTP_MAX_K (worker/engine/dgr_engine.h; tests/wire/test_wire_mtp.py checks)
    draft_max: int = 8
