"""The ShardEngine's C ABI as ctypes sees it (worker/engine/dgr_engine.h): the version, the shared
structs, loading a library and checking that it is the ABI this binding speaks, and the status codes.
`dgr.runtime.engine` builds the Engine on it."""

from __future__ import annotations

import ctypes as C
import os
import threading
from pathlib import Path

from dgr.core.errors import CacheMiss, EngineError, SchemaMismatch, Unsupported
from dgr.core.paths import default_engine_library

ABI_VERSION = 10                # worker/engine/dgr_engine.h's DGR_ABI_VERSION (tests/engine/test_engine_abi.py holds them equal)
LIB_ENV = "DGR_ENGINE_LIB"

OK, E_ENGINE, E_CACHE_MISS, E_SCHEMA, E_ARTIFACT, E_UNSUPPORTED = range(6)
WANT_LOGITS = {"none": 0, "last": 1, "all": 2}  # Step.want_logits -> enum dgr_want_logits (dgr_engine.h)
# Engine.open(kernels=) -> dgr_open_params.fast_kernels, the DGR_KERNELS_* of dgr_engine.h
KERNELS = {"reference": 0, "fast": 1, "invariant": 2}
# the sets whose results never depend on the batch (what a route, `dgr bench` and `dgr bench peers` may run)
EXACT_KERNELS = ("reference", "invariant")


class COpenParams(C.Structure):
    _fields_ = [("n_ctx", C.c_int32), ("max_sessions", C.c_int32), ("n_ubatch", C.c_int32),
                ("n_threads", C.c_int32), ("layer_begin", C.c_int32), ("layer_end", C.c_int32),
                ("n_gpu_layers", C.c_int32), ("kv_f32", C.c_int32), ("fast_kernels", C.c_int32),
                ("n_draft_max", C.c_int32), ("poll", C.c_int32)]


class CStageInfo(C.Structure):
    _fields_ = [("arch", C.c_char * 64),
                ("layer_begin", C.c_int32), ("layer_end", C.c_int32), ("n_layer", C.c_int32),
                ("n_embd", C.c_int32), ("n_streams", C.c_int32), ("n_vocab", C.c_int32),
                ("is_first", C.c_int32), ("is_last", C.c_int32), ("needs_token_ids", C.c_int32),
                ("has_vocab", C.c_int32), ("n_ctx", C.c_int32), ("max_sessions", C.c_int32),
                ("batch_invariant", C.c_int32), ("has_mtp", C.c_int32), ("n_draft_max", C.c_int32),
                ("matmul_kernels", C.c_char * 512)]


class CStep(C.Structure):
    _fields_ = [("session_id", C.c_char_p), ("epoch", C.c_int64), ("n_tokens", C.c_int32),
                ("positions", C.POINTER(C.c_int32)), ("token_ids", C.POINTER(C.c_int32)),
                ("boundary", C.POINTER(C.c_float)), ("boundary_width", C.c_int32),
                ("want_logits", C.c_int32)]


class CStepOut(C.Structure):
    _fields_ = [("boundary", C.POINTER(C.c_float)), ("logits", C.POINTER(C.c_float)),
                ("n_logit_rows", C.c_int32), ("next_token", C.c_int32), ("n_cached", C.c_int32)]


class CMemory(C.Structure):
    _fields_ = [("weights_bytes", C.c_uint64), ("kv_bytes", C.c_uint64), ("compute_bytes", C.c_uint64),
                ("device_weights_bytes", C.c_uint64), ("device", C.c_char * 64)]


class CVocabInfo(C.Structure):
    _fields_ = [("n_vocab", C.c_int32), ("bos", C.c_int32), ("eos", C.c_int32), ("eot", C.c_int32),
                ("n_eog", C.c_int32)]


# The structs this binding shares with the library, by their C names (dgr_abi_struct_size answers for each).
STRUCTS: dict[str, type[C.Structure]] = {
    "dgr_open_params": COpenParams, "dgr_stage_info": CStageInfo, "dgr_step": CStep, "dgr_step_out": CStepOut,
    "dgr_memory": CMemory, "dgr_vocab_info": CVocabInfo}


