"""`dgr baseline` and `dgr parity` as a user runs them: a saved baseline, an exact bundle, and a
negative control that must make the command fail."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.cli.main import main
from dgr.runtime.engine import Engine

from support.engine import make_bundle, synth_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory, engine_lib):
    d = tmp_path_factory.mktemp("cli")
    whole = synth_model(d, "qwen2")
    bundle = make_bundle(whole, [(0, 4), (4, 5), (5, 6)], d)
    return d, whole, bundle, engine_lib


def test_baseline_then_parity_is_exact(setup, capsys):
    d, whole, bundle, lib = setup
    base = d / "base.npz"
    args = ["--prompt", "hello there, general kenobi", "--prompt", "the other session", "--steps", "5",
            "--n-ubatch", "8", "--lib", str(lib)]
    assert main(["baseline", str(whole), *args, "-o", str(base)]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "2 session(s)" in out
    z = np.load(base)
    with Engine.open(whole, n_ctx=64, max_sessions=1, lib=lib) as e:
        n_prompt = len(e.tokenize("hello there, general kenobi"))
    assert z["prefill_logits_0"].shape[0] == n_prompt  # every prompt position
    assert z["decode_logits_1"].shape == (5, z["prefill_logits_1"].shape[1])
    assert main(["parity", str(bundle.root), "--baseline", str(base), "--lib", str(lib)]) == 0
    out = capsys.readouterr().out
    assert "max abs difference: 0" in out and "parity: EXACT" in out


def test_parity_without_a_baseline_runs_the_source(setup, capsys):
    d, whole, bundle, lib = setup
    assert main(["parity", str(bundle.root), "--steps", "3", "--lib", str(lib)]) == 0
    out = capsys.readouterr().out
    assert "parity: EXACT" in out
    assert "  prefix cache (restore, and cut back to" in out and "positions): exact" in out   # the warm pass


def test_parity_warm_pass_fails_when_a_restore_is_wrong(setup, capsys, monkeypatch):
    """The warm pass is a check: a saved state with one bit changed (in the last cell's values) fails `dgr parity`
    (exit 1) while the split itself stays exact."""
    d, whole, bundle, lib = setup
    real = Engine.state_get

    def one_bit_off(self, sid, epoch):
        state, n = real(self, sid, epoch)
        b = bytearray(state)
        b[-8] ^= 0x01
        return bytes(b), n
    monkeypatch.setattr(Engine, "state_get", one_bit_off)
    assert main(["parity", str(bundle.root), "--steps", "3", "--lib", str(lib)]) == 1
    cap = capsys.readouterr()
    assert "parity: EXACT" in cap.out                     # the split itself is still exact
    assert "a restored prefix does not reproduce the split's cold run" in cap.err


@pytest.mark.parametrize("stage", [0, 1])
def test_perturbed_boundary_makes_parity_fail(setup, capsys, stage):
    d, whole, bundle, lib = setup
    rc = main(["parity", str(bundle.root), "--steps", "2", "--perturb-boundary", str(stage), "--lib", str(lib)])
    assert rc == 1
    cap = capsys.readouterr()
    assert "session 0, prefill, position 0" in cap.out
    assert "parity FAILED" in cap.err
