"""The vocabulary of a synthetic architecture: what one row of dgr synth's table says about a model.

An `ArchSpec` names the tensors of each layer (with a shape from the model's dims and an optional
`when` for layers that differ: dense/MoE, attention/recurrent), the tensors outside the layers, extra
hyper-parameters, how the default dims change, and each layer's kind (which `dgr parity --synth` cuts
across). The writer that turns a spec into a GGUF is dgr.toolchain.synth.generic's; the specs of each family group live
in dgr.toolchain.synth.families.

Shapes are numpy (row-major) order: ggml's ne reversed. Dims: E embd, F ffn, H heads, K kv heads,
D head dim, X experts, X_used experts per token, G expert ffn, V vocab (set by the writer), swa window,
swa_pattern, n_layer, ctx (context length), plus whatever a spec's `dims` hook adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import gguf
import numpy as np

T = gguf.MODEL_TENSOR
KA = gguf.Keys.Attention  # metadata key templates ("{arch}.attention..."), formatted with the arch
KL = gguf.Keys.LLM
KR = gguf.Keys.Rope
KS = gguf.Keys.SSM

Shape = Callable[[dict], tuple[int, ...]]
Init = Callable[[tuple[int, ...], np.random.Generator, dict], np.ndarray]

NORM = "norm"      # initialised to ones (a neutral norm multiplier), always F32
WEIGHT = "weight"  # normal * scale, in the model's dtype
BIAS = "bias"      # normal * scale, always F32
F32 = "f32"        # normal * scale, always F32 (small tables llama.cpp reads as F32)


@dataclass(frozen=True)
class LayerTensor:
    tensor: gguf.MODEL_TENSOR
    suffix: str  # "weight" | "bias" | "" (a bare name such as blk.N.ssm_a)
    shape: Shape
    kind: str
    when: Callable[[int, dict], bool] | None = None  # (layer, dims) -> present; None: every layer
    init: Init | None = None                           # custom values (F32), e.g. a negative ssm_a


def lt(tensor, shape, kind=WEIGHT, suffix="weight", when=None, init=None) -> LayerTensor:
    return LayerTensor(tensor, suffix, shape, kind, when, init)


def only(tensors: tuple[LayerTensor, ...], when: Callable[[int, dict], bool]) -> tuple[LayerTensor, ...]:
    """The same tensors, present only in the layers `when` selects (a dense lead, recurrent layers...)."""
    return tuple(LayerTensor(t.tensor, t.suffix, t.shape, t.kind, when, t.init) for t in tensors)


@dataclass(frozen=True)
class Typed:
    """A metadata value written with an explicit GGUF type (default: int -> u32, float -> f32)."""

    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None  # for arrays


@dataclass(frozen=True)
class ArchSpec:
    layer: tuple[LayerTensor, ...]
    tied: bool = False                      # default for --tied
    # extra metadata (key templates -> values; a value None drops a default key such as rope dims)
    extra_kv: Callable[[dict], dict] = field(default=lambda d: {})
    head_dim: int = 16
    # tensors outside the layers, besides token_embd, output_norm.weight and output.weight
    globals: tuple[LayerTensor, ...] = ()
    output_norm: bool = True                # writes output_norm.weight
    dims: Callable[[dict], dict] | None = None   # adjust the default dims (gets and returns a dict)
    kind: Callable[[int, dict], str] | None = None  # a layer's kind ("swa"/"full", "dense"/"moe", ...)
    features: tuple[str, ...] = ()          # what a split of this model exercises (docs/families.md)
    parity_layers: int = 6                  # layers of the model `dgr parity --synth` writes


# The common per-layer groups most decoder families are made of.
ATTN = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q, lambda d: (d["H"] * d["D"], d["E"])),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
)
QKV_BIAS = (
    lt(T.ATTN_Q, lambda d: (d["H"] * d["D"],), BIAS, "bias"),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"],), BIAS, "bias"),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"],), BIAS, "bias"),
)
QK_NORM = (
    lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM),
    lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM),
)
FFN = (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_GATE, lambda d: (d["F"], d["E"])),
    lt(T.FFN_UP, lambda d: (d["F"], d["E"])),
    lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
)
MOE = (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["G"], d["E"])),
    lt(T.FFN_UP_EXP, lambda d: (d["X"], d["G"], d["E"])),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["G"])),
)
SHARED_EXPERT = (
    lt(T.FFN_GATE_SHEXP, lambda d: (d["G"], d["E"])),
    lt(T.FFN_UP_SHEXP, lambda d: (d["G"], d["E"])),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"])),
)
OUTPUT_NORM_BIAS = lt(T.OUTPUT_NORM, lambda d: (d["E"],), BIAS, "bias")


# A leading dense block count L (dgr.toolchain.synth.generic's default dims: 1), then MoE: the kind the cuts cross.
def dense_lead(il: int, d: dict) -> bool:
    return il < d["L"]


def after_lead(il: int, d: dict) -> bool:
    return il >= d["L"]


def dense_moe_kind(il: int, d: dict) -> str:
    return "dense" if dense_lead(il, d) else "moe"


# MLA attention as deepseek2 reads it (absorbed form: wk_b / wv_b). Dims: Q q lora rank, C kv lora rank,
# R rope head dim, N no-rope head dim, V value head dim.
MLA_ATTN = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q_A_NORM, lambda d: (d["Q"],), NORM),
    lt(T.ATTN_KV_A_NORM, lambda d: (d["C"],), NORM),
    lt(T.ATTN_Q_A, lambda d: (d["Q"], d["E"])),
    lt(T.ATTN_Q_B, lambda d: (d["H"] * (d["N"] + d["R"]), d["Q"])),
    lt(T.ATTN_KV_A_MQA, lambda d: (d["C"] + d["R"], d["E"])),
    lt(T.ATTN_K_B, lambda d: (d["H"], d["C"], d["N"])),
    lt(T.ATTN_V_B, lambda d: (d["H"], d["V"], d["C"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["V"])),
)


def moe_kv(d: dict) -> dict:
    return {KL.EXPERT_COUNT: d["X"], KL.EXPERT_USED_COUNT: d["X_used"], KL.EXPERT_FEED_FORWARD_LENGTH: d["G"]}


def swa_kv(d: dict) -> dict:
    """Every `swa_pattern`-th layer is full attention, the others slide over `swa` positions."""
    return {KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"]}


def swa_kind(il: int, d: dict) -> str:
    """gemma-style pattern: layer il is full attention when (il + 1) % pattern == 0."""
    return "full" if (il + 1) % d["swa_pattern"] == 0 else "swa"
