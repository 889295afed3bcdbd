"""An emulated WAN link per hop: a TCP forwarder that delays every byte by a set one-way delay in each
direction and optionally paces it to a bandwidth, counting what it carried.

Why a forwarder: this kernel has no `netem` (network namespaces, veth and tbf/htb work, but nothing
delays packets), so delay is made in userspace. Each chunk read from one side is stamped with the time
it may arrive at the other side, `t + one_way`, and a writer releases it then: the link keeps its
bandwidth (many chunks are in flight at once, as on a long fat pipe) and the delay is per byte, not per
message. With `mbit`, chunks are cut into segments and each is serialized at that rate before its
delay starts (`start = max(now, link free)`, `free = start + bits / rate`): a fluid model of a
store-and-forward link. A bounded queue per direction stops reading when it is full, so TCP's own flow
control pushes back on the sender, as a real bottleneck does.

`stall=(after_bytes, seconds)` makes a link go silent once: when `after_bytes` have come in towards its
target, neither direction releases anything for `seconds` (a thin link's queue draining, a congested
path), so what a peer does while its bytes and pings are held can be tested without depending on how
fast this machine happens to be.

`WanLinks(addresses, one_way_ms, mbit)` puts one forwarder in front of each address; `.addresses` are
the forwarders', in the same order, to give a route client: every worker reaches the next hop (and the
last stage the origin) through the addresses of the route it is told, so every hop crosses a link.
"""

from __future__ import annotations

import collections
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dgr.core.log import get_logger

log = get_logger(__name__)

READ_BYTES = 256 * 1024
SEGMENT_BYTES = 16 * 1024          # paced links release in segments this big (bytes arrive progressively)
# Bytes a link holds per direction before it stops reading: an unpaced link holds what a fast sender
# puts in flight during the delay (8 MiB: ~800 MB/s at 10 ms); a paced one models a bottleneck buffer of
# twice the bandwidth-delay product (at least 256 KiB), the rest queues in the sender's TCP buffers.
UNPACED_QUEUE_BYTES = 8 * 1024 * 1024
MIN_PACED_QUEUE_BYTES = 256 * 1024


@dataclass
class Direction:
    """What one direction of a link carried: bytes, chunks, and how late chunks were released (the
    emulator's own timing error, beyond the delay it was told)."""

    bytes: int = 0
    chunks: int = 0
    late_ns: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, n: int, late_ns: int | None) -> None:
        with self.lock:                                 # several connections share a direction's counts
            self.bytes += n
            self.chunks += 1
            if late_ns is not None and len(self.late_ns) < 100_000:
                self.late_ns.append(late_ns)

    def late_ms_median(self) -> float:
        return statistics.median(self.late_ns) / 1e6 if self.late_ns else 0.0


class _Pipe:
    """One direction of one connection: a reader stamping chunks, a writer releasing them on time."""

    def __init__(self, link: Link, src: socket.socket, dst: socket.socket, stats: Direction, name: str):
        self.link, self.src, self.dst, self.stats = link, src, dst, stats
        self.q: collections.deque = collections.deque()
        self.queued = 0
        self.eof = False
        self.dead = False
        self.cv = threading.Condition()
        self.free_ns = 0                                # when the paced transmitter is free again
        self.threads = [threading.Thread(target=self._read, daemon=True, name=f"wan-read-{name}"),
                        threading.Thread(target=self._write, daemon=True, name=f"wan-write-{name}")]
        for t in self.threads:
            t.start()

    def _stamp(self, data: bytes, now: int) -> list[tuple[int, bytes]]:
        link = self.link
        if not link.ns_per_byte:
            return [(now + link.delay_ns, data)]
        out = []
        for lo in range(0, len(data), SEGMENT_BYTES):
            seg = data[lo:lo + SEGMENT_BYTES]
            start = max(now, self.free_ns)
            self.free_ns = start + int(len(seg) * link.ns_per_byte)
            out.append((self.free_ns + link.delay_ns, seg))
        return out

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(READ_BYTES)
                if not data:
                    break
                now = time.monotonic_ns()
                self.link._arrived(self, len(data), now)
                with self.cv:
                    while self.queued >= self.link.queue_bytes and not self.dead:
                        self.cv.wait(0.5)               # full: stop reading, TCP pushes back on the sender
                    if self.dead:
                        return
                    for item in self._stamp(data, now):
                        self.q.append(item)
                        self.queued += len(item[1])
                    self.cv.notify_all()
        except OSError:
            pass
        with self.cv:
            self.eof = True
            self.cv.notify_all()

    def _write(self) -> None:
        clean = False
        try:
            while True:
                with self.cv:
                    while True:
                        if self.dead:
                            return
                        if self.q:
                            due, data = self.q[0]
                            wait = max(due, self.link.held_until_ns) - time.monotonic_ns()
                            if wait <= 0:
                                break
                            self.cv.wait(wait / 1e9)
                        elif self.eof:
                            self.dst.shutdown(socket.SHUT_WR)   # pass the half-close on, after the data
                            clean = True
                            return
                        else:
                            self.cv.wait()
                    self.q.popleft()
                    self.queued -= len(data)
                    self.cv.notify_all()
                self.dst.sendall(data)
                self.stats.add(len(data), -wait if self.link.delay_ns else None)
        except OSError:
            pass
        finally:
            self.link._drop(self, clean)

    def kill(self) -> None:
        with self.cv:
            self.dead = True
            self.cv.notify_all()

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()


