"""`dgr gate alpha` over the committed contract: SmolLM2 in 3 worker processes (parity and the speed rows),
tiny DeepSeek V4 in 2, 3 and 4 stages, the 12-stage scenario and the MTP refusal, one table; a gate whose
row fails exits 1 and says which.

No test here judges this machine's speed: speed is judged by `dgr bench`, `dgr certify` and `dgr gate alpha`
run as commands. The speed rows' judgement (measured numbers + contract -> rows) is a pure function tested
with given numbers, passing and failing; the end-to-end run asserts that its speed rows were measured
(finite, positive) and judged against the contract's thresholds, not that this machine was fast enough.
"""

from __future__ import annotations

import math
import re

import pytest

from dgr.app.certify import (DEFAULT_CONTRACT, INCONCLUSIVE, GateResult, Judged, Row, SpeedRuns, exit_code,
                              is_inconclusive, judge, load_contract, overall, speed_figures)
from dgr.app.certify.features import PREFIX_CHECK, RECOVERY_CHECK
from dgr.core.certificate import Figure, check, load_certificate
from dgr.runtime.engine_abi import build_numerics

from support.certify import dgr, table_rows as _rows

TARGETS = ["smollm2-135m-3stage", "deepseek4-tiny-2stage", "deepseek4-tiny-3stage", "deepseek4-tiny-4stage",
           "deepseek4-v4shape-12stage"]
SPEED_ROWS = ("speed: decode ratio", "speed: prefill ratio (256 tokens)")


def _runs(decode, prefill, tokens: int = 256) -> SpeedRuns:
    """Given measurements from per-round ratios: the whole model's tok/s varies from round to round (the
    machine's load), the pipeline's is that round's ratio times it."""
    whole = (60.0, 45.0, 62.0, 50.0, 58.0, 40.0, 61.0, 55.0, 59.0)

    def side(ratios):
        w = whole[:len(ratios)]
        return tuple(r * x for r, x in zip(ratios, w)), w

    (pd, wd), (pp, wp) = side(decode), side(prefill)
    return SpeedRuns(prefill_tokens=tokens, threads=2, pipeline_decode=pd, whole_decode=wd,
                     pipeline_prefill=pp, whole_prefill=wp)


def _judged(figs: list[Figure]) -> list[tuple]:
    return [(f.check, f.figure, f.threshold, f.passed) for f in figs]


# The per-round ratios of three runs of one good bundle: a quiet machine, a busy one (the user's 0.993), and
# one where the pipeline really is slower (a route that serialized its chunks).
QUIET = (1.08, 1.12, 1.09, 1.15, 1.11, 1.10, 1.13, 1.07, 1.12)
BUSY = (0.91, 1.04, 0.993, 1.21, 0.95, 1.10, 0.97, 1.02, 0.98)
SLOW = (0.90, 0.93, 0.95, 0.92, 0.97, 0.96, 0.94, 0.91, 1.01)


# --- the speed rows' judgement, with given numbers (no engine, no clock) ----------------------------------

