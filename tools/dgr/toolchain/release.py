"""Release archives of a lane's worker: check one against its MANIFEST.json, or build one with Bazel.

A release (`bazel build //:release_<lane>`, written by toolchains/bazel/release.py) is a .tar.gz whose
`dgr-<lane>/MANIFEST.json` gives the size and blake3 of every other file. `verify_release` checks an
archive against it, as an operator does before deploying a worker (docs/build.md). `write_image` makes the
worker's OCI image of one (dgr.toolchain.image, which Bazel's `//:image_<lane>` runs as a script).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from dgr.core.errors import ReleaseError
from dgr.core.hashing import bytes_blake3
from dgr.core.paths import REPO_ROOT
from dgr.toolchain import image as oci
from dgr.toolchain.tools_image import build_tools

MANIFEST = "MANIFEST.json"


def verify_release(archive: str | Path) -> dict[str, Any]:
    """The release's manifest, once every file in `archive` matches it; else ReleaseError naming the file."""
    archive = Path(archive)
    try:
        tar = tarfile.open(archive, "r:gz")
    except (OSError, tarfile.TarError) as err:
        raise ReleaseError(f"{archive}: not a readable release archive ({err})") from err
    with tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        tops = {name.split("/", 1)[0] for name in members}
        if len(tops) != 1:
            raise ReleaseError(f"{archive}: a release has one top folder, this has {sorted(tops)}")
        top = tops.pop()
        if f"{top}/{MANIFEST}" not in members:
            raise ReleaseError(f"{archive}: no {top}/{MANIFEST}")
        manifest = json.loads(tar.extractfile(members.pop(f"{top}/{MANIFEST}")).read())
        expected = manifest.get("files", {})
        have = {name[len(top) + 1:]: m for name, m in members.items()}
        for path in sorted(set(have) - set(expected)):
            raise ReleaseError(f"{archive}: {top}/{path} is not in the manifest")
        for path, want in sorted(expected.items()):
            m = have.get(path)
            if m is None:
                raise ReleaseError(f"{archive}: {top}/{path} is in the manifest but not in the archive")
            data = tar.extractfile(m).read()
            got = bytes_blake3(data)
            if len(data) != want["size"] or got != want["blake3"]:
                raise ReleaseError(
                    f"{archive}: {top}/{path} does not match the manifest "
                    f"(blake3 {got[:16]}..., size {len(data)}; manifest {want['blake3'][:16]}..., size {want['size']})"
                )
    return manifest


def build_release(lane: str) -> Path:
    """`bazel build //:release_<lane>` (its output goes to the terminal), verified; returns the archive."""
    bazel = shutil.which("bazel")
    if not bazel:
        raise ReleaseError("bazel is not installed (Debian: apt-get install bazel-bootstrap); docs/build.md")
    target = f"//:release_{lane}"
    proc = subprocess.run([bazel, "build", target], cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise ReleaseError(f"bazel build {target} failed (exit {proc.returncode}); its output is above")
    out = subprocess.run([bazel, "info", "bazel-bin"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = Path(out) / f"release_{lane}.tar.gz"
    verify_release(archive)
    return archive


def write_image(archive: str | Path, out: str | Path, tools: bool = False) -> tuple[dict[str, Any], list[Path]]:
    """The OCI image of release `archive` (docs/deploy.md, "Container image") in `out`: image_<lane>/ (an OCI
    layout, also holding Docker's manifest.json), image_<lane>.tar (that folder as one tar: `docker load`,
    `podman load`) and image_<lane>.MANIFEST.json (the digest, the release, the layers, the libraries); with
    `tools` the tools image (dgr:<version>) as tools_<lane>/, tools_<lane>.tar and tools_<lane>.MANIFEST.json.
    Returns that manifest and the three paths. An existing folder of that name is replaced, anything else there refused."""
    out = Path(out)
    try:
        release = oci.read_release(str(archive), everything=tools)
        mtime = oci.source_date_epoch()
        image = build_tools(release, mtime=mtime) if tools else oci.build(release, mtime=mtime)
    except oci.ImageError as err:
        raise ReleaseError(str(err)) from err
    stem = f"{'tools' if tools else 'image'}_{release.lane}"
    layout = out / stem
    if layout.exists():
        if not (layout / "oci-layout").is_file():
            raise ReleaseError(f"{layout} exists and is not an OCI image layout: move it away or give another --out")
        shutil.rmtree(layout)
    out.mkdir(parents=True, exist_ok=True)
    image.write_layout(str(layout))
    tar = out / f"{stem}.tar"
    tar.write_bytes(image.tar(mtime))
    manifest = out / f"{stem}.MANIFEST.json"
    manifest.write_bytes(oci.record_bytes(image))
    return image.record, [layout, tar, manifest]
