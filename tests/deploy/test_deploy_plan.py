"""`dgr deploy plan`: what goes where, what is missing, the routes; one clear error per problem.

Real files and real bundles (a tiny synthetic llama built in the test, SmolLM2's recipes); the CLI
runs as a user runs it.
"""

from __future__ import annotations

import json

import pytest

from dgr.app.deploy.plan import make_plan
from dgr.app.deploy.spec import DeployError, load_deployment

from support.deploy import REPO, dgr, errors, tiny_bundle, write


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"))


def _by_id(tiny, store, stages: str, hosts: str = "", extra: str = "") -> str:
    hosts = hosts or f'[[hosts]]\nname = "a"\naddress = "127.0.0.1"\nstore = "{store}"\n'
    return (f'name = "t"\n{extra}\n[bundle]\nid = "{tiny.id}"\nsource = "{tiny.root}"\n\n{hosts}\n{stages}')


def test_the_committed_local_file_plans_three_stages_with_a_middle_replica(smollm2_gguf):
    proc = dgr("deploy", "plan", "deploy/local-3stage.toml", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert [(w["name"], w["stage"], w["layers"]) for w in p["workers"]] == [
        ("s0-r0", 0, [0, 10]), ("s1-r0", 1, [10, 20]), ("s1-r1", 1, [10, 20]), ("s2-r0", 2, [20, 30])]
    assert all(w["local"] for w in p["workers"]) and p["problems"] == []
    from dgr.core.paths import workspace

    assert {w["store"] for w in p["workers"]} == {str((workspace() / "store").resolve())}, "{workspace}/store"
    assert p["routes"] == ["127.0.0.1:7100,127.0.0.1:7110|127.0.0.1:7111,127.0.0.1:7120"]
    text = dgr("deploy", "plan", "deploy/local-3stage.toml")
    assert text.returncode == 0 and 'dgr generate --route "127.0.0.1:7100,127.0.0.1:7110|' in text.stdout
    print(text.stdout)


def test_every_problem_gets_one_error_and_a_non_zero_exit(tmp_path):
    # a missing bundle, an unknown host, an overlapping range and a host over its worker capacity
    f = write(tmp_path / "bad.toml", f"""
name = "bad"
[bundle]
id = "{'ab' * 32}"
source = "{tmp_path / 'nowhere'}"

[[hosts]]
name = "a"
address = "127.0.0.1"
store = "{tmp_path / 'store'}"
capacity = {{ workers = 2 }}

[[stages]]
layers = [0, 3]
host = "a"
replicas = 3

[[stages]]
layers = [2, 4]
host = "b"
""")
    proc = dgr("deploy", "plan", str(f))
    assert proc.returncode == 1
    errs = errors(proc)
    print("\n".join(errs))
    assert len(errs) == 4, errs
    assert sum("no bundle with this id" in e for e in errs) == 1
    assert sum("host 'b' is not one of the file's hosts (a)" in e for e in errs) == 1
    assert sum("stages[1] = [2, 4) overlaps stages[0] = [0, 3)" in e for e in errs) == 1
    assert sum("host a: over capacity: 3 workers placed on it, its capacity.workers is 2" in e for e in errs) == 1
    assert "4 problem(s)" in proc.stderr and "nothing was started" in proc.stderr


def test_ranges_must_be_the_bundles_and_cover_it_and_memory_is_checked(tiny, tmp_path):
    stages = '[[stages]]\nlayers = [0, 2]\nhost = "a"\n\n[[stages]]\nlayers = [2, 5]\nhost = "a"\n'
    proc = dgr("deploy", "plan", str(write(tmp_path / "r.toml", _by_id(tiny, tmp_path / "s", stages))))
    errs = errors(proc)
    assert proc.returncode == 1 and len(errs) == 1, errs
    assert "stages[1] = [2, 5) is not a stage of bundle" in errs[0] and "[0, 2) [2, 4) [4, 6)" in errs[0]
    stages = '[[stages]]\nlayers = [0, 2]\nhost = "a"\n\n[[stages]]\nlayers = [2, 4]\nhost = "a"\n'
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "n.toml", _by_id(tiny, tmp_path / "s", stages)))))
    assert errs == [f"stage 2 [4, 6) of bundle {tiny.id[:12]} runs nowhere: add a [[stages]] entry with "
                    "layers = [4, 6]"]
    stages += '\n[[stages]]\nlayers = [4, 6]\nhost = "a"\n'
    hosts = (f'[[hosts]]\nname = "a"\naddress = "127.0.0.1"\nstore = "{tmp_path / "s"}"\n'
             'capacity = { memory = "64KiB" }\n')
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "m.toml", _by_id(tiny, tmp_path / "s", stages, hosts)))))
    assert len(errs) == 1 and errs[0].startswith("host a: over capacity: its 3 workers hold") and "64.0 KiB" not in errs[0]
    assert "capacity.memory is 0.1 MiB" in errs[0] or "capacity.memory is" in errs[0]


