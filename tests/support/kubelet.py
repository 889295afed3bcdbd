"""A stand-in kubelet for the Kubernetes render's tests: a rendered pod's containers run here as local
processes, their command, arguments and environment exactly as rendered, with what a node would supply
supplied locally:

- the image's programs (`<prefix>/bin/dgr-worker`, `<prefix>/bin/dgr`): this checkout's dgr-worker
  ($DGR_WORKER_BIN, as the tests find it) and dgr; or, where `images` names the container's image (an
  unpacked image's folder and config), the container's own command in a chroot of that image, as a
  runtime runs it (tests/support/images.py: its Env and the pod's, its user, the mounts, nothing of the host);
- the volumes: the claim is a local store folder, emptyDirs are fresh folders, Secrets are the keys
  `kubectl` was given (`Kubectl`: a stand-in for it that keeps what `secrets.sh` applies), with the
  volume's `defaultMode`; a pod's `fsGroup` owns its emptyDirs (setgid, group-writable) and Secret files,
  as the kubelet makes them; a mount's `subPathExpr` is expanded as the kubelet does;
- `$(VAR)` in command and arguments expanded from the container's environment, `fieldRef: metadata.name`
  as the pod's name;
- the network: each container port is a free local port, `0.0.0.0:PORT` in an argument becomes
  `127.0.0.1:<its port>`, and a pod's DNS name (`<pod>.<service>`) resolves to 127.0.0.1 (`resolve`).
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dgr.app.deploy.local import free_port
from support.images import HOST_PATH, container_command

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

# `kubectl create secret generic ... --dry-run=client -o yaml` and `kubectl apply -f -`, enough of them for
# secrets.sh: the Secret it would create, and applying one keeps it in $KUBECTL_STORE/<name>.yaml
_KUBECTL = '''
import base64, os, sys, pathlib, yaml
a = sys.argv[1:]
if a[:3] == ["create", "secret", "generic"]:
    s = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": a[3]}, "data": {}}
    i = 4
    while i < len(a):
        x = a[i]
        if x == "--namespace":
            s["metadata"]["namespace"] = a[i + 1]; i += 1
        elif x.startswith("--type="):
            s["type"] = x.split("=", 1)[1]
        elif x.startswith("--from-file="):
            key, path = x.split("=", 2)[1:]
            s["data"][key] = base64.b64encode(pathlib.Path(path).read_bytes()).decode()
        elif x not in ("--dry-run=client", "-o", "yaml"):
            sys.exit(f"kubectl stand-in: {x} is not understood")
        i += 1
    print(yaml.safe_dump(s))
elif a == ["apply", "-f", "-"]:
    s = yaml.safe_load(sys.stdin)
    pathlib.Path(os.environ["KUBECTL_STORE"], s["metadata"]["name"] + ".yaml").write_text(yaml.safe_dump(s))
    print(f"secret/{s['metadata']['name']} created")
else:
    sys.exit(f"kubectl stand-in: {a} is not understood")
'''


class Kubectl:
    """A `kubectl` on PATH that keeps the Secrets applied through it in `store`."""

    def __init__(self, root: Path):
        self.bin, self.store = root / "bin", root / "secrets"
        self.bin.mkdir(parents=True)
        self.store.mkdir()
        exe = self.bin / "kubectl"
        exe.write_text(f"#!{sys.executable}\n{_KUBECTL}")
        exe.chmod(0o755)

    def run(self, script: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "KUBECTL_STORE": str(self.store)}
        return subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=120)

    def secrets(self) -> dict[str, dict]:
        return {p.stem: yaml.safe_load(p.read_text()) for p in sorted(self.store.glob("*.yaml"))}


def programs(prefix: str) -> dict[str, list[str]]:
    """The image's programs as local commands."""
    from dgr.app.workerbin import worker_binary

    return {f"{prefix}/bin/dgr-worker": [str(worker_binary())], f"{prefix}/bin/dgr": [sys.executable, "-m", "dgr"]}