class Link:
    """A forwarder listening on `listen` (port 0 picks one) in front of `target`: every connection to it
    is relayed to `target`, each direction delayed by `one_way_ms` and paced to `mbit` (None: as fast
    as the machine goes). `down` counts bytes towards the target, `up` bytes back from it."""

    def __init__(self, target: str, one_way_ms: float, mbit: float | None = None, *, listen: str = "127.0.0.1:0",
                 queue_bytes: int | None = None, stall: tuple[int, float] | None = None):
        if one_way_ms < 0:
            raise ValueError(f"one_way_ms must be >= 0, not {one_way_ms}")
        if mbit is not None and mbit <= 0:
            raise ValueError(f"mbit must be > 0 (or None for no limit), not {mbit}")
        if stall is not None and (stall[0] < 0 or stall[1] <= 0):
            raise ValueError(f"stall must be (after_bytes >= 0, seconds > 0), not {stall}")
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"target {target!r} is not HOST:PORT")
        self.target = (host, int(port))
        self.one_way_ms, self.mbit = float(one_way_ms), mbit
        self.delay_ns = int(one_way_ms * 1e6)
        self.ns_per_byte = 8e3 / mbit if mbit else 0.0  # 8 bits at mbit Mbit/s, in ns
        bdp = int(mbit * 1e6 / 8 * one_way_ms / 1e3) if mbit else 0
        self.queue_bytes = queue_bytes or (max(MIN_PACED_QUEUE_BYTES, 2 * bdp) if mbit else UNPACED_QUEUE_BYTES)
        self.down, self.up = Direction(), Direction()
        self.turns = 0                                  # direction changes: a request then its reply is 2
        self._last: Direction | None = None
        self.stall = stall
        self.arrived_down = 0                           # bytes read towards the target (for `stall`)
        self.held_until_ns = 0                          # nothing is released before this (a stall)
        self.stalled = False
        self.connections = 0
        self.pipes: set[_Pipe] = set()
        self.socks: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.closed = False
        lhost, _, lport = listen.rpartition(":")
        self.server = socket.create_server((lhost, int(lport)))
        self.address = f"{lhost}:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name=f"wan-accept-{self.address}").start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
                b.settimeout(None)
            except OSError as err:
                log.warning("wan link %s: cannot reach %s:%d: %s", self.address, *self.target, err)
                a.close()
                continue
            for s in (a, b):                            # no Nagle: the delay is the link's, not the kernel's
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                if self.closed:
                    a.close(), b.close()
                    return
                self.connections += 1
                n = self.connections
                self.socks |= {a, b}
                self.pipes.add(_Pipe(self, a, b, self.down, f"{self.address}-{n}-down"))
                self.pipes.add(_Pipe(self, b, a, self.up, f"{self.address}-{n}-up"))

    def _arrived(self, pipe: _Pipe, n: int, now: int) -> None:
        """Count turns (data in the other direction than the last: half a round trip), the bytes read towards
        the target, and start the one stall when they pass its threshold."""
        with self.lock:
            if pipe.stats is not self._last:
                self._last = pipe.stats
                self.turns += 1
        if self.stall is None or pipe.stats is not self.down:
            return
        with self.lock:
            self.arrived_down += n
            if self.stalled or self.arrived_down < self.stall[0]:
                return
            self.stalled = True
            self.held_until_ns = now + int(self.stall[1] * 1e9)
            pipes = list(self.pipes)
        log.info("wan link %s: stalled for %.1f s after %d bytes", self.address, self.stall[1], self.arrived_down)
        for p in pipes:
            p.wake()                                    # writers waiting on a due time re-read the hold

    def _drop(self, pipe: _Pipe, clean: bool) -> None:
        """A direction ended. After a clean half-close the other direction goes on until its side closes
        too; on a failure (or when both are done) both sockets close, so each side sees the connection go."""
        with self.lock:
            self.pipes.discard(pipe)
            peers = [p for p in self.pipes if p.src is pipe.dst and p.dst is pipe.src]
            if clean and peers:
                return
            self.socks -= {pipe.src, pipe.dst}
        for p in peers:
            p.kill()
        for s in (pipe.src, pipe.dst):
            _close(s)

    def stats(self) -> dict:
        return {"address": self.address, "target": "%s:%d" % self.target, "one_way_ms": self.one_way_ms,
                "mbit": self.mbit, "stalled": self.stalled, "connections": self.connections, "bytes_down": self.down.bytes,
                "bytes_up": self.up.bytes, "late_ms_median": statistics.median(
                    [self.down.late_ms_median(), self.up.late_ms_median()])}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            pipes, socks = list(self.pipes), list(self.socks)
        _close(self.server)                             # wakes the accept() thread too
        for p in pipes:
            p.kill()
        for s in socks:
            _close(s)


