"""Corrupt and truncated GGUF headers: `dgr inspect`'s reader, `dgr bundle verify` and the engine's stage-file
checks answer typed errors (dgr.core.errors), never crash, hang or allocate what a bogus length claims."""

from __future__ import annotations

import random
import resource
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dgr.core.errors import BundleError, EngineError, GGUFError
from dgr.core.hashing import file_blake3
from dgr.gguf.model import model_info, read_header
from dgr.toolchain.bundle import build, verify_bundle
from dgr.toolchain.modelreport import format_report, inspect_model
from dgr.toolchain.synth.generic import synth

from support.fuzz import engine_open_outcomes, header_fields, mutate_gguf

N_HEADERS = 10_000


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return synth("llama", 2, 32, 1, tmp_path_factory.mktemp("fuzzgguf") / "small.gguf")


def _bundle(root: Path, src: Path, chunk: int = 4096):
    r = root / "b.toml"
    r.write_text(f'name = "fz"\n[source]\nuri = "{src}"\nblake3 = "{file_blake3(src)}"\n'
                 f"[placement]\nstages = [[0, 1], [1, 2]]\n[bundle]\nchunk_size = {chunk}\n")
    return build(r, root / "store")


def test_ten_thousand_corrupt_headers_give_gguf_errors(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    fields, end = header_fields(data)
    assert end <= read_header(small_gguf).data_offset
    rng = random.Random(10)
    path = tmp_path / "m.gguf"
    outcomes: Counter = Counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(N_HEADERS):
        what, bad = mutate_gguf(data, fields, end, rng)
        path.write_bytes(bad)
        try:
            r = inspect_model(path)
            format_report(r)
            model_info(read_header(path))
            outcomes["ok"] += 1                     # a mutation that kept the file readable (a name's byte)
        except GGUFError as e:
            assert str(path) in str(e), (what, e)
            outcomes["GGUFError"] += 1
        except BaseException as e:                   # noqa: BLE001 - the property under test
            pytest.fail(f"case {i} ({what}): {type(e).__name__}: {e}")
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print(f"\n{N_HEADERS} corrupt headers: {dict(outcomes)}; peak RSS grew {grew_mib:.0f} MiB")
    assert outcomes["GGUFError"] > N_HEADERS // 2
    assert grew_mib < 512                            # no allocation sized by a bogus length


@pytest.mark.parametrize("value,code", [(2**64 - 1, "count"), (2**40, "length"), (0xFFFFFFFF, "type")])
def test_huge_claims_are_refused_before_allocating(small_gguf, tmp_path, value, code):
    import struct

    data = bytearray(small_gguf.read_bytes())
    fields, _ = header_fields(bytes(data))
    for f in [f for f in fields if f.kind == code][:20]:
        b = bytearray(data)
        struct.pack_into("<Q" if f.size == 8 else "<I", b, f.offset, value & ((1 << 8 * f.size) - 1))
        p = tmp_path / "h.gguf"
        p.write_bytes(bytes(b))
        with pytest.raises(GGUFError, match="corrupt|truncated|unknown"):
            read_header(p)


def test_cli_inspect_of_a_corrupt_file_is_a_clear_error(small_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(small_gguf.read_bytes()[:300])
    out = subprocess.run([sys.executable, "-m", "dgr", "inspect", str(bad)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "truncated" in out.stderr and "Traceback" not in out.stderr


def test_verify_names_the_corrupt_file_and_chunk(small_gguf, tmp_path):
    b = _bundle(tmp_path, small_gguf)
    rng = random.Random(3)
    for s in b.manifest.stages:
        p = b.root / s.file
        good = p.read_bytes()
        fields, end = header_fields(good)
        for _ in range(25):
            what, bad = mutate_gguf(good, fields, end, rng)
            if bad == good:
                continue
            p.write_bytes(bad)
            with pytest.raises(BundleError) as e:
                verify_bundle(b.root, resume=False)
            msg = str(e.value)
            assert s.file in msg, what
            if len(bad) == len(good):
                k = next(i for i in range(len(good)) if good[i] != bad[i]) // b.manifest.chunk_size
                assert f"chunk {k} " in msg, (what, msg)
            else:
                assert "truncated" in msg or "too long" in msg
        p.write_bytes(good)
    assert verify_bundle(b.root, resume=False).complete


def test_engine_open_of_corrupt_stage_files_is_typed(engine_lib, small_gguf, tmp_path):
    """A few hundred real-engine opens of corrupted stage files, in a subprocess that may crash."""
    b = _bundle(tmp_path, small_gguf)
    rng = random.Random(5)
    paths = []
    for s in b.manifest.stages:
        good = (b.root / s.file).read_bytes()
        fields, end = header_fields(good)
        for i in range(150):
            what, bad = mutate_gguf(good, fields, end, rng)
            p = tmp_path / "cases" / f"{s.index}-{i}.gguf"
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(bad)
            paths.append(p)
    out = engine_open_outcomes(paths)
    counts = Counter(v.split(" ")[0] for v in out.values())
    print(f"\n{len(paths)} engine opens: {dict(counts)}")
    bad = {p: v for p, v in out.items() if v.startswith(("CRASH", "HANG", "UNTYPED"))}
    # A repeated vocabulary token, which llama.cpp asserts on (abort), is refused by Engine.open first:
    # every corruption ends in a dgr error.
    assert not bad, f"{len(bad)} opens did not end in a dgr error; first: {sorted(bad.items())[:5]}"
    assert len(out) == len(paths)


def _duplicate_vocab(path: Path) -> bool:
    try:
        toks = read_header(path).get("tokenizer.ggml.tokens") or []
    except GGUFError:
        return False
    return len(set(toks)) != len(toks)


def test_engine_refuses_a_repeated_vocabulary_token_instead_of_aborting(engine_lib, small_gguf, tmp_path):
    b = _bundle(tmp_path, small_gguf)
    good = (b.root / b.manifest.stages[0].file).read_bytes()
    toks = read_header(small_gguf).get("tokenizer.ggml.tokens")
    a, c = next((x, y) for x in toks for y in toks if x != y and len(x.encode()) == len(y.encode()) > 1)
    i = good.index(len(c.encode()).to_bytes(8, "little") + c.encode())
    bad = good[:i + 8] + a.encode() + good[i + 8 + len(c.encode()):]     # token c renamed to token a
    p = tmp_path / "dup.gguf"
    p.write_bytes(bad)
    assert _duplicate_vocab(p)
    out = engine_open_outcomes([p])
    assert not out[str(p)].startswith("CRASH"), out
    assert out[str(p)] == "EngineError", out
    from dgr.runtime.engine import Engine

    with pytest.raises(EngineError, match="repeats the token"):
        Engine.open(p, lib=engine_lib)


def test_worker_refuses_a_tampered_stage_file_before_the_engine_opens_it(small_gguf, tmp_path):
    b = _bundle(tmp_path, small_gguf)
    s = b.manifest.stages[1]
    p = b.root / s.file
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    # no engine library at all: a refusal by the engine would name the library, not the chunk
    env = {"DGR_ENGINE_LIB": str(tmp_path / "no-engine.so")}
    import os

    out = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(b.root), "--stage", "1",
                          "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode != 0
    k = (len(data) // 2) // b.manifest.chunk_size
    assert f"{s.file}: chunk {k} " in out.stderr and "does not match the manifest" in out.stderr, out.stderr
    assert "no-engine.so" not in out.stderr and "Traceback" not in out.stderr
