"""Synthetic specs of the dense_a family group (see dgr.toolchain.synth.families): llama-like dense decoders.

Each row writes exactly the tensors and metadata its llama.cpp model file (src/models/<arch>.cpp)
requires, plus the optional pieces that change what a layer computes (scale multipliers, no-RoPE
layers, sliding-window patterns, sinks), so a split has something to get wrong. The layer kinds mark
where layers differ so `dgr parity --synth` cuts across them.
"""

from __future__ import annotations

import gguf

from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, KR, MOE, NORM, OUTPUT_NORM_BIAS, QK_NORM, QKV_BIAS,
                                      ArchSpec, T, lt, moe_kv, swa_kind, swa_kv)

KX = gguf.Keys.xIELU

# ffn without a gate (arcee: relu^2, sequential up -> down; apertus: xIELU between up and down)
_FFN_UP_DOWN = (FFN[0], FFN[2], FFN[3])
# layernorm (weight + bias) before attention and before the ffn (orion)
_LN_BIAS = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.FFN_NORM, lambda d: (d["E"],), BIAS, "bias"),
)
_ATTN_POST_NORM = lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM)
_ATTN_SINKS = lt(T.ATTN_SINKS, lambda d: (d["H"],), F32, "weight")


def _no_rope_step(il: int, d: dict) -> str:
    # smollm3: every 4th layer (il + 1) % 4 == 0 attends without RoPE (n_no_rope_layer_step = 4)
    return "nope" if (il + 1) % 4 == 0 else "rope"


def _mistral3_kv(d: dict) -> dict:
    # llama-4 style attention temperature tuning: Q scaled per position by
    # log(floor(pos / floor_scale) + 1) * scale + 1, floor_scale = the original context length;
    # a short original context so the prompts cross several floors
    return {KA.TEMPERATURE_SCALE: 0.1, KR.SCALING_ORIG_CTX_LEN: 8}


def _apertus_kv(d: dict) -> dict:
    # xIELU per layer (arrays of n_layer, keys without the arch prefix); each layer its own values
    n = d["n_layer"]
    return {
        KX.ALPHA_N: [0.8 + 0.01 * il for il in range(n)], KX.ALPHA_P: [0.8 - 0.01 * il for il in range(n)],
        KX.BETA: [0.5] * n, KX.EPS: [-1e-6] * n,
    }


def _granite_kv(d: dict) -> dict:
    # Granite's multipliers: the embedding (first stage only: build_inp_embd scales token input), each
    # residual branch, the attention scale, and the logits (last stage only: after the head)
    return {KL.LOGIT_SCALE: 8.0, KL.RESIDUAL_SCALE: 0.22, KL.EMBEDDING_SCALE: 12.0, KA.SCALE: 0.0078125}


def _granite_swa_kv(d: dict) -> dict:
    # granite_swa reads the SWA pattern as a per-layer array (true: sliding window) and an optional
    # per-layer RoPE pattern; the global layers here attend without RoPE
    swa = [_swa_layer(il, d) for il in range(d["n_layer"])]
    return {**_granite_kv(d), KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: swa,
            "{arch}.attention.rope_pattern": [1 if s else 0 for s in swa]}


def _swa_layer(il: int, d: dict) -> bool:
    return (il + 1) % 3 != 0


def _granite_swa_kind(il: int, d: dict) -> str:
    return "swa" if _swa_layer(il, d) else "full-nope"


def _mellum_kv(d: dict) -> dict:
    return {**moe_kv(d), **swa_kv(d), KR.FREQ_BASE_SWA: 5000.0}


def _seed_oss_dims(d: dict) -> dict:
    # seed-oss: the head count times head dim differs from the width (Q/O are not square)
    return {**d, "H": d["H"] + 2}


# --- the group's extras -------------------------------------------------------------------------------

# bitnet: sub-norms inside attention (before wo) and inside the ffn (before down); no output matrix
# (the head is the token embedding)
_BITNET = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_SUB_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q, lambda d: (d["E"], d["E"])),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["E"])),
) + FFN + (lt(T.FFN_SUB_NORM, lambda d: (d["F"],), NORM),)