def test_judge_takes_the_median_and_interquartile_range_of_the_per_round_ratios():
    quiet, busy, slow = judge(*_pair(QUIET), 1.0), judge(*_pair(BUSY), 1.0), judge(*_pair(SLOW), 1.0)
    assert quiet.ratios == pytest.approx(QUIET) and quiet.median == pytest.approx(1.11)
    assert (quiet.q1, quiet.q3, quiet.verdict) == (pytest.approx(1.09), pytest.approx(1.12), "pass")
    # the busy machine: its median is below the threshold, but the middle half of its rounds straddles it
    assert busy.median == pytest.approx(0.993) and busy.q1 < 1.0 <= busy.q3
    assert (busy.q1, busy.q3, busy.verdict) == (pytest.approx(0.97), pytest.approx(1.04), "inconclusive")
    assert (slow.median, slow.q3, slow.verdict) == (pytest.approx(0.94), pytest.approx(0.96), "fail")
    # the verdict follows the quartiles, not the median: a lower quartile at the threshold passes, an upper
    # quartile a hair under it fails, a median under it with an upper quartile above is inconclusive
    assert judge((1.0, 1.0, 1.2), (1.0, 1.0, 1.0), 1.0).verdict == "pass"
    assert judge((0.9, 0.99999, 0.99999), (1.0, 1.0, 1.0), 1.0).verdict == "fail"
    assert judge((0.9, 0.95, 1.2), (1.0, 1.0, 1.0), 1.0).verdict == "inconclusive"
    # each round is its own ratio: the pipeline side by side with the whole model in the same round
    assert judge((60.0, 120.0), (50.0, 100.0), 1.0).ratios == (1.2, 1.2)
    # one round decides alone (no spread); no rounds, or a side that measured nothing, is a failure
    one = judge((0.993,), (1.0,), 1.0)
    assert (one.median, one.q1, one.q3, one.verdict) == (0.993, 0.993, 0.993, "fail")
    assert judge((), (), 0.0) == Judged((), 0.0, 0.0, 0.0, "fail")
    assert judge((10.0, 10.0), (0.0, 10.0), 0.5).ratios == (0.0, 1.0)


def _pair(ratios, whole: float = 100.0):
    return tuple(r * whole for r in ratios), (whole,) * len(ratios)


def test_speed_rows_judge_the_per_round_ratios_against_the_contracts_thresholds():
    alpha = load_contract().contract.speed                  # the committed thresholds: 0.5 decode, 1.0 prefill
    assert (alpha.decode_ratio_min, alpha.prefill_ratio_min, alpha.repeats) == (0.5, 1.0, 9)
    decode_ok = (0.72, 0.75, 0.70, 0.78, 0.74, 0.73, 0.76, 0.71, 0.77)
    passing = speed_figures(_runs(decode_ok, QUIET), alpha)
    assert _judged(passing) == [("speed: decode ratio", "0.740 (IQR 0.720-0.760)", ">= 0.5", True),
                                ("speed: prefill ratio (256 tokens)", "1.110 (IQR 1.090-1.120)", ">= 1.0", True)]
    assert passing[1].detail == (
        "per-round ratios over 9 round(s), pipeline and whole model side by side, alternating which goes first: "
        "median 1.110, interquartile 1.090-1.120, min 1.070, max 1.150; median tok/s: pipeline 64.4, whole model "
        "58.0 (2 thread(s) per process)")
    assert "(32 tokens, 2 thread(s) per process)" in passing[0].detail
    assert overall(passing) == "passed" and exit_code(passing) == 0
    # the busy machine: the prefill row is inconclusive, not a pass, and says so first
    busy = speed_figures(_runs(decode_ok, BUSY), alpha)
    assert _judged(busy)[1] == ("speed: prefill ratio (256 tokens)", "0.993 (IQR 0.970-1.040)", ">= 1.0", False)
    assert busy[1].detail.startswith(f"{INCONCLUSIVE}: the interquartile range of the per-round ratios covers the "
                                     "threshold 1.0, so this row is not a pass (rerun on a quieter machine); ")
    assert is_inconclusive(busy[1]) and not is_inconclusive(busy[0])
    assert overall(busy) == "inconclusive" and exit_code(busy) == 3
    # a slow pipeline fails outright; a failure outranks an inconclusive row
    slow = speed_figures(_runs(decode_ok, SLOW), alpha)
    assert [(f.passed, is_inconclusive(f)) for f in slow] == [(True, False), (False, False)]
    assert exit_code(slow) == 1
    below = speed_figures(_runs((0.40, 0.45, 0.42, 0.41, 0.44, 0.43, 0.46, 0.39, 0.47), BUSY), alpha)
    assert [f.passed for f in below] == [False, False] and exit_code(below) == 1
    # the thresholds are the contract's: the same numbers against another contract
    lenient = alpha.model_copy(update={"prefill_ratio_min": 0.9})
    assert [f.passed for f in speed_figures(_runs(decode_ok, BUSY), lenient)] == [True, True]


