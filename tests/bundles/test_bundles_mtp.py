"""Bundles with MTP (issue 22, item 2): `bundle.include_mtp = true` puts the MTP block and the copy of the
token embedding it reads on the last stage only, the planner and `dgr deploy plan` count those bytes there,
the last stage file says `dgr.mtp`, the engine loads it and the split stays exact against the whole model,
and alpha certification refuses it by name. Without it the block is left out, as before."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dgr.core.constants import Keys
from dgr.gguf.model import model_info, read_header, tensor_nbytes
from dgr.toolchain.bundle import build, make_plan
from dgr.toolchain.recipe import load_recipe
from dgr.toolchain.synth.deepseek4 import synth_deepseek4

from support.engine import b3

LAYERS = 4  # + the MTP block: blk.4


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    return synth_deepseek4(tmp_path_factory.mktemp("v4mtp") / "v4.gguf", layers=LAYERS, hash_layers=3)


def _recipe(root: Path, src: Path, ranges, mtp: bool, name: str = "v4mtp") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    pairs = ", ".join(f"[{a}, {b}]" for a, b in ranges)
    r = root / f"{name}.toml"
    r.write_text(f'name = "{name}"\n\n[source]\nuri = "{src}"\nblake3 = "{b3(src)}"\n\n'
                 f"[placement]\nstages = [{pairs}]\n\n[bundle]\ninclude_mtp = {'true' if mtp else 'false'}\n")
    return r


def _mtp_names(src: Path) -> set[str]:
    return {t.name for t in read_header(src).tensors if t.name.startswith(f"blk.{LAYERS}.")}


def test_the_last_stage_carries_the_mtp_block_and_the_embedding_copy(v4, tmp_path):
    mtp = _mtp_names(v4)
    assert mtp, "the synthetic V4 has an MTP block"
    bp = make_plan(load_recipe(_recipe(tmp_path, v4, [(0, 2), (2, 4)], mtp=True)))
    names = [{t.name for t, _ in sp.tensors} for sp in bp.stages]
    assert bp.excluded == []
    assert mtp <= names[-1] and not mtp & names[0]
    # the block reads each position's token: the last stage gets its own copy of the (untied) embedding
    assert not model_info(v4).tied_embeddings
    assert "token_embd.weight" in names[0] and "token_embd.weight" in names[-1]

    off = make_plan(load_recipe(_recipe(tmp_path / "off", v4, [(0, 2), (2, 4)], mtp=False)))
    off_names = [{t.name for t, _ in sp.tensors} for sp in off.stages]
    assert set(off.excluded) == mtp and not any(mtp & n for n in off_names)
    assert "token_embd.weight" not in off_names[-1]
    # exactly the block and the copy are added, on the last stage only
    extra = sum(tensor_nbytes(t.shape, t.type) for t in read_header(v4).tensors
                if t.name in mtp or t.name == "token_embd.weight")
    assert bp.stages[0].weight_bytes == off.stages[0].weight_bytes
    assert bp.stages[-1].weight_bytes - off.stages[-1].weight_bytes == extra


@pytest.mark.engine
def test_an_mtp_bundle_loads_and_splits_exactly(v4, tmp_path, engine_lib):
    import numpy as np

    from dgr.runtime.engine import Engine
    from dgr.toolchain.parity import Schedule

    from support.engine import baseline_and_split

    # cut past the 3 hash layers: the last stage needs token ids for its MTP block alone
    bundle = build(_recipe(tmp_path, v4, [(0, 3), (3, 4)], mtp=True), tmp_path / "store")
    assert bundle.manifest.excluded_tensors == []
    kvs = [read_header(p).kvs for p in bundle.stage_paths]
    assert Keys.MTP not in kvs[0] and kvs[-1][Keys.MTP].value is True
    # the MTP block reads every position's token: the seam into the last stage carries the sideband
    st = bundle.manifest.stages
    assert st[0].boundary_out.token_ids and st[1].boundary_in.token_ids and kvs[-1][Keys.BOUNDARY_TOKEN_IDS].value
    assert _mtp_names(v4) <= {t.name for t in read_header(bundle.stage_paths[-1]).tensors}
    with Engine.open(bundle.stage_paths[-1], n_ctx=64, max_sessions=1, lib=engine_lib) as e:
        info = e.describe()
    assert (info.layer_begin, info.layer_end, info.n_layer) == (3, 4, LAYERS) and info.needs_token_ids
    rng = np.random.default_rng(11)
    sched = Schedule(prompts=[rng.integers(0, 256, size=n).tolist() for n in (140, 37)], steps=3, n_ubatch=32)
    base, run, c = baseline_and_split(v4, bundle.stage_paths, sched, engine_lib)
    assert c.exact, f"max abs {c.max_abs_diff}, first diverging {c.first_diverging}"
    assert run.generated == base.generated


def test_deploy_plan_counts_the_mtp_bytes_on_the_last_stage(v4, tmp_path):
    """A host with room for the last stage without MTP but not with it: `dgr deploy plan` says so for the
    MTP bundle only."""
    from support.deploy import dgr

    on, off = (make_plan(load_recipe(_recipe(tmp_path / k, v4, [(0, 2), (2, 4)], mtp=m)))
               for k, m in (("on", True), ("off", False)))
    room = (on.stages[-1].weight_bytes + off.stages[-1].weight_bytes) // 2
    problems = {}
    for k in ("on", "off"):
        dep = tmp_path / f"{k}.toml"
        dep.write_text(
            f'name = "mtp-{k}"\n\n[bundle]\nrecipe = "{tmp_path / k / "v4mtp.toml"}"\n\n'
            f'[[hosts]]\nname = "a"\naddress = "127.0.0.1"\nstore = "{tmp_path / "store"}"\n'
            'capacity = { memory = "1GiB", workers = 2 }\n\n'
            f'[[hosts]]\nname = "b"\naddress = "127.0.0.1"\nstore = "{tmp_path / "store"}"\n'
            f'capacity = {{ memory = {room}, workers = 2 }}\n\n'
            '[[stages]]\nlayers = [0, 2]\nhost = "a"\nport = 7600\n\n'
            '[[stages]]\nlayers = [2, 4]\nhost = "b"\nport = 7610\n')
        proc = dgr("deploy", "plan", str(dep), "--json")
        problems[k] = json.loads(proc.stdout)["problems"] if proc.stdout.strip() else [proc.stderr]
    assert problems["off"] == []
    assert any(f"weights ({on.stages[-1].weight_bytes} bytes)" in p and "capacity.memory" in p
               for p in problems["on"]), problems["on"]


def test_alpha_certification_refuses_an_mtp_bundle_by_name(v4, tmp_path, capsys):
    from dgr.cli.main import main

    rc = main(["certify", "--recipe", str(_recipe(tmp_path, v4, [(0, 2), (2, 4)], mtp=True)),
               "--store", str(tmp_path / "store"), "--out", str(tmp_path / "cert.json")])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(r"MTP is on \(bundle\.include_mtp\): alpha certifies bundles with MTP off", err)
    assert not (tmp_path / "store").exists() and not (tmp_path / "cert.json").exists()


@pytest.mark.engine
def test_dgr_workers_serve_an_mtp_bundle_with_the_plain_bundles_text(v4, tmp_path, engine_lib):
    """In worker processes: the MTP last stage opens (its manifest and its engine agree that it takes the
    token-id sideband), the ids reach it over the wire, and greedy text equals the bundle without MTP."""
    from dgr.app.local import LocalRoute
    from dgr.runtime.wire.client import RouteClient

    texts = {}
    for mtp in (True, False):
        b = build(_recipe(tmp_path / str(mtp), v4, [(0, 3), (3, 4)], mtp=mtp), tmp_path / f"store-{mtp}")
        stages = [["--bundle", str(b.root), "--stage", str(i), "--threads", "1", "--n-ctx", "256"] for i in range(2)]
        with LocalRoute(stages, env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300) as route:
            with RouteClient(route.addresses) as rc:
                assert rc.hops[-1].schema_in.token_ids is mtp
                # every V4 stage rolls back its last step (--draft-max, default 8), and keeps no prefixes: a
                # kept prefix is not its last step (and on the MTP stage a saved state lacks the MTP cache)
                assert all(h.can_roll_back and h.n_draft_max == 8 for h in rc.hops)
                assert rc.hops[-1].has_mtp is mtp
                assert all(h.prefix_cache_capacity_bytes == 0 for h in rc.hops)
                texts[mtp] = rc.run(list(range(1, 40)), max_new_tokens=12, stop_token_ids=[]).token_ids
    assert texts[True] == texts[False] and len(texts[True]) == 12
