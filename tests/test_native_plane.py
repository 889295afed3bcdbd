"""The native data plane (`dgr worker serve --data-plane native`, worker/engine/dgr_dataplane.cpp): greedy
decode steps go round the ring in C++ over plain TCP, in real worker processes, and the generation equals
the whole model's token for token (SmolLM2 and a tiny llama here; V4's sideband and every family in
their own tests); sessions share engine forwards; the row each token was drawn from comes back with it
for parity runs; sampled sessions draw in C++ exactly what the Python sampler draws; what the plane does
not do (every position's logits) stays on gRPC and stays exact; a worker killed or a session closed mid-decode is routed around or reopened; garbage on the port
is dropped; the frame layout is one contract (proto/dgr/v1/native.md, the C header and source,
dgr.wire.native)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dgr.app.local import LocalRoute
from dgr.wire import native
from dgr.wire.client import RouteClient

from support.route import SAMPLED, die_at, run_with_fault

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The three primary colors are"


def _route(engine_lib, bundle, plane="native", replicas=1, n_ctx=512):
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(n_ctx),
             "--data-plane", plane] for i in range(len(bundle.manifest.stages))]
    return LocalRoute(args, replicas=replicas, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


def _closed_by_peer(s: socket.socket) -> bool:
    """The worker closed the connection (EOF, or a reset where bytes it did not read were left)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def _native_steps(c: RouteClient) -> list[int]:
    return [d.native_steps for d in c.describe()]


def test_frame_layout_is_one_contract():
    doc = (REPO / "proto/dgr/v1/native.md").read_text()
    head = (REPO / "worker/engine/dgr_dataplane.h").read_text()
    src = (REPO / "worker/engine/dgr_dataplane.cpp").read_text()
    assert f"0x{native.FRAME_MAGIC:08X}" in doc
    assert re.search(rf"DGR_DP_MAGIC\s+0x{native.FRAME_MAGIC:08X}u", head)
    assert re.search(rf"DGR_DP_MAX_HOPS\s+{native.MAX_HOPS}\b", head) and f"at most {native.MAX_HOPS}" in doc
    assert re.search(rf"FIXED_BYTES\s+=\s+{native.FRAME_FIXED_BYTES};", src)
    assert re.search(rf"HOP_BYTES\s+=\s+{native.HOP_BYTES};", src) and f"{native.HOP_BYTES} bytes each" in doc
    assert re.search(rf"MAX_BODY\s+=\s+1u << {native.MAX_BODY_BYTES.bit_length() - 1};", src)
    assert f"over {native.MAX_BODY_BYTES >> 20} MiB" in doc
    # the doc's table: offsets in order, the fixed part ends where the variable part starts
    offsets = [int(m) for m in re.findall(r"^\| (\d+) \|", doc, re.M)]
    assert offsets == sorted(offsets) and offsets[-1] == native.FRAME_FIXED_BYTES
    codes = {"1 unreachable": native.E_UNREACHABLE, "2 cache miss": native.E_CACHE_MISS, "3 engine": native.E_ENGINE,
             "4 unknown session": native.E_UNKNOWN, "5 context full": native.E_CONTEXT_FULL}
    for text, code in codes.items():
        assert text in doc and text.startswith(str(code))


@pytest.fixture(scope="module")
def smollm2(engine_lib, smollm2_gguf):
    """The 3-stage bundle and the whole model's greedy tokens and logits for PROMPT."""
    from dgr.app.demo import ensure_bundle, whole_model_run
    from dgr.engine import Engine

    with Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1) as eng:
        ids = eng.tokenize(PROMPT)
        ref = whole_model_run(eng, ids, 24)
    return ensure_bundle(3, progress=False)[0], ids, ref


