#!/usr/bin/env python3
"""The OCI image of a lane's worker, made from its release archive: dgr-worker, the engine library and the
shared libraries they load; no shell, no Python, nothing else.

    python3 tools/dgr/toolchain/image.py --release release_cpu.tar.gz --tar image_cpu.tar \\
            --manifest image_cpu.MANIFEST.json [--layout DIR]
    python3 tools/dgr/toolchain/image.py --refuse-lane cuda      # a lane with no image: say what it needs, exit 1

What the image holds (/ is the container's root):
    /opt/dgr/bin/dgr-worker, /opt/dgr/lib/libdgr_engine.so   the release's own files, checked against its
                                    MANIFEST.json (the prefix of `dgr deploy render --systemd/--kubernetes`)
    /opt/dgr/release.json, /opt/dgr/upstream.json         what the release says it is
    the dynamic loader and every library the two need      as the loader finds them on the building host
                                    (`ld.so --list`), at the same paths, with the symlinks on the way
                                    (Debian 12: /lib -> usr/lib), and each Debian package's copyright file
    /etc/passwd, /etc/group          root, and `dgr` (65532), the user the image runs as (kubernetes.USER)
    /etc/dgr/tls                     empty: TLS files are mounted there (no CA is baked in)
    /var/lib/dgr/store               empty: the store holding the bundle, mounted read-only
    /var/lib/dgr/state               the worker's state, the user's own; /tmp (1777)
Two layers (the system's libraries, then dgr's files), so that a new dgr over the same host libraries
changes one. Health: the worker's gRPC health service (grpc.health.v1, SERVING once the stage is loaded),
which orchestrators probe themselves; there is no shell or probe binary to run a Docker HEALTHCHECK.

Same release, same host libraries, same bytes: layers are ustar archives with entries sorted, mtime
SOURCE_DATE_EPOCH (else 0), owner 0:0 (the state folder 65532), no user or group names and no pax
headers; gzip without a name or time; JSON with sorted keys. The image's digest (its manifest's sha256)
goes into image_<lane>.MANIFEST.json beside the release's, with the release it was made from.

Outputs: the OCI image layout (oci-layout, index.json, blobs/sha256/...) plus Docker's manifest.json, as a
folder (--layout) and as one tar of that folder (--tar): `docker load -i`, `podman load -i` and
`skopeo copy oci-archive:` all take it.

Standard library only: run by path by the Bazel target `//:image_<lane>` (toolchains/lanes.bzl, plain
python3, no dgr installed) and imported by `dgr release image`. The blake3 checks use the release's own
dgr-worker (`--blake3`), as toolchains/bazel/release.py does.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

PREFIX = "/opt/dgr"                    # = dgr.app.deploy.systemd.DEFAULT_PREFIX (a test holds them equal)
USER = 65532                           # = dgr.app.deploy.kubernetes.USER
USER_NAME = "dgr"
STORE = "/var/lib/dgr/store"           # = kubernetes.STORE_MOUNT
STATE = "/var/lib/dgr/state"           # = kubernetes.STATE_MOUNT
TLS = "/etc/dgr/tls"                   # = kubernetes.TLS_MOUNT
PORT = 7000                            # = kubernetes.DEFAULT_PORT (documentation only: --listen decides)
REPOSITORY = "dgr-worker"              # the image's name: dgr-worker:<version>, as the Kubernetes render names it

# Lanes with an image, and why the others have none: the `//:image_<lane>` targets of a declared lane run
# `--refuse-lane` and `dgr release image` refuses such a release, both with this text.
LANE_IMAGES = {
    "cpu": "",
    "cuda": ("the CUDA lane's image is declared, not built: its engine links libcuda.so.1, the host driver's "
             "own library, which an image must not carry (the NVIDIA Container Toolkit mounts the driver's into "
             "the container, with the device nodes: `--gpus`, or the nvidia.com/gpu device plugin), while the "
             "CUDA runtime it also links (libcudart, libcublas, libcublasLt) must come from the toolkit release "
             "it was built with; and no CUDA host is here to run one. Build it on a CUDA host from an "
             "nvidia/cuda runtime base of the same CUDA version"),
    "vulkan": ("the Vulkan lane's image is declared, not built: the Vulkan loader (libvulkan.so.1) finds its "
               "driver at run time (an ICD: Mesa's lavapipe or radv, or the GPU vendor's, named by a JSON file in "
               "/usr/share/vulkan/icd.d) and dlopens it, so the loader's closure that makes this image misses it; "
               "the image needs the ICD, its manifest and its own libraries chosen per GPU, and /dev/dri from the "
               "host"),
    "rocm": "the ROCm lane is declared, not built (toolchains/lanes.bzl): there is no release to make an image of",
    "metal": "the Metal lane runs on macOS only: there is no Linux image of it",
}

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"

PASSWD = f"root:x:0:0:root:/root:/sbin/nologin\n{USER_NAME}:x:{USER}:{USER}:dgr worker:/nonexistent:/sbin/nologin\n"
GROUP = f"root:x:0:\n{USER_NAME}:x:{USER}:\n"
# glibc's own defaults, written down: names from /etc/hosts (which runtimes mount), then DNS
NSSWITCH = "passwd: files\ngroup: files\nhosts: files dns\n"


class ImageError(Exception):
    """The message says what is wrong and what to do; `dgr release image` prints it."""


# ---- the release

@dataclass(frozen=True)
class Release:
    lane: str
    version: str
    files: dict[str, bytes]            # path inside the release's top folder -> bytes, for the files used
    manifest: dict
    sha256: str                        # of the archive
    name: str                          # the archive's file name


WANTED = ("bin/dgr-worker", "lib/libdgr_engine.so", "release.json", "upstream.json", "MANIFEST.json")


def read_release(path: str) -> Release:
    """The files of a release archive (toolchains/bazel/release.py) that an image carries."""
    try:
        data = open(path, "rb").read()
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except (OSError, tarfile.TarError) as err:
        raise ImageError(f"{path}: not a readable release archive ({err}); build one with `dgr release build`") from err
    with tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        tops = {n.split("/", 1)[0] for n in members}
        if len(tops) != 1:
            raise ImageError(f"{path}: a release has one top folder, this has {sorted(tops)}")
        top = tops.pop()
        files = {}
        for rel in WANTED:
            m = members.get(f"{top}/{rel}")
            if m is None:
                raise ImageError(f"{path}: no {top}/{rel}: not a release of dgr-worker (toolchains/bazel/release.py)")
            files[rel] = tar.extractfile(m).read()
    info = json.loads(files["release.json"])
    manifest = json.loads(files["MANIFEST.json"])
    return Release(info["lane"], info["version"], files, manifest, hashlib.sha256(data).hexdigest(),
                   os.path.basename(path))


def refusal(lane: str) -> str:
    """'' where the lane has an image, else why not (and what it would need)."""
    if lane not in LANE_IMAGES:
        return f"no lane {lane!r}: the lanes are {', '.join(LANE_IMAGES)}"
    return LANE_IMAGES[lane]


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


# ---- the image

def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _gzip(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return out.getvalue()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blake3(worker: bytes, blobs: dict[str, bytes]) -> dict[str, str]:
    """The blake3 of each blob, by the release's own dgr-worker (`--blake3`), which this host must run."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "dgr-worker")
        with open(exe, "wb") as f:
            f.write(worker)
        os.chmod(exe, 0o755)
        argv, names = [exe], {}
        for i, (key, data) in enumerate(sorted(blobs.items())):
            names[key] = os.path.join(tmp, f"blob{i}")
            with open(names[key], "wb") as f:
                f.write(data)
            argv += ["--blake3", names[key]]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            raise ImageError(f"the release's dgr-worker --blake3 failed ({out.returncode}): {out.stderr.strip()}")
        by_file = {p: d for d, p in (line.split("  ", 1) for line in out.stdout.splitlines())}
        return {key: by_file[n] for key, n in names.items()}


