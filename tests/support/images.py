"""Running the worker's image without a container runtime (tests/builds/test_build_image.py, tests/builds/test_build_deb.py).

An image is unpacked as a runtime does it (index.json -> manifest -> layers in order, each extracted over
the last) and its entrypoint run in a chroot of that folder, with what an OCI runtime gives a container and
nothing else of the host: its own mount namespace (`unshare -m`: the mounts die with the process), /proc,
a /dev holding null, zero, random and urandom, the volumes bind-mounted at their paths (read-only where
asked), the image's Env alone (`env -i`), and its User (`chroot --userspec`). The network is the host's (as
`--network host`): workers on loopback reach it and it reaches them. `routes_around` joins such a worker,
serving stage 1 of SmolLM2, to ordinary workers serving stages 0 and 2, beside a route of three ordinary
workers; `same_generation` holds the two routes to the same tokens and logits.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import numpy as np

HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
DEVICES = ("null", "zero", "random", "urandom")
READY = re.compile(r"serving on (\S+:\d+)")


def require_root(what: str) -> None:
    """Fail (never skip) where the test cannot run: a chroot and mounts need root."""
    if os.geteuid() != 0:
        raise AssertionError(f"{what} needs root (chroot, mount namespaces, bind mounts): run the test as root, "
                             "as CI does; nothing here is skipped")


def synthetic_release(dest: Path, worker: Path, engine: Path, *, lane: str = "cpu", version: str = "0.0.0") -> Path:
    """A release_<lane>.tar.gz holding only what an image takes from one (toolchains/bazel/release.py's
    layout and MANIFEST.json): the checkout's worker and engine, in seconds, without Bazel."""
    import blake3

    top = f"dgr-{lane}"
    files = {"bin/dgr-worker": worker.read_bytes(), "lib/libdgr_engine.so": engine.read_bytes(),
             "release.json": json.dumps({"format": 1, "lane": lane, "version": version}).encode(),
             "upstream.json": json.dumps({"commit": "0" * 40, "tree_hash": "0" * 64, "patches": []}).encode()}
    manifest = {"format": 1, "lane": lane, "version": version,
                "upstream": {"commit": "0" * 40, "tree_hash": "0" * 64, "patches": []},
                "files": {p: {"size": len(d), "blake3": blake3.blake3(d).hexdigest()} for p, d in files.items()}}
    files["MANIFEST.json"] = json.dumps(manifest).encode()
    out = dest / f"release_{lane}.tar.gz"
    with tarfile.open(out, "w:gz") as tar:
        for path, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size, info.mode = len(data), 0o755 if path.startswith(("bin/", "lib/")) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return out


def image_config(layout: Path) -> tuple[dict, dict]:
    """(manifest, config) of the one image in an OCI layout."""
    index = json.loads((layout / "index.json").read_text())
    (entry,) = index["manifests"]
    blob = layout / "blobs" / "sha256"
    manifest = json.loads((blob / entry["digest"].split(":", 1)[1]).read_bytes())
    config = json.loads((blob / manifest["config"]["digest"].split(":", 1)[1]).read_bytes())
    return manifest, config


def unpack(layout: Path, root: Path) -> dict:
    """The image's layers extracted in order into `root` (owners kept: we are root); returns its config."""
    manifest, config = image_config(layout)
    root.mkdir(parents=True, exist_ok=True)
    for layer in manifest["layers"]:
        path = layout / "blobs" / "sha256" / layer["digest"].split(":", 1)[1]
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-xzf", str(path)], check=True)
    return config


