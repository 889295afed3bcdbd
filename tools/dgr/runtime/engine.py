"""The real ShardEngine: ctypes over worker/engine's C ABI (dgr_engine.h), implementing
`dgr.runtime.engine_api.ShardEngine`.

    eng = Engine.open("stage-00-of-02.gguf")                 # a stage of a bundle
    eng = Engine.open("model.gguf", layer_range=(0, 12))     # a whole GGUF with a range override (tests)
    eng = Engine.open("model.gguf")                          # the whole model (baseline)

The library is the `lib` argument, else `$DGR_ENGINE_LIB`, else the CPU build that `dgr build-engine
--lane cpu` leaves in the workspace. The runtime never builds it (a worker must not compile llama.cpp):
callers that may build (the demo, test fixtures) call `dgr.toolchain.enginebuild.ensure_engine()` first. Every C
status becomes a dgr.core.errors type; the engine never crashes on bad input.
"""

from __future__ import annotations

import ctypes as C
import json
from pathlib import Path

import gguf
import numpy as np
from pydantic import ValidationError

from dgr.core.constants import DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX
from dgr.core.contract import StageContract
from dgr.core.errors import EngineError, GGUFError, SchemaMismatch
from dgr.gguf.model import read_header
# LIB_ENV, OK, library_path and load_library are part of this module's face (callers import them from here)
from dgr.runtime.engine_abi import (E_ENGINE, KERNELS, LIB_ENV, OK, WANT_LOGITS, CMemory, COpenParams, CStageInfo,  # noqa: F401
                                    CStep, CStepOut, CVocabInfo, library_path, load_library, raise_status)
from dgr.runtime.engine_api import MemoryReport, StageInfo, Step, StepResult, VocabInfo


def sample(logits, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
           position: int = 0, lib: str | Path | C.CDLL | None = None) -> int:
    """The token dgr-worker's last stage draws from one row of logits: the engine library's own sampler
    (`dgr_sample`, worker/engine/dgr_sample.cpp), keyed by (seed, position); greedy at temperature 0. `lib`:
    a loaded library (the fake engine's carries the same sampler) or where to load one."""
    h = lib if isinstance(lib, C.CDLL) else load_library(lib)
    row = np.ascontiguousarray(logits, dtype=np.float32)
    if row.ndim != 1 or row.size == 0:
        raise EngineError(f"sample: one non-empty row of logits, not shape {row.shape}")
    tok = h.dgr_sample(row.ctypes.data_as(C.POINTER(C.c_float)), row.size, float(temperature), int(top_k),
                       float(top_p), int(seed) & (2**64 - 1), int(position))
    if tok < 0:
        raise EngineError(f"dgr_sample refused a row of {row.size} logits")
    return int(tok)


def logprobs(logits, *, chosen: int = -1, top: int = 0,
             lib: str | Path | C.CDLL | None = None) -> tuple[float | None, list[tuple[int, float]]]:
    """The log-probabilities dgr-worker's last stage reports for one row (`dgr_logprobs`): the model's
    distribution (log-softmax of the raw row). Returns (chosen's logprob or None, [(id, logprob)] of the
    `top` most likely, most likely first, ties by lower id)."""
    h = lib if isinstance(lib, C.CDLL) else load_library(lib)
    row = np.ascontiguousarray(logits, dtype=np.float32)
    if not hasattr(h, "dgr_logprobs"):
        raise EngineError("this engine library has no dgr_logprobs; rebuild it (`dgr build-engine`)")
    chosen_lp = C.c_float()
    ids = (C.c_int32 * max(1, top))()
    lps = (C.c_float * max(1, top))()
    n = h.dgr_logprobs(row.ctypes.data_as(C.POINTER(C.c_float)), row.size, int(chosen), C.byref(chosen_lp),
                       int(top), ids, lps)
    if n < 0:
        raise EngineError(f"dgr_logprobs refused a row of {row.size} logits (chosen {chosen}, top {top})")
    return (float(chosen_lp.value) if chosen >= 0 else None), [(int(ids[i]), float(lps[i])) for i in range(n)]


