"""The reconnect pauses and the connection attempt's timeout: defined once, in dgr.runtime.wire.limits
(dgr-worker's copy, worker/server/wire_constants.h, is generated from it: tests/wire/test_cpp_tables.py), and
every channel a worker opens to a peer must use them."""

from __future__ import annotations

import re

from dgr.runtime.wire import limits

from support.paths import REPO

SERVER = REPO / "worker" / "server"


def _cpp_constants() -> dict[str, int]:
    text = (SERVER / "wire_constants.h").read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}


def test_the_worker_and_the_client_reconnect_alike():
    cpp = _cpp_constants()      # generated from limits: equal unless the header drifted (test_cpp_tables.py)
    for name in ("RECONNECT_INITIAL_MS", "RECONNECT_MAX_MS", "CONNECT_TIMEOUT_MS"):
        assert cpp.get(name) == getattr(limits, name), (name, cpp.get(name), getattr(limits, name))
    # a connection attempt is given longer than the first pause: a busy or far peer is not "unreachable"
    assert limits.CONNECT_TIMEOUT_MS > limits.RECONNECT_INITIAL_MS
    opts = dict(limits.reconnect_options())
    assert opts == {"grpc.initial_reconnect_backoff_ms": limits.RECONNECT_INITIAL_MS,
                    "grpc.min_reconnect_backoff_ms": limits.CONNECT_TIMEOUT_MS,
                    "grpc.max_reconnect_backoff_ms": limits.RECONNECT_MAX_MS}


def test_every_channel_the_worker_opens_sets_the_three():
    """A channel made without them gets gRPC's defaults (1 s first pause, 120 s at most), so a peer restarted
    in place would wait behind a long backoff; one with a literal would drift from the client."""
    for path in sorted(SERVER.rglob("*.cpp")):
        text = path.read_text()
        if "CreateCustomChannel" not in text or path.name == "probe.cpp":   # --probe: one attempt, its own deadline
            continue
        for arg, const in (("GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS", "RECONNECT_INITIAL_MS"),
                           ("GRPC_ARG_MIN_RECONNECT_BACKOFF_MS", "CONNECT_TIMEOUT_MS"),
                           ("GRPC_ARG_MAX_RECONNECT_BACKOFF_MS", "RECONNECT_MAX_MS")):
            sets = re.findall(rf"SetInt\({arg},\s*(\w+)\)", text)
            assert sets and set(sets) == {const}, (path.name, arg, sets)
            assert text.count("CreateCustomChannel") == len(sets), (path.name, arg)
