"""Helpers shared by the fuzz tests: GGUF header field maps and mutators, malformed frame makers, and a
subprocess that opens stage files on the real engine (so a crash is caught and counted, not fatal)."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class Field:
    offset: int
    size: int   # 4 or 8 (a count, a length, a type code) or the byte length of a string's bytes
    kind: str   # "count", "length", "type", "dims", "shape", "offset", "bytes", "scalar"


def header_fields(data: bytes) -> tuple[list[Field], int]:
    """Every structural field of a well-formed GGUF header, and where the header ends."""
    pos = 0
    out: list[Field] = []

    def take(n: int, kind: str) -> int:
        nonlocal pos
        fmt = "<I" if n == 4 else "<Q"
        (v,) = struct.unpack_from(fmt, data, pos)
        out.append(Field(pos, n, kind))
        pos += n
        return v

    def string() -> None:
        nonlocal pos
        n = take(8, "length")
        if n:
            out.append(Field(pos, n, "bytes"))
        pos += n

    scal = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(t: int) -> None:
        nonlocal pos
        if t in scal:
            out.append(Field(pos, scal[t], "scalar"))
            pos += scal[t]
        elif t == 8:
            string()
        elif t == 9:
            sub = take(4, "type")
            n = take(8, "count")
            for _ in range(n):
                value(sub)
        else:
            raise AssertionError(f"type {t}")

    pos = 8  # magic, version
    n_tensors = take(8, "count")
    n_kv = take(8, "count")
    for _ in range(n_kv):
        string()
        value(take(4, "type"))
    for _ in range(n_tensors):
        string()
        for _ in range(take(4, "dims")):
            take(8, "shape")
        take(4, "type")
        take(8, "offset")
    return out, pos


_HUGE = (2**64 - 1, 2**63, 2**62 + 1, 2**40, 2**32 - 1, 2**31, 2**24, 0xFFFFFFFF, 65537, 4097, 17, 0)


def mutate_gguf(data: bytes, fields: list[Field], header_end: int, rng: random.Random) -> tuple[str, bytes]:
    """One corrupt or truncated copy of `data` (a well-formed GGUF): (what was done, the bytes)."""
    kind = rng.choice(("truncate", "flip", "field", "field", "field", "bytes", "magic"))
    b = bytearray(data)
    if kind == "truncate":
        cut = rng.choice((rng.randrange(header_end + 1), rng.randrange(len(data)), rng.randrange(32)))
        return f"truncate@{cut}", bytes(b[:cut])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(header_end)] ^= 1 << rng.randrange(8)
        return "flip", bytes(b)
    if kind == "magic":
        off = rng.randrange(8)
        b[off] = rng.randrange(256)
        return f"magic@{off}", bytes(b)
    structural = [f for f in fields if f.kind != "bytes"]
    if kind == "bytes":
        strs = [f for f in fields if f.kind == "bytes"]
        f = rng.choice(strs)
        for _ in range(rng.randint(1, 4)):
            b[f.offset + rng.randrange(f.size)] = rng.choice((0x00, 0xFF, 0xC3, 0x80, rng.randrange(256)))
        return f"bytes@{f.offset}", bytes(b)
    f = rng.choice(structural)
    if f.size in (4, 8):
        v = rng.choice(_HUGE + (rng.getrandbits(8 * f.size),))
        v &= (1 << (8 * f.size)) - 1
        struct.pack_into("<I" if f.size == 4 else "<Q", b, f.offset, v)
    else:
        b[f.offset] = rng.randrange(256)
    return f"{f.kind}@{f.offset}={struct.unpack_from('<I' if f.size == 4 else '<Q', b, f.offset)[0] if f.size in (4, 8) else '?'}", bytes(b)


# A script run in a subprocess: open each file on the real engine, one JSON line per outcome. The parent
# restarts it after a crash (the file being opened is the crash's reproducer).
_OPENER = r"""
import json, sys
from dgr.runtime.engine import Engine
from dgr.core.errors import DgrError
for line in sys.stdin:
    path = line.strip()
    print("@@" + json.dumps({"start": path}), flush=True)
    try:
        e = Engine.open(path, n_ctx=64, max_sessions=1, n_threads=1)
        e.close()
        out = "ok"
    except DgrError as err:
        out = type(err).__name__
    except Exception as err:
        out = "UNTYPED " + type(err).__name__ + ": " + str(err)[:200]
    print("@@" + json.dumps({"done": path, "outcome": out}), flush=True)
