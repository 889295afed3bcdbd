"""A deterministic numpy ShardEngine for protocol and client tests (milliseconds, no llama.cpp).

A fake *model* (`FakeModel`, built from a spec string such as ``"layers=6,embd=16,cuts=2:4,seed=1"``)
has token embeddings, `layers` residual layers and a head, all drawn from `seed`. A fake *bundle* cuts it
at `cuts` into stages; `FakeEngine(model, stage)` runs one stage, `FakeEngine(model)` the whole model,
and the whole model's logits equal the composition of its stages' bit for bit (every op is a per-token
matvec, so batching and chunking do not change a single bit).

Each layer mixes the token with the running mean of everything the session has seen at that layer, so
outputs depend on history and a stage must hold a real per-session cache: a step whose positions do not
continue the cache raises `CacheMiss`. The first `hash_layers` layers also mix in the token id (as
DeepSeek V4's hash-routed layers do), so a later stage that owns one of them needs the token-id
sideband (`dgr.contract.needs_token_ids`).

Vocabulary: 0 pad, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (UTF-8), the rest unused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dgr.constants import DEFAULT_N_CTX
from dgr.contract import StageContract
from dgr.engine_api import MemoryReport, StageInfo, Step, StepResult, VocabInfo
from dgr.errors import CacheMiss, EngineError, SchemaMismatch

BOS, EOS, BYTE0 = 1, 2, 3
_SPEC_KEYS = ("layers", "embd", "streams", "vocab", "seed", "cuts", "hash_layers", "ctx", "sessions", "recurrent")


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
        """Parse ``key=value,...`` (keys: layers embd streams vocab seed cuts hash_layers ctx sessions;
        cuts as ``2:4``)."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in _SPEC_KEYS:
                raise EngineError(f"fake engine spec {spec!r}: bad item {part!r}; expected key=value "
                                  f"with key in {', '.join(_SPEC_KEYS)}")
            if key == "cuts":
                kw[key] = tuple(int(c) for c in value.split(":") if c)
            else:
                kw[key] = int(value)
        return cls(**kw)

    def to_spec(self) -> str:
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


