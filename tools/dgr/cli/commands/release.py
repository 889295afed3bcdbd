"""`dgr release verify|build|image|deb|python-deps`: a release of the worker (the work is in dgr.toolchain.release,
dgr.toolchain.pydeps and, for the Debian package, dgr.app.deploy.debian)."""

from __future__ import annotations

from dgr.core.constants import LANES


def _verify(args) -> int:
    # lazy: dgr.toolchain.release costs 11 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.release import verify_release

    manifest = verify_release(args.archive)
    up = manifest.get("upstream", {})
    print(f"ok: {args.archive}: lane {manifest.get('lane')}, {len(manifest.get('files', {}))} files match "
          f"the manifest; llama.cpp {up.get('commit', '?')[:12]} with {len(up.get('patches', []))} patches")
    return 0


def _build(args) -> int:
    # lazy: dgr.toolchain.release costs 11 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.release import build_release

    print(build_release(args.lane))
    return 0


def _image(args) -> int:
    # lazy: dgr.toolchain.release costs 11 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.release import write_image

    record, (layout, tar, manifest) = write_image(args.release, args.out, tools=args.tools)
    print(f"ok: {record['ref']} ({record['lane']} lane, {record['architecture']}) {record['digest']}, "
          f"{record['size'] / 1e6:.1f} MB in {len(record['layers'])} layers")
    print(f"  {layout}/  the OCI image layout")
    print(f"  {tar}  the same as one tar: docker load -i / podman load -i")
    print(f"  {manifest}  the digest, the release it was made from, the layers and libraries")
    return 0


def _deb(args) -> int:
    # lazy: dgr.app.deploy.debian costs 135 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.deploy.debian import build_deb

    deb = build_deb(args.release, args.out)
    print(f"ok: {deb} ({deb.stat().st_size / 1e6:.1f} MB): `dpkg -i {deb.name}`, then docs/deploy.md \"Debian package\"")
    return 0


def _python_deps(args) -> int:
    # lazy: dgr.toolchain.pydeps costs 13 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.pydeps import LOCK_PATH, fetch_locked, wheel_dir, write_lock

    if args.lock:
        lock = write_lock()
        print(f"locked {len(lock['wheels'])} wheels ({lock['python']}) in {LOCK_PATH}")
    paths = fetch_locked()
    size = sum(p.stat().st_size for p in paths)
    print(f"ok: {len(paths)} locked wheels in {wheel_dir()} ({size / 1e6:.1f} MB), each matching its sha256")
    return 0


def register(sub) -> None:
    """Add `dgr release` to the `dgr` parser."""
    p = sub.add_parser("release", help="build or verify a release of the worker (Bazel, docs/build.md)")
    rsub = p.add_subparsers(dest="release_command", metavar="SUBCOMMAND", required=True)
    v = rsub.add_parser("verify", help="check a release archive against its MANIFEST.json")
    v.add_argument("archive", help="release_<lane>.tar.gz")
    v.set_defaults(func=_verify)
    b = rsub.add_parser("build", help="bazel build //:release_<lane>, verify it, print its path")
    b.add_argument("--lane", choices=LANES, default="cpu")
    b.set_defaults(func=_build)
    i = rsub.add_parser("image", help="the OCI image of a release's dgr-worker: no shell, no Python, the libraries "
                        "it loads from this host; with --tools the image of its dgr command line (docs/deploy.md, "
                        "Container image)")
    i.add_argument("--release", required=True, help="release_<lane>.tar.gz (`dgr release build`)")
    i.add_argument("--out", required=True, help="folder for image_<lane>/, image_<lane>.tar and image_<lane>.MANIFEST.json "
                   "(with --tools: tools_<lane>/, tools_<lane>.tar, tools_<lane>.MANIFEST.json)")
    i.add_argument("--tools", action="store_true", help="the tools image dgr:<version>: the whole release, bin/dgr its "
                   "entrypoint, on this host's CPython of the release's version (the Kubernetes render's init "
                   "container and gateway run it)")
    i.set_defaults(func=_image)
    e = rsub.add_parser("deb", help="the Debian package of a release's dgr-worker: /opt/dgr, the unit template "
                        "dgr-worker@.service, its user and folders (docs/deploy.md, Debian package)")
    e.add_argument("--release", required=True, help="release_cpu.tar.gz (`dgr release build`)")
    e.add_argument("--out", required=True, help="folder for dgr-worker_<version>_<arch>.deb")
    e.set_defaults(func=_deb)
    d = rsub.add_parser("python-deps", help="put the locked wheels a release carries into the workspace "
                        "(sha256-checked; Bazel's @dgr_python_deps reads them)")
    d.add_argument("--lock", action="store_true", help="first re-lock: the closure of pyproject's "
                   "[tool.dgr.release] python-deps at this environment's installed versions")
    d.set_defaults(func=_python_deps)