@dataclass(frozen=True)
class Image:
    blobs: dict[str, bytes]            # "sha256:<hex>" -> bytes
    index: bytes                       # index.json
    docker_manifest: bytes             # manifest.json (`docker load`)
    digest: str                        # the image manifest's: what a registry names the image by
    record: dict                       # image_<lane>.MANIFEST.json

    def layout_files(self) -> dict[str, bytes]:
        files = {f"blobs/sha256/{d.split(':', 1)[1]}": b for d, b in self.blobs.items()}
        files["oci-layout"] = _json({"imageLayoutVersion": "1.0.0"})
        files["index.json"] = self.index
        files["manifest.json"] = self.docker_manifest
        return files

    def tar(self, mtime: int) -> bytes:
        tree = Tree()
        for path, data in self.layout_files().items():
            tree.file(path, data)
        return tree.layer(mtime)

    def write_layout(self, out: str) -> None:
        os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)
        for path, data in sorted(self.layout_files().items()):
            with open(os.path.join(out, path), "wb") as f:
                f.write(data)


def source_date_epoch() -> int:
    v = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not v.isdigit():
        raise ImageError(f"SOURCE_DATE_EPOCH={v!r}: seconds since 1970 (an integer), or unset for 0")
    return int(v)


def build(release: Release, *, mtime: int = 0, repository: str = REPOSITORY) -> Image:
    """The image of `release` (its lane must have one), its libraries taken from this host."""
    why = refusal(release.lane)
    if why:
        raise ImageError(f"{release.name}: {why}")
    worker, engine = release.files["bin/dgr-worker"], release.files["lib/libdgr_engine.so"]
    sums = _blake3(worker, {"bin/dgr-worker": worker, "lib/libdgr_engine.so": engine})
    for rel, got in sums.items():
        want = release.manifest.get("files", {}).get(rel, {}).get("blake3")
        if got != want:
            raise ImageError(f"{release.name}: {rel} does not match the release's MANIFEST.json (blake3 {got[:16]}..., "
                             f"manifest {str(want)[:16]}...): the archive is damaged; `dgr release verify` it")
    arch = elf_arch(worker, "bin/dgr-worker")
    if elf_arch(engine, "lib/libdgr_engine.so") != arch:
        raise ImageError(f"{release.name}: bin/dgr-worker and lib/libdgr_engine.so are built for different machines")
    loader = elf_interpreter(worker)
    if not loader or not os.path.exists(loader):
        raise ImageError(f"bin/dgr-worker's loader {loader} is not on this host: build the image where the release runs")

    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for rel, data in (("dgr-worker", worker), ("libdgr_engine.so", engine)):
            paths.append(os.path.join(tmp, rel))
            with open(paths[-1], "wb") as f:
                f.write(data)
        libraries = library_closure(paths, loader)

    system = Tree()
    debian = debian_packages(libraries)
    owners: dict[str, dict] = {}
    for lib in libraries:
        system.host_path(lib)
        pkg, version = debian.get(lib, (None, None))
        owners[lib] = {"package": pkg, "version": version}
    for pkg in sorted({pkg for pkg, _ in debian.values()}):
        copyright = f"/usr/share/doc/{pkg}/copyright"
        if os.path.lexists(copyright):
            system.host_path(copyright)
    system.file("etc/passwd", PASSWD.encode())
    system.file("etc/group", GROUP.encode())
    system.file("etc/nsswitch.conf", NSSWITCH.encode())
    system.dir(TLS)
    system.dir(STORE)
    system.dir(STATE, 0o750, uid=USER)
    system.dir("tmp", 0o1777)
    for d in ("dev", "proc", "sys"):                   # where runtimes mount theirs (and a chroot of the layers)
        system.dir(d)

    dgr = Tree()
    dgr.file(f"{PREFIX}/bin/dgr-worker", worker, executable=True)
    dgr.file(f"{PREFIX}/lib/libdgr_engine.so", engine, executable=True)
    dgr.file(f"{PREFIX}/release.json", release.files["release.json"])
    dgr.file(f"{PREFIX}/upstream.json", release.files["upstream.json"])

    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))
    blobs: dict[str, bytes] = {}
    layers, diff_ids, history = [], [], []
    for tree, what in ((system, "the loader and the shared libraries of dgr-worker and libdgr_engine.so, "
                                "from the building host (ld.so --list); users; mount points"),
                       (dgr, f"dgr-worker and libdgr_engine.so of the {release.lane} release {release.version}")):
        raw = tree.layer(mtime)
        gz = _gzip(raw)
        blobs[_sha(gz)] = gz
        diff_ids.append(_sha(raw))
        layers.append({"mediaType": MEDIA_LAYER, "digest": _sha(gz), "size": len(gz)})
        history.append({"created": created, "created_by": f"dgr release image: {what}"})

    ref = f"{repository}:{release.version}"
    labels = {
        "org.opencontainers.image.title": repository,
        "org.opencontainers.image.description": f"dgr stage worker, {release.lane} lane: one stage of a GGUF bundle "
                                                "over gRPC (docs/deploy.md, Container image)",
        "org.opencontainers.image.version": release.version,
        "dgr.lane": release.lane,
        "dgr.llama-cpp.commit": release.manifest.get("upstream", {}).get("commit", ""),
        "dgr.release.sha256": release.sha256,
        "dgr.mounts": f"the bundle's store read-only at {STORE}, TLS files at {TLS}, state at {STATE}, /tmp writable",
        # Docker's HEALTHCHECK runs a command in the container; this image has none to run
        "dgr.health": "grpc.health.v1 on the --listen port (SERVING once the stage is loaded, NOT_SERVING while it "
                      "drains): a Kubernetes grpc probe, or grpc_health_probe from outside; TCP connect under "
                      "mutual TLS (the port opens only once the stage is loaded)",
    }
    config = {
        "created": created,
        "architecture": arch,
        "os": "linux",
        "config": {
            "User": f"{USER}:{USER}",
            "Entrypoint": [f"{PREFIX}/bin/dgr-worker"],
            "Cmd": ["--help"],
            # the engine by name (dgr-worker would find it in ../lib through /proc/self/exe)
            "Env": [f"PATH={PREFIX}/bin", f"DGR_ENGINE_LIB={PREFIX}/lib/libdgr_engine.so"],
            "WorkingDir": STATE,
            "ExposedPorts": {f"{PORT}/tcp": {}},
            "StopSignal": "SIGTERM",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": history,
    }
    config_bytes = _json(config)
    blobs[_sha(config_bytes)] = config_bytes
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": _sha(config_bytes), "size": len(config_bytes)},
        "layers": layers,
        "annotations": {"org.opencontainers.image.version": release.version, "org.opencontainers.image.created": created},
    }
    manifest_bytes = _json(manifest)
    digest = _sha(manifest_bytes)
    blobs[digest] = manifest_bytes
    index = _json({
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [{"mediaType": MEDIA_MANIFEST, "digest": digest, "size": len(manifest_bytes),
                       "platform": {"architecture": arch, "os": "linux"},
                       "annotations": {"org.opencontainers.image.ref.name": release.version,
                                       "io.containerd.image.name": ref}}],
    })
    docker = _json([{"Config": "blobs/sha256/" + _sha(config_bytes)[7:], "RepoTags": [ref],
                     "Layers": ["blobs/sha256/" + layer["digest"][7:] for layer in layers]}])
    record = {
        "format": 1,
        "ref": ref,
        "digest": digest,
        "config": _sha(config_bytes),
        "lane": release.lane,
        "version": release.version,
        "architecture": arch,
        "size": sum(len(b) for b in blobs.values()),
        "release": {"archive": release.name, "sha256": release.sha256,
                    "upstream": release.manifest.get("upstream", {})},
        "layers": [{**layer, "diff_id": d, "created_by": h["created_by"]}
                   for layer, d, h in zip(layers, diff_ids, history)],
        "files": {f"{PREFIX}/{rel}": release.manifest["files"][rel] for rel in sorted(sums)},
        "libraries": owners,
    }
    return Image(blobs, index, docker, digest, record)


