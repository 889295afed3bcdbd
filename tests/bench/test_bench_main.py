"""`dgr bench`: the whole model and the pipeline side by side in one run: the JSON fields the issue names
(the interface), per-boundary figures that add up to the ring's overhead, socket bytes that carry at
least the boundary payload, the plot, sections of modules not built, and scripts/device-check's dry run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time

import pytest

from dgr.app.bench.pipeline import carried, tcp_bytes
from dgr.cli.commands import bench

REQUIRED = ("whole.decode_tok_s", "whole.prefill_tok_s", "pipeline.decode_tok_s", "pipeline.prefill_tok_s",
            "pipeline.per_hop_ms", "ratios.decode", "ratios.prefill", "sessions.aggregate_over_single")


def _bench(tmp_path, *argv) -> tuple[int, dict]:
    p = argparse.ArgumentParser(prog="dgr")
    bench.register(p.add_subparsers())
    out = tmp_path / "bench.json"
    args = p.parse_args(["bench", "--json", str(out), *argv])
    rc = args.func(args)
    return rc, json.loads(out.read_text())


def _get(rep: dict, dotted: str):
    for k in dotted.split("."):
        rep = rep[k]
    return rep


def _check_report(rep: dict, stages: int, lengths: list[int]) -> None:
    for key in REQUIRED:
        assert isinstance(_get(rep, key), (int, float)) and _get(rep, key) > 0, key
    p = rep["pipeline"]
    for side in ("whole", "pipeline"):
        assert sorted(int(n) for n in rep[side]["prefill_tok_s_by_len"]) == lengths
    assert rep["pipeline"]["prefill_tok_s"] == rep["pipeline"]["prefill_tok_s_by_len"][str(max(lengths))]
    rounds = rep["rounds"]                                          # ratios pair each round's two sides
    assert rep["ratios"]["decode"] == pytest.approx(statistics.median(
        a / b for a, b in zip(rounds["pipeline_decode_tok_s"], rounds["whole_decode_tok_s"])), rel=1e-3)
    assert [b["boundary"] for b in p["boundaries"]] == [f"{k}->{k + 1}" for k in range(stages - 1)] + \
        [f"{stages - 1}->origin"]
    assert all(b["p90_ms"] >= b["median_ms"] >= 0 for b in p["boundaries"])
    assert [s["stage"] for s in p["stages"]] == list(range(stages)) and all(s["compute"] > 0 for s in p["stages"])
    assert p["per_hop_p90_ms"] >= p["per_hop_ms"] and p["ring_ms"] > p["compute_ms"] > 0
    assert p["same_tokens_as_whole"] is True
    w = rep["wire"]
    assert len(w["payload_bytes_per_token_per_seam"]) == stages - 1 and w["payload_bytes_per_token"] > 0
    sock = w["socket_bytes_per_token"]
    # the sockets carry every seam's boundary and then some (framing, timings, the token's return)
    assert sock is not None and len(sock["into_stage"]) == stages
    for k, payload in enumerate(w["payload_bytes_per_token_per_seam"], start=1):
        assert sock["into_stage"][k] >= payload
    assert p["wire_bytes_per_token"] == sock["total"] >= w["payload_bytes_per_token"]
    assert rep["sessions"]["m"] >= 2 and rep["sessions"]["aggregate_tok_s"] > 0
    fl = rep["floor"]                                              # measured after the ring's idle gap
    assert fl["one_way_p90_ms"] >= fl["one_way_ms"] > 0 and fl["gap_ms"] > 0
    assert fl["per_hop_over_floor"] == pytest.approx(p["per_hop_ms"] / fl["one_way_ms"], rel=0.01)


@pytest.mark.engine
def test_bench_on_a_tiny_model_reports_every_figure_and_the_plot(tmp_path, capsys, engine_lib):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    progress: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: progress.append(record.getMessage())
    lg = logging.getLogger("dgr.app.bench.pipeline")
    level = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(handler)
    try:
        rc, rep = _bench(tmp_path, "--synth", "llama", "--stages", "3", "--tokens", "12", "--prompt-lengths", "16,40",
                         "--sessions", "2", "--rounds", "1", "--n-ctx", "96", "--kernels", "invariant",
                         "--plot", str(png))
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    assert rc == 0
    _check_report(rep, 3, [16, 40])
    assert rep["bench"]["arch"] == "llama" and rep["bench"]["stages"] == 3 and rep["bench"]["wire_dtype"] == "f32"
    # KV sized for the run (--n-ctx; --sessions + 2 sessions), not a server's default
    assert rep["bench"]["n_ctx"] == 96 and rep["bench"]["max_sessions"] == 4
    assert rep["bench"]["kernels"] == "invariant"                  # workers and whole model alike: tokens equal
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    out = capsys.readouterr()
    assert "decode tok/s" in out.out and "boundary 2->origin" in out.out and "greedy tokens equal" in out.out
    assert "loopback floor: one bare TCP message" in out.out
    assert any("round 1/1" in m for m in progress)                  # progress: the log (stderr under the CLI)


@pytest.mark.engine
@pytest.mark.slow
def test_bench_smollm2_three_stages(tmp_path, engine_lib):
    rc, rep = _bench(tmp_path, "--stages", "3", "--tokens", "16", "--prompt-lengths", "32,128", "--sessions", "2",
                     "--rounds", "1", "--tls")
    assert rc == 0
    _check_report(rep, 3, [32, 128])
    assert rep["bench"]["model"] == "smollm2-135m-3stage"
    # the same bundle with mutual TLS beside plaintext in the same run: both measured, the same text
    t = rep["tls"]
    assert t["stages"] == 3 and t["same_text"] is True
    assert t["plaintext_per_hop_ms"] > 0 and t["tls_per_hop_ms"] > 0
    assert t["plaintext_decode_tok_s"] > 0 and t["tls_decode_tok_s"] > 0
    assert rep["wire"]["payload_bytes_per_token_per_seam"] == [576 * 4, 576 * 4]     # f32 rows of n_embd 576


def test_a_section_not_built_yet_says_so(tmp_path, capsys):
    got = bench._section("dgr.app.no_such_module", "measure", lambda f: f())
    assert "not built yet" in got["error"] and "dgr.app.no_such_module" in got["error"]
    got = bench._section("dgr.app.bench.pipeline", "no_such_function", lambda f: f())
    assert "dgr.app.bench.pipeline.no_such_function is not built yet" in got["error"]
    got = bench._section("dgr.app.bench.pipeline", "prepare", lambda f: f(bundle="x", synth="llama"))
    assert got == {"error": "dgr bench: give --bundle or --synth, not both"}


def test_nothing_to_run_is_refused():
    from dgr.core.errors import DgrError

    p = argparse.ArgumentParser(prog="dgr")
    bench.register(p.add_subparsers())
    args = p.parse_args(["bench", "--no-main"])
    with pytest.raises(DgrError, match="nothing left to run"):
        args.func(args)


@pytest.mark.engine
def test_an_n_ctx_shorter_than_the_run_is_refused_before_anything_starts(tmp_path, engine_lib):
    from dgr.core.errors import DgrError

    with pytest.raises(DgrError, match=r"--n-ctx 50 is less than the 64 positions .* give at least 64"):
        _bench(tmp_path, "--synth", "llama", "--stages", "2", "--tokens", "8", "--prompt-lengths", "48",
               "--rounds", "1", "--n-ctx", "50")


def test_hop_figures_add_up_to_the_ring():
    """Boundaries (sender's send + transit + receiver's queue; the last: send + return + stage 0's queue) plus
    the origin's remainder are exactly ring minus compute, token by token."""
    from dgr.app.bench.pipeline import hop_figures
    from dgr.runtime.wire.stats import Generation, TokenEvent

    ms = 1_000_000
    evs = [TokenEvent(0, "", 0, 1, 0, 0)]                          # the prefill's token: not a decode token
    for k in range(5):
        t = [(0, 0, 1 * ms, 3 * ms, ms // 10), (1, ms // 2, ms // 5, 3 * ms, ms // 10), (2, ms // 2, ms // 5, 5 * ms, ms // 10)]
        compute = sum(x[3] for x in t)
        parts = sum(x[1] + x[2] + x[4] for x in t) + ms // 2 + k * ms // 10
        evs.append(TokenEvent(k + 1, "", 1 + k, 1, compute + parts + ms // 4, compute, None, t, ms // 2 + k * ms // 10))
    fig = hop_figures([Generation(prompt_ids=[1], events=evs)], 3)
    assert fig["tokens"] == 5
    b = {x["boundary"]: x["median_ms"] for x in fig["boundaries"]}
    assert b["0->1"] == pytest.approx(0.1 + 0.5 + 0.2) and b["1->2"] == pytest.approx(0.8)
    assert b["2->origin"] == pytest.approx(0.1 + 0.7 + 1.0)            # send + median return + stage 0's queue
    assert fig["origin_ms"] == pytest.approx(0.25)
    assert fig["per_hop_ms"] * 3 == pytest.approx(sum(b.values()) + 0.25)
    assert fig["compute_ms"] == pytest.approx(11.0) and fig["stages"][2]["compute"] == pytest.approx(5.0)


def test_concurrent_decode_counts_only_the_time_every_session_was_decoding():
    """Sessions started together: one prefills for 2 s, the other decodes meanwhile; the aggregate is the tokens
    that arrived while both decoded over that time, as llama-batched-bench's S_TG leaves prefill out (the wall
    time from the start would have counted the 2 s of prefill), and a lone session is its own decode rate."""
    from dgr.runtime.wire.stats import Generation, TokenEvent, concurrent_decode_tokens_per_s

    def gen(times):
        g = Generation(prompt_ids=[1], token_ids=list(range(len(times))),
                       events=[TokenEvent(0, "", 0, 1, 0, 0, at=t) for t in times])
        g.t_start, g.t_first, g.t_last = 0.0, times[0], times[-1]
        return g

    fast = gen([0.125 * (k + 1) for k in range(32)])             # decodes from 0.125 s to 4.0 s, 8 tok/s
    slow = gen([2.0 + 0.25 * k for k in range(9)])                # its first token at 2.0 s, then 4 tok/s to 4.0 s
    # in (2.0, 4.0]: fast's tokens at 2.125 .. 4.0 (16) and slow's at 2.25 .. 4.0 (8)
    assert concurrent_decode_tokens_per_s([fast, slow]) == pytest.approx(24 / 2.0)
    assert concurrent_decode_tokens_per_s([fast]) == pytest.approx(31 / 3.875)
    assert concurrent_decode_tokens_per_s([fast, gen([5.0, 5.5])]) == 0.0   # never both decoding


def test_device_check_is_valid_bash_and_its_dry_run_stops_before_the_gpu(repo_root, tmp_path):
    script = repo_root / "scripts" / "device-check"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    run = subprocess.run([str(script), "--dry-run"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OUT": str(tmp_path)})
    assert run.returncode == 0, run.stdout + run.stderr
    plan = run.stdout
    for step in ("build-engine --lane cuda", "parity --synth llama --stages 3", "bench --synth llama --stages 3",
                 "bench --stages 3", "bench frames --rounds 3 --layers-per-stage 14"):
        assert step in plan, plan
    assert (tmp_path / "device-check.log").exists()


@pytest.mark.slow
def test_bench_conversation_reports_every_turn_on_both_networks_with_the_same_text(tmp_path, engine_lib):
    """`dgr bench conversation` (issue 23), small: every figure it promises is there, from one run, and the
    answers with and without the prefix cache are the same (its exit status says so too)."""
    out = tmp_path / "conv.json"
    p = subprocess.run([sys.executable, "-m", "dgr", "bench", "conversation", "--stages", "2", "--turns", "3",
                        "--conversations", "2", "--max-tokens", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "DGR_ENGINE_LIB": str(engine_lib)})
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["same_text"] and [t["turn"] for t in r["loopback"]] == [1, 2, 3] == [t["turn"] for t in r["wan"]]
    assert all(t["ttft_cache_ms"] > 0 and t["ttft_none_ms"] > 0 for t in r["loopback"] + r["wan"])
    assert len(r["cache_bytes_per_1000_tokens_per_stage"]) == 2 and min(r["cache_bytes_per_1000_tokens_per_stage"]) > 0
    inter = r["interleaved"]
    assert inter["lookups"] == 2 * 4 and 0 <= inter["hits"] <= inter["lookups"]   # 2 conversations x 4 turns
    assert "turn 3:" in p.stdout and "interleaved conversations" in p.stdout


def test_the_loopback_floor_is_a_real_round_trip_between_two_processes():
    from dgr.app.bench.loopback_floor import one_way_ms

    fl = one_way_ms(1.0, n=5)                                       # a second process answers each stamp
    assert fl["messages"] == 5 and fl["gap_ms"] == 1.0 and fl["one_way_p90_ms"] >= fl["one_way_ms"] > 0
    with pytest.raises(ValueError, match="n >= 1"):
        one_way_ms(1.0, n=0)


def test_socket_bytes_are_counted_per_connection_so_a_closed_one_takes_nothing_away():
    """`dgr bench`'s socket bytes (pipeline.tcp_bytes): a worker closes a link no open session uses, so a
    connection counted at one reading can be gone at the next. Counted per connection, what the port carried
    in between is what its open connections carried since, never less than nothing. Real sockets, read by ss."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def connect_and_send(n: int):
        c = socket.create_connection(("127.0.0.1", port))
        s, _ = srv.accept()
        c.sendall(b"x" * n)
        got = 0
        while got < n:
            got += len(s.recv(65536))
        return c, s

    try:
        first = connect_and_send(5000)
        time.sleep(0.2)
        b0 = tcp_bytes({port})
        if b0 is None:
            pytest.fail("ss could not read the TCP connections (iproute2's ss is required)")
        assert sum(v[0] for c, v in b0.items() if c[0] == port) >= 5000
        for s in first:                                  # the first connection closes (a pruned link) ...
            s.close()
        second = connect_and_send(3000)                  # ... and a new one carries 3000 bytes
        time.sleep(0.2)
        b1 = tcp_bytes({port})
        assert carried(b0, b1, port, 0) == 3000         # into the server: the new connection's bytes alone
        assert carried(b0, b1, port, 1) == 0
        for s in second:
            s.close()
    finally:
        srv.close()