class _Weights:
    """All parameters, drawn deterministically from the seed (per layer, so a stage draws only its own)."""

    def __init__(self, m: FakeModel, begin: int, end: int):
        d = m.width
        rng = np.random.default_rng([m.seed, 0])
        self.embed = rng.standard_normal((m.vocab, d)).astype(np.float32)
        self.head = (rng.standard_normal((d, m.vocab)) / np.sqrt(d)).astype(np.float32)
        self.tok = (rng.standard_normal((m.vocab, d)) * 0.5).astype(np.float32)
        self.layers = {}
        for layer in range(begin, end):
            r = np.random.default_rng([m.seed, 1, layer])
            w = (r.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
            a = r.uniform(0.5, 1.5, d).astype(np.float32)
            self.layers[layer] = (w, a)


class FakeEngine:
    """One stage (or, with stage=None, the whole model) of a `FakeModel`."""

    def __init__(self, model: FakeModel | str, stage: int | None = None):
        self.model = FakeModel.from_spec(model) if isinstance(model, str) else model
        m = self.model
        if stage is None:
            self.begin, self.end, self.stage = 0, m.layers, None
        else:
            if not 0 <= stage < len(m.ranges):
                raise EngineError(f"fake bundle has {len(m.ranges)} stages; there is no stage {stage}")
            (self.begin, self.end), self.stage = m.ranges[stage], stage
        self.w = _Weights(m, self.begin, self.end)
        # Its seams by the one sideband rule, as a bundle build would plan them.
        contract = StageContract.plan(self.begin, self.end, m.layers, n_streams=m.streams, n_embd=m.embd,
                                      n_hash_layers=m.hash_layers)
        self._info = StageInfo(arch="fake", contract=contract, n_vocab=m.vocab, has_vocab=True, n_ctx=m.ctx,
                               max_sessions=m.sessions, can_truncate=not m.recurrent)
        self.sessions: dict[tuple[str, int], dict] = {}
        self.closed = False

    def describe(self) -> StageInfo:
        return self._info

    # --- sessions
    def open_session(self, session_id: str, epoch: int) -> None:
        key = (session_id, epoch)
        if key in self.sessions:
            raise EngineError(f"session {session_id} epoch {epoch} is already open")
        if len(self.sessions) >= self.model.sessions:
            raise EngineError(f"all {self.model.sessions} sessions are in use; close one first")
        d = self.model.width
        # "sums": each layer's running sum; "inputs": each layer's input per position, kept so that
        # `truncate` can recompute the sums of a shorter prefix (speculation's rollback)
        self.sessions[key] = {"n": 0, "sums": {l: np.zeros(d, np.float64) for l in self.w.layers},
                              "inputs": {l: [] for l in self.w.layers}}

    def close_session(self, session_id: str, epoch: int) -> None:
        self.sessions.pop((session_id, epoch), None)

    def n_cached(self, session_id: str, epoch: int) -> int:
        return self._session(session_id, epoch)["n"]

    def truncate(self, session_id: str, epoch: int, n_keep: int) -> None:
        """Drop positions >= n_keep: the running sums become those of the first n_keep inputs, summed in
        the same order as the forward did (so the result is bit for bit the cache of a shorter history)."""
        sess = self._session(session_id, epoch)
        if not 0 <= n_keep <= sess["n"]:
            raise EngineError(f"session {session_id} epoch {epoch} holds {sess['n']} positions: cannot keep {n_keep}")
        if n_keep == sess["n"]:
            return
        if self.model.recurrent:
            raise EngineError("fake recurrent model: its state cannot drop positions (only the latest state is "
                              "kept), so speculative decoding is not possible; generate without --speculate")
        for layer, inputs in sess["inputs"].items():
            del inputs[n_keep:]
            s = np.zeros(self.model.width, np.float64)
            for h in inputs:
                s += h
            sess["sums"][layer] = s
        sess["n"] = n_keep

    def _session(self, session_id: str, epoch: int) -> dict:
        try:
            return self.sessions[(session_id, epoch)]
        except KeyError:
            raise EngineError(f"no open session {session_id} epoch {epoch} on layers "
                              f"[{self.begin}, {self.end}); open it first") from None

    # --- compute
    def _check(self, step: Step, info: StageInfo) -> tuple[dict, np.ndarray]:
        sess = self._session(step.session_id, step.epoch)
        pos = np.asarray(step.positions, dtype=np.int32)
        n = len(pos)
        if n == 0:
            raise EngineError("a step needs at least one position")
        if pos[0] != sess["n"]:
            raise CacheMiss(f"session {step.session_id} epoch {step.epoch} holds {sess['n']} positions "
                            f"on layers [{self.begin}, {self.end}) but the step starts at {pos[0]}: "
                            f"re-prefill at a new epoch", held=sess["n"], expected=int(pos[0]))
        if not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
            raise EngineError("positions must be contiguous and increasing")
        if pos[-1] >= info.n_ctx:
            raise EngineError(f"position {pos[-1]} is beyond the context of {info.n_ctx}")
        needs_ids = info.is_first or info.needs_token_ids
        if needs_ids and (step.token_ids is None or len(step.token_ids) != n):
            raise SchemaMismatch(f"layers [{self.begin}, {self.end}) need {n} token ids with the step "
                                 f"(got {None if step.token_ids is None else len(step.token_ids)})")
        if step.token_ids is not None:
            ids = np.asarray(step.token_ids)
            if ids.size and (ids.min() < 0 or ids.max() >= info.n_vocab):
                raise EngineError(f"token id out of range [0, {info.n_vocab})")
        if info.is_first:
            x = self.w.embed[np.asarray(step.token_ids)]
        else:
            want = (n, info.n_streams, info.n_embd)
            b = step.boundary
            if b is None or b.dtype != np.float32 or tuple(b.shape) != want:
                got = None if b is None else f"{b.dtype}{list(b.shape)}"
                raise SchemaMismatch(f"layers [{self.begin}, {self.end}) take a float32 boundary "
                                     f"{list(want)}, got {got}")
            x = b.reshape(n, -1)
        return sess, x

    def forward(self, steps: list[Step]) -> list[StepResult]:
        if self.closed:
            raise EngineError("engine is closed")
        info = self.describe()
        keys = [(s.session_id, s.epoch) for s in steps]
        if len(set(keys)) != len(keys):
            raise EngineError("one batch holds at most one step per session")
        checked = [self._check(s, info) for s in steps]   # validate all before touching any cache
        results = []
        for step, (sess, x) in zip(steps, checked):
            ids = None if step.token_ids is None else np.asarray(step.token_ids)
            out = np.empty_like(x)
            for t in range(x.shape[0]):
                h = x[t].astype(np.float32)
                for layer in range(self.begin, self.end):
                    w, a = self.w.layers[layer]
                    s = sess["sums"][layer]
                    s += h
                    sess["inputs"][layer].append(h)
                    mean = (s / (sess["n"] + t + 1)).astype(np.float32)
                    z = w @ h + a * mean
                    if layer < self.model.hash_layers:
                        z = z + self.w.tok[ids[t]]
                    h = (h + np.tanh(z)).astype(np.float32)
                out[t] = h
            sess["n"] += x.shape[0]
            res = StepResult(step.session_id, step.epoch, n_cached=sess["n"])
            if info.is_last:
                rows = {"all": out, "last": out[-1:], "none": out[:0]}[step.want_logits]
                res.logits = np.stack([self._head(r) for r in rows]) if len(rows) else \
                    np.zeros((0, info.n_vocab), np.float32)
                res.next_token = int(np.argmax(self._head(out[-1])))
            else:
                res.boundary = out.reshape(-1, info.n_streams, info.n_embd)
            results.append(res)
        return results

    def _head(self, h: np.ndarray) -> np.ndarray:
        return (h / np.float32(max(float(np.linalg.norm(h)), 1e-6))) @ self.w.head

    # --- vocabulary
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + [BYTE0 + b for b in text.encode("utf-8")]

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i - BYTE0 for i in ids if BYTE0 <= i < BYTE0 + 256).decode("utf-8", "replace")

    def eos_token_ids(self) -> list[int]:
        return list(self.vocab().stop_ids)

    def vocab(self) -> VocabInfo:
        """As `dgr.engine.Engine.vocab()`: BOS and EOS, no separate end of turn; EOS alone ends a generation."""
        return VocabInfo(n_vocab=self.model.vocab, bos=BOS, eos=EOS, eot=None, eog=(EOS,))

    def memory(self) -> MemoryReport:
        d = self.model.width
        weights = sum(w.nbytes + a.nbytes for w, a in self.w.layers.values()) + self.w.embed.nbytes \
            + self.w.head.nbytes + self.w.tok.nbytes
        return MemoryReport(weights_bytes=weights, kv_bytes=len(self.sessions) * len(self.w.layers) * d * 8,
                            compute_bytes=0, layers_with_state=tuple(self.w.layers))

    def close(self) -> None:
        self.sessions.clear()
        self.closed = True
