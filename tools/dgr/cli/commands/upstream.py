"""`dgr upstream fetch|verify|patch|status|pin-patches|bump`: the pinned llama.cpp (parse, call, print).

The work is in dgr.toolchain.upstream (fetch, verify, patch, status; bump in dgr.toolchain.upstream.bump) and
dgr.toolchain.pin.
"""

from __future__ import annotations

import json
from pathlib import Path


def _fetch(args) -> int:
    # lazy: dgr.toolchain.upstream costs 75 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import upstream
    print(upstream.fetch())
    return 0


def _verify(args) -> int:
    # lazy: dgr.toolchain.upstream costs 75 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import upstream
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
    # lazy: dgr.toolchain.upstream costs 75 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import upstream
    print(upstream.patch(force=args.force))
    return 0


def _status(args) -> int:
    # lazy: dgr.toolchain.upstream costs 75 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import upstream
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
    # lazy: dgr.toolchain.upstream costs 75 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import upstream
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


def _bump(args) -> int:
    # lazy: dgr.toolchain.upstream.bump costs 189 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.upstream import bump

    families = None
    if args.families and args.families != "all":
        families = [a.strip() for a in args.families.split(",") if a.strip()]
    opts = bump.Options(write=args.write, sha256=args.sha256, commit=args.commit, release=args.release,
                        archive_sha256=args.archive_sha256, families=families, skip_gate=args.skip_gate,
                        patches_only=args.patches_only, patches=Path(args.patches) if args.patches else None,
                        jobs=args.jobs, threads=args.threads,
                        scratch=Path(args.scratch) if args.scratch else None)
    res = bump.bump(args.source, opts)
    print(bump.report_text(res))
    if args.json:
        print(res.to_json(), end="")
    return 0 if res.passed else 1


def register(sub) -> None:
    """Add `dgr upstream` to the `dgr` parser."""
    up = sub.add_parser("upstream", help="the pinned llama.cpp: fetch, verify, patch, status, bump")
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
    bp = usub.add_parser(
        "bump", help="move the pin to another llama.cpp: verify it, re-apply the patches, rebuild, rerun parity, "
        "the V4 splits and the alpha gate in a scratch folder; --write rewrites the pin only when all pass")
    bp.add_argument("source", metavar="SOURCE",
                    help="`llama-cpp-python==VERSION` (its sdist vendors llama.cpp), or a llama.cpp source folder")
    bp.add_argument("--write", action="store_true", help="rewrite the pin, its tree listing and the patches when "
                    "every step passed (default: a rehearsal that changes nothing in the checkout)")
    bp.add_argument("--sha256", help="the sdist's expected sha256 (default: record what pip fetched)")
    bp.add_argument("--commit", help="a plain folder's llama.cpp commit (a git work tree names its own)")
    bp.add_argument("--release", help="the new commit's llama.cpp release tag (bNNNN), written into the pin")
    bp.add_argument("--archive-sha256", help="also pin the GitHub archive of the commit, at this sha256")
    bp.add_argument("--families", metavar="LIST", help="parity for these architectures only (comma-separated; "
                    "default all 108): a quick rehearsal, refused with --write")
    bp.add_argument("--skip-gate", action="store_true", help="leave out `dgr gate alpha` (refused with --write)")
    bp.add_argument("--patches", metavar="DIR", help="the stack regenerated for the new commit, to apply instead of "
                    "the pinned one: a folder laid out like patches/llama.cpp/, or a git clone of the bump's restack/ "
                    "with the failed patches fixed; --write makes it the pinned series")
    bp.add_argument("--patches-only", action="store_true", help="stop after the patch step (refused with --write)")
    bp.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: min(2, cpus))")
    bp.add_argument("--threads", type=int, default=1, help="CPU threads per engine in the parity runs (default 1)")
    bp.add_argument("--scratch", help="the scratch folder (default <workspace>/upstream-bump/<version or tree-commit>)")
    bp.add_argument("--json", action="store_true", help="also print the report as JSON")
    bp.set_defaults(func=_bump)
