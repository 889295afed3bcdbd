"""A new operator's first hour with their own model (issue 24, part 1): recipes that cannot build a broken bundle.

Each test is a defect a new user hit: a scaffold example rule that quantized 1-D norms (the bundle
verified, then `dgr parity` aborted inside llama.cpp), a type the engine cannot run refused without
naming the rule, `dgr recipe new` without `--stages`, with silent unknown `--set` keys, a traceback on
an existing folder, an even split that ignores the output head, and `--expect-id` refusing the short
id every listing shows. Bundles are built by the real builder from tiny generated models and run on
the real engine in a child process (an abort inside llama.cpp must fail the test, not end the run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from dgr.cli.main import main
from dgr.core.hashing import file_blake3
from dgr.gguf.model import model_info, read_header
from dgr.toolchain.bundle import build, load_bundle, never_quantized, weights
from dgr.toolchain.bundle.quantize import _NEVER_NAMES, _NEVER_PARTS, _NEVER_PARTS_OF_ARCH, n_dims
from dgr.toolchain.planner import balanced
from dgr.toolchain.synth.generic import synth
from dgr.toolchain.templates import template_variables

from support.paths import REPO

Q = gguf.GGMLQuantizationType
# The scaffold's example rule line, commented out as `dgr recipe new` writes it.
EXAMPLE_RULES = re.compile(r"^# (rules = \[.*\])$", re.M)


def new_recipe(capsys, *args: str) -> Path:
    assert main(["recipe", "new", *args]) == 0
    return Path(capsys.readouterr().out.strip().splitlines()[-1])


def failing(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def run_dgr(*args: str, lib: Path) -> subprocess.CompletedProcess:
    """`dgr ARGS` in a child process (llama.cpp aborts the process on what it cannot run)."""
    env = dict(os.environ, DGR_ENGINE_LIB=str(lib), GGML_NO_BACKTRACE="1")
    return subprocess.run([sys.executable, "-m", "dgr", *args], capture_output=True, text=True, env=env, timeout=300)


def parity_against_one_stage(recipe: Path, store: Path, lib: Path) -> subprocess.CompletedProcess:
    """Build `recipe`, and the same recipe as one stage (the whole model with the same quantized bytes);
    `dgr baseline` the whole, `dgr parity` the split against it."""
    split = build(recipe, store)
    n_layer = split.manifest.model.n_layer
    whole_recipe = recipe.with_name("whole.toml")
    text = re.sub(r"^stages = .*$", f"stages = [[0, {n_layer}]]", recipe.read_text(), flags=re.M)
    whole_recipe.write_text(re.sub(r'^name = ".*"$', 'name = "whole"', text, flags=re.M))
    whole = build(whole_recipe, store)
    base = store / "whole.npz"
    r = run_dgr("baseline", str(whole.stage_paths[0]), "--steps", "3", "--threads", "1", "-o", str(base), lib=lib)
    if r.returncode != 0:
        return r
    return run_dgr("parity", str(split.root), "--baseline", str(base), "--threads", "1", lib=lib)


# ------------------------------------------------------------------ quantization rules


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "gemma3"])
def test_scaffold_example_rules_uncommented_build_a_bundle_that_runs(tmp_path, capsys, engine_lib, arch):
    """The scaffold's commented rules, uncommented, build a bundle that `dgr parity` passes (it aborted with
    `binary_op: unsupported types` when the FFN rule quantized the 1-D ffn_norm tensors)."""
    model = synth(arch, 4, 64, 5, tmp_path / "m.gguf")
    path = new_recipe(capsys, "--name", "mine", "--from-model", str(model), "--stages", "2", "-o", str(tmp_path))
    text = path.read_text()
    assert len(EXAMPLE_RULES.findall(text)) == 1
    path.write_text(EXAMPLE_RULES.sub(r"\1", text))
    r = parity_against_one_stage(path, tmp_path / "store", engine_lib)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parity: EXACT" in r.stdout
    # the rules did quantize (matrices to Q8_0), and left alone what llama.cpp never quantizes
    b = load_bundle(next((tmp_path / "store").glob("mine-*")))
    types = {t.name: t.type for p in b.stage_paths for t in read_header(p).tensors}
    src = {t.name: t for t in read_header(model).tensors}
    converted = 0
    for name, t in src.items():
        if never_quantized(name, t.shape, arch, t.type) or not re.fullmatch(r"blk\.\d+\.(ffn|attn)_.*\.weight", name):
            assert types[name] == t.type, name
        else:
            assert types[name] == Q.Q8_0, name
            converted += 1
    assert converted >= 4 * 5  # per layer at least the three FFN matrices (or expert stacks), Q and output


def test_rules_do_not_apply_to_what_llama_cpp_never_quantizes_and_plan_says_so(tmp_path, capsys):
    """`blk.*.ffn_*.weight` also matches the 1-D ffn_norm and (MoE) the 2-D expert router: both keep their
    type; `dgr recipe plan` counts them as kept; the stage files say the same."""
    model = synth("qwen3moe", 2, 64, 1, tmp_path / "m.gguf")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                      '[quantization]\nrules = [{ pattern = "blk.*.ffn_*.weight", type = "Q8_0" }, '
                      '{ pattern = "blk.*.ffn_up_exps.weight", type = "Q4_0" }]\n'
                      '[placement]\nstages = [[0, 1], [1, 2]]\n')
    assert main(["recipe", "plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    src = read_header(model)
    ffn = [t for t in src.tensors if re.fullmatch(r"blk\.\d+\.ffn_.*\.weight", t.name)]
    kept = [t for t in ffn if t.name.endswith(("ffn_norm.weight", "ffn_gate_inp.weight"))]
    assert len(kept) == 4 and all(t.type == Q.F32 for t in kept)
    assert (f"rules[0] blk.*.ffn_*.weight: {len(ffn) - len(kept)} tensors -> Q8_0; "
            f"kept: {len(kept)} tensors llama.cpp never quantizes") in out
    assert "blk.0.ffn_norm.weight" in out and "an expert router: blk.0.ffn_gate_inp.weight" in out
    assert "rules[1] blk.*.ffn_up_exps.weight: applies to no tensor" in out  # the first rule took them all
    b = build(recipe, tmp_path / "store")
    got = {t.name: t.type for p in b.stage_paths for t in read_header(p).tensors}
    for t in ffn:
        assert got[t.name] == (Q.F32 if t in kept else Q.Q8_0), t.name


@pytest.mark.parametrize("rule,tensor,what", [
    # rows of 128 values (n_ff) against TQ2_0's block of 256: llama.cpp cannot load the tensor
    ('{ pattern = "blk.*.ffn_down.weight", type = "TQ2_0" }', "blk.0.ffn_down.weight", "not a multiple of TQ2_0's block of 256"),
    # a K-quant: the gguf package cannot make it
    ('{ pattern = "blk.*.ffn_up.weight", type = "Q4_K" }', "blk.0.ffn_up.weight", "needs the pinned llama.cpp quantizer"),
])
def test_a_type_the_engine_cannot_run_is_refused_at_plan_and_build_naming_tensor_type_and_rule(
        tmp_path, capsys, rule, tensor, what):
    model = synth("llama", 2, 64, 2, tmp_path / "m.gguf")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                      f'[quantization]\nrules = [{{ pattern = "blk.*.attn_q.weight", type = "F16" }}, {rule}]\n'
                      '[placement]\nstages = [[0, 1], [1, 2]]\n')
    pattern = re.search(r'pattern = "([^"]+)"', rule).group(1)
    for argv in (["recipe", "plan", str(recipe)], ["recipe", "build", str(recipe), "--store", str(tmp_path / "s"), "-q"]):
        err = failing(capsys, argv)
        assert str(recipe) in err and repr(tensor) in err and what in err, err
        assert f'quantization.rules[1] {{ pattern = "{pattern}"' in err, err  # the rule, as the file writes it
        assert "keep" in err  # what to do
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("r-*"))


def test_a_default_type_that_does_not_fit_a_tensor_names_the_default_and_a_keep_rule(tmp_path, capsys):
    """A TQ1_0 default on a 64-wide model: the message names quantization.default and a rule to keep that
    tensor in every layer."""
    model = synth("llama", 2, 64, 2, tmp_path / "m.gguf")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                      '[quantization]\ndefault = "TQ1_0"\n[placement]\nstages = [[0, 2]]\n')
    err = failing(capsys, ["recipe", "plan", str(recipe)])
    assert 'quantization.default = "TQ1_0"' in err and "'token_embd.weight'" in err
    assert '{ pattern = "token_embd.weight", type = "keep" }' in err


def test_never_quantized_follows_llama_cpp():
    """The transcription of llama.cpp's tensor_allows_quantization, case by case."""
    assert n_dims((64,)) == 1 and n_dims((64, 1, 1)) == 1 and n_dims((64, 8)) == 2 and n_dims((64, 1, 4)) == 3
    assert never_quantized("blk.0.ffn_norm.weight", (64,)) == "1-D"
    assert never_quantized("blk.0.time_mix_lerp_x.weight", (64, 1, 1)) == "1-D"  # trailing 1s do not count
    assert never_quantized("blk.0.attn_q_norm.weight", (16, 16)) == "a norm"
    assert never_quantized("blk.0.attn_q.bias", (64, 2)) == "a bias"
    assert never_quantized("blk.0.ssm_a", (16, 64)) == "not a weight"
    assert never_quantized("blk.3.ffn_gate_inp.weight", (64, 8)) == "an expert router"
    assert never_quantized("position_embd.weight", (64, 512)) == "a position table"
    assert never_quantized("token_types.weight", (64, 2)) == "a token-type table"
    assert never_quantized("blk.0.ssm_conv1d.weight", (4, 128)) == "an SSM conv1d kernel"
    assert never_quantized("blk.0.time_mix_w1.weight", (64, 160)) == "an RWKV time-mix table"
    assert never_quantized("blk.0.ffn_gate_tid2eid.weight", (6, 1000), src=Q.I32) == "an integer table (I32)"
    # glm5-next's exclusions are its own: DeepSeek V4's hyper-connection mixers may be quantized
    assert never_quantized("blk.0.hc_attn_fn.weight", (64, 24), "glm5-next") is not None
    assert never_quantized("blk.0.hc_attn_fn.weight", (64, 24), "deepseek4") is None
    for name in ("blk.0.ffn_up.weight", "blk.0.attn_output.weight", "output.weight", "token_embd.weight",
                 "blk.0.ffn_down_exps.weight"):
        assert never_quantized(name, (64, 128, 4)) is None, name


