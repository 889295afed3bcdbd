"""One numerics per route (docs/numerics.md): every engine says what decides its bits, every worker advertises it,
and clients, the gateway, parity and certification refuse to mix numerics unless told to, and then say so.

The mix used here is one this machine always has: a stage started with `--fast-kernels` (llama.cpp's
shape-dependent kernels) beside stages on the batch-invariant reference kernels, from one engine library."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import requests

from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import MixedNumerics, StageError

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "The three primary colors are"
MAX_NEW = 12


def _bundle(stages: int = 3):
    from dgr.app.demo import ensure_bundle

    return ensure_bundle(stages, progress=False)[0]


def _args(stage: int, *extra: str) -> list[str]:
    return ["--bundle", str(_bundle().root), "--stage", str(stage), "--threads", "1", "--n-ctx", "512", *extra]


@pytest.fixture(scope="module")
def mixed(engine_lib):
    """Stages 0 and 1 on reference kernels, stage 2 on fast kernels; a second replica of stage 2 on reference."""
    with LocalRoute([_args(0), _args(1), _args(2, "--fast-kernels")], env={"DGR_ENGINE_LIB": str(engine_lib)},
                    timeout=300) as fast_last, \
            LocalRoute([_args(2)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as ref_last:
        yield fast_last.addresses, ref_last.addresses[0]


def test_an_engine_names_its_numerics_build_kernels_and_kv(engine_lib, smollm2_gguf):
    from dgr.runtime.engine import Engine
    from dgr.runtime.engine_abi import load_library
    from dgr.toolchain.pin import load_pin, patch_series

    pin = load_pin()
    build = load_library(engine_lib).dgr_numerics_build().decode()
    # the CMake build compiles ggml's CPU backend for the lane's declared baseline, as Bazel does
    assert build.startswith("cpu/x86-64-v3 gcc-"), build
    assert build.endswith(f" llama.cpp-{pin.commit[:12]}+{len(pin.patches)}.{patch_series(pin)[:12]}"), build
    opened = {}
    for kw in ({}, {"fast_kernels": True}, {"kv_dtype": "f32"}, {"kernels": "invariant"}):
        eng = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1, n_ctx=256, **kw)
        try:
            opened[tuple(kw)] = eng.numerics
        finally:
            eng.close()
    assert opened[()] == build + " reference kv-f16 fa-auto"
    assert opened[("fast_kernels",)] == build + " fast kv-f16 fa-auto"
    assert opened[("kv_dtype",)] == build + " reference kv-f32 fa-auto"
    assert opened[("kernels",)] == build + " invariant kv-f16 fa-auto"
    out = subprocess.run([sys.executable, "-m", "dgr", "--version"], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "DGR_ENGINE_LIB": str(engine_lib)})
    assert out.returncode == 0, out.stderr
    assert f"numerics {build} ({engine_lib})" in out.stdout


def test_workers_advertise_their_numerics_and_a_mix_is_refused_by_name(mixed, engine_lib):
    addresses, _ = mixed
    with RouteClient(addresses[:2]) as c:
        descs = c.describe()
    ref = descs[0].identity.numerics
    assert ref.endswith(" reference kv-f16 fa-auto") and descs[1].identity.numerics == ref
    import json

    assert json.loads(descs[0].descriptor_json)["identity"]["numerics"] == ref
    with RouteClient(addresses) as c, pytest.raises(MixedNumerics) as err:
        c.run(PROMPT, max_new_tokens=4)
    msg = str(err.value)
    assert msg.startswith("stage 2 (") and "fast kv-f16" in msg and "but stage 0 computes" in msg and ref in msg
    assert "--allow-mixed-numerics" in msg
    # the command line says the same and exits non-zero
    out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", ",".join(addresses), "--max-tokens", "4",
                          PROMPT], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "fast kv-f16" in out.stderr and "their results differ" in out.stderr, out.stderr


def test_an_allowed_mix_runs_and_every_result_says_it_is_not_exact(mixed):
    addresses, _ = mixed
    with RouteClient(addresses, allow_mixed_numerics=True) as c:
        gen = c.run(PROMPT, max_new_tokens=4)
    assert gen.token_ids and not gen.exact
    assert [n.split(" ")[-3] for n in gen.numerics] == ["reference", "reference", "fast"]
    out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", ",".join(addresses), "--max-tokens", "4",
                          "--allow-mixed-numerics", PROMPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dgr: not exact: this route mixes numerics (stage 0: cpu/x86-64-v3" in out.stderr


def test_recovery_never_moves_a_stage_onto_a_replica_of_other_numerics(mixed, engine_lib, smollm2_gguf):
    """Stage 2's replicas: reference first (the route's numerics), fast second. Killing the first makes the client
    look for another: it refuses the fast one by name instead of finishing the text on other numerics."""
    fast_addrs, ref_last = mixed
    with LocalRoute([_args(2)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as victim:
        route = [[fast_addrs[0]], [fast_addrs[1]], [victim.addresses[0], fast_addrs[2]]]
        with RouteClient(route, attempts=2, hop_deadline=1.0) as c:
            first = c.run(PROMPT, max_new_tokens=2)
            assert first.exact
            victim.procs[0].kill()
            victim.procs[0].wait()
            with pytest.raises(StageError) as err:
                c.run(PROMPT, max_new_tokens=4)
    assert "fast kv-f16" in str(err.value) and "their results differ" in str(err.value), str(err.value)
    # a replica of the route's own numerics is taken: the text is the whole route's
    with RouteClient([[fast_addrs[0]], [fast_addrs[1]], [ref_last]]) as c:
        assert c.run(PROMPT, max_new_tokens=4).exact


def test_the_gateway_refuses_a_mix_and_labels_an_allowed_one(mixed):
    from support.gateway import gateway, metric

    addresses, ref_last = mixed
    with pytest.raises(StageError, match="their results differ"):
        with gateway(",".join(addresses)):
            pass
    with gateway(",".join(addresses[:2] + [ref_last])) as g:
        r = requests.post(g.url + "/v1/completions", json={"model": g.backend.info.name, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-dgr-exact"] == "true"
        assert not r.json()["system_fingerprint"].endswith("-mixed")
        assert metric(requests.get(g.url + "/metrics").text, "dgr_gateway_route_exact") == 1
    with gateway(",".join(addresses), allow_mixed_numerics=True) as g:
        r = requests.post(g.url + "/v1/completions", json={"model": g.backend.info.name, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-dgr-exact"] == "false"
        assert r.json()["system_fingerprint"].endswith("-mixed")
        assert requests.get(g.url + "/v1/models").headers["x-dgr-exact"] == "false"
        assert metric(requests.get(g.url + "/metrics").text, "dgr_gateway_route_exact") == 0


def test_the_gateway_checks_every_replica_when_it_starts(mixed):
    """A spare replica of other numerics is named when the gateway starts, not found at a recovery."""
    from support.gateway import gateway

    addresses, ref_last = mixed
    with pytest.raises(MixedNumerics) as err:
        with gateway(f"{addresses[0]},{addresses[1]},{ref_last}|{addresses[2]}"):
            pass
    assert str(err.value).startswith(f"stage 2 replica {addresses[2]}: computes ") and "fast kv-f16" in str(err.value)
    with gateway(f"{addresses[0]},{addresses[1]},{ref_last}|{addresses[2]}", allow_mixed_numerics=True) as g:
        assert requests.get(g.url + "/v1/models").headers["x-dgr-exact"] == "false"


def test_parity_refuses_a_baseline_of_other_numerics(engine_lib, smollm2_gguf, tmp_path):
    """`dgr baseline` records its numerics; `dgr parity` compares a split only with a baseline of its own."""
    base = tmp_path / "fast.npz"
    env = {**__import__("os").environ, "DGR_ENGINE_LIB": str(engine_lib)}
    made = subprocess.run([sys.executable, "-m", "dgr", "baseline", str(smollm2_gguf), "-o", str(base), "--steps", "2",
                           "--threads", "1", "--kv-dtype", "f16"], capture_output=True, text=True, timeout=600, env=env)
    assert made.returncode == 0, made.stderr
    assert "numerics: cpu/x86-64-v3" in made.stdout
    from dgr.toolchain.parity import load_baseline, save_baseline

    sched, res, meta = load_baseline(base)
    assert meta["numerics"].endswith(" reference kv-f16 fa-auto")
    other = tmp_path / "other.npz"
    save_baseline(other, sched, res, {**meta, "numerics": meta["numerics"].replace(" reference ", " fast ")})
    refused = subprocess.run([sys.executable, "-m", "dgr", "parity", str(_bundle().root), "--baseline", str(other),
                              "--threads", "1"], capture_output=True, text=True, timeout=600, env=env)
    assert refused.returncode != 0
    assert "was computed with numerics" in refused.stderr and "fast kv-f16" in refused.stderr, refused.stderr
    same = subprocess.run([sys.executable, "-m", "dgr", "parity", str(_bundle().root), "--baseline", str(base),
                           "--threads", "1"], capture_output=True, text=True, timeout=600, env=env)
    assert same.returncode == 0, same.stderr
    assert f"numerics: {meta['numerics']}" in same.stdout


def test_a_certificate_holds_only_for_the_numerics_it_was_measured_on():
    """Python's check (the worker's C++ one: tests/worker/test_worker_cpp_certification.py) refuses a certificate measured
    on other numerics before anything else of it is looked at."""
    from dgr.core.certificate import Certificate, ContractRef, Hardware, Identity, check

    ident = dict(model="m", bundle_id="b" * 64, lane="cpu", upstream_commit="c" * 40, patch_series="s" * 64,
                 engine_blake3="e" * 64, worker_blake3="w" * 64)
    cert = Certificate(identity=Identity(**ident, numerics="cpu/x86-64-v3 reference"),
                       contract=ContractRef(path="none.toml", blake3="x" * 64),
                       hardware=Hardware(cpu_model="c", cores=1, memory_bytes=1, os="Linux"))
    assert check(cert, Identity(**ident, numerics="cpu/x86-64-v3 fast")) == (
        "certificate is for numerics 'cpu/x86-64-v3 reference', this worker computes 'cpu/x86-64-v3 fast'")
    assert "numerics" not in (check(cert, Identity(**ident, numerics="cpu/x86-64-v3 reference")) or "")


def test_bench_numerics_compares_variants_at_the_same_positions(engine_lib, smollm2_gguf):
    """`dgr bench numerics`' comparison: the reference against itself is 0 and never diverges; every row is
    compared (the reference's tokens fed to each variant), and each row names the numerics it ran."""
    from dgr.app.bench.numerics import Variant, compare, table

    rows = compare([("smollm2", smollm2_gguf)], [Variant("ref", engine_lib), Variant("fast", engine_lib, "fast")],
                   tokens=8, prompts=("The three primary colors are", "Once upon a time"), prefill_tokens=64,
                   rounds=1)
    ref, fast = rows
    assert (ref.max_abs_diff, ref.diverged, ref.first_divergence) == (0.0, 0, [None, None])
    assert ref.rows == fast.rows == 2 * 8
    assert ref.numerics.endswith(" reference kv-f16 fa-auto") and fast.numerics.endswith(" fast kv-f16 fa-auto")
    assert ref.prefill_tok_s > 0 and fast.decode_tok_s > 0
    assert "| smollm2 | fast |" in table(rows)


def test_a_route_on_the_invariant_kernels_is_exact_against_the_whole_model_alone_and_beside_others(engine_lib,
                                                                                                  smollm2_gguf):
    """`dgr-worker --kernels invariant` (ggml's batch-invariant dispatch) on every stage: Describe names it, and a
    session's greedy tokens equal the whole model's on the same kernels, with 3 sessions sharing every forward
    (--hold-batch 3: until 3 sessions have opened, a stage runs a forward only when steps of 3 wait; the workers'
    counters say the forwards were shared) and alone after them."""
    import re
    import threading
    import urllib.request

    from dgr.app.demo import whole_model_run
    from dgr.runtime.engine import Engine

    prompts = [PROMPT, "Once upon a time, in a land far away,", "def f(n):"]
    args = [_args(k, "--kernels", "invariant", "--hold-batch", "3", "--metrics-listen", "127.0.0.1:0") for k in range(3)]
    with LocalRoute(args, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as route:
        with RouteClient(route.addresses, prefix_cache=False) as c:
            descs = c.describe()
            assert all(d.identity.numerics.endswith(" invariant kv-f16 fa-auto") for d in descs)
            # and which kernel each weight type takes: SmolLM2's Q4_1 matrices have no invariant fast path
            for d in descs:
                groups = dict(part.split(": ", 1) for part in d.matmul_kernels.split("; "))
                [q4_1] = [k for types, k in groups.items() if "Q4_1" in types.split(", ")]
                assert q4_1 == "vec_dot, each row alone (the reference kernel: no invariant fast path)", d.matmul_kernels
            ids = [c.tokenize(p) for p in prompts]
        got: dict[int, list[int]] = {}

        def one(k: int) -> None:
            with RouteClient(route.addresses, prefix_cache=False) as ck:
                got[k] = ck.run(ids[k], max_new_tokens=MAX_NEW, stop_token_ids=[]).token_ids

        # first the three together (until 3 sessions have opened, each stage waits for steps of 3), then one alone
        threads = [threading.Thread(target=one, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with RouteClient(route.addresses, prefix_cache=False) as c:
            alone = c.run(ids[0], max_new_tokens=MAX_NEW, stop_token_ids=[])
        assert alone.exact
        whole = Engine.open(smollm2_gguf, lib=engine_lib, n_threads=1, n_ctx=512, kernels="invariant")
        try:
            want = [whole_model_run(whole, i, MAX_NEW, chunk_tokens=64).token_ids for i in ids]
        finally:
            whole.close()
        assert alone.token_ids == want[0]
        assert got == dict(enumerate(want))
        for log in route.logs:
            url = re.search(r"metrics on (\S+)", "".join(log)).group(1)
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            assert float(re.search(r'dgr_worker_forwards_total\{sessions="shared"\} (\S+)', text).group(1)) > 0, text


def test_two_kernel_sets_asked_at_once_are_refused(worker_bin):
    out = subprocess.run([str(worker_bin), *_args(0, "--fast-kernels", "--kernels", "invariant")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--fast-kernels and --kernels invariant ask for two kernel sets; give one" in out.stderr
    bad = subprocess.run([str(worker_bin), *_args(0, "--kernels", "quick")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'quick'" in bad.stderr
