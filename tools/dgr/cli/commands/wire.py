"""`dgr wire protoc`: the wire protocol's maintenance, the committed Python stubs regenerated from proto/dgr/v1
(dgr.toolchain.protogen) and the committed C++ headers from the Python that defines the keys, wire dtypes
and wire constants (dgr.toolchain.cppgen). The client side of the wire is `dgr generate` (commands/generate.py), the worker
`dgr worker` (commands/worker.py)."""

from __future__ import annotations

from dgr.core.log import get_logger
from dgr.toolchain import cppgen

log = get_logger(__name__)


def register(sub) -> None:
    """Add `dgr wire` to the `dgr` parser."""
    p = sub.add_parser("wire", help="wire protocol maintenance")
    psub = p.add_subparsers(dest="wire_command", metavar="ACTION", required=True)
    pc = psub.add_parser("protoc", help="regenerate the committed Python stubs from proto/dgr/v1 and "
                          "the C++ headers generated from the Python (dgr.toolchain.cppgen)")
    pc.add_argument("--check", action="store_true", help="only report drift (exit 1 on drift)")
    pc.set_defaults(func=_protoc)


def _protoc(args) -> int:
    # lazy: dgr.toolchain.protogen needs grpc_tools, not in a release (pyproject.toml [tool.dgr.release])
    from dgr.toolchain import protogen

    if args.check:
        bad = protogen.drift() + cppgen.drift()
        if bad:
            log.error("out of date: %s; run `dgr wire protoc`", ", ".join(bad))
            return 1
        print("stubs match proto/, C++ headers match the Python")
        return 0
    for path in protogen.write() + cppgen.write():
        print(path)
    return 0
