"""`dgr gate alpha` over the committed contract: SmolLM2 in 3 worker processes (parity and the speed gate),
tiny DeepSeek V4 in 2, 3 and 4 stages, the 12-stage scenario and the MTP refusal, one table, exit 0; and a
gate whose row fails exits 1."""

from __future__ import annotations

import pytest

from dgr.certificate import check, load_certificate
from dgr.certify import DEFAULT_CONTRACT
from support.certify import dgr

pytestmark = [pytest.mark.engine, pytest.mark.slow]    # ~45 s on 2 idle cores (SmolLM2's speed rows)

TARGETS = ["smollm2-135m-3stage", "deepseek4-tiny-2stage", "deepseek4-tiny-3stage", "deepseek4-tiny-4stage",
           "deepseek4-v4shape-12stage"]


def _rows(out: str) -> dict[str, list[str]]:
    """check -> [figure, threshold, pass] from the printed table (columns split on 2+ spaces)."""
    import re

    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 4 and cells[3] in ("yes", "NO"):
            rows[cells[0]] = cells[1:]
    return rows


def test_gate_alpha_passes_on_this_machine_and_prints_its_table(tmp_path, engine_lib, capsys):
    rc = dgr(["gate", "alpha", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert out.splitlines()[1].split() == ["check", "figure", "threshold", "pass"]
    rows = _rows(out)
    assert all(v[2] == "yes" for v in rows.values()), out
    assert rows["deepseek4-tiny-2stage: MTP-on recipe refused"][0].startswith("refused")
    for t in TARGETS:
        assert rows[f"{t}: MTP off"][2] == "yes"
        assert rows[f"{t}: parity: max |logit diff|"][:2] == ["0", "== 0"]
        assert rows[f"{t}: parity: greedy tokens"][1] == "all equal"
    # speed rows for the real weights only, thresholds as the committed contract says
    assert rows["smollm2-135m-3stage: speed: decode ratio"][1] == ">= 0.5"
    assert rows["smollm2-135m-3stage: speed: prefill ratio (256 tokens)"][1] == ">= 1.0"
    assert not any("speed" in k for k in rows if k.startswith("deepseek4"))
    assert rows["deepseek4-v4shape-12stage: stages in worker processes"][:2] == ["12", "== 12"]
    assert rows["deepseek4-v4shape-12stage: 10+ stage scenario"][0] == "12 stages, 12 processes"
    assert "PASSED" in out.splitlines()[-2]
    # one valid certificate per target, against the committed contract
    for t in TARGETS:
        cert = load_certificate(tmp_path / f"{t}.json")
        assert cert.passed and cert.contract.path == "certification/alpha.toml"
        assert check(cert, cert.identity.model_copy(update={"contract_blake3": ""})) is None
        assert cert.contract.blake3 == cert.identity.contract_blake3
    assert DEFAULT_CONTRACT.is_file()


GATE_CONTRACT = """\
name = "failing"
threads_per_process = 1

[parity]
random_prompts = [20]
max_new_tokens = 3
chunk_tokens = 16
n_ctx = 128

[speed]
applies_to = "all"
decode_tokens = 3
prefill_tokens = 24
repeats = 1
decode_ratio_min = 0.0
prefill_ratio_min = 1000.0

[gate.mtp_refusal]
synthetic = "llama-2stage"

[[gate.synthetic]]
name = "llama-2stage"
arch = "llama"
layers = 4
embd = 64
stages = [[0, 2], [2, 4]]
"""


def test_a_gate_with_a_failing_row_exits_1(tmp_path, engine_lib, capsys, monkeypatch):
    c = tmp_path / "failing.toml"
    c.write_text(GATE_CONTRACT)
    monkeypatch.setenv("DGR_WORKSPACE", str(tmp_path / "ws"))
    rc = dgr(["gate", "alpha", "--contract", str(c), "--out-dir", str(tmp_path / "certs")])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rc == 1, out
    assert rows["llama-2stage: speed: prefill ratio (24 tokens)"][1:] == [">= 1000.0", "NO"]
    assert rows["llama-2stage: parity: max |logit diff|"][2] == "yes"
    assert rows["llama-2stage: MTP-on recipe refused"][2] == "yes"
    assert "FAILED" in out
    assert not load_certificate(tmp_path / "certs" / "llama-2stage.json").passed
