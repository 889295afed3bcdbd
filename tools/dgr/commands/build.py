"""`dgr` subcommands of the build area: `dgr release verify|build` (the work is in dgr.release)."""

from __future__ import annotations


def _verify(args) -> int:
    from dgr.release import verify_release

    manifest = verify_release(args.archive)
    up = manifest.get("upstream", {})
    print(f"ok: {args.archive}: lane {manifest.get('lane')}, {len(manifest.get('files', {}))} files match "
          f"the manifest; llama.cpp {up.get('commit', '?')[:12]} with {len(up.get('patches', []))} patches")
    return 0


def _build(args) -> int:
    from dgr.release import build_release

    print(build_release(args.lane))
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
