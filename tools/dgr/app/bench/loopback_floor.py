"""The loopback floor `dgr bench` reports beside the per-hop overhead: what one bare message costs on this
machine between two processes, with no gRPC, no protobuf and no worker in the way.

A decode hop starts with the receiving worker asleep: its threads have waited about a ring's time for the
frame. Waking a sleeping process costs far more than a busy one does (on a 2-vCPU VM, about 25 us one way
right after the last message and 70-90 us after 5-15 ms idle: docs/worker-speed-plan.md), so the floor is
measured after the same idle gap: the sender sleeps `gap_ms`, stamps the monotonic clock and sends 8 bytes
over TCP loopback (TCP_NODELAY, as gRPC sets it); the receiver, a second Python process blocked in recv,
stamps the clock when the bytes arrive and sends its stamp back. The one-way time is the receiver's stamp
minus the sender's (one clock: CLOCK_MONOTONIC is shared by the processes of one machine). Python adds a
few microseconds per side, so the floor is an upper bound of the kernel's own cost.
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import time

STAMP = struct.Struct("<q")
MESSAGES_PER_ROUND = 60   # what dgr bench and dgr bench frames send per round: about a second at SmolLM2's ring time


def _recv_exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def _serve() -> None:
    """The receiver (`python -m dgr.app.bench.loopback_floor`): print its port, then answer each stamp with its own."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while _recv_exact(conn, STAMP.size) is not None:
        t_recv = time.monotonic_ns()
        conn.sendall(STAMP.pack(t_recv))


def one_way_ms(gap_ms: float, n: int = 100) -> dict[str, float]:
    """Median and p90 (ms) of `n` one-way loopback messages, each sent after `gap_ms` of idle."""
    if n < 1 or gap_ms < 0:
        raise ValueError(f"one_way_ms needs n >= 1 and gap_ms >= 0, got n={n}, gap_ms={gap_ms}")
    proc = subprocess.Popen([sys.executable, "-m", "dgr.app.bench.loopback_floor"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(n):
                time.sleep(gap_ms / 1e3)
                t_send = time.monotonic_ns()
                s.sendall(STAMP.pack(t_send))
                got = _recv_exact(s, STAMP.size)
                if got is None:
                    raise RuntimeError("the loopback floor's receiver closed its connection")
                times.append((STAMP.unpack(got)[0] - t_send) / 1e6)
    finally:
        proc.kill()
        proc.wait()
    times.sort()
    return {"gap_ms": gap_ms, "one_way_ms": statistics.median(times),
            "one_way_p90_ms": times[min(len(times) - 1, (len(times) * 9) // 10)], "messages": n}


if __name__ == "__main__":
    _serve()
