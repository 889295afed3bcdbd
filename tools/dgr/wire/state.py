"""The state every part of a stage worker shares: what the stage is, its sessions, its typed errors and counts.

`StageState` is the base of the worker's parts (servicer, scheduler, links, origin; dgr.wire.worker
composes them): it holds the engine, the stage's identity and contract, the session table and the one
lock that guards it. The records below (`Session`, `Work`) are what those parts pass each other.
`WorkerMetrics` is what the parts count (Prometheus, a registry per worker: docs/wire.md "Metrics and
the descriptor"), and `StageState.descriptor()` what the worker advertises (dgr.descriptor).
"""

from __future__ import annotations

import collections
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dgr import descriptor as dd
from dgr.engine_api import ShardEngine
from dgr.wire import codec
from dgr.wire.codec import hop_name
from dgr.wire.gen import stage_pb2 as pb

# Ends a frame queue: the request iterator of an outgoing stream, or the reply stream of an incoming one.
END = object()
# Put on an incoming stream's reply queue when the worker drains: the stream ends UNAVAILABLE.
DRAIN = object()
# The sender of a frame that never crossed the network (a one-stage route's token back into itself).
LOCAL = object()


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


@dataclass(frozen=True)
class StageIdentity:
    """What the engine's StageInfo does not know: where the stage comes from."""

    model: str
    bundle_id: str
    stage_index: int
    stage_count: int
    upstream_commit: str = ""
    patch_series: str = ""
    lane: str = "cpu"
    engine: str = "llama.cpp"
    wire_dtype: str = "f32"
    eos_token_ids: tuple[int, ...] = ()  # every end-of-generation id (llama_vocab_is_eog), the eos first
    chat_template: str = ""                # the model's own (tokenizer.chat_template), for gateways
    engine_blake3: str = ""                # blake3 of the engine library file (fake: of its source)


class WireFault(Exception):
    """A frame the worker refuses: becomes a dgr.v1.WireError answered to the sender."""

    def __init__(self, code: int, message: str, held: int = 0, expected: int = 0, retry_after_ms: int = 0):
        super().__init__(message)
        self.code, self.message, self.held, self.expected = code, message, held, expected
        self.retry_after_ms = retry_after_ms


@dataclass
class Session:
    session_id: str
    epoch: int
    route: list
    hop_index: int
    sampling: pb.Sampling
    logits: int
    # origin (stage 0) only:
    client: queue.Queue | None = None  # reply stream of the client's Frames call
    max_new: int = 0
    stop_ids: frozenset = frozenset()
    produced: int = 0
    context_ids: list = field(default_factory=list)
    text: str = ""
    done: bool = False
    failed: bool = False
    # bounded resources: when it last did anything (a session opened and never used is idle from the
    # start), and the positions its cache holds (the engine's n_cached after its last step)
    last_used: float = field(default_factory=time.monotonic)
    held: int = 0
    # mTLS: who opened it at this stage (the previous hop, or the client at stage 0); at the origin,
    # who may send its tokens back (the last hop) and its errors (any hop of the route)
    opener: str | None = None
    returner: str | None = None
    route_members: frozenset = frozenset()
    # speculation (docs/speculation.md). At the origin: the draft source (dgr.wire.drafts) and its k,
    # the tokens the session has run (prompt + generated: where drafts are looked up), whether every hop
    # can roll back. On every stage: the first draft position of its last speculative step, below which
    # a rollback never drops positions.
    drafter: object | None = None
    draft_k: int = 0
    history: list = field(default_factory=list)
    can_roll_back: bool = False
    no_roll_back: str = ""             # the hops that cannot roll back, named
    spec_cap: int = 17                 # positions a step may carry without being split into frames
    spec_floor: int | None = None
    # the last stage: it already told the origin, on a new stream, that its stream there broke (once)
    told_origin: bool = False
    # the native data plane (dgr.wire.native): registered with this stage's plane; at the origin, every
    # hop has one and the session asks only for what it does (greedy, no logits rows, no speculation),
    # and `native_decoding` once its decode was handed over
    native: bool = False
    native_decoding: bool = False


