"""`dgr gate alpha|beta`: a release gate, every target of its contract certified (dgr.app.certify.run_gate), one
table printed. Exit statuses as `dgr certify`'s: 0 every row passes, 1 one fails, 3 none fails but a speed row is
inconclusive, 2 a refusal or an error."""

from __future__ import annotations

from dgr.cli.shared import VERDICT_EXIT_HELP
from dgr.core.paths import REPO_ROOT


def _gate(args) -> int:
    # lazy: dgr.app.certify costs 263 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.app.certify import run_gate
    from dgr.app.certify.verdict import EXIT_CODES

    contract = args.contract or REPO_ROOT / "certification" / f"{args.gate_name}.toml"
    res = run_gate(contract, out_dir=args.out_dir, lane=args.lane, lib=args.engine_lib)
    print(res.table())
    where = sorted({str(p.parent) for p in res.certificates.values()})
    if where:
        print(f"certificates: {', '.join(where)}")
    return EXIT_CODES[res.verdict]


def register(sub) -> None:
    """Add `dgr gate` to the `dgr` parser."""
    g = sub.add_parser("gate", help="run a release gate (alpha, beta): certify its targets, print one table")
    gsub = g.add_subparsers(dest="gate_name", metavar="GATE", required=True)
    gates = {
        "alpha": "SmolLM2 in 3 stages, tiny DeepSeek V4 in 2, 3 and 4 stages, the 12-stage scenario, MTP off: parity, "
                 "the prefix cache, recovery from a kill -9, speed; exit 0 only if every row passes",
        "beta": "everything alpha checks, plus MTP on (include_mtp bundles of tiny DeepSeek V4 and the 12-stage "
                "scenario): exact against MTP off, kill -9 of the last stage mid-draft with a replica, tokens per "
                "ring trip and the rejected-draft cost, a soak: exit 0 only if every row passes",
    }
    for name, what in gates.items():
        a = gsub.add_parser(name, help=what, epilog=VERDICT_EXIT_HELP)
        a.add_argument("--contract", help=f"the contract TOML (default certification/{name}.toml)")
        a.add_argument("--out-dir", help=f"where the certificates go (default: .dgr/certificates/{name})")
        a.add_argument("--lane", help="default: the contract's lane")
        a.add_argument("--engine-lib", help="the engine library (default $DGR_ENGINE_LIB or the lane's build)")
        a.set_defaults(func=_gate)
