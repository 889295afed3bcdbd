"""dgr-worker's --certs/--contract (issue 21 phase 5, docs/worker.md) against the Python worker's: the same
directory of real certificate files (a matching one, one whose contract changed, one with a failed figure,
one for another bundle, one for another stage, one that is not a certificate) gives the same certificates in
the descriptor, and the same reasons logged for each one ignored, from real worker processes."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from dgr.certificate import Certificate, ContractRef, Figure, Hardware, Identity, StageRange, contract_hash
from support.certify import write_contract
from test_worker_cpp import cpp, py, tiny, worker_bin  # noqa: F401  (fixtures)

LOGGED = re.compile(r"(ignoring .*|advertising certificate .*)$")


def _identity(tiny, worker_bin) -> dict:
    p = cpp(worker_bin, tiny, 0)
    try:
        from dgr.wire.gen import stage_pb2 as pb
        return json.loads(p.stub.Describe(pb.DescribeRequest()).descriptor_json)["identity"]
    finally:
        p.stop()


def _cert(idn: dict, contract, blake3: str, *, passed=True, stage=(0, 0, 2), **change) -> Certificate:
    ident = {k: idn[k] for k in ("model", "bundle_id", "lane", "upstream_commit", "patch_series", "engine_blake3")}
    return Certificate(
        identity=Identity(**{**ident, **change}, contract_blake3=blake3),
        contract=ContractRef(path=str(contract), blake3=blake3, name="test"),
        hardware=Hardware(cpu_model="Test CPU \u00e9", cores=2, memory_bytes=1 << 30, os="Linux", gpu="Test GPU"),
        stages=(StageRange(stage=stage[0], layer_begin=stage[1], layer_end=stage[2]),),
        figures=(Figure(check="parity greedy tokens", figure=0, threshold="== 0", passed=True),
                 Figure(check="decode ratio", figure=0.8125, threshold=">= 0.5", passed=passed)),
        passed=passed, created_at="2026-01-02T03:04:05Z", dgr_version="0.test")


@pytest.fixture(scope="module")
def certs(tmp_path_factory, tiny, worker_bin):
    d = tmp_path_factory.mktemp("cpp-certs")
    idn = _identity(tiny, worker_bin)
    contract = write_contract(d / "contract.toml")
    now = contract_hash(contract)
    old = write_contract(d / "old.toml", decode=0.5)
    then = contract_hash(old)
    old.write_text(old.read_text() + "# edited after certifying\n")
    out = d / "certs"
    _cert(idn, contract, now).save(out / "a-good.json")
    _cert(idn, old, then).save(out / "b-stale.json")
    _cert(idn, contract, now, passed=False).save(out / "c-failed.json")
    _cert(idn, contract, now, bundle_id="f" * 64).save(out / "d-foreign.json")
    _cert(idn, contract, now, stage=(1, 2, 4)).save(out / "e-other-stage.json")
    (out / "f-not-one.json").write_text('{"schema": "something/v0"}\n')
    return out, contract


def _served(proc) -> tuple[list, list[str]]:
    from dgr.wire.gen import stage_pb2 as pb
    try:
        d = json.loads(proc.stub.Describe(pb.DescribeRequest()).descriptor_json)
    finally:
        log = proc.stop()
    return d["certificates"], [m.group(1) for line in log.splitlines() if (m := LOGGED.search(line))]


@pytest.mark.parametrize("with_contract", [False, True])
def test_the_same_certificates_are_advertised_and_the_same_reasons_logged(certs, tiny, worker_bin, with_contract):
    out, contract = certs
    flags = ["--certs", str(out), *(["--contract", str(contract)] if with_contract else [])]
    c_certs, c_log = _served(cpp(worker_bin, tiny, 0, *flags))
    p_certs, p_log = _served(py(tiny, 0, *flags))
    assert c_certs == p_certs and len(c_certs) == 1, (c_certs, p_certs)
    assert c_certs[0]["summary"] == "2/2 checks passed on Test CPU \u00e9 + Test GPU"
    assert c_log == p_log, "\n".join(["dgr-worker:", *c_log, "dgr worker serve:", *p_log])
    assert len(c_log) == 6 and c_log[0].startswith("advertising certificate a-good.json")
    why = {line.split()[2 if line.startswith("ignoring certificate") else 1]: line for line in c_log[1:]}
    stale = "measured against contract" if with_contract else "changed since the certificate was made"
    assert stale in why["b-stale.json"] and "failed gate (decode ratio)" in why["c-failed.json"]
    assert "bundle_id" in why["d-foreign.json"] and "not stage 0 [0, 2)" in why["e-other-stage.json"]
    assert "not a dgr.certificate/v1 certificate" in why["f-not-one.json:"]


def test_a_missing_certs_directory_or_contract_is_refused_as_by_the_python_worker(certs, tiny, worker_bin, tmp_path):
    out, contract = certs
    for flags, why in ((["--certs", str(tmp_path / "none")], "no such directory"),
                       (["--certs", str(out), "--contract", str(tmp_path / "gone.toml")], "no such file")):
        r = subprocess.run([str(worker_bin), "--bundle", str(tiny), "--stage", "0", "--listen", "127.0.0.1:0", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and why in r.stderr, r.stderr
