"""The native data plane (worker/engine/dgr_dataplane.h), from the control plane's side.

`dgr worker serve --data-plane native` starts one `NativePlane` next to the gRPC server: a TCP listener
in the engine library whose threads run a session's decode steps round the ring in C++ (frames in,
engine step, frames out, the last stage's draw back to the origin), without Python on the way. Python keeps
everything else: describe, open/close, the prefill, the client's stream. A session goes native when
every hop of its route has a plane and it asks for what the plane does (any sampling, no logits rows or
the sampled row, no speculation, an f32 boundary, a plaintext route); any other session runs on the gRPC plane as before. The frame layout
is documented in proto/dgr/v1/native.md; `FRAME_FIXED_BYTES` and `HOP_BYTES` here are checked against it
and against the C++ (tests/test_native_plane.py).
"""

from __future__ import annotations

import ctypes as C
import threading

from dgr.errors import WireError

FRAME_MAGIC = 0x4E524744                 # "DGRN" (DGR_DP_MAGIC)
FRAME_FIXED_BYTES = 48
HOP_BYTES = 36
MAX_HOPS = 64                            # DGR_DP_MAX_HOPS
MAX_BODY_BYTES = 1 << 24                 # a receiver refuses a larger frame body (MAX_BODY)
KIND_TOKEN, KIND_ERROR = 2, 3
E_UNREACHABLE, E_CACHE_MISS, E_ENGINE, E_UNKNOWN, E_CONTEXT_FULL = 1, 2, 3, 4, 5
DATA_PLANES = ("grpc", "native")


class _Hop(C.Structure):
    _fields_ = [("stage_index", C.c_int32), ("queue_ns", C.c_int64), ("compute_ns", C.c_int64),
                ("wire_ns", C.c_int64), ("transit_ns", C.c_int64)]


class Event(C.Structure):
    _fields_ = [("session_id", C.c_char * 128), ("epoch", C.c_int64), ("kind", C.c_int32),
                ("token_id", C.c_int32), ("position", C.c_int32), ("done", C.c_int32),
                ("error_code", C.c_int32), ("stage_index", C.c_int32), ("ring_ns", C.c_int64),
                ("return_ns", C.c_int64), ("n_hops", C.c_int32), ("hops", _Hop * MAX_HOPS),
                ("message", C.c_char * 512), ("n_logits", C.c_int32)]


def _bind(lib: C.CDLL) -> None:
    if getattr(lib, "_dgr_dp_bound", False):
        return
    if not hasattr(lib, "dgr_dp_start"):
        raise WireError("this engine library has no native data plane (built before it): rebuild it with "
                        "`dgr build-engine`, or serve with --data-plane grpc")
    v, i32, i64, cp, p = C.c_void_p, C.c_int32, C.c_int64, C.c_char_p, C.POINTER
    lib.dgr_dp_start.argtypes = [v, cp, i32, i32, p(v), p(i32)]
    lib.dgr_dp_start.restype = i32
    lib.dgr_dp_stop.argtypes = [v]
    lib.dgr_dp_stop.restype = None
    lib.dgr_dp_session.argtypes = [v, cp, i64, cp, i32, C.c_double, i32, C.c_double, C.c_uint64]
    lib.dgr_dp_forget.argtypes = [v, cp, i64]
    lib.dgr_dp_decode.argtypes = [v, cp, i64, i32, i32, i32, p(i32), i32]
    lib.dgr_dp_next_event.argtypes = [v, i32, p(Event), p(C.c_float), i32]
    lib.dgr_dp_last_used.argtypes = [v, cp, i64]
    lib.dgr_dp_last_used.restype = i64
    lib.dgr_dp_die_at.argtypes = [v, cp, i64, i32]
    lib.dgr_dp_die_at.restype = i32
    lib.dgr_dp_configure.argtypes = [v, i32, i32]
    lib.dgr_dp_configure.restype = i32
    lib.dgr_dp_counts.argtypes = [v, p(i64), p(i64)]
    lib.dgr_dp_counts.restype = None
    for name in ("dgr_dp_session", "dgr_dp_forget", "dgr_dp_decode", "dgr_dp_next_event"):
        getattr(lib, name).restype = i32
    lib.dgr_sample.argtypes = [p(C.c_float), i32, C.c_double, i32, C.c_double, C.c_uint64, i64]
    lib.dgr_sample.restype = i32
    lib.dgr_exp_fixed.argtypes = [C.c_double]
    lib.dgr_exp_fixed.restype = C.c_double
    lib.dgr_uniform.argtypes = [C.c_uint64, i64]
    lib.dgr_uniform.restype = C.c_double
    lib._dgr_dp_bound = True


class NativeSampler:
    """The C++ sampler of the native plane (`dgr_sample`) from Python: tests hold it against
    dgr.wire.sampling.sample, which must draw the same token."""

    def __init__(self, lib: C.CDLL):
        _bind(lib)
        self._lib = lib

    def sample(self, logits, *, temperature=0.0, top_k=0, top_p=0.0, seed=0, position=0) -> int:
        import numpy as np

        row = np.ascontiguousarray(logits, dtype=np.float32)
        return self._lib.dgr_sample(row.ctypes.data_as(C.POINTER(C.c_float)), len(row), temperature, top_k,
                                    top_p, seed, position)

    def exp_fixed(self, d: float) -> float:
        return self._lib.dgr_exp_fixed(d)

    def uniform(self, seed: int, position: int) -> float:
        return self._lib.dgr_uniform(seed, position)


