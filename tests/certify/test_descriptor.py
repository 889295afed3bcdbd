"""The descriptor a worker advertises (dgr.core.descriptor): the committed JSON schema, `dgr worker describe`
against real worker processes (fake and real engine), and the certificates a worker holds: only those for
exactly its identity under the contract file's current hash (`dgr worker serve --certs DIR`)."""

from __future__ import annotations

import json
import os

import pydantic
import pytest

from dgr.app.local import LocalRoute
from dgr.core.descriptor import SCHEMA_PATH, CompatIdentity, Descriptor, schema_json
from dgr.core.hashing import file_blake3
from dgr.runtime.wire.client import RouteClient

from support.metrics import cert_identity, describe_cli, descriptor, write_certificate
from support.route import PROMPT, SPEC, fake_route
from support.worker import describe

N_NEW = 10


def running_binary_blake3(route: LocalRoute, i: int = 0) -> str:
    """Python's blake3 of the executable worker process `i` of `route` is running (/proc/PID/exe)."""
    return file_blake3(os.readlink(f"/proc/{route.procs[i].pid}/exe"), threads=False)


def _ident(me: Descriptor, **override) -> dict:
    """cert_identity with the worker binary's blake3 too (what a certificate names now)."""
    return cert_identity(me, **{"worker_blake3": me.identity.worker_blake3, **override})


def test_committed_schema_matches_the_model(repo_root):
    path = repo_root / SCHEMA_PATH
    assert path.is_file(), f"{SCHEMA_PATH} is missing: run `.venv/bin/python -m dgr.core.descriptor` and commit it"
    assert path.read_text() == schema_json(), (
        f"{SCHEMA_PATH} is out of date with dgr.core.descriptor.Descriptor: run `.venv/bin/python -m dgr.core.descriptor` "
        "to rewrite it and commit the file (and bump SCHEMA_VERSION if a field changed meaning or went away)")


def test_the_model_is_frozen_and_strict():
    ok = dict(model="m", bundle_id="b", stage_index=0, stage_count=2, layer_begin=0, layer_end=3, n_layer=6,
              upstream_commit="c", patch_series="p", lane="cpu", arch="llama", engine="llama.cpp",
              engine_blake3="e", wire_dtype="f32")
    ident = CompatIdentity(**ok)
    with pytest.raises(pydantic.ValidationError):
        ident.lane = "cuda"                                    # frozen
    for bad in ({"extra": 1}, {"stage_index": "0"}, {"layer_end": 0}, {"layer_end": 7}, {"stage_index": 2},
                {"wire_dtype": "f8"}):
        with pytest.raises(pydantic.ValidationError):
            CompatIdentity(**{**ok, **bad})