@dataclass
class Pod:
    """One pod of a rendered template: `name`, its spec, and the local folders standing in for its volumes."""

    name: str
    spec: dict
    root: Path
    claims: dict[str, Path]                   # claimName -> a local folder
    secrets: dict[str, dict]                  # Secret name -> the Secret (data base64, as kubectl applied it)
    ports: dict[int, int] = field(default_factory=dict)   # containerPort -> local port
    images: dict[str, tuple[Path, dict]] = field(default_factory=dict)   # image -> (unpacked root, config)

    def __post_init__(self):
        self.volumes = {v["name"]: self._volume(v) for v in self.spec.get("volumes", [])}
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            for p in c.get("ports", []):
                self.ports.setdefault(p["containerPort"], free_port("127.0.0.1"))

    def _volume(self, v: dict) -> Path:
        d = self.root / "volumes" / v["name"]
        if "persistentVolumeClaim" in v:
            return self.claims[v["persistentVolumeClaim"]["claimName"]]
        d.mkdir(parents=True)
        group = self.spec.get("securityContext", {}).get("fsGroup")
        if "emptyDir" in v:
            if group is not None:
                os.chown(d, -1, group)
                d.chmod(0o2777)
            else:
                d.chmod(0o777)
            return d
        source = v.get("projected") or v["secret"]
        mode = source.get("defaultMode", 0o644)
        sources = v["projected"]["sources"] if "projected" in v else [{"secret": {"name": v["secret"]["secretName"]}}]
        for src in sources:
            s = self.secrets[src["secret"]["name"]]
            items = src["secret"].get("items") or [{"key": k, "path": k} for k in s["data"]]
            for it in items:
                f = d / it["path"]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(base64.b64decode(s["data"][it["key"]]))
                if group is not None:
                    os.chown(f, -1, group)
                f.chmod(mode)
        return d

    def container(self, name: str) -> dict:
        return next(c for c in self.spec.get("initContainers", []) + self.spec["containers"] if c["name"] == name)

    def _env(self, c: dict) -> dict[str, str]:
        """The container's environment as the pod sees it."""
        out = {}
        for e in c.get("env", []):
            if "value" in e:
                out[e["name"]] = e["value"]
            elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
                out[e["name"]] = self.name
            else:
                raise AssertionError(f"the stand-in kubelet has no {e['valueFrom']}")
        return out

    def env(self, c: dict) -> dict[str, str]:
        """... with the paths of mounts mapped to their local folders."""
        return {k: self._path(c, v) for k, v in self._env(c).items()}

    def mounts(self, c: dict) -> dict[str, Path]:
        """mountPath -> the local folder, subPathExpr expanded from the container's environment."""
        env = self._env(c)
        out = {}
        for m in c.get("volumeMounts", []):
            sub = _VAR.sub(lambda x: env[x.group(1)], m.get("subPathExpr", m.get("subPath", "")))
            out[m["mountPath"]] = self.volumes[m["name"]] / sub if sub else self.volumes[m["name"]]
        return out

    def _path(self, c: dict, value: str) -> str:
        for mount, local in sorted(self.mounts(c).items(), key=lambda x: -len(x[0])):
            if value == mount or value.startswith(mount + "/"):
                return str(local) + value[len(mount):]
        return value

    def argv(self, c: dict, prefix: str, resolve: dict[str, str] | None = None) -> list[str]:
        """The container's command and arguments as a local command line: `$(VAR)` expanded, mount paths
        mapped to their folders, `0.0.0.0:PORT` to 127.0.0.1 and this pod's local port, and the names in
        `resolve` (a pod's `<pod>.<service>:<port>` -> a local HOST:PORT) replaced."""
        env = self._env(c)
        raw = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in c["command"] + c.get("args", [])]
        out = programs(prefix)[raw[0]] + [self._path(c, a) for a in raw[1:]]
        for port, local in self.ports.items():
            out = [a.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local}") for a in out]
        for name, local in (resolve or {}).items():
            out = [a.replace(name, local) for a in out]
        return out

    def probe_argv(self, c: dict, probe: str, prefix: str) -> list[str]:
        """A container's exec probe as a local command line: no `$(VAR)` expansion (the kubelet does none
        there), mount paths mapped, `127.0.0.1:PORT` to this pod's local port."""
        raw = c[probe]["exec"]["command"]
        out = programs(prefix)[raw[0]] + [self._path(c, a) for a in raw[1:]]
        for port, local in self.ports.items():
            out = [a.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local}") for a in out]
        return out

    def image_argv(self, c: dict, resolve: dict[str, str] | None = None) -> list[str]:
        """The container as a runtime runs it from its image (`images`): its command and arguments as
        rendered (`$(VAR)` expanded, the network mapped as in `argv`), in a chroot of the image, with the
        pod's environment and mounts (read-only where the mount says so)."""
        root, config = self.images[c["image"]]
        env = self._env(c)
        raw = [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in c["command"] + c.get("args", [])]
        for port, local in self.ports.items():
            raw = [a.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local}") for a in raw]
        for name, local in (resolve or {}).items():
            raw = [a.replace(name, local) for a in raw]
        read_only = {m["mountPath"]: m.get("readOnly", False) for m in c.get("volumeMounts", [])}
        volumes = {inside: (local, read_only[inside]) for inside, local in self.mounts(c).items()}
        return container_command(root, config, raw[1:], entrypoint=raw[:1], volumes=volumes, env=env)

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def popen(self, name: str, prefix: str, host_env: dict[str, str],
              resolve: dict[str, str] | None = None) -> subprocess.Popen:
        """Start container `name`; its output goes to `log(name)`. `host_env`: what the image would hold
        (the engine library's place)."""
        c = self.container(name)
        with open(self.log(name), "w") as out:
            if c["image"] in self.images:
                return subprocess.Popen(self.image_argv(c, resolve), env={"PATH": HOST_PATH, "LC_ALL": "C"},
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            return subprocess.Popen(self.argv(c, prefix, resolve), env={**os.environ, **host_env, **self.env(c)},
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
