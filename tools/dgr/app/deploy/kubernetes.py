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

With `[kubernetes] workload = "leaderworkerset"` the workers are one LeaderWorkerSet instead (LWS's v1
API): every group a whole pipeline, pod i of a group serving stage i (`--stage $(LWS_WORKER_INDEX)` in the
workers' shared template), all on DEFAULT_PORT, reached in the set's own headless Service; one
PodDisruptionBudget over the set's pods.

Resources: memory requested and limited to `Plan.memory_estimate` (the stage's weights, its prefix cache,
headroom for KV and compute), cpu requested as [worker] threads; a CUDA or ROCm host's pods ask for one GPU.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from dgr.app.deploy.kubernetes_pods import (  # noqa: F401 (the render's constants, read by the images and tests)
    DEFAULT_PORT, GATEWAY_MEMBER, GATEWAY_PORT, GPU, HARDENED, MAX_STS, STATE_MOUNT, STORE_MOUNT, TLS_KEYS, TLS_MOUNT,
    USER, Options, base_name, bundle_folder, claim_name, dns, labels, layers_note, meta, mib, mutual, pod_spec,
    secret_name)
from dgr.app.deploy.plan import Plan, WorkerPlan
from dgr.app.deploy.spec import DeployError

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


def stage_sets(plan: Plan) -> list[StageSet]:
    """The StatefulSets: per stage, one per host its workers run on (in the file's order)."""
    base = base_name(plan)
    out = []
    for i in range(plan.stage_count()):
        ws = [w for w in plan.workers if w.stage == i]
        hosts = list(dict.fromkeys(w.host.name for w in ws))
        service = dns(f"{base}-s{i}", "Service")
        port = ws[0].port or DEFAULT_PORT
        for h in hosts:
            name = service if len(hosts) == 1 else f"{service}-{h}"
            out.append(StageSet(i, h, dns(name, "StatefulSet", MAX_STS), service, port,
                                  tuple(w for w in ws if w.host.name == h)))
    return out


def _lws(plan: Plan) -> bool:
    return plan.loaded.deployment.kubernetes.workload == "leaderworkerset"


def route(plan: Plan) -> str:
    """The route the gateway is given: `<pod>.<service>:<port>`, stages in order, replicas joined by '|'."""
    if _lws(plan):
        g = lws_group(plan)
        return ",".join("|".join(g.address(k, i) for k in range(g.replicas)) for i in range(g.size))
    sets = stage_sets(plan)
    return ",".join("|".join(rs.address(k) for rs in sets if rs.stage == i for k in range(len(rs.workers)))
                    for i in range(plan.stage_count()))


def stateful_set(plan: Plan, rs: StageSet, o: Options) -> dict:
    select = labels(plan, "stage", stage=str(rs.stage), host=dns(rs.host, "host"))
    spec = pod_spec(plan, list(rs.workers), str(rs.stage), rs.port, rs.service,
                    [rs.pod(k) for k in range(len(rs.workers))], o)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(plan, o, rs.name, select),
        "spec": {
            "serviceName": rs.service, "replicas": len(rs.workers), "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": select},
            "template": {
                "metadata": {"labels": select, "annotations": {
                    "dgr/bundle-id": plan.bundle.id, "dgr/layers": layers_note(list(rs.workers)),
                    "dgr/workers": " ".join(w.name for w in rs.workers)}},
                "spec": spec}}}


# ---- a LeaderWorkerSet: every group a whole pipeline (LWS's v1 API, leaderworkerset.x-k8s.io)

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"   # LWS sets it in every container of a group's pods: 0 leader, i worker i
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


@dataclass(frozen=True)
class Group:
    """The LeaderWorkerSet of a pipeline: `replicas` groups of `size` pods, pod i of a group serving stage i
    (the leader stage 0). LWS names the leader of group g `<name>-<g>`, its worker i `<name>-<g>-<i>`, and
    makes a headless Service `<name>` for all of them (subdomainPolicy Shared)."""

    name: str
    size: int
    replicas: int
    workers: tuple[tuple[WorkerPlan, ...], ...]   # [stage][group]

    def pod(self, group: int, stage: int) -> str:
        return f"{self.name}-{group}" if stage == 0 else f"{self.name}-{group}-{stage}"

    def address(self, group: int, stage: int) -> str:
        return f"{self.pod(group, stage)}.{self.name}:{DEFAULT_PORT}"


def lws_group(plan: Plan) -> Group:
    """The deployment as one LeaderWorkerSet; DeployError where its shape does not fit one: every stage needs
    the same number of workers (a group is a whole pipeline), and the stages after the first share one
    pod template, so one lane."""
    stages = [tuple(w for w in plan.workers if w.stage == i) for i in range(plan.stage_count())]
    counts = sorted({len(ws) for ws in stages})
    if len(counts) != 1:
        raise DeployError("kubernetes.workload = \"leaderworkerset\": every group of a LeaderWorkerSet is a whole "
                          "pipeline, so every stage needs the same number of workers; this file has "
                          + ", ".join(f"stage {i}: {len(ws)}" for i, ws in enumerate(stages))
                          + " (give each stage the same replicas, or use the default workload, statefulset)")
    later = sorted({w.host.lane for ws in stages[1:] for w in ws})
    if len(later) > 1 or len({w.host.lane for w in stages[0]}) > 1:
        raise DeployError("kubernetes.workload = \"leaderworkerset\": the stages after the first share one pod "
                          f"template, so one lane, and stage 0's workers share one; this file has {later} after "
                          "stage 0 (put them on hosts of one lane, or use the default workload, statefulset)")
    # a pod is <name>-<g>-<i>, and its pods' labels carry <name>-<g> and a hash: keep it short enough for both
    name = dns(f"{base_name(plan)}-lws", "LeaderWorkerSet", MAX_STS - 6)
    return Group(name, len(stages), counts[0], tuple(stages))