def test_a_bundle_not_in_the_store_is_listed_as_missing_and_up_would_copy_it(tiny, tmp_path):
    stages = "".join(f'[[stages]]\nlayers = [{b}, {e}]\nhost = "a"\nport = {7300 + 10 * i}\n\n'
                     for i, (b, e) in enumerate([(0, 2), (2, 4), (4, 6)]))
    f = write(tmp_path / "ok.toml", _by_id(tiny, tmp_path / "store", stages))
    proc = dgr("deploy", "plan", str(f))
    assert proc.returncode == 0, proc.stderr
    assert "missing:" in proc.stdout and f"is not provisioned in {tmp_path / 'store'}" in proc.stdout
    assert f"copy it from {tiny.root}" in proc.stdout
    assert "route: 127.0.0.1:7300,127.0.0.1:7310,127.0.0.1:7320" in proc.stdout


def test_absent_certificates_and_plaintext_off_loopback_are_named(tiny, tmp_path):
    stages = "".join(f'[[stages]]\nlayers = [{b}, {e}]\nhost = "far"\nport = {7400 + b}\n\n' for b, e in [(0, 2), (2, 4), (4, 6)])
    hosts = f'[[hosts]]\nname = "far"\naddress = "192.0.2.7"\nstore = "{tmp_path / "s"}"\n'
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "p.toml", _by_id(tiny, tmp_path / "s", stages, hosts)))))
    assert errs == ["host far: workers would listen on 192.0.2.7 in plaintext; add [tls] (a `dgr certs init` "
                    "folder) or set worker.insecure = true for a trusted network"], errs
    tls = f'[tls]\ndir = "{tmp_path / "certs"}"\n'
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "t.toml", _by_id(tiny, tmp_path / "s", stages, hosts, tls)))))
    assert errs[0].startswith(f"tls.dir {tmp_path / 'certs'}: certificates absent: no ca.pem; make the CA with")
    assert [e.split(":")[0] for e in errs[1:]] == ["worker s0-r0", "worker s1-r0", "worker s2-r0"]
    assert f"dgr certs issue {tmp_path / 'certs'} s0-r0 --host 192.0.2.7" in errs[1]


