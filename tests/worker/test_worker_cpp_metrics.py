"""dgr-worker's Prometheus metrics (`--metrics-listen`, issue 21 phase 4, docs/worker.md): the metric
families, types and labels users' dashboards read (written out below: the names the Python worker,
dgr.runtime.wire.state.WorkerMetrics, served), counters that move with a generation by what it did, bytes per seam
equal on both sides, the URL in the descriptor; scraped from real worker processes."""

from __future__ import annotations

import http.client
import json
import math
import re
import signal
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc

from support.engine import make_bundle, synth_model
from support.metrics import scrape, value
from support.worker import cpp, make_ca, tls_flags, wait_for

FLAGS = ("--threads", "1", "--n-ctx", "256")
METRICS = ("--metrics-listen", "127.0.0.1:0")
PROMPT_IDS = list(range(5, 25))
N_NEW = 12
CHUNK = 8                                 # prefill tokens per step
RANGES = [(0, 2), (2, 4), (4, 6)]
URL = re.compile(r"metrics on (\S+)")

# The contract: every family a worker serves, its type and its labels (a histogram's samples also carry
# `le`), and the latency buckets (seconds). A seam_bytes sample per seam the stage has: received at
# layer_begin unless it is the first stage, sent at layer_end unless it is the last.
FAMILIES = {
    "dgr_worker_steps": ("counter", ("kind",)),
    "dgr_worker_tokens": ("counter", ("kind",)),
    "dgr_worker_tokens_sampled": ("counter", ()),
    "dgr_worker_mtp_drafts": ("counter", ()),
    "dgr_worker_forwards": ("counter", ("sessions",)),
    "dgr_worker_sessions_opened": ("counter", ()),
    "dgr_worker_step_queue_seconds": ("histogram", ()),
    "dgr_worker_step_compute_seconds": ("histogram", ()),
    "dgr_worker_frame_transit_seconds": ("histogram", ("frame",)),
    "dgr_worker_errors": ("counter", ("code",)),
    "dgr_worker_seam_bytes": ("counter", ("direction", "layer")),
    "dgr_worker_sessions_open": ("gauge", ()),
    "dgr_worker_queued_steps": ("gauge", ()),
    "dgr_worker_cached_positions": ("gauge", ()),
    "dgr_worker_uptime_seconds": ("gauge", ()),
    "dgr_worker_max_frame_bytes_sent": ("gauge", ()),
    "dgr_worker_outgoing_channels": ("gauge", ()),
    "dgr_worker_unary_calls_running": ("gauge", ()),
    "dgr_worker_unary_calls_waiting": ("gauge", ()),
    "dgr_worker_unary_calls_members": ("gauge", ()),
    "dgr_worker_unary_calls_refused": ("counter", ()),
    "dgr_worker_sessions_reaped": ("counter", ()),
    "dgr_worker_overloaded": ("counter", ()),
    "dgr_worker_info": ("gauge", ("model", "bundle_id", "stage", "stage_count", "layers", "lane", "engine")),
    # the prefix cache (docs/worker.md "Prefix cache"): served where it is on, as here (a dense llama)
    "dgr_worker_prefix_cache_bytes": ("gauge", ()),
    "dgr_worker_prefix_cache_entries": ("gauge", ()),
    "dgr_worker_prefix_cache_lookups": ("counter", ()),
    "dgr_worker_prefix_cache_hits": ("counter", ()),
    "dgr_worker_prefix_cache_hit_tokens": ("counter", ()),
    "dgr_worker_prefix_cache_evicted": ("counter", ()),
}
LABEL_VALUES = {"kind": ("decode", "prefill"), "frame": ("step", "token"), "sessions": ("one", "shared"),
                "code": tuple(n for n in pb.ErrorCode.keys() if n != "ERROR_UNSPECIFIED")}
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engine_lib):
    d = tmp_path_factory.mktemp("cpp-metrics")
    src = synth_model(d, "llama", layers=6)
    return src, make_bundle(src, RANGES, d / "store").root


def _url(p) -> str:
    [u] = [m.group(1) for line in p.log if (m := URL.search(line))]
    return u


