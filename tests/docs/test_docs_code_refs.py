"""The C++ in worker/ points at the Python it mirrors or ports (`dgr.runtime.wire.codec.FRAME_OVERHEAD`,
`dgr.core.certificate.check`); every such pointer names a module that exists, and an attribute of it that
exists. A pointer to Python that moved or was deleted sends a reader nowhere, and fails here.

A reference is a dotted `dgr.<name>...` in a .cpp or .h file. Not references: the `dgr.*` GGUF keys
(worker/engine/dgr_keys.h, and their `dgr.layer.*` prefixes), the proto package (`dgr.v1.Stage`), a C++
member access (`hp.dgr.begin`) and a schema name (`dgr.certificate/v1`). A module whose import needs an
optional dependency that is not installed counts when its file exists; its attribute is not checked."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from support.paths import REPO

TOOLS = REPO / "tools"
REF = re.compile(r"(?<![\w.>])dgr(?:\.[A-Za-z_]\w*)+(?![\w/])")


def gguf_keys() -> set[str]:
    return set(re.findall(r'"(dgr\.[^"]+)"', (REPO / "worker" / "engine" / "dgr_keys.h").read_text()))


def proto_packages() -> set[str]:
    return {m for p in (REPO / "proto").rglob("*.proto")
            for m in re.findall(r"^package\s+([\w.]+)\s*;", p.read_text(), re.M)}


def is_python(ref: str, keys: set[str], packages: set[str]) -> bool:
    if any(ref == k or k.startswith(ref + ".") for k in keys):
        return False
    return not any(ref == p or ref.startswith(p + ".") for p in packages)


def references(text: str, keys: set[str], packages: set[str]) -> list[tuple[int, str]]:
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
            for m in REF.finditer(line) if is_python(m.group(0), keys, packages)]


def module_file(module: str) -> Path | None:
    base = TOOLS.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def unresolved(ref: str) -> str | None:
    """None when `ref` names a module of tools/ (the longest prefix that is one) and attributes of it;
    otherwise what is missing."""
    parts = ref.split(".")
    for n in range(len(parts), 0, -1):
        module = ".".join(parts[:n])
        if module_file(module) is None:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError as e:   # an optional dependency: the file exists, which is what can be checked
            if e.name and not e.name.startswith("dgr"):
                return None
            raise
        for i, attr in enumerate(parts[n:], n):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:i])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module {ref} (nor any prefix of it) under tools/"


def cpp_files() -> list[Path]:
    return sorted(p for ext in ("cpp", "h") for p in (REPO / "worker").rglob(f"*.{ext}"))


@pytest.fixture(scope="module", autouse=True)
def tools_on_path():
    sys.path.insert(0, str(TOOLS))
    yield
    sys.path.remove(str(TOOLS))


def test_every_python_reference_in_the_worker_resolves() -> None:
    keys, packages = gguf_keys(), proto_packages()
    found, stale = 0, []
    for f in cpp_files():
        for line, ref in references(f.read_text(errors="replace"), keys, packages):
            found += 1
            why = unresolved(ref)
            if why:
                stale.append(f"{f.relative_to(REPO)}:{line}: {ref}: {why}")
    assert found > 10, f"found only {found} references: is the pattern still right?"
    assert not stale, ("C++ comments point at Python that does not exist (name what exists now, grep "
                       "tools/dgr, or drop the pointer):\n" + "\n".join(stale))


def test_the_check_tells_references_from_keys_and_members() -> None:
    keys, packages = {"dgr.layer.begin", "dgr.mtp"}, {"dgr.v1"}
    text = ("// dgr.app.stages.held_certificates and dgr.core.certificate.check, ported; keys dgr.layer.*\n"
            "hp.dgr.begin = 1; p->dgr.end = 2; // dgr.v1.Stage, dgr.mtp, schema dgr.certificate/v1\n"
            "// (dgr.runtime.wire.codec's). dgr.wire.prefix\n")
    refs = [r for _, r in references(text, keys, packages)]
    assert refs == ["dgr.app.stages.held_certificates", "dgr.core.certificate.check", "dgr.runtime.wire.codec",
                    "dgr.wire.prefix"]
    assert unresolved("dgr.core.certificate.check") is None
    assert unresolved("dgr.runtime.wire.codec") is None
    assert "held_certificates" in unresolved("dgr.app.stages.held_certificates")
    assert unresolved("dgr.wire.prefix") == "dgr has no attribute 'wire'"
    assert unresolved("dgx.nothing").startswith("no module")