def container_command(root: Path, config: dict, args: list[str], *, volumes: dict[str, tuple[Path, bool]],
                      entrypoint: list[str] | None = None, env: dict[str, str] | None = None) -> list[str]:
    """The argv that runs `entrypoint + args` (default: the image's Entrypoint) in a chroot of `root` as
    a runtime would: `volumes` maps a path inside to (host path, read-only); `env` (a pod's) is added to
    the image's Env, winning where both name a variable."""
    c = config["config"]
    user = c.get("User", "0:0")
    lines = ["set -e", f"r={shlex.quote(str(root))}",
             'mount -t proc proc "$r/proc"',
             'mount -t tmpfs -o mode=755,nosuid dev "$r/dev"']
    for d in DEVICES:
        lines += [f': > "$r/dev/{d}"', f'mount --bind /dev/{d} "$r/dev/{d}"']
    for inside, (host, read_only) in sorted(volumes.items()):
        target = f'"$r"{shlex.quote(inside)}'
        lines += [f"mkdir -p {target}" if host.is_dir() else f": > {target}",
                  f"mount --bind {shlex.quote(str(host))} {target}"]
        if read_only:
            lines.append(f"mount -o remount,bind,ro {target}")
    argv = (entrypoint or c["Entrypoint"]) + args
    environment = ["env", "-i", *c.get("Env", []), *(f"{k}={v}" for k, v in sorted((env or {}).items()))]
    chroot = shutil.which("chroot", path=HOST_PATH)
    lines.append("exec " + " ".join(shlex.quote(a) for a in [*environment, chroot, f"--userspec={user}", str(root),
                                                             *argv]))
    return ["unshare", "-m", "sh", "-c", "\n".join(lines)]


class Process:
    """A worker started by `argv` (a container_command): its output kept, read on a thread once it serves."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={"PATH": HOST_PATH, "LC_ALL": "C"})
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> str:
        """The HOST:PORT it prints once it serves; AssertionError with its output if it exits or is silent."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
                self._reader.start()
                return m.group(1)
        self.proc.kill()
        self.lines.extend(self.proc.stdout)
        raise AssertionError("the worker did not start:\n" + self.log)

    def stop(self) -> int:
        """SIGTERM (the worker drains and exits); its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        if self._reader:
            self._reader.join(timeout=10)
        return rc


# ---- a stage of SmolLM2 served from elsewhere, joined to a route of ordinary workers

PROMPT = "The three primary colors are"
MAX_NEW = 16


def routes_around(bundle: Path, engine_lib: Path, middle: Process, check, timeout: float = 300):
    """A route of three ordinary workers, and one of stages 0 and 2 as ordinary workers around `middle`
    (stage 1); `check(address)` looks at `middle` while it serves, and it is stopped (drained) before the others."""
    from dgr.app.local import LocalRoute
    from dgr.runtime.wire.client import RouteClient

    args = [["--bundle", str(bundle), "--stage", str(i), "--threads", "1", "--n-ctx", "512"] for i in range(3)]
    env = {"DGR_ENGINE_LIB": str(engine_lib)}
    with LocalRoute(args, env=env, timeout=timeout) as r:
        with RouteClient(r.addresses) as c:
            ordinary = c.run(PROMPT, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
        address = middle.wait_ready(timeout)
        route = [r.addresses[0], address, r.addresses[2]]
        try:
            with RouteClient(route) as c:
                mixed = c.run(PROMPT, max_new_tokens=MAX_NEW, logits="last", stop_token_ids=[])
                numerics = c.numerics
            check(address)
        finally:
            rc = middle.stop()
    print(middle.log)
    assert rc == 0 and "drained and stopped" in middle.log, middle.log
    return ordinary, mixed, numerics


def health(address: str) -> str:
    """grpc.health.v1's answer for the worker at `address` (SERVING once its stage is loaded)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def same_generation(ordinary, mixed, numerics) -> None:
    """One numerics on the route (docs/numerics.md), and the same tokens, text and logits as the ordinary route."""
    assert len(set(numerics)) == 1 and numerics[0].startswith("cpu/x86-64-v3 "), numerics
    assert mixed.token_ids == ordinary.token_ids and mixed.text == ordinary.text and mixed.text
    n = len(mixed.prompt_ids)
    rows = [k for k in range(n - 1, n - 1 + MAX_NEW)]
    assert all(np.array_equal(mixed.logits[k], ordinary.logits[k]) for k in rows)
