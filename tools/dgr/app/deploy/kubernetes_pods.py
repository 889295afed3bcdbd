"""The pods of `dgr deploy render --kubernetes` (dgr.app.deploy.kubernetes makes the objects around them):
the paths and ports the images and the render share, the images a render names (`Options`), and the spec
of a pod serving a stage: the worker's argv (`dgr.app.deploy.argv.worker_args`, as `dgr up` and the units
give it), its init container verifying the bundle, probes on the worker's health service, resources from the
planner's memory estimate, hardening, and under [tls] its own Secret projected by the pod's name."""

from __future__ import annotations

from dataclasses import dataclass

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
MAX_STS = 52                          # a StatefulSet's pods carry `<name>-<hash>` labels of at most 63


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


def dns(name: str, what: str, limit: int = 63) -> str:
    n = name.replace("_", "-")
    if len(n) > limit or n.startswith("-") or n.endswith("-"):
        raise DeployError(f"{what} {n!r}: a Kubernetes name of at most {limit} characters that starts and ends "
                          "with a letter or digit; shorten the deployment's or the host's name")
    return n


def base_name(plan: Plan) -> str:
    return dns(plan.name, "deployment name")


def mutual(plan: Plan) -> bool:
    t = plan.loaded.deployment.tls
    return t is not None and t.mutual


def labels(plan: Plan, component: str, **more: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dgr", "app.kubernetes.io/instance": base_name(plan),
            "app.kubernetes.io/component": component, **{f"dgr/{k}": v for k, v in more.items()}}


def meta(plan: Plan, o: Options, name: str, labels: dict[str, str]) -> dict:
    m: dict = {"name": name, "labels": {**labels, "app.kubernetes.io/managed-by": "dgr",
                                        "app.kubernetes.io/version": __version__}}
    if o.namespace:
        m["namespace"] = o.namespace
    return m


def mib(n: int) -> str:
    return f"{-(-n // (1 << 20))}Mi"


HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
             "capabilities": {"drop": ["ALL"]}}


def probe(how: dict, period: int, failures: int) -> dict:
    return {**how, "periodSeconds": period, "timeoutSeconds": 5, "failureThreshold": failures}


def probe_action(port: int, tls: dict[str, str], mutual: bool, prefix: str) -> dict:
    """How the kubelet asks a worker's health: its gRPC probe in plaintext; under mutual TLS the worker's own
    `--probe` with the pod's certificate (no $(VAR) in it: the kubelet does not expand an exec probe's command);
    under server-only TLS a TCP connect."""
    if not tls:
        return {"grpc": {"port": port}}
    if not mutual:
        return {"tcpSocket": {"port": "grpc"}}
    flags = [x for flag in ("--tls-cert", "--tls-key", "--tls-ca") for x in (flag, tls[flag])]
    return {"exec": {"command": [f"{prefix}/bin/dgr-worker", "--probe", f"127.0.0.1:{port}", *flags,
                                 "--rpc-timeout", "4"]}}


def bundle_folder(plan: Plan) -> str:
    info = plan.bundle
    if not (info.id and info.name):
        raise DeployError(f"{info.label}: its id is not known yet (the pods name the bundle folder "
                          f"{STORE_MOUNT}/<name>-<id12> in the claim): build it first (`dgr recipe build "
                          f"{info.recipe_path} --store STORE`, or `dgr up`), or give bundle.id")
    return f"{STORE_MOUNT}/{info.name}-{info.id[:12]}"


def claim_name(plan: Plan) -> str:
    return dns(f"{base_name(plan)}-store", "PersistentVolumeClaim")


def secret_name(pod: str) -> str:
    return dns(f"{pod}-tls", "Secret", 253)


def pod_spec(plan: Plan, ws: list[WorkerPlan], stage: str, port: int, service: str, pods: list[str],
             o: Options) -> dict:
    """The spec of a pod serving one of `ws`'s stages (`stage`: its number, or `$(LWS_WORKER_INDEX)` where
    the pod learns it from its group) on `port`, advertised as `$(POD_NAME).<service>`; under [tls] it
    mounts its own of `pods`' Secrets. Resources fit the largest of `ws`."""
    d = plan.loaded.deployment
    w0 = ws[0]
    bundle = bundle_folder(plan)
    files = tls_files(plan, w0)
    tls = d.tls is not None
    tls_paths = {flag: f"{TLS_MOUNT}/{TLS_KEYS[flag]}" for flag in files}
    args = worker_args(plan, w0, bundle, port, bind="0.0.0.0", tls=tls_paths,
                       insecure=d.worker.insecure or not mutual(plan))
    args[args.index("--stage") + 1] = stage
    # peers and errors name the pod as the route does, never its bare host name (which other pods cannot resolve)
    args += ["--advertise", f"$(POD_NAME).{service}"]
    memory = mib(max(plan.memory_estimate(w) for w in ws))
    limits = {"memory": memory}
    if w0.host.lane in GPU:
        limits[GPU[w0.host.lane]] = "1"
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "DGR_WORKSPACE", "value": STATE_MOUNT}]
    mounts = [{"name": "store", "mountPath": STORE_MOUNT, "readOnly": True},
              {"name": "state", "mountPath": STATE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    health = probe_action(port, tls_paths if tls else {}, tls and mutual(plan), o.prefix)
    tls_mount = [{"name": "tls", "mountPath": TLS_MOUNT, "subPathExpr": "$(POD_NAME)", "readOnly": True}] if tls else []
    worker = {
        "name": "worker", "image": o.image, "imagePullPolicy": "IfNotPresent",
        "command": [f"{o.prefix}/bin/dgr-worker"], "args": args, "env": env,
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"}],
        "startupProbe": probe(health, 5, STARTUP_S // 5),
        "readinessProbe": probe(health, 5, 2),
        "livenessProbe": probe(health, 10, 3),
        "resources": {"requests": {"cpu": str(d.worker.threads or 1), "memory": memory}, "limits": limits},
        "securityContext": HARDENED, "volumeMounts": mounts + tls_mount,
    }
    verify = {
        "name": "verify-bundle", "image": o.tools_image, "imagePullPolicy": "IfNotPresent",
        "command": [f"{o.prefix}/bin/dgr", "bundle", "verify", bundle, "--stage", stage,
                    "--expect-id", plan.bundle.id, "-q"],
        "env": [{"name": "DGR_WORKSPACE", "value": STATE_MOUNT}],
        "resources": {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": HARDENED, "volumeMounts": mounts,
    }
    volumes: list[dict] = [
        {"name": "store", "persistentVolumeClaim": {"claimName": claim_name(plan), "readOnly": True}},
        {"name": "state", "emptyDir": {"sizeLimit": "64Mi"}}, {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if tls:
        volumes.append({"name": "tls", "projected": {"defaultMode": 0o440, "sources": [
            {"secret": {"name": secret_name(pod), "items": [
                {"key": key, "path": f"{pod}/{key}"} for key in TLS_KEYS.values()]}}
            for pod in pods]}})
    return {
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": int(d.worker.drain_timeout) + 5,
        "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER,
                            "fsGroup": USER, "fsGroupChangePolicy": "OnRootMismatch",
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [verify], "containers": [worker], "volumes": volumes}


def layers_note(ws: list[WorkerPlan]) -> str:
    return " ".join(f"[{b}, {e})" for b, e in dict.fromkeys(w.layers for w in ws))
