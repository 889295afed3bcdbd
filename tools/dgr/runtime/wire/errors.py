"""Typed errors of the wire, raised by the client: each names the hop and says what to do.

A worker answers `dgr.v1.WireError` frames; `from_proto` turns them into these classes. `gave_up`
makes the error a route client raises when recovery runs out of attempts: every hop tried, and why.
"""

from __future__ import annotations

import re

from dgr.core.errors import WireError
from dgr.runtime.wire.gen import stage_pb2 as pb


class StageError(WireError):
    """A hop answered a typed error (`code` is the dgr.v1.ErrorCode name, `hop` says where)."""

    code = "ERROR_UNSPECIFIED"

    def __init__(self, message: str, *, hop: str = "", held: int = 0, expected: int = 0,
                 retry_after_ms: int = 0):
        super().__init__(f"{hop}: {message}" if hop and not message.startswith(hop) else message)
        self.hop, self.held, self.expected, self.retry_after_ms = hop, held, expected, retry_after_ms
        self.failures: list = []        # set by `gave_up`: every failed attempt of a route client

    @property
    def stage(self) -> int | None:
        """The stage index this error names ("stage I (HOST:PORT)", dgr.runtime.wire.codec.hop_name), if any."""
        return hop_stage(self.hop)


class RemoteCacheMiss(StageError):
    code = "CACHE_MISS"


class RemoteSchemaMismatch(StageError):
    code = "SCHEMA_MISMATCH"


class WrongStage(StageError):
    code = "WRONG_STAGE"


class WrongRange(StageError):
    code = "WRONG_RANGE"


class MixedNumerics(StageError):
    """A hop computes other bits than the rest of the route (docs/numerics.md): refused unless the client
    allows mixed numerics. Raised by the client itself; no worker sends it."""

    code = "MIXED_NUMERICS"


class UnknownSession(StageError):
    code = "UNKNOWN_SESSION"


class StaleEpoch(StageError):
    code = "STALE_EPOCH"


class Overloaded(StageError):
    code = "OVERLOADED"


class BadFrame(StageError):
    code = "BAD_FRAME"


class MessageTooLarge(StageError):
    code = "MESSAGE_TOO_LARGE"


class HopUnreachable(StageError):
    code = "HOP_UNREACHABLE"


class RemoteEngineError(StageError):
    code = "ENGINE"


class InternalError(StageError):
    code = "INTERNAL"


_BY_CODE = {cls.code: cls for cls in StageError.__subclasses__()}


# Errors after which a new epoch can succeed: the hop died, stalled or lost the session's cache. The rest
# (wrong stage, schema, range, bad frame, engine, oversized message) fail the same way on a retry.
RECOVERABLE = (HopUnreachable, RemoteCacheMiss, UnknownSession, StaleEpoch, Overloaded)
_HOP = re.compile(r"^stage (\d+) \((.+)\)$")


def hop_stage(hop: str) -> int | None:
    m = _HOP.match(hop or "")
    return int(m.group(1)) if m else None


def from_proto(err: pb.WireError) -> StageError:
    name = pb.ErrorCode.Name(err.code)
    cls = _BY_CODE.get(name, StageError)
    return cls(err.message, hop=err.hop, held=err.held, expected=err.expected,
               retry_after_ms=getattr(err, "retry_after_ms", 0))


def gave_up(last: StageError, failures: list, routes: list[str]) -> StageError:
    """The error to raise when recovery stops: of `last`'s class (a caller catching HopUnreachable still
    does), naming every failed attempt (hop and why) and every route tried."""
    lines = [f"  attempt {n}: {f.hop or 'route'}: {f.why}" for n, f in enumerate(failures, 1)]
    tried = sorted({f.hop for f in failures if f.hop})
    err = type(last)(f"gave up after {len(failures)} failed attempt(s); hops that failed: {', '.join(tried)}; "
                     f"routes tried: {' then '.join(dict.fromkeys(routes))}\n" + "\n".join(lines) +
                     "\nrestart those workers, give more replicas (--route A,B1|B2,C) or raise --attempts",
                     hop=last.hop, held=last.held, expected=last.expected)
    err.failures = list(failures)
    return err


def to_proto(code: int, message: str, hop: str, *, held: int = 0, expected: int = 0) -> pb.WireError:
    return pb.WireError(code=code, message=message, hop=hop, held=held, expected=expected)