@dataclass
class Work:
    """One queued step: the frame, where errors about it go, and its decoded boundary."""

    frame: pb.Frame
    reply: queue.Queue | None          # where errors about this frame go
    t_recv: int
    x: np.ndarray | None = None
    transit_ns: int = 0


class StageState:
    """The engine, the stage, its sessions. `lock` guards the sessions and every part's shared tables
    (queued steps, links); `engine_lock` makes sure the engine is never called from two threads at once."""

    def __init__(self, engine: ShardEngine, identity: StageIdentity, *, address: str, max_message_bytes: int,
                 limits: Limits | None = None, tls=None):
        self.engine, self.identity = engine, identity
        self.limits = limits or Limits()
        self.tls = tls                                  # dgr.wire.tls.TlsConfig, or None: plaintext
        self.member = member_name(tls)
        self.info = engine.describe()
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.dtype = codec.dtype_code(identity.wire_dtype)
        self.contract = self.info.contract.with_dtype(identity.wire_dtype)   # the engine's, in the wire dtype
        # Token ids always travel with the boundary (a few bytes a token), so any later stage that owns
        # token-id layers (V4's hash layers) has them; token_ids=True says this sender provides them.
        out = self.contract.boundary_out
        self._boundary_in = self.contract.boundary_in
        self._boundary_out = None if out is None else out.model_copy(update={"token_ids": True})
        self.engine_lock = threading.Lock()
        self.lock = threading.RLock()                   # sessions, pending, links
        self.sessions: dict[tuple[str, int], Session] = {}
        self.latest_epoch: dict[str, int] = {}
        self.stopping = False
        self.reaped_sessions = 0
        self.overloaded = 0
        self.streams: set[queue.Queue] = set()          # reply queues of the incoming Frames streams
        # what the worker reports about itself (Describe's descriptor, the metrics endpoint)
        self.started = time.monotonic()
        self.restarts = 0                               # a supervisor's count; 0 when not supervised
        self.certificates: tuple[dd.HeldCertificate, ...] = ()   # those matching this identity exactly
        self.metrics_url = ""                           # set by dgr.wire.worker.serve when it serves metrics
        self.memory = engine.memory()                   # refreshed by the engine thread (Describe never waits)
        self.memory_at = self.started
        self.step_times = {"decode": collections.deque(maxlen=STEP_TIMES_KEPT),
                           "prefill": collections.deque(maxlen=STEP_TIMES_KEPT)}   # (compute_ns, queue_ns)
        self.errors: collections.Counter = collections.Counter()   # WireError code name -> answered
        self.metrics = WorkerMetrics(self)
        self.native = None                              # dgr.wire.native.NativePlane (--data-plane native)

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and self.tls.mutual

    @property
    def hop(self) -> str:
        return hop_name(self.identity.stage_index, self.address)

    def schema_in(self) -> pb.BoundarySchema | None:
        b = self._boundary_in
        return None if b is None else codec.schema_msg(b, self.identity.bundle_id, self.info.layer_begin)

    def schema_out(self) -> pb.BoundarySchema | None:
        b = self._boundary_out
        return None if b is None else codec.schema_msg(b, self.identity.bundle_id, self.info.layer_end)

    def _err(self, code: int, message: str, **kw) -> pb.WireError:
        self._count_error(code)
        return pb.WireError(code=code, message=f"{self.hop}: {message}", hop=self.hop, **kw)

    def _count_error(self, code: int) -> None:
        """Count a typed error this worker answers (Describe's descriptor, dgr_worker_errors_total)."""
        name = pb.ErrorCode.Name(code)
        self.errors[name] += 1
        self.metrics.errors[name].inc()

    def descriptor(self) -> dd.Descriptor:
        """What this worker advertises now (dgr.descriptor): identity, capacity, load, seam cost, health,
        security and the certificates it holds."""
        i, idn, lim, m = self.info, self.identity, self.limits, self.memory
        sessions = list(self.sessions.values())
        b_in, b_out = self._boundary_in, self._boundary_out
        return dd.Descriptor(
            address=self.address,
            identity=dd.CompatIdentity(
                model=idn.model, bundle_id=idn.bundle_id, stage_index=idn.stage_index, stage_count=idn.stage_count,
                layer_begin=i.layer_begin, layer_end=i.layer_end, n_layer=i.n_layer,
                upstream_commit=idn.upstream_commit, patch_series=idn.patch_series, lane=idn.lane, arch=i.arch,
                engine=idn.engine, engine_blake3=idn.engine_blake3, wire_dtype=idn.wire_dtype),
            capacity=dd.Capacity(
                max_sessions=i.max_sessions, n_ctx=i.n_ctx, max_queued_steps=lim.max_queued_steps,
                max_session_steps=lim.max_session_steps, max_batch_tokens=lim.max_batch_tokens,
                max_message_bytes=self.max_message_bytes, session_ttl_s=float(lim.session_ttl_s),
                memory=dd.Memory(weights_bytes=m.weights_bytes, kv_bytes=m.kv_bytes, compute_bytes=m.compute_bytes,
                                 device_weights_bytes=m.device_weights_bytes, device=m.device),
                decode=step_times(self.step_times["decode"]), prefill=step_times(self.step_times["prefill"])),
            load=dd.Load(open_sessions=len(sessions), queued_steps=int(getattr(self, "n_pending", 0)),
                         cached_positions=sum(s.held for s in sessions)),
            seam=dd.SeamCost(seam_in=None if b_in is None else dd.Seam.of(b_in, i.layer_begin),
                             seam_out=None if b_out is None else dd.Seam.of(b_out, i.layer_end)),
            health=dd.Health(serving=not self.stopping, uptime_s=time.monotonic() - self.started,
                             errors=dict(self.errors), reaped_sessions=self.reaped_sessions,
                             overloaded=self.overloaded, restarts=self.restarts),
            security=dd.Security(tls=self.tls is not None, mutual_tls=self.mutual_tls, member=self.member),
            certificates=tuple(self.certificates), metrics=self.metrics_url)

    def _reply_error(self, reply: queue.Queue | None, frame: pb.Frame, err: pb.WireError) -> None:
        if reply is not None:
            reply.put(pb.Frame(session_id=frame.session_id, epoch=frame.epoch, error=err))


