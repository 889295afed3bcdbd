"""`dgr deploy render FILE --kubernetes OUT`: the deployment as Kubernetes objects, one YAML file per object.

Per stage and host of the file (a "replica set": the `replicas` workers a stage has on one `[[hosts]]`
entry, which here is a pool of nodes with one lane) a StatefulSet whose pods run the release's worker
(`<prefix>/bin/dgr-worker serve ...`, the argv `dgr up` and the systemd units give,
`dgr.app.deploy.argv.worker_args`) on `0.0.0.0:<port>` (the stage's port, or DEFAULT_PORT: every pod
has its own address); per stage a headless Service (pod `<sts>-<k>` is `<sts>-<k>.<service>`) and a
PodDisruptionBudget of one pod at a time; one PersistentVolumeClaim, read-only, holding the store the
bundle was provisioned into (`<store>/<name>-<id12>`); an init container that verifies the pod's own stage
file and the bundle's id (`dgr bundle verify --stage N --expect-id ID`, resumable: its progress is in the
pod's state volume, which outlives a restart of the container); a gateway (`dgr serve`) Deployment and
Service whose route names the pods by those DNS names, replicas joined by '|'.

Probes: the worker's grpc.health.v1 service (SERVING once the stage is loaded, NOT_SERVING while it
drains). In plaintext the kubelet's own gRPC probe asks it. That probe cannot present a client certificate,
so under mutual TLS an exec probe asks instead: `dgr-worker --probe 127.0.0.1:PORT` with the pod's own member
certificate, checking the worker's certificate under the pod's name (the first host its certificate names).
Under server-only TLS the probes are TCP connects: the worker opens its port only once its stage is loaded.
A startup probe gives a large stage an hour to verify and load before liveness counts.

Trust: under [tls] each pod presents its own member certificate (worker `s<i>-r<k>`'s files of tls.dir,
issued by `dgr certs issue` for the pod's DNS name) from a Secret of its own, `<pod>-tls` (tls.crt,
tls.key, ca.crt; `secrets.sh` makes them with kubectl). A StatefulSet's pods share one template, so its
volume projects every pod's Secret into a folder named after the pod, and the container mounts only its
own folder (`subPathExpr: $(POD_NAME)`). Without [tls], or with server-only TLS, workers serve anyone on
the pod network (`--insecure`: the worker refuses a wildcard address otherwise); `notes` says so.

Resources: memory requested and limited to `Plan.memory_estimate` (the stage's weights, its prefix cache,
headroom for KV and compute), cpu requested as [worker] threads; a CUDA or ROCm host's pods ask for one GPU.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from dgr import __version__
from dgr.app.deploy.argv import tls_files, worker_args
from dgr.app.deploy.plan import Plan, WorkerPlan
from dgr.app.deploy.spec import DeployError
from dgr.app.deploy.systemd import DEFAULT_PREFIX  # where the images hold the release: bin/dgr-worker, bin/dgr, lib/

DEFAULT_PORT = 7000                    # a stage the file gives no port: the same in every pod
GATEWAY_PORT = 8000
STORE_MOUNT = "/var/lib/dgr/store"     # the claim: a store, the bundle in <name>-<id12>/
STATE_MOUNT = "/var/lib/dgr/state"     # $DGR_WORKSPACE: the verification's progress
TLS_MOUNT = "/etc/dgr/tls"             # this pod's Secret
# the Secret key each TLS flag's file is (kubernetes.io/tls names, and the CA beside them)
TLS_KEYS = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-ca": "ca.crt"}
GATEWAY_MEMBER = "gateway"             # its certificate: tls.dir/gateway.pem
USER = 65532                           # the images' unprivileged user (no account needed)
STARTUP_S = 3600                       # how long a pod may take to verify and load its stage
GPU = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}   # the device plugins' resource names
_MAX_STS = 52                          # a StatefulSet's pods carry `<name>-<hash>` labels of at most 63


@dataclass(frozen=True)
class Options:
    image: str                         # the worker's image (the release's dgr-worker and engine, no Python)
    tools_image: str                   # the init container's and the gateway's (the release's bin/dgr)
    namespace: str | None = None
    prefix: str = DEFAULT_PREFIX

    @staticmethod
    def default(image: str | None = None, tools_image: str | None = None, namespace: str | None = None,
                prefix: str | None = None) -> Options:
        return Options(image or f"dgr-worker:{__version__}", tools_image or f"dgr:{__version__}", namespace,
                       prefix or DEFAULT_PREFIX)


@dataclass(frozen=True)
class StageSet:
    """The workers of one stage on one host: one StatefulSet, pod k is workers[k]."""

    stage: int
    host: str
    name: str                          # the StatefulSet's
    service: str                       # the stage's headless Service
    port: int
    workers: tuple[WorkerPlan, ...]

    def pod(self, k: int) -> str:
        return f"{self.name}-{k}"

    def address(self, k: int) -> str:
        return f"{self.pod(k)}.{self.service}:{self.port}"


def _dns(name: str, what: str, limit: int = 63) -> str:
    n = name.replace("_", "-")
    if len(n) > limit or n.startswith("-") or n.endswith("-"):
        raise DeployError(f"{what} {n!r}: a Kubernetes name of at most {limit} characters that starts and ends "
                          "with a letter or digit; shorten the deployment's or the host's name")
    return n


def _base(plan: Plan) -> str:
    return _dns(plan.name, "deployment name")


def stage_sets(plan: Plan) -> list[StageSet]:
    """The StatefulSets: per stage, one per host its workers run on (in the file's order)."""
    base = _base(plan)
    out = []
    for i in range(plan.stage_count()):
        ws = [w for w in plan.workers if w.stage == i]
        hosts = list(dict.fromkeys(w.host.name for w in ws))
        service = _dns(f"{base}-s{i}", "Service")
        port = ws[0].port or DEFAULT_PORT
        for h in hosts:
            name = service if len(hosts) == 1 else f"{service}-{h}"
            out.append(StageSet(i, h, _dns(name, "StatefulSet", _MAX_STS), service, port,
                                  tuple(w for w in ws if w.host.name == h)))
    return out


def route(plan: Plan) -> str:
    """The route the gateway is given: `<pod>.<service>:<port>`, stages in order, replicas joined by '|'."""
    sets = stage_sets(plan)
    return ",".join("|".join(rs.address(k) for rs in sets if rs.stage == i for k in range(len(rs.workers)))
                    for i in range(plan.stage_count()))


def _mutual(plan: Plan) -> bool:
    t = plan.loaded.deployment.tls
    return t is not None and t.mutual


def _labels(plan: Plan, component: str, **more: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dgr", "app.kubernetes.io/instance": _base(plan),
            "app.kubernetes.io/component": component, **{f"dgr/{k}": v for k, v in more.items()}}


def _meta(plan: Plan, o: Options, name: str, labels: dict[str, str]) -> dict:
    m: dict = {"name": name, "labels": {**labels, "app.kubernetes.io/managed-by": "dgr",
                                        "app.kubernetes.io/version": __version__}}
    if o.namespace:
        m["namespace"] = o.namespace
    return m


def _mib(n: int) -> str:
    return f"{-(-n // (1 << 20))}Mi"


_HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
             "capabilities": {"drop": ["ALL"]}}


