"""The fake engine for protocol and client tests (milliseconds, no llama.cpp): a small C++ library behind
the real engine's C ABI (worker/fake/dgr_fake_engine.cpp, `libdgr_fake_engine.so`), run here through
dgr.runtime.engine's ctypes and by the real dgr-worker (`dgr-worker --fake-engine SPEC --stage N`).

A fake *model* (`FakeModel`, built from a spec string such as ``"layers=6,embd=16,cuts=2:4,seed=1"``)
has token embeddings, `layers` residual layers and a head, all drawn from `seed`. A fake *bundle* cuts it
at `cuts` into stages; `FakeEngine(model, stage)` runs one stage, `FakeEngine(model)` the whole model,
and the whole model's logits equal the composition of its stages' bit for bit (every op is a per-token
scalar loop in a fixed order, so batching and chunking do not change a single bit).

Each layer mixes the token with the running mean of everything the session has seen at that layer, so
outputs depend on history and a stage must hold a real per-session cache: a step whose positions do not
continue the cache raises `CacheMiss`. The first `hash_layers` layers also mix in the token id (as
DeepSeek V4's hash-routed layers do), so a later stage that owns one of them needs the token-id
sideband (`dgr.core.contract.needs_token_ids`). `recurrent=1` behaves as a recurrent model: no partial
rollback (truncate refuses). The layer formula and the weights' generator are at the top of
worker/fake/dgr_fake_engine.cpp.

Vocabulary: 0 pad, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (UTF-8), the rest unused.

The library: $DGR_FAKE_ENGINE_LIB (a runfiles path under Bazel), else `libdgr_fake_engine.so` beside the
engine library when it is newer than the fake's sources (`dgr build-engine --lane cpu` builds it there),
else one built here on demand with the system C++ compiler (a second or two), cached in the workspace
under a hash of its sources.
"""

from __future__ import annotations

import ctypes as C
import dataclasses
import hashlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr.core.constants import DEFAULT_N_CTX
from dgr.core.contract import StageContract
from dgr.core.errors import EngineError
from dgr.core.locks import locked
from dgr.core.paths import REPO_ROOT, default_engine_library, env_path, workspace
from dgr.runtime.engine import LIB_ENV as ENGINE_ENV, OK, Engine, load_library
from dgr.runtime.engine_abi import raise_status
from dgr.runtime.engine_api import MemoryReport, StageInfo, Step, StepResult

BOS, EOS, BYTE0 = 1, 2, 3
_SPEC_KEYS = ("layers", "embd", "streams", "vocab", "seed", "cuts", "hash_layers", "ctx", "sessions", "recurrent")

LIB_ENV = "DGR_FAKE_ENGINE_LIB"
LIBRARY = "libdgr_fake_engine.so"
# what the library is compiled from (repository paths); a change to any of them rebuilds it on demand
# What it is compiled from: every file of worker/fake (as CMake and Bazel glob them) and these of the engine.
ENGINE_SOURCES = ("worker/engine/dgr_sample.cpp", "worker/engine/dgr_engine.h", "worker/engine/dgr_contract.h",
                  "worker/engine/dgr_keys.h")


def sources(root: Path) -> list[str]:
    """The fake engine's sources under `root`, relative, sorted (worker/fake/*.cpp and *.h, ENGINE_SOURCES)."""
    fake = sorted(p.relative_to(root).as_posix() for p in (root / "worker" / "fake").glob("*.[ch]*")
                  if p.suffix in (".cpp", ".h"))
    return [*fake, *ENGINE_SOURCES]
# no -march, no -ffast-math: fp-contract off keeps every product and sum rounded on its own (the same
# flags as worker/CMakeLists.txt and worker/fake/BUILD.bazel give it)
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off")


