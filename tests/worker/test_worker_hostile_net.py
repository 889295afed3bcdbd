"""dgr-worker's network edges against a hostile member or stranger (issue 35, docs/security.md): where it
may connect (peer addresses: TCP HOST:PORT only, --peer-allow), a flood that takes every descriptor, HTTP/2
streams opened and reset as fast as a member can (the rapid reset class, CVE-2023-44487), and a metrics
client that drips its request.

Real dgr-worker processes of the fake engine on loopback; the attacks by a member run under mutual TLS with
certificates from `dgr certs` (make_ca). Every wait is for something observable (a descriptor count, a reply,
a connection), with a timeout; nothing compares a time.
"""

from __future__ import annotations

import os
import re
import resource
import select
import socket
import ssl
import struct
import subprocess
import threading
from pathlib import Path

import grpc
import pytest

from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.testing.fake_engine import library_path

from support.worker import READY, make_ca, tls_flags, wait_for

SPEC = "layers=4,embd=8,cuts=2"
METRICS = re.compile(r"metrics on (\S+)")


class Worker:
    """`dgr-worker --fake-engine SPEC --stage N` on loopback, optionally under an open-files limit."""

    def __init__(self, worker_bin: Path, *extra: str, stage: int = 0, nofile: int | None = None):
        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        env = {**os.environ, "DGR_FAKE_ENGINE_LIB": str(library_path())}
        self.p = subprocess.Popen([str(worker_bin), "--fake-engine", SPEC, "--stage", str(stage), "--listen", "127.0.0.1:0",
                                   *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  preexec_fn=limit)
        self.log: list[str] = []
        self.address = self.metrics = ""
        for line in self.p.stdout:
            self.log.append(line)
            if m := METRICS.search(line):
                self.metrics = m.group(1)
            if m := READY.search(line):
                self.address = m.group(1)
                break
        assert self.address, f"dgr-worker exited ({self.p.wait()}) before serving:\n{''.join(self.log)}"
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.p.stdout:
            self.log.append(line)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.p.pid}/fd"))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> str:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return "".join(self.log)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_ca(tmp_path_factory.mktemp("pki") / "ops", ["w0", "w1", "member", "attacker"])


def _describe(address: str, tls, timeout: float = 10, wait_for_ready: bool = False) -> pb.StageDescription:
    ch = grpc.secure_channel(address, tls.channel_credentials(), options=[("grpc.use_local_subchannel_pool", 1)])
    with ch:
        return pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=timeout, wait_for_ready=wait_for_ready)


# ------------------------------------------------------------------------------------- peer addresses

def _verdicts(worker_bin, addresses: list[str], *flags: str) -> list[str]:
    argv = [str(worker_bin), *flags]
    for a in addresses:
        argv += ["--test-peer-address", a]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


TCP = "give the peer's HOST:PORT (an IPv4 address, [IPv6] or a DNS name, and a port 1-65535)"
SCHEME = "peers are reached over TCP only, never by a gRPC target with a scheme (unix:, dns:, ipv4:, vsock:, ...)"

ADDRESSES = [
    ("127.0.0.1:7001", None),
    ("[::1]:7001", None),
    ("stage1.example:7001", None),
    ("w-2.mesh.internal.:443", None),
    ("unix:/run/dgr/admin.sock", SCHEME),
    ("unix-abstract:dgr", "'unix-abstract:' is a gRPC target scheme"),
    ("unix:7001", "'unix:' is a gRPC target scheme, not a host name"),
    ("dns:7001", "'dns:' is a gRPC target scheme, not a host name"),
    ("dns:///stage1.example:7001", SCHEME),
    ("ipv4:10.0.0.1:7001", SCHEME),
    ("ipv6:[::1]:7001", SCHEME),
    ("vsock:2:7001", SCHEME),
    ("http://stage1.example:7001", SCHEME),
    ("::1:7001", "an IPv6 address goes in brackets; give [::1]:7001"),
    ("[::1:7001", "an IPv6 address opened with '[' is not closed with ']'"),
    ("[nope]:7001", "'[nope]' is not an IPv6 address"),
    (":7001", "its host is empty"),
    ("stage1.example", "it has no :PORT"),
    ("stage1.example:", "its port '' is not a number 1-65535"),
    ("stage1.example:0", "its port 0 is not in 1-65535"),
    ("stage1.example:65536", "its port 65536 is not in 1-65535"),
    ("stage1.example:http", "its port 'http' is not a number 1-65535"),
    ("stage1.example:-1", "its port '-1' is not a number 1-65535"),
    ("999.0.0.1:7001", "'999.0.0.1' is not an IPv4 address (give a.b.c.d)"),
    ("st age:7001", "its host holds ' '"),
    ("stage_1:7001", "its host holds '_'"),
    ("-stage:7001", "'-stage' is not a DNS name"),
    ("a..b:7001", "'a..b' is not a DNS name"),
    ("stage\x01:7001", "it holds control characters"),
    ("stage\x7f:7001", "it holds control characters"),
    ("st\u00e4ge:7001", "it holds characters outside ASCII"),
    ("a" * 250 + ".b:7001", "it is longer than 255 characters"),
    ("", "it is empty"),
]


