"""Synthetic specs of the dense_c family group (see dgr.toolchain.synth.families): gemma, GLM, ERNIE, GPT-style."""

from __future__ import annotations

import numpy as np

from dgr.toolchain.synth.spec import (ATTN, BIAS, FFN, KA, KL, KR, MOE, NORM, OUTPUT_NORM_BIAS, QK_NORM, QKV_BIAS,
                                      SHARED_EXPERT, ArchSpec, T, lt, moe_kv, only, swa_kind, swa_kv)

_ATTN_POST_NORM = lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM)
_FFN_POST_NORM = lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM)


def _gemma2_kv(d: dict) -> dict:
    # both soft-caps explicit (the pinned defaults are 50 and 30): attention caps every layer, the
    # final one only the head (last stage)
    return {**swa_kv(d), KL.ATTN_LOGIT_SOFTCAPPING: 50.0, KL.FINAL_LOGIT_SOFTCAPPING: 30.0}


# glm4: post-attention and post-MLP norms, a fused gate+up projection (SwiGLU over 2*F rows)
_GLM4_LAYER = ATTN + (_ATTN_POST_NORM,) + (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_UP, lambda d: (2 * d["F"], d["E"])),
    lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
    _FFN_POST_NORM,
)

# GPT-style blocks: LayerNorm with bias, a fused QKV projection with bias, biased output and MLP
# (no gate). The fused QKV has E + 2*K*D rows (llama.cpp's n_embd + 2*n_embd_gqa: H*D == E here).
_LN_ATTN = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.ATTN_QKV, lambda d: (d["E"] + 2 * d["K"] * d["D"], d["E"])),
    lt(T.ATTN_QKV, lambda d: (d["E"] + 2 * d["K"] * d["D"],), BIAS, "bias"),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias"),
)
_LN_MLP = (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
    lt(T.FFN_DOWN, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.FFN_UP, lambda d: (d["F"], d["E"])),
    lt(T.FFN_UP, lambda d: (d["F"],), BIAS, "bias"),
)
_GPT_LAYER = _LN_ATTN + _LN_MLP
# learned absolute positions, one row per training context position (an input tensor: first stage)
_POS_EMBD = lt(T.POS_EMBD, lambda d: (d["ctx"], d["E"]))
_POS_CTX = 512  # the position table's rows = the model's n_ctx_train (written by _pos_kv, whatever --context)


def _with_ctx(d: dict) -> dict:
    return {**d, "ctx": _POS_CTX}


def _layernorm_kv(d: dict) -> dict:
    return {KA.LAYERNORM_EPS: 1e-5}


def _pos_kv(d: dict) -> dict:
    return {KA.LAYERNORM_EPS: 1e-5, KL.CONTEXT_LENGTH: _POS_CTX}


