"""Where `dgr-worker` (the C++ stage worker, worker/server) is: what `dgr worker serve` becomes, what local
routes start."""

from __future__ import annotations

import os
from pathlib import Path

from dgr.core.errors import WireError
from dgr.core.paths import env_path
from dgr.runtime.engine_abi import library_path

WORKER_BIN_ENV = "DGR_WORKER_BIN"


def worker_binary() -> Path:
    """`dgr-worker`: $DGR_WORKER_BIN, else the one beside the engine library (a CMake build folder, a
    release's lib/ has it in ../bin); WireError saying how to get one otherwise."""
    env = os.environ.get(WORKER_BIN_ENV)
    if env:
        path = env_path(env).resolve()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise WireError(f"${WORKER_BIN_ENV} is {env}, which is not an executable file: unset it, or point it "
                            "at a built dgr-worker")
        return path
    lib = library_path()
    for path in (lib.parent / "dgr-worker", lib.parent.parent / "bin" / "dgr-worker"):
        if path.is_file() and os.access(path, os.X_OK) and _is_program(path):
            return path
    raise WireError(f"no dgr-worker beside the engine library {lib}: run `dgr build-engine --lane cpu` (it needs "
                    "gRPC C++: `apt-get install libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev "
                    f"protobuf-compiler nlohmann-json3-dev`), or set ${WORKER_BIN_ENV} to a built dgr-worker")


def _is_program(path: Path) -> bool:
    """An ELF executable: never a release's launcher script that runs dgr itself."""
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"