def _group_workers(g: Group) -> list[tuple[str, WorkerPlan]]:
    """(pod, worker) for every pod of the groups."""
    return [(g.pod(k, i), w) for i, ws in enumerate(g.workers) for k, w in enumerate(ws)]


def leader_worker_set(plan: Plan, g: Group, o: Options) -> dict:
    pods = [pod for pod, _ in _group_workers(g)]
    select = labels(plan, "pipeline")

    def template(ws: list[WorkerPlan], stage: str) -> dict:
        return {"metadata": {"labels": select, "annotations": {
                    "dgr/bundle-id": plan.bundle.id, "dgr/layers": layers_note(ws),
                    "dgr/workers": " ".join(w.name for w in ws)}},
                "spec": pod_spec(plan, ws, stage, DEFAULT_PORT, g.name, pods, o)}

    leader = template(list(g.workers[0]), "0")
    later = [w for ws in g.workers[1:] for w in ws]
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet", "metadata": meta(plan, o, g.name, select),
        "spec": {
            "replicas": g.replicas,
            # the workers start with the leader: each stage waits for its own peers, not for the leader
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": g.size,
                # a pod that restarts rejoins its group alone: the route recovers a stage on its own
                # (docs/reliability.md), so a group is never torn down for one pod
                "restartPolicy": "None",
                "leaderTemplate": leader,
                "workerTemplate": template(later, f"$({LWS_WORKER_INDEX})") if later else leader}}}


def group_disruption_budget(plan: Plan, g: Group, o: Options) -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(plan, o, g.name, labels(plan, "pipeline")),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {LWS_NAME_LABEL: g.name}}}}


def stage_service(plan: Plan, stage: int, rs: StageSet, o: Options) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(plan, o, rs.service, labels(plan, "stage", stage=str(stage))),
            "spec": {"clusterIP": "None", "selector": labels(plan, "stage", stage=str(stage)),
                     "ports": [{"name": "grpc", "port": rs.port, "targetPort": "grpc", "protocol": "TCP"}]}}


def disruption_budget(plan: Plan, stage: int, rs: StageSet, o: Options) -> dict:
    # one pod of a stage at a time: with replicas the others carry the route; a stage of one pod still
    # lets a node drain (the route waits for it to come back, as for a restart in place)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(plan, o, rs.service, labels(plan, "stage", stage=str(stage))),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(plan, "stage", stage=str(stage))}}}


def store_claim(plan: Plan, o: Options) -> dict:
    size = sum(plan.bundle.weights or [0])
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": meta(plan, o, claim_name(plan), labels(plan, "store")),
            "spec": {"accessModes": ["ReadOnlyMany"],
                     "resources": {"requests": {"storage": mib(size + size // 10 + (64 << 20))}}}}


def gateway(plan: Plan, o: Options) -> list[dict]:
    d = plan.loaded.deployment
    name = dns(f"{base_name(plan)}-gateway", "Deployment")
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
    select = labels(plan, "gateway")
    mounts = [{"name": "state", "mountPath": STATE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict] = [{"name": "state", "emptyDir": {"sizeLimit": "64Mi"}},
                           {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if tls:
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": secret_name(name), "defaultMode": 0o440}})
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(plan, o, name, select),
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
                    "securityContext": HARDENED, "volumeMounts": mounts}],
                "volumes": volumes}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(plan, o, name, select),
               "spec": {"selector": select, "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http",
                                                       "protocol": "TCP"}]}}
    return [deployment, service]


def manifests(plan: Plan, o: Options) -> list[dict]:
    """Every object, in the order `kubectl apply` should meet them: the claim, per stage its Service,
    StatefulSets and budget (or the LeaderWorkerSet and its budget), then the gateway."""
    plan.check()
    out = [store_claim(plan, o)]
    if _lws(plan):
        g = lws_group(plan)
        return out + [leader_worker_set(plan, g, o), group_disruption_budget(plan, g, o)] + gateway(plan, o)
    sets = stage_sets(plan)
    for i in range(plan.stage_count()):
        mine = [rs for rs in sets if rs.stage == i]
        out += [stage_service(plan, i, mine[0], o), *(stateful_set(plan, rs, o) for rs in mine),
                disruption_budget(plan, i, mine[0], o)]
    return out + gateway(plan, o)


def members(plan: Plan) -> list[tuple[str, str, list[str]]]:
    """(Secret, member, the DNS names its certificate must hold) per pod and for the gateway."""
    out = []
    if _lws(plan):
        g = lws_group(plan)
        out = [(secret_name(pod), w.name, [f"{pod}.{g.name}"]) for pod, w in _group_workers(g)]
    else:
        for rs in stage_sets(plan):
            for k, w in enumerate(rs.workers):
                out.append((secret_name(rs.pod(k)), w.name, [f"{rs.pod(k)}.{rs.service}"]))
    gw = dns(f"{base_name(plan)}-gateway", "Deployment")
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
    if _lws(plan):
        out.append("kubernetes.workload = \"leaderworkerset\": the cluster needs the LeaderWorkerSet controller "
                   f"(kubernetes-sigs/lws, v0.7 or later: the {LWS_API} API with restartPolicy None); it makes the "
                   "headless Service the route's names resolve in")
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
