"""The engine's C ABI moves as one piece (issue 25): the version in worker/engine/dgr_engine.h moves whenever a
declaration does (its fingerprint is recorded per version in worker/engine/dgr_engine.abi), the Python binding
speaks that version, and the binding refuses a library of another version or with structs of other sizes,
saying what to rebuild (shown with real shared libraries compiled here)."""

from __future__ import annotations

import ctypes as C
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.core.errors import EngineError
from dgr.runtime import engine_abi

from support.paths import REPO

HEADER = REPO / "worker" / "engine" / "dgr_engine.h"
LOCK = REPO / "worker" / "engine" / "dgr_engine.abi"


def header_version(text: str) -> int:
    return int(re.search(r"^#define DGR_ABI_VERSION (\d+)$", text, re.M).group(1))


def fingerprint(text: str) -> str:
    """blake3 of the header's declarations: comments, the version line and layout whitespace left out."""
    import blake3

    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^#define DGR_ABI_VERSION \d+$", " ", text, flags=re.M)
    return blake3.blake3(" ".join(text.split()).encode()).hexdigest()


def recorded() -> dict[int, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, digest = line.split()
            out[int(version)] = digest
    return out


def test_the_binding_speaks_the_headers_version():
    assert engine_abi.ABI_VERSION == header_version(HEADER.read_text())


def test_a_changed_declaration_moves_the_version():
    text = HEADER.read_text()
    version, got = header_version(text), fingerprint(text)
    table = recorded()
    assert table.get(version) == got, (
        f"worker/engine/dgr_engine.h's declarations (fingerprint {got}) are not those recorded for C ABI {version}"
        f" ({table.get(version)}): a signature or a shared struct changed. Bump DGR_ABI_VERSION (and "
        f"dgr.runtime.engine_abi.ABI_VERSION) and add the line `{version + 1} {got}` to {LOCK.relative_to(REPO)}")
    assert len(set(table.values())) == len(table), "two ABI versions with the same declarations"


def test_the_fingerprint_sees_a_struct_change_and_ignores_comments():
    text = HEADER.read_text()
    assert fingerprint(text.replace("// ", "// reworded: ")) == fingerprint(text)
    assert fingerprint(text.replace("int32_t n_logit_rows;", "int64_t n_logit_rows;")) != fingerprint(text)


def test_every_shared_struct_is_checked():
    """The header's DGR_ABI_STRUCTS list and the binding's STRUCTS name the same structs."""
    m = re.search(r"#define DGR_ABI_STRUCTS\(X\)((?:[^\n]*\\\n)*[^\n]*)", HEADER.read_text())
    assert m, "dgr_engine.h has no DGR_ABI_STRUCTS list"
    assert set(re.findall(r"X\((\w+)\)", m.group(1))) == set(engine_abi.STRUCTS)


@pytest.mark.engine
def test_the_built_libraries_answer_the_same_sizes(engine_lib):
    from dgr.testing import fake_engine

    for path in (engine_lib, fake_engine.library_path()):
        h = engine_abi.load_library(path)         # checks version and sizes
        h.dgr_abi_struct_size.restype = C.c_int32
        assert h.dgr_abi_struct_size(b"no_such_struct") == -1
        for name, struct in engine_abi.STRUCTS.items():
            assert h.dgr_abi_struct_size(name.encode()) == C.sizeof(struct), (path, name)


def _library(tmp_path: Path, name: str, version: int, step_size: str = "sizeof(dgr_step)") -> Path:
    """A shared library that answers the ABI's two questions as told (a library built from another checkout)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"{name}.c"
    src.write_text(f"""#include <string.h>
#include "dgr_engine.h"
int32_t dgr_abi_version(void) {{ return {version}; }}
int32_t dgr_abi_struct_size(const char * n) {{
#define X(s) if (strcmp(n, #s) == 0) return strcmp(#s, "dgr_step") == 0 ? (int32_t)({step_size}) : (int32_t)sizeof(s);
    DGR_ABI_STRUCTS(X)
#undef X
    return -1;
}}
""")
    out = tmp_path / f"lib{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-I", str(HEADER.parent), "-o", str(out), str(src)], check=True)
    return out


def test_a_library_of_another_version_is_refused(tmp_path):
    lib = _library(tmp_path, "old", engine_abi.ABI_VERSION - 1)
    with pytest.raises(EngineError) as e:
        engine_abi.load_library(lib)
    msg = str(e.value)
    assert f"C ABI {engine_abi.ABI_VERSION - 1}, this dgr expects {engine_abi.ABI_VERSION}" in msg
    assert "rebuild the engine" in msg


def test_a_library_whose_struct_differs_is_refused(tmp_path):
    lib = _library(tmp_path, "odd", engine_abi.ABI_VERSION, step_size="sizeof(dgr_step) + 8")
    with pytest.raises(EngineError) as e:
        engine_abi.load_library(lib)
    ours = C.sizeof(engine_abi.STRUCTS["dgr_step"])
    assert f"dgr_step is {ours + 8} bytes in {lib.resolve()} but {ours} in this dgr" in str(e.value)
    assert "rebuild the engine" in str(e.value)


def test_the_bindings_kernel_names_are_the_headers_values():
    """Engine.open(kernels=...) passes dgr_open_params.fast_kernels: the binding's names map to the header's
    DGR_KERNELS_* values."""
    defined = {m.group(1).lower(): int(m.group(2))
               for m in re.finditer(r"^#define DGR_KERNELS_(\w+)\s+(\d+)$", HEADER.read_text(), re.M)}
    assert defined == engine_abi.KERNELS


def test_the_engine_doc_names_the_current_version():
    """docs/engine.md says which version the ABI is and what each added; it said 6 while the header said 8."""
    doc = (REPO / "docs" / "engine.md").read_text()
    [said] = re.findall(r"`dgr_abi_version\(\)` is (\d+)", doc)
    version = header_version(HEADER.read_text())
    assert int(said) == version, f"docs/engine.md says C ABI {said}, dgr_engine.h {version}"
    assert f"v{version} " in " ".join(doc.split()), f"docs/engine.md does not say what C ABI {version} added"