def _delta(after, before, name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


def _exposition(text: str) -> tuple[dict[str, str], set]:
    """An exposition's family types ({family: type}, from its TYPE lines, as prometheus_client writes them: a
    counter's TYPE line names it with `_total`, which the family here is named without) and its samples
    ({(name, sorted labels)}, `le` as the text written: "0.1", not "0.10000000000000001"); `_created`
    (prometheus_client's creation times) left out. A sample whose family has no TYPE line (a parser would
    type it unknown) fails here."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split()
            assert typ != "counter" or name.endswith("_total"), line
            if not name.endswith("_created"):
                types[name.removesuffix("_total") if typ == "counter" else name] = typ
    families = list(text_string_to_metric_families(text))
    assert not [f.name for f in families if f.type == "unknown"], "samples without their TYPE line"
    samples = {(s.name, tuple(sorted(s.labels.items())))
               for f in families for s in f.samples if not s.name.endswith("_created")}
    return types, samples


def _get(url: str, context=None) -> str:
    with urllib.request.urlopen(url, context=context, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def _assert_contract(text: str, begin: int, end: int, first: bool, last: bool) -> None:
    """Every family of FAMILIES with its type, and every sample it must hold, labels and all; nothing else."""
    types, samples = _exposition(text)
    assert types == {f: t for f, (t, _) in FAMILIES.items()}
    want = set()
    for fam, (kind, labels) in FAMILIES.items():
        if fam == "dgr_worker_seam_bytes":
            combos = [{"direction": "received", "layer": str(begin)}] * (not first) + \
                     [{"direction": "sent", "layer": str(end)}] * (not last)
        elif fam == "dgr_worker_info":
            [info] = [dict(lab) for name, lab in samples if name == fam]
            combos = [info]
            assert sorted(info) == sorted(labels), info
        else:
            combos = [{}]
            for name in labels:
                combos = [{**c, name: v} for c in combos for v in LABEL_VALUES[name]]
        names = {"counter": [("_total", {})], "gauge": [("", {})],
                 "histogram": [("_count", {}), ("_sum", {})] + [("_bucket", {"le": floatToGoString(le)}) for le in (*BUCKETS, math.inf)]}
        want |= {(fam + suffix, tuple(sorted({**c, **more}.items()))) for c in combos for suffix, more in names[kind]}
    assert samples == want, (sorted(samples - want), sorted(want - samples))


def _prefill_chunks(n: int) -> list[int]:
    return [min(CHUNK, n - lo) for lo in range(0, n, CHUNK)]


def test_counters_move_with_a_generation_by_what_it_did(tiny, worker_bin):
    procs = []
    try:
        procs = [cpp(worker_bin, tiny[1], i, *FLAGS, *METRICS) for i in range(3)]
        urls = [_url(p) for p in procs]
        descs = [p.stub.Describe(pb.DescribeRequest()) for p in procs]
        for p, d, u in zip(procs, descs, urls):                  # the descriptor names the URL
            assert json.loads(d.descriptor_json)["metrics"] == u
        for i, ((b, e), u) in enumerate(zip(RANGES, urls)):       # the families, types and labels
            _assert_contract(_get(u), b, e, i == 0, i == 2)
        before = [scrape(u) for u in urls]
        with RouteClient([p.address for p in procs], chunk_tokens=CHUNK) as c:
            seam = [h.seam_bytes_per_token for h in c.describe()]
            gen = c.run(PROMPT_IDS, max_new_tokens=N_NEW, stop_token_ids=[])
        assert len(gen.token_ids) == N_NEW
        assert wait_for(lambda: all(value(scrape(u), "dgr_worker_sessions_open") == 0 for u in urls), 10)
        after = [scrape(u) for u in urls]
        n = len(gen.prompt_ids)
        chunks = _prefill_chunks(n)
        # one step a prefill chunk (a chunk of one position counts as a decode), one a decoded token
        steps = {"prefill": sum(k > 1 for k in chunks), "decode": sum(k == 1 for k in chunks) + N_NEW - 1}
        tokens = {"prefill": sum(k for k in chunks if k > 1), "decode": sum(k == 1 for k in chunks) + N_NEW - 1}
        assert steps["prefill"] > 1                                # the prompt was chunked
        for i, (a, b) in enumerate(zip(after, before)):
            assert _delta(a, b, "dgr_worker_step_compute_seconds_count") == sum(steps.values()), i
            assert _delta(a, b, "dgr_worker_step_queue_seconds_count") == sum(steps.values()), i
            if i:
                assert _delta(a, b, "dgr_worker_frame_transit_seconds_count", frame="step") == sum(steps.values()), i
            [info] = [dict(k[1]) for k in a if k[0] == "dgr_worker_info"]
            ident = descs[i].identity
            assert info == {"model": ident.model, "bundle_id": ident.bundle_id, "stage": str(i), "stage_count": "3",
                            "layers": "%d-%d" % RANGES[i], "lane": "cpu", "engine": descs[i].engine}, i
            for k in ("sessions_open", "queued_steps", "cached_positions"):
                assert value(a, f"dgr_worker_{k}") == 0, (i, k)
            # every other sample, labels and all, moved by exactly what the generation did
            want = {("dgr_worker_steps_total", (("kind", k),)): float(v) for k, v in steps.items()}
            want |= {("dgr_worker_tokens_total", (("kind", k),)): float(v) for k, v in tokens.items()}
            want |= {("dgr_worker_errors_total", (("code", c),)): 0.0 for c in LABEL_VALUES["code"]}
            want |= {(f"dgr_worker_{k}", ()): 0.0 for k in ("sessions_open", "queued_steps", "cached_positions",
                                                          "sessions_reaped_total", "overloaded_total")}
            want[("dgr_worker_sessions_opened_total", ())] = 1.0
            # the prefix cache: 31 positions ran, less than one block (32): nothing looked up, nothing kept
            want |= {(f"dgr_worker_prefix_cache_{k}", ()): 0.0 for k in (
                "bytes", "entries", "lookups_total", "hits_total", "hit_tokens_total", "evicted_total")}
            # one session alone: every step ran in a forward of its own
            want[("dgr_worker_forwards_total", (("sessions", "one"),))] = float(sum(steps.values()))
            want[("dgr_worker_forwards_total", (("sessions", "shared"),))] = 0.0
            want[("dgr_worker_tokens_sampled_total", ())] = float(N_NEW if i == 2 else 0)
            want[("dgr_worker_mtp_drafts_total", ())] = 0.0             # no MTP block, no --speculate mtp
            if i:
                want[("dgr_worker_seam_bytes_total", (("direction", "received"), ("layer", str(RANGES[i][0]))))] = \
                    float((n + N_NEW - 1) * seam[i - 1])
            if i < 2:
                want[("dgr_worker_seam_bytes_total", (("direction", "sent"), ("layer", str(RANGES[i][1]))))] = \
                    float((n + N_NEW - 1) * seam[i])
            got = {k: v - b.get(k, 0.0) for k, v in a.items()
                   if not k[0].endswith(("_sum", "_bucket", "_created")) and "seconds" not in k[0]
                   and k[0] not in ("dgr_worker_info", "dgr_worker_max_frame_bytes_sent",
                                    "dgr_worker_outgoing_channels") and not k[0].startswith("dgr_worker_unary_calls")}
            assert got == want, (i, {k: (got.get(k), want.get(k)) for k in got.keys() | want.keys()
                                     if got.get(k) != want.get(k)})
            assert value(a, "dgr_worker_max_frame_bytes_sent") > 0, i
        assert _delta(after[0], before[0], "dgr_worker_frame_transit_seconds_count", frame="token") == N_NEW
        for k, (src, dst, layer) in enumerate(((0, 1, 2), (1, 2, 4))):   # both sides of a seam count alike
            sent = _delta(after[src], before[src], "dgr_worker_seam_bytes_total", direction="sent", layer=layer)
            got = _delta(after[dst], before[dst], "dgr_worker_seam_bytes_total", direction="received", layer=layer)
            assert sent == got == (n + N_NEW - 1) * seam[src] > 0, (layer, sent, got)
    finally:
        for p in procs:
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


def test_metrics_over_mutual_tls(tiny, worker_bin, tmp_path):
    """Under --tls-ca: HTTPS with the worker's certificate, a client certificate from the CA required; plain
    HTTP gets no answer; what a scraper with a certificate gets is the whole contract."""
    cfg = make_ca(tmp_path / "ca", ["w0", "scraper"])
    p = cpp(worker_bin, tiny[1], 0, *FLAGS, *METRICS, *tls_flags(cfg["w0"]))
    try:
        url = _url(p)
        assert url.startswith("https://127.0.0.1:"), url
        ctx = ssl.create_default_context(cafile=str(cfg["scraper"].ca))
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):   # no client certificate
            urllib.request.urlopen(url, context=ctx, timeout=10).read()
        with pytest.raises((ConnectionError, urllib.error.URLError, http.client.HTTPException)):  # plain HTTP
            urllib.request.urlopen("http://" + url.removeprefix("https://"), timeout=10).read()
        ctx.load_cert_chain(str(cfg["scraper"].cert), str(cfg["scraper"].key))
        _assert_contract(_get(url, ctx), *RANGES[0], True, False)
        with grpc.secure_channel(p.address, cfg["scraper"].channel_credentials()) as ch:
            d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=30)
        assert json.loads(d.descriptor_json)["metrics"] == url
    finally:
        p.stop()