def test_hosts_of_other_numerics_are_a_problem_unless_the_file_allows_a_mix(tiny, tmp_path):
    """docs/numerics.md: a lane and a CPU variant decide the bits a worker computes; one route needs one of each."""
    stages = "".join(f'[[stages]]\nlayers = [{b}, {e}]\nhost = "{h}"\nport = {7500 + b}\n\n'
                     for h, (b, e) in zip("aab", [(0, 2), (2, 4), (4, 6)]))
    hosts = "".join(f'[[hosts]]\nname = "{n}"\naddress = "127.0.0.1"\nstore = "{tmp_path / "s"}"\n{extra}\n'
                    for n, extra in (("a", ""), ("b", 'cpu_variant = "native"')))
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "mix.toml", _by_id(tiny, tmp_path / "s", stages, hosts)))))
    assert errs == ["the workers would compute different numerics: cpu/x86-64-v3: s0-r0 on a, s1-r0 on a; "
                    "cpu/native: s2-r0 on b: their results differ, so the route would reproduce no whole-model run "
                    "(clients refuse it). Give every host one lane and cpu_variant, or set allow_mixed_numerics = "
                    "true (results are then labelled not exact)"], errs
    allowed = _by_id(tiny, tmp_path / "s", stages, hosts, "allow_mixed_numerics = true")
    assert dgr("deploy", "plan", str(write(tmp_path / "ok.toml", allowed))).returncode == 0
    bad = hosts.replace('"native"', '"avx9000"')
    proc = dgr("deploy", "plan", str(write(tmp_path / "bad.toml", _by_id(tiny, tmp_path / "s", stages, bad))))
    assert proc.returncode != 0 and "cpu_variant 'avx9000' is not one of ['x86-64-v3', 'native']" in proc.stderr


def test_a_malformed_file_names_the_field(tmp_path):
    f = write(tmp_path / "x.toml", f'name = "x"\n[bundle]\nrecipe = "r"\n[[hosts]]\nname = "a"\naddress = "127.0.0.1"\n'
              f'store = "{tmp_path}"\nlane = "tpu"\n')
    proc = dgr("deploy", "plan", str(f))
    assert proc.returncode == 2
    assert "invalid deployment file: hosts.0.lane: lane 'tpu' is not one of" in proc.stderr
    with pytest.raises(DeployError, match="give exactly one of bundle.recipe"):
        write(tmp_path / "y.toml", 'name = "y"\n[bundle]\n[[hosts]]\nname = "a"\naddress = "h"\nstore = "/srv"\n')
        load_deployment(tmp_path / "y.toml")


def test_a_store_under_home_is_refused(tiny, tmp_path):
    stages = '[[stages]]\nlayers = [0, 6]\nhost = "a"\n'
    hosts = '[[hosts]]\nname = "a"\naddress = "127.0.0.1"\nstore = "/home/someone/models"\n'
    errs = errors(dgr("deploy", "plan", str(write(tmp_path / "h.toml", _by_id(tiny, "/x", stages, hosts)))))
    assert any("is under /home" in e for e in errs), errs


def test_without_stages_the_planner_places_them_by_the_hosts_memory(smollm2_gguf, tmp_path):
    recipe = REPO / "recipes" / "smollm2-135m-planned"
    hosts = "".join(f'[[hosts]]\nname = "{n}"\naddress = "127.0.0.1"\nstore = "{tmp_path / n}"\n'
                    f'capacity = {{ memory = "{m}", speed = {s} }}\n\n'
                    for n, m, s in [("desktop-gpu", "64MiB", 2.0), ("laptop", "40MiB", 1.0), ("mini-pc", "48MiB", 1.0)])
    f = write(tmp_path / "planned.toml", f'name = "planned"\n[bundle]\nrecipe = "{recipe}"\n\n{hosts}')
    plan = make_plan(f)
    assert plan.problems == [], plan.problems
    from dgr.toolchain.bundle import make_plan as recipe_plan
    from dgr.toolchain.recipe import load_recipe

    want = [(sp.begin, sp.end) for sp in recipe_plan(load_recipe(recipe / "recipe.toml")).stages]
    got = [(w.host.name, w.layers) for w in plan.workers]
    assert got == [(h, r) for h, r in zip(["desktop-gpu", "laptop", "mini-pc"], want)]
    # other speeds place the layers elsewhere than the bundle has them: named, with the fix
    g = write(tmp_path / "other.toml", f.read_text().replace("speed = 2.0", "speed = 1.0"))
    probs = make_plan(g).problems
    assert len(probs) == 1 and "the planner places layers as" in probs[0] and "list [[stages]] explicitly" in probs[0]
