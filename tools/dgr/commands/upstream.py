"""`dgr` subcommands of the upstream area: `dgr upstream ...` and `dgr build-engine` (parse, call, print).

The work is in dgr.upstream (fetch, verify, patch, status), dgr.pin and dgr.enginebuild.
"""

from __future__ import annotations

import json


def _fetch(args) -> int:
    from dgr import upstream

    print(upstream.fetch())
    return 0


def _verify(args) -> int:
    from dgr import upstream

    pin = upstream.load_pin()
    got = upstream.verify(pin)
    upstream.check_patch_list(pin)
    print(f"verified: llama.cpp {pin.commit} tree hash {got}; patch list matches {upstream.PATCH_DIR_REL}/")
    patched = upstream.layout(pin).patched
    changes = upstream.local_changes(patched)  # [] when the tree is not made yet
    if changes:
        print(f"note: {patched} has local edits, not in the patches: {', '.join(changes[:10])}")
    return 0


def _patch(args) -> int:
    from dgr import upstream

    print(upstream.patch(force=args.force))
    return 0


def _status(args) -> int:
    from dgr import upstream

    st = upstream.status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    print(f"llama.cpp   {st['commit']} ({st['release']})")
    print(f"pin         {st['pin']}")
    print(f"workspace   {st['workspace']}")
    print(f"fetched     {yes(st['fetched'])}" + (f" from {st['source']}" if st["source"] else ""))
    print(f"verified    {yes(st['verified'])}" + (f": {st['verify_error']}" if st["verify_error"] else ""))
    state = "the pinned list" if st["patches_current"] else "NOT the pinned list: run dgr upstream patch"
    print(f"patched     {st['patched'] or 'no'} ({len(st['patches_applied'])} patches, {state})")
    for p in st["patches_applied"]:
        print(f"  applied   {p.rsplit('/', 1)[1]}")
    if st["patch_list_error"]:
        print(f"patch list  {st['patch_list_error']}")
    if st["local_changes"]:
        print(f"local edits {', '.join(st['local_changes'][:10])}")
    return 0


def _pin_patches(args) -> int:
    from dgr import upstream

    pin = upstream.load_pin()
    if args.check:
        upstream.check_patch_list(pin)
        print(f"{pin.path.name}: patch list matches {upstream.PATCH_DIR_REL}/ ({len(pin.patches)} patches)")
        return 0
    entries = upstream.pin_patches(pin)
    for e in entries:
        print(f"{e['blake3']}  {e['file']}")
    print(f"{pin.path}: {len(entries)} patch(es) pinned")
    return 0


def _build_engine(args) -> int:
    from dgr import enginebuild

    print(enginebuild.ensure_engine(args.lane, jobs=args.jobs, force=args.force))
    return 0


def register(sub) -> None:
    """Add this area's subcommands to the `dgr` parser."""
    up = sub.add_parser("upstream", help="the pinned llama.cpp: fetch, verify, patch, status")
    usub = up.add_subparsers(dest="upstream_command", metavar="ACTION", required=True)
    usub.add_parser("fetch", help="download a pinned source and extract the verified tree").set_defaults(func=_fetch)
    usub.add_parser("verify", help="recheck the fetched tree's hash and the patch list against the pin") \
        .set_defaults(func=_verify)
    p = usub.add_parser("patch", help="make upstream/llama.cpp = pristine + patches/llama.cpp in pin order")
    p.add_argument("--force", action="store_true", help="discard local edits in upstream/llama.cpp")
    p.set_defaults(func=_patch)
    s = usub.add_parser("status", help="commit, source used, verified or not, patches applied")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_status)
    pp = usub.add_parser("pin-patches", help="rewrite the pin's patch list from patches/llama.cpp/")
    pp.add_argument("--check", action="store_true", help="only check that the folder and the pin agree")
    pp.set_defaults(func=_pin_patches)

    from dgr.constants import LANES

    b = sub.add_parser("build-engine", help="build the ShardEngine library for a lane (cached)")
    b.add_argument("--lane", default="cpu", choices=LANES)
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: min(2, cpus))")
    b.add_argument("--force", action="store_true", help="run CMake even when the inputs are unchanged")
    b.set_defaults(func=_build_engine)
