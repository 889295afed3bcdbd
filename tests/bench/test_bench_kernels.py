"""`dgr bench kernels`: the same whole model on each CPU kernel set side by side, and stock llama.cpp (its own
`llama-batched-bench`, built from the pinned tree without dgr's patches). The report has a row per model, thread
count and kernel set, every prompt length measured, each engine row naming the numerics it ran (so a row cannot
silently measure another kernel set), and the ratio tables. Nothing here compares a time: the command measures
speed."""

from __future__ import annotations

import pytest

from dgr.core.errors import DgrError
from dgr.runtime.engine import quantize
from dgr.toolchain.synth.generic import synth

from support.bench_cli import run_bench_json


def _kernels(tmp_path, *argv) -> tuple[int, dict]:
    return run_bench_json(tmp_path, "kernels", *argv)


@pytest.mark.engine
@pytest.mark.slow
def test_kernels_measures_every_kernel_set_and_stock_llama_cpp_on_one_model(tmp_path, capsys, engine_lib):
    pytest.importorskip("matplotlib")
    model = quantize(synth("llama", 2, 256, 1, tmp_path / "f32.gguf"), tmp_path / "q4k.gguf", "Q4_K", lib=engine_lib)
    png = tmp_path / "kernels.png"
    rc, rep = _kernels(tmp_path, "--model", str(model), "--threads", "1", "--prompt-lengths", "8,16", "--tokens",
                       "4", "--rounds", "1", "--lib", str(engine_lib), "--plot", str(png))
    assert rc == 0
    assert rep["poll"] == 50  # both sides' threads as llama.cpp's tools run them
    rows = {r["variant"]: r for r in rep["rows"]}
    assert list(rows) == ["invariant", "reference", "fast", "stock"]
    for v, r in rows.items():
        assert r["threads"] == 1 and set(r["prefill_tok_s"]) == {"8", "16"}
        assert all(x > 0 for x in r["prefill_tok_s"].values()) and r["decode_tok_s"] > 0, r
    for v in ("invariant", "reference", "fast"):
        assert rows[v]["numerics"].endswith(f" {v} kv-f16 fa-auto"), rows[v]["numerics"]
    assert "stock" in rows["stock"]["numerics"]
    out = capsys.readouterr().out
    assert "| q4k.gguf | 1 | invariant |" in out and "invariant / stock" in out and "invariant / reference" in out
    assert png.stat().st_size > 0


def test_kernels_refuses_an_unknown_kernel_set_by_name(tmp_path):
    with pytest.raises(DgrError, match="--kernels 'reference,turbo': choose from invariant, reference, fast, stock"):
        _kernels(tmp_path, "--kernels", "reference,turbo")


@pytest.mark.engine
def test_kernels_names_a_model_the_engine_cannot_read(tmp_path, engine_lib):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(DgrError, match=r"(?s)dgr-engine-bench on truncated.gguf \(invariant, 1 thread\(s\)\) failed "
                                       r"\(exit 1\):.*truncated.gguf: not a readable GGUF file"):
        _kernels(tmp_path, "--model", str(bad), "--kernels", "invariant", "--threads", "1", "--rounds", "1",
                 "--lib", str(engine_lib))


def test_kernels_refuses_a_polling_level_outside_0_to_100(tmp_path):
    with pytest.raises(DgrError, match=r"--poll is 0-100 \(ggml's polling level\), got 101"):
        _kernels(tmp_path, "--poll", "101", "--model", str(tmp_path / "never-read.gguf"), "--rounds", "1")


def test_kernels_refuses_zero_rounds(tmp_path):
    with pytest.raises(DgrError, match="--rounds and --tokens must be at least 1"):
        _kernels(tmp_path, "--model", str(tmp_path / "m.gguf"), "--kernels", "invariant", "--rounds", "0")
