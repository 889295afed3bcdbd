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

from dgr.app.certify import INCONCLUSIVE, CertifyError, mtp_off
from dgr.app.certify.features import PREFIX_CHECK, RECOVERY_CHECK
from dgr.core.certificate import (IDENTITY_FIELDS, Certificate, CertificateError, Identity, check, contract_hash,
                                  load_certificate)
from dgr.core.hashing import file_blake3
from dgr.toolchain import pin
from dgr.toolchain.bundle import load_bundle
from dgr.toolchain.bundle.manifest import manifest_bytes

from support.certify import dgr, tiny_llama_bundle, write_contract

pytestmark = pytest.mark.engine       # ~15 s on 2 shared cores

FIGURES = {"MTP off", "parity: greedy tokens", "parity: max |logit diff|", "stages in worker processes",
           PREFIX_CHECK, "speed: decode ratio", "speed: prefill ratio (48 tokens)", RECOVERY_CHECK}


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
    from dgr.runtime.engine_abi import load_library

    # the worker binary the stages ran (`dgr worker serve` execs dgr-worker), hashed here by Python
    assert cert.identity == Identity(model="tiny-llama", bundle_id=bundle.id, lane="cpu", upstream_commit=p.commit,
                                     patch_series=pin.patch_series(p), engine_blake3=file_blake3(engine_lib),
                                     worker_blake3=file_blake3(worker_binary()),
                                     contract_blake3=file_blake3(contract),
                                     numerics=load_library(engine_lib).dgr_numerics_build().decode() +
                                     " reference kv-f16 fa-auto")
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
    # 2 prompts (one text, one of 80 random ids) x 6 greedy tokens, every logit bit-identical
    assert rows["parity: greedy tokens"].figure == "12/12"
    assert rows["parity: max |logit diff|"].figure == 0.0
    assert rows["parity: max |logit diff|"].threshold == "== 0"
    assert rows["stages in worker processes"].figure == 3
    assert "a replica of stage 1" in rows["stages in worker processes"].detail
    # the 80-token prompt again after its first 40 were kept: one whole block (32) restored, the cold run's
    # tokens and logits bit for bit
    assert rows[PREFIX_CHECK].figure == "32/80 restored, same tokens and logits"
    assert "32 positions restored" in rows[PREFIX_CHECK].detail and "6 logits rows compared" in rows[PREFIX_CHECK].detail
    # stage 1 of 3 killed itself after 3 of 6 tokens; its replica took over, the same tokens and logits
    assert rows[RECOVERY_CHECK].figure == "same tokens and logits"
    assert rows[RECOVERY_CHECK].detail.startswith("stage 1's first worker exited -9 about to compute position 82 "
                                                  "(after 3 of 6 tokens of a 80-token prompt)")
    assert "2 epoch(s)" in rows[RECOVERY_CHECK].detail
    # speed rows measured for real (finite, positive ratios); the test contract's thresholds are 0, which
    # any measurement meets: no test judges this machine's speed (tests/certify/test_gate_alpha.py judges given numbers)
    for name in ("speed: decode ratio", "speed: prefill ratio (48 tokens)"):
        m = re.fullmatch(r"(\d+\.\d{3}) \(IQR (\d+\.\d{3})-(\d+\.\d{3})\)", rows[name].figure)
        assert m and all(math.isfinite(float(x)) and float(x) > 0 for x in m.groups()), rows[name].figure
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


def _certify(root, bundle, contract, capsys):
    """`dgr certify` of `bundle` against `contract`: (exit code, what it printed, the certificate, its rows by check)."""
    out = contract.with_suffix(".json")
    rc = dgr(["certify", "--bundle", str(bundle.root), "--out", str(out), "--contract", str(contract)])
    cert = load_certificate(out)
    return rc, capsys.readouterr().out, cert, {f.check: f for f in cert.figures}


def test_a_failing_speed_row_fails_the_run_and_the_certificate_is_not_valid(root, bundle, engine_lib, capsys,
                                                                            monkeypatch):
    """Parity runs for real; the speed numbers are given (decode at a quarter of the whole model's), so the
    decode row fails against the contract's 0.5 whatever this machine's load."""
    from dgr.app.certify import SpeedRuns, runner

    given = SpeedRuns(prefill_tokens=48, threads=1, pipeline_decode=(10.0,), whole_decode=(40.0,),
                      pipeline_prefill=(200.0,), whole_prefill=(100.0,))
    monkeypatch.setattr(runner, "measure_speed", lambda c, client, eng, threads: given)
    rc, out, cert, rows = _certify(root, bundle, write_contract(root / "strict.toml", decode=0.5, prefill=1.0), capsys)
    assert rc == 1
    assert (rows["speed: decode ratio"].figure, rows["speed: decode ratio"].threshold) == \
        ("0.250 (IQR 0.250-0.250)", ">= 0.5")
    assert not rows["speed: decode ratio"].passed
    assert (rows["speed: prefill ratio (48 tokens)"].figure, rows["speed: prefill ratio (48 tokens)"].passed) == \
        ("2.000 (IQR 2.000-2.000)", True)
    assert rows["parity: greedy tokens"].passed and rows["parity: max |logit diff|"].passed and not cert.passed
    assert [f.check for f in cert.figures if not f.passed] == ["speed: decode ratio"]
    assert "failed gate (speed: decode ratio)" in check(cert, _worker_identity(cert))
    assert re.search(r"tiny-llama: speed: decode ratio +0\.250 \(IQR 0\.250-0\.250\) +>= 0\.5 +NO", out), out
    assert "FAILED" in out


