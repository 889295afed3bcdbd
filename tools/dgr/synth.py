"""Tiny random-weight GGUF models that the pinned llama.cpp loads and runs.

Tests of every area use them: an architecture is exercised in seconds without downloading weights.
Each architecture is one row of `ARCHS` (its per-layer tensors and extra hyper-parameters); the
writer is shared. Output is deterministic: the same arguments give the same bytes.

The tokenizer is a byte-level GPT-2 style BPE: the 256 byte symbols, a few merges and three control
tokens, so any ASCII text tokenizes and detokenizes back to itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from dgr.errors import DgrError

T = gguf.MODEL_TENSOR
KA = gguf.Keys.Attention  # metadata key templates ("{arch}.attention..."), formatted with the arch
KL = gguf.Keys.LLM

# Shapes are numpy (row-major) order: ggml's ne reversed. Dims: E embd, F ffn, H heads, K kv heads,
# D head dim, X experts, G expert ffn.
Shape = Callable[[dict], tuple[int, ...]]

_NORM = "norm"     # initialised to ones (a neutral RMS-norm multiplier)
_WEIGHT = "weight"  # normal * scale
_BIAS = "bias"     # normal * scale, always F32


@dataclass(frozen=True)
class LayerTensor:
    tensor: gguf.MODEL_TENSOR
    suffix: str  # "weight" | "bias"
    shape: Shape
    kind: str
    when: Callable[[int, dict], bool] | None = None  # (layer, dims) -> present; None: every layer


def _lt(tensor, shape, kind=_WEIGHT, suffix="weight", when=None) -> LayerTensor:
    return LayerTensor(tensor, suffix, shape, kind, when)


_ATTN = (
    _lt(T.ATTN_NORM, lambda d: (d["E"],), _NORM),
    _lt(T.ATTN_Q, lambda d: (d["H"] * d["D"], d["E"])),
    _lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"])),
    _lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"])),
    _lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
)
_QKV_BIAS = (
    _lt(T.ATTN_Q, lambda d: (d["H"] * d["D"],), _BIAS, "bias"),
    _lt(T.ATTN_K, lambda d: (d["K"] * d["D"],), _BIAS, "bias"),
    _lt(T.ATTN_V, lambda d: (d["K"] * d["D"],), _BIAS, "bias"),
)
_QK_NORM = (
    _lt(T.ATTN_Q_NORM, lambda d: (d["D"],), _NORM),
    _lt(T.ATTN_K_NORM, lambda d: (d["D"],), _NORM),
)
_FFN = (
    _lt(T.FFN_NORM, lambda d: (d["E"],), _NORM),
    _lt(T.FFN_GATE, lambda d: (d["F"], d["E"])),
    _lt(T.FFN_UP, lambda d: (d["F"], d["E"])),
    _lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
)
_MOE = (
    _lt(T.FFN_NORM, lambda d: (d["E"],), _NORM),
    _lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    _lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["G"], d["E"])),
    _lt(T.FFN_UP_EXP, lambda d: (d["X"], d["G"], d["E"])),
    _lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["G"])),
)


@dataclass(frozen=True)
class ArchSpec:
    layer: tuple[LayerTensor, ...]
    tied: bool = False                      # default for --tied
    extra_kv: Callable[[dict], dict] = field(default=lambda d: {})
    head_dim: int = 16


def _gemma3_kv(d: dict) -> dict:
    # Every `swa_pattern`-th layer is full attention, the others slide over `swa` positions.
    return {KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"]}


def _moe_kv(d: dict) -> dict:
    return {KL.EXPERT_COUNT: d["X"], KL.EXPERT_USED_COUNT: d["X_used"], KL.EXPERT_FEED_FORWARD_LENGTH: d["G"]}


# deepseek2 (MLA attention, leading dense blocks, then MoE with shared experts). Dims: Q q lora rank,
# C kv lora rank, R rope head dim, N no-rope head dim, V value head dim, S shared experts, L dense lead.
def _ds2_dense(il: int, d: dict) -> bool:
    return il < d["L"]


def _ds2_moe(il: int, d: dict) -> bool:
    return il >= d["L"]


_DS2_ATTN = (
    _lt(T.ATTN_NORM, lambda d: (d["E"],), _NORM),
    _lt(T.ATTN_Q_A_NORM, lambda d: (d["Q"],), _NORM),
    _lt(T.ATTN_KV_A_NORM, lambda d: (d["C"],), _NORM),
    _lt(T.ATTN_Q_A, lambda d: (d["Q"], d["E"])),
    _lt(T.ATTN_Q_B, lambda d: (d["H"] * (d["N"] + d["R"]), d["Q"])),
    _lt(T.ATTN_KV_A_MQA, lambda d: (d["C"] + d["R"], d["E"])),
    _lt(T.ATTN_K_B, lambda d: (d["H"], d["C"], d["N"])),
    _lt(T.ATTN_V_B, lambda d: (d["H"], d["V"], d["C"])),
    _lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["V"])),
)
_DS2_FFN = _FFN[:1] + tuple(_lt(t.tensor, t.shape, t.kind, t.suffix, _ds2_dense) for t in _FFN[1:]) + tuple(
    _lt(t.tensor, t.shape, t.kind, t.suffix, _ds2_moe) for t in _MOE[1:]
) + (
    _lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), _BIAS, "bias", _ds2_moe),
    _lt(T.FFN_GATE_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=_ds2_moe),
    _lt(T.FFN_UP_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=_ds2_moe),
    _lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"] * d["S"]), when=_ds2_moe),
)


def _deepseek2_kv(d: dict) -> dict:
    # MLA as the pinned llama.cpp reads it (absorbed form: one KV head of width C + R, value width C);
    # gating func 2 = sigmoid, which uses exp_probs_b as the routing bias.
    return {
        KA.HEAD_COUNT_KV: 1, KA.KEY_LENGTH: d["C"] + d["R"], KA.VALUE_LENGTH: d["C"],
        KA.KEY_LENGTH_MLA: d["N"] + d["R"], KA.VALUE_LENGTH_MLA: d["V"],
        KA.Q_LORA_RANK: d["Q"], KA.KV_LORA_RANK: d["C"], gguf.Keys.Rope.DIMENSION_COUNT: d["R"],
        KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"], KL.EXPERT_GATING_FUNC: 2,
        KL.EXPERT_WEIGHTS_SCALE: 1.5, KL.EXPERT_WEIGHTS_NORM: True, **_moe_kv(d),
    }


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(layer=_ATTN + _FFN),
    "qwen2": ArchSpec(layer=_ATTN + _QKV_BIAS + _FFN),
    "qwen3": ArchSpec(layer=_ATTN + _QK_NORM + _FFN),
    "gemma3": ArchSpec(
        layer=_ATTN + _QK_NORM + (_lt(T.ATTN_POST_NORM, lambda d: (d["E"],), _NORM),) + _FFN
        + (_lt(T.FFN_POST_NORM, lambda d: (d["E"],), _NORM),),
        tied=True,
        extra_kv=_gemma3_kv,
    ),
    "qwen3moe": ArchSpec(layer=_ATTN + _QK_NORM + _MOE, extra_kv=_moe_kv),
    "deepseek2": ArchSpec(layer=_DS2_ATTN + _DS2_FFN, extra_kv=_deepseek2_kv),
}

# A few merges so the BPE path is exercised; each merged token is added to the vocabulary.
_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e"))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_symbols() -> list[str]:
    """The GPT-2 byte-to-symbol table: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