def check_abi(h: C.CDLL, path: Path) -> None:
    """Refuse a library of another C ABI: its version (DGR_ABI_VERSION) or the size of a struct both sides
    share differs from what this binding was written for. Says what to rebuild."""
    rebuild = ("rebuild the engine from this checkout (`dgr build-engine --lane cpu`, or scripts/setup), or point "
               f"{LIB_ENV} at a library built from the same dgr")
    h.dgr_abi_version.restype = C.c_int32
    version = h.dgr_abi_version()
    if version != ABI_VERSION:
        raise EngineError(f"{path} has C ABI {version}, this dgr expects {ABI_VERSION}: {rebuild}")
    try:
        size_of = h.dgr_abi_struct_size
    except AttributeError:
        raise EngineError(f"{path} does not export dgr_abi_struct_size (C ABI {ABI_VERSION} does): {rebuild}") from None
    size_of.argtypes, size_of.restype = [C.c_char_p], C.c_int32
    for name, struct in STRUCTS.items():
        theirs, ours = size_of(name.encode()), C.sizeof(struct)
        if theirs != ours:
            raise EngineError(f"{name} is {theirs} bytes in {path} but {ours} in this dgr "
                              f"(dgr.runtime.engine_abi): {rebuild}")

_libs: dict[str, C.CDLL] = {}
_lock = threading.Lock()


def library_path(lib: str | Path | None = None) -> Path:
    """Where the engine library is: the argument, $DGR_ENGINE_LIB, or the workspace's CPU build if it
    exists; EngineError saying how to get one otherwise (this never builds)."""
    if lib:
        return Path(lib)
    env = os.environ.get(LIB_ENV)
    if env:
        return Path(env)
    built = default_engine_library("cpu")
    if built.is_file():
        return built
    raise EngineError(f"no engine library: {LIB_ENV} is unset and {built} does not exist; run "
                      f"`dgr build-engine --lane cpu`, or set {LIB_ENV} to a built libdgr_engine")