def test_describe_prints_the_descriptor_of_each_stage():
    with fake_route(extra=["--session-ttl", "60"]) as r:
        with RouteClient(r.addresses) as c:
            gen = c.run(PROMPT, max_new_tokens=N_NEW, stop_token_ids=[])
        descs = [descriptor(a) for a in r.addresses]          # `dgr worker describe --json`, validated
        raw = [describe(a) for a in r.addresses]               # the Describe RPC carries the same JSON
        binaries = [running_binary_blake3(r, i) for i in range(len(r.addresses))]
        summary = describe_cli(r.addresses[1])
        cli_json = describe_cli(r.addresses[2], "--json").stdout
    schema = json.loads(schema_json())
    assert set(json.loads(cli_json)) == set(schema["properties"]) == set(schema["required"]) | {"schema_version"}
    for i, (d, msg) in enumerate(zip(descs, raw)):
        from_rpc = Descriptor.model_validate_json(msg.descriptor_json)
        assert from_rpc.identity == d.identity and from_rpc.capacity.memory == d.capacity.memory
        idn, pi = d.identity, msg.identity
        assert (idn.model, idn.bundle_id, idn.stage_index, idn.stage_count, idn.layer_begin, idn.layer_end,
                idn.n_layer, idn.lane, idn.arch) == (pi.model, pi.bundle_id, pi.stage_index, pi.stage_count,
                                                      pi.layer_begin, pi.layer_end, pi.n_layer, pi.lane, pi.arch)
        assert (idn.layer_begin, idn.layer_end) == [(0, 2), (2, 4), (4, 6)][i]
        assert d.address == r.addresses[i] and idn.engine == "fake" and len(idn.engine_blake3) == 64
        # the worker binary's own bytes: what the process is running, hashed by Python here
        assert idn.worker_blake3 == binaries[i] and len(idn.worker_blake3) == 64
        assert d.capacity.session_ttl_s == 60.0 and d.capacity.max_sessions == msg.max_sessions
        assert d.capacity.decode.steps == N_NEW - 1 and d.capacity.prefill.steps >= 1
        assert d.capacity.decode.compute_ms_p90 >= d.capacity.decode.compute_ms_median > 0
        assert d.load.open_sessions == 0 and d.health.serving and d.health.restarts == 0
        assert d.health.errors == {} and d.health.uptime_s > 0
        assert not d.security.tls and d.certificates == () and d.metrics == ""
        # seam cost: 16 values a token (embd 16, one stream) in every wire dtype; the sideband after layer 2
        if i < 2:
            assert d.seam.seam_out.bytes_per_token == {"f32": 64, "f16": 32, "bf16": 32}
            assert d.seam.seam_out.layer == idn.layer_end and d.seam.seam_out.wire_dtype == "f32"
            assert d.seam.seam_out.bytes_per_token["f32"] == msg.seam_bytes_per_token
        else:
            assert d.seam.seam_out is None
        assert (d.seam.seam_in is None) == (i == 0)
        if i:
            assert d.seam.seam_in.token_ids == (i == 1)        # SPEC: hash_layers=3, stage 1 begins at 2
    assert len(gen.token_ids) == N_NEW
    assert summary.returncode == 0, summary.stderr
    for text in (f"{r.addresses[1]}: stage 1/3 [2, 4) of 6 layers", "64 B/token out at layer 4",
                 "certificates: none", "plaintext"):
        assert text in summary.stdout, summary.stdout


def test_describe_names_an_address_without_a_worker():
    out = describe_cli("127.0.0.1:1", "--json", "--timeout", "2")
    assert out.returncode != 0 and "127.0.0.1:1 did not answer Describe" in out.stderr
    assert "Traceback" not in out.stderr


def _one_worker(spec_args: list[str], *extra: str, env=None, timeout=120.0) -> LocalRoute:
    return LocalRoute([[*spec_args, *extra]], env=env, timeout=timeout)


def _log(route: LocalRoute) -> str:
    return "".join(route.logs[0])


