"""`dgr deploy render FILE --kubernetes OUT`: every object of deploy/local-3stage.toml's render and of a
12-stage fleet's (two hosts, one of them CUDA, a stage with replicas on both, mutual TLS, a namespace)
validates offline against Kubernetes K8S's schemas (`kubernetes-validate`, strict: an unknown field is
an error) and against what the schemas cannot say (names, selectors, mounts, ports); the render is the
same bytes twice; and the rendered pods run here (a stand-in kubelet, tests/support/kubelet.py: their
command, arguments and environment as rendered, the init container first) form a route, with mutual TLS
from the Secrets `secrets.sh` makes and in plaintext, that generates what a route of the same workers
started the normal way generates, and so does the rendered gateway over it."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import time
from pathlib import Path

import kubernetes_validate as kv
import pytest
import requests
import yaml

from dgr import __version__
from dgr.app.deploy.control import health
from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.tls import TlsConfig

from support.deploy import dgr, lib_env, tiny, tiny_fixed_ports_file, write  # noqa: F401 (module fixtures)
from support.engine import make_bundle, synth_model
from support import lws
from support.kubelet import Kubectl, Pod

K8S = "1.30.0"          # the schemas the objects are checked against: gRPC probes are GA from 1.27
FILE = "deploy/local-3stage.toml"
PREFIX = "/opt/dgr"
PROMPT = "Once upon a time"
_DNS = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _objects(out: Path) -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def _templates(o: dict) -> list[dict]:
    """The pod templates of a workload object (a LeaderWorkerSet's leader and worker templates)."""
    if o["kind"] in ("StatefulSet", "Deployment"):
        return [o["spec"]["template"]]
    if o["kind"] == "LeaderWorkerSet":
        t = o["spec"]["leaderWorkerTemplate"]
        return [t[k] for k in ("leaderTemplate", "workerTemplate") if k in t]
    return []


def _check(objs: list[dict]) -> None:
    """The schemas (a LeaderWorkerSet's: tests/support/lws.py), then what they do not check: names are DNS
    labels (a StatefulSet's at most 52), every selector picks a rendered pod template (or a LeaderWorkerSet's
    pods), every mount names a volume, every claim is rendered, every probe and Service port names a container
    port, every StatefulSet's Service is headless."""
    for o in objs:
        if o["kind"] == "LeaderWorkerSet":
            lws.validate(o, K8S)
        else:
            assert kv.validate(o, K8S, strict=True) == K8S.rsplit(".", 1)[0], o["metadata"]["name"]
    templates = [t for o in objs for t in _templates(o)]
    claims = {o["metadata"]["name"] for o in _by_kind(objs, "PersistentVolumeClaim")}
    groups = {o["metadata"]["name"] for o in _by_kind(objs, "LeaderWorkerSet")}
    for o in objs:
        name = o["metadata"]["name"]
        assert _DNS.match(name) and len(name) <= (52 if o["kind"] == "StatefulSet" else 63), name
        sel = o["spec"].get("selector")
        if sel is not None:
            sel = sel.get("matchLabels", sel)
            if lws.NAME_LABEL in sel:                   # the label the LWS controller gives its pods
                assert sel == {lws.NAME_LABEL: sel[lws.NAME_LABEL]} and sel[lws.NAME_LABEL] in groups, name
            else:
                assert any(sel.items() <= t["metadata"]["labels"].items() for t in templates), name
    for s in objs:
        if s["kind"] in ("StatefulSet", "Deployment"):
            assert s["spec"]["selector"]["matchLabels"].items() <= s["spec"]["template"]["metadata"]["labels"].items()
        for template in _templates(s):
            pod = template["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert claims >= {v["persistentVolumeClaim"]["claimName"] for v in volumes.values()
                              if "persistentVolumeClaim" in v}
            for c in pod.get("initContainers", []) + pod["containers"]:
                assert all(m["name"] in volumes for m in c.get("volumeMounts", [])), c["name"]
                ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe in c and "exec" in c[probe]:     # dgr-worker --probe 127.0.0.1:PORT, the container's port
                        cmd = c[probe]["exec"]["command"]
                        assert cmd[0] == c["command"][0] and cmd[1] == "--probe", (c["name"], probe)
                        assert int(cmd[2].rsplit(":", 1)[1]) in ports.values(), (c["name"], probe)
                        assert not any("$(" in a for a in cmd), "the kubelet does not expand an exec probe's command"
                    elif probe in c:
                        how = c[probe].get("grpc") or c[probe].get("tcpSocket") or c[probe].get("httpGet")
                        assert how["port"] in ports or how["port"] in ports.values(), (c["name"], probe)
        if s["kind"] == "StatefulSet":
            [svc] = [x for x in _by_kind(objs, "Service") if x["metadata"]["name"] == s["spec"]["serviceName"]]
            assert svc["spec"]["clusterIP"] == "None"


def _render(file: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = dgr("deploy", "render", file, "--kubernetes", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_the_validator_is_real():
    # strict: an unknown field is refused (a render with a misspelled field would fail _check)
    with pytest.raises(kv.ValidationError):
        kv.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
                     "spec": {"clusterIp": "None"}}, K8S, strict=True)


@pytest.fixture(scope="module")
def local_3stage(smollm2_gguf):
    """The committed file's bundle built into its store (the pods name its folder), as `dgr up` builds it."""
    from dgr.app.deploy.plan import make_plan
    from dgr.app.deploy.provision import provision_local

    plan = make_plan(FILE)
    if not plan.bundle.copies:
        provision_local(plan)
    return make_plan(FILE)


def test_the_local_file_renders_valid_objects_without_tls(local_3stage, tmp_path):
    proc = _render(FILE, tmp_path / "a")
    objs = _objects(tmp_path / "a")
    _check(objs)
    name = "local-3stage"
    assert [f.name for f in sorted((tmp_path / "a").iterdir())] == sorted(
        [f"{name}-store.persistentvolumeclaim.yaml", f"{name}-gateway.deployment.yaml", f"{name}-gateway.service.yaml"]
        + [f"{name}-s{i}.{k}.yaml" for i in range(3) for k in ("service", "statefulset", "poddisruptionbudget")])
    assert "no [tls]" in proc.stderr and "--insecure" in proc.stderr
    sets = {s["metadata"]["name"]: s for s in _by_kind(objs, "StatefulSet")}
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {f"{name}-s0": 1, f"{name}-s1": 2, f"{name}-s2": 1}
    pod = sets[f"{name}-s1"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["command"] == [f"{PREFIX}/bin/dgr-worker"] and c["image"] == f"dgr-worker:{__version__}"
    # the argv `dgr up` and the units give, on the pod's wildcard address, plaintext (no [tls])
    plan = local_3stage
    w = next(w for w in plan.workers if w.name == "s1-r0")
    from dgr.app.deploy.argv import worker_args

    folder = f"/var/lib/dgr/store/{plan.bundle.name}-{plan.bundle.id[:12]}"
    assert c["args"] == worker_args(plan, w, folder, 7110, bind="0.0.0.0", insecure=True) + [
        "--advertise", f"$(POD_NAME).{name}-s1"]
    assert c["readinessProbe"]["grpc"] == {"port": 7110} and c["livenessProbe"]["grpc"] == {"port": 7110}
    assert c["resources"]["requests"] == {"cpu": "1", "memory": f"{-(-plan.memory_estimate(w) // 2**20)}Mi"}
    [init] = pod["initContainers"]
    assert init["command"] == [f"{PREFIX}/bin/dgr", "bundle", "verify", folder, "--stage", "1", "--expect-id",
                               plan.bundle.id, "-q"]
    store = next(m for m in init["volumeMounts"] if m["name"] == "store")
    assert store["readOnly"] is True and {"name": "store", "persistentVolumeClaim": {
        "claimName": f"{name}-store", "readOnly": True}} in pod["volumes"]
    [gw] = _by_kind(objs, "Deployment")
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--route") + 1] == (f"{name}-s0-0.{name}-s0:7100,{name}-s1-0.{name}-s1:7110|"
                                               f"{name}-s1-1.{name}-s1:7110,{name}-s2-0.{name}-s2:7120")
    assert "--allow-mixed-numerics" not in args, "one lane, one CPU variant: the route is exact"
    assert [p["spec"]["maxUnavailable"] for p in _by_kind(objs, "PodDisruptionBudget")] == [1, 1, 1]
    _render(FILE, tmp_path / "b")
    assert [p.read_bytes() for p in sorted((tmp_path / "a").iterdir())] == \
        [p.read_bytes() for p in sorted((tmp_path / "b").iterdir())]


def test_render_takes_one_of_systemd_or_kubernetes(tmp_path):
    proc = dgr("deploy", "render", FILE)
    assert proc.returncode == 2 and "one of the arguments --systemd --kubernetes is required" in proc.stderr
    proc = dgr("deploy", "render", FILE, "--systemd", str(tmp_path / "u"), "--kubernetes", str(tmp_path / "k"))
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


# -- a 12-stage fleet ---------------------------------------------------------------------------------------

TWELVE = [(i, i + 1) for i in range(12)]


@pytest.fixture(scope="module")
def twelve(tmp_path_factory):
    root = tmp_path_factory.mktemp("twelve")
    return make_bundle(synth_model(root, "llama", layers=12, embd=64), TWELVE, root / "build", name="fleet")


def _fleet_file(tmp_path: Path, b, tls_dir: Path) -> str:
    stages = []
    for i, (lo, hi) in enumerate(TWELVE):
        where = 'hosts = ["gpu-a", "cpu-b"]\nreplicas = 2' if i == 5 else f'host = "{"gpu-a" if i % 2 else "cpu-b"}"'
        stages.append(f"[[stages]]\nlayers = [{lo}, {hi}]\n{where}\nport = {7000 + 10 * i}\n")
    # CUDA and CPU hosts compute different numerics (docs/numerics.md): the file says it means to mix them
    return str(write(tmp_path / "fleet.toml", f"""name = "fleet"
allow_mixed_numerics = true
[bundle]
id = "{b.id}"
source = "{b.root}"

[[hosts]]
name = "gpu-a"
address = "10.0.0.1"
store = "/srv/dgr/store"
lane = "cuda"

[[hosts]]
name = "cpu-b"
address = "10.0.0.2"
store = "/srv/dgr/store"

{chr(10).join(stages)}
[worker]
threads = 4
n_ctx = 8192

[tls]
dir = "{tls_dir}"
"""))


def _issue(tls_dir: Path, members: list[str]) -> None:
    from dgr.app import certs

    certs.init(tls_dir)
    for m in members:
        certs.issue(tls_dir, m, ["127.0.0.1"])


def test_a_12_stage_fleet_with_mutual_tls_renders_valid_objects_and_its_secrets(twelve, tmp_path):
    workers = [f"s{i}-r{k}" for i in range(12) for k in range(4 if i == 5 else 1)]
    _issue(tmp_path / "ca", [*workers, "gateway"])
    f = _fleet_file(tmp_path, twelve, tmp_path / "ca")
    proc = _render(f, tmp_path / "out", "--namespace", "dgr-fleet", "--image", "registry.local/dgr-worker:t")
    assert "under mutual TLS the probes run `dgr-worker --probe`" in proc.stderr
    objs = _objects(tmp_path / "out")
    _check(objs)
    assert all(o["metadata"]["namespace"] == "dgr-fleet" for o in objs)
    sets = {s["metadata"]["name"]: s for s in _by_kind(objs, "StatefulSet")}
    assert len(sets) == 13 and len(_by_kind(objs, "PodDisruptionBudget")) == 12
    assert len([s for s in _by_kind(objs, "Service") if s["spec"].get("clusterIP") == "None"]) == 12
    assert sets["fleet-s5-gpu-a"]["spec"]["replicas"] == sets["fleet-s5-cpu-b"]["spec"]["replicas"] == 2
    assert {s["spec"]["serviceName"] for n, s in sets.items() if n.startswith("fleet-s5-")} == {"fleet-s5"}
    for n, s in sets.items():
        pod = s["spec"]["template"]["spec"]
        [c] = pod["containers"]
        assert c["image"] == "registry.local/dgr-worker:t"
        gpu = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpu == ("1" if n in ("fleet-s5-gpu-a", *(f"fleet-s{i}" for i in range(1, 12, 2))) else None), n
        assert c["readinessProbe"]["exec"]["command"] == c["livenessProbe"]["exec"]["command"] == [
            c["command"][0], "--probe", f"127.0.0.1:{c['ports'][0]['containerPort']}", "--tls-cert",
            "/etc/dgr/tls/tls.crt", "--tls-key", "/etc/dgr/tls/tls.key", "--tls-ca", "/etc/dgr/tls/ca.crt",
            "--rpc-timeout", "4"]
        assert c["resources"]["requests"]["cpu"] == "4" and "--insecure" not in c["args"]
        a = c["args"]
        assert [a[a.index(x) + 1] for x in ("--tls-cert", "--tls-key", "--tls-ca")] == [
            "/etc/dgr/tls/tls.crt", "/etc/dgr/tls/tls.key", "/etc/dgr/tls/ca.crt"]
        assert {"name": "tls", "mountPath": "/etc/dgr/tls", "subPathExpr": "$(POD_NAME)", "readOnly": True} in \
            c["volumeMounts"]
        [tls] = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert [src["secret"]["name"] for src in tls["projected"]["sources"]] == [
            f"{n}-{k}-tls" for k in range(s["spec"]["replicas"])]
    [gw] = _by_kind(objs, "Deployment")
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    hops = args[args.index("--route") + 1].split(",")
    assert len(hops) == 12 and hops[5] == ("fleet-s5-gpu-a-0.fleet-s5:7050|fleet-s5-gpu-a-1.fleet-s5:7050|"
                                           "fleet-s5-cpu-b-0.fleet-s5:7050|fleet-s5-cpu-b-1.fleet-s5:7050")
    assert "--insecure" not in args and "--https-cert" in args
    assert "--allow-mixed-numerics" in args, "the file planned CUDA and CPU stages in one route"

    # secrets.sh, with kubectl standing in: one valid kubernetes.io/tls Secret per pod and the gateway's
    script = (tmp_path / "out" / "secrets.sh").read_text()
    assert f"#   dgr certs issue {tmp_path / 'ca'} s5-r3 --host fleet-s5-cpu-b-1.fleet-s5 " \
        "--host fleet-s5-cpu-b-1.fleet-s5.dgr-fleet.svc\n" in script
    kubectl = Kubectl(tmp_path / "kubectl")
    ran = kubectl.run(tmp_path / "out" / "secrets.sh")
    assert ran.returncode == 0, ran.stderr
    secrets = kubectl.secrets()
    pods = [f"{n}-{k}" for n, s in sets.items() for k in range(s["spec"]["replicas"])]
    assert sorted(secrets) == sorted([f"{p}-tls" for p in pods] + ["fleet-gateway-tls"])
    # pod k of a stage's second host is the stage's worker after the first host's: its certificate
    cert = secrets["fleet-s5-cpu-b-1-tls"]["data"]["tls.crt"]
    assert base64.b64decode(cert) == (tmp_path / "ca" / "s5-r3.pem").read_bytes()
    for s in secrets.values():
        kv.validate(s, K8S, strict=True)
        assert s["type"] == "kubernetes.io/tls" and sorted(s["data"]) == ["ca.crt", "tls.crt", "tls.key"]
        assert s["metadata"]["namespace"] == "dgr-fleet"


def test_the_gateways_certificate_must_be_issued(twelve, tmp_path):
    workers = [f"s{i}-r{k}" for i in range(12) for k in range(4 if i == 5 else 1)]
    _issue(tmp_path / "ca", workers)
    proc = dgr("deploy", "render", _fleet_file(tmp_path, twelve, tmp_path / "ca"), "--kubernetes", str(tmp_path / "o"))
    assert proc.returncode != 0
    assert f"no {tmp_path / 'ca' / 'gateway.pem'}; issue it with `dgr certs issue {tmp_path / 'ca'} gateway " \
        "--host fleet-gateway`" in proc.stderr


# -- a LeaderWorkerSet: every group a whole pipeline ---------------------------------------------------------

def _lws_fleet_file(tmp_path: Path, b, tls_dir: Path, stages: str | None = None) -> str:
    """The 12 stages as a LeaderWorkerSet of 2 groups: stage 0 (the leader) on the CPU pool, the rest on CUDA."""
    stages = stages or "".join(f'[[stages]]\nlayers = [{lo}, {hi}]\nhost = "{"cpu-b" if i == 0 else "gpu-a"}"\n'
                               f"replicas = 2\n\n" for i, (lo, hi) in enumerate(TWELVE))
    text = Path(_fleet_file(tmp_path, b, tls_dir)).read_text()
    head, _, rest = text.partition("[[stages]]")
    return str(write(tmp_path / "fleet-lws.toml", head + stages + "[worker]" + rest.split("[worker]", 1)[1]
                     + '\n[kubernetes]\nworkload = "leaderworkerset"\n'))


def test_a_12_stage_leaderworkerset_with_mutual_tls_renders_valid_objects_and_its_secrets(twelve, tmp_path):
    workers = [f"s{i}-r{k}" for i in range(12) for k in range(2)]
    _issue(tmp_path / "ca", [*workers, "gateway"])
    proc = _render(_lws_fleet_file(tmp_path, twelve, tmp_path / "ca"), tmp_path / "out", "--namespace", "dgr-fleet")
    assert "LeaderWorkerSet controller" in proc.stderr
    objs = _objects(tmp_path / "out")
    _check(objs)
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == sorted([
        "fleet-store.persistentvolumeclaim.yaml", "fleet-lws.leaderworkerset.yaml",
        "fleet-lws.poddisruptionbudget.yaml", "fleet-gateway.deployment.yaml", "fleet-gateway.service.yaml",
        "secrets.sh"])
    [group] = _by_kind(objs, "LeaderWorkerSet")
    spec = group["spec"]
    t = spec["leaderWorkerTemplate"]
    assert (spec["replicas"], t["size"], t["restartPolicy"]) == (2, 12, "None")
    leader, worker = (t[k]["spec"]["containers"][0] for k in ("leaderTemplate", "workerTemplate"))
    for c, stage in ((leader, "0"), (worker, "$(LWS_WORKER_INDEX)")):
        assert c["args"][c["args"].index("--stage") + 1] == stage
        assert c["args"][c["args"].index("--listen") + 1] == "0.0.0.0:7000"
        assert c["args"][-2:] == ["--advertise", "$(POD_NAME).fleet-lws"]
    init = t["workerTemplate"]["spec"]["initContainers"][0]
    assert init["command"][init["command"].index("--stage") + 1] == "$(LWS_WORKER_INDEX)"
    assert "nvidia.com/gpu" not in leader["resources"]["limits"] and worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert leader["args"][leader["args"].index("--lane") + 1] == "cpu"
    assert worker["args"][worker["args"].index("--lane") + 1] == "cuda"
    [budget] = _by_kind(objs, "PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {lws.NAME_LABEL: "fleet-lws"}}}
    # the pods as the LWS controller names them, each reached as <pod>.<set> (its headless Service)
    names = [name for name, *_ in lws.pods(group)]
    assert names[:3] == ["fleet-lws-0", "fleet-lws-0-1", "fleet-lws-0-2"] and len(names) == 24
    [gw] = _by_kind(objs, "Deployment")
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    hops = args[args.index("--route") + 1].split(",")
    assert hops[0] == "fleet-lws-0.fleet-lws:7000|fleet-lws-1.fleet-lws:7000"
    assert hops[5] == "fleet-lws-0-5.fleet-lws:7000|fleet-lws-1-5.fleet-lws:7000" and len(hops) == 12
    # one Secret per pod, every template projecting them all (each container mounts its own by $(POD_NAME))
    for k in ("leaderTemplate", "workerTemplate"):
        [v] = [v for v in t[k]["spec"]["volumes"] if v["name"] == "tls"]
        assert sorted(s["secret"]["name"] for s in v["projected"]["sources"]) == sorted(f"{n}-tls" for n in names)
    script = (tmp_path / "out" / "secrets.sh").read_text()
    assert f"#   dgr certs issue {tmp_path / 'ca'} s5-r1 --host fleet-lws-1-5.fleet-lws " \
        "--host fleet-lws-1-5.fleet-lws.dgr-fleet.svc\n" in script
    kubectl = Kubectl(tmp_path / "kubectl")
    assert kubectl.run(tmp_path / "out" / "secrets.sh").returncode == 0
    secrets = kubectl.secrets()
    assert sorted(secrets) == sorted([f"{n}-tls" for n in names] + ["fleet-gateway-tls"])
    assert base64.b64decode(secrets["fleet-lws-1-5-tls"]["data"]["tls.crt"]) == (tmp_path / "ca" / "s5-r1.pem").read_bytes()


def test_a_leaderworkerset_is_refused_where_a_group_cannot_be_a_whole_pipeline(twelve, tmp_path):
    workers = [f"s{i}-r{k}" for i in range(12) for k in range(2)]
    _issue(tmp_path / "ca", [*workers, "gateway"])
    uneven = "".join(f'[[stages]]\nlayers = [{lo}, {hi}]\nhost = "gpu-a"\nreplicas = {1 if i == 3 else 2}\n\n'
                     for i, (lo, hi) in enumerate(TWELVE))
    proc = dgr("deploy", "render", _lws_fleet_file(tmp_path, twelve, tmp_path / "ca", uneven), "--kubernetes",
               str(tmp_path / "o"))
    assert proc.returncode != 0 and "every stage needs the same number of workers" in proc.stderr
    assert "stage 3: 1" in proc.stderr and "statefulset" in proc.stderr
    mixed = "".join(f'[[stages]]\nlayers = [{lo}, {hi}]\nhost = "{"cpu-b" if i == 7 else "gpu-a"}"\nreplicas = 2\n\n'
                    for i, (lo, hi) in enumerate(TWELVE))
    proc = dgr("deploy", "render", _lws_fleet_file(tmp_path, twelve, tmp_path / "ca", mixed), "--kubernetes",
               str(tmp_path / "o"))
    assert proc.returncode != 0 and "share one pod template, so one lane" in proc.stderr
    assert not (tmp_path / "o").exists()


# -- the rendered pods, run here ----------------------------------------------------------------------------

def _wait_serving(address: str, tls, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while health(address, tls, timeout=0.5) != "SERVING":
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _pods(objs: list[dict], root: Path, claims: dict[str, Path], secrets: dict[str, dict],
          images: dict | None = None) -> dict[str, Pod]:
    """Every pod the workload objects make, by the address the route gives it (`<pod>.<service>:<port>`):
    a StatefulSet's `<set>-<k>`, a LeaderWorkerSet's as its controller makes them (tests/support/lws.py)."""
    out: dict[str, Pod] = {}
    for o in objs:
        name = o["metadata"]["name"]
        if o["kind"] == "StatefulSet":
            made = [(f"{name}-{k}", o["spec"]["template"]["spec"], o["spec"]["serviceName"])
                    for k in range(o["spec"]["replicas"])]
        elif o["kind"] == "LeaderWorkerSet":
            made = [(pod, spec, name) for pod, _, _, spec in lws.pods(o)]
        else:
            continue
        for pod_name, spec, service in made:
            pod = Pod(pod_name, spec, root / pod_name, claims, secrets, images=images or {})
            out[f"{pod_name}.{service}:{next(iter(pod.ports))}"] = pod
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["statefulset", "leaderworkerset"])
@pytest.mark.parametrize("tls", [True, False], ids=["mutual-tls", "plaintext"])
def test_the_rendered_pods_form_a_route_that_generates_the_normal_routes_tokens(tiny, lib_env, tmp_path, tls,
                                                                                workload):
    from dgr.toolchain.bundle import provision

    lws_set = workload == "leaderworkerset"
    ca = tmp_path / "ca"
    if tls:
        _issue(ca, [*(f"s{i}-r{k}" for i in range(3) for k in range(2 if lws_set or i == 1 else 1)), "gateway",
                    "client"])
    _render(tiny_fixed_ports_file(tmp_path, tiny, ca if tls else None, workload), tmp_path / "out")
    objs = _objects(tmp_path / "out")
    _check(objs)
    # the claim: a store the bundle was provisioned into (`dgr bundle provision BUNDLE --to STORE`)
    claim = tmp_path / "claim"
    assert provision(tiny.root, claim).complete
    kubectl = Kubectl(tmp_path / "kubectl")
    assert (tmp_path / "out" / "secrets.sh").exists() == tls
    if tls:
        assert kubectl.run(tmp_path / "out" / "secrets.sh").returncode == 0
    secrets = kubectl.secrets()
    pods = _pods(objs, tmp_path / "pods", {"tiny-store": claim}, secrets)
    assert list(pods.values())[0].name == ("tiny-lws-0" if lws_set else "tiny-s0-0") and len(pods) == (6 if lws_set else 4)
    local = {name: f"127.0.0.1:{next(iter(p.ports.values()))}" for name, p in pods.items()}   # the stand-in DNS
    # plaintext: what the kubelet's gRPC probe asks (health of ""); under TLS its TCP probe passes once this does
    client = TlsConfig(ca / "client.pem", ca / "client.key", ca / "ca.pem") if tls else None
    procs: list[subprocess.Popen] = []
    try:
        for p in pods.values():                         # the init container, then the worker
            init = p.popen("verify-bundle", PREFIX, lib_env)
            assert init.wait(120) == 0, p.log("verify-bundle").read_text()
            assert "ok: bundle" in p.log("verify-bundle").read_text()
            procs.append(p.popen("worker", PREFIX, lib_env))
        for (name, p), proc in zip(pods.items(), procs):
            _wait_serving(local[name], client, proc, p.log("worker"))
            if tls:                                     # the pod's exec probe, as the kubelet runs it
                probe = p.probe_argv(p.container("worker"), "readinessProbe", PREFIX)
                r = subprocess.run(probe, capture_output=True, text=True, timeout=30, env={**os.environ, **lib_env})
                assert r.returncode == 0 and r.stdout == "SERVING\n", (probe, r.stdout, r.stderr)
        [gw_obj] = _by_kind(objs, "Deployment")
        args = gw_obj["spec"]["template"]["spec"]["containers"][0]["args"]
        route = args[args.index("--route") + 1]
        for name, addr in local.items():
            route = route.replace(name, addr)
        with RouteClient(route, tls=client) as c:
            assert all(d.mutual_tls == tls for d in c.describe())
            got = c.run(PROMPT, max_new_tokens=24, stop_token_ids=[])
            text = c.run(PROMPT, max_new_tokens=16)
        # the rendered gateway over those pods (under TLS: HTTPS with its member certificate, mTLS to the route)
        gw = Pod("tiny-gateway-0", gw_obj["spec"]["template"]["spec"], tmp_path / "pods" / "gateway", {}, secrets)
        procs.append(gw.popen("gateway", PREFIX, lib_env, resolve=local))
        url = f"{'https' if tls else 'http'}://127.0.0.1:{gw.ports[8000]}"
        verify = str(ca / "ca.pem") if tls else True
        deadline = time.monotonic() + 120
        while True:
            try:
                up = requests.get(f"{url}/health", verify=verify, timeout=2)
                if up.ok:
                    break
            except requests.ConnectionError:
                pass
            assert procs[-1].poll() is None and time.monotonic() < deadline, gw.log("gateway").read_text()[-3000:]
            time.sleep(0.3)
        r = requests.post(f"{url}/v1/completions", verify=verify, timeout=120,
                          json={"model": up.json()["model"], "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text.text
    finally:
        _stop(procs)
    # the same workers started the normal way (`dgr worker serve`, plaintext on loopback)
    stage_args = [["--bundle", str(tiny.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"] for i in range(3)]
    with LocalRoute(stage_args, replicas=[2, 2, 2] if lws_set else [1, 2, 1], env=lib_env) as r, \
            RouteClient(r.route) as c:
        want = c.run(PROMPT, max_new_tokens=24, stop_token_ids=[])
    assert got.token_ids == want.token_ids and len(got.token_ids) == 24