# deci (Nemotron NAS): per-layer head counts; a layer is full attention, "linear attention" (no KV
# heads: attn_norm + wo only) or attention-free (no heads: no attention tensors at all)
_DECI_PATTERN = ("attn", "linear", "attn", "noattn")


def _deci_kind(il: int, d: dict) -> str:
    return _DECI_PATTERN[il % len(_DECI_PATTERN)]


def _deci_kv(d: dict) -> dict:
    kinds = [_deci_kind(il, d) for il in range(d["n_layer"])]
    return {KA.HEAD_COUNT: [0 if k == "noattn" else d["H"] for k in kinds],
            KA.HEAD_COUNT_KV: [d["K"] if k == "attn" else 0 for k in kinds]}


def _is(*kinds):
    return lambda il, d: _deci_kind(il, d) in kinds


_DECI = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM, when=_is("attn", "linear")),
    lt(T.ATTN_Q, lambda d: (d["H"] * d["D"], d["E"]), when=_is("attn")),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"]), when=_is("attn")),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"]), when=_is("attn")),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"]), when=_is("attn", "linear")),
) + FFN


# openelm: layer-wise scaling (heads, KV heads and ffn width grow with depth), fused QKV, QK norm,
# tied head. The writer's shapes do not depend on the layer, so each width is its own tensor group.
_ELM_WIDTHS = ((2, 1, 64), (3, 1, 96), (4, 2, 128))  # (heads, kv heads, ffn) of the narrow..wide thirds


def _elm_width(il: int, d: dict) -> int:
    return min(len(_ELM_WIDTHS) - 1, il * len(_ELM_WIDTHS) // d["n_layer"])


def _elm_layer(w: int) -> tuple:
    h, k, f = _ELM_WIDTHS[w]
    when = lambda il, d: _elm_width(il, d) == w  # noqa: E731
    return (
        lt(T.ATTN_NORM, lambda d: (d["E"],), NORM, when=when),
        lt(T.ATTN_QKV, lambda d: ((h + 2 * k) * d["D"], d["E"]), when=when),
        lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM, when=when),
        lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM, when=when),
        lt(T.ATTN_OUT, lambda d: (d["E"], h * d["D"]), when=when),
        lt(T.FFN_NORM, lambda d: (d["E"],), NORM, when=when),
        lt(T.FFN_GATE, lambda d: (f, d["E"]), when=when),
        lt(T.FFN_DOWN, lambda d: (d["E"], f), when=when),
        lt(T.FFN_UP, lambda d: (f, d["E"]), when=when),
    )


def _elm_kv(d: dict) -> dict:
    ws = [_ELM_WIDTHS[_elm_width(il, d)] for il in range(d["n_layer"])]
    return {KA.HEAD_COUNT: [w[0] for w in ws], KA.HEAD_COUNT_KV: [w[1] for w in ws],
            KL.FEED_FORWARD_LENGTH: [w[2] for w in ws]}


# layernorm with biases before attention and ffn, attention output bias, ffn biases (codeshell, jais2)
_LN_W_B = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.FFN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.FFN_UP, lambda d: (d["F"],), BIAS, "bias"),
    lt(T.FFN_DOWN, lambda d: (d["E"],), BIAS, "bias"),
)
# jais: fused QKV with bias, gated ffn with biases, ALiBi (no RoPE)
_JAIS = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_QKV, lambda d: ((d["H"] + 2 * d["K"]) * d["D"], d["E"])),
    lt(T.ATTN_QKV, lambda d: ((d["H"] + 2 * d["K"]) * d["D"],), BIAS, "bias"),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["E"])),
) + FFN + _LN_W_B + (lt(T.FFN_GATE, lambda d: (d["F"],), BIAS, "bias"),)