def test_the_exclusions_are_the_pinned_llama_cpps(llama_src):
    """Every exclusion in the pinned src/llama-quant.cpp's tensor_allows_quantization is in dgr's tables (so a
    moved pin that adds one fails here until the tables follow)."""
    text = (llama_src / "src" / "llama-quant.cpp").read_text()
    body = text[text.index("static bool tensor_allows_quantization("):]
    body = body[: body.index("\n}\n")]
    upstream = set(re.findall(r'name\.find\("([^"]+)"\)\s*==\s*std::string::npos', body))
    ours = {p for p, _ in _NEVER_PARTS} | {p for parts in _NEVER_PARTS_OF_ARCH.values() for p, _ in parts}
    assert upstream and upstream == ours
    assert re.findall(r"LLM_TENSOR_(POS_EMBD|TOKEN_TYPES),", body) == ["POS_EMBD", "TOKEN_TYPES"]
    assert set(_NEVER_NAMES) == {"position_embd.weight", "token_types.weight"}
    assert 'if (arch == LLM_ARCH_GLM5_NEXT)' in body and "ggml_n_dims(tensor) < 2" in body
    assert 'name.rfind("weight") == name.size() - 6' in body


# ------------------------------------------------------------------ dgr recipe new


def test_recipe_new_takes_stages_and_writes_a_recipe_that_builds(tmp_path, capsys, monkeypatch):
    """`--stages N`; `--from-model` with a relative path writes a uri the recipe's folder resolves (the
    uri used to be relative to where the command ran)."""
    (tmp_path / "models").mkdir()
    synth("llama", 6, 64, 0, tmp_path / "models" / "m.gguf")
    monkeypatch.chdir(tmp_path)
    path = new_recipe(capsys, "--name", "three", "--from-model", "models/m.gguf", "--stages", "3", "-o", "recipes")
    assert path == tmp_path / "recipes" / "three" / "recipe.toml"
    assert 'uri = "../../models/m.gguf"' in path.read_text()
    assert main(["recipe", "build", str(path.parent), "--store", str(tmp_path / "store"), "-q"]) == 0
    b = load_bundle(next((tmp_path / "store").glob("three-*")))
    assert len(b.manifest.stages) == 3
    # the commented `workers` line replaces `stages`: the planner places the layers on its two workers
    text = path.read_text()
    workers = re.search(r"^# (workers = \[.*\])$", text, re.M)
    path.write_text(re.sub(r"^stages = .*$", workers.group(1), text, flags=re.M))
    assert main(["recipe", "plan", str(path.parent)]) == 0
    assert "2 stages" in capsys.readouterr().out
    # without a model: the stage count splits n_layer evenly, and the recipe says the blake3 is to fill in
    path = new_recipe(capsys, "--name", "blank", "--stages", "4", "--set", "n_layer=8", "-o", "recipes")
    text = path.read_text()
    assert "stages = [[0, 2], [2, 4], [4, 6], [6, 8]]" in text and "b3sum" in text