def _probe(how: dict, period: int, failures: int) -> dict:
    return {**how, "periodSeconds": period, "timeoutSeconds": 5, "failureThreshold": failures}


def probe_action(rs: StageSet, tls: dict[str, str], mutual: bool, prefix: str) -> dict:
    """How the kubelet asks a worker's health: its gRPC probe in plaintext; under mutual TLS the worker's own
    `--probe` with the pod's certificate (no $(VAR) in it: the kubelet does not expand an exec probe's command);
    under server-only TLS a TCP connect."""
    if not tls:
        return {"grpc": {"port": rs.port}}
    if not mutual:
        return {"tcpSocket": {"port": "grpc"}}
    flags = [x for flag in ("--tls-cert", "--tls-key", "--tls-ca") for x in (flag, tls[flag])]
    return {"exec": {"command": [f"{prefix}/bin/dgr-worker", "--probe", f"127.0.0.1:{rs.port}", *flags,
                                 "--rpc-timeout", "4"]}}


def _bundle_folder(plan: Plan) -> str:
    info = plan.bundle
    if not (info.id and info.name):
        raise DeployError(f"{info.label}: its id is not known yet (the pods name the bundle folder "
                          f"{STORE_MOUNT}/<name>-<id12> in the claim): build it first (`dgr recipe build "
                          f"{info.recipe_path} --store STORE`, or `dgr up`), or give bundle.id")
    return f"{STORE_MOUNT}/{info.name}-{info.id[:12]}"


