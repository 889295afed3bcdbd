"""dgr-worker's Prometheus metrics (`--metrics-listen`, issue 21 phase 4, docs/worker.md): the Python worker's
names and labels (dgr.wire.state.WorkerMetrics), counters that move with a generation as the Python worker's
do, bytes per seam equal on both sides, the URL in the descriptor; scraped from real worker processes."""

from __future__ import annotations

import http.client
import json
import re
import signal
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from dgr.wire.client import RouteClient
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from support.metrics import scrape, value
from support.worker import make_ca, tls_flags, wait_for
from test_worker_cpp import cpp, py, worker_bin  # noqa: F401  (worker_bin: the fixture)
from test_worker_cpp_frames import FLAGS, tiny  # noqa: F401  (tiny: the fixture)

METRICS = ("--metrics-listen", "127.0.0.1:0")
PROMPT_IDS = list(range(5, 25))
N_NEW = 12
URL = re.compile(r"metrics on (\S+)")


def _url(p) -> str:
    [u] = [m.group(1) for line in p.log if (m := URL.search(line))]
    return u


def _delta(after, before, name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


def _families(samples) -> set[str]:
    return {k[0] for k in samples}


def test_counters_move_with_a_generation_as_the_python_workers_do(tiny, worker_bin):
    routes = {}
    try:
        for kind in ("cpp", "py"):
            routes[kind] = [cpp(worker_bin, tiny[1], i, *FLAGS, *METRICS) if kind == "cpp" else
                            py(tiny[1], i, *FLAGS, *METRICS) for i in range(3)]
        deltas = {}
        for kind, procs in routes.items():
            urls = [_url(p) for p in procs]
            for p, u in zip(procs, urls):                    # the descriptor names the URL
                assert json.loads(p.stub.Describe(pb.DescribeRequest()).descriptor_json)["metrics"] == u
            before = [scrape(u) for u in urls]
            with RouteClient([p.address for p in procs]) as c:
                seam = [h.seam_bytes_per_token for h in c.describe()]
                gen = c.run(PROMPT_IDS, max_new_tokens=N_NEW, stop_token_ids=[])
            assert wait_for(lambda: all(value(scrape(u), "dgr_worker_sessions_open") == 0 for u in urls), 10)
            after = [scrape(u) for u in urls]
            n = len(gen.prompt_ids)
            for i, (a, b) in enumerate(zip(after, before)):
                assert _delta(a, b, "dgr_worker_tokens_total", kind="prefill") == n, i
                assert _delta(a, b, "dgr_worker_tokens_total", kind="decode") == N_NEW - 1, i
                assert _delta(a, b, "dgr_worker_steps_total", kind="decode") == N_NEW - 1, i
                steps = _delta(a, b, "dgr_worker_steps_total", kind="decode") + \
                    _delta(a, b, "dgr_worker_steps_total", kind="prefill")
                assert _delta(a, b, "dgr_worker_step_compute_seconds_count") == steps, i
                assert _delta(a, b, "dgr_worker_step_queue_seconds_count") == steps, i
                assert _delta(a, b, "dgr_worker_sessions_opened_total") == 1, i
                assert value(a, "dgr_worker_queued_steps") == 0
                [info] = [dict(k[1]) for k in a if k[0] == "dgr_worker_info"]
                assert (info["stage"], info["stage_count"], info["layers"], info["lane"]) == \
                    (str(i), "3", ["0-2", "2-4", "4-6"][i], "cpu")
                if i:
                    assert _delta(a, b, "dgr_worker_frame_transit_seconds_count", frame="step") == steps, i
            assert _delta(after[2], before[2], "dgr_worker_tokens_sampled_total") == N_NEW
            assert _delta(after[0], before[0], "dgr_worker_frame_transit_seconds_count", frame="token") == N_NEW
            for k, (src, dst, layer) in enumerate(((0, 1, 2), (1, 2, 4))):
                sent = _delta(after[src], before[src], "dgr_worker_seam_bytes_total", direction="sent", layer=layer)
                got = _delta(after[dst], before[dst], "dgr_worker_seam_bytes_total", direction="received", layer=layer)
                assert sent == got == (n + N_NEW - 1) * seam[src], (layer, sent, got)
            deltas[kind] = [{k: v - b.get(k, 0.0) for k, v in a.items()
                             if not k[0].endswith(("_sum", "_bucket", "_created")) and "seconds" not in k[0]
                             and k[0] not in ("dgr_worker_info", "dgr_worker_max_frame_bytes_sent")}
                            for a, b in zip(after, before)]
            if kind == "cpp":                                # the same sample names, stage for stage
                for i in range(3):
                    theirs = {f for f in _families(scrape(_url(routes["py"][i]))) if not f.endswith("_created")}
                    assert _families(after[i]) == theirs, (i, _families(after[i]) ^ theirs)
        for i in range(3):                                   # and the same counts for the same generation
            assert deltas["cpp"][i] == deltas["py"][i], i
    finally:
        for v in routes.values():
            for p in v:
                p.stop()


def test_a_bad_request_moves_the_error_counter_of_its_code(tiny, worker_bin):
    p = cpp(worker_bin, tiny[1], 1, *FLAGS, *METRICS)
    try:
        u = _url(p)
        before = scrape(u)
        frames = [pb.Frame(session_id="nobody", epoch=3, step=pb.Step(positions=[0], cache_expect=0))]
        got = next(iter(p.stub.Frames(iter(frames), timeout=30)))
        assert got.error.code == pb.UNKNOWN_SESSION
        assert _delta(scrape(u), before, "dgr_worker_errors_total", code="UNKNOWN_SESSION") == 1
        p.p.send_signal(signal.SIGTERM)                       # the metrics endpoint does not hold up a drain
        assert p.p.wait(timeout=30) == 0
    finally:
        p.stop()


def test_metrics_listen_is_refused_on_a_network_without_tls(tiny, worker_bin):
    for bad, why in (("0.0.0.0:0", "refusing to listen on 0.0.0.0:0 without TLS"), ("nohost", "give HOST:PORT")):
        r = subprocess.run([str(worker_bin), "--bundle", str(tiny[1]), "--stage", "0", "--metrics-listen", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and why in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["cpp", "py"])
def test_metrics_over_mutual_tls_as_the_python_worker_serves_them(tiny, worker_bin, tmp_path, kind):
    """Under --tls-ca: HTTPS with the worker's certificate, a client certificate from the CA required; plain
    HTTP gets no answer. The same checks pass against both workers."""
    cfg = make_ca(tmp_path / "ca", ["w0", "scraper"])
    flags = (*FLAGS, *METRICS, *tls_flags(cfg["w0"]))
    p = cpp(worker_bin, tiny[1], 0, *flags) if kind == "cpp" else py(tiny[1], 0, *flags)
    try:
        url = _url(p)
        assert url.startswith("https://127.0.0.1:"), url
        ctx = ssl.create_default_context(cafile=str(cfg["scraper"].ca))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):   # no client certificate
            urllib.request.urlopen(url, context=ctx, timeout=10).read()
        with pytest.raises((ConnectionError, urllib.error.URLError, http.client.HTTPException)):  # plain HTTP
            urllib.request.urlopen("http://" + url.removeprefix("https://"), timeout=10).read()
        ctx.load_cert_chain(str(cfg["scraper"].cert), str(cfg["scraper"].key))
        with urllib.request.urlopen(url, context=ctx, timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        assert "dgr_worker_steps_total" in text and "dgr_worker_errors_total" in text
        with grpc.secure_channel(p.address, cfg["scraper"].channel_credentials()) as ch:
            d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=30)
        assert json.loads(d.descriptor_json)["metrics"] == url
    finally:
        p.stop()