STEP_TIMES_KEPT = 1024                 # steps of each kind the descriptor's medians are over
# step latencies: 0.1 ms .. 10 s
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def step_times(times) -> dd.StepTimes:
    """Median and 90th percentile (nearest rank) of (compute_ns, queue_ns) pairs, in ms."""
    pairs = list(times)
    if not pairs:
        return dd.StepTimes(steps=0, compute_ms_median=0.0, compute_ms_p90=0.0, queue_ms_median=0.0,
                            queue_ms_p90=0.0)
    compute, wait = sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)
    p90 = lambda xs: xs[min(len(xs) - 1, int(0.9 * len(xs)))] / 1e6     # noqa: E731
    return dd.StepTimes(steps=len(pairs), compute_ms_median=statistics.median(compute) / 1e6,
                        compute_ms_p90=p90(compute), queue_ms_median=statistics.median(wait) / 1e6,
                        queue_ms_p90=p90(wait))


class WorkerMetrics:
    """A worker's Prometheus metrics in a registry of its own (several workers may share a process).
    Events are counted where they happen (a counter's inc or a histogram's observe, nothing more);
    gauges and the counts the state already keeps are read from it at scrape time."""

    def __init__(self, state: "StageState"):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        kw = dict(namespace="dgr_worker", registry=r)
        steps = Counter("steps", "engine steps run (one session's frame of positions)", ["kind"], **kw)
        tokens = Counter("tokens", "positions run through the engine", ["kind"], **kw)
        self.steps = {k: steps.labels(k) for k in ("decode", "prefill")}
        self.tokens = {k: tokens.labels(k) for k in ("decode", "prefill")}
        self.sampled = Counter("tokens_sampled", "tokens sampled (last stage)", **kw)
        self.opened = Counter("sessions_opened", "sessions opened here", **kw)
        self.queue = Histogram("step_queue_seconds", "a step's wait for the engine thread",
                               buckets=LATENCY_BUCKETS, **kw)
        self.compute = Histogram("step_compute_seconds", "the engine call a step ran in",
                                 buckets=LATENCY_BUCKETS, **kw)
        transit = Histogram("frame_transit_seconds", "from the sender handing a frame to gRPC to this worker "
                            "reading it (wall clocks): steps in, tokens back at the origin", ["frame"],
                            buckets=LATENCY_BUCKETS, **kw)
        self.transit = {k: transit.labels(k) for k in ("step", "token")}
        errors = Counter("errors", "typed errors this worker answered, by dgr.v1.ErrorCode", ["code"], **kw)
        self.errors = {n: errors.labels(n) for n in pb.ErrorCode.keys() if n != "ERROR_UNSPECIFIED"}
        seam = Counter("seam_bytes", "boundary bytes across this worker's seams (layer: the seam's global "
                       "layer index)", ["direction", "layer"], **kw)
        info = state.info
        self.seam_in = None if info.is_first else seam.labels("received", str(info.layer_begin))
        self.seam_out = None if info.is_last else seam.labels("sent", str(info.layer_end))
        r.register(_StateCollector(state))

    def step(self, n_tokens: int, queue_ns: int, compute_ns: int) -> str:
        kind = "decode" if n_tokens == 1 else "prefill"
        self.steps[kind].inc()
        self.tokens[kind].inc(n_tokens)
        self.queue.observe(queue_ns / 1e9)
        self.compute.observe(compute_ns / 1e9)
        return kind