@pytest.mark.engine
@pytest.mark.slow
def test_smollm2_native_ring_equals_the_whole_model(engine_lib, smollm2):
    bundle, ids, ref = smollm2
    with _route(engine_lib, bundle) as r, RouteClient(r.addresses) as c:
        hops = c.describe()
        assert all(d.native_address for d in hops)
        gen = c.run(ids, max_new_tokens=24, stop_token_ids=[])
        steps = _native_steps(c)
        # the first token comes from the prefill (gRPC); the other 23 went round the native ring
        assert steps == [23, 23, 23], steps
        # a parity run: the row each token was drawn from comes back with it, round the native ring too
        parity = c.run(ids, max_new_tokens=8, logits="last", stop_token_ids=[])
        assert _native_steps(c) == [30, 30, 30]
        # every position's rows (LOGITS_ALL) are not what the plane does: that session stays on gRPC
        every = c.run(ids, max_new_tokens=4, logits="all", stop_token_ids=[])
        assert _native_steps(c) == [30, 30, 30]
    assert gen.token_ids == ref.token_ids and gen.epochs == 1
    assert every.token_ids == ref.token_ids[:4]
    # every token still carries every stage's timings
    assert all(sorted(h[0] for h in ev.timings) == [0, 1, 2] and ev.compute_ns > 0 for ev in gen.events[1:])
    assert parity.token_ids == ref.token_ids[:8]
    assert all(np.array_equal(parity.logits[len(ids) - 1 + k], ref.logits[k]) for k in range(8))


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_sessions_forced_to_share_every_forward_equal_the_whole_model_alone(engine_lib, smollm2_gguf, smollm2, n):
    """Sharing is forced, not hoped for: every stage holds its queue (--hold-batch N) until steps of N
    sessions wait, so the N prompts (different lengths) prefill in one forward per stage and every
    decode step of one session shares its forward with the other N - 1, at other positions. Each
    session's tokens and logits rows equal the whole model run alone, bit for bit."""
    from dgr.app.demo import whole_model_run
    from dgr.engine import Engine

    bundle = smollm2[0]
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived",
               "def fibonacci(n):", "Water boils at one hundred degrees Celsius, and"][:n]
    with Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1) as eng:
        ids = [eng.tokenize(p) for p in prompts]
        refs = [whole_model_run(eng, i, 12) for i in ids]
    assert len({len(i) for i in ids}) == n                  # every session at other positions
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--data-plane", "native",
             "--hold-batch", str(n)] for i in range(3)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r:
        def one(i):
            with RouteClient(r.addresses) as c:
                return c.run(ids[i], max_new_tokens=12, logits="last", stop_token_ids=[])

        with ThreadPoolExecutor(n) as ex:
            got = list(ex.map(one, range(n)))
        with RouteClient(r.addresses) as c:
            hops = c.describe()
    for i, (g, ref) in enumerate(zip(got, refs)):
        assert g.token_ids == ref.token_ids, f"session {i}"
        for k in range(12):
            assert np.array_equal(g.logits[len(ids[i]) - 1 + k].view(np.uint32), ref.logits[k].view(np.uint32)), \
                f"session {i}, token {k}"
    # the first token of each comes from its prefill (gRPC), the other 11 went round the native ring, and
    # the hold made every native forward carry one step of each of the n sessions
    assert [d.native_steps for d in hops] == [n * 11] * 3
    assert [d.native_forwards for d in hops] == [11] * 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from support.engine import make_bundle, synth_model

    d = tmp_path_factory.mktemp("native-tiny")
    return make_bundle(synth_model(d, "llama"), [(0, 2), (2, 4), (4, 6)], d)


