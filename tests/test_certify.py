"""`dgr certify` on a tiny bundle in real worker processes: the certificate names the exact identity, the
host and the contract's hash with every figure; a tampered contract or another identity makes `check`
say why it is not valid; a speed row that fails (given numbers) fails the run; an MTP-on recipe is refused
first. No test judges this machine's speed: that is `dgr certify` run as a command."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

from dgr.app.certify import CertifyError, mtp_off
from dgr.core.certificate import (IDENTITY_FIELDS, Certificate, CertificateError, Identity, check, contract_hash,
                                  load_certificate)
from dgr.core.hashing import file_blake3
from dgr.toolchain import pin
from dgr.toolchain.bundle import load_bundle
from dgr.toolchain.bundle.manifest import manifest_bytes

from support.certify import dgr, tiny_llama_bundle, write_contract

pytestmark = pytest.mark.engine       # ~15 s on 2 shared cores

FIGURES = {"MTP off", "parity: greedy tokens", "parity: max |logit diff|", "stages in worker processes",
           "speed: decode ratio", "speed: prefill ratio (48 tokens)"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("certify")


@pytest.fixture(scope="module")
def bundle(root):
    return tiny_llama_bundle(root)


@pytest.fixture(scope="module")
def contract(root):
    return write_contract(root / "contract.toml")


@pytest.fixture(scope="module")
def certified(root, bundle, contract, engine_lib):
    """`dgr certify` once: (exit code, stdout, certificate path)."""
    out = root / "cert.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = dgr(["certify", "--bundle", str(bundle.root), "--lane", "cpu", "--out", str(out),
                  "--contract", str(contract)])
    return rc, buf.getvalue(), out


def _worker_identity(cert: Certificate) -> Identity:
    """What a worker of the certified bundle compares: its own identity, which holds no contract hash."""
    return cert.identity.model_copy(update={"contract_blake3": ""})


def test_certificate_names_the_exact_identity_the_host_the_contract_and_every_figure(
        certified, bundle, contract, engine_lib):
    rc, out, path = certified
    assert rc == 0, out
    cert = load_certificate(path)
    p = pin.load_pin()
    from dgr.app.workerbin import worker_binary

    # the worker binary the stages ran (`dgr worker serve` execs dgr-worker), hashed here by Python
    assert cert.identity == Identity(model="tiny-llama", bundle_id=bundle.id, lane="cpu", upstream_commit=p.commit,
                                     patch_series=pin.patch_series(p), engine_blake3=file_blake3(engine_lib),
                                     worker_blake3=file_blake3(worker_binary()),
                                     contract_blake3=file_blake3(contract))
    assert cert.contract.blake3 == contract_hash(contract) and cert.contract.name == "test"
    assert Path(cert.contract.path) == contract.resolve()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert f": {cert.hardware.cpu_model}\n" in cpuinfo
    assert cert.hardware.cores == len(os.sched_getaffinity(0))
    assert cert.hardware.memory_bytes > 1 << 28 and cert.hardware.os
    assert [(s.layer_begin, s.layer_end) for s in cert.stages] == [(0, 2), (2, 4), (4, 6)]
    rows = {f.check: f for f in cert.figures}
    assert set(rows) == FIGURES
    assert all(f.passed and f.threshold for f in cert.figures) and cert.passed
    # 2 prompts (one text, one of 40 random ids) x 6 greedy tokens, every logit bit-identical
    assert rows["parity: greedy tokens"].figure == "12/12"
    assert rows["parity: max |logit diff|"].figure == 0.0
    assert rows["parity: max |logit diff|"].threshold == "== 0"
    assert rows["stages in worker processes"].figure == 3
    # speed rows measured for real (finite, positive ratios); the test contract's thresholds are 0, which
    # any measurement meets: no test judges this machine's speed (tests/test_gate_alpha.py judges given numbers)
    for name in ("speed: decode ratio", "speed: prefill ratio (48 tokens)"):
        assert isinstance(rows[name].figure, float) and math.isfinite(rows[name].figure) and rows[name].figure > 0
        assert rows[name].threshold == ">= 0.0" and "tok/s" in rows[name].detail
    # the printed table has every row, and the JSON is the certificate's canonical content
    for name in FIGURES:
        assert f"tiny-llama: {name}" in out
    assert json.loads(path.read_text())["schema"] == "dgr.certificate/v1"
    assert check(cert, _worker_identity(cert)) is None


def test_a_tampered_contract_invalidates_the_certificate(certified, contract):
    cert = load_certificate(certified[2])
    idn = _worker_identity(cert)
    original = contract.read_bytes()
    try:
        contract.write_bytes(original.replace(b"max_new_tokens = 6", b"max_new_tokens = 7"))
        why = check(cert, idn)
        assert why is not None and "changed since the certificate was made" in why and str(contract) in why
        contract.write_bytes(original + b"# a comment is a change too\n")
        assert "recertify" in check(cert, idn)
    finally:
        contract.write_bytes(original)
    assert check(cert, idn) is None
    moved = contract.with_name("gone.toml")
    assert "cannot be read" in check(cert, idn, contract_path=moved)


def test_a_certificate_for_another_identity_is_rejected(certified, root, bundle):
    cert = load_certificate(certified[2])
    idn = _worker_identity(cert)
    # another bundle of the same model (other cuts): a different bundle id
    other = tiny_llama_bundle(root / "other", ranges=((0, 3), (3, 6)))
    assert other.id != bundle.id
    why = check(cert, idn.model_copy(update={"bundle_id": other.id}))
    assert why is not None and "bundle_id" in why and other.id[:16] in why
    for field in IDENTITY_FIELDS:
        why = check(cert, idn.model_copy(update={field: getattr(idn, field) + "x"}))
        assert why is not None and field in why
    why = check(cert, idn.model_copy(update={"contract_blake3": "0" * 64}))
    assert why is not None and "contract" in why
    # another worker binary (another build of dgr-worker): the reason names both
    assert check(cert, idn.model_copy(update={"worker_blake3": "0" * 64})) == (
        f"certificate is for worker {idn.worker_blake3[:12]}, this worker is {'0' * 12}: re-certify")


def test_a_certificate_made_before_it_named_the_worker_binary_is_refused(certified, root):
    cert = load_certificate(certified[2])
    raw = json.loads(certified[2].read_text())
    del raw["identity"]["worker_blake3"]
    old = root / "old-cert.json"
    old.write_text(json.dumps(raw))
    why = check(load_certificate(old), _worker_identity(cert))
    assert why == ("certificate names no worker binary (it was made before certificates recorded worker_blake3): "
                   "re-certify")


def test_a_failing_speed_row_fails_the_run_and_the_certificate_is_not_valid(root, bundle, engine_lib, capsys,
                                                                            monkeypatch):
    """Parity runs for real; the speed numbers are given (decode at a quarter of the whole model's), so the
    decode row fails against the contract's 0.5 whatever this machine's load."""
    from dgr.app.certify import SpeedRuns, runner

    given = SpeedRuns(prefill_tokens=48, threads=1, pipeline_decode=(10.0,), whole_decode=(40.0,),
                      pipeline_prefill=(200.0,), whole_prefill=(100.0,))
    monkeypatch.setattr(runner, "measure_speed", lambda c, client, eng, threads: given)
    contract = write_contract(root / "strict.toml", decode=0.5, prefill=1.0)
    out = root / "strict.json"
    rc = dgr(["certify", "--bundle", str(bundle.root), "--out", str(out), "--contract", str(contract)])
    assert rc == 1
    cert = load_certificate(out)
    rows = {f.check: f for f in cert.figures}
    assert (rows["speed: decode ratio"].figure, rows["speed: decode ratio"].threshold) == (0.25, ">= 0.5")
    assert not rows["speed: decode ratio"].passed
    assert (rows["speed: prefill ratio (48 tokens)"].figure, rows["speed: prefill ratio (48 tokens)"].passed) == \
        (2.0, True)
    assert rows["parity: greedy tokens"].passed and rows["parity: max |logit diff|"].passed and not cert.passed
    assert [f.check for f in cert.figures if not f.passed] == ["speed: decode ratio"]
    assert "failed gate (speed: decode ratio)" in check(cert, _worker_identity(cert))
    out = capsys.readouterr().out
    assert re.search(r"tiny-llama: speed: decode ratio +0\.25 +>= 0\.5 +NO", out), out
    assert "FAILED" in out


def _mtp_recipe(root: Path, src: Path) -> Path:
    r = root / "mtp-on.toml"
    r.write_text(f'name = "mtp-on"\n\n[source]\nuri = "{src}"\nblake3 = "{file_blake3(src)}"\n\n'
                 "[placement]\nstages = [[0, 3], [3, 6]]\n\n[bundle]\ninclude_mtp = true\n")
    return r


def test_an_mtp_on_recipe_is_refused_before_anything_runs(root, bundle, contract, capsys):
    r = _mtp_recipe(root, Path(bundle.manifest.source.uri))
    store, out = root / "mtp-store", root / "mtp.json"
    rc = dgr(["certify", "--recipe", str(r), "--store", str(store), "--out", str(out), "--contract", str(contract)])
    err = capsys.readouterr().err
    assert rc == 2 and "MTP is on (bundle.include_mtp): alpha certifies bundles with MTP off" in err
    assert not store.exists() and not out.exists()      # no store made, no bundle built, nothing certified


def test_a_bundle_whose_recorded_recipe_turns_mtp_on_is_refused(root, bundle, contract, capsys):
    """A bundle folder whose manifest records an MTP-on recipe (written by hand here; `dgr recipe build` makes
    real ones, tests/test_bundles_mtp.py) is refused by `dgr certify --bundle` before the engine or a worker
    starts."""
    import shutil

    m = bundle.manifest
    forged = m.model_copy(update={"recipe": m.recipe.model_copy(
        update={"text": m.recipe.text + "\n[bundle]\ninclude_mtp = true\n"})})
    d = root / "forged"
    shutil.copytree(bundle.root, d)
    (d / "manifest.json").write_bytes(manifest_bytes(forged))
    with pytest.raises(CertifyError, match="(?s)refused before anything runs.*alpha certifies bundles with MTP off"):
        mtp_off(load_bundle(d))
    out = root / "forged.json"
    rc = dgr(["certify", "--bundle", str(d), "--out", str(out), "--contract", str(contract),
              "--engine-lib", str(root / "no-such-engine.so")])   # never reached: refused first
    assert rc == 2 and "MTP" in capsys.readouterr().err and not out.exists()


def test_unreadable_certificates_and_contracts_are_refused(root, capsys):
    bad = root / "bad.json"
    bad.write_text('{"schema": "something else"}')
    with pytest.raises(CertificateError, match="not a dgr.certificate/v1"):
        load_certificate(bad)
    bad.write_text("{")
    with pytest.raises(CertificateError, match="not a readable certificate"):
        load_certificate(bad)
    c = root / "half.toml"
    c.write_text('name = "x"\n[parity]\nprompts = ["a"]\n[speed]\ndecode_ratio_min = 0.5\n')
    rc = dgr(["certify", "--bundle", str(root), "--out", str(root / "x.json"), "--contract", str(c)])
    assert rc == 2 and "speed.prefill_ratio_min" in capsys.readouterr().err
