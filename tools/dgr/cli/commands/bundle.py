"""`dgr bundle verify|provision`: check every chunk of a bundle, or copy it into a store verifying as it copies
(dgr.toolchain.bundle)."""

from __future__ import annotations


def _verify(args) -> int:
    # lazy: dgr.toolchain.bundle.verify costs 11 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.bundle import check_id, load_bundle, verify_bundle

    if args.expect_id:
        check_id(load_bundle(args.bundle), args.expect_id)  # before hashing: a wrong bundle fails at once
    rep = verify_bundle(args.bundle, resume=not args.fresh, progress=not args.quiet, stages=args.stage)
    which = f" of stage(s) {', '.join(map(str, sorted(set(args.stage))))}" if args.stage else ""
    print(f"ok: bundle {rep.bundle_id}: {rep.chunks_total} chunks{which} verified "
          f"({rep.chunks_read} read now, {rep.chunks_skipped} verified by an earlier interrupted run)")
    return 0


def _provision(args) -> int:
    # lazy: dgr.toolchain.bundle.store costs 7 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain.bundle import provision

    rep = provision(args.bundle, args.to, progress=not args.quiet)
    print(f"provisioned bundle {rep.bundle_id} to {rep.dest} "
          f"({rep.chunks_copied} chunks copied, {rep.chunks_reused} already there and re-verified)")
    return 0


def register(sub) -> None:
    """Add `dgr bundle` to the `dgr` parser."""
    bundle = sub.add_parser("bundle", help="bundles: verify, provision")
    bsub = bundle.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)
    p = bsub.add_parser("verify", help="check every chunk of a bundle (resumes an interrupted check)")
    p.add_argument("bundle")
    p.add_argument("--fresh", action="store_true", help="ignore an interrupted run's progress")
    p.add_argument("--stage", type=int, action="append", metavar="N",
                   help="check only stage N's file (repeat for more; default: every stage): what a worker serving "
                   "stage N reads")
    p.add_argument("--expect-id", metavar="ID", help="fail unless this is the bundle's id: the whole id, its 12-digit "
                   "short form, any prefix of 8 or more hex digits, or the store folder's NAME-ID12")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_verify)
    p = bsub.add_parser("provision", help="copy a bundle into a store, verifying as it copies (resumable)")
    p.add_argument("bundle")
    p.add_argument("--to", required=True, help="store folder on a mounted drive (not under /home)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=_provision)