@pytest.mark.engine
def test_the_native_sampler_draws_what_the_python_sampler_draws(engine_lib):
    """dgr_sample (C++) and dgr.wire.sampling.sample are one algorithm: exp bit for bit (a fused
    multiply-add anywhere in the C++ would show here), the same uniforms, the same token on random rows
    (ties, top-k, top-p, temperatures)."""
    from dgr.engine import load_library
    from dgr.wire.native import NativeSampler
    from dgr.wire.sampling import exp_fixed, sample, uniform

    ns = NativeSampler(load_library(engine_lib))
    rng = np.random.default_rng(0)
    d = np.concatenate([-rng.exponential(30, size=20000), [0.0, -1e-300, -745.0, -800.0, -708.4]])
    c = np.array([ns.exp_fixed(x) for x in d])
    assert np.array_equal(exp_fixed(d).view(np.uint64), c.view(np.uint64))
    ok = np.exp(d) > 1e-300
    assert np.max(np.abs(exp_fixed(d)[ok] / np.exp(d[ok]) - 1)) < 1e-15
    assert all(uniform(s, p) == ns.uniform(s, p) for s in (0, 1, 11, 2**63 + 5) for p in range(300))
    for i in range(3000):
        n = int(rng.integers(2, 3000))
        row = (rng.standard_normal(n) * rng.uniform(0.1, 8)).astype(np.float32)
        if i % 7 == 0:
            row[rng.integers(0, n, 5)] = row.max()     # ties
        kw = dict(temperature=float(np.float32(rng.uniform(0.05, 2.0))), top_k=int(rng.choice([0, 1, 5, 40, 5000])),
                  top_p=float(np.float32(rng.choice([0.0, 0.5, 0.9, 0.95, 1.0]))),
                  seed=int(rng.integers(0, 2**63)), position=int(rng.integers(0, 100000)))
        assert sample(row, **kw) == ns.sample(row, **kw), (i, kw)
        assert sample(row) == ns.sample(row)


@pytest.mark.engine
def test_sampled_sessions_go_native_and_equal_the_grpc_plane(engine_lib, tiny):
    ids = list(range(5, 25))
    with _route(engine_lib, tiny, "grpc", n_ctx=256) as r, RouteClient(r.addresses) as c:
        assert not any(d.native_address for d in c.describe())
        want_sampled = c.run(ids, max_new_tokens=24, stop_token_ids=[], **SAMPLED)
        want_greedy = c.run(ids, max_new_tokens=24, stop_token_ids=[])
        want_top = c.run(ids, max_new_tokens=24, stop_token_ids=[], temperature=0.7, top_k=5, seed=3)
    with _route(engine_lib, tiny, n_ctx=256) as r, RouteClient(r.addresses) as c:
        sampled = c.run(ids, max_new_tokens=24, stop_token_ids=[], **SAMPLED)
        assert _native_steps(c) == [23, 23, 23]
        greedy = c.run(ids, max_new_tokens=24, stop_token_ids=[])
        top = c.run(ids, max_new_tokens=24, stop_token_ids=[], temperature=0.7, top_k=5, seed=3)
        assert _native_steps(c) == [69, 69, 69]
    assert sampled.token_ids == want_sampled.token_ids and sampled.token_ids != greedy.token_ids
    assert greedy.token_ids == want_greedy.token_ids
    assert top.token_ids == want_top.token_ids


@pytest.mark.engine
def test_a_lossy_wire_dtype_keeps_the_session_on_grpc(engine_lib, tiny):
    """Native frames carry float32 boundaries; a route served in f16 must round at every seam as it asked,
    so its sessions stay on gRPC and give the gRPC plane's f16 tokens."""
    ids = list(range(5, 25))

    def route(plane):
        args = [["--bundle", str(tiny.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256",
                 "--data-plane", plane, "--wire-dtype", "f16"] for i in range(3)]
        return LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)

    with route("grpc") as r, RouteClient(r.addresses) as c:
        want = c.run(ids, max_new_tokens=16, logits="last", stop_token_ids=[])
    with route("native") as r, RouteClient(r.addresses) as c:
        got = c.run(ids, max_new_tokens=16, logits="last", stop_token_ids=[])
        assert _native_steps(c) == [0, 0, 0]
    assert got.token_ids == want.token_ids
    assert all(np.array_equal(got.logits[p], want.logits[p]) for p in want.logits)


