"""A quantized bundle checked against the whole model with the same weights (issue 24, a new operator's first hour).

A recipe that quantizes (a Q8_0 rule) builds a bundle whose weights are not the source's, so the source
cannot be its baseline: `dgr parity BUNDLE` reported "parity FAILED (max abs 0.0028)" and `dgr certify`
failed its parity rows. The baseline of such a bundle is the same recipe built as one stage
(dgr.toolchain.bundle.baseline_model), built once into the workspace and reused; an unquantized bundle is still
compared with its source. Tiny random-weight models (`dgr synth`), bundles built by the real builder, the
real `dgr` command line in a child process for parity and in this process for certify (as
tests/certify/test_certify.py does); DGR_WORKSPACE points every run at this module's own workspace.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from dgr.core.certificate import load_certificate
from dgr.core.errors import BundleError
from dgr.core.hashing import file_blake3
from dgr.gguf.model import read_header
from dgr.toolchain.bundle import build, load_bundle

from support.certify import dgr, write_contract

pytestmark = pytest.mark.engine

Q = gguf.GGMLQuantizationType
RANGES = [(0, 2), (2, 3), (3, 4)]
Q8_RULE = '[quantization]\nrules = [{ pattern = "blk.*.ffn_*.weight", type = "Q8_0" }]\n'


def write_recipe(path: Path, name: str, src: Path, ranges, extra: str = "") -> Path:
    """A recipe of `src` (a path relative to the recipe's folder, or absolute) split at `ranges`."""
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    path.write_text(f'name = "{name}"\n\n[source]\nuri = "{src}"\nblake3 = "{file_blake3(path.parent / src)}"\n\n'
                    f"[placement]\nstages = [{pairs}]\n\n{extra}")
    return path


def types_of(paths) -> dict[str, Q]:
    return {t.name: t.type for p in paths for t in read_header(p).tensors}


def tensor_bytes(paths) -> dict[str, bytes]:
    return {t.name: bytes(t.data.tobytes()) for p in paths for t in gguf.GGUFReader(str(p)).tensors}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pq")


@pytest.fixture(scope="module")
def workspace(root):
    return root / "ws"


@pytest.fixture(scope="module")
def source(root):
    from dgr.toolchain.synth.generic import synth

    return synth("llama", 4, 256, 11, root / "llama-4L.gguf")


@pytest.fixture(scope="module")
def quantized(root, source):
    """A 3-stage bundle of the tiny llama whose FFN matrices the recipe makes Q8_0."""
    b = build(write_recipe(root / "q8.toml", "q8", source, RANGES, Q8_RULE), root / "store")
    src, got = types_of([source]), types_of(b.stage_paths)
    assert {n for n in got if got[n] != src[n]} == {f"blk.{i}.ffn_{m}.weight" for i in range(4)
                                                     for m in ("gate", "up", "down")}
    assert all(got[n] == Q.Q8_0 for n in got if got[n] != src[n])
    return b


def run_dgr(*args: str, lib: Path, workspace: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DGR_ENGINE_LIB=str(lib), DGR_WORKSPACE=str(workspace), GGML_NO_BACKTRACE="1")
    return subprocess.run([sys.executable, "-m", "dgr", *args], capture_output=True, text=True, env=env, timeout=300)


def parity(bundle, lib, workspace, *extra: str) -> subprocess.CompletedProcess:
    return run_dgr("parity", str(bundle.root), "--threads", "1", "--steps", "3", *extra, lib=lib, workspace=workspace)


def test_parity_of_a_quantized_bundle_is_exact_against_the_recipe_built_as_one_stage(
        quantized, engine_lib, workspace):
    r = parity(quantized, engine_lib, workspace)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parity: EXACT" in r.stdout
    assert re.search(r"max abs difference: 0 ", r.stdout), r.stdout
    m = re.search(r"baseline: the recipe built as one stage: (\S+)", r.stdout)
    assert m, r.stdout
    one = Path(m.group(1))
    # built once, into the workspace, and said so on stderr with where
    assert one.is_file() and workspace.resolve() in one.resolve().parents
    assert "building" in r.stderr and str(one.parent) in r.stderr, r.stderr
    whole = load_bundle(one.parent)
    assert [(s.layer_begin, s.layer_end) for s in whole.manifest.stages] == [(0, 4)]
    assert whole.manifest.source.blake3 == quantized.manifest.source.blake3
    # the same weights: every tensor the split holds has the same type and bytes in the one-stage file
    assert types_of([one]) == types_of(quantized.stage_paths)
    assert tensor_bytes([one]) == tensor_bytes(quantized.stage_paths)
    # a second parity reuses it: nothing is built again
    again = parity(quantized, engine_lib, workspace)
    assert again.returncode == 0 and "parity: EXACT" in again.stdout, again.stdout + again.stderr
    assert f"baseline: the recipe built as one stage: {one}" in again.stdout
    assert "building" not in again.stderr and str(one.parent) in again.stderr, again.stderr
    # and the comparison is real: one changed boundary value fails it
    bad = parity(quantized, engine_lib, workspace, "--perturb-boundary", "0")
    assert bad.returncode == 1 and "parity FAILED" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_an_unquantized_bundle_is_still_compared_with_its_source(root, source, engine_lib, tmp_path):
    plain = build(write_recipe(root / "plain.toml", "plain", source, RANGES), root / "store")
    ws = tmp_path / "ws"
    r = parity(plain, engine_lib, ws)
    assert r.returncode == 0 and "parity: EXACT" in r.stdout, r.stdout + r.stderr
    assert f"baseline: the source GGUF {source}" in r.stdout, r.stdout
    assert not (ws / "baselines").exists()          # nothing built


def test_a_source_the_manifest_names_relative_to_the_recipe_is_found_again_or_given_with_source(
        root, source, engine_lib, tmp_path, monkeypatch):
    """`dgr recipe new --from-model` writes the source's path relative to the recipe's folder, which the
    bundle cannot resolve from elsewhere. The workspace that built the bundle remembers where that blake3
    was found (and checks it again); any other workspace says to pass --source, then checks the bundle."""
    d = root / "rel"
    d.mkdir()
    built_in = tmp_path / "built-in"
    monkeypatch.setenv("DGR_WORKSPACE", str(built_in))
    rel = build(write_recipe(d / "recipe.toml", "q8", Path("..") / source.name, RANGES, Q8_RULE), root / "store-rel")
    fresh = tmp_path / "fresh"
    r = parity(rel, engine_lib, fresh)
    assert r.returncode == 2 and "--source PATH" in r.stderr, r.stdout + r.stderr
    r = parity(rel, engine_lib, fresh, "--source", str(root / "store-rel"))
    assert r.returncode == 2 and "is not the bundle's source" in r.stderr, r.stdout + r.stderr
    r = parity(rel, engine_lib, fresh, "--source", str(source))
    assert r.returncode == 0 and "parity: EXACT" in r.stdout, r.stdout + r.stderr
    assert "baseline: the recipe built as one stage: " in r.stdout
    # the workspace that built it finds the source by itself
    r = parity(rel, engine_lib, built_in)
    assert r.returncode == 0 and "parity: EXACT" in r.stdout, r.stdout + r.stderr


def test_certify_of_a_quantized_bundle_passes_against_the_recipe_built_as_one_stage(
        root, quantized, engine_lib, workspace, monkeypatch, capsys):
    monkeypatch.setenv("DGR_WORKSPACE", str(workspace))
    contract = write_contract(root / "contract.toml")
    out = root / "q8-cert.json"
    rc = dgr(["certify", "--bundle", str(quantized.root), "--lane", "cpu", "--out", str(out),
              "--contract", str(contract)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    cert = load_certificate(out)
    rows = {f.check: f for f in cert.figures}
    assert cert.passed and cert.identity.bundle_id == quantized.id
    assert rows["parity: greedy tokens"].passed
    assert rows["parity: max |logit diff|"].passed and rows["parity: max |logit diff|"].figure == 0.0
    # the certificate says what the whole model was
    assert "whole model: the recipe built as one stage: " in rows["parity: max |logit diff|"].detail


def test_a_quantized_bundle_of_a_model_with_mtp_is_refused_naming_the_reason(root, engine_lib, workspace, capsys,
                                                                            monkeypatch):
    """llama.cpp cannot load a one-stage bundle of a model with an MTP block (the bundle leaves the block
    out: `blk.N.attn_norm.weight not found`), so such a bundle has no whole-model baseline yet: parity and
    certify refuse it, saying why, before building anything."""
    from dgr.runtime.engine import Engine
    from dgr.toolchain.bundle import baseline_model
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4

    monkeypatch.setenv("DGR_WORKSPACE", str(workspace))
    src = synth_deepseek4(root / "v4.gguf", layers=4, hash_layers=2)
    store = root / "v4-store"
    split = build(write_recipe(root / "v4q.toml", "v4q", src, [(0, 2), (2, 4)], Q8_RULE), store)
    assert split.manifest.model.n_layer_all == split.manifest.model.n_layer + 1
    with pytest.raises(BundleError, match=r"(?s)one stage.*MTP.*blk\.4\.attn_norm\.weight"):
        baseline_model(split, src)
    r = parity(split, engine_lib, workspace)
    assert r.returncode == 2 and "MTP" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    out = root / "v4q-cert.json"
    rc = dgr(["certify", "--bundle", str(split.root), "--out", str(out), "--contract",
              str(write_contract(root / "contract.toml"))])
    err = capsys.readouterr().err
    assert rc == 2 and "MTP block" in err and "one stage" in err and not out.exists(), err
    assert not list(workspace.glob("baselines/*/store/v4q-*"))     # nothing was built for it
    # the reason is real: the pinned engine cannot open the recipe built as one stage
    one = build(write_recipe(root / "v4one.toml", "v4one", src, [(0, 4)], Q8_RULE), store)
    with pytest.raises(Exception, match=r"blk\.4\.attn_norm\.weight.* not found"):
        Engine.open(one.stage_paths[0], n_ctx=64, max_sessions=1, n_threads=1, lib=engine_lib).close()
