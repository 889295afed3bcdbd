"""What several `dgr` commands parse the same way (each command's own module is dgr.cli.commands.<command>):
the flags of a client of a route (`dgr generate`, `dgr serve`)."""

from __future__ import annotations


def add_route_args(p, *, waits_for_route: bool = False) -> None:
    """What every client of a route takes (`dgr generate`, `dgr serve`): the route with its replicas,
    how long to wait, how often to recover, and TLS to the workers. `waits_for_route`: --timeout also
    bounds the wait for stages that are not up yet when the route is opened (RouteClient.connect_wait)."""
    from dgr.runtime.wire.client import DEFAULT_ATTEMPTS, DEFAULT_HOP_DEADLINE

    p.add_argument("--route", required=True,
                   help="HOST:PORT,... stage 0 first; replicas of a stage in preference order separated by "
                        "'|' (quote it: \"A,B1|B2,C\")")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for a token from a route whose hops all answer (a slow route)" +
                        ("; also how long to wait, when the route is opened, for a stage that is not up yet "
                         "(a worker starting or restarting: retried, one line on stderr says which) before "
                         "giving up naming it" if waits_for_route else "") + " (default %(default)s)")
    p.add_argument("--hop-deadline", type=float, default=DEFAULT_HOP_DEADLINE, metavar="S",
                   help="after S seconds without a reply, probe every hop with deadline S; a hop that does "
                        "not answer is routed around (default %(default)s)")
    p.add_argument("--attempts", type=int, default=DEFAULT_ATTEMPTS, metavar="N",
                   help="failed attempts (dead, stopped or emptied hops) recovered from before giving up "
                        "(default %(default)s)")
    p.add_argument("--tls-cert", metavar="FILE", help="this client's certificate (TLS to the route)")
    p.add_argument("--tls-key", metavar="FILE", help="its key")
    p.add_argument("--tls-ca", metavar="FILE", help="the CA the workers' certificates come from (mTLS)")
    p.add_argument("--allow-mixed-numerics", action="store_true",
                   help="run a route whose stages compute different bits (other builds, instruction sets or kernel "
                        "switches: docs/numerics.md) instead of refusing it; its results then match no whole-model "
                        "run, and every result says it is not exact")