# nemotron: LayerNorm with bias, separate Q/K/V, biased output, squared-ReLU MLP with biases
_NEMOTRON_LAYER = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
) + ATTN[1:] + (lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias"),) + _LN_MLP


# llama4: every 4th layer is full attention without RoPE (and with the temperature-scaled query), the
# other three chunked attention with RoPE and an L2 QK-norm; every 2nd layer's FFN is MoE (sigmoid
# routing) plus a shared expert, the others dense. Over 8 layers the cuts cross all of it.
_L4_ATTN_STEP = 4  # the pinned default pattern (3 chunked, 1 full) and no-RoPE step
_L4_MOE_STEP = 2


def _l4_moe(il: int, d: dict) -> bool:
    return (il + 1) % _L4_MOE_STEP == 0


def _l4_dense(il: int, d: dict) -> bool:
    return not _l4_moe(il, d)


def _l4_kind(il: int, d: dict) -> str:
    attn = "full-norope" if (il + 1) % _L4_ATTN_STEP == 0 else "chunked"
    return f"{attn}-{'moe' if _l4_moe(il, d) else 'dense'}"


_LLAMA4_LAYER = ATTN + FFN[:1] + only(FFN[1:], _l4_dense) + only(MOE[1:] + SHARED_EXPERT, _l4_moe)


def _llama4_kv(d: dict) -> dict:
    return {**moe_kv(d), KL.INTERLEAVE_MOE_LAYER_STEP: _L4_MOE_STEP, KA.SLIDING_WINDOW_PATTERN: _L4_ATTN_STEP}


# gemma4 as its 26B-A4B / 31B variants are: no per-layer embeddings, no shared-KV layers (a model with
# either refuses a range: src/models/gemma4.cpp). Every 3rd layer is full attention with a wider head
# (32; sliding layers 16), proportional RoPE (rope_freqs) and K reused as V (no attn_v); odd layers
# add a routed MoE (router on the normed residual, with its own scale and pre/post norms) to the
# dense MLP; every layer has an output scale. Over 6 layers: swa-dense, swa-moe, full-dense,
# swa-moe, swa-dense, full-moe.
_G4_FULL_STEP = 3
_G4_HD_FULL = 32


def _g4_full(il: int, d: dict) -> bool:
    return (il + 1) % _G4_FULL_STEP == 0


def _g4_swa(il: int, d: dict) -> bool:
    return not _g4_full(il, d)


def _g4_moe(il: int, d: dict) -> bool:
    return il % 2 == 1


def _g4_kind(il: int, d: dict) -> str:
    return f"{'full' if _g4_full(il, d) else 'swa'}-{'moe' if _g4_moe(il, d) else 'dense'}"


def _g4_rope_freqs(shape, rng, d):
    # proportional RoPE: the first half of the frequencies as they are, the rest slowed down
    return np.where(np.arange(shape[0]) < shape[0] // 2, 1.0, 4.0).astype(np.float32)


def _g4_out_scale(shape, rng, d):
    return np.full(shape, 0.75, dtype=np.float32)


_G4_LAYER = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q, lambda d: (d["H"] * d["D"], d["E"]), when=_g4_swa),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"]), when=_g4_swa),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"]), when=_g4_swa),
    lt(T.ATTN_Q, lambda d: (d["H"] * _G4_HD_FULL, d["E"]), when=_g4_full),
    lt(T.ATTN_K, lambda d: (d["K"] * _G4_HD_FULL, d["E"]), when=_g4_full),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"]), when=_g4_swa),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * _G4_HD_FULL), when=_g4_full),
    lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM, when=_g4_swa),
    lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM, when=_g4_swa),
    lt(T.ATTN_Q_NORM, lambda d: (_G4_HD_FULL,), NORM, when=_g4_full),
    lt(T.ATTN_K_NORM, lambda d: (_G4_HD_FULL,), NORM, when=_g4_full),
    _ATTN_POST_NORM,
    lt(T.LAYER_OUT_SCALE, lambda d: (1,), init=_g4_out_scale),
) + FFN + (_FFN_POST_NORM,) + only((
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_GATE_INP, lambda d: (d["E"],), NORM, "scale"),
    lt(T.FFN_PRE_NORM_2, lambda d: (d["E"],), NORM),
    lt(T.FFN_POST_NORM_1, lambda d: (d["E"],), NORM),
    lt(T.FFN_POST_NORM_2, lambda d: (d["E"],), NORM),
) + MOE[2:], _g4_moe)


def _gemma4_kv(d: dict) -> dict:
    return {
        **moe_kv(d), KA.SLIDING_WINDOW: d["swa"],
        KA.SLIDING_WINDOW_PATTERN: [_g4_swa(il, d) for il in range(d["n_layer"])],
        KA.KEY_LENGTH: _G4_HD_FULL, KA.VALUE_LENGTH: _G4_HD_FULL, KR.DIMENSION_COUNT: _G4_HD_FULL,
        KA.KEY_LENGTH_SWA: d["D"], KA.VALUE_LENGTH_SWA: d["D"], KR.DIMENSION_COUNT_SWA: d["D"],
        KR.FREQ_BASE_SWA: 10000.0, KR.FREQ_BASE: 1000000.0,
        KL.EMBD_LENGTH_PER_LAYER_INP: 0, KL.FINAL_LOGIT_SOFTCAPPING: 30.0,
    }


# hy_v3 (HY V3 MoE): QK-norm before RoPE; a dense lead (layer 0), then sigmoid-routed experts with a
# selection bias (blk.N.exp_probs_b) plus an ungated shared expert. MTP layers: none here.
def _hy3_dense(il: int, d: dict) -> bool:
    return il < d["L"]


def _hy3_moe(il: int, d: dict) -> bool:
    return il >= d["L"]


_HY3_LAYER = ATTN + QK_NORM + FFN[:1] + only(FFN[1:], _hy3_dense) + only(MOE[1:] + SHARED_EXPERT + (
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, ""),), _hy3_moe)


def _hy3_kv(d: dict) -> dict:
    return {**moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"], KL.EXPERT_WEIGHTS_NORM: True,
            KL.EXPERT_WEIGHTS_SCALE: 2.5}


# qwen3vl: interleaved M-RoPE, QK-norm; the first 4 layers are deepstack layers (they add the vision
# features that ride in the input rows: zero padding for token ids), so the cuts put some on later stages
_QWEN3VL_DEEPSTACK = 4