def load_library(lib: str | Path | None = None) -> C.CDLL:
    path = library_path(lib).resolve()
    with _lock:
        if str(path) in _libs:
            return _libs[str(path)]
        if not path.exists():
            raise EngineError(f"engine library {path} does not exist; unset {LIB_ENV} or run `dgr build-engine`")
        try:
            h = C.CDLL(str(path))
        except OSError as err:
            raise EngineError(f"cannot load the engine library {path}: {err}") from None
        check_abi(h, path)
        h.dgr_has_hooks.restype = C.c_int32
        h.dgr_engine_lane.restype = C.c_char_p
        h.dgr_numerics_build.restype = C.c_char_p
        h.dgr_engine_numerics.restype = C.c_char_p
        h.dgr_engine_numerics.argtypes = [C.c_void_p]
        h.dgr_last_error.restype = C.c_char_p
        h.dgr_last_cache_miss.argtypes = [C.POINTER(C.c_int64), C.POINTER(C.c_int64)]
        h.dgr_engine_open.argtypes = [C.c_char_p, C.POINTER(COpenParams), C.POINTER(C.c_void_p)]
        h.dgr_engine_close.argtypes = [C.c_void_p]
        h.dgr_engine_close.restype = None
        h.dgr_engine_describe.argtypes = [C.c_void_p, C.POINTER(CStageInfo)]
        h.dgr_engine_memory.argtypes = [C.c_void_p, C.POINTER(CMemory)]
        for name in ("dgr_session_open", "dgr_session_close"):
            getattr(h, name).argtypes = [C.c_void_p, C.c_char_p, C.c_int64]
        h.dgr_session_n_cached.argtypes = [C.c_void_p, C.c_char_p, C.c_int64, C.POINTER(C.c_int32)]
        h.dgr_forward.argtypes = [C.c_void_p, C.c_int32, C.POINTER(CStep), C.POINTER(CStepOut)]
        h.dgr_tokenize.argtypes = [C.c_void_p, C.c_char_p, C.c_int32, C.POINTER(C.c_int32), C.c_int32]
        h.dgr_detokenize.argtypes = [C.c_void_p, C.POINTER(C.c_int32), C.c_int32, C.c_char_p, C.c_int32]
        h.dgr_vocab_read.argtypes = [C.c_char_p, C.POINTER(CVocabInfo), C.POINTER(C.c_int32), C.c_int32]
        h.dgr_engine_vocab.argtypes = [C.c_void_p, C.POINTER(CVocabInfo), C.POINTER(C.c_int32), C.c_int32]
        # speculation's rollback: the fake engine of an older checkout may lack it (cannot roll back)
        if hasattr(h, "dgr_session_truncate"):
            h.dgr_session_truncate.argtypes = [C.c_void_p, C.c_char_p, C.c_int64, C.c_int32]
            h.dgr_session_truncate.restype = C.c_int32
            h.dgr_engine_can_truncate.argtypes = [C.c_void_p]
            h.dgr_engine_can_truncate.restype = C.c_int32
        # the prefix cache's saved states (the real engine; a fake engine need not)
        if hasattr(h, "dgr_session_state_get"):
            h.dgr_session_state_get.argtypes = [C.c_void_p, C.c_char_p, C.c_int64, C.c_void_p, C.c_uint64,
                                                C.POINTER(C.c_uint64), C.POINTER(C.c_int32)]
            h.dgr_session_state_get.restype = C.c_int32
            h.dgr_session_state_set.argtypes = [C.c_void_p, C.c_char_p, C.c_int64, C.c_void_p, C.c_uint64,
                                                C.c_int32, C.c_int32]
            h.dgr_session_state_set.restype = C.c_int32
        # MTP drafting (the real engine; a fake engine need not)
        if hasattr(h, "dgr_mtp_draft"):
            h.dgr_mtp_draft.argtypes = [C.c_void_p, C.c_char_p, C.c_int64, C.c_int32, C.c_int32, C.POINTER(C.c_int32)]
            h.dgr_mtp_draft.restype = C.c_int32
        h.dgr_sample.argtypes = [C.POINTER(C.c_float), C.c_int32, C.c_double, C.c_int32, C.c_double, C.c_uint64,
                                 C.c_int64]
        # log-probabilities and grammar sampling: the real engine has them; a fake engine need not
        if hasattr(h, "dgr_logprobs"):
            h.dgr_logprobs.argtypes = [C.POINTER(C.c_float), C.c_int32, C.c_int32, C.POINTER(C.c_float), C.c_int32,
                                       C.POINTER(C.c_int32), C.POINTER(C.c_float)]
            h.dgr_logprobs.restype = C.c_int32
        if hasattr(h, "dgr_grammar_open"):
            h.dgr_grammar_open.argtypes = [C.c_void_p, C.c_char_p, C.c_char_p, C.POINTER(C.c_void_p)]
            h.dgr_grammar_close.argtypes = [C.c_void_p]
            h.dgr_grammar_close.restype = None
            h.dgr_grammar_apply.argtypes = [C.c_void_p, C.POINTER(C.c_float), C.c_int32]
            h.dgr_grammar_accept.argtypes = [C.c_void_p, C.c_int32]
            h.dgr_json_schema_to_grammar.argtypes = [C.c_char_p, C.c_char_p, C.c_int32]
            for name in ("dgr_grammar_open", "dgr_grammar_apply", "dgr_grammar_accept", "dgr_json_schema_to_grammar"):
                getattr(h, name).restype = C.c_int32
        for name in ("dgr_sample", "dgr_engine_open", "dgr_engine_describe", "dgr_engine_memory", "dgr_session_open",
                     "dgr_session_close", "dgr_session_n_cached", "dgr_forward", "dgr_tokenize", "dgr_detokenize",
                     "dgr_vocab_read", "dgr_engine_vocab"):
            getattr(h, name).restype = C.c_int32
        _libs[str(path)] = h
        return h


def raise_status(h: C.CDLL, status: int) -> None:
    """Raise the dgr.core.errors type of a failed call's status, with the library's last error message."""
    msg = (h.dgr_last_error() or b"").decode(errors="replace") or f"engine status {status}"
    if status == E_CACHE_MISS:
        held, expected = C.c_int64(), C.c_int64()
        h.dgr_last_cache_miss(C.byref(held), C.byref(expected))
        raise CacheMiss(msg, held=held.value, expected=expected.value)
    if status == E_SCHEMA:
        raise SchemaMismatch(msg)
    if status == E_UNSUPPORTED:
        raise Unsupported(msg)
    raise EngineError(msg)


def build_numerics(lib: str | Path | None = None) -> str:
    """What the engine library computes with, before any open's switches (dgr_numerics_build, docs/numerics.md)."""
    return load_library(lib).dgr_numerics_build().decode()
