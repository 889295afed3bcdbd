"""The wire dtype table (docs/wire-dtypes.md and its JSON): a row per architecture and dtype, measured the
way the wire carries boundaries; a recipe's boundary dtype is checked against it at plan and build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.app.bench.dtypes import DTYPES, STEPS, parse_markdown, read_table, run_dtype_table
from dgr.toolchain.recipe import POOR_AGREEMENT, WIRE_DTYPE_TABLE, boundary_dtype_warning

from support.engine import b3, synth_model

DOC = WIRE_DTYPE_TABLE.with_suffix(".md")


def _synth_list() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "dgr", "synth", "--list"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.split()


def test_the_committed_table_has_a_row_per_architecture_and_dtype():
    md, rows = parse_markdown(DOC), read_table()
    cells = {(r["architecture"], r["model"], r["dtype"]) for r in md}
    assert cells == {(r["arch"], r["model"], r["dtype"]) for r in rows} and len(md) == len(rows)  # one source
    for arch in _synth_list():
        assert {d for a, m, d in cells if a == arch and m == "synth"} == set(DTYPES), arch
    assert {d for a, m, d in cells if m == "SmolLM2-135M"} == set(DTYPES)
    for r in rows:
        assert r["steps"] == STEPS == 256
        if r["dtype"] == "f32":             # the reference: exact by construction
            assert (r["top1_agree"], r["max_abs_logit_diff"], r["kl_mean"]) == (1.0, 0.0, 0.0)
        if r["dtype"] == "q8_0":
            assert r["bytes_vs_f32"] == 34 / 128 <= 0.27
    assert "## The recipe default" in DOC.read_text()


@pytest.mark.engine
def test_the_table_is_measured_through_the_codec(engine_lib, tmp_path):
    """Two architectures, every dtype, 256 greedy tokens each: f32 is exact, the lossy dtypes are not
    bit for bit (the codec really ran), and the markdown and the JSON say the same."""
    out = tmp_path / "wire-dtypes.md"
    rows = run_dtype_table(archs=["qwen3", "mamba"], lib=engine_lib, smollm2=False, out=out)
    assert [(r["arch"], r["dtype"]) for r in rows] == [(a, d) for a in ("qwen3", "mamba") for d in DTYPES]
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == rows
    assert len(parse_markdown(out)) == len(rows)
    for r in rows:
        assert r["steps"] == 256 and 0.0 <= r["top1_agree"] <= 1.0
        assert r["bytes_per_token"] == {"f32": 256, "f16": 128, "bf16": 128, "q8_0": 68}[r["dtype"]]
        if r["dtype"] == "f32":
            assert r["max_abs_logit_diff"] == 0.0 and r["first_divergence"] is None
        else:
            assert r["max_abs_logit_diff"] > 0.0 and r["kl_mean"] >= 0.0


def _recipe(tmp_path: Path, src: Path, dtype: str) -> Path:
    p = tmp_path / f"r-{dtype}.toml"
    p.write_text(f'name = "t"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n'
                 f'[placement]\nstages = [[0, 3], [3, 6]]\n\n[boundary]\ndtype = "{dtype}"\n')
    return p


def _plan(recipe: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr", "recipe", "plan", str(recipe)], capture_output=True,
                          text=True, timeout=120)


def _poor(dtype: str) -> str:
    """An architecture measured only on its tiny model whose `dtype` row is poor."""
    rows = read_table()
    real = {r["arch"] for r in rows if r["model"] != "synth"}
    return next(r["arch"] for r in rows if r["dtype"] == dtype and r["arch"] not in real
                and r["top1_agree"] < POOR_AGREEMENT)


def test_recipe_plan_warns_of_a_lossy_dtype_measured_poor_for_its_architecture(tmp_path):
    arch = _poor("q8_0")
    src = synth_model(tmp_path, arch)
    p = _plan(_recipe(tmp_path, src, "q8_0"))
    assert p.returncode == 0, p.stderr
    assert f"boundary dtype q8_0 loses too much on architecture {arch}" in p.stderr
    assert "use f32" in p.stderr and "docs/wire-dtypes.md" in p.stderr
    p = _plan(_recipe(tmp_path, src, "f32"))
    assert p.returncode == 0 and "loses too much" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "dgr", "recipe", "build", str(_recipe(tmp_path, src, "q8_0")),
                        "--store", str(tmp_path / "store"), "-q"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"boundary dtype q8_0 loses too much on architecture {arch}" in p.stderr
    from dgr.toolchain.bundle import load_bundle
    assert load_bundle(next((tmp_path / "store").glob("t-*"))).manifest.boundary_dtype == "q8_0"


def _table(tmp_path: Path, rows: list[tuple[str, str, float]]) -> Path:
    t = tmp_path / "table.json"
    t.write_text(json.dumps({"rows": [{"arch": "llama", "model": m, "dtype": d, "top1_agree": a, "steps": 256,
                                       "first_divergence": None if a == 1 else 3, "kl_mean": 1e-3}
                                      for m, d, a in rows]}))
    return t


def test_a_real_models_row_speaks_for_its_architecture(tmp_path):
    """A tiny random model's near-ties are not its architecture's: where a real model was measured, its row
    decides, and the warning names it."""
    good_real = _table(tmp_path, [("synth", "q8_0", 0.2), ("SmolLM2-135M", "q8_0", 0.95), ("SmolLM2-135M", "f32", 1)])
    assert boundary_dtype_warning("llama", "q8_0", good_real) is None
    poor_real = _table(tmp_path, [("synth", "q8_0", 1.0), ("SmolLM2-135M", "q8_0", 0.4),
                                  ("SmolLM2-135M", "f16", 0.97), ("SmolLM2-135M", "f32", 1.0)])
    why = boundary_dtype_warning("llama", "q8_0", poor_real)
    assert "measured on SmolLM2-135M" in why and "40% of 1 x 256" in why and "use f32 or f16" in why


def test_recipe_plan_refuses_q8_0_on_a_width_that_is_not_whole_blocks(tmp_path):
    p = _plan(_recipe(tmp_path, synth_model(tmp_path, "llama", embd=48), "q8_0"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "boundary.dtype: wire dtype q8_0 packs 32 values per block" in p.stderr and "48 values" in p.stderr


def test_the_check_without_a_table_or_a_measurement(tmp_path):
    assert boundary_dtype_warning("llama", "f32") is None                     # exact: never warned
    assert boundary_dtype_warning("llama", "q8_0", tmp_path / "none.json") is None
    t = tmp_path / "t.json"
    t.write_text(json.dumps({"rows": [{"arch": "llama", "model": "synth", "dtype": "f16", "top1_agree": 1.0,
                                       "steps": 256, "first_divergence": None, "kl_mean": 0.0}]}))
    assert boundary_dtype_warning("llama", "f16", t) is None
    assert "has no measurement of it for architecture gemma3" in boundary_dtype_warning("gemma3", "f16", t)
