"""The emulated WAN (dgr.app.bench.wan_link, dgr.app.bench.wan): every byte delayed by the one-way delay each way,
bandwidth kept (bytes in flight at once) or paced to `mbit`, connections closed through; a route through
the links gives the loopback text, its traffic (worker to worker included) crosses them, and each token
pays at least S one-way delays."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dgr.app.local import FakeRoute, LocalRoute
from dgr.app.bench.wan import Link, WanLinks, measure_wan, raw_overhead, table
from dgr.runtime.wire.client import RouteClient

from support.wan import connect, echo_server, recv_exactly, sink_server

FAKE = "layers=6,embd=16,cuts=2:4,seed=3"      # 3 stages, 16 f32 per token at each seam
PROMPT = "The capital of France is"


def test_each_direction_is_delayed_and_counted():
    with echo_server() as target, Link(target, 25.0) as link, connect(link.address) as s:
        t = time.monotonic()
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        rtt = time.monotonic() - t
        # a direction counts a chunk just after writing it: the echo can be read here before it is counted
        deadline = time.monotonic() + 10
        while link.up.bytes < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert rtt >= 0.050                                 # 25 ms there, 25 ms back
    assert (link.down.bytes, link.up.bytes, link.connections) == (4, 4, 1)
    assert link.stats()["late_ms_median"] >= 0


def _in_flight(link: Link) -> int:
    """Bytes the link holds (read, waiting out their delay) in both directions."""
    with link.lock:
        return sum(p.queued for p in link.pipes)


def test_the_delay_is_per_byte_not_per_message():
    """Twenty pings sent back to back are all in the link at once, each waiting out its own delay, as in
    a long pipe, instead of one round trip each; they come back intact and in order. (What the link holds
    is asserted, not how long the pings took: a loaded machine changes the second, not the first.)"""
    pings = [b"%02d" % k for k in range(20)]
    # a delay far longer than sending takes: every ping is read and held before the first one is due
    with echo_server() as target, Link(target, 60_000.0) as link, connect(link.address) as s:
        for p in pings:
            s.sendall(p)
        deadline = time.monotonic() + 30
        while _in_flight(link) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _in_flight(link) == 40 and link.down.bytes == 0, (_in_flight(link), link.down.bytes)
    with echo_server() as target, Link(target, 25.0) as link, connect(link.address) as s:
        t = time.monotonic()
        for p in pings:
            s.sendall(p)
            time.sleep(0.002)
        data = recv_exactly(s, 40)
        total = time.monotonic() - t
    assert data == b"".join(pings)
    assert total >= 0.050                               # never early: 25 ms there, 25 ms back


def test_bandwidth_is_paced_and_the_half_close_passes_after_the_data():
    n = 1_000_000
    with sink_server() as (target, reads), Link(target, 5.0, mbit=40) as link:
        s = connect(link.address)
        t = time.monotonic()
        s.sendall(b"x" * n)
        s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 10
        while (sum(b for _, b in reads) < n or link.down.bytes < n) and time.monotonic() < deadline:
            time.sleep(0.01)
        s.close()
    assert sum(b for _, b in reads) == n == link.down.bytes
    assert reads[-1][0] - t >= n * 8 / 40e6 + 0.005        # 0.2 s at 40 Mbit/s, then the delay
    assert reads[0][0] - t >= 0.005


def test_a_stall_holds_both_directions_once_its_threshold_came_in_then_releases_everything_in_order():
    """Below the threshold bytes pass; the byte that crosses it starts the stall, and nothing comes back
    (not even the echo of earlier bytes still in the link) until it ends; then all of it, in order."""
    with echo_server() as target, Link(target, 1.0, stall=(8, 1.5)) as link, connect(link.address) as s:
        s.sendall(b"abcd")
        assert recv_exactly(s, 4) == b"abcd"            # under the threshold: an ordinary link
        t = time.monotonic()
        s.sendall(b"efgh")                              # 8 bytes in: the stall starts
        s.sendall(b"ijkl")
        assert recv_exactly(s, 8) == b"efghijkl"
        held = time.monotonic() - t
        deadline = time.monotonic() + 10                # a direction counts a chunk just after writing it
        while link.down.bytes < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.stats()["stalled"] and link.down.bytes == 12
    assert held >= 1.5
    with pytest.raises(ValueError, match="stall"):
        Link(target, 1.0, stall=(8, 0))


def test_a_closed_target_closes_the_client_side():
    with echo_server() as target, Link(target, 1.0) as link, connect(link.address) as s:
        s.sendall(b"abc")
        s.shutdown(socket.SHUT_WR)                      # the echo server half-closes back after the data
        assert recv_exactly(s, 3) == b"abc"
        s.settimeout(5)
        assert s.recv(10) == b""


def test_a_link_to_nothing_refuses_connections_and_bad_arguments_are_named():
    with socket.create_server(("127.0.0.1", 0)) as tmp:
        dead = f"127.0.0.1:{tmp.getsockname()[1]}"
    with Link(dead, 1.0) as link, connect(link.address) as s:
        s.settimeout(5)
        assert s.recv(10) == b""                        # accepted, then closed: nothing to relay to
    with pytest.raises(ValueError, match="HOST:PORT"):
        Link("nowhere", 1.0)
    with pytest.raises(ValueError, match="one_way_ms"):
        Link(dead, -1)
    with pytest.raises(ValueError, match="mbit"):
        Link(dead, 1, mbit=0)


def test_a_fake_route_through_links_gives_the_loopback_text_and_every_hop_crosses_one():
    one_way = 15.0
    with FakeRoute.of(FAKE) as route, RouteClient(route.addresses) as direct, \
            WanLinks(route.addresses, one_way) as wan, RouteClient(wan.addresses) as far:
        ref = direct.run(PROMPT, max_new_tokens=12, stop_token_ids=[])
        before = wan.bytes()
        gen = far.run(PROMPT, max_new_tokens=12, stop_token_ids=[])
        moved = [(d1 - d0, u1 - u0) for (d1, u1), (d0, u0) in zip(wan.bytes(), before)]
    assert gen.token_ids == ref.token_ids and gen.text == ref.text
    positions = len(gen.prompt_ids) + len(gen.token_ids) - 1
    # links 1 and 2 sit in front of stages 1 and 2: the boundaries of every position came through them
    assert all(down >= positions * 16 * 4 for down, _ in moved[1:]), moved
    assert moved[0][0] > 0 and moved[0][1] > 0          # prompt and tokens into stage 0, text out of it
    rings = [e.ring_ns / 1e6 for e in gen.events[1:]]
    assert rings and min(rings) >= 3 * one_way, rings   # three links per trip round the ring


def test_a_thin_link_carrying_a_long_prompt_needs_a_longer_link_keepalive():
    """A keepalive ping waits behind the bytes queued ahead of it: on a thin link a long prompt's boundaries
    (2048 tokens of a 576-wide seam are 4.7 MB, 3.8 s at 10 Mbit/s) hold it past the default 2 s, and the
    hop is dropped as unreachable, naming the flag; `--link-keepalive-timeout` longer than the burst carries
    it. How long a paced link holds a ping depends on how fast this machine drains gRPC's windows, so the
    links here hold everything for a set time instead, once 256 KiB of the prompt's boundaries came in:
    longer than a ping's 1 s + 2 s in the first route, shorter than the 60 s keepalive timeout of the second.
    (The client's own probes of silent hops wait 30 s here, so that the workers' keepalive is what notices.)"""
    from dgr.runtime.wire.errors import StageError

    spec = "layers=4,embd=576,cuts=2,seed=3,ctx=4096"
    prompt = [i % 200 + 3 for i in range(512)]          # 1.2 MB per seam
    stall = (256 * 1024, 8.0)
    with FakeRoute.of(spec) as route, WanLinks(route.addresses, 1.0, stall=stall) as wan, \
            RouteClient(wan.addresses, attempts=1, hop_deadline=30) as c:
        with pytest.raises(StageError, match="--link-keepalive-timeout"):
            c.run(prompt, max_new_tokens=2, stop_token_ids=[])
        assert [s["stalled"] for s in wan.stats()] == [False, True]   # the prompt link carries token ids, the seam link boundaries
    with FakeRoute.of(spec, extra=["--link-keepalive-timeout", "60"]) as route, \
            WanLinks(route.addresses, 1.0, stall=stall) as wan, \
            RouteClient(wan.addresses, attempts=1, hop_deadline=30) as c:
        ref = c.run(prompt[:8], max_new_tokens=2, stop_token_ids=[])   # short: under the stall's threshold
        gen = c.run(prompt, max_new_tokens=2, stop_token_ids=[])
        assert [s["stalled"] for s in wan.stats()] == [False, True]   # the prompt link carries token ids, the seam link boundaries
    assert len(gen.token_ids) == 2 and len(ref.token_ids) == 2


@pytest.mark.engine
@pytest.mark.slow
def test_smollm2_through_4_worker_processes_at_20ms_rtt_gives_the_loopback_text(engine_lib):
    from dgr.app.demo import ensure_bundle

    b = ensure_bundle(4, progress=False)[0]
    one_way, stages = 10.0, 4
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"] for i in range(stages)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as route, \
            RouteClient(route.addresses) as direct, WanLinks(route.addresses, one_way) as wan, \
            RouteClient(wan.addresses) as far:
        ref = direct.run(PROMPT, max_new_tokens=16, stop_token_ids=[])
        before = wan.bytes()
        gen = far.run(PROMPT, max_new_tokens=16, stop_token_ids=[])
        moved = [(d1 - d0, u1 - u0) for (d1, u1), (d0, u0) in zip(wan.bytes(), before)]
        n_embd = direct.hops[1].schema_in.n_embd
    assert gen.token_ids == ref.token_ids and gen.text == ref.text
    positions = len(gen.prompt_ids) + len(gen.token_ids) - 1
    assert all(down >= positions * n_embd * 4 for down, _ in moved[1:]), moved   # worker to worker, f32
    assert moved[0][0] > 0 and moved[0][1] > 0
    rings = [e.ring_ns / 1e6 for e in gen.events[1:]]
    assert min(rings) >= stages * one_way, rings
    assert (gen.t_last - gen.t_first) * 1e3 / (len(gen.token_ids) - 1) >= stages * one_way


@pytest.mark.engine
@pytest.mark.slow
def test_measure_wan_reports_the_ring_against_its_ideal_and_the_prefill(engine_lib):
    r = measure_wan(stages=4, rtt_ms=20.0, tokens=8, rounds=1, prefill_tokens=128, prefill_rounds=1)
    print("\n" + table(r))
    assert r["same_text"] and r["prefill_same_token"]
    assert r["one_way_ms"] == 10.0 and r["stages"] == 4
    assert r["ideal_ring_ms"] == pytest.approx(r["compute_ms"] + 4 * 10.0 + 4 * r["per_hop_link_ms"])
    assert r["tpot_over_ideal"] == pytest.approx(r["tpot_ms"] / r["ideal_ring_ms"])
    assert r["tpot_ms"] >= 4 * 10.0 and r["ring_ms"] >= 4 * 10.0
    assert r["prefill_ms"] >= 6 * 10.0                  # client -> 0 -> 1 -> 2 -> 3 -> 0 -> client
    assert r["prefill_chunks"] == 2 and r["prefill_compute_ms"] > 0
    assert r["prefill_transfer_ms"] == pytest.approx(6 * 10.0)
    assert r["prefill_overlap"] == pytest.approx(r["prefill_ms"] / (r["prefill_compute_ms"] + r["prefill_transfer_ms"]))
    assert all(down > 0 for down, _ in r["decode_link_bytes"]) and len(r["links"]) == 4
    assert {"emulator_overhead_ms", "delay_late_ms", "per_hop_ms", "prefill_unchunked_ms"} <= set(r)


def test_raw_overhead_measures_direct_zero_and_delayed_round_trips():
    r = raw_overhead(5.0, n=20)
    assert 0 < r["direct_rtt_ms"] and 0 < r["zero_link_rtt_ms"]
    assert r["delayed_link_rtt_excess_ms"] >= 0             # never early: a byte waits its full delay


def test_threads_of_closed_links_end():
    before = threading.active_count()
    with echo_server() as target:
        for _ in range(3):
            with Link(target, 1.0) as link, connect(link.address) as s:
                s.sendall(b"x")
                recv_exactly(s, 1)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