def json_schema_to_grammar(schema: str | dict, *, lib: str | Path | C.CDLL | None = None) -> str:
    """The GBNF the pinned llama.cpp's json_schema_to_grammar makes of a JSON Schema (what the last stage
    constrains a `json_schema` session with). Raises EngineError saying why a schema is refused."""
    h = lib if isinstance(lib, C.CDLL) else load_library(lib)
    if not hasattr(h, "dgr_json_schema_to_grammar"):
        raise EngineError("this engine library has no grammar support; rebuild it (`dgr build-engine`)")
    raw = (schema if isinstance(schema, str) else json.dumps(schema)).encode()
    cap = 4096
    while True:
        buf = C.create_string_buffer(cap)
        n = h.dgr_json_schema_to_grammar(raw, buf, cap)
        if n < 0:
            raise_status(h, E_ENGINE)
        if n <= cap:
            return buf.raw[:n].decode()
        cap = n


class Grammar:
    """llama.cpp's grammar sampler over an open engine's vocabulary (`Engine.grammar`): `apply` masks a
    logits row (forbidden tokens become -inf), `accept` advances it over the token drawn."""

    def __init__(self, lib: C.CDLL, handle: C.c_void_p):
        self._lib, self._h = lib, handle

    def apply(self, logits) -> np.ndarray:
        row = np.array(logits, dtype=np.float32, copy=True)
        status = self._lib.dgr_grammar_apply(self._h, row.ctypes.data_as(C.POINTER(C.c_float)), row.size)
        if status:
            raise_status(self._lib, status)
        return row

    def accept(self, token: int) -> None:
        status = self._lib.dgr_grammar_accept(self._h, int(token))
        if status:
            raise_status(self._lib, status)

    def close(self) -> None:
        if self._h:
            self._lib.dgr_grammar_close(self._h)
            self._h = None

    def __del__(self):
        self.close()


def _vocab(h: C.CDLL, call) -> VocabInfo:
    """`call(info, eog, cap)` (dgr_vocab_read or dgr_engine_vocab bound to its first argument) as a VocabInfo;
    a second call when the vocabulary marks more end-of-generation ids than the first array held."""
    cap = 64
    while True:
        info, eog = CVocabInfo(), (C.c_int32 * cap)()
        st = call(C.byref(info), eog, cap)
        if st != OK:
            raise_status(h, st)
        if info.n_eog <= cap:
            break
        cap = info.n_eog
    opt = lambda t: None if t < 0 else int(t)               # noqa: E731
    return VocabInfo(n_vocab=info.n_vocab, bos=opt(info.bos), eos=opt(info.eos), eot=opt(info.eot),
                     eog=tuple(int(t) for t in eog[:info.n_eog]))


def read_vocab(path: str | Path, *, lib: str | Path | None = None) -> VocabInfo:
    """The special tokens of the GGUF at `path` (a whole model or a stage file) as llama.cpp sees them,
    from its vocabulary alone (no weights are loaded): bos, eos, eot and every end-of-generation id."""
    h = load_library(lib)
    path = Path(path)
    if not path.is_file():
        raise EngineError(f"{path}: no such file")
    _refuse_what_llama_aborts_on(path)
    return _vocab(h, lambda info, eog, cap: h.dgr_vocab_read(str(path).encode(), info, eog, cap))


def _i32(a, n: int, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(a), dtype=np.int32)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise SchemaMismatch(f"{what} must be int32 [{n}], got shape {arr.shape}")
    return arr


def _refuse_what_llama_aborts_on(path: Path) -> None:
    """Checks of a model file that llama.cpp makes with an assertion (which aborts the whole process)
    rather than an error: a vocabulary with a repeated token (llama-vocab.cpp's GGML_ASSERT on
    id_to_token.size() == token_to_id.size()). llama.cpp reads each token as a C string, so two tokens
    that agree up to a NUL byte are the same token to it. A header dgr cannot read is left to the
    engine's own checks, which answer with typed errors."""
    try:
        tokens = read_header(path).get(gguf.Keys.Tokenizer.LIST)
    except GGUFError:
        return
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        as_c = [t.split("\x00", 1)[0] for t in tokens]
        if len(set(as_c)) == len(as_c):
            return
        seen: set = set()
        dup = next(t for t in as_c if t in seen or seen.add(t))
        raise EngineError(f"{path}: the vocabulary ({gguf.Keys.Tokenizer.LIST}) repeats the token {dup!r}; "
                          "llama.cpp cannot load it: the file is corrupt or was written wrongly (rebuild it)")