def test_only_certificates_for_exactly_this_identity_are_advertised(tmp_path):
    stage1 = ["--fake-engine", SPEC, "--stage", "1"]
    with _one_worker(stage1) as r:
        me = descriptor(r.addresses[0])
    contract = tmp_path / "alpha.toml"
    contract.write_text('[speed]\ndecode_ratio_min = 0.5\n')
    certs = tmp_path / "certs"
    certs.mkdir()
    span = [(1, me.identity.layer_begin, me.identity.layer_end)]
    good = write_certificate(certs / "good.json", _ident(me), span, contract)
    for name, override in (("other-bundle", {"bundle_id": "fake-0000000000000000"}), ("other-lane", {"lane": "cuda"}),
                           ("other-engine", {"engine_blake3": "0" * 64}), ("other-model", {"model": "fake:x"}),
                           ("other-worker", {"worker_blake3": "0" * 64}), ("old", {"worker_blake3": ""})):
        write_certificate(certs / f"{name}.json", _ident(me, **override), span, contract)
    write_certificate(certs / "failed.json", _ident(me), span, contract, passed=False)
    write_certificate(certs / "other-stage.json", _ident(me), [(0, 0, 2)], contract)
    (certs / "junk.json").write_text("{not json")
    with _one_worker(stage1, "--certs", str(certs)) as r:
        d = descriptor(r.addresses[0])
        log = _log(r)
        summary = describe_cli(r.addresses[0]).stdout
    assert [c.id for c in d.certificates] == [good]
    held = d.certificates[0]
    assert (held.lane, held.contract, held.issued_at) == ("cpu", "alpha", "2026-12-01T00:00:00Z")
    assert f"certificates: {good}" in summary
    assert "1 certificate(s) advertised" in log
    for name, why in (("other-bundle", "bundle_id"), ("other-lane", "lane"), ("other-engine", "engine_blake3"),
                      ("other-model", "model"), ("failed", "failed gate"), ("other-stage", "not stage 1"),
                      ("other-worker", f"for worker {'0' * 12}, this worker is {me.identity.worker_blake3[:12]}: "
                                       "re-certify"),
                      ("old", "names no worker binary")):
        line = next((x for x in log.splitlines() if f"ignoring certificate {name}.json" in x), "")
        assert why in line, (name, log)
    assert "ignoring junk.json" in log

    # the contract file changes: every certificate made before is invalid, the worker advertises none
    contract.write_text('[speed]\ndecode_ratio_min = 0.1\n')
    with _one_worker(stage1, "--certs", str(certs)) as r:
        d = descriptor(r.addresses[0])
        log = _log(r)
    assert d.certificates == ()
    assert "ignoring certificate good.json" in log and "changed since the certificate was made" in log
    # ... and against another contract file named by --contract, likewise
    contract.write_text('[speed]\ndecode_ratio_min = 0.5\n')            # as certified again
    other = tmp_path / "other.toml"
    other.write_text("[speed]\n")
    with _one_worker(stage1, "--certs", str(certs)) as r:
        assert [c.id for c in descriptor(r.addresses[0]).certificates] == [good]
    with _one_worker(stage1, "--certs", str(certs), "--contract", str(other)) as r:
        assert descriptor(r.addresses[0]).certificates == ()


@pytest.mark.engine
def test_real_engine_descriptor_and_certificate(tmp_path, engine_lib):
    from dgr.app.stages import patch_series

    from support.engine import make_bundle, synth_model

    bundle = make_bundle(synth_model(tmp_path, "llama"), [(0, 3), (3, 6)], tmp_path)
    commit, series = patch_series()
    lib_hash = file_blake3(engine_lib.resolve())
    from dgr.app.workerbin import worker_binary

    worker_hash = file_blake3(worker_binary(), threads=False)   # what `dgr worker serve --bundle` execs
    ident = dict(model=bundle.manifest.recipe.name, bundle_id=bundle.id, lane="cpu", upstream_commit=commit,
                 patch_series=series, engine_blake3=lib_hash, worker_blake3=worker_hash)
    contract = tmp_path / "alpha.toml"
    contract.write_text("[speed]\n")
    certs = tmp_path / "certs"
    certs.mkdir()
    good = write_certificate(certs / "cpu.json", ident, [(0, 0, 3), (1, 3, 6)], contract)
    write_certificate(certs / "other-engine.json", {**ident, "engine_blake3": "1" * 64}, [(0, 0, 3)], contract)
    args = ["--bundle", str(bundle.root), "--stage", "0", "--threads", "1", "--n-ctx", "128", "--max-sessions", "2"]
    with _one_worker(args, "--certs", str(certs), env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as r:
        d = descriptor(r.addresses[0])
        log = _log(r)
        running = running_binary_blake3(r)
    i = d.identity
    assert i.worker_blake3 == running == worker_hash
    assert (i.model, i.bundle_id, i.upstream_commit, i.patch_series, i.engine_blake3, i.lane) == \
        (ident["model"], bundle.id, commit, series, lib_hash, "cpu")
    assert (i.engine, i.arch, i.layer_begin, i.layer_end, i.n_layer) == ("llama.cpp", "llama", 0, 3, 6)
    assert d.capacity.memory.weights_bytes > 0 and d.capacity.memory.kv_bytes > 0
    assert (d.capacity.n_ctx, d.capacity.max_sessions) == (128, 2)
    assert d.seam.seam_out.bytes_per_token == {"f32": 256, "f16": 128, "bf16": 128, "q8_0": 68}
    assert [c.id for c in d.certificates] == [good]
    assert "ignoring certificate other-engine.json" in log and "engine_blake3" in log