def test_a_side_that_measured_nothing_gives_ratio_0_and_fails():
    alpha = load_contract().contract.speed
    none = SpeedRuns(prefill_tokens=24, threads=1, pipeline_decode=(10.0,), whole_decode=(0.0,),
                     pipeline_prefill=(), whole_prefill=())
    assert [(f.check, f.figure, f.passed) for f in speed_figures(none, alpha)] == [
        ("speed: decode ratio", "0.000 (IQR 0.000-0.000)", False),
        ("speed: prefill ratio (24 tokens)", "0.000 (IQR 0.000-0.000)", False)]


def test_measure_speed_runs_both_sides_in_every_round_alternating_which_goes_first(monkeypatch):
    """A fake route and engine record the order: one untimed round, then `repeats` rounds, the pipeline first
    in the even ones; every round gives one entry per side."""
    from types import SimpleNamespace

    from dgr.app.certify import measure_speed, runner

    order, speed = [], iter(range(1, 1000))

    class Client:
        chunk_tokens = 16

        def run(self, ids, max_new_tokens, stop_token_ids):
            order.append("P")
            v = float(next(speed))
            return SimpleNamespace(decode_tokens_per_s=v, prefill_tokens_per_s=v)

    def whole(eng, ids, max_new, chunk_tokens):
        assert chunk_tokens == 16
        order.append("W")
        v = float(next(speed))
        return SimpleNamespace(decode_tokens_per_s=v, prefill_tokens_per_s=v)

    monkeypatch.setattr(runner, "whole_model_run", whole)               # the names runner calls them by
    monkeypatch.setattr(runner, "long_prompt", lambda tokenize, n: list(range(n)))
    c = load_contract().contract
    runs = measure_speed(c, Client(), SimpleNamespace(tokenize=lambda t: [1, 2, 3]), threads=2)
    rounds = ["".join(order[k:k + 4]) for k in range(0, len(order), 4)]   # decode pair, then prefill pair
    assert rounds == ["WPWP"] + ["PWPW", "WPWP"] * 4 + ["PWPW"]          # warm-up, then 9 alternating
    assert len(runs.pipeline_prefill) == len(runs.whole_prefill) == c.speed.repeats == 9
    assert runs.prefill_tokens == c.speed.prefill_tokens and runs.threads == 2
    # round 0 (pipeline first): the pipeline's numbers were measured before the whole model's
    assert runs.pipeline_decode[0] < runs.whole_decode[0] and runs.pipeline_decode[1] > runs.whole_decode[1]


def test_a_failing_row_fails_the_gate_its_table_and_its_exit_code(monkeypatch, capsys):
    lc = load_contract()
    exact = Row("t", Figure(check="parity: max |logit diff|", figure=0.0, threshold="== 0", passed=True))
    decode_ok = (0.7,) * 9
    for runs, rc, summary, prefill in (
            (_runs(decode_ok, SLOW), 1, "2/3 rows pass: FAILED", ["0.940 (IQR 0.920-0.960)", ">= 1.0", "NO"]),
            (_runs(decode_ok, BUSY), 3, f"2/3 rows pass, 1 inconclusive: INCONCLUSIVE ({INCONCLUSIVE}: not a pass; "
                                        "rerun on a quieter machine)",
             ["0.993 (IQR 0.970-1.040)", ">= 1.0", "inconclusive"]),
            (_runs(decode_ok, QUIET), 0, "3/3 rows pass: PASSED", ["1.110 (IQR 1.090-1.120)", ">= 1.0", "yes"])):
        res = GateResult(contract=lc, rows=[exact] + [Row("t", f) for f in speed_figures(runs, lc.contract.speed)])
        assert res.passed == (rc == 0) and res.verdict == {0: "passed", 1: "failed", 3: "inconclusive"}[rc]
        monkeypatch.setattr("dgr.app.certify.run_gate", lambda *a, res=res, **k: res)
        assert dgr(["gate", "alpha"]) == rc
        out = capsys.readouterr().out
        assert out == res.table() + "\n"
        lines = out.splitlines()
        assert lines[0] == f"dgr gate alpha (contract certification/alpha.toml, blake3 {lc.blake3[:16]}; numerics unknown)"
        assert lines[1].split() == ["check", "figure", "threshold", "pass"] and lines[-1] == summary
        rows = _rows(out)
        assert rows["t: parity: max |logit diff|"] == ["0", "== 0", "yes"]
        assert rows["t: speed: prefill ratio (256 tokens)"] == prefill
    # an inconclusive row beside a failed one: the run failed
    failed = Row("t", exact.figure.model_copy(update={"passed": False}))
    both = GateResult(contract=lc, rows=[failed] + [Row("t", f) for f in speed_figures(_runs(decode_ok, BUSY),
                                                                                      lc.contract.speed)])
    assert both.verdict == "failed" and both.table().endswith("1/3 rows pass, 1 inconclusive: FAILED")
    assert not GateResult(contract=lc).passed               # a gate with no rows passes nothing
    assert GateResult(contract=lc).verdict == "failed"