class Engine:
    """One stage (or the whole model) in this process. Implements dgr.runtime.engine_api.ShardEngine."""

    def __init__(self, handle: C.c_void_p, lib: C.CDLL, path: Path):
        self._h = handle
        self._lib = lib
        self.path = path
        self._info = self._describe()

    @classmethod
    def open(cls, path: str | Path, *, layer_range: tuple[int, int] | None = None,
             n_ctx: int = DEFAULT_N_CTX, max_sessions: int = DEFAULT_MAX_SESSIONS, n_ubatch: int = 512,
             n_threads: int = 0, n_gpu_layers: int = -1, kv_dtype: str = "f16",
             fast_kernels: bool = False, kernels: str = "reference", n_draft_max: int = 0, poll: int = 0,
             lib: str | Path | None = None) -> "Engine":
        """`kernels` (CPU): "reference" (the default: ggml's reference kernels, every row alone, so a
        session's logits do not depend on what shares its forwards or how its tokens are batched),
        "invariant" (ggml's batch_invariant switch: flash attention's tiled kernel for every number of queries,
        and for each matrix a kernel chosen by its type, never by the row count: repacked Q4_K's gemm, Q6_K's tiled
        GEMM, each with a one-row path of the same float order, vec_dot for the other types; also batch
        invariant, prefill as fast as llama.cpp's own on K-quant models; docs/batching.md) or
        "fast" (llama.cpp's shape-dependent choice: results depend on the batch; for measuring only).
        `fast_kernels=True` is `kernels="fast"`.
        `n_draft_max`: the longest draft a truncate must roll back after a verification step (V4's snapshot
        cache; 0: none, but an MTP last stage's default, DGR_MTP_MAX_K).
        `poll` (with n_threads > 1): ggml's polling level, 0-100, how long the compute threads spin waiting for the
        next graph before they sleep (0: at once; 50: llama.cpp's default). No bit depends on it."""
        h = load_library(lib)
        path = Path(path)
        if not path.is_file():
            raise EngineError(f"{path}: no such stage file")
        if fast_kernels:
            if kernels not in ("reference", "fast"):
                raise EngineError(f"fast_kernels=True and kernels={kernels!r} ask for two kernel sets; give one")
            kernels = "fast"
        if kernels not in KERNELS:
            raise EngineError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        if kv_dtype not in ("f16", "f32"):
            raise EngineError(f"kv_dtype must be f16 or f32, got {kv_dtype!r}")
        p = COpenParams(n_ctx=n_ctx, max_sessions=max_sessions, n_ubatch=n_ubatch, n_threads=n_threads,
                        layer_begin=layer_range[0] if layer_range else 0,
                        layer_end=layer_range[1] if layer_range else 0, n_gpu_layers=n_gpu_layers,
                        kv_f32=int(kv_dtype == "f32"), fast_kernels=KERNELS[kernels], n_draft_max=n_draft_max,
                        poll=poll)
        if layer_range and layer_range[1] <= 0:
            raise EngineError(f"layer range {layer_range} is empty; give [begin, end) with end > begin >= 0")
        _refuse_what_llama_aborts_on(path)
        out = C.c_void_p()
        st = h.dgr_engine_open(str(path).encode(), C.byref(p), C.byref(out))
        if st != OK:
            raise_status(h, st)
        return cls(out, h, path)

    @property
    def has_hooks(self) -> bool:
        return bool(self._lib.dgr_has_hooks())

    @property
    def lane(self) -> str:
        """The backend lane the library was built for (cpu, vulkan, cuda, ...)."""
        return self._lib.dgr_engine_lane().decode()

    @property
    def numerics(self) -> str:
        """What decides the bits this engine computes (docs/numerics.md): the build's lane and instruction set,
        compiler, pin and patch series, then this open's kernel switches. Runs compare bit for bit only
        when these are equal."""
        return self._lib.dgr_engine_numerics(self._handle()).decode()

    def _check(self, status: int) -> None:
        if status != OK:
            raise_status(self._lib, status)

    def _handle(self) -> C.c_void_p:
        if self._h is None:
            raise EngineError(f"engine for {self.path} is closed")
        return self._h

    @property
    def has_mtp(self) -> bool:
        """The last stage of an include_mtp bundle: it owns the MTP block and drafts (`mtp_draft`)."""
        return bool(self._raw.has_mtp)

    @property
    def n_draft_max(self) -> int:
        """Positions a truncate may roll back after one step (0: a V4 stage opened without it cannot)."""
        return int(self._raw.n_draft_max)

    def mtp_draft(self, session_id: str, epoch: int, token: int, k: int) -> list[int]:
        """k greedy MTP drafts after `token`, the token just drawn for the session's next position. The
        session's caches are left as they were: the verification step [token, *drafts] feeds them."""
        if not hasattr(self._lib, "dgr_mtp_draft"):
            raise EngineError(f"{self.path}: this engine library has no MTP drafting (dgr_mtp_draft); rebuild it "
                              "with `dgr build-engine --lane cpu`")
        out = (C.c_int32 * max(int(k), 1))()
        self._check(self._lib.dgr_mtp_draft(self._handle(), session_id.encode(), epoch, int(token), int(k), out))
        return list(out[: int(k)])

    def _describe(self) -> StageInfo:
        s = CStageInfo()
        self._check(self._lib.dgr_engine_describe(self._handle(), C.byref(s)))
        self._raw = s
        # The C side applies the sideband rule (worker/engine/dgr_contract.h) and states first/last; the
        # contract derives first/last from the range, so a disagreement means a mismatched library. The
        # engine does not know the next stage's needs (token_ids_out stays False); the worker sends
        # the ids along anyway.
        try:
            contract = StageContract(layer_begin=s.layer_begin, layer_end=s.layer_end, n_layer=s.n_layer,
                                     n_streams=s.n_streams, n_embd=s.n_embd, token_ids_in=bool(s.needs_token_ids))
        except ValidationError as err:
            raise EngineError(f"{self.path}: the engine describes an invalid stage: {err}") from None
        if (contract.is_first, contract.is_last) != (bool(s.is_first), bool(s.is_last)):
            raise EngineError(f"{self.path}: the engine says first={bool(s.is_first)} last={bool(s.is_last)} for "
                              f"{contract.describe()}; rebuild the engine library")
        can_truncate = hasattr(self._lib, "dgr_session_truncate") and \
            bool(self._lib.dgr_engine_can_truncate(self._handle()))
        return StageInfo(arch=s.arch.decode(), contract=contract, n_vocab=s.n_vocab,
                         has_vocab=bool(s.has_vocab), n_ctx=s.n_ctx, max_sessions=s.max_sessions,
                         can_truncate=can_truncate, batch_invariant=bool(s.batch_invariant),
                         matmul_kernels=s.matmul_kernels.decode())

    def describe(self) -> StageInfo:
        return self._info

    def open_session(self, session_id: str, epoch: int) -> None:
        self._check(self._lib.dgr_session_open(self._handle(), session_id.encode(), epoch))

    def close_session(self, session_id: str, epoch: int) -> None:
        self._check(self._lib.dgr_session_close(self._handle(), session_id.encode(), epoch))

    def n_cached(self, session_id: str, epoch: int) -> int:
        out = C.c_int32()
        self._check(self._lib.dgr_session_n_cached(self._handle(), session_id.encode(), epoch, C.byref(out)))
        return out.value

    def truncate(self, session_id: str, epoch: int, n_keep: int) -> None:
        if not hasattr(self._lib, "dgr_session_truncate"):
            raise EngineError(f"{self.path}: this engine library predates dgr_session_truncate (speculative "
                              "decoding's rollback): rebuild it with `dgr build-engine --lane cpu`")
        self._check(self._lib.dgr_session_truncate(self._handle(), session_id.encode(), epoch, n_keep))

    def state_get(self, session_id: str, epoch: int) -> tuple[bytes, int]:
        """The session's cached positions on this engine's layers as bytes (what a worker's prefix cache
        keeps), and how many positions they hold."""
        if not hasattr(self._lib, "dgr_session_state_get"):
            raise EngineError(f"{self.path}: this engine library predates saved session states: rebuild it "
                              "with `dgr build-engine --lane cpu`")
        size, n_pos = C.c_uint64(), C.c_int32()
        sid = session_id.encode()
        self._check(self._lib.dgr_session_state_get(self._handle(), sid, epoch, None, 0, C.byref(size), C.byref(n_pos)))
        buf = C.create_string_buffer(size.value)
        self._check(self._lib.dgr_session_state_get(self._handle(), sid, epoch, buf, size.value, C.byref(size),
                                                    C.byref(n_pos)))
        return buf.raw[: size.value], n_pos.value

    def state_set(self, session_id: str, epoch: int, state: bytes, n_positions: int, n_keep: int) -> None:
        """Load a state `state_get` gave into an open, empty session, keeping its first `n_keep` positions."""
        if not hasattr(self._lib, "dgr_session_state_set"):
            raise EngineError(f"{self.path}: this engine library predates saved session states: rebuild it "
                              "with `dgr build-engine --lane cpu`")
        self._check(self._lib.dgr_session_state_set(self._handle(), session_id.encode(), epoch, state, len(state),
                                                    n_positions, n_keep))

    def forward(self, steps: list[Step]) -> list[StepResult]:
        info = self._info
        if not steps:
            raise EngineError("forward needs at least one step")
        width = info.n_streams * info.n_embd
        c_steps = (CStep * len(steps))()
        c_outs = (CStepOut * len(steps))()
        keep: list[np.ndarray] = []   # arrays the C side reads or writes, alive until the call returns
        outs: list[tuple[np.ndarray | None, np.ndarray | None]] = []
        for k, s in enumerate(steps):
            pos = np.asarray(s.positions)
            n = int(pos.shape[0]) if pos.ndim == 1 else -1
            if n <= 0:
                raise SchemaMismatch(f"step {k} ({s.session_id}): positions must be a non-empty int32 [n]")
            pos = _i32(pos, n, "positions")
            cs = c_steps[k]
            cs.session_id = s.session_id.encode()
            cs.epoch = s.epoch
            cs.n_tokens = n
            cs.positions = pos.ctypes.data_as(C.POINTER(C.c_int32))
            keep.append(pos)
            if s.token_ids is not None:
                tok = _i32(s.token_ids, n, f"step {k} token_ids")
                cs.token_ids = tok.ctypes.data_as(C.POINTER(C.c_int32))
                keep.append(tok)
            if s.boundary is not None:
                b = np.asarray(s.boundary)
                if b.dtype != np.float32:
                    raise SchemaMismatch(f"step {k}: boundary dtype is {b.dtype}; the engine takes float32 (convert wire dtypes first)")
                if b.shape != (n, info.n_streams, info.n_embd):
                    raise SchemaMismatch(f"step {k}: boundary shape {b.shape}, this stage (layers [{info.layer_begin}, "
                                         f"{info.layer_end})) takes [n_tokens, n_streams, n_embd] = [{n}, {info.n_streams}, {info.n_embd}]")
                b = np.ascontiguousarray(b)
                cs.boundary = b.ctypes.data_as(C.POINTER(C.c_float))
                cs.boundary_width = width
                keep.append(b)
            if s.want_logits not in WANT_LOGITS:
                raise EngineError(f"step {k}: want_logits must be one of {sorted(WANT_LOGITS)}, got {s.want_logits!r}")
            cs.want_logits = WANT_LOGITS[s.want_logits]
            bout = lout = None
            if not info.is_last:
                bout = np.empty((n, info.n_streams, info.n_embd), dtype=np.float32)
                c_outs[k].boundary = bout.ctypes.data_as(C.POINTER(C.c_float))
            elif s.want_logits != "none":
                rows = n if s.want_logits == "all" else 1
                lout = np.empty((rows, info.n_vocab), dtype=np.float32)
                c_outs[k].logits = lout.ctypes.data_as(C.POINTER(C.c_float))
            outs.append((bout, lout))
        self._check(self._lib.dgr_forward(self._handle(), len(steps), c_steps, c_outs))
        results = []
        for k, s in enumerate(steps):
            bout, lout = outs[k]
            o = c_outs[k]
            results.append(StepResult(
                session_id=s.session_id, epoch=s.epoch, boundary=bout,
                logits=lout[: o.n_logit_rows] if lout is not None else None,
                next_token=o.next_token if info.is_last else None, n_cached=o.n_cached))
        return results

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        raw = text.encode()
        cap = len(raw) + 16
        while True:
            buf = (C.c_int32 * cap)()
            n = self._lib.dgr_tokenize(self._handle(), raw, int(add_special), buf, cap)
            if n < 0:
                raise_status(self._lib, E_ENGINE)
            if n <= cap:
                return list(buf[:n])
            cap = n

    def detokenize(self, ids: list[int]) -> str:
        arr = (C.c_int32 * max(1, len(ids)))(*ids)
        cap = 16 * len(ids) + 16
        while True:
            buf = C.create_string_buffer(cap)
            n = self._lib.dgr_detokenize(self._handle(), arr, len(ids), buf, cap)
            if n < 0:
                raise_status(self._lib, E_ENGINE)
            if n <= cap:
                return buf.raw[:n].decode(errors="replace")
            cap = n

    def grammar(self, gbnf: str = "", json_schema: str = "") -> Grammar:
        """A grammar sampler for this engine's vocabulary: GBNF (root rule "root") or a JSON Schema."""
        if not hasattr(self._lib, "dgr_grammar_open"):
            raise EngineError("this engine library has no grammar support; rebuild it (`dgr build-engine`)")
        out = C.c_void_p()
        self._check(self._lib.dgr_grammar_open(self._handle(), gbnf.encode() or None, json_schema.encode() or None,
                                               C.byref(out)))
        return Grammar(self._lib, out)

    def vocab(self) -> VocabInfo:
        """This engine's special tokens (see `read_vocab`): what a stage's identity advertises as stop ids."""
        h = self._handle()
        return _vocab(self._lib, lambda info, eog, cap: self._lib.dgr_engine_vocab(h, info, eog, cap))

    def memory(self) -> MemoryReport:
        m = CMemory()
        self._check(self._lib.dgr_engine_memory(self._handle(), C.byref(m)))
        info = self._info
        layers = tuple(range(info.layer_begin, info.layer_end)) if m.kv_bytes else ()
        return MemoryReport(weights_bytes=m.weights_bytes, kv_bytes=m.kv_bytes, compute_bytes=m.compute_bytes,
                            layers_with_state=layers, device_weights_bytes=m.device_weights_bytes,
                            device=m.device.decode())

    def close(self) -> None:
        if self._h is not None:
            self._lib.dgr_engine_close(self._h)
            self._h = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# the llama_ftype (pinned llama.h) whose default type is each type: with `pure`, every matrix in it (dgr_quantize)
QUANT_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12, "Q4_K": 15,
                "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25,
                "IQ3_S": 26, "IQ2_S": 29, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37,
                "F16": 1}


def quantize(src: str | Path, dst: str | Path, qtype: str, *, n_threads: int = 0,
             lib: str | Path | None = None) -> Path:
    """Write `dst`: `src` with every matrix llama.cpp's quantizer would quantize in `qtype` (its own
    quantizer, built with the engine; a uniform importance matrix for the types that need one)."""
    if qtype not in QUANT_FTYPES:
        raise EngineError(f"unknown quantization type {qtype!r}; choose one of {', '.join(QUANT_FTYPES)}")
    if not Path(src).is_file():
        raise EngineError(f"quantize: no such model file {src}")
    if not Path(dst).parent.is_dir():
        raise EngineError(f"quantize: the folder of {dst} does not exist: create it first")
    h = load_library(lib)
    h.dgr_quantize.argtypes = [C.c_char_p, C.c_char_p, C.c_int32, C.c_int32]
    h.dgr_quantize.restype = C.c_int32
    st = h.dgr_quantize(str(src).encode(), str(dst).encode(), QUANT_FTYPES[qtype], n_threads)
    if st != OK:
        raise_status(h, st)
    return Path(dst)
