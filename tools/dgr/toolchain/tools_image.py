"""The tools image, dgr:<version>: the whole release of a lane (bin/dgr, its Python package and dependencies,
dgr-worker and the engine) on the building host's CPython of the release's Python tag, bin/dgr its entrypoint.
The Kubernetes render's init container (`dgr bundle verify`) and gateway (`dgr serve`) run it.

    python3 tools/dgr/toolchain/tools_image.py --release release_cpu.tar.gz --tar tools_image_cpu.tar \\
            --manifest tools_image_cpu.MANIFEST.json [--layout DIR]
    dgr release image --tools --release release_cpu.tar.gz --out DIR

What it holds beyond the release (at /opt/dgr, every file checked against its MANIFEST.json): the
interpreter and its standard library (less STDLIB_LEFT_OUT), the sh, dirname and readlink the release's
bin/dgr (a sh script) runs, and the loader and shared libraries all of them load (`ld.so --list`), with
their Debian packages' copyright files; the users and mount points of the worker's image. Three layers:
the system, the release's Python dependencies (they change when the lock does), the rest of the release.
Reproducible as the worker's image is (dgr.toolchain.image, whose layers and config this reuses).

Standard library only, with dgr.toolchain.image and rootfs: run by path by the Bazel target
`//:tools_image_<lane>` (plain python3, no dgr installed), as image.py is, and imported by `dgr release image
--tools`.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script (Bazel's //:tools_image_<lane>): dgr from the source tree, this folder off sys.path (as image.py)
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))  # tools/

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from dgr.toolchain.image import (BINARIES, PREFIX, STATE, STORE, TLS, Image, Release, add_output_arguments,  # noqa: E402
                                 assemble, blake3_sums, check_release, read_release, refusal, release_libraries,
                                 source_date_epoch, system_layer, write_outputs)
from dgr.toolchain.rootfs import ImageError, Tree, debian_packages, elf_interpreter, library_closure  # noqa: E402

TOOLS_REPOSITORY = "dgr"                # dgr:<version>, as the Kubernetes render names it (kubernetes.Options)
TOOLS_PORT = 8000                       # = kubernetes.GATEWAY_PORT (documentation only: --listen decides)
# What the release's bin/dgr (a POSIX sh script) runs besides Python; nothing else of a shell's world comes along.
SHELL_TOOLS = ("/bin/sh", "/usr/bin/dirname", "/usr/bin/readlink")
# Parts of the standard library no dgr command imports: its own tests, the GUI, the installers, the
# build configuration, and the host's site packages (bin/dgr runs Python with -S: the release's python/
# is the only place packages come from).
STDLIB_LEFT_OUT = ("test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
                   "site-packages", "dist-packages", "__pycache__", "EXTERNALLY-MANAGED")
STDLIB_MODULES_LEFT_OUT = ("_tkinter", "_test", "_ctypes_test", "_xxtestfuzz", "xxlimited", "xxsubtype")


def host_python(tag: str) -> tuple[str, str]:
    """The host's CPython for a release's Python tag (cp311: /usr/bin/python3.11) and its standard library's
    folder; ImageError saying what to install where it is missing or another version."""
    m = re.fullmatch(r"cp3(\d+)", tag or "")
    if not m:
        raise ImageError(f"the release's release.json names Python {tag!r}, not a CPython 3 tag (cp311): not a "
                         "release this dgr makes")
    exe = f"/usr/bin/python3.{m.group(1)}"
    if not os.path.isfile(exe):
        raise ImageError(f"the release's Python dependencies are built for {tag}, and this host has no {exe}: install "
                         f"it (Debian: apt-get install python3.{m.group(1)}) and build again")
    out = subprocess.run([exe, "-S", "-I", "-c", "import sys, sysconfig; print('cp%d%d' % sys.version_info[:2]); "
                          "print(sysconfig.get_path('stdlib'))"], capture_output=True, text=True, env={"LC_ALL": "C"})
    got = out.stdout.split()
    if out.returncode != 0 or len(got) != 2 or got[0] != tag:
        raise ImageError(f"{exe} is not the CPython the release needs ({tag}): {out.stdout.strip()} {out.stderr.strip()}")
    return exe, got[1]


def stdlib_files(stdlib: str) -> list[str]:
    """The standard library's files (and symlinks) but STDLIB_LEFT_OUT's, sorted."""
    found = []
    for folder, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_LEFT_OUT and not d.startswith("config-"))
        for name in sorted(files):
            if name in STDLIB_LEFT_OUT or name.endswith((".pyc", ".pyo")):
                continue
            if name.endswith(".so") and name.split(".", 1)[0].startswith(STDLIB_MODULES_LEFT_OUT):
                continue
            found.append(os.path.join(folder, name))
    return found


def python_libraries(release: Release, exe: str, stdlib_sos: list[str]) -> list[str]:
    """The loader and the host's shared libraries that the interpreter, its extension modules and the release's
    own (python/**.so) load; libraries the release carries itself (numpy.libs/, found through $ORIGIN) are not
    the host's and stay out."""
    with open(exe, "rb") as f:
        loader = elf_interpreter(f.read())
    if not loader or not os.path.exists(loader):
        raise ImageError(f"{exe}'s loader {loader} is not on this host")
    with tempfile.TemporaryDirectory() as tmp:
        ours = []
        for rel, data in release.files.items():
            if rel.startswith("python/") and ".so" in os.path.basename(rel):
                path = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                ours.append(path)
        found = library_closure([exe, *stdlib_sos, *ours], loader)
        return [p for p in found if not p.startswith(tmp + os.sep)]


def check_release_files(release: Release) -> str:
    """Every file of `release` matches its MANIFEST.json (by the release's own dgr-worker); returns the
    architecture (check_release)."""
    arch = check_release(release)
    listed = release.manifest.get("files", {})
    files = {rel: data for rel, data in release.files.items() if rel != "MANIFEST.json"}
    for rel in sorted(set(files) ^ set(listed)):
        where = "the archive" if rel in files else "the manifest"
        raise ImageError(f"{release.name}: {rel} is only in {where}: the archive is damaged; `dgr release verify` it")
    sums = blake3_sums(release.files["bin/dgr-worker"], files)
    for rel, got in sorted(sums.items()):
        if got != listed[rel]["blake3"]:
            raise ImageError(f"{release.name}: {rel} does not match the release's MANIFEST.json (blake3 {got[:16]}..., "
                             f"manifest {listed[rel]['blake3'][:16]}...): the archive is damaged; `dgr release verify` it")
    return arch


def build_tools(release: Release, *, mtime: int = 0, repository: str = TOOLS_REPOSITORY) -> Image:
    """The tools image of `release` (read with everything=True): the whole release at PREFIX, bin/dgr its
    entrypoint, on this host's CPython of the release's tag with its standard library and the shared
    libraries all of it loads; the sh, dirname and readlink bin/dgr runs; no package manager, no pip."""
    why = refusal(release.lane)
    if why:
        raise ImageError(f"{release.name}: {why}")
    if "bin/dgr" not in release.files or "python/dgr/__init__.py" not in release.files:
        raise ImageError(f"{release.name}: no bin/dgr and python/dgr/: read the release with everything=True")
    arch = check_release_files(release)
    tag = json.loads(release.files["release.json"]).get("python", "")
    exe, stdlib = host_python(tag)
    stdlib = stdlib_files(stdlib)
    sos = [p for p in stdlib if p.endswith(".so")]
    shell = [os.path.realpath(t) for t in SHELL_TOOLS]
    with open(shell[0], "rb") as f:
        shell_loader = elf_interpreter(f.read())
    libraries = sorted(set(python_libraries(release, exe, sos)) | set(library_closure(shell, shell_loader))
                       | set(release_libraries(release)))
    system, owners = system_layer(libraries)
    python = debian_packages([exe, *stdlib[:1]])
    for path in [exe, *SHELL_TOOLS, *stdlib]:
        system.host_path(path)
    for pkg in sorted({pkg for pkg, _ in {**python, **debian_packages(shell)}.values()}):
        copyright = f"/usr/share/doc/{pkg}/copyright"
        if os.path.lexists(copyright):
            system.host_path(copyright)

    deps, dgr = Tree(), Tree()
    for rel, data in sorted(release.files.items()):
        ours = not rel.startswith("python/") or rel.startswith("python/dgr/")
        (dgr if ours else deps).file(f"{PREFIX}/{rel}", data, executable=rel in release.executable)

    return assemble(
        release, arch,
        [(system, f"{exe} and its standard library, /bin/sh, dirname and readlink, the loader and the shared "
                  "libraries they, the release's Python modules, dgr-worker and the engine load, from the building host (ld.so --list); "
                  "users; mount points"),
         (deps, f"the Python dependencies of the {release.lane} release {release.version} (python/, locked wheels)"),
         (dgr, f"dgr of the {release.lane} release {release.version}: bin/dgr, python/dgr, dgr-worker, the engine")],
        mtime=mtime, repository=repository,
        description=f"dgr's command line, {release.lane} lane: the gateway (`serve`), `bundle verify` and every "
                    "other command, on the release's own Python (docs/deploy.md, Container image)",
        entrypoint=[f"{PREFIX}/bin/dgr"],
        env=[f"PATH={PREFIX}/bin:/usr/bin:/bin", f"PYTHON={exe}", f"HOME={STATE}", f"DGR_WORKSPACE={STATE}",
             "PYTHONDONTWRITEBYTECODE=1"],
        port=TOOLS_PORT,
        labels={"dgr.mounts": f"the bundle's store read-only at {STORE}, TLS files at {TLS}, state at {STATE}, "
                              "/tmp writable"},
        record={"files": {f"{PREFIX}/{rel}": release.manifest["files"][rel] for rel in ("bin/dgr", *BINARIES)},
                "python": {"executable": exe, "tag": tag, "package": "/".join(python.get(exe, ("", "")))},
                "libraries": owners})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools_image.py", description="The tools image (dgr:<version>) of a release.")
    p.add_argument("--release", required=True, help="release_<lane>.tar.gz (toolchains/bazel/release.py)")
    add_output_arguments(p, manifest="its record (the digest, the release, the layers, the libraries)",
                         repository=TOOLS_REPOSITORY)
    args = p.parse_args(argv)
    if not (args.tar or args.layout or args.manifest):
        p.error("give at least one of --tar, --layout, --manifest")
    try:
        mtime = source_date_epoch()
        image = build_tools(read_release(args.release, everything=True), mtime=mtime, repository=args.repository)
        write_outputs(image, mtime, args.tar, args.layout, args.manifest)
    except ImageError as err:
        print(f"tools_image.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