def test_peer_addresses_are_tcp_host_port_only(worker_bin):
    got = _verdicts(worker_bin, [a for a, _ in ADDRESSES])
    assert len(got) == len(ADDRESSES), got
    for (address, why), line in zip(ADDRESSES, got):
        if why is None:
            assert line == "ok", (address, line)
            continue
        assert line.startswith("refused: this worker does not connect to peer address '"), (address, line)
        assert why in line, (address, line)
        assert not re.search(r"(?i)refused by|unreachable|timed out|connection|errno", line), line   # nothing of the port
        assert "\x01" not in line and "\x7f" not in line and len(line) < 700, line


def test_peer_allow_bounds_addresses_and_names(worker_bin):
    allow = "127.0.0.0/8,::1/128"
    cases = [
        ("127.0.0.9:7001", None),
        ("[::1]:7001", None),
        ("[::ffff:127.0.0.1]:7001", None),           # an IPv4-mapped address is its IPv4 address
        ("localhost:7001", None),                    # resolves only to loopback
        ("10.1.2.3:7001", "it is outside --peer-allow; give an address inside --peer-allow 127.0.0.0/8,::1/128, or "
                          "widen --peer-allow on this worker"),
        ("[fd00::1]:7001", "it is outside --peer-allow"),
        ("[::ffff:10.0.0.1]:7001", "it is outside --peer-allow"),
        ("nowhere.invalid:7001", "its name does not resolve here, and under --peer-allow a name must resolve to "
                                 "addresses inside it"),
        ("unix:/tmp/x", SCHEME),                     # the form is checked first
    ]
    got = _verdicts(worker_bin, [a for a, _ in cases], "--peer-allow", allow)
    for (address, why), line in zip(cases, got):
        assert (line == "ok") if why is None else (why in line), (address, line)
    # a name resolving outside: only the addresses it resolves to count
    got = _verdicts(worker_bin, ["localhost:7001"], "--peer-allow", "10.0.0.0/8")
    assert "its name resolves to an address outside --peer-allow" in got[0], got