SPECS: dict[str, ArchSpec] = {
    # embedding scaled by sqrt(n_embd) on the first stage only; head tied to the token embedding
    "gemma": ArchSpec(layer=ATTN + FFN, tied=True, features=("dense", "tied", "embd-scale")),
    # gemma2: alternating sliding-window / global layers, post-norms, attention and final soft-capping
    "gemma2": ArchSpec(
        layer=ATTN + (_ATTN_POST_NORM,) + FFN + (_FFN_POST_NORM,),
        tied=True,
        extra_kv=_gemma2_kv,
        kind=swa_kind,
        features=("swa", "tied", "embd-scale", "softcap", "post-norm"),
    ),
    "glm4": ArchSpec(layer=_GLM4_LAYER, features=("dense", "post-norm", "fused-gate-up")),
    # hunyuan-dense runs hunyuan_vl's graph (src/models/hunyuan-vl.cpp): QK-norm after RoPE
    "hunyuan-dense": ArchSpec(layer=ATTN + QK_NORM + FFN, features=("dense", "qk-norm")),
    # hunyuan_vl: the same graph with M-RoPE (rope sections; text positions in every section)
    "hunyuan_vl": ArchSpec(layer=ATTN + QK_NORM + FFN, extra_kv=lambda d: {KR.DIMENSION_SECTIONS: [2, 3, 3, 0]},
                           features=("dense", "qk-norm", "mrope")),
    "ernie4_5": ArchSpec(layer=ATTN + FFN, features=("dense",)),
    "nemotron": ArchSpec(layer=_NEMOTRON_LAYER, globals=(OUTPUT_NORM_BIAS,), extra_kv=_layernorm_kv,
                         features=("dense", "layernorm", "bias", "relu2")),
    # minicpm runs granite's graph: embedding, residual and logit scales (explicit, not the defaults
    # derived from the layer count)
    "minicpm": ArchSpec(layer=ATTN + FFN, extra_kv=lambda d: {
        KL.EMBEDDING_SCALE: 12.0, KL.RESIDUAL_SCALE: 1.4 / d["n_layer"] ** 0.5, KL.LOGIT_SCALE: 256.0 / d["E"]},
        features=("dense", "embd-scale", "residual-scale")),
    # gptneox: parallel attention + MLP residual, partial NeoX RoPE over half the head
    "gptneox": ArchSpec(layer=_GPT_LAYER, globals=(OUTPUT_NORM_BIAS,), extra_kv=lambda d: {
        KA.LAYERNORM_EPS: 1e-5, KL.USE_PARALLEL_RESIDUAL: True, KR.DIMENSION_COUNT: d["D"] // 2},
        features=("layernorm", "bias", "fused-qkv", "parallel-attn-ffn", "partial-rope")),
    # gpt2 / starcoder: learned position embeddings added on the first stage only, no RoPE
    "gpt2": ArchSpec(layer=_GPT_LAYER, globals=(_POS_EMBD, OUTPUT_NORM_BIAS), dims=_with_ctx,
                     extra_kv=_pos_kv, features=("layernorm", "bias", "fused-qkv", "pos-embd")),
    # starcoder: the same block with multi-query attention (one KV head)
    "starcoder": ArchSpec(layer=_GPT_LAYER, globals=(_POS_EMBD, OUTPUT_NORM_BIAS),
                          dims=lambda d: {**_with_ctx(d), "K": 1}, extra_kv=_pos_kv,
                          features=("layernorm", "bias", "fused-qkv", "mqa", "pos-embd")),
    "llama4": ArchSpec(layer=_LLAMA4_LAYER, extra_kv=_llama4_kv, kind=_l4_kind, parity_layers=8,
                       features=("chunked-attn", "no-rope-layers", "attn-temperature", "moe", "shared-expert",
                                 "interleaved-moe", "qk-norm")),
    "gemma4": ArchSpec(
        layer=_G4_LAYER, tied=True, extra_kv=_gemma4_kv, kind=_g4_kind,
        globals=(lt(T.ROPE_FREQS, lambda d: (_G4_HD_FULL // 2,), init=_g4_rope_freqs),),
        features=("swa", "per-layer-head-dim", "k-as-v", "proportional-rope", "moe", "dense+moe-ffn",
                  "layer-out-scale", "embd-scale", "softcap", "tied"),
    ),
    "hy_v3": ArchSpec(layer=_HY3_LAYER, extra_kv=_hy3_kv, kind=lambda il, d: "dense" if _hy3_dense(il, d) else "moe",
                      features=("qk-norm", "dense-lead", "moe", "sigmoid-routing", "expert-bias", "shared-expert")),
    # qwen2vl: multi-section RoPE (a text position in every section), QKV bias
    "qwen2vl": ArchSpec(layer=ATTN + QKV_BIAS + FFN, extra_kv=lambda d: {KR.DIMENSION_SECTIONS: [2, 3, 3, 0]},
                        features=("dense", "mrope", "qkv-bias")),
    "qwen3vl": ArchSpec(
        layer=ATTN + QK_NORM + FFN,
        extra_kv=lambda d: {KR.DIMENSION_SECTIONS: [2, 3, 3, 0], KL.NUM_DEEPSTACK_LAYERS: _QWEN3VL_DEEPSTACK},
        kind=lambda il, d: "deepstack" if il < _QWEN3VL_DEEPSTACK else "layer",
        features=("dense", "imrope", "qk-norm", "deepstack")),
}