"""


def engine_open_outcomes(paths: list[Path], timeout: float = 300) -> dict[str, str]:
    """path -> outcome ('ok', a DgrError class name, 'UNTYPED ...', 'CRASH rc', 'HANG') for each file."""
    todo = [str(p) for p in paths]
    out: dict[str, str] = {}
    while todo:
        p = subprocess.Popen([sys.executable, "-c", _OPENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, errors="replace",
                             env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        try:
            stdout, _ = p.communicate("\n".join(todo) + "\n", timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
            hung = True
        started = None
        for line in stdout.splitlines():
            if not line.startswith("@@"):
                continue                               # the engine's own output
            rec = json.loads(line[2:])
            if "start" in rec:
                started = rec["start"]
            else:
                out[rec["done"]] = rec["outcome"]
                started = None
        if started is not None:
            out[started] = "HANG" if hung else f"CRASH {p.returncode}"
        todo = [t for t in todo if t not in out]
        if hung and started is None:
            break
    return out


# ---------------------------------------------------------------------------------------------- frames


def frame_mutations(pb, codec, good_schema, shape_tail: tuple[int, int], sid: str, epoch: int,
                    rng: random.Random, pos0: int = 0):
    """An endless stream of malformed frames for a non-first stage holding session (sid, epoch) at
    `pos0` positions: each differs from a well-formed step in one or more ways."""
    ns, ne = shape_tail
    nrng = np.random.default_rng(rng.getrandbits(32))

    def good(n: int):
        x = nrng.standard_normal((n, ns, ne)).astype(np.float32) if rng.random() < 0.1 else \
            np.zeros((n, ns, ne), np.float32)
        return pb.Frame(session_id=sid, epoch=epoch, step=pb.Step(
            positions=range(pos0, pos0 + n), token_ids=[7] * n, boundary=codec.encode(x, good_schema.dtype),
            schema=good_schema, cache_expect=pos0))

    def m_shape(f):
        f.step.boundary.shape[:] = rng.choice(([], [1], [len(f.step.positions), ns], [0, ns, ne],
                                               [len(f.step.positions) + 1, ns, ne], [1, ns, ne, 1],
                                               [2**31, 2**31, 2**31], [len(f.step.positions), ne, ns + 1]))

    def m_dtype(f):
        f.step.boundary.dtype = rng.choice([d for d in (0, 1, 2, 3, 4, 99, 2**31 - 1) if d != good_schema.dtype])

    def m_data(f):
        d = f.step.boundary.data
        f.step.boundary.data = rng.choice((b"", d[:-1], d + b"\0", d[: len(d) // 2],
                                           bytes(rng.getrandbits(8) for _ in range(rng.randrange(64)))))

    def m_positions(f):
        n = len(f.step.positions)
        f.step.positions[:] = rng.choice(([], [pos0 + 1] * n, list(range(pos0 + n, pos0, -1)),
                                          [2**31 - 1] * n, [-1] + list(range(n - 1)),
                                          list(range(pos0 + 10**6, pos0 + 10**6 + n))))

    def m_cache(f):
        f.step.cache_expect = rng.choice((pos0 + 1, 2**64 - 1, 2**31 + 7, pos0 + 3))
        if rng.random() < 0.5:
            # small: a frame the checks pass and the engine refuses (CACHE_MISS: it holds pos0 positions);
            # huge: contiguous positions, but not where cache_expect says
            p = f.step.cache_expect if f.step.cache_expect < 2**20 else f.step.cache_expect % 2**20
            f.step.positions[:] = range(p, p + len(f.step.positions))

    def m_session(f):
        f.session_id = rng.choice(("", "nobody", sid + "x", "\u2603" * 40, "a" * 4096))

    def m_epoch(f):
        f.epoch = rng.choice((0, epoch + 1, epoch + 1000, 2**64 - 1))

    def m_schema(f):
        s = f.step.schema
        # (not token_ids: a sender's flag, checked against what the receiver needs at OpenSession)
        which = rng.choice(("n_streams", "n_embd", "dtype", "bundle_id", "layer", "clear"))
        if which == "clear":
            f.step.ClearField("schema")
        elif which == "bundle_id":
            s.bundle_id = rng.choice(("", "other", s.bundle_id + "\0"))
        else:
            top = 2**31 if which == "dtype" else 2**32    # an enum is an int32
            setattr(s, which, (getattr(s, which) + rng.choice((1, 7, 2**31 - 1))) % top)

    def m_missing(f):
        which = rng.choice(("boundary", "token_ids", "step", "all"))
        if which == "boundary":
            f.step.ClearField("boundary")
        elif which == "token_ids":
            del f.step.token_ids[:]
        elif which == "step":
            f.ClearField("step")
        else:
            f.Clear()

    def m_body(f):
        if rng.random() < 0.5:
            f.generate.max_new_tokens = rng.randrange(2**32)    # generate frames go to stage 0 only
        else:
            f.step.token_ids.extend([rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(1, 5))])

    def m_count(f):
        n = rng.choice((600, 4096))
        f.step.positions[:] = range(pos0, pos0 + n)

    muts = (m_shape, m_dtype, m_data, m_positions, m_cache, m_session, m_epoch, m_schema, m_missing, m_body,
            m_count)
    while True:
        f = good(rng.choice((1, 1, 2, 3)))
        for m in rng.sample(muts, rng.choice((1, 1, 1, 2, 3))):
            m(f)
        yield f


def whole_model(spec: str, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from the unsplit fake model `spec` (no wire involved): the expected text's ids."""
    from dgr.runtime.engine_api import Step
    from dgr.testing.fake_engine import FakeEngine, FakeModel

    e = FakeEngine(FakeModel.from_spec(spec))
    e.open_session("ref", 1)
    r = e.forward([Step("ref", 1, np.arange(len(ids)), np.array(ids), want_logits="last")])[0]
    out, pos = [], len(ids)
    while True:
        out.append(r.next_token)
        if len(out) == n or r.next_token in e.eos_token_ids():
            return out
        r = e.forward([Step("ref", 1, np.array([pos]), np.array([r.next_token]), want_logits="last")])[0]
        pos += 1


# ---------------------------------------------------------------------------------------------- full disks


class Tmpfs:
    """A small tmpfs mounted at `path` (root only); `fill_to(free)` leaves exactly `free` bytes (pages)."""

    def __init__(self, path: Path, size: str):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                             capture_output=True, text=True)
        if out.returncode:
            import pytest

            pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}): the full-disk tests need root")

    def free(self) -> int:
        import shutil

        return shutil.disk_usage(self.path).free

    def fill_to(self, free: int) -> Path:
        filler = self.path / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (self.free() - free))
        assert self.free() == free, (self.free(), free)
        return filler

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)
