"""A worker's Prometheus metrics (`dgr worker serve --metrics-listen`), scraped from real worker processes
before and after a generation: steps, tokens, sampled tokens, step latency histograms, sessions, queue
depth, bytes per seam (equal on both sides of a seam), and errors by the code the worker answered."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb

from support.metrics import metrics_urls, scrape, value
from support.route import PROMPT, fake_route
from support.wire import RawStream, open_on
from support.worker import describe, sigterm_and_time, wait_for

METRICS = ["--metrics-listen", "127.0.0.1:0"]
N_NEW = 12
EMBD = 16                                          # support.route.SPEC: embd=16, one stream, f32 on the wire


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_move_with_a_generation_and_seams_agree():
    with fake_route(extra=METRICS) as r:
        urls = metrics_urls(r)
        before = [scrape(u) for u in urls]
        with RouteClient(r.addresses) as c:
            gen = c.run(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
        assert len(gen.token_ids) == N_NEW
        after = [scrape(u) for u in urls]
        n_prompt = len(gen.prompt_ids)
        for i, (a, b) in enumerate(zip(after, before)):
            # every stage ran the prompt's chunks and one decode step per token after the first
            assert _delta(a, b, "dgr_worker_tokens_total", kind="prefill") == n_prompt, i
            assert _delta(a, b, "dgr_worker_tokens_total", kind="decode") == N_NEW - 1, i
            assert _delta(a, b, "dgr_worker_steps_total", kind="decode") == N_NEW - 1, i
            steps = _delta(a, b, "dgr_worker_steps_total", kind="decode") + \
                _delta(a, b, "dgr_worker_steps_total", kind="prefill")
            # one latency observation per step, of each kind the worker measures
            assert _delta(a, b, "dgr_worker_step_compute_seconds_count") == steps, i
            assert _delta(a, b, "dgr_worker_step_queue_seconds_count") == steps, i
            assert _delta(a, b, "dgr_worker_sessions_opened_total") == 1, i
            assert value(a, "dgr_worker_queued_steps") == 0
            [info] = [dict(k[1]) for k in a if k[0] == "dgr_worker_info"]
            assert (info["stage"], info["stage_count"], info["layers"], info["lane"], info["engine"]) == \
                (str(i), "3", ["0-2", "2-4", "4-6"][i], "cpu", "fake")
            if i:                                      # steps came over the wire from the hop before
                assert _delta(a, b, "dgr_worker_frame_transit_seconds_count", frame="step") == steps, i
        assert _delta(after[2], before[2], "dgr_worker_tokens_sampled_total") == N_NEW
        assert _delta(after[0], before[0], "dgr_worker_tokens_sampled_total") == 0
        # the origin timed every token's return from the last stage
        assert _delta(after[0], before[0], "dgr_worker_frame_transit_seconds_count", frame="token") == N_NEW
        # bytes per seam: what stage i sends at a seam is what stage i+1 receives there, all of it f32 boundary
        want = (n_prompt + N_NEW - 1) * EMBD * 4
        for seam, (src, dst) in ((2, (0, 1)), (4, (1, 2))):
            sent = _delta(after[src], before[src], "dgr_worker_seam_bytes_total", direction="sent", layer=seam)
            got = _delta(after[dst], before[dst], "dgr_worker_seam_bytes_total", direction="received", layer=seam)
            assert sent == got == want, (seam, sent, got, want)
        # the client closed its session: every stage shows it gone
        assert wait_for(lambda: all(value(scrape(u), "dgr_worker_sessions_open") == 0 for u in urls), 10)
        assert all(value(scrape(u), "dgr_worker_errors_total", code="UNKNOWN_SESSION") == 0 for u in urls)
        rc, _ = sigterm_and_time(r, 1)                 # the metrics endpoint does not hold up a drain
        assert rc == 0


def test_a_bad_request_moves_the_error_counter_of_its_code():
    with fake_route(extra=METRICS) as r:
        urls = metrics_urls(r)
        descs = [describe(a) for a in r.addresses]
        before = [scrape(u) for u in urls]
        raw = RawStream(r.addresses[1])
        try:
            # a step for a session nobody opened: UNKNOWN_SESSION
            reply = raw.ask(pb.Frame(session_id="nobody", epoch=1, step=pb.Step(positions=[0], cache_expect=0)))
            assert reply.error.code == pb.UNKNOWN_SESSION
            # an open session, then a step whose positions are not contiguous: BAD_FRAME, twice
            import grpc

            from dgr.runtime.wire.gen import stage_pb2_grpc as pb_grpc
            with grpc.insecure_channel(r.addresses[1]) as ch:
                assert not open_on(pb_grpc.StageStub(ch), r.addresses, 1, descs, "s", 1).HasField("error")
            for _ in range(2):
                reply = raw.ask(pb.Frame(session_id="s", epoch=1, step=pb.Step(positions=[0, 2], cache_expect=0)))
                assert reply.error.code == pb.BAD_FRAME
        finally:
            raw.close()
        after = [scrape(u) for u in urls]
        assert _delta(after[1], before[1], "dgr_worker_errors_total", code="UNKNOWN_SESSION") == 1
        assert _delta(after[1], before[1], "dgr_worker_errors_total", code="BAD_FRAME") == 2
        assert _delta(after[1], before[1], "dgr_worker_errors_total", code="SCHEMA_MISMATCH") == 0
        for other in (0, 2):                           # only the worker that answered counts them
            assert _delta(after[other], before[other], "dgr_worker_errors_total", code="BAD_FRAME") == 0
        # the descriptor counts the same answers
        from support.metrics import descriptor

        d = descriptor(r.addresses[1])
        assert d.health.errors == {"UNKNOWN_SESSION": 1, "BAD_FRAME": 2}
        assert d.metrics == urls[1] and d.load.open_sessions == 1


def test_metrics_listen_is_refused_on_a_network_without_tls():
    from support.route import SPEC

    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "0",
                          "--metrics-listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "refusing to listen on 0.0.0.0:0 without TLS" in out.stderr   # dgr-worker's refusal
    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", SPEC, "--stage", "0",
                          "--metrics-listen", "nowhere"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--metrics-listen 'nowhere'" in out.stderr and "Traceback" not in out.stderr


def test_metrics_over_mutual_tls(tmp_path):
    import ssl
    import urllib.request

    from dgr.app.local import LocalRoute

    from support.worker import make_ca, tls_flags

    cfg = make_ca(tmp_path / "ca", ["w0", "scraper"])
    args = ["--fake-engine", "layers=4,embd=8,cuts=2", "--stage", "0", *METRICS, *tls_flags(cfg["w0"])]
    with LocalRoute([args]) as r:
        [url] = metrics_urls(r)
        assert url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=str(cfg["scraper"].ca))
        with pytest.raises(Exception):                 # no client certificate: refused
            urllib.request.urlopen(url, context=ctx, timeout=10).read()
        ctx.load_cert_chain(str(cfg["scraper"].cert), str(cfg["scraper"].key))
        text = urllib.request.urlopen(url, context=ctx, timeout=10).read().decode()
        assert "dgr_worker_steps_total" in text


@pytest.mark.engine
def test_real_engine_counters_move(tmp_path, engine_lib):
    from dgr.app.local import LocalRoute

    from support.engine import make_bundle, synth_model

    bundle = make_bundle(synth_model(tmp_path, "llama"), [(0, 3), (3, 6)], tmp_path)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", "128", *METRICS]
            for i in range(2)]
    ids = list(range(5, 25))
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r:
        urls = metrics_urls(r)
        before = [scrape(u) for u in urls]
        with RouteClient(r.addresses) as c:
            gen = c.run(ids, max_new_tokens=8, stop_token_ids=[])
        after = [scrape(u) for u in urls]
    assert len(gen.token_ids) == 8
    for a, b in zip(after, before):
        assert _delta(a, b, "dgr_worker_tokens_total", kind="prefill") == len(ids)
        assert _delta(a, b, "dgr_worker_tokens_total", kind="decode") == 7
        assert _delta(a, b, "dgr_worker_step_compute_seconds_sum") > 0
    assert _delta(after[1], before[1], "dgr_worker_tokens_sampled_total") == 8
    want = (len(ids) + 7) * 64 * 4                  # synth embd 64, f32
    assert _delta(after[0], before[0], "dgr_worker_seam_bytes_total", direction="sent", layer=3) == want
    assert _delta(after[1], before[1], "dgr_worker_seam_bytes_total", direction="received", layer=3) == want
