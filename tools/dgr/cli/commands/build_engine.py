"""`dgr build-engine`: the ShardEngine library for a lane, built from the patched llama.cpp and cached (the
work is in dgr.toolchain.enginebuild)."""

from __future__ import annotations

from dgr.core.constants import CPU_VARIANTS, LANES


def _build_engine(args) -> int:
    # lazy: dgr.toolchain.enginebuild costs 80 ms at start-up (python -X importtime, 2026-12-05)
    from dgr.toolchain import enginebuild

    print(enginebuild.ensure_engine(args.lane, jobs=args.jobs, force=args.force, cpu_variant=args.cpu_variant))
    return 0


def register(sub) -> None:
    """Add `dgr build-engine` to the `dgr` parser."""
    b = sub.add_parser("build-engine", help="build the ShardEngine library for a lane (cached)")
    b.add_argument("--lane", default="cpu", choices=LANES)
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: min(2, cpus))")
    b.add_argument("--force", action="store_true", help="run CMake even when the inputs are unchanged")
    b.add_argument("--cpu-variant", default=CPU_VARIANTS[0], choices=CPU_VARIANTS,
                   help="the CPU backend's instruction set: x86-64-v3, the lane's baseline that every build shares "
                   "(default), or native, this machine's own CPU, into <workspace>/build/<lane>-native: faster "
                   "where it has AVX-512, but its results differ and its workers cannot share a route with the "
                   "baseline's (docs/numerics.md)")
    b.set_defaults(func=_build_engine)
