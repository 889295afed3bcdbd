"""`dgr certify`: parse, call dgr.app.certify, print the table and write the certificate. Exit 0 when every
row passes, 1 when one fails, 3 when none fails but a speed row is inconclusive (the machine was busy:
dgr.app.certify.verdict), 2 for a refusal or an error."""

from __future__ import annotations

from pathlib import Path

from dgr.cli.shared import VERDICT_EXIT_HELP


def _certify(args) -> int:
    # lazy: dgr.app.certify costs 263 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.certify import certify, format_table, load_contract
    from dgr.app.certify.fixtures import bundle_for_recipe
    from dgr.app.certify.gate import Row
    from dgr.app.certify.verdict import EXIT_CODES, FAILED, INCONCLUSIVE, INCONCLUSIVE_RUN, PASSED, overall

    lc = load_contract(args.contract)         # the contract first: a bad one fails before anything runs
    if args.recipe:
        # read (and refuse an MTP-on recipe) before a store is made, a bundle built or a worker started
        bundle = bundle_for_recipe(args.recipe, Path(args.store) if args.store else None, progress=True).root
    else:
        bundle = args.bundle
    cert = certify(bundle, contract=lc, lane=args.lane, lib=args.engine_lib, source=args.source,
                   threads=args.threads or None)
    cert.save(args.out)
    name = cert.identity.model
    print(format_table([Row(name, f) for f in cert.figures],
                       f"dgr certify: bundle {cert.identity.bundle_id[:16]} on {cert.hardware.cpu_model} "
                       f"({cert.hardware.cores} cores), contract {lc.ref_path}"))
    v = overall(cert.figures)
    what = {PASSED: "valid", FAILED: "records a FAILED gate",
            INCONCLUSIVE_RUN: f"not valid: {INCONCLUSIVE}, a speed row could not decide; rerun on a quieter machine"}[v]
    print(f"certificate: {args.out} ({what}; digest {cert.digest[:16]})")
    return EXIT_CODES[v]


def register(sub) -> None:
    """Add `dgr certify` to the `dgr` parser."""
    p = sub.add_parser("certify", help="certify a bundle: exact against its whole model in worker processes, "
                                       "and the speed gate of a committed contract; writes a certificate",
                       epilog=VERDICT_EXIT_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="the bundle folder (or its manifest.json)")
    src.add_argument("--recipe", help="a recipe: read (an MTP-on recipe is refused), built into --store if "
                                      "missing, then certified")
    p.add_argument("--store", help="where --recipe's bundle is found or built (default $DGR_STORE or the "
                                   "workspace store)")
    p.add_argument("--lane", help="the lane certified (default: the contract's, cpu for alpha)")
    p.add_argument("--out", required=True, help="the certificate JSON file to write")
    p.add_argument("--contract", help="the contract TOML (default certification/alpha.toml)")
    p.add_argument("--engine-lib", help="the engine library (default $DGR_ENGINE_LIB or the lane's build)")
    p.add_argument("--source", help="the bundle's source GGUF, when its manifest's source URI does not resolve here")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per process (default: the contract's rule)")
    p.set_defaults(func=_certify)
