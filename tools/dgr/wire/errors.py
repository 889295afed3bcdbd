"""Typed errors of the wire, raised by the client: each names the hop and says what to do.

A worker answers `dgr.v1.WireError` frames; `from_proto` turns them into these classes.
"""

from __future__ import annotations

from dgr.errors import WireError
from dgr.wire.gen import stage_pb2 as pb


class StageError(WireError):
    """A hop answered a typed error (`code` is the dgr.v1.ErrorCode name, `hop` says where)."""

    code = "ERROR_UNSPECIFIED"

    def __init__(self, message: str, *, hop: str = "", held: int = 0, expected: int = 0):
        super().__init__(f"{hop}: {message}" if hop and not message.startswith(hop) else message)
        self.hop, self.held, self.expected = hop, held, expected


class RemoteCacheMiss(StageError):
    code = "CACHE_MISS"


class RemoteSchemaMismatch(StageError):
    code = "SCHEMA_MISMATCH"


class WrongStage(StageError):
    code = "WRONG_STAGE"


class WrongRange(StageError):
    code = "WRONG_RANGE"


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


def from_proto(err: pb.WireError) -> StageError:
    name = pb.ErrorCode.Name(err.code)
    cls = _BY_CODE.get(name, StageError)
    return cls(err.message, hop=err.hop, held=err.held, expected=err.expected)


def to_proto(code: int, message: str, hop: str, *, held: int = 0, expected: int = 0) -> pb.WireError:
    return pb.WireError(code=code, message=message, hop=hop, held=held, expected=expected)
