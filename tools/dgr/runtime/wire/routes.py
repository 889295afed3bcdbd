"""Routes as the client sees them: parsing `A,B1|B2,C`, and naming why a hop cannot be reached (not up yet,
refused by TLS, no replica answering)."""

from __future__ import annotations

import grpc

from dgr.core.errors import WireError
from dgr.runtime.wire.errors import HopUnreachable, StageError


def parse_route(text: str) -> list[list[str]]:
    """`A,B1|B2,C` -> [["A"], ["B1", "B2"], ["C"]]: stages in order, each a list of replicas
    (HOST:PORT) in preference order."""
    if not text or not text.strip():
        raise WireError("the route is empty: give HOST:PORT of every stage, stage 0 first (A,B1|B2,C)")
    out = []
    for i, hop in enumerate(text.split(",")):
        reps = [r.strip() for r in hop.split("|")]
        if not all(reps):
            raise WireError(f"route {text!r}: stage {i} {'is empty' if not hop.strip() else 'has an empty replica'}"
                            ": give HOST:PORT for every stage, replicas separated by '|' (A,B1|B2,C)")
        for r in reps:
            host, _, port = r.rpartition(":")
            if not host or not port.isdigit():
                raise WireError(f"route {text!r}: stage {i}: {r!r} is not HOST:PORT")
        out.append(list(dict.fromkeys(reps)))
    return out


def tls_refused(detail: str) -> bool:
    """A TLS peer drops a plaintext or untrusted client while it connects: what gRPC says then."""
    low = detail.lower()
    return any(s in low for s in ("ssl", "tls", "handshake", "certificate")) or \
        ("failed to connect" in low and "socket closed" in low)


def not_up(err: grpc.RpcError, timeout: float) -> str | None:
    """Why a hop cannot be reached, in a few words, when it may come up by itself (a worker starting,
    restarting in place, or too busy to answer in time); None when waiting cannot help: a TLS refusal,
    a name that does not resolve, or any answer from a worker."""
    detail = (err.details() or "").strip()
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {timeout:g} s"
    if err.code() != grpc.StatusCode.UNAVAILABLE or tls_refused(detail) or "dns" in detail.lower():
        return None
    low = detail.lower()
    return next((s for s in ("connection refused", "connection reset", "no route to host",
                             "network is unreachable") if s in low), "unavailable")


def unreachable(hop: str, what: str, err: grpc.RpcError, *, tls: bool) -> HopUnreachable:
    """The error for a hop that did not answer `what` (with a hint: is it running, or which TLS side is wrong)."""
    detail, hint = (err.details() or "").strip(), "is it running?"
    if tls_refused(detail):
        hint = ("TLS refused: give --tls-cert/--tls-key (and --tls-ca) from the CA the workers trust"
                if not tls else "TLS refused: is this certificate from the CA the worker trusts, "
                "and does the worker's certificate name this host?")
    return HopUnreachable(f"{what}: {err.code().name}{': ' + detail if detail else ''}: {hint}", hop=hop)


def no_answer(hop: str, errors: list[StageError], down: dict[str, str], waited: float) -> StageError:
    """The error for a stage when none of its replicas answered (after waiting `waited` s for those
    in `down`)."""
    if down and len(down) == len(errors):
        what = (f"still unreachable after waiting {waited:g} s ({next(iter(down.values()))})" if len(down) == 1
                else f"no replica came up within {waited:g} s: " +
                " or ".join(f"{a} ({r})" for a, r in down.items()))
        return HopUnreachable(f"{what}: start its worker (dgr worker serve ... --listen {' or '.join(down)}), "
                              "correct the route, or wait longer (dgr generate --timeout S)", hop=hop)
    if len(errors) == 1:
        return errors[0]
    return type(errors[-1])("no replica of this stage answers: " + "; ".join(str(e) for e in errors),
                            hop=hop)
