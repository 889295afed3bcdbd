"""What an image's root file system takes from the building host (dgr.toolchain.image): the shared libraries
an ELF file loads, as the host's loader finds them (`ld.so --list`, what ldd runs); those files at their
paths with every symlink on the way (Debian 12's /lib -> usr/lib); the tree as a deterministic tar layer;
and the Debian packages the files came from (their licenses, and the image manifest's list).

Standard library only: image.py imports it when Bazel runs it as a script.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import struct
import subprocess
import tarfile
from dataclasses import dataclass, field


class ImageError(Exception):
    """The message says what is wrong and what to do; `dgr release image` prints it."""


# ---- ELF: the machine, the loader, the libraries

ARCH = {0x3E: "amd64", 0xB7: "arm64"}  # e_machine -> the OCI architecture


def elf_arch(data: bytes, what: str) -> str:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ImageError(f"{what}: not a 64-bit ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in ARCH:
        raise ImageError(f"{what}: ELF machine {machine:#x} has no image architecture here (known: {ARCH})")
    return ARCH[machine]


def elf_interpreter(data: bytes) -> str | None:
    """PT_INTERP of a 64-bit little-endian ELF file (an executable's dynamic loader), or None (a library)."""
    phoff = struct.unpack_from("<Q", data, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 3:
            return data[p_offset:p_offset + p_filesz].rstrip(b"\0").decode()
    return None


_NEEDS = re.compile(r"^\s*(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$")
_LOADER = re.compile(r"^\s*(/\S+) \(0x[0-9a-f]+\)$")


def library_closure(paths: list[str], loader: str) -> list[str]:
    """Every shared library the ELF files at `paths` load, as the host's `loader` finds them
    (`ld.so --list`, what ldd runs), the loader included: absolute host paths, sorted."""
    found: set[str] = set()
    for p in paths:
        out = subprocess.run([loader, "--list", p], capture_output=True, text=True, env={"LC_ALL": "C"})
        if out.returncode != 0:
            raise ImageError(f"{loader} --list {p} failed ({out.returncode}): {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            m = _NEEDS.match(line)
            if m:
                if m.group(2) == "not found":
                    raise ImageError(f"{os.path.basename(p)} needs {m.group(1)}, which this host does not have: "
                                     "install it (Debian: `apt-file search` names the package) and build again")
                found.add(m.group(2))
                continue
            m = _LOADER.match(line)
            if m:
                found.add(m.group(1))
    return sorted(found)


# ---- the file tree of a layer

@dataclass
class Node:
    kind: str                          # "dir", "file" or "link"
    mode: int = 0o755
    data: bytes = b""
    target: str = ""                   # a link's
    uid: int = 0


@dataclass
class Tree:
    """Paths (relative to /, '/'-separated) -> nodes; parents are added as root-owned 0755 folders."""

    nodes: dict[str, Node] = field(default_factory=dict)

    def _parents(self, path: str) -> None:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            n = self.nodes.setdefault(d, Node("dir"))
            if n.kind != "dir":
                raise ImageError(f"/{d} is a {n.kind} in the image, but /{path} is inside it")

    def put(self, path: str, node: Node) -> None:
        path = path.strip("/")
        self._parents(path)
        old = self.nodes.get(path)
        if old is None or old == node or old == Node("dir") and node.kind == "dir":
            self.nodes[path] = node              # (a folder made as a parent takes the mode it is given later)
        elif not (node == Node("dir") and old.kind == "dir"):
            raise ImageError(f"/{path} would be put in the image twice, differently ({old.kind}, {node.kind})")

    def file(self, path: str, data: bytes, executable: bool = False) -> None:
        self.put(path, Node("file", 0o755 if executable else 0o644, data))

    def dir(self, path: str, mode: int = 0o755, uid: int = 0) -> None:
        self.put(path, Node("dir", mode, uid=uid))

    def host_path(self, path: str) -> None:
        """The host's file at `path` at the same path, every symlink on the way (in the folders or at
        the end) kept as the same symlink: what a library's path means on the host, it means here."""
        real = self._host_dir(os.path.dirname(path))
        p = os.path.join(real, os.path.basename(path))
        if os.path.islink(p):
            target = os.readlink(p)
            self.put(p, Node("link", 0o777, target=target))
            self.host_path(os.path.normpath(os.path.join(real, target)))
        elif os.path.isfile(p):
            st = os.stat(p)
            with open(p, "rb") as f:
                self.file(p, f.read(), executable=bool(st.st_mode & 0o111))
        else:
            raise ImageError(f"{p}: not a file on this host (a library the loader named)")

    def _host_dir(self, d: str) -> str:
        """`d` with its symlinks followed, each one put in the tree; returns the real folder."""
        if d in ("/", ""):
            return "/"
        real_parent = self._host_dir(os.path.dirname(d))
        p = os.path.join(real_parent, os.path.basename(d))
        if os.path.islink(p):
            target = os.readlink(p)
            self.put(p, Node("link", 0o777, target=target))
            return self._host_dir(os.path.normpath(os.path.join(real_parent, target)))
        return p

    def layer(self, mtime: int) -> bytes:
        """The tree as an uncompressed ustar archive: sorted, fixed times and owners, no names."""
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for path in sorted(self.nodes):
                n = self.nodes[path]
                info = tarfile.TarInfo(path + ("/" if n.kind == "dir" else ""))
                info.mtime, info.mode, info.uid, info.gid = mtime, n.mode, n.uid, n.uid
                info.uname = info.gname = ""
                if n.kind == "dir":
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                elif n.kind == "link":
                    info.type, info.linkname = tarfile.SYMTYPE, n.target
                    tar.addfile(info)
                else:
                    info.size = len(n.data)
                    tar.addfile(info, io.BytesIO(n.data))
        return raw.getvalue()


# ---- Debian: which package each library came from (licenses, and the image manifest's list)

def debian_packages(paths: list[str]) -> dict[str, tuple[str, str]]:
    """path -> (package, version) of the Debian package that installed it, for those dpkg knows ({} off
    Debian). dpkg knows a file by the path its package installed it at (/lib/... or /usr/lib/..., either
    side of merged /usr), so each path is asked as given, resolved, and across /usr. Two dpkg-query calls."""
    if not shutil.which("dpkg-query"):
        return {}
    tries: dict[str, list[str]] = {}
    for path in paths:
        ts = [path, os.path.realpath(path)]
        ts += [t[4:] if t.startswith("/usr/") else "/usr" + t for t in ts]
        tries[path] = list(dict.fromkeys(ts))
    asked = sorted({t for ts in tries.values() for t in ts})
    # exit 1 when some path is no package's: the others are still listed
    out = subprocess.run(["dpkg-query", "-S", *asked], capture_output=True, text=True, env={"LC_ALL": "C"}).stdout
    owner = {}
    for line in out.splitlines():
        pkgs, _, p = line.partition(": ")
        if p in asked and "diversion" not in pkgs:
            owner[p] = pkgs.split(",")[0].strip().split(":")[0]
    found = {path: next(owner[t] for t in ts if t in owner) for path, ts in tries.items() if any(t in owner for t in ts)}
    if not found:
        return {}
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Version}\n", *sorted(set(found.values()))],
                         capture_output=True, text=True, check=True, env={"LC_ALL": "C"}).stdout
    versions = dict(line.split("\t", 1) for line in out.splitlines())
    return {path: (pkg, versions[pkg]) for path, pkg in found.items()}