def record_bytes(image: Image) -> bytes:
    return (json.dumps(image.record, indent=2, sort_keys=True) + "\n").encode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="image.py", description="The OCI image of a release's dgr-worker.")
    p.add_argument("--release", help="release_<lane>.tar.gz (toolchains/bazel/release.py)")
    p.add_argument("--tar", help="write the image as one tar here (OCI layout + Docker's manifest.json)")
    p.add_argument("--layout", help="write the image as an OCI layout folder here")
    p.add_argument("--manifest", help="write image_<lane>.MANIFEST.json here (the digest, the release, the layers)")
    p.add_argument("--repository", default=REPOSITORY, help="the image's name (default: %(default)s)")
    p.add_argument("--refuse-lane", metavar="LANE", help="print why LANE has no image and exit 1")
    args = p.parse_args(argv)
    try:
        if args.refuse_lane:
            raise ImageError(refusal(args.refuse_lane) or f"the {args.refuse_lane} lane has an image: give --release")
        if not args.release or not (args.tar or args.layout or args.manifest):
            p.error("give --release and at least one of --tar, --layout, --manifest")
        mtime = source_date_epoch()
        image = build(read_release(args.release), mtime=mtime, repository=args.repository)
        if args.tar:
            with open(args.tar, "wb") as f:
                f.write(image.tar(mtime))
        if args.layout:
            image.write_layout(args.layout)
        if args.manifest:
            with open(args.manifest, "wb") as f:
                f.write(record_bytes(image))
    except ImageError as err:
        print(f"image.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