def test_an_inconclusive_speed_row_exits_3_and_the_certificate_is_not_valid(root, bundle, engine_lib, capsys,
                                                                            monkeypatch):
    """The speed numbers are given (three rounds whose prefill ratios straddle the contract's 1.0: a busy
    machine), the rest runs for real: no row fails, `dgr certify` exits 3 and says why, and the certificate
    it writes records the spread and is no pass."""
    from dgr.app.certify import SpeedRuns, runner

    given = SpeedRuns(prefill_tokens=48, threads=1, pipeline_decode=(30.0, 31.0, 29.0), whole_decode=(40.0,) * 3,
                      pipeline_prefill=(95.0, 99.3, 104.0), whole_prefill=(100.0,) * 3)
    monkeypatch.setattr(runner, "measure_speed", lambda c, client, eng, threads: given)
    rc, printed, cert, rows = _certify(root, bundle, write_contract(root / "busy.toml", decode=0.5, prefill=1.0),
                                       capsys)
    assert rc == 3, printed
    busy = rows["speed: prefill ratio (48 tokens)"]
    assert (busy.figure, busy.threshold, busy.passed) == ("0.993 (IQR 0.972-1.016)", ">= 1.0", False)
    assert busy.detail.startswith(f"{INCONCLUSIVE}: the interquartile range of the per-round ratios covers the "
                                  "threshold 1.0, so this row is not a pass")
    assert "min 0.950, max 1.040" in busy.detail
    assert [f.check for f in cert.figures if not f.passed] == ["speed: prefill ratio (48 tokens)"]
    assert not cert.passed and "failed gate (speed: prefill ratio (48 tokens))" in check(cert, _worker_identity(cert))
    assert re.search(r"tiny-llama: speed: prefill ratio \(48 tokens\) +0\.993 \(IQR 0\.972-1\.016\) +>= 1\.0 +"
                     r"inconclusive\n", printed), printed
    assert f"7/8 rows pass, 1 inconclusive: INCONCLUSIVE ({INCONCLUSIVE}: not a pass; rerun" in printed
    assert f"(not valid: {INCONCLUSIVE}, a speed row could not decide; rerun on a quieter machine;" in printed


def test_a_threshold_no_measurement_can_meet_fails_for_real(root, bundle, engine_lib, capsys):
    """Measured for real, against a prefill threshold of 1000 (no pipeline is 1000 times the whole model): the
    verdict is certain on any machine, loaded or not, and the exit code is 1."""
    rc, printed, _, rows = _certify(root, bundle, write_contract(root / "impossible.toml", decode=0.0, prefill=1000.0),
                                    capsys)
    assert rc == 1, printed
    assert [k for k, f in rows.items() if not f.passed] == ["speed: prefill ratio (48 tokens)"]
    assert rows["speed: prefill ratio (48 tokens)"].threshold == ">= 1000.0"
    assert not rows["speed: prefill ratio (48 tokens)"].detail.startswith(INCONCLUSIVE)
    assert "7/8 rows pass: FAILED" in printed


def test_a_replica_that_cannot_take_over_fails_recovery_and_a_stage_without_a_cache_refuses(root, bundle, engine_lib,
                                                                                          capsys, monkeypatch):
    """The route made wrong on purpose: the replica that should take over after the kill -9 takes its boundary
    in bf16 (stage 0 sends f32: it refuses the session, and the client gives up), and stage 0 keeps no prefixes
    (--prefix-cache-mib 0). The recovery row fails and says why, the prefix-cache row says refused and is not a
    failure: exit 1, one failed row, the certificate written."""
    from dgr.app.certify.features import Fault

    planned = Fault.extra

    def extra(self, stage, replica):
        more = {(0, 0): ["--prefix-cache-mib", "0"], (self.stage, 1): ["--wire-dtype", "bf16"]}
        return planned(self, stage, replica) + more.get((stage, replica), [])

    monkeypatch.setattr(Fault, "extra", extra)
    rc, printed, cert, rows = _certify(root, bundle, write_contract(root / "broken.toml"), capsys)
    assert rc == 1, printed
    assert [k for k, f in rows.items() if not f.passed] == [RECOVERY_CHECK]
    assert rows[RECOVERY_CHECK].figure == "gave up"
    assert rows[RECOVERY_CHECK].detail.startswith("stage 1's first worker exited -9 about to compute position 82")
    assert "the client gave up: " in rows[RECOVERY_CHECK].detail and "bf16" in rows[RECOVERY_CHECK].detail
    refused = rows[PREFIX_CHECK]
    assert refused.passed and refused.figure == "refused: --prefix-cache-mib 0", refused
    assert refused.detail.startswith("stage(s) [0] keep no prefixes")
    assert "failed gate (recovery: kill -9 of the middle stage mid-generation, replica)" in check(
        cert, _worker_identity(cert))