@pytest.mark.parametrize("value, why", [
    ("10.0.0.1/8", "'10.0.0.1/8' has host bits set"),
    ("10.0.0.0/33", "'10.0.0.0/33' has a bad prefix length (0-32)"),
    ("fd00::/129", "'fd00::/129' has a bad prefix length (0-128)"),
    ("stage1.example", "'stage1.example' is not an IPv4 or IPv6 network"),
    ("10.0.0.0/8,,::1", "an empty entry"),
])
def test_bad_peer_allow_is_one_line_and_exit_2(worker_bin, value, why):
    r = subprocess.run([str(worker_bin), "--fake-engine", SPEC, "--stage", "0", "--peer-allow", value],
                       capture_output=True, text=True, timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and why in lines[0], r.stderr


def test_a_route_hop_on_a_unix_socket_is_refused_without_connecting(worker_bin, pki, tmp_path):
    """A member opens a session whose next hop is `unix:PATH`: gRPC would dial the local socket at PATH (an
    admin endpoint, a sidecar) on the member's behalf. The worker refuses it by name and never connects."""
    path = tmp_path / "victim.sock"
    victim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    victim.bind(str(path))
    victim.listen(16)
    victim.setblocking(False)
    w = Worker(worker_bin, *tls_flags(pki["w0"]), "--rpc-timeout", "3")
    try:
        d = _describe(w.address, pki["member"])
        hops = [pb.Hop(address=w.address, bundle_id=d.identity.bundle_id, stage_index=0, layer_begin=0, layer_end=2),
                pb.Hop(address=f"unix:{path}", bundle_id=d.identity.bundle_id, stage_index=1, layer_begin=2, layer_end=4)]
        ch = grpc.secure_channel(w.address, pki["member"].channel_credentials())
        with ch:
            r = pb_grpc.StageStub(ch).OpenSession(pb.OpenSessionRequest(session_id="s", epoch=1, route=hops), timeout=30)
        try:
            conn, _ = victim.accept()
            conn.close()
            connected = True
        except BlockingIOError:
            connected = False
        assert not connected, "the worker dialed the unix socket a route named"
        assert r.HasField("error") and f"does not connect to peer address 'unix:{path}'" in r.error.message, r
    finally:
        victim.close()
        w.stop()


def test_a_member_holding_its_unary_calls_is_refused_more_and_others_are_served(worker_bin, pki):
    """--max-rpc-per-member 2: a member holds two OpenSession calls that wait on a next hop that never answers
    (a TCP port that accepts and says nothing); its third call, of any kind, is refused at once by name, while
    another member is served, and once the two are over the member is served again."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    silent = socket.socket()                        # accepts every connection and never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held_open: list[socket.socket] = []

    def accept():
        try:
            while True:
                held_open.append(silent.accept()[0])
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    w = Worker(worker_bin, *tls_flags(pki["w0"]), "--max-rpc-per-member", "2", "--rpc-timeout", "6",
               "--metrics-listen", "127.0.0.1:0")
    ctx = ssl.create_default_context(cafile=str(pki["member"].ca))
    ctx.load_cert_chain(str(pki["member"].cert), str(pki["member"].key))

    def metric(name: str) -> float:
        with urllib.request.urlopen(w.metrics, context=ctx, timeout=10) as r:
            text = r.read().decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    try:
        d = _describe(w.address, pki["member"])
        hops = [pb.Hop(address=w.address, bundle_id=d.identity.bundle_id, stage_index=0, layer_begin=0, layer_end=2),
                pb.Hop(address="127.0.0.1:%d" % silent.getsockname()[1], bundle_id=d.identity.bundle_id,
                       stage_index=1, layer_begin=2, layer_end=4)]
        ch = grpc.secure_channel(w.address, pki["attacker"].channel_credentials(),
                                 options=[("grpc.use_local_subchannel_pool", 1)])
        with ch:
            s = pb_grpc.StageStub(ch)
            chans = [grpc.secure_channel(w.address, pki["attacker"].channel_credentials(),
                                         options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(2)]
            held = [pb_grpc.StageStub(c).OpenSession.future(
                pb.OpenSessionRequest(session_id=f"hold-{k}", epoch=1, route=hops), timeout=60) for k, c in enumerate(chans)]
            assert wait_for(lambda: metric("dgr_worker_unary_calls_running") == 2, 10), "the two calls never ran"
            with pytest.raises(grpc.RpcError) as refused:
                s.Describe(pb.DescribeRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert "this member has 2 calls running or waiting here, the most one member may (--max-rpc-per-member 2)" \
                in refused.value.details(), refused.value.details()
            assert metric("dgr_worker_unary_calls_refused_total") == 1
            assert _describe(w.address, pki["member"]).member == "w0"      # another member: served meanwhile
            for f in held:
                r = f.result()
                assert r.HasField("error") and r.error.code == pb.HOP_UNREACHABLE, r
            assert s.Describe(pb.DescribeRequest(), timeout=10).member == "w0"
    finally:
        silent.close()
        for c in held_open:
            c.close()
        print(w.stop()[-3000:])


# ------------------------------------------------------------------------------------- descriptors

def test_the_listener_survives_a_flood_that_takes_every_descriptor(worker_bin, pki):
    """Bare TCP connections until the worker has no descriptor left (open-files limit 64): gRPC 1.51 stops
    accepting for good at its first EMFILE. Once the flood is gone, a member connects and is served; a member
    connected before the flood is served throughout."""
    nofile = 64
    w = Worker(worker_bin, *tls_flags(pki["w0"]), "--max-connections", "4", "--handshake-timeout", "60", nofile=nofile)
    flood: list[socket.socket] = []
    try:
        before = grpc.secure_channel(w.address, pki["member"].channel_credentials(),
                                     options=[("grpc.use_local_subchannel_pool", 1)])
        stub = pb_grpc.StageStub(before)
        assert stub.Describe(pb.DescribeRequest(), timeout=10).member == "w0"
        host, port = w.address.rsplit(":", 1)
        flood = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3 * nofile)]
        # the worker took descriptors up to its limit (the guard stops 8 short of it; unguarded, all 64)
        assert wait_for(lambda: w.fds() >= nofile - 8, 30), (w.fds(), w.stop())
        assert stub.Describe(pb.DescribeRequest(), timeout=10).member == "w0"   # an established member
        for s in flood:
            s.close()
        flood.clear()
        # the flood's connections closed, the worker closes its ends (EOF in the handshake)
        assert wait_for(lambda: w.fds() < nofile // 2, 30), (w.fds(), w.stop())
        # The flood's connections that were still in the listen queue when the port came back are accepted then,
        # dead, in a burst that can reach the margin once more: the connection that meets it is shed, as any
        # would be. So the member connects as gRPC's channels do, trying again until the port serves it
        # (unguarded, it never does: gRPC stopped accepting at its first EMFILE).
        assert _describe(w.address, pki["member"], timeout=30, wait_for_ready=True).member == "w0", w.stop()
        before.close()
    finally:
        for s in flood:
            s.close()
        print(w.stop()[-3000:])


def test_max_connections_must_fit_the_open_files_limit(worker_bin):
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    env = {**os.environ, "DGR_FAKE_ENGINE_LIB": str(library_path())}
    r = subprocess.run([str(worker_bin), "--fake-engine", SPEC, "--stage", "0", "--listen", "127.0.0.1:0",
                        "--max-connections", "256"], capture_output=True, text=True, timeout=20, env=env, preexec_fn=limit)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert ("--max-connections 256 needs an open-files limit (RLIMIT_NOFILE) of at least 304, and this process may "
            "open 64: raise it (ulimit -n; LimitNOFILE= in a systemd unit) or lower --max-connections") in lines[0]


def test_the_open_files_limit_is_raised_and_logged(worker_bin):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 1024) if hard != resource.RLIM_INFINITY else 1024

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, low))

    env = {**os.environ, "DGR_FAKE_ENGINE_LIB": str(library_path())}
    p = subprocess.Popen([str(worker_bin), "--fake-engine", SPEC, "--stage", "0", "--listen", "127.0.0.1:0",
                          "--max-connections", "8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env, preexec_fn=limit)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if READY.search(line):
                break
        assert f"dgr worker: open-files limit {low} (RLIMIT_NOFILE)\n" in lines, lines
        limits = Path(f"/proc/{p.pid}/limits").read_text()
        assert re.search(rf"Max open files\s+{low}\s+{low}", limits), limits
    finally:
        p.terminate()
        p.wait(timeout=30)


# ------------------------------------------------------------------------------------- HTTP/2 streams

def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:       # HPACK: a literal without indexing, new name, no Huffman
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class H2:
    """A member's raw HTTP/2 connection (TLS with its certificate, ALPN h2) that opens Describe calls and
    resets each at once, as fast as it can write; what the worker sends is read and dropped."""

    HEADERS, RST_STREAM, SETTINGS, END_HEADERS, CANCEL = 1, 3, 4, 0x4, 8

    def __init__(self, address: str, tls):
        host, port = address.rsplit(":", 1)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(str(tls.ca))
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
        ctx.set_alpn_protocols(["h2"])
        self.sock = ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=30), server_hostname=host)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.block = b"".join(_literal(n, v) for n, v in [
            (b":method", b"POST"), (b":scheme", b"https"), (b":path", b"/dgr.v1.Stage/Describe"),
            (b":authority", address.encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(self.SETTINGS, 0, 0))
        self.next_stream = 1
        self.closed = False

    def _read_what_came(self):
        """Read and drop what the worker sent (it must never wait on this client's window)."""
        try:
            while self.sock.pending() or select.select([self.sock], [], [], 0)[0]:
                if not self.sock.recv(65536):
                    self.closed = True
                    return
        except OSError:
            self.closed = True

    def reset_burst(self, n: int) -> int:
        """n streams opened and cancelled; how many were written before the worker closed the connection."""
        out = bytearray()
        for _ in range(n):
            s = self.next_stream
            self.next_stream += 2
            out += _frame(self.HEADERS, self.END_HEADERS, s, self.block)
            out += _frame(self.RST_STREAM, 0, s, struct.pack(">I", self.CANCEL))
        try:
            self.sock.sendall(bytes(out))
        except OSError:
            self.closed = True
            return 0
        self._read_what_came()
        return n

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


@pytest.mark.xfail(strict=False, reason=(
    "gRPC 1.51 keeps what every opened-and-reset stream cost until it has worked through the whole connection's "
    "input: no reset accounting, no bound on pending requests (both came with the CVE-2023-44487 fixes, 1.56.3/1.57.1+). "
    "Serving every RPC through the callback API took 20,000 resets from +326 MiB to +32 MiB; 60,000 at full speed still "
    "grow it 0.5-1.2 GiB. Needs a newer gRPC C++ (none reachable here), or a proxy in front that has the fix "
    "(docs/security.md)"))
def test_a_member_resetting_streams_as_fast_as_it_can_does_not_grow_the_worker(worker_bin, pki):
    """60,000 Describe streams opened and reset at once on raw HTTP/2 connections by a member (the rapid
    reset class): another member is served afterwards, and the worker's memory stays bounded."""
    w = Worker(worker_bin, *tls_flags(pki["w0"]))
    conns: list[H2] = []
    try:
        assert _describe(w.address, pki["member"]).member == "w0"
        rss0 = w.rss_kib()
        sent, peak = 0, rss0
        while sent < 60000:
            if not conns or conns[-1].closed:
                conns.append(H2(w.address, pki["attacker"]))
            sent += conns[-1].reset_burst(500) or 1    # (a closed connection: the next loop opens another)
            peak = max(peak, w.rss_kib())

        def served():
            nonlocal peak
            peak = max(peak, w.rss_kib())
            try:
                return _describe(w.address, pki["member"], timeout=10).member == "w0"
            except grpc.RpcError as err:                # RESOURCE_EXHAUSTED while gRPC works through the resets
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                return False

        assert wait_for(served, 30)
        assert w.p.poll() is None
        assert peak - rss0 < 128 * 1024, f"RSS {rss0} KiB before, {peak} KiB at most after 60,000 resets"
    finally:
        for c in conns:
            c.close()
        print(w.stop()[-3000:])


# ------------------------------------------------------------------------------------- metrics

def test_a_metrics_client_that_drips_its_request_blocks_no_other_scrape(worker_bin):
    """One client connects to --metrics-listen and sends its request a byte a second (it would take hours);
    a scrape on another connection meanwhile is answered, and the dripper is cut off."""
    w = Worker(worker_bin, "--metrics-listen", "127.0.0.1:0")
    stop = threading.Event()
    try:
        url = w.metrics
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        drip = socket.create_connection((host, int(port)), timeout=60)
        drip.sendall(b"G")
        cut = threading.Event()

        def dripping():
            try:
                while not stop.wait(1):
                    drip.sendall(b"E")
            except OSError:
                cut.set()

        threading.Thread(target=dripping, daemon=True).start()
        scrape = socket.create_connection((host, int(port)), timeout=20)
        scrape.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        got = b""
        try:
            while chunk := scrape.recv(65536):
                got += chunk
        except socket.timeout:
            pass
        scrape.close()
        assert got.startswith(b"HTTP/1.1 200 OK") and b"dgr_worker_sessions_open" in got, got[:200]
        # and the dripper itself is let go: its connection closed by the worker
        assert cut.wait(30) or drip.recv(1) == b""
    finally:
        stop.set()
        w.stop()