SPECS: dict[str, ArchSpec] = {
    "mistral3": ArchSpec(layer=ATTN + FFN, extra_kv=_mistral3_kv, features=("dense", "attn-temp")),
    "smollm3": ArchSpec(layer=ATTN + FFN, tied=True, kind=_no_rope_step, parity_layers=8,
                        features=("dense", "no-rope-layers", "tied")),
    "arcee": ArchSpec(layer=ATTN + _FFN_UP_DOWN, features=("dense", "relu2")),
    "apertus": ArchSpec(layer=ATTN + QK_NORM + _FFN_UP_DOWN, extra_kv=_apertus_kv,
                        features=("dense", "qk-norm", "xielu")),
    "granite": ArchSpec(layer=ATTN + FFN, extra_kv=_granite_kv,
                        features=("dense", "embd-scale", "residual-scale", "logit-scale")),
    "granite_swa": ArchSpec(layer=ATTN + (_ATTN_SINKS,) + FFN, extra_kv=_granite_swa_kv, kind=_granite_swa_kind,
                            features=("swa", "sinks", "no-rope-layers", "embd-scale", "residual-scale",
                                      "logit-scale")),
    "seed_oss": ArchSpec(layer=ATTN + QKV_BIAS + (_ATTN_POST_NORM,) + FFN[1:], dims=_seed_oss_dims,
                         features=("dense", "qkv-bias", "post-attn-norm")),
    "xverse": ArchSpec(layer=ATTN + FFN, features=("dense",)),
    "orion": ArchSpec(layer=ATTN + FFN + _LN_BIAS, globals=(OUTPUT_NORM_BIAS,),
                      extra_kv=lambda d: {KA.LAYERNORM_EPS: 1e-5}, features=("dense", "layernorm")),
    # baichuan ropes only as its 7B (32 layers; 13B = 40 layers is ALiBi, any other count neither)
    "baichuan": ArchSpec(layer=ATTN + FFN, parity_layers=32, features=("dense",)),
    "internlm2": ArchSpec(layer=ATTN + FFN, features=("dense",)),
    "mellum": ArchSpec(layer=ATTN + QK_NORM + MOE, extra_kv=_mellum_kv, kind=swa_kind,
                       features=("moe", "swa", "qk-norm")),
    "maincoder": ArchSpec(layer=ATTN + QK_NORM + FFN, features=("dense", "qk-norm")),
    # the group's extras
    "bitnet": ArchSpec(layer=_BITNET, tied=True, features=("dense", "sub-norm", "tied")),
    "deci": ArchSpec(layer=_DECI, extra_kv=_deci_kv, kind=_deci_kind, parity_layers=8,
                     features=("dense", "variable-heads", "linear-attn-layers", "attn-free-layers")),
    "plamo": ArchSpec(layer=ATTN + FFN[1:], features=("dense", "parallel-attn-ffn")),
    "codeshell": ArchSpec(layer=ATTN + QKV_BIAS + _LN_W_B + (FFN[0], FFN[2], FFN[3]), globals=(OUTPUT_NORM_BIAS,),
                          extra_kv=lambda d: {KA.LAYERNORM_EPS: 1e-5},
                          features=("dense", "layernorm", "qkv-bias", "gelu")),
    "chatglm": ArchSpec(layer=ATTN + QKV_BIAS + (FFN[0], lt(T.FFN_UP, lambda d: (2 * d["F"], d["E"])), FFN[3]),
                        extra_kv=lambda d: {KR.DIMENSION_COUNT: d["D"] // 2},
                        features=("dense", "qkv-bias", "partial-rope", "swiglu-fused")),
    "openelm": ArchSpec(layer=_elm_layer(0) + _elm_layer(1) + _elm_layer(2), tied=True, extra_kv=_elm_kv,
                        kind=lambda il, d: ("narrow", "middle", "wide")[_elm_width(il, d)],
                        features=("dense", "variable-heads", "fused-qkv", "qk-norm", "tied")),
    "jais": ArchSpec(layer=_JAIS, globals=(OUTPUT_NORM_BIAS,),
                     extra_kv=lambda d: {KA.LAYERNORM_EPS: 1e-5, KA.MAX_ALIBI_BIAS: 8.0},
                     features=("dense", "alibi", "layernorm", "fused-qkv")),
    "jais2": ArchSpec(layer=ATTN + _LN_W_B + (FFN[0], FFN[2], FFN[3]), globals=(OUTPUT_NORM_BIAS,),
                      extra_kv=lambda d: {KA.LAYERNORM_EPS: 1e-5}, features=("dense", "layernorm", "relu2")),
}
