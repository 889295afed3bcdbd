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

Standard library only (with dgr.toolchain.rootfs, which takes the host's files): run by path by the Bazel
target `//:image_<lane>` (toolchains/lanes.bzl, plain python3, no dgr installed) and imported by `dgr
release image`. The blake3 checks use the release's own dgr-worker (`--blake3`), as release.py does.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script (Bazel's //:image_<lane>), where dgr is not installed: import dgr.toolchain.rootfs from
    # the source tree (the package's __init__ files import nothing). The script's own folder leaves sys.path:
    # it holds dgr's modules, whose names must not stand in for the standard library's.
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))  # tools/

import argparse  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from dgr.toolchain.rootfs import (ImageError, Tree, debian_packages, elf_arch, elf_interpreter,  # noqa: E402
                                  library_closure)

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
             "it was built with. Build it on a CUDA host from an nvidia/cuda runtime base of that CUDA version"),
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


# ---- the release

@dataclass(frozen=True)
class Release:
    lane: str
    version: str
    files: dict[str, bytes]            # path inside the release's top folder -> bytes, for the files used
    manifest: dict
    sha256: str                        # of the archive
    name: str                          # the archive's file name
    executable: frozenset[str] = frozenset()   # the paths among `files` with an executable bit


WANTED = ("bin/dgr-worker", "lib/libdgr_engine.so", "release.json", "upstream.json", "MANIFEST.json")