class _StateCollector:
    """What the state already knows, read at scrape time: load, sessions, reaping, OVERLOADED, uptime."""

    def __init__(self, state: "StageState"):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, idn = self.state, self.state.identity
        sessions = list(s.sessions.values())
        g = lambda name, doc, v: GaugeMetricFamily(f"dgr_worker_{name}", doc, value=v)   # noqa: E731
        yield g("sessions_open", "open sessions", len(sessions))
        yield g("queued_steps", "steps queued for the engine", int(getattr(s, "n_pending", 0)))
        yield g("cached_positions", "positions held over all open sessions", sum(x.held for x in sessions))
        yield g("uptime_seconds", "seconds since the worker started", time.monotonic() - s.started)
        yield g("max_frame_bytes_sent", "largest frame sent so far", int(getattr(s, "max_frame_bytes_sent", 0)))
        yield CounterMetricFamily("dgr_worker_sessions_reaped", "sessions closed after --session-ttl idle",
                                  value=s.reaped_sessions)
        yield CounterMetricFamily("dgr_worker_overloaded", "requests answered OVERLOADED", value=s.overloaded)
        info = GaugeMetricFamily("dgr_worker_info", "what this worker serves (always 1)",
                                 labels=["model", "bundle_id", "stage", "stage_count", "layers", "lane", "engine"])
        info.add_metric([idn.model, idn.bundle_id, str(idn.stage_index), str(idn.stage_count),
                         f"{s.info.layer_begin}-{s.info.layer_end}", idn.lane, idn.engine], 1)
        yield info


def member_name(tls) -> str:
    """The common name of this worker's own certificate ("" without TLS): what its peers see of it."""
    if tls is None:
        return ""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    except (OSError, ValueError):
        return ""
    return ",".join(sorted(a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)))


__all__ = ["DRAIN", "END", "LOCAL", "Limits", "Session", "StageIdentity", "StageState",
           "WireFault", "WorkerMetrics", "Work", "member_name", "step_times"]
