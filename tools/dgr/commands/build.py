"""`dgr` subcommands of the build area: `dgr release verify|build`.

A release (`bazel build //:release_<lane>`, toolchains/bazel/release.py) is a .tar.gz whose
`dgr-<lane>/MANIFEST.json` gives the size and blake3 of every other file. `dgr release verify`
checks an archive against it, as an operator does before deploying a worker.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

from dgr.errors import ReleaseError

MANIFEST = "MANIFEST.json"


def verify_release(archive: Path) -> dict:
    """The release's manifest, once every file in `archive` matches it; else ReleaseError naming the file."""
    import blake3

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
            got = blake3.blake3(data).hexdigest()
            if len(data) != want["size"] or got != want["blake3"]:
                raise ReleaseError(
                    f"{archive}: {top}/{path} does not match the manifest "
                    f"(blake3 {got[:16]}..., size {len(data)}; manifest {want['blake3'][:16]}..., size {want['size']})"
                )
    return manifest


def _verify(args) -> int:
    manifest = verify_release(Path(args.archive))
    up = manifest.get("upstream", {})
    print(f"ok: {args.archive}: lane {manifest.get('lane')}, {len(manifest.get('files', {}))} files match "
          f"the manifest; llama.cpp {up.get('commit', '?')[:12]} with {len(up.get('patches', []))} patches")
    return 0


def _build(args) -> int:
    from dgr.paths import REPO_ROOT

    bazel = shutil.which("bazel")
    if not bazel:
        raise ReleaseError("bazel is not installed (Debian: apt-get install bazel-bootstrap); docs/build.md")
    target = f"//:release_{args.lane}"
    proc = subprocess.run([bazel, "build", target], cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise ReleaseError(f"bazel build {target} failed (exit {proc.returncode}); its output is above")
    out = subprocess.run([bazel, "info", "bazel-bin"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = Path(out) / f"release_{args.lane}.tar.gz"
    verify_release(archive)
    print(archive)
    return 0


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    from dgr.constants import LANES

    p = sub.add_parser("release", help="build or verify a release of the worker (Bazel, docs/build.md)")
    rsub = p.add_subparsers(dest="release_command", metavar="SUBCOMMAND", required=True)
    v = rsub.add_parser("verify", help="check a release archive against its MANIFEST.json")
    v.add_argument("archive", help="release_<lane>.tar.gz")
    v.set_defaults(func=_verify)
    b = rsub.add_parser("build", help="bazel build //:release_<lane>, verify it, print its path")
    b.add_argument("--lane", choices=LANES, default="cpu")
    b.set_defaults(func=_build)
