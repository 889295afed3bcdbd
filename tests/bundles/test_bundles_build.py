"""Recipes to bundles: split and rejoin byte for byte, determinism, dgr.* keys, quantization, recipe errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from dgr.cli.main import main
from dgr.core.constants import FORMAT_VERSION, MANIFEST_NAME, Keys
from dgr.core.hashing import file_blake3
from dgr.gguf.model import read_header
from dgr.toolchain.bundle import build, load_bundle
from dgr.toolchain.synth.generic import synth

from support.paths import REPO


def write_recipe(dirpath: Path, model: Path, placement: str, *, name: str = "t", extra: str = "",
                 blake: str | None = None, chunk: int = 65536) -> Path:
    p = dirpath / f"{name}.toml"
    p.write_text(f'''name = "{name}"
{extra}
[source]
uri = "{os.path.relpath(model, dirpath)}"
blake3 = "{blake or file_blake3(model)}"

[placement]
{placement}

[bundle]
chunk_size = {chunk}
''')
    return p


def source_bytes(h, name: str) -> bytes:
    t = h.tensor(name)
    with open(h.path, "rb") as f:
        f.seek(h.data_offset + t.offset)
        return f.read(t.nbytes)


def assert_split_rejoins(bundle, source: Path) -> None:
    """Every stage tensor equals the source tensor; every source tensor is where it belongs."""
    src = read_header(source)
    m = bundle.manifest
    n = len(m.stages)
    seen: dict[str, list[int]] = {}
    for s in m.stages:
        h = read_header(bundle.root / s.file)
        assert h.get(Keys.STAGE_INDEX) == s.index and h.get(Keys.STAGE_COUNT) == n
        assert (h.get(Keys.LAYER_BEGIN), h.get(Keys.LAYER_END)) == (s.layer_begin, s.layer_end)
        assert h.get(Keys.LAYER_TOTAL) == m.model.n_layer and h.get(Keys.FORMAT_VERSION) == FORMAT_VERSION
        assert h.get(Keys.SOURCE_BLAKE3) == m.source.blake3 and h.get(Keys.RECIPE_BLAKE3) == m.recipe.blake3
        assert h.get(Keys.BOUNDARY_N_EMBD) == m.model.n_embd and h.get(Keys.BOUNDARY_N_STREAMS) == 1
        # original metadata kept bit for bit (block_count stays the whole model's)
        for key, kv in src.kvs.items():
            assert h.kvs[key].raw == kv.raw, key
        assert len(h.tensors) == s.tensor_count
        for t in h.tensors:
            st = src.tensor(t.name)
            assert (t.shape, t.type) == (st.shape, st.type)
            assert source_bytes(h, t.name) == source_bytes(src, t.name), t.name
            seen.setdefault(t.name, []).append(s.index)
    tied = m.model.tied_embeddings
    for t in src.tensors:
        if t.name.startswith("blk."):
            layer = int(t.name.split(".")[1])
            want = [s.index for s in m.stages if s.layer_begin <= layer < s.layer_end]
        elif t.name == "token_embd.weight":
            want = sorted({0, n - 1}) if tied else [0]
        else:  # output_norm, output
            want = [n - 1]
        assert seen.get(t.name) == want, (t.name, seen.get(t.name), want)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False),
                                       ("gemma3", True), ("qwen3moe", False)])
def test_split_rejoin_synthetic(tmp_path, arch, tied):
    model = synth(arch, 5, 64, 3, tmp_path / "m.gguf", tied=tied)
    r = write_recipe(tmp_path, model, "stages = [[0, 1], [1, 3], [3, 5]]")
    b = build(r, tmp_path / "store")
    assert [(s.layer_begin, s.layer_end) for s in b.manifest.stages] == [(0, 1), (1, 3), (3, 5)]
    assert_split_rejoins(b, model)
    # stage files open with the gguf package's reader too (an independent parser)
    for p in b.stage_paths:
        assert len(gguf.GGUFReader(p).tensors) > 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_split_rejoin_smollm2(tmp_path, smollm2_gguf, n):
    b = build(REPO / "recipes" / f"smollm2-135m-{n}stage" / "recipe.toml", tmp_path / "store")
    assert len(b.manifest.stages) == n
    assert b.manifest.source.blake3 == file_blake3(smollm2_gguf)
    assert_split_rejoins(b, smollm2_gguf)
    # the tied embedding rides on the last stage as the LM head
    last = read_header(b.stage_paths[-1])
    assert {t.name for t in last.tensors} >= {"token_embd.weight", "output_norm.weight"}


def test_two_builds_are_identical(tmp_path):
    model = synth("qwen3", 4, 64, 11, tmp_path / "m.gguf")
    r = write_recipe(tmp_path, model, "stages = [[0, 2], [2, 4]]")
    a = build(r, tmp_path / "s1")
    b = build(r, tmp_path / "s2")
    assert a.id == b.id
    for pa, pb in zip(a.stage_paths, b.stage_paths):
        assert pa.read_bytes() == pb.read_bytes()
    assert (a.root / MANIFEST_NAME).read_bytes() == (b.root / MANIFEST_NAME).read_bytes()
    raw = (a.root / MANIFEST_NAME).read_text()
    assert str(tmp_path) not in raw  # no absolute paths from the build machine
    man = json.loads(raw)
    assert man["recipe"]["text"] == r.read_text() and man["stages"][1]["boundary_in"]["dtype"] == "f32"


def test_find_or_build_finds_the_recipes_bundle_again_and_builds_only_what_is_missing(tmp_path, monkeypatch):
    """What the gate and the benchmarks share: the bundle of a recipe is found in the store by the recipe's
    blake3 (no second build); a foreign or half-written folder of the same name is skipped; an edited recipe
    is built anew beside it."""
    from dgr.toolchain.bundle import builder, find_or_build

    model = synth("qwen3", 4, 64, 11, tmp_path / "m.gguf")
    r = write_recipe(tmp_path, model, "stages = [[0, 2], [2, 4]]")
    store = tmp_path / "store"
    (store / "t-half").mkdir(parents=True)
    (store / "t-half" / MANIFEST_NAME).write_text("{")           # half-written: not a match, not an error
    a = find_or_build(r, store)
    built: list[Path] = []
    monkeypatch.setattr(builder, "build", lambda *a, **k: built.append(a[0]) or pytest.fail("built again"))
    assert find_or_build(r, store).root == a.root and built == []
    monkeypatch.undo()
    r2 = write_recipe(tmp_path, model, "stages = [[0, 1], [1, 4]]")
    b = find_or_build(r2, store)
    assert b.root != a.root and b.manifest.recipe.blake3 != a.manifest.recipe.blake3 and a.root.is_dir()


def test_smollm2_build_twice_same_id(tmp_path, smollm2_gguf):
    r = REPO / "recipes" / "smollm2-135m-planned" / "recipe.toml"
    a, b = build(r, tmp_path / "s1"), build(r, tmp_path / "s2")
    assert a.id == b.id and a.root.name == b.root.name
    assert [p.read_bytes() == q.read_bytes() for p, q in zip(a.stage_paths, b.stage_paths)] == [True] * 3
    # the planned placement fits each worker's memory
    mem = [64 * 2**20, 40 * 2**20, 48 * 2**20]
    assert all(s.weight_bytes <= m for s, m in zip(a.manifest.stages, mem))
    assert a.manifest.stages[1].boundary_in.dtype == "f16"


def test_quantization_rules(tmp_path):
    model = synth("llama", 2, 64, 2, tmp_path / "m.gguf")
    extra = '[quantization]\nrules = [{ pattern = "blk.*.ffn_[gud]*.weight", type = "Q8_0" }, ' \
            '{ pattern = "blk.*.attn_[qk].weight", type = "F16" }]'
    b = build(write_recipe(tmp_path, model, "stages = [[0, 1], [1, 2]]", extra=extra), tmp_path / "store")
    src = gguf.GGUFReader(model)
    srcs = {t.name: t for t in src.tensors}
    for p in b.stage_paths:
        for t in gguf.GGUFReader(p).tensors:
            f = np.asarray(srcs[t.name].data, dtype=np.float32)
            if ".ffn_" in t.name and "norm" not in t.name:
                assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
                want = gguf.quants.quantize(f.reshape(-1, f.shape[-1]), gguf.GGMLQuantizationType.Q8_0)
                assert bytes(t.data) == want.tobytes()
            elif t.name.endswith(("attn_q.weight", "attn_k.weight")):
                assert t.tensor_type == gguf.GGMLQuantizationType.F16
                assert bytes(t.data) == f.astype(np.float16).tobytes()
            else:
                assert t.tensor_type == srcs[t.name].tensor_type and bytes(t.data) == bytes(srcs[t.name].data)


def _err(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0, err
    return err


def test_recipe_errors_say_what_to_fix(tmp_path, capsys):
    model = synth("llama", 4, 64, 0, tmp_path / "m.gguf")
    store = str(tmp_path / "store")

    def err_for(placement: str, **kw) -> str:
        r = write_recipe(tmp_path, model, placement, **kw)
        return _err(capsys, ["recipe", "build", str(r), "--store", store, "-q"])

    e = err_for("stages = [[0, 3], [2, 4]]")
    assert "placement.stages" in e and "overlaps" in e
    e = err_for("stages = [[0, 1], [2, 4]]")
    assert "layers [1, 2) in no stage" in e
    e = err_for("stages = [[0, 2], [2, 6]]")
    assert "past the model's last layer" in e and "4 layers" in e
    e = err_for("stages = [[0, 2]]")
    assert "layers [2, 4) are in no stage" in e
    e = err_for("stages = [[0, 4]]", extra='[quantization]\nrules = [{ pattern = "*", type = "Q9_Z" }]')
    assert "quantization.rules.0.type" in e and "unknown GGML type 'Q9_Z'" in e
    e = err_for("stages = [[0, 4]]", extra='[quantization]\nrules = [{ pattern = "blk.*.ffn_up.weight", type = "Q4_K" }]')
    assert "needs the pinned llama.cpp quantizer" in e and "blk.0.ffn_up.weight" in e
    e = err_for("stages = [[0, 4]]", blake="0" * 64)
    assert "blake3 mismatch" in e and file_blake3(model) in e
    e = err_for("stages = [[0, 4]]", extra='colour = "blue"')
    assert "colour: unknown field" in e
    e = err_for('workers = [{ name = "a", memory = "10KiB" }]')
    assert "does not fit" in e
    r = write_recipe(tmp_path, model, "stages = [[0, 4]]")
    e = _err(capsys, ["recipe", "build", str(r), "--store", "/home/someone/models"])
    assert "under /home" in e and "mounted" in e
    assert not list((tmp_path / "store").glob("t-*")), "a failed build leaves no bundle behind"


def test_recipe_new_scaffolds_a_buildable_recipe(tmp_path, capsys):
    model = synth("llama", 6, 32, 0, tmp_path / "m.gguf")
    assert main(["recipe", "new", "--name", "my-split", "--from-model", str(model), "--set", "n_stages=3",
                 "-o", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "my-split" / "recipe.toml"
    assert "stages = [[0, 2], [2, 4], [4, 6]]" in path.read_text()
    assert main(["recipe", "build", str(path.parent), "--store", str(tmp_path / "store"), "-q"]) == 0
    b = load_bundle(next((tmp_path / "store").glob("my-split-*")))
    assert len(b.manifest.stages) == 3


def test_recipe_template_offers_dgrs_own_choices():
    """The template's menus are dgr's tables (cookiecutter.json cannot import them), not second copies."""
    from dgr.core.constants import LANES
    from dgr.core.contract import DEFAULT_WIRE_DTYPE, WIRE_DTYPES

    ctx = json.loads((REPO / "tools/dgr/toolchain/templates/recipe/cookiecutter.json").read_text())
    assert ctx["boundary_dtype"] == list(WIRE_DTYPES) and ctx["boundary_dtype"][0] == DEFAULT_WIRE_DTYPE
    assert ctx["lane"] == list(LANES)


def test_load_bundle_rejects_edited_manifest(tmp_path):
    model = synth("llama", 2, 32, 0, tmp_path / "m.gguf")
    b = build(write_recipe(tmp_path, model, "stages = [[0, 1], [1, 2]]"), tmp_path / "store")
    assert load_bundle(b.root).id == b.id
    assert [p.name for p in b.stage_paths] == ["stage-00-of-02.gguf", "stage-01-of-02.gguf"]
    other = tmp_path / "copy"
    shutil.copytree(b.root, other)
    raw = json.loads((other / MANIFEST_NAME).read_text())
    (other / MANIFEST_NAME).write_text(json.dumps(raw, indent=1))
    from dgr.core.errors import BundleError

    with pytest.raises(BundleError, match="canonical"):
        load_bundle(other)


def test_build_fails_naming_a_tensor_that_fits_no_stage(tmp_path, capsys):
    p = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(2)
    w.add_embedding_length(8)
    for name in ("token_embd.weight", "blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "mystery_table.weight"):
        w.add_tensor(name, np.zeros((8,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = write_recipe(tmp_path, p, "stages = [[0, 1], [1, 2]]")
    err = _err(capsys, ["recipe", "build", str(r), "--store", str(tmp_path / "store"), "-q"])
    assert "mystery_table.weight" in err and "no layer dgr understands" in err


def test_deepseek4_bundle_carries_mhc_schema_sideband_and_excludes_mtp(tmp_path):
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4

    model = synth_deepseek4(tmp_path / "v4.gguf", layers=4, embd=128, seed=0, hash_layers=3, mtp=True)
    b = build(write_recipe(tmp_path, model, "stages = [[0, 1], [1, 3], [3, 4]]"), tmp_path / "store")
    m = b.manifest
    assert (m.model.n_streams, m.model.n_layer, m.model.n_layer_all, m.model.n_hash_layers) == (4, 4, 5, 3)
    assert m.excluded_tensors and all(t.startswith("blk.4.") for t in m.excluded_tensors)
    s0, s1, s2 = m.stages
    assert s0.boundary_in is None and s0.boundary_out.n_streams == 4 and s0.boundary_out.n_embd == 128
    assert s1.boundary_in.token_ids is True   # starts inside the hash-routed layers
    assert s2.boundary_in.token_ids is False and s2.boundary_out is None
    for s, want in zip(m.stages, (False, True, False)):
        h = read_header(b.root / s.file)
        assert h.get(Keys.BOUNDARY_N_STREAMS) == 4 and h.get(Keys.BOUNDARY_TOKEN_IDS) is want
        assert not any(t.name.startswith("blk.4.") for t in h.tensors)
    last = {t.name for t in read_header(b.stage_paths[-1]).tensors}
    assert {"output_hc_fn.weight", "output_norm.weight", "output.weight"} <= last
    src = read_header(model)
    placed = {t.name for p in b.stage_paths for t in read_header(p).tensors}
    assert placed | set(m.excluded_tensors) == {t.name for t in src.tensors}


@pytest.mark.slow
def test_build_memory_stays_bounded(tmp_path):
    """A build copies tensor data in pieces: peak memory grows far less than the model's size."""
    import subprocess
    import sys

    model = synth("llama", 8, 1024, 0, tmp_path / "big.gguf", dtype="f16")
    size = model.stat().st_size
    assert size > 140 * 2**20
    r = write_recipe(tmp_path, model, "stages = [[0, 3], [3, 8]]", chunk=8 * 2**20)
    code = f"""
import resource
from dgr.toolchain.bundle import build
from dgr.core.hashing import file_blake3
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
build({str(r)!r}, {str(tmp_path / 'store')!r})
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after = (int(x) * 1024 for x in out.split())
    assert after - before < 48 * 2**20 < size / 3, (before, after, size)


def test_mtp_on_a_model_without_an_mtp_block_is_refused(tmp_path, capsys):
    model = synth("llama", 2, 32, 0, tmp_path / "m.gguf")
    r = tmp_path / "mtp.toml"
    r.write_text(f'name = "mtp"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                 '[placement]\nstages = [[0, 2]]\n[bundle]\ninclude_mtp = true\n')
    err = _err(capsys, ["recipe", "build", str(r), "--store", str(tmp_path / "store")])
    assert "bundle.include_mtp is on, but llama here has no MTP block" in err and "set include_mtp false" in err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())
