"""Running the worker's image without a container runtime (tests/test_build_image.py, tests/test_build_deb.py).

An image is unpacked as a runtime does it (index.json -> manifest -> layers in order, each extracted over
the last) and its entrypoint run in a chroot of that folder, with what an OCI runtime gives a container and
nothing else of the host: its own mount namespace (`unshare -m`: the mounts die with the process), /proc,
a /dev holding null, zero, random and urandom, the volumes bind-mounted at their paths (read-only where
asked), the image's Env alone (`env -i`), and its User (`chroot --userspec`). The network is the host's (as
`--network host`): workers on loopback reach it and it reaches them.
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
                      entrypoint: list[str] | None = None) -> list[str]:
    """The argv that runs `entrypoint + args` (default: the image's Entrypoint) in a chroot of `root` as
    a runtime would: `volumes` maps a path inside to (host path, read-only)."""
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
    env = ["env", "-i", *c.get("Env", [])]
    chroot = shutil.which("chroot", path=HOST_PATH)
    lines.append("exec " + " ".join(shlex.quote(a) for a in [*env, chroot, f"--userspec={user}", str(root), *argv]))
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
