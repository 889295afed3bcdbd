"""Helpers for the emulated-WAN tests: a TCP echo server and a sink, each on loopback in this process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


def _serve(handler) -> tuple[socket.socket, str]:
    srv = socket.create_server(("127.0.0.1", 0))

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=handler, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv, f"127.0.0.1:{srv.getsockname()[1]}"


def _stop(srv: socket.socket) -> None:
    try:
        srv.shutdown(socket.SHUT_RDWR)                  # wakes the accept() thread (close() alone does not)
    except OSError:
        pass
    srv.close()


@contextlib.contextmanager
def echo_server() -> Iterator[str]:
    """HOST:PORT of a server that sends back whatever it gets, and half-closes when its peer does."""
    def echo(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                c.sendall(data)
            c.shutdown(socket.SHUT_WR)

    srv, address = _serve(echo)
    try:
        yield address
    finally:
        _stop(srv)


@contextlib.contextmanager
def sink_server() -> Iterator[tuple[str, list[tuple[float, int]]]]:
    """HOST:PORT of a server that reads and drops everything, and the (monotonic time, bytes) of each read."""
    reads: list[tuple[float, int]] = []

    def sink(c: socket.socket) -> None:
        with c:
            while data := c.recv(65536):
                reads.append((time.monotonic(), len(data)))

    srv, address = _serve(sink)
    try:
        yield address, reads
    finally:
        _stop(srv)


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += data
    return bytes(out)