def tokenizer_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the synthetic byte-level BPE tokenizer."""
    tokens = byte_symbols() + ["".join(m) for m in _MERGES] + list(SPECIALS)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in _MERGES]


def add_tokenizer(w: gguf.GGUFWriter) -> None:
    """Write the synthetic byte-level BPE tokenizer's metadata (shared by every synthetic writer)."""
    tokens, types, merges = tokenizer_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(SPECIALS[0]))
    w.add_eos_token_id(tokens.index(SPECIALS[0]))
    w.add_add_bos_token(False)


def synth(
    arch: str,
    layers: int,
    embd: int,
    seed: int,
    path: str | Path,
    *,
    tied: bool | None = None,
    dtype: str = "f32",
    n_ff: int | None = None,
    n_expert: int = 4,
    n_expert_used: int = 2,
    swa: int = 8,
    swa_pattern: int = 2,
    context: int = 512,
    scale: float = 0.02,
) -> Path:
    """Write a random-weight `arch` model with `layers` blocks and width `embd` to `path`."""
    if arch not in ARCHS:
        raise DgrError(f"dgr synth: unknown --arch {arch!r}; known: {', '.join(sorted(ARCHS))}")
    spec = ARCHS[arch]
    hd = spec.head_dim
    if layers < 1:
        raise DgrError(f"dgr synth: --layers must be >= 1, got {layers}")
    if embd < 2 * hd or embd % hd:
        raise DgrError(f"dgr synth: --embd must be a multiple of {hd} and >= {2 * hd}, got {embd}")
    if dtype not in ("f32", "f16"):
        raise DgrError(f"dgr synth: --dtype must be f32 or f16, got {dtype!r}")
    n_head = embd // hd
    dims = {
        "E": embd, "F": n_ff or 2 * embd, "H": n_head, "K": max(1, n_head // 2), "D": hd,
        "X": n_expert, "X_used": n_expert_used, "G": n_ff or embd, "swa": swa, "swa_pattern": swa_pattern,
        "Q": embd // 2, "C": embd // 2, "R": hd // 2, "N": hd, "V": hd, "S": 1, "L": min(1, layers - 1),
    }
    tied = spec.tied if tied is None else tied
    n_vocab = len(tokenizer_vocab()[0])
    rng = np.random.default_rng(seed)
    wdtype = np.float32 if dtype == "f32" else np.float16

    def weight(shape) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(wdtype)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"dgr-synth-{arch}-L{layers}-E{embd}-s{seed}")
    w.add_description(f"dgr synth --arch {arch} --layers {layers} --embd {embd} --seed {seed}: random weights")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(context)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(dims["F"])
    w.add_head_count(n_head)
    extra = spec.extra_kv(dims)
    w.add_head_count_kv(extra.pop(KA.HEAD_COUNT_KV, dims["K"]))
    w.add_key_length(extra.pop(KA.KEY_LENGTH, hd))
    w.add_value_length(extra.pop(KA.VALUE_LENGTH, hd))
    w.add_rope_dimension_count(extra.pop(gguf.Keys.Rope.DIMENSION_COUNT, hd))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    for key, val in extra.items():
        full = key.format(arch=arch)
        if isinstance(val, bool):
            w.add_bool(full, val)
        elif isinstance(val, float):
            w.add_float32(full, val)
        else:
            w.add_uint32(full, int(val))
    add_tokenizer(w)

    w.add_tensor(gguf.TENSOR_NAMES[T.TOKEN_EMBD] + ".weight", weight((n_vocab, embd)))
    for il in range(layers):
        for lt in spec.layer:
            if lt.when is not None and not lt.when(il, dims):
                continue
            name = gguf.TENSOR_NAMES[lt.tensor].format(bid=il) + "." + lt.suffix
            shape = lt.shape(dims)
            if lt.kind == _NORM:
                w.add_tensor(name, np.ones(shape, dtype=np.float32))
            elif lt.kind == _BIAS:
                w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * scale)
            else:
                w.add_tensor(name, weight(shape))
    w.add_tensor(gguf.TENSOR_NAMES[T.OUTPUT_NORM] + ".weight", np.ones((embd,), dtype=np.float32))
    if not tied:
        w.add_tensor(gguf.TENSOR_NAMES[T.OUTPUT] + ".weight", weight((n_vocab, embd)))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
