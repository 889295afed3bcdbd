"""dgr-worker's --certs/--contract (issue 21 phase 5, docs/worker.md), from real worker processes: a directory
of real certificate files (a matching one, one whose contract changed, one with a failed figure, one for
another bundle, one for another stage, one that is not a certificate, one for another worker binary, one made
before certificates named the worker binary) gives exactly the matching certificate in the descriptor (as
dgr.core.descriptor.HeldCertificate from the certificate file: its digest, contract, lane, date, summary), and each
one ignored is logged with its reason, every line written out here (dgr.core.certificate.check's words). A
certificate names the worker binary (worker_blake3: dgr-worker's executable)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from dgr.core.certificate import (Certificate, ContractRef, Figure, Hardware, Identity, StageRange, contract_hash,
                                  load_certificate)
from dgr.core.descriptor import HeldCertificate
from dgr.core.hashing import file_blake3

from support.certify import write_contract
from support.worker import cpp

LOGGED = re.compile(r"(ignoring .*|advertising certificate .*)$")


def _identity(tiny_pair, worker_bin) -> dict:
    p = cpp(worker_bin, tiny_pair, 0)
    try:
        from dgr.runtime.wire.gen import stage_pb2 as pb
        return json.loads(p.stub.Describe(pb.DescribeRequest()).descriptor_json)["identity"]
    finally:
        p.stop()


def _cert(idn: dict, contract, blake3: str, *, passed=True, stage=(0, 0, 2), **change) -> Certificate:
    ident = {k: idn[k] for k in ("model", "bundle_id", "lane", "upstream_commit", "patch_series", "engine_blake3",
                                 "worker_blake3", "numerics")}
    return Certificate(
        identity=Identity(**{**ident, **change}, contract_blake3=blake3),
        contract=ContractRef(path=str(contract), blake3=blake3, name="test"),
        hardware=Hardware(cpu_model="Test CPU \u00e9", cores=2, memory_bytes=1 << 30, os="Linux", gpu="Test GPU"),
        stages=(StageRange(stage=stage[0], layer_begin=stage[1], layer_end=stage[2]),),
        figures=(Figure(check="parity greedy tokens", figure=0, threshold="== 0", passed=True),
                 Figure(check="decode ratio", figure=0.8125, threshold=">= 0.5", passed=passed)),
        passed=passed, created_at="2026-01-02T03:04:05Z", dgr_version="0.test")


OTHER_WORKER = "0123456789ab" * 5 + "cdef"       # another build of dgr-worker
ANOTHER_WORKER = "fedcba987654" * 5 + "3210"     # and another
OTHER_NUMERICS = "cpu/native-x86-64-v3+avx512 gcc-12.2.0 llama.cpp-0123456789ab+26.0123456789ab fast kv-f16 fa-auto"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory, tiny_pair, worker_bin):
    """({"cpp": DIR, "other": DIR}, contract, {kind: (its worker_blake3, a-good's digest, DIR)}): the same
    certificates, written for this dgr-worker's binary and for another build's."""
    d = tmp_path_factory.mktemp("cpp-certification")
    idn = _identity(tiny_pair, worker_bin)
    # the descriptor names the binary that is running: Python's blake3 of the file says the same
    assert idn["worker_blake3"] == file_blake3(worker_bin, threads=False)
    contract = write_contract(d / "contract.toml")
    now = contract_hash(contract)
    old = write_contract(d / "old.toml", decode=0.5)
    then = contract_hash(old)
    old.write_text(old.read_text() + "# edited after certifying\n")
    dirs, mine = {}, {}
    for kind, worker in (("cpp", idn["worker_blake3"]), ("other", ANOTHER_WORKER)):
        me = {**idn, "worker_blake3": worker}
        out = dirs[kind] = d / kind
        good = _cert(me, contract, now)
        good.save(out / "a-good.json")
        _cert(me, old, then).save(out / "b-stale.json")
        _cert(me, contract, now, passed=False).save(out / "c-failed.json")
        _cert(me, contract, now, bundle_id="f" * 64).save(out / "d-foreign.json")
        _cert(me, contract, now, stage=(1, 2, 4)).save(out / "e-other-stage.json")
        (out / "f-not-one.json").write_text('{"schema": "something/v0"}\n')
        _cert(me, contract, now, worker_blake3=OTHER_WORKER).save(out / "g-other-worker.json")
        # made before certificates named the worker binary: no worker_blake3 at all
        raw = json.loads(good.canonical_json())
        del raw["identity"]["worker_blake3"]
        (out / "h-old.json").write_text(json.dumps(raw, indent=2) + "\n")
        _cert(me, contract, now, numerics=OTHER_NUMERICS).save(out / "i-other-numerics.json")
        mine[kind] = worker, good.digest, str(out)
    return dirs, contract, mine


def _served(proc) -> tuple[list, list[str]]:
    from dgr.runtime.wire.gen import stage_pb2 as pb
    try:
        d = json.loads(proc.stub.Describe(pb.DescribeRequest()).descriptor_json)
    finally:
        log = proc.stop()
    return d["certificates"], [m.group(1) for line in log.splitlines() if (m := LOGGED.search(line))]


def _short(h: str) -> str:
    return h[:16]                                  # how check() names a hash (dgr.core.certificate._short)


@pytest.mark.parametrize("with_contract", [False, True])
def test_the_matching_certificate_is_advertised_and_each_other_one_logged_with_its_reason(certificates, tiny_pair,
                                                                                        worker_bin, with_contract):
    dirs, contract, mine = certificates
    out = dirs["cpp"]
    flags = ["--certs", str(out), *(["--contract", str(contract)] if with_contract else [])]
    held, log = _served(cpp(worker_bin, tiny_pair, 0, *flags))
    # the references: the certificate files themselves and the contract files as they are now
    good, stale = load_certificate(out / "a-good.json"), load_certificate(out / "b-stale.json")
    assert good.digest == mine["cpp"][1]
    lane, bid, worker = good.identity.lane, good.identity.bundle_id, mine["cpp"][0]
    now, then = contract_hash(contract), stale.contract.blake3
    assert held == [json.loads(HeldCertificate(
        id=good.digest, contract="test", contract_blake3=now, lane=lane, issued_at="2026-01-02T03:04:05Z",
        summary="2/2 checks passed on Test CPU \u00e9 + Test GPU").model_dump_json())]
    if with_contract:     # the worker's contract is the one to match
        why_stale = f"certificate was measured against contract {_short(then)}, this worker expects {_short(now)}"
    else:                 # the contract file each certificate names, as it is now
        why_stale = (f"contract file {stale.contract.path} changed since the certificate was made (blake3 "
                     f"{_short(contract_hash(stale.contract.path))}, certified against {_short(then)}): recertify")
    assert log == [
        f"advertising certificate a-good.json ({good.digest[:16]}, lane {lane})",
        f"ignoring certificate b-stale.json (lane {lane}): {why_stale}",
        f"ignoring certificate c-failed.json (lane {lane}): certificate records a failed gate (decode ratio)",
        f"ignoring certificate d-foreign.json (lane {lane}): certificate is for bundle_id {'f' * 16}, this worker "
        f"has {_short(bid)}",
        f"ignoring certificate e-other-stage.json (lane {lane}): certificate covers stages [(1, 2, 4)], not stage 0 "
        "[0, 2)",
        f"ignoring f-not-one.json: {out / 'f-not-one.json'}: not a dgr.certificate/v1 certificate (schema "
        "'something/v0')",
        # another worker binary: not advertised, the reason names both binaries
        f"ignoring certificate g-other-worker.json (lane {lane}): certificate is for worker {OTHER_WORKER[:12]}, "
        f"this worker is {worker[:12]}: re-certify",
        # a certificate made before certificates named the worker binary: refused, not crashed on
        f"ignoring certificate h-old.json (lane {lane}): certificate names no worker binary (it was made before "
        "certificates recorded worker_blake3): re-certify",
        # measured on other numerics (docs/numerics.md): not this worker's figures
        f"ignoring certificate i-other-numerics.json (lane {lane}): certificate is for numerics '{OTHER_NUMERICS}', "
        f"this worker computes '{good.identity.numerics}'",
    ], "\n".join(log)
    assert good.identity.numerics, "the worker's descriptor names its numerics"


def test_a_certificate_for_another_worker_binary_is_not_advertised(certificates, tiny_pair, worker_bin):
    """dgr-worker given the certificates written for another build's binary: none is advertised, and each one
    whose identity and stage match says the worker binary differs."""
    dirs, contract, mine = certificates
    held, log = _served(cpp(worker_bin, tiny_pair, 0, "--certs", str(dirs["other"])))
    assert held == []
    line = next(x for x in log if "a-good.json" in x)
    assert line == (f"ignoring certificate a-good.json (lane cpu): certificate is for worker {mine['other'][0][:12]}, "
                    f"this worker is {mine['cpp'][0][:12]}: re-certify")


def test_a_missing_certs_directory_or_contract_is_refused_in_one_line(certificates, tiny_pair, worker_bin, tmp_path):
    dirs, contract, _ = certificates
    out = dirs["cpp"]
    for flags, why in ((["--certs", str(tmp_path / "none")],
                        f"--certs {tmp_path / 'none'}: no such directory (put the certificates `dgr certify` wrote "
                        "there)"),
                       (["--certs", str(out), "--contract", str(tmp_path / "gone.toml")],
                        f"--contract {tmp_path / 'gone.toml'}: no such file")):
        cmd = [str(worker_bin), "--bundle", str(tiny_pair), "--stage", "0", "--listen", "127.0.0.1:0", *flags]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.splitlines() == [f"dgr-worker: error: {why}"], r.stderr