def read_release(path: str, everything: bool = False) -> Release:
    """The files of a release archive (toolchains/bazel/release.py) that the worker's image carries, or with
    `everything` all of them (the tools image: bin/dgr and its Python)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except (OSError, tarfile.TarError) as err:
        raise ImageError(f"{path}: not a readable release archive ({err}); build one with `dgr release build`") from err
    with tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        tops = {n.split("/", 1)[0] for n in members}
        if len(tops) != 1:
            raise ImageError(f"{path}: a release has one top folder, this has {sorted(tops)}")
        top = tops.pop()
        files, executable = {}, set()
        for rel in WANTED:
            if f"{top}/{rel}" not in members:
                raise ImageError(f"{path}: no {top}/{rel}: not a release of dgr-worker (toolchains/bazel/release.py)")
        wanted = [n[len(top) + 1:] for n in sorted(members)] if everything else WANTED
        for rel in wanted:
            m = members[f"{top}/{rel}"]
            files[rel] = tar.extractfile(m).read()
            if m.mode & 0o111:
                executable.add(rel)
    info = json.loads(files["release.json"])
    manifest = json.loads(files["MANIFEST.json"])
    return Release(info["lane"], info["version"], files, manifest, hashlib.sha256(data).hexdigest(),
                   os.path.basename(path), frozenset(executable))


def refusal(lane: str) -> str:
    """'' where the lane has an image, else why not (and what it would need)."""
    if lane not in LANE_IMAGES:
        return f"no lane {lane!r}: the lanes are {', '.join(LANE_IMAGES)}"
    return LANE_IMAGES[lane]


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


def blake3_sums(worker: bytes, blobs: dict[str, bytes]) -> dict[str, str]:
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


BINARIES = ("bin/dgr-worker", "lib/libdgr_engine.so")


def check_release(release: Release) -> str:
    """The release's worker and engine match its MANIFEST.json and are built for one machine; returns it
    (the OCI architecture, which is also Debian's name for it)."""
    worker, engine = (release.files[b] for b in BINARIES)
    sums = blake3_sums(worker, {b: release.files[b] for b in BINARIES})
    for rel, got in sums.items():
        want = release.manifest.get("files", {}).get(rel, {}).get("blake3")
        if got != want:
            raise ImageError(f"{release.name}: {rel} does not match the release's MANIFEST.json (blake3 {got[:16]}..., "
                             f"manifest {str(want)[:16]}...): the archive is damaged; `dgr release verify` it")
    arch = elf_arch(worker, "bin/dgr-worker")
    if elf_arch(engine, "lib/libdgr_engine.so") != arch:
        raise ImageError(f"{release.name}: bin/dgr-worker and lib/libdgr_engine.so are built for different machines")
    return arch


def release_libraries(release: Release) -> list[str]:
    """The loader and every shared library the release's worker and engine load, as this host has them."""
    worker = release.files["bin/dgr-worker"]
    loader = elf_interpreter(worker)
    if not loader or not os.path.exists(loader):
        raise ImageError(f"bin/dgr-worker's loader {loader} is not on this host: build where the release runs")
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for rel in BINARIES:
            paths.append(os.path.join(tmp, os.path.basename(rel)))
            with open(paths[-1], "wb") as f:
                f.write(release.files[rel])
        return library_closure(paths, loader)


def system_layer(libraries: list[str]) -> tuple[Tree, dict[str, dict]]:
    """The host's `libraries` at their paths, their Debian packages' copyright files, the users and the
    mount points; and each library's package (the image manifest's list)."""
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
    return system, owners


def assemble(release: Release, arch: str, layers: list[tuple[Tree, str]], *, mtime: int, repository: str,
              description: str, entrypoint: list[str], env: list[str], port: int, labels: dict[str, str],
              record: dict) -> Image:
    """The OCI image of `layers` (each a tree and what it holds), configured to run `entrypoint` as USER."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime))
    blobs: dict[str, bytes] = {}
    manifest_layers, diff_ids, history = [], [], []
    for tree, what in layers:
        raw = tree.layer(mtime)
        gz = _gzip(raw)
        blobs[_sha(gz)] = gz
        diff_ids.append(_sha(raw))
        manifest_layers.append({"mediaType": MEDIA_LAYER, "digest": _sha(gz), "size": len(gz)})
        history.append({"created": created, "created_by": f"dgr release image: {what}"})

    ref = f"{repository}:{release.version}"
    labels = {
        "org.opencontainers.image.title": repository,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.version": release.version,
        "dgr.lane": release.lane,
        "dgr.llama-cpp.commit": release.manifest.get("upstream", {}).get("commit", ""),
        "dgr.release.sha256": release.sha256,
        **labels,
    }
    config = {
        "created": created,
        "architecture": arch,
        "os": "linux",
        "config": {
            "User": f"{USER}:{USER}",
            "Entrypoint": entrypoint,
            "Cmd": ["--help"],
            "Env": env,
            "WorkingDir": STATE,
            "ExposedPorts": {f"{port}/tcp": {}},
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
        "layers": manifest_layers,
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
                     "Layers": ["blobs/sha256/" + layer["digest"][7:] for layer in manifest_layers]}])
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
                   for layer, d, h in zip(manifest_layers, diff_ids, history)],
        **record,
    }
    return Image(blobs, index, docker, digest, record)


def build(release: Release, *, mtime: int = 0, repository: str = REPOSITORY) -> Image:
    """The worker's image of `release` (its lane must have one), its libraries taken from this host."""
    why = refusal(release.lane)
    if why:
        raise ImageError(f"{release.name}: {why}")
    arch = check_release(release)
    worker, engine = (release.files[b] for b in BINARIES)
    system, owners = system_layer(release_libraries(release))

    dgr = Tree()
    dgr.file(f"{PREFIX}/bin/dgr-worker", worker, executable=True)
    dgr.file(f"{PREFIX}/lib/libdgr_engine.so", engine, executable=True)
    dgr.file(f"{PREFIX}/release.json", release.files["release.json"])
    dgr.file(f"{PREFIX}/upstream.json", release.files["upstream.json"])

    return assemble(
        release, arch,
        [(system, "the loader and the shared libraries of dgr-worker and libdgr_engine.so, from the building host "
                  "(ld.so --list); users; mount points"),
         (dgr, f"dgr-worker and libdgr_engine.so of the {release.lane} release {release.version}")],
        mtime=mtime, repository=repository,
        description=f"dgr stage worker, {release.lane} lane: one stage of a GGUF bundle over gRPC (docs/deploy.md, "
                    "Container image)",
        entrypoint=[f"{PREFIX}/bin/dgr-worker"],
        # the engine by name (dgr-worker would find it in ../lib through /proc/self/exe)
        env=[f"PATH={PREFIX}/bin", f"DGR_ENGINE_LIB={PREFIX}/lib/libdgr_engine.so"],
        port=PORT,
        labels={
            "dgr.mounts": f"the bundle's store read-only at {STORE}, TLS files at {TLS}, state at {STATE}, /tmp writable",
            # Docker's HEALTHCHECK runs a command in the container; this image has none to run
            "dgr.health": "grpc.health.v1 on the --listen port (SERVING once the stage is loaded, NOT_SERVING while "
                          "it drains): a Kubernetes grpc probe in plaintext; under mutual TLS the exec probe "
                          "`dgr-worker --probe 127.0.0.1:PORT` with the pod's certificate",
        },
        record={"files": {f"{PREFIX}/{rel}": release.manifest["files"][rel] for rel in BINARIES},
                "libraries": owners})


def record_bytes(image: Image) -> bytes:
    return (json.dumps(image.record, indent=2, sort_keys=True) + "\n").encode()


def write_outputs(image: Image, mtime: int, tar: str | None, layout: str | None, manifest: str | None) -> None:
    """The image as one tar, as an OCI layout folder, and its record, where each is asked for."""
    if tar:
        with open(tar, "wb") as f:
            f.write(image.tar(mtime))
    if layout:
        image.write_layout(layout)
    if manifest:
        with open(manifest, "wb") as f:
            f.write(record_bytes(image))


def add_output_arguments(p: argparse.ArgumentParser, *, manifest: str, repository: str) -> None:
    """The image scripts' outputs (--tar, --layout, --manifest: what `write_outputs` writes) and --repository."""
    p.add_argument("--tar", help="write the image as one tar here (OCI layout + Docker's manifest.json)")
    p.add_argument("--layout", help="write the image as an OCI layout folder here")
    p.add_argument("--manifest", help=f"write {manifest} here")
    p.add_argument("--repository", default=repository, help="the image's name (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="image.py", description="The OCI image of a release's dgr-worker.")
    p.add_argument("--release", help="release_<lane>.tar.gz (toolchains/bazel/release.py)")
    add_output_arguments(p, manifest="image_<lane>.MANIFEST.json (the digest, the release, the layers)",
                         repository=REPOSITORY)
    p.add_argument("--refuse-lane", metavar="LANE", help="print why LANE has no image and exit 1")
    args = p.parse_args(argv)
    try:
        if args.refuse_lane:
            raise ImageError(refusal(args.refuse_lane) or f"the {args.refuse_lane} lane has an image: give --release")
        if not args.release or not (args.tar or args.layout or args.manifest):
            p.error("give --release and at least one of --tar, --layout, --manifest")
        mtime = source_date_epoch()
        image = build(read_release(args.release), mtime=mtime, repository=args.repository)
        write_outputs(image, mtime, args.tar, args.layout, args.manifest)
    except ImageError as err:
        print(f"image.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