def _gen(tokens, rows, cached=0, epochs=1, failures=()):
    import numpy as np

    from dgr.runtime.wire.stats import Failure, Generation

    g = Generation(prompt_ids=[1] * 10, token_ids=list(tokens), cached_tokens=cached, epochs=epochs,
                   failures=[Failure(stage=s, address="a", hop="h", code="HOP_UNREACHABLE", why="", at=0.0, tokens=2)
                             for s in failures])
    g.logits = {9 + k: np.asarray(r, np.float32) for k, r in enumerate(rows)}
    return g


def test_the_feature_rows_decide_from_the_generations_they_are_given():
    """The prefix-cache and recovery rows' decisions, fed generations: equal bit for bit passes; one token, one
    logit's last bit, nothing restored, no kill or no second epoch fails, and says which."""
    import numpy as np

    from dgr.app.certify.features import Fault, differs, prefix_figure, recovery_figure

    rows = [[0.5, -1.0, 2.0], [0.25, 3.0, -2.0], [1.0, 1.0, 0.0]]
    cold = _gen([1, 1, 0], rows)
    flipped = [list(r) for r in rows]
    flipped[1][2] = float(np.nextafter(np.float32(-2.0), np.float32(0.0)))   # one ulp: the same argmax
    assert differs(_gen([1, 1, 0], rows), cold) == ""
    assert differs(_gen([1, 2, 0], rows), cold) == "token 1 differs (3 tokens, 3 undisturbed)"
    assert differs(_gen([1, 1, 0], flipped), cold) == "the logits row at position 10 differs (max |diff| 1.19e-07)"
    assert differs(_gen([1, 1, 0], rows[:2]), cold).startswith("logits rows at positions [9, 10], undisturbed")

    ok = prefix_figure(_gen([1, 1, 0], rows, cached=32), cold, 80, 40)
    assert (ok.figure, ok.passed) == ("32/80 restored, same tokens and logits", True)
    bad = prefix_figure(_gen([1, 1, 0], flipped, cached=32), cold, 80, 40)
    assert (bad.figure, bad.passed) == ("32/80 restored, DIFFERS", False)
    assert bad.detail.endswith("; the logits row at position 10 differs (max |diff| 1.19e-07)")
    cold_again = prefix_figure(_gen([1, 1, 0], rows, cached=0), cold, 40, 20)
    assert not cold_again.passed and "nothing restored (a prompt shorter than 66 tokens" in cold_again.detail

    fault = Fault.plan(3, 10, 6)
    assert (fault.stage, fault.position, fault.tokens) == (1, 12, 3) and fault.replicas(3) == [1, 2, 1]
    assert fault.extra(1, 0) == ["--test-die-at", "certify-recovery:1:12"] and fault.extra(1, 1) == []
    assert Fault.plan(12, 150, 16).stage == 6 and Fault.plan(2, 150, 1).position == 149
    recovered = _gen([1, 1, 0], rows, epochs=2, failures=[1])
    good = recovery_figure(recovered, cold, -9, fault, 10, 6)
    assert (good.figure, good.passed) == ("same tokens and logits", True)
    assert recovery_figure(_gen([1, 1, 0], flipped, epochs=2, failures=[1]), cold, -9, fault, 10, 6).figure == "DIFFERS"
    gave_up = recovery_figure(None, cold, -9, fault, 10, 6, "gave up after 6 failed attempt(s)")
    assert (gave_up.figure, gave_up.passed) == ("gave up", False) and gave_up.detail.endswith(
        "the client gave up: gave up after 6 failed attempt(s)")
    never = recovery_figure(_gen([1, 1, 0], rows), cold, None, fault, 10, 6)
    assert (never.figure, never.passed) == ("same tokens and logits, no kill, not recovered", False)
    elsewhere = recovery_figure(_gen([1, 1, 0], rows, epochs=2, failures=[2]), cold, -9, fault, 10, 6)
    assert (elsewhere.figure, elsewhere.passed) == ("same tokens and logits, not recovered", False)


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
    real ones, tests/bundles/test_bundles_mtp.py) is refused by `dgr certify --bundle` before the engine or a worker
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