def _close(s: socket.socket) -> None:
    """Shut down first: a thread blocked in recv() on this socket wakes only then (close() alone does not)."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class WanLinks:
    """One emulated link in front of each of `addresses` (HOST:PORT), all with the same one-way delay
    and bandwidth. `addresses` (the attribute) are the forwarders', in order: give them to a
    RouteClient. A context manager; `stats()` says what each link carried."""

    def __init__(self, addresses: Sequence[str], one_way_ms: float, mbit: float | None = None, *,
                 stall: tuple[int, float] | None = None):
        self.targets = list(addresses)
        self.one_way_ms, self.mbit = float(one_way_ms), mbit
        self.links: list[Link] = []
        try:
            for a in self.targets:
                self.links.append(Link(a, one_way_ms, mbit, stall=stall))
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self.links]

    def bytes(self) -> list[tuple[int, int]]:
        """(down, up) bytes per link: towards its worker and back from it."""
        return [(link.down.bytes, link.up.bytes) for link in self.links]

    def turns(self) -> list[int]:
        """Per link, how often the data changed direction (a request and its reply: 2): round trips x 2."""
        return [link.turns for link in self.links]

    def late_ms_median(self) -> float:
        """The median time chunks were released after they were due, over both directions of every link."""
        late = [x for link in self.links for d in (link.down, link.up) for x in d.late_ns]
        return statistics.median(late) / 1e6 if late else 0.0

    def stats(self) -> list[dict]:
        return [link.stats() for link in self.links]

    def close(self) -> None:
        for link in self.links:
            link.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def raw_overhead(one_way_ms: float, n: int = 200) -> dict:
    """What a link adds to a raw TCP round trip on this machine, median of `n` 64-byte pings to an echo
    server in this process: direct, through a 0 ms link, and through a `one_way_ms` link less its two
    delays (the release timing's error), in ms."""
    srv = socket.create_server(("127.0.0.1", 0))

    def echo():
        try:
            c, _ = srv.accept()
        except OSError:
            return
        with c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := c.recv(65536):
                c.sendall(data)

    def rtt(address: str) -> float:
        threading.Thread(target=echo, daemon=True).start()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port))) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(n):
                t = time.perf_counter_ns()
                s.sendall(b"x" * 64)
                got = 0
                while got < 64:
                    got += len(s.recv(64 - got))
                times.append(time.perf_counter_ns() - t)
        return statistics.median(times) / 1e6

    target = f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        direct = rtt(target)
        with Link(target, 0.0) as zero:
            via0 = rtt(zero.address)
        with Link(target, one_way_ms) as far:
            delayed = rtt(far.address) - 2 * one_way_ms
    finally:
        _close(srv)
    return {"direct_rtt_ms": direct, "zero_link_rtt_ms": via0, "delayed_link_rtt_excess_ms": delayed,
            "per_direction_ms": (via0 - direct) / 2}