# --- the gate end to end, on the engine -------------------------------------------------------------------

@pytest.fixture
def judged_speed(monkeypatch) -> list[tuple[SpeedRuns, object, list[Figure]]]:
    """Every call of the speed rows' judgement during a test: (measured, the contract's [speed], rows)."""
    from dgr.app.certify import runner

    calls, real = [], runner.speed_figures

    def spy(m, s):
        figs = real(m, s)
        calls.append((m, s, figs))
        return figs

    monkeypatch.setattr(runner, "speed_figures", spy)
    return calls


@pytest.mark.engine
@pytest.mark.slow      # ~45 s on 2 idle cores (SmolLM2's speed rows)
def test_gate_alpha_certifies_every_target_and_prints_its_table(tmp_path, engine_lib, capsys, judged_speed):
    rc = dgr(["gate", "alpha", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    lc = load_contract()
    lines = out.splitlines()
    assert lines[0] == (f"dgr gate alpha (contract certification/alpha.toml, blake3 {lc.blake3[:16]}; "
                        f"numerics {build_numerics(engine_lib)})")
    assert lines[1].split() == ["check", "figure", "threshold", "pass"]
    rows = _rows(out)
    speed = {k for k in rows if ": speed: " in k}
    # speed rows for the real weights only
    assert speed == {f"smollm2-135m-3stage: {s}" for s in SPEED_ROWS}
    # exactness, MTP off and the refusal, the scenario: every other row passes on any machine, loaded or not
    assert all(v[2] == "yes" for k, v in rows.items() if k not in speed), out
    assert rows["deepseek4-tiny-2stage: MTP-on recipe refused"][0].startswith("refused")
    for t in TARGETS:
        assert rows[f"{t}: MTP off"][2] == "yes"
        assert rows[f"{t}: parity: max |logit diff|"][:2] == ["0", "== 0"]
        assert rows[f"{t}: parity: greedy tokens"][1] == "all equal"
    assert rows["deepseek4-v4shape-12stage: stages in worker processes"][:2] == ["12", "== 12"]
    assert rows["deepseek4-v4shape-12stage: 10+ stage scenario"][0] == "12 stages, 12 processes"
    # the features: SmolLM2 restores a kept prefix exactly; DeepSeek V4 keeps none and says why (not a failure);
    # every target recovers from a kill -9 of its middle stage to the same tokens and logits
    assert re.fullmatch(r"\d+/150 restored, same tokens and logits",
                        rows[f"smollm2-135m-3stage: {PREFIX_CHECK}"][0]), rows
    for t in TARGETS:
        figure, threshold, passed = rows[f"{t}: {PREFIX_CHECK}"]
        assert passed == "yes" and threshold == "restored > 0, bit-identical (or refused)"
        assert figure.startswith("refused: deepseek4 ") == t.startswith("deepseek4"), figure
        assert rows[f"{t}: {RECOVERY_CHECK}"] == ["same tokens and logits", "= the undisturbed run, on a replica",
                                                   "yes"]

    # The speed rows: measured here (finite, positive tok/s on both sides of every timed round) and judged
    # against the committed contract's thresholds. Whether they pass depends on the machine's load and is
    # not asserted: the pass column must only agree with the decision on the measured numbers.
    alpha = lc.contract.speed
    [(runs, judged_by, figs)] = judged_speed
    assert judged_by == alpha and runs.prefill_tokens == 256
    for side in (runs.pipeline_decode, runs.whole_decode, runs.pipeline_prefill, runs.whole_prefill):
        assert len(side) == alpha.repeats and all(math.isfinite(x) and x > 0 for x in side), runs
    smol = load_certificate(tmp_path / "smollm2-135m-3stage.json")
    by_check = {f.check: f for f in smol.figures}
    assert [by_check[s] for s in SPEED_ROWS] == figs
    for name, pipeline, whole, minimum in ((SPEED_ROWS[0], runs.pipeline_decode, runs.whole_decode,
                                            alpha.decode_ratio_min),
                                           (SPEED_ROWS[1], runs.pipeline_prefill, runs.whole_prefill,
                                            alpha.prefill_ratio_min)):
        j = judge(pipeline, whole, minimum)
        assert len(j.ratios) == alpha.repeats and all(math.isfinite(r) and r > 0 for r in j.ratios)
        f = by_check[name]
        assert f.figure == f"{j.median:.3f} (IQR {j.q1:.3f}-{j.q3:.3f})" and f.threshold == f">= {minimum}"
        assert f.passed == (j.verdict == "pass") and is_inconclusive(f) == (j.verdict == "inconclusive")
        assert rows[f"smollm2-135m-3stage: {name}"] == [f.figure, f">= {minimum}",
                                                        {"pass": "yes", "fail": "NO"}.get(j.verdict, j.verdict)]

    # the gate's verdict is every row's: exit 0 and PASSED exactly when every row says yes, 3 when the rows
    # that do not are inconclusive speed rows, 1 otherwise
    ok = sum(v[2] == "yes" for v in rows.values())
    busy = sum(v[2] == "inconclusive" for v in rows.values())
    verdict = "passed" if ok == len(rows) else "inconclusive" if ok + busy == len(rows) else "failed"
    assert rc == {"passed": 0, "failed": 1, "inconclusive": 3}[verdict], out
    assert lines[-2].startswith(f"{ok}/{len(rows)} rows pass" + (f", {busy} inconclusive" if busy else "") +
                                f": {verdict.upper()}")
    assert lines[-1] == f"certificates: {tmp_path}"
    # one certificate per target, against the committed contract (its path and the hash of its bytes), naming
    # the dgr-worker binary its stages ran; valid exactly when every one of its rows passed
    from dgr.app.workerbin import worker_binary
    from dgr.core.hashing import file_blake3

    worker = file_blake3(worker_binary(), threads=False)
    for t in TARGETS:
        cert = load_certificate(tmp_path / f"{t}.json")
        assert cert.identity.worker_blake3 == worker, t
        assert cert.contract.path == "certification/alpha.toml"
        assert cert.contract.blake3 == cert.identity.contract_blake3 == lc.blake3
        assert cert.passed == all(f.passed for f in cert.figures)
        assert cert.passed or t == "smollm2-135m-3stage"    # only speed rows may fail, and only SmolLM2 has them
        why = check(cert, cert.identity.model_copy(update={"contract_blake3": ""}))
        assert why is None if cert.passed else "failed gate (speed: " in why
        assert {f.check for f in cert.figures} >= {PREFIX_CHECK, RECOVERY_CHECK}
    assert DEFAULT_CONTRACT.is_file()


GATE_CONTRACT = """\
name = "failing"
threads_per_process = 1

[parity]
random_prompts = [70]
max_new_tokens = 3
chunk_tokens = 16
n_ctx = 128

[speed]
applies_to = "all"
decode_tokens = 3
prefill_tokens = 24
repeats = 1
decode_ratio_min = 0.5
prefill_ratio_min = 1.0

[gate.mtp_refusal]
synthetic = "llama-2stage"

[[gate.synthetic]]
name = "llama-2stage"
arch = "llama"
layers = 4
embd = 64
stages = [[0, 2], [2, 4]]
"""


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("case", ["failing", "inconclusive"])
def test_a_gate_with_a_failing_row_exits_1_and_one_with_an_inconclusive_row_3(case, tmp_path, engine_lib, capsys,
                                                                              monkeypatch):
    """Parity, the prefix cache and recovery run for real; the speed numbers are given, so the verdict does not
    depend on this machine's load: a pipeline at half the whole model's prefill speed in every round fails
    (exit 1), three rounds whose ratios straddle 1.0 are inconclusive (exit 3)."""
    from dgr.app.certify import runner

    prefill = {"failing": ((150.0,), (300.0,)), "inconclusive": ((290.0, 300.0, 330.0), (300.0, 300.0, 300.0))}[case]
    n = len(prefill[0])
    given = SpeedRuns(prefill_tokens=24, threads=1, pipeline_decode=(40.0,) * n, whole_decode=(50.0,) * n,
                      pipeline_prefill=prefill[0], whole_prefill=prefill[1])
    asked = []
    monkeypatch.setattr(runner, "measure_speed", lambda c, client, eng, threads: asked.append(c.speed) or given)
    c = tmp_path / "failing.toml"
    c.write_text(GATE_CONTRACT)
    monkeypatch.setenv("DGR_WORKSPACE", str(tmp_path / "ws"))
    rc = dgr(["gate", "alpha", "--contract", str(c), "--out-dir", str(tmp_path / "certs")])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rc == {"failing": 1, "inconclusive": 3}[case], out
    assert [s.prefill_ratio_min for s in asked] == [1.0]       # measured once, for the one target
    assert rows["llama-2stage: speed: decode ratio"] == ["0.800 (IQR 0.800-0.800)", ">= 0.5", "yes"]
    prefill_row = "llama-2stage: speed: prefill ratio (24 tokens)"
    assert rows[prefill_row] == {"failing": ["0.500 (IQR 0.500-0.500)", ">= 1.0", "NO"],
                                 "inconclusive": ["1.000 (IQR 0.983-1.050)", ">= 1.0", "inconclusive"]}[case]
    assert rows["llama-2stage: parity: max |logit diff|"][2] == "yes"
    assert rows["llama-2stage: parity: greedy tokens"][2] == "yes"
    assert rows["llama-2stage: MTP-on recipe refused"][2] == "yes"
    assert rows[f"llama-2stage: {PREFIX_CHECK}"] == ["32/70 restored, same tokens and logits",
                                                     "restored > 0, bit-identical (or refused)", "yes"]
    assert rows[f"llama-2stage: {RECOVERY_CHECK}"][2] == "yes"
    assert [k for k, v in rows.items() if v[2] != "yes"] == [prefill_row]
    assert out.splitlines()[-2] == {
        "failing": f"{len(rows) - 1}/{len(rows)} rows pass: FAILED",
        "inconclusive": f"{len(rows) - 1}/{len(rows)} rows pass, 1 inconclusive: INCONCLUSIVE ({INCONCLUSIVE}: not a "
                        "pass; rerun on a quieter machine)"}[case]
    cert = load_certificate(tmp_path / "certs" / "llama-2stage.json")
    assert not cert.passed
    assert "failed gate (speed: prefill ratio (24 tokens))" in check(
        cert, cert.identity.model_copy(update={"contract_blake3": ""}))
