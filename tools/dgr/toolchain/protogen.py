"""Generate the Python stubs of proto/dgr/v1/*.proto with grpc_tools (pinned in pyproject.toml).

The stubs are committed under tools/dgr/runtime/wire/gen/ so that `pip install` needs no protoc; the proto is
the source of truth and tests/wire/test_wire_proto.py regenerates them and fails on any drift. After
editing a .proto, run `dgr wire protoc`.

protoc names the modules after the proto package (`dgr.v1`), which would collide with this Python
package, so the one cross-module import grpc_tools writes is rewritten to a relative import.
"""

from __future__ import annotations

import importlib.resources
import re
import tempfile
from pathlib import Path

from grpc_tools import protoc  # build-time dependency only

from dgr.core.errors import WireError
from dgr.core.paths import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("dgr/v1/stage.proto",)
GEN_DIR = Path(__file__).resolve().parents[1] / "runtime" / "wire" / "gen"
HEADER = "# Generated from proto/{src} by `dgr wire protoc` (grpc_tools). DO NOT EDIT.\n"


_GENERATED_VERSION = re.compile(r"^(GRPC_GENERATED_VERSION = ')(\d+\.\d+)\.\d+'", re.M)


def generate() -> dict[str, str]:
    """Run protoc on the protos; return {file name: content} of the stubs as they should be committed."""
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for src in PROTO_FILES:
            args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                    f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_ROOT / src)]
            if protoc.main(args) != 0:
                raise WireError(f"protoc failed on proto/{src}: run the command by hand to see why: "
                                f"python -m grpc_tools.protoc {' '.join(args[1:])}")
            stem = Path(src).stem
            module = src[: -len(".proto")].replace("/", ".")        # dgr.v1.stage
            package, _, name = module.rpartition(".")
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                text = (Path(tmp) / Path(src).parent / f"{stem}{suffix}").read_text()
                text = text.replace(f"from {package} import {name}_pb2 as",
                                    f"from . import {name}_pb2 as")
                # grpc_tools writes its own patch release as the lowest grpcio the stub accepts: written as the
                # pinned minor (X.Y.0), so every grpcio-tools X.Y.* a fresh install picks writes the same stub
                text = _GENERATED_VERSION.sub(r"\g<1>\g<2>.0'", text)
                out[f"{stem}{suffix}"] = HEADER.format(src=src) + text
    return out


def write(gen_dir: Path = GEN_DIR) -> list[Path]:
    """Regenerate the committed stubs in place."""
    gen_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generate().items():
        path = gen_dir / name
        path.write_text(text)
        written.append(path)
    init = gen_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protocol stubs (see dgr.toolchain.protogen)."""\n')
    return written


def drift(gen_dir: Path = GEN_DIR) -> list[str]:
    """Names of committed stubs that differ from a fresh generation (empty when in sync)."""
    bad = []
    for name, text in generate().items():
        path = gen_dir / name
        if not path.exists() or path.read_text() != text:
            bad.append(name)
    return bad
