"""One definition per idea across Python and C++: the C++ headers that carry dgr's GGUF keys, the engine's
defaults, the wire dtypes and the wire's sizes and pauses are generated from the Python (dgr.toolchain.cppgen),
committed, and equal to a fresh generation; no other C++ file defines them again. What stays written twice
(a JSON template's choices, the descriptor's field names in dgr-worker) is held equal here."""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel

from dgr.core.contract import DEFAULT_WIRE_DTYPE, WIRE_DTYPES
from dgr.core.descriptor import Descriptor
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.toolchain import cppgen

# name -> how a C++ definition of it looks; each may appear only in the generated header that holds it
DEFINITIONS = {
    "DGR_KEY_*": r"#define\s+DGR_KEY_\w+",
    "DGR_DEFAULT_N_CTX": r"#define\s+DGR_DEFAULT_N_CTX\b",
    "WireDtype": r"struct\s+WireDtype\s*\{",
    "wire dtype rows": r'\{\s*"q8_0"\s*,\s*32\b',
    "wire dtype names": r"f32, f16, bf16, q8_0|f32\|f16\|bf16\|q8_0",
    "descriptor schema version": r'"schema_version",\s*\d',
    **{n: rf"\b{n}\s*=\s*\d" for n in ("FRAME_OVERHEAD", "PER_TOKEN_IDS", "DEFAULT_MAX_MESSAGE_BYTES",
                                       "RECONNECT_INITIAL_MS", "RECONNECT_MAX_MS", "CONNECT_TIMEOUT_MS",
                                       "MAX_TOP_LOGPROBS", "DESCRIPTOR_SCHEMA_VERSION")},
}


def test_committed_headers_match_the_python(repo_root):
    assert cppgen.drift(repo_root) == [], "C++ headers differ from the Python: run `dgr wire protoc` and commit"


def test_header_drift_is_detected(tmp_path):
    for rel in cppgen.HEADERS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    cppgen.write(tmp_path)
    assert cppgen.drift(tmp_path) == []
    keys = tmp_path / "worker/engine/dgr_keys.h"
    keys.write_text(keys.read_text().replace('"dgr.mtp"', '"dgr.mtp2"'))
    assert cppgen.drift(tmp_path) == ["worker/engine/dgr_keys.h"]


def test_the_headers_say_what_the_python_says(repo_root):
    keys = (repo_root / "worker/engine/dgr_keys.h").read_text()
    assert dict(re.findall(r'#define DGR_KEY_(\w+)\s+"([^"]+)"', keys)) == dict(cppgen.keys())
    server = (repo_root / "worker/server/wire_constants.h").read_text()
    rows = re.findall(r'\{"(\w+)", (\d+), (\d+), (true|false), (\d+)\}', server)
    assert [(n, int(b), int(bb), lo == "true", int(code)) for n, b, bb, lo, code in rows] == [
        (d.name, d.block, d.block_bytes, d.lossless, pb.Dtype.Value(d.name.upper())) for d in WIRE_DTYPES.values()]
    # the plain header's codes, each checked against the proto's enum of its name where protobuf is included
    assert "stage.pb.h" not in server
    codes = (repo_root / "worker/server/wire_dtype_codes.h").read_text()
    assert re.findall(r"static_assert\(WIRE_DTYPES\[(\d+)\]\.code == dgr::v1::(\w+),", codes) == [
        (str(k), d.name.upper()) for k, d in enumerate(WIRE_DTYPES.values())]


def test_the_proto_names_every_wire_dtype_and_no_other():
    assert set(pb.Dtype.keys()) - {"DTYPE_UNSPECIFIED"} == {n.upper() for n in WIRE_DTYPES}


def test_no_other_cpp_file_defines_them_again(repo_root):
    generated = {repo_root / rel for rel in cppgen.HEADERS}
    found = []
    for path in sorted((repo_root / "worker").rglob("*")):
        skip = path in generated or "third_party" in path.parts
        if skip or path.suffix not in (".h", ".cpp", ".cc", ".inc"):
            continue
        text = path.read_text(errors="replace")
        found += [(str(path.relative_to(repo_root)), name) for name, pat in DEFINITIONS.items()
                  if re.search(pat, text)]
    assert found == [], "define these once, in the Python (dgr.toolchain.cppgen writes the C++)"


def test_the_recipe_templates_dtype_choices_are_the_wire_dtypes(repo_root):
    # a JSON template cannot import: written twice, held equal (its first choice is the default)
    spec = json.loads((repo_root / "tools/dgr/toolchain/templates/recipe/cookiecutter.json").read_text())
    assert spec["boundary_dtype"] == list(WIRE_DTYPES) and spec["boundary_dtype"][0] == DEFAULT_WIRE_DTYPE


def _model_fields(model: type[BaseModel]) -> set[str]:
    """The field names of `model` and of every model nested in it."""
    out = set()
    for name, f in model.model_fields.items():
        out.add(name)
        for t in (f.annotation, *typing.get_args(f.annotation)):
            for u in (t, *typing.get_args(t)):
                if isinstance(u, type) and issubclass(u, BaseModel):
                    out |= _model_fields(u)
    return out


def test_the_workers_descriptor_json_names_the_models_fields(repo_root):
    """Written twice: dgr.core.descriptor.Descriptor (the model, its schema generated from it) and dgr-worker's
    descriptor_json (metrics/description.cpp), which writes the JSON key by key. tests/certify/test_descriptor.py
    validates a running worker's JSON against the model; this catches a field added on one side only without
    building the worker."""
    text = (repo_root / "worker/server/metrics/description.cpp").read_text()
    body = text[text.index("std::string descriptor_json("):text.index("std::string metrics_text(")]
    assert set(re.findall(r'\{"(\w+)",', body)) == _model_fields(Descriptor)


def test_the_flag_defaults_are_not_written_again(repo_root):
    """dgr-worker's flags that `dgr worker serve` shares default to the generated values (defaults::...)."""
    names = "|".join(n for _, n, _ in cppgen.flag_defaults())
    for rel in ("worker/server/worker.h", "worker/server/serve.h"):
        text = (repo_root / rel).read_text()
        assert re.findall(rf"\b({names})\s*=\s*[\d.]", text) == [], rel