class NativePlane:
    """A started plane over `engine` (a dgr.engine.Engine: the real engine only) on `host` (port 0:
    a free one); `address` is HOST:PORT for the other stages."""

    def __init__(self, engine, host: str, stage_index: int, port: int = 0):
        lib = getattr(engine, "_lib", None)
        if lib is None:
            raise WireError("--data-plane native needs the llama.cpp engine (a bundle), not --fake-engine")
        _bind(lib)
        self._lib, self._engine = lib, engine
        h, bound = C.c_void_p(), C.c_int32()
        if lib.dgr_dp_start(engine._handle(), host.encode(), port, stage_index, C.byref(h), C.byref(bound)) != 0:
            raise WireError(f"cannot start the native data plane on {host}:{port}: is the port free?")
        self._h = h
        self.address = f"{host}:{bound.value}"
        n_vocab = engine.describe().n_vocab
        self._row = (C.c_float * max(1, n_vocab))()     # the event thread's logits buffer
        self._lock = threading.Lock()
        self._closing = False
        self._events: threading.Thread | None = None

    def run_events(self, on_event) -> None:
        """Origin: call `on_event(Event, logits_row)` for every token and error, on a thread of its own."""
        def loop():
            while not self._closing:
                try:
                    got = self.next_event(200)
                except EOFError:
                    return
                if got is not None:
                    on_event(*got)

        self._events = threading.Thread(target=loop, daemon=True, name="native-events")
        self._events.start()

    def session(self, session_id: str, epoch: int, next_address: str, logits: bool = False,
                sampling=None) -> None:
        """Register a session: its next hop's plane ("" on the last stage); `logits`: each token comes
        with the row it was drawn from (LOGITS_LAST); `sampling`: its dgr.v1.Sampling (None: greedy)."""
        t, k, p, s = ((sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
                      if sampling is not None else (0.0, 0, 0.0, 0))
        self._lib.dgr_dp_session(self._h, session_id.encode(), epoch, next_address.encode(), int(logits),
                                 t, k, p, s)

    def forget(self, session_id: str, epoch: int) -> None:
        if self._h is not None:
            self._lib.dgr_dp_forget(self._h, session_id.encode(), epoch)

    def decode(self, session_id: str, epoch: int, position: int, token: int, max_new: int,
               stop_ids) -> None:
        stop = list(stop_ids)
        arr = (C.c_int32 * max(1, len(stop)))(*stop)
        if self._lib.dgr_dp_decode(self._h, session_id.encode(), epoch, position, token, max_new, arr, len(stop)):
            raise WireError(f"session {session_id} epoch {epoch} is not registered on this native plane")

    def next_event(self, timeout_ms: int = 200) -> tuple[Event, bytes] | None:
        """The next token or error at the origin, with the token's logits row (float32 little-endian
        bytes, b"" without one); None when there is none yet. Raises EOFError once stopped. (One
        thread calls it: the row buffer is reused.)"""
        ev = Event()
        if self._h is None:
            raise EOFError("the native plane stopped")
        rc = self._lib.dgr_dp_next_event(self._h, timeout_ms, C.byref(ev), self._row, len(self._row))
        if rc < 0:
            raise EOFError("the native plane stopped")
        if rc != 1:
            return None
        return ev, C.string_at(self._row, 4 * ev.n_logits) if ev.n_logits else b""

    def last_used_ns(self, session_id: str, epoch: int) -> int:
        return self._lib.dgr_dp_last_used(self._h, session_id.encode(), epoch) if self._h is not None else 0

    def configure(self, max_batch_sessions: int, hold_batch: int = 0) -> None:
        """At most `max_batch_sessions` sessions per forward; `hold_batch` > 0 (tests) runs a forward only
        when steps of that many sessions wait (or of every session registered here, when fewer are)."""
        if self._lib.dgr_dp_configure(self._h, max_batch_sessions, hold_batch) != 0:
            raise WireError(f"native plane: max_batch_sessions {max_batch_sessions} must be >= 1 and "
                            f"hold_batch {hold_batch} >= 0")

    def die_at(self, session_id: str, epoch: int, position: int) -> None:
        """Tests: SIGKILL this process when about to run that step (dgr_dp_die_at)."""
        self._lib.dgr_dp_die_at(self._h, session_id.encode(), epoch, position)

    def counts(self) -> tuple[int, int]:
        """(steps run, engine forwards): their ratio is the plane's batching."""
        s, f = C.c_int64(), C.c_int64()
        self._lib.dgr_dp_counts(self._h, C.byref(s), C.byref(f))
        return s.value, f.value

    def stop(self) -> None:
        """Stop the event thread first (it waits inside the plane), then the plane."""
        self._closing = True
        if self._events is not None and self._events is not threading.current_thread():
            self._events.join(5)
        with self._lock:
            h, self._h = self._h, None
        if h is not None:
            self._lib.dgr_dp_stop(h)