@dataclass(frozen=True)
class FakeModel:
    layers: int = 6
    embd: int = 16
    streams: int = 1
    vocab: int = 300
    seed: int = 1
    cuts: tuple[int, ...] = (2, 4)       # stage boundaries: stages [0,2) [2,4) [4,6)
    hash_layers: int = 0                 # the first N layers need token ids (V4-style sideband)
    ctx: int = DEFAULT_N_CTX
    sessions: int = 64
    recurrent: int = 0                   # 1: behave as a recurrent model (no partial rollback: truncate refuses)

    def __post_init__(self):
        if self.vocab < BYTE0 + 256:
            raise EngineError(f"fake model: vocab={self.vocab} must be at least {BYTE0 + 256}")
        if list(self.cuts) != sorted(set(self.cuts)) or any(not 0 < c < self.layers for c in self.cuts):
            raise EngineError(f"fake model: cuts={self.cuts} must be increasing layer indices inside "
                              f"(0, {self.layers})")

    @classmethod
    def from_spec(cls, spec: str) -> FakeModel:
        """Parse ``key=value,...`` (keys: layers embd streams vocab seed cuts hash_layers ctx sessions
        recurrent; cuts as ``2:4``)."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in _SPEC_KEYS:
                raise EngineError(f"fake engine spec {spec!r}: bad item {part!r}; expected key=value "
                                  f"with key in {', '.join(_SPEC_KEYS)}")
            try:
                kw[key] = tuple(int(c) for c in value.split(":") if c) if key == "cuts" else int(value)
            except ValueError:
                raise EngineError(f"fake engine spec {spec!r}: bad item {part!r}; {value!r} is not an "
                                  f"integer") from None
        return cls(**kw)

    def to_spec(self) -> str:
        """The canonical spec (worker/fake/dgr_fake_engine.cpp's dgr_fake_spec writes the same)."""
        return ",".join(f"{k}={':'.join(map(str, v)) if k == 'cuts' else v}"
                        for k in _SPEC_KEYS for v in [getattr(self, k)]
                        if k != "recurrent" or v)          # (older specs, and their bundle ids, unchanged)

    @property
    def bundle_id(self) -> str:
        return "fake-" + hashlib.sha256(self.to_spec().encode()).hexdigest()[:16]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        edges = [0, *self.cuts, self.layers]
        return list(zip(edges[:-1], edges[1:]))

    @property
    def width(self) -> int:
        return self.streams * self.embd


# --- where the library comes from

_found: Path | None = None
_find_lock = threading.Lock()


def _repo_root() -> Path:
    return REPO_ROOT


def _from_env(value: str) -> Path:
    """$DGR_FAKE_ENGINE_LIB: a path, or under Bazel a runfiles path."""
    path = env_path(value)
    if not path.is_file():
        raise EngineError(f"{LIB_ENV}={value}: no such file; unset it (the fake engine is then built on demand) "
                          f"or point it at a built {LIBRARY}")
    return path.resolve()


def _beside_engine() -> Path | None:
    """libdgr_fake_engine.so beside the engine library ($DGR_ENGINE_LIB, else the workspace's CPU build),
    when it is at least as new as every source it is built from (a stale one is passed over)."""
    env = os.environ.get(ENGINE_ENV)
    for engine in ([Path(env)] if env else []) + [default_engine_library("cpu")]:
        lib = engine.parent / LIBRARY
        if lib.is_file():
            srcs = [_repo_root() / s for s in sources(_repo_root())]
            newest = max((s.stat().st_mtime for s in srcs if s.is_file()), default=0.0)
            if lib.stat().st_mtime >= newest:
                return lib.resolve()
    return None


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not shutil.which(cxx):
        raise EngineError(f"the fake engine ({LIBRARY}) is built on demand with a C++ compiler, and none was found "
                          "(CXX, c++, g++ or clang++): install one (Debian: apt-get install g++), build it with "
                          f"`dgr build-engine --lane cpu`, or set {LIB_ENV}")
    return cxx


def build_library() -> Path:
    """Compile the fake engine with the system C++ compiler into the workspace (once per source hash,
    under a file lock); its path."""
    root = _repo_root()
    rels = sources(root)
    srcs = [root / s for s in rels]
    missing = [str(s) for s in srcs if not s.is_file()]
    if missing:
        raise EngineError(f"the fake engine's sources are not here ({', '.join(missing)}): set {LIB_ENV} to a "
                          f"built {LIBRARY}, or run from a checkout")
    cxx = _compiler()
    h = hashlib.sha256("\0".join((cxx, *CXXFLAGS)).encode())
    for rel, src in zip(rels, srcs):
        h.update(f"\0{rel}\0".encode())
        h.update(src.read_bytes())
    folder = workspace() / "build" / "fake-engine"
    out = folder / h.hexdigest()[:16] / LIBRARY
    if out.is_file():
        return out
    with locked(folder / ".build.lock"):
        if out.is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{LIBRARY}.{os.getpid()}.tmp")
        cmd = [cxx, *CXXFLAGS, f"-I{root / 'worker/engine'}", f"-I{root / 'worker/fake'}",
               *(str(s) for s in srcs if s.suffix == ".cpp"), "-o", str(tmp)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as err:
            raise EngineError(f"cannot run the C++ compiler {cxx} for the fake engine: {err}") from None
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise EngineError(f"building the fake engine failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    return out


def library_path() -> Path:
    """The fake engine library: $DGR_FAKE_ENGINE_LIB, else the one beside the engine library (when it is
    not older than its sources), else one built on demand (see `build_library`)."""
    global _found
    env = os.environ.get(LIB_ENV)
    if env:
        return _from_env(env)
    with _find_lock:
        if _found is None or not _found.is_file():
            _found = _beside_engine() or build_library()
        return _found


# --- the engine


class FakeEngine(Engine):
    """One stage (or, with stage=None, the whole model) of a `FakeModel`, on the C fake engine through
    dgr.runtime.engine's ctypes (implements dgr.runtime.engine_api.ShardEngine, as `dgr.runtime.engine.Engine` does)."""

    def __init__(self, model: FakeModel | str, stage: int | None = None):
        self.model = FakeModel.from_spec(model) if isinstance(model, str) else model
        m = self.model
        if stage is not None and not 0 <= stage < len(m.ranges):
            raise EngineError(f"fake bundle has {len(m.ranges)} stages; there is no stage {stage}")
        self.stage = stage
        self.begin, self.end = (0, m.layers) if stage is None else m.ranges[stage]
        self.sessions: set[tuple[str, int]] = set()     # the open (session, epoch) keys
        spec = m.to_spec() + ("" if stage is None else f",stage={stage}")
        lib = load_library(library_path())
        out = C.c_void_p()
        st = lib.dgr_engine_open(spec.encode(), None, C.byref(out))
        if st != OK:
            raise_status(lib, st)
        super().__init__(out, lib, Path(f"fake:{spec}"))

    def _describe(self) -> StageInfo:
        info = super()._describe()
        m = self.model
        # its seams by the one sideband rule, as a bundle build would plan them (the next stage's needs too)
        contract = StageContract.plan(info.layer_begin, info.layer_end, m.layers, n_streams=m.streams, n_embd=m.embd,
                                      n_hash_layers=m.hash_layers)
        return dataclasses.replace(info, contract=contract)

    @property
    def closed(self) -> bool:
        return self._h is None

    def open_session(self, session_id: str, epoch: int) -> None:
        super().open_session(session_id, epoch)
        self.sessions.add((session_id, epoch))

    def close_session(self, session_id: str, epoch: int) -> None:
        super().close_session(session_id, epoch)
        self.sessions.discard((session_id, epoch))

    def forward(self, steps: list[Step]) -> list[StepResult]:
        if self.closed:
            raise EngineError("engine is closed")
        results = super().forward(steps) if steps else []
        if self._info.is_last:                          # want_logits="none": no rows (not None)
            for r in results:
                if r.logits is None:
                    r.logits = np.zeros((0, self._info.n_vocab), np.float32)
        return results

    def eos_token_ids(self) -> list[int]:
        return list(self.vocab().stop_ids)

    def memory(self) -> MemoryReport:
        return dataclasses.replace(super().memory(), layers_with_state=tuple(range(self.begin, self.end)))

    def close(self) -> None:
        self.sessions.clear()
        super().close()