def test_recipe_new_refuses_unknown_set_keys_listing_the_known(tmp_path, capsys):
    err = failing(capsys, ["recipe", "new", "--name", "x", "--set", "n_stage=3", "-o", str(tmp_path)])
    assert "n_stage" in err and "unknown template variable" in err
    for key in template_variables():
        assert key in err
    err = failing(capsys, ["recipe", "new", "--name", "x", "--set", "lane=tpu", "-o", str(tmp_path)])
    assert "tpu" in err and "cpu, cuda, rocm, vulkan, metal" in err
    err = failing(capsys, ["recipe", "new", "--name", "x", "--stages", "3", "--set", "n_stages=2", "-o", str(tmp_path)])
    assert "disagree" in err
    model = synth("llama", 2, 32, 0, tmp_path / "m.gguf")
    err = failing(capsys, ["recipe", "new", "--name", "x", "--from-model", str(model), "--stages", "3", "-o", str(tmp_path)])
    assert "3 stages but the model has 2 layers" in err
    assert not (tmp_path / "x").exists()


def test_recipe_new_refuses_an_existing_folder_without_a_traceback(tmp_path, capsys):
    path = new_recipe(capsys, "--name", "mine", "-o", str(tmp_path))
    before = path.read_text()
    path.write_text(before + "# my edits\n")
    err = failing(capsys, ["recipe", "new", "--name", "mine", "-o", str(tmp_path)])
    assert str(tmp_path / "mine") in err and "already exists" in err and "--name" in err
    assert path.read_text() == before + "# my edits\n"  # nothing overwritten