@pytest.mark.engine
def test_a_middle_stage_killed_mid_decode_is_routed_around(engine_lib, tiny):
    ids = list(range(5, 25))
    args = [["--bundle", str(tiny.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256",
             "--data-plane", "native"] for i in range(3)]
    fault = die_at("victim", len(ids), 9)              # the native plane kills its process mid-decode
    with LocalRoute(args, replicas=[1, 2, 1], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300,
                    extra=lambda i, k: fault if (i, k) == (1, 0) else []) as r:
        with RouteClient(r.replicas) as c:
            want = c.run(ids, max_new_tokens=48, stop_token_ids=[])
        with RouteClient(r.replicas) as c:
            gen = c.run(ids, max_new_tokens=48, stop_token_ids=[], session_id="victim")
            after = c.describe()
    assert gen.token_ids == want.token_ids
    # (the gRPC link stage 0 keeps for prefills may notice first, or the native write: either names stage 1)
    assert gen.epochs >= 2 and gen.failures[0].stage == 1 and gen.failures[0].code == "HOP_UNREACHABLE"
    assert after[1].native_steps > 0                   # the replica's decode went native too


@pytest.mark.engine
def test_a_session_closed_under_the_native_ring_is_reported_and_reopened(engine_lib, tiny):
    import grpc

    from dgr.wire.gen import stage_pb2 as pb
    from dgr.wire.gen import stage_pb2_grpc as pb_grpc

    ids = list(range(5, 25))
    with _route(engine_lib, tiny, n_ctx=256) as r:
        with RouteClient(r.addresses) as c:
            want = c.run(ids, max_new_tokens=40, stop_token_ids=[])
        stub = pb_grpc.StageStub(grpc.insecure_channel(r.addresses[1]))

        def close_at_stage_1():                        # as a reaper or an operator would, mid-decode
            stub.CloseSession(pb.CloseSessionRequest(session_id="s", epoch=1, chain=False), timeout=10)

        with RouteClient(r.addresses) as c:
            gen, _ = run_with_fault(c, close_at_stage_1, 9, prompt=ids, max_new_tokens=40, session_id="s")
    assert gen.token_ids == want.token_ids
    f = gen.failures[0]
    assert gen.epochs == 2 and (f.stage, f.code) == (1, "UNKNOWN_SESSION"), gen.failures
    assert "native plane" in f.why and "session s epoch 1" in f.why and "open it again" in f.why


@pytest.mark.engine
def test_garbage_on_the_native_port_is_dropped_and_the_worker_keeps_serving(engine_lib, tiny):
    ids = list(range(5, 25))
    with _route(engine_lib, tiny, n_ctx=256) as r, RouteClient(r.addresses) as c:
        want = c.run(ids, max_new_tokens=12, stop_token_ids=[])
        host, _, port = c.describe()[1].native_address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _closed_by_peer(s)
        with socket.create_connection((host, int(port)), timeout=10) as s:   # the right magic, lengths that lie
            s.sendall(native.FRAME_MAGIC.to_bytes(4, "little") + (native.FRAME_FIXED_BYTES).to_bytes(4, "little")
                      + bytes([1, 0, 200, 0]) + bytes(native.FRAME_FIXED_BYTES - 4))
            assert _closed_by_peer(s)
        with socket.create_connection((host, int(port)), timeout=10) as s:   # a body it will not allocate
            s.sendall(native.FRAME_MAGIC.to_bytes(4, "little") + (native.MAX_BODY_BYTES + 1).to_bytes(4, "little"))
            assert _closed_by_peer(s)
        again = c.run(ids, max_new_tokens=12, stop_token_ids=[])
        log = "".join(r.logs[1])
    assert again.token_ids == want.token_ids
    assert "not a dgr native frame (bad magic)" in log and "frame lengths disagree" in log
    assert "frame body length out of range" in log


def test_native_plane_is_refused_where_it_cannot_run(tmp_path):
    fake = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--fake-engine", "layers=4,cuts=2",
                           "--stage", "0", "--data-plane", "native"], capture_output=True, text=True, timeout=60)
    assert fake.returncode != 0 and "needs the llama.cpp engine" in fake.stderr and "Traceback" not in fake.stderr
