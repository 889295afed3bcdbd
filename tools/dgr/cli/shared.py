"""What several `dgr` commands parse the same way (each command's own module is dgr.cli.commands.<command>):
the flags of a client of a route (`dgr generate`, `dgr serve`), of a parity run's schedule (`dgr baseline`,
`dgr parity`), the exit statuses of a certification (`dgr certify`, `dgr gate`) and where the run of a
deployment is found (`dgr down`, `dgr status`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dgr.core.constants import DEFAULT_N_UBATCH, DEFAULT_PROMPT, DEFAULT_STEPS
from dgr.runtime.wire.client import DEFAULT_ATTEMPTS, DEFAULT_HOP_DEADLINE


def add_route_args(p, *, waits_for_route: bool = False) -> None:
    """What every client of a route takes (`dgr generate`, `dgr serve`): the route with its replicas,
    how long to wait, how often to recover, and TLS to the workers. `waits_for_route`: --timeout also
    bounds the wait for stages that are not up yet when the route is opened (RouteClient.connect_wait)."""
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


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    """What a parity run feeds the model (`dgr baseline`, `dgr parity`): the prompts, the decode steps, the
    batch, and the engine library, its threads and KV cache type."""
    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for several sessions sharing each batch "
                   f"(default: {DEFAULT_PROMPT[:30]!r}...)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"greedy decode steps (default {DEFAULT_STEPS})")
    p.add_argument("--n-ubatch", type=int, default=DEFAULT_N_UBATCH,
                   help=f"physical batch size (default {DEFAULT_N_UBATCH})")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per engine (default: all cores; "
                   "use fewer on a shared machine, spinning threads then cost more than they give)")
    p.add_argument("--lib", type=Path, help="engine library (default: $DGR_ENGINE_LIB or the cached CPU build)")
    p.add_argument("--kv-dtype", choices=("f16", "f32"), default=None,
                   help="KV cache type (default f16, llama.cpp's; f32 with an all-F32 model makes an all-F32 "
                        "reference; parity takes the baseline's)")


# what `dgr certify` and `dgr gate` exit with (dgr.app.certify.verdict.EXIT_CODES), told under their --help
VERDICT_EXIT_HELP = ("exit status: 0 every row passes; 1 a row fails; 3 no row fails but a speed row is "
                     "inconclusive (the spread of its per-round ratios covers the threshold: the machine was busy; "
                     "not a pass, rerun); 2 refused or an error")


# --run-dir of a command that finds a deployment's run (`dgr down`, `dgr status`); `dgr up` makes it
FOUND_RUN_DIR_HELP = ("the run folder (default: the one the latest `dgr up` of the deployment used, its --run-dir "
                      "or <workspace>/deploy/<name>)")