def test_every_template_variable_is_documented_in_help_and_docs(capsys):
    variables = template_variables()
    assert {"name", "description", "source_uri", "source_blake3", "provenance_repo", "provenance_revision",
            "n_layer", "n_stages", "boundary_dtype", "lane"} <= set(variables)
    with pytest.raises(SystemExit):
        main(["recipe", "new", "--help"])
    out = capsys.readouterr().out
    assert "--stages N" in out
    docs = (REPO / "docs" / "bundles.md").read_text()
    docs = docs[docs.index("### Template variables"):]
    docs = docs[: docs.index("\n#")]
    for key, (_, about) in variables.items():
        assert about, f"{key}: no description in cookiecutter.json's __prompts__"
        assert re.search(rf"^  {key} ", out, re.M), key
        assert f"| `{key}` |" in docs, f"docs/bundles.md does not document template variable {key}"


def test_scaffold_balances_stages_by_weight_not_layer_count(tmp_path, capsys, smollm2_gguf):
    """SmolLM2-135M: 30 layers of 2.1 MiB, and a tied 28.7 MiB head on the last stage (13 layers' worth).
    Split evenly, the last stage reads 60 MiB a token against 32 MiB; the scaffold takes layers off it."""
    path = new_recipe(capsys, "--name", "smol", "--from-model", str(smollm2_gguf), "--stages", "2", "-o", str(tmp_path))
    w = weights(model_info(smollm2_gguf))
    want = balanced(w.layer_bytes, 2, **w.kwargs())
    ranges = [list(r) for r in want.ranges]
    assert f"stages = {ranges}" in path.read_text()
    (a, cut), (_, n) = want.ranges
    assert n == 30 and cut > 15 + 5  # well past the even split
    even = max(sum(w.layer_bytes[:15]), sum(w.layer_bytes[15:]) + w.output_bytes)
    assert max(want.stage_work) < 0.8 * even
    # the planner's own `workers` placement weighs the same way: two equal workers, the same cut
    recipe = tmp_path / "planned.toml"
    recipe.write_text(f'name = "planned"\n[source]\nuri = "{smollm2_gguf}"\nblake3 = "{file_blake3(smollm2_gguf)}"\n'
                      '[placement]\nworkers = [{ name = "a", memory = "1GiB" }, { name = "b", memory = "1GiB" }]\n')
    assert main(["recipe", "plan", str(recipe)]) == 0
    assert f"stage 1: layers [{cut}, 30)" in capsys.readouterr().out


# ------------------------------------------------------------------ dgr bundle verify --expect-id


def test_verify_expect_id_takes_the_short_id_and_any_prefix(tmp_path, capsys):
    model = synth("llama", 2, 32, 0, tmp_path / "m.gguf")
    recipe = tmp_path / "v.toml"
    recipe.write_text(f'name = "v"\n[source]\nuri = "m.gguf"\nblake3 = "{file_blake3(model)}"\n'
                      '[placement]\nstages = [[0, 1], [1, 2]]\n')
    b = build(recipe, tmp_path / "store")
    for expect in (b.id, b.id[:12], b.id[:8], b.id[:12].upper(), b.root.name):
        assert main(["bundle", "verify", str(b.root), "--expect-id", expect, "-q"]) == 0, expect
        assert f"ok: bundle {b.id}" in capsys.readouterr().out
    other = ("0" if b.id[0] != "0" else "1") + b.id[1:12]
    err = failing(capsys, ["bundle", "verify", str(b.root), "--expect-id", other, "-q"])
    assert b.id in err and other in err and "not the bundle" in err
    err = failing(capsys, ["bundle", "verify", str(b.root), "--expect-id", b.id[:4], "-q"])
    assert "too short" in err and b.id[:12] in err
    err = failing(capsys, ["bundle", "verify", str(b.root), "--expect-id", "not-an-id", "-q"])
    assert "not a bundle id" in err