def claim_name(plan: Plan) -> str:
    return _dns(f"{_base(plan)}-store", "PersistentVolumeClaim")


def secret_name(pod: str) -> str:
    return _dns(f"{pod}-tls", "Secret", 253)


def stateful_set(plan: Plan, rs: StageSet, o: Options) -> dict:
    d = plan.loaded.deployment
    w0 = rs.workers[0]
    bundle = _bundle_folder(plan)
    files = tls_files(plan, w0)
    tls = d.tls is not None
    tls_paths = {flag: f"{TLS_MOUNT}/{TLS_KEYS[flag]}" for flag in files}
    args = worker_args(plan, w0, bundle, rs.port, bind="0.0.0.0", tls=tls_paths,
                       insecure=d.worker.insecure or not _mutual(plan))
    # peers and errors name the pod as the route does, never its bare host name (which other pods cannot resolve)
    args += ["--advertise", f"$(POD_NAME).{rs.service}"]
    memory = _mib(plan.memory_estimate(w0))
    limits = {"memory": memory}
    if w0.host.lane in GPU:
        limits[GPU[w0.host.lane]] = "1"
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "DGR_WORKSPACE", "value": STATE_MOUNT}]
    mounts = [{"name": "store", "mountPath": STORE_MOUNT, "readOnly": True},
              {"name": "state", "mountPath": STATE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    health = probe_action(rs, tls_paths if tls else {}, tls and _mutual(plan), o.prefix)
    tls_mount = [{"name": "tls", "mountPath": TLS_MOUNT, "subPathExpr": "$(POD_NAME)", "readOnly": True}] if tls else []
    worker = {
        "name": "worker", "image": o.image, "imagePullPolicy": "IfNotPresent",
        "command": [f"{o.prefix}/bin/dgr-worker"], "args": args, "env": env,
        "ports": [{"name": "grpc", "containerPort": rs.port, "protocol": "TCP"}],
        "startupProbe": _probe(health, 5, STARTUP_S // 5),
        "readinessProbe": _probe(health, 5, 2),
        "livenessProbe": _probe(health, 10, 3),
        "resources": {"requests": {"cpu": str(d.worker.threads or 1), "memory": memory}, "limits": limits},
        "securityContext": _HARDENED, "volumeMounts": mounts + tls_mount,
    }
    verify = {
        "name": "verify-bundle", "image": o.tools_image, "imagePullPolicy": "IfNotPresent",
        "command": [f"{o.prefix}/bin/dgr", "bundle", "verify", bundle, "--stage", str(rs.stage),
                    "--expect-id", plan.bundle.id, "-q"],
        "env": [{"name": "DGR_WORKSPACE", "value": STATE_MOUNT}],
        "resources": {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": _HARDENED, "volumeMounts": mounts,
    }
    volumes: list[dict] = [
        {"name": "store", "persistentVolumeClaim": {"claimName": claim_name(plan), "readOnly": True}},
        {"name": "state", "emptyDir": {"sizeLimit": "64Mi"}}, {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if tls:
        volumes.append({"name": "tls", "projected": {"defaultMode": 0o440, "sources": [
            {"secret": {"name": secret_name(rs.pod(k)), "items": [
                {"key": key, "path": f"{rs.pod(k)}/{key}"} for key in TLS_KEYS.values()]}}
            for k in range(len(rs.workers))]}})
    select = _labels(plan, "stage", stage=str(rs.stage), host=_dns(rs.host, "host"))
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(plan, o, rs.name, select),
        "spec": {
            "serviceName": rs.service, "replicas": len(rs.workers), "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": select},
            "template": {
                "metadata": {"labels": select, "annotations": {
                    "dgr/bundle-id": plan.bundle.id, "dgr/layers": f"[{w0.layers[0]}, {w0.layers[1]})",
                    "dgr/workers": " ".join(w.name for w in rs.workers)}},
                "spec": {
                    "automountServiceAccountToken": False, "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": int(d.worker.drain_timeout) + 5,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER,
                                        "fsGroup": USER, "fsGroupChangePolicy": "OnRootMismatch",
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": [verify], "containers": [worker], "volumes": volumes}}}}


def stage_service(plan: Plan, stage: int, rs: StageSet, o: Options) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(plan, o, rs.service, _labels(plan, "stage", stage=str(stage))),
            "spec": {"clusterIP": "None", "selector": _labels(plan, "stage", stage=str(stage)),
                     "ports": [{"name": "grpc", "port": rs.port, "targetPort": "grpc", "protocol": "TCP"}]}}


def disruption_budget(plan: Plan, stage: int, rs: StageSet, o: Options) -> dict:
    # one pod of a stage at a time: with replicas the others carry the route; a stage of one pod still
    # lets a node drain (the route waits for it to come back, as for a restart in place)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(plan, o, rs.service, _labels(plan, "stage", stage=str(stage))),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(plan, "stage", stage=str(stage))}}}


def store_claim(plan: Plan, o: Options) -> dict:
    size = sum(plan.bundle.weights or [0])
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(plan, o, claim_name(plan), _labels(plan, "store")),
            "spec": {"accessModes": ["ReadOnlyMany"],
                     "resources": {"requests": {"storage": _mib(size + size // 10 + (64 << 20))}}}}


def gateway(plan: Plan, o: Options) -> list[dict]:
    d = plan.loaded.deployment
    name = _dns(f"{_base(plan)}-gateway", "Deployment")
    tls = d.tls is not None
    args = ["serve", "--route", route(plan), "--listen", f"0.0.0.0:{GATEWAY_PORT}"]
    if tls:
        cert, key, ca = (f"{TLS_MOUNT}/{TLS_KEYS[f]}" for f in ("--tls-cert", "--tls-key", "--tls-ca"))
        args += ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca, "--https-cert", cert, "--https-key", key]
    else:
        args += ["--insecure"]
    if d.allow_mixed_numerics:                   # the file planned a mix (docs/numerics.md): the gateway must allow it
        args += ["--allow-mixed-numerics"]
    http = {"httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS" if tls else "HTTP"},
            "timeoutSeconds": 5}
    select = _labels(plan, "gateway")
    mounts = [{"name": "state", "mountPath": STATE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict] = [{"name": "state", "emptyDir": {"sizeLimit": "64Mi"}},
                           {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if tls:
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": secret_name(name), "defaultMode": 0o440}})
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(plan, o, name, select),
        "spec": {"replicas": 1, "selector": {"matchLabels": select}, "template": {
            "metadata": {"labels": select},
            "spec": {
                "automountServiceAccountToken": False, "enableServiceLinks": False,
                "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER, "fsGroup": USER,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "gateway", "image": o.tools_image, "imagePullPolicy": "IfNotPresent",
                    "command": [f"{o.prefix}/bin/dgr"], "args": args,
                    "env": [{"name": "DGR_WORKSPACE", "value": STATE_MOUNT},
                            {"name": "PYTHONUNBUFFERED", "value": "1"}],
                    "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
                    "readinessProbe": {**http, "periodSeconds": 5, "failureThreshold": 2},
                    "livenessProbe": {**http, "periodSeconds": 10, "failureThreshold": 3},
                    "resources": {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
                    "securityContext": _HARDENED, "volumeMounts": mounts}],
                "volumes": volumes}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(plan, o, name, select),
               "spec": {"selector": select, "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http",
                                                       "protocol": "TCP"}]}}
    return [deployment, service]


def manifests(plan: Plan, o: Options) -> list[dict]:
    """Every object, in the order `kubectl apply` should meet them: the claim, per stage its Service,
    StatefulSets and budget, then the gateway."""
    plan.check()
    out = [store_claim(plan, o)]
    sets = stage_sets(plan)
    for i in range(plan.stage_count()):
        mine = [rs for rs in sets if rs.stage == i]
        out += [stage_service(plan, i, mine[0], o), *(stateful_set(plan, rs, o) for rs in mine),
                disruption_budget(plan, i, mine[0], o)]
    return out + gateway(plan, o)


def members(plan: Plan) -> list[tuple[str, str, list[str]]]:
    """(Secret, member, the DNS names its certificate must hold) per pod and for the gateway."""
    out = []
    for rs in stage_sets(plan):
        for k, w in enumerate(rs.workers):
            out.append((secret_name(rs.pod(k)), w.name, [f"{rs.pod(k)}.{rs.service}"]))
    gw = _dns(f"{_base(plan)}-gateway", "Deployment")
    return out + [(secret_name(gw), GATEWAY_MEMBER, [gw])]


def secrets_script(plan: Plan, o: Options) -> str:
    """`secrets.sh`: one kubernetes.io/tls Secret per pod (and the gateway's) from tls.dir, with kubectl."""
    tdir = plan.loaded.resolve(plan.loaded.deployment.tls.dir)
    ns = f" --namespace {shlex.quote(o.namespace)}" if o.namespace else ""
    lines = ["#!/bin/sh",
             f"# Rendered by `dgr deploy render {plan.loaded.path} --kubernetes`: edit the deployment file, not this.",
             "# One Secret per pod: its member certificate and key (tls.dir/<worker>.pem, .key) and the CA. Issue",
             "# them first, each for the name the route gives its pod (and the gateway's for its Service):"]
    for _, member, names in members(plan):
        if o.namespace:
            names = names + [f"{n}.{o.namespace}.svc" for n in names]
        hosts = " ".join(f"--host {n}" for n in names)
        lines.append(f"#   dgr certs issue {shlex.quote(str(tdir))} {member} {hosts}")
    lines += ["# TLS_DIR=... runs it with the files somewhere else.",
              "set -eu",
              f"TLS_DIR=${{TLS_DIR:-{shlex.quote(str(tdir))}}}",
              "secret() {",
              f"    kubectl create secret generic \"$1\"{ns} --type=kubernetes.io/tls \\",
              '        --from-file=tls.crt="$TLS_DIR/$2.pem" --from-file=tls.key="$TLS_DIR/$2.key" \\',
              '        --from-file=ca.crt="$TLS_DIR/ca.pem" --dry-run=client -o yaml | kubectl apply -f -',
              "}"]
    lines += [f"secret {name} {member}" for name, member, _ in members(plan)]
    return "\n".join(lines) + "\n"


def notes(plan: Plan) -> list[str]:
    """What an operator must know about this render (printed by the CLI on stderr)."""
    d = plan.loaded.deployment
    out = []
    if d.tls is None:
        out.append("no [tls]: the workers and the gateway serve anyone on the pod network in plaintext (--insecure); "
                   "add [tls] for anything but a lab")
    else:
        if not d.tls.mutual:
            out.append("tls.mutual = false: the workers serve any client on the pod network (--insecure)")
        out.append(("under mutual TLS the probes run `dgr-worker --probe` in the pod with its own certificate (the "
                    "kubelet's gRPC probe cannot present one)" if d.tls.mutual else
                    "under server-only TLS the probes are TCP connects") +
                   "; secrets.sh makes each pod's Secret from tls.dir")
    for lane in sorted({w.host.lane for w in plan.workers} - {"cpu", *GPU}):
        hosts = ", ".join(sorted({w.host.name for w in plan.workers if w.host.lane == lane}))
        out.append(f"host(s) {hosts}: lane {lane}: no device resource is requested; add your device plugin's "
                   "to the StatefulSet's resources.limits")
    return out


def _check_gateway_member(plan: Plan) -> None:
    t = plan.loaded.deployment.tls
    if t is None:
        return
    tdir = plan.loaded.resolve(t.dir)
    _, member, names = members(plan)[-1]
    for ext in ("pem", "key"):
        if not (tdir / f"{member}.{ext}").is_file():
            raise DeployError(f"the gateway: certificates absent: no {tdir / f'{member}.{ext}'}; issue it with "
                              f"`dgr certs issue {tdir} {member} --host {names[0]}`")


def _yaml(plan: Plan, obj: dict) -> str:
    class Plain(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:   # a part used twice is written out twice, never as &id001
            return True

    head = f"# Rendered by `dgr deploy render {plan.loaded.path} --kubernetes`: edit the deployment file, not this.\n"
    return head + yaml.dump(obj, Dumper=Plain, sort_keys=True, default_flow_style=False, width=1 << 16)


def file_name(obj: dict) -> str:
    return f"{obj['metadata']['name']}.{obj['kind'].lower()}.yaml"


def render(plan: Plan, out: Path, o: Options) -> list[Path]:
    """Write one YAML file per object (and `secrets.sh` under [tls]) into `out`; returns the files."""
    objs = manifests(plan, o)
    _check_gateway_member(plan)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for obj in objs:
        p = out / file_name(obj)
        p.write_text(_yaml(plan, obj))
        files.append(p)
    if plan.loaded.deployment.tls is not None:
        p = out / "secrets.sh"
        p.write_text(secrets_script(plan, o))
        p.chmod(0o755)
        files.append(p)
    return files
