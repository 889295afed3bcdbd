"""Synthetic specs of the moe_a family group (see dgr.toolchain.synth.families): mixture-of-experts decoders.

Shapes are numpy order (ggml's ne reversed). Each row writes what the arch's load_arch_tensors in the
pinned llama.cpp requires, and the metadata its load_arch_hparams reads.
"""

from __future__ import annotations

import gguf

from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, KR, KS, MOE, NORM, OUTPUT_NORM_BIAS, QK_NORM,
                                      QKV_BIAS, SHARED_EXPERT, ArchSpec, T, after_lead as _moe, dense_lead as _dense,
                                      dense_moe_kind as _dense_moe_kind, lt, moe_kv, only, swa_kind, swa_kv)

_EXP_PROBS_B = lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _moe)  # routing bias
_ATTN_POST_NORM = lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM)


def _shared_experts(when=None) -> tuple:
    """S shared experts fused into one FFN of width G*S (deepseek-style)."""
    return (lt(T.FFN_GATE_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=when),
            lt(T.FFN_UP_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=when),
            lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"] * d["S"]), when=when))


# qwen2moe: every layer MoE plus one shared expert behind a sigmoid gate (ffn_gate_inp_shexp, a
# [n_embd] row); attention with q/k/v biases.
_QWEN2MOE = ArchSpec(
    layer=ATTN + QKV_BIAS + MOE + SHARED_EXPERT + (lt(T.FFN_GATE_INP_SHEXP, lambda d: (d["E"],)),),
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"]},
    features=("moe", "shared-expert", "qkv-bias"),
)

# olmoe: q/k norms over the whole projection ([n_embd] each), which needs as many kv heads as heads;
# the experts are n_ff wide (no expert length key).
_OLMOE = ArchSpec(
    layer=ATTN + (lt(T.ATTN_Q_NORM, lambda d: (d["E"],), NORM), lt(T.ATTN_K_NORM, lambda d: (d["E"],), NORM))
    + MOE,
    dims=lambda d: {**d, "K": d["H"], "F": d["G"]},
    extra_kv=moe_kv,
    features=("moe", "qk-norm"),
)

# ernie4_5-moe (hparams and tensors from ernie4-5.cpp): dense lead, then MoE every
# interleave_moe_layer_step-th layer (1: every layer past the lead; the loader makes MoE tensors for every
# layer past the lead, so only step 1 is consistent), routing bias and a shared expert.
_ERNIE45_MOE = ArchSpec(
    layer=ATTN + FFN[:1] + only(FFN[1:], _dense) + only(MOE[1:] + SHARED_EXPERT, _moe) + (_EXP_PROBS_B,),
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"],
                        "{arch}.interleave_moe_layer_step": 1, KL.LEADING_DENSE_BLOCK_COUNT: d["L"]},
    kind=_dense_moe_kind,
    features=("dense-lead", "moe", "shared-expert", "expert-bias"),
)

# hunyuan-moe: every layer MoE (experts n_ff wide) plus a dense shared MLP; q/k norms after RoPE.
_HUNYUAN_MOE = ArchSpec(
    layer=ATTN + QK_NORM + MOE + SHARED_EXPERT,
    dims=lambda d: {**d, "F": d["G"]},
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"]},
    features=("moe", "shared-expert", "qk-norm"),
)

# glm4moe (GLM-4.5): q/k/v biases, q/k norms, the post-attention norm is the FFN's input norm (no
# ffn_norm), a dense lead, then sigmoid-gated MoE with a routing bias and S shared experts (G*S wide).
# No MTP (nextn) layers: the nextn count key is optional and absent.
_GLM4MOE = ArchSpec(
    layer=ATTN + QKV_BIAS + QK_NORM + (_ATTN_POST_NORM,) + only(FFN[1:], _dense) + only(MOE[1:], _moe)
    + (_EXP_PROBS_B,) + _shared_experts(_moe),
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_COUNT: d["S"], KL.LEADING_DENSE_BLOCK_COUNT: d["L"],
                        KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 1.5},
    kind=_dense_moe_kind,
    features=("dense-lead", "moe", "shared-expert", "expert-bias", "sigmoid-gating", "qkv-bias", "qk-norm"),
)

# minimax-m2: q/k norms over the whole projection (q [H*D], k [K*D]), partial RoPE (half the head),
# every layer MoE (experts n_ff wide) with sigmoid gating and a required routing bias.
_MINIMAX_M2 = ArchSpec(
    layer=ATTN + (lt(T.ATTN_Q_NORM, lambda d: (d["H"] * d["D"],), NORM),
                  lt(T.ATTN_K_NORM, lambda d: (d["K"] * d["D"],), NORM))
    + MOE + (lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias"),),
    dims=lambda d: {**d, "F": d["G"]},
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_GATING_FUNC: 2, KR.DIMENSION_COUNT: d["D"] // 2},
    features=("moe", "expert-bias", "sigmoid-gating", "qk-norm", "partial-rope"),
)

# bailingmoe (Ling): every layer MoE plus S shared experts; softmax gating with normalised weights.
_BAILINGMOE = ArchSpec(
    layer=ATTN + MOE + _shared_experts(),
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_COUNT: d["S"], KL.EXPERT_WEIGHTS_NORM: True},
    features=("moe", "shared-expert"),
)

# bailingmoe2 (Ling 2.0): fused QKV, q/k norms, dense lead, then sigmoid-gated MoE with a routing bias
# and S shared experts. No MTP (nextn) layers: the nextn count key is optional and absent.
_BAILINGMOE2 = ArchSpec(
    layer=(lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
           lt(T.ATTN_QKV, lambda d: (d["H"] * d["D"] + 2 * d["K"] * d["D"], d["E"])),
           lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])))
    + QK_NORM + FFN[:1] + only(FFN[1:], _dense) + only(MOE[1:], _moe) + (_EXP_PROBS_B,) + _shared_experts(_moe),
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_COUNT: d["S"], KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"],
                        KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_GATING_FUNC: 2,
                        KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 1.5},
    kind=_dense_moe_kind,
    features=("dense-lead", "moe", "shared-expert", "expert-bias", "sigmoid-gating", "fused-qkv", "qk-norm"),
)

# gpt-oss (openai-moe.cpp): alternating sliding-window / full attention layers (pattern 2: odd layers
# full), attention sinks per head, output-projection bias, the post-attention norm as the FFN's norm, and
# MoE with biased router and experts (SwiGLU-OAI, softmax over the chosen experts' weights).
_GPT_OSS = ArchSpec(
    layer=ATTN + (_ATTN_POST_NORM,
                  lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias"),
                  lt(T.ATTN_SINKS, lambda d: (d["H"],), F32),
                  lt(T.FFN_GATE_INP, lambda d: (d["X"],), BIAS, "bias"),
                  lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["G"]), BIAS, "bias"),
                  lt(T.FFN_UP_EXP, lambda d: (d["X"], d["G"]), BIAS, "bias"),
                  lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"]), BIAS, "bias"))
    + MOE[1:],
    extra_kv=lambda d: {**moe_kv(d), **swa_kv(d)},
    kind=swa_kind,
    features=("moe", "swa", "attn-sinks", "expert-bias"),
)

# dots1: no GQA (k/v as wide as q), q/k norms, dense lead, then sigmoid-gated MoE with a routing bias
# and S shared experts.
_DOTS1 = ArchSpec(
    layer=ATTN + QK_NORM + FFN[:1] + only(FFN[1:], _dense) + only(MOE[1:], _moe) + (_EXP_PROBS_B,)
    + _shared_experts(_moe),
    dims=lambda d: {**d, "K": d["H"]},
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_COUNT: d["S"], KL.LEADING_DENSE_BLOCK_COUNT: d["L"],
                        KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True},
    kind=_dense_moe_kind,
    features=("dense-lead", "moe", "shared-expert", "expert-bias", "sigmoid-gating", "qk-norm"),
)

# granitemoe (hparams and tensors from granite-moe.cpp, graph from granite.cpp): the granite scale
# multipliers (embedding: first stage only, inside build_inp_embd; residual; attention; logits: last
# stage only), every layer MoE with experts n_ff wide plus the "MoE shared" variant's shared expert.
_GRANITEMOE = ArchSpec(
    layer=ATTN + MOE + SHARED_EXPERT,
    dims=lambda d: {**d, "F": d["G"]},
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"], KL.LOGIT_SCALE: 4.0,
                        KL.RESIDUAL_SCALE: 0.25, KL.EMBEDDING_SCALE: 6.0, KA.SCALE: 0.125},
    features=("moe", "shared-expert", "embd-scale", "residual-scale", "logit-scale"),
)

# phimoe (tensors from phimoe.cpp, graph from phi3.cpp): RMS norms with biases (attention, FFN,
# output), output-projection and LM-head biases, every layer MoE with experts n_ff wide.
_PHIMOE = ArchSpec(
    layer=ATTN + (lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
                  lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias"),
                  lt(T.FFN_NORM, lambda d: (d["E"],), BIAS, "bias"))
    + MOE,
    globals=(OUTPUT_NORM_BIAS, lt(T.OUTPUT, lambda d: (d["V"],), BIAS, "bias")),
    dims=lambda d: {**d, "F": d["G"]},
    extra_kv=moe_kv,
    features=("moe", "norm-bias", "head-bias"),
)

# grovemoe: q/k norms, every layer MoE plus "adjugate" chunk experts (X / experts_per_group of them,
# chunk_ffn wide) routed by the same router logits and added with expert_group_scale.
_GROVEMOE = ArchSpec(
    layer=ATTN + QK_NORM + MOE + (
        lt(T.FFN_GATE_CHEXP, lambda d: (d["X"] // d["P"], d["C"], d["E"])),
        lt(T.FFN_UP_CHEXP, lambda d: (d["X"] // d["P"], d["C"], d["E"])),
        lt(T.FFN_DOWN_CHEXP, lambda d: (d["X"] // d["P"], d["E"], d["C"]))),
    dims=lambda d: {**d, "P": 2, "C": d["G"] // 2},  # P experts per group, C chunk ffn width
    extra_kv=lambda d: {**moe_kv(d), KL.EXPERT_CHUNK_FEED_FORWARD_LENGTH: d["C"], KL.EXPERT_GROUP_SCALE: 0.05,
                        KL.EXPERTS_PER_GROUP: d["P"]},
    features=("moe", "chunk-experts", "qk-norm"),
)

# bailingmoe3: a hybrid of Kimi delta attention (KDA: q/k/v short convs, per-channel forget gate,
# recurrent state) in 3 of 4 layers and gated MLA attention (absorbed form: one KV head of width C + R,
# value width C; no q lora) in every 4th; a dense lead, then sigmoid-gated MoE with a routing bias and a
# shared expert. head_count_kv per layer marks the kinds (0: KDA). No MTP (nextn) layers. Dims: Hd KDA
# head size, Ck conv kernel, Vh MLA value head size (C kv lora rank, R rope part, N no-rope part: dgr.toolchain.synth.generic).
def _bm3_attn(il: int, d: dict) -> bool:
    return (il + 1) % 4 == 0


def _bm3_kda(il: int, d: dict) -> bool:
    return not _bm3_attn(il, d)


def _bm3_inner(d: dict) -> int:
    return d["H"] * d["Hd"]


_BM3_KDA = only((
    lt(T.SSM_CONV1D_Q, lambda d: (_bm3_inner(d), 1, d["Ck"])),
    lt(T.SSM_CONV1D_K, lambda d: (_bm3_inner(d), 1, d["Ck"])),
    lt(T.SSM_CONV1D_V, lambda d: (_bm3_inner(d), 1, d["Ck"])),
    lt(T.ATTN_Q, lambda d: (_bm3_inner(d), d["E"])),
    lt(T.ATTN_K, lambda d: (_bm3_inner(d), d["E"])),
    lt(T.ATTN_V, lambda d: (_bm3_inner(d), d["E"])),
    lt(T.SSM_F_A, lambda d: (_bm3_inner(d), d["E"])),
    lt(T.SSM_BETA, lambda d: (d["H"], d["E"])),
    lt(T.SSM_A, lambda d: (d["H"], 1), F32, ""),  # multiplies the gate logits (no scan)
    lt(T.SSM_DT, lambda d: (_bm3_inner(d),), BIAS, "bias"),
    lt(T.SSM_G_A, lambda d: (_bm3_inner(d), d["E"])),
    lt(T.SSM_NORM, lambda d: (d["Hd"],), NORM),
    lt(T.ATTN_OUT, lambda d: (d["E"], _bm3_inner(d))),
), _bm3_kda)

_BM3_MLA = only((
    lt(T.ATTN_Q, lambda d: (d["H"] * (d["N"] + d["R"]), d["E"])),
    lt(T.ATTN_KV_A_MQA, lambda d: (d["C"] + d["R"], d["E"])),
    lt(T.ATTN_KV_A_NORM, lambda d: (d["C"],), NORM),
    lt(T.ATTN_K_B, lambda d: (d["H"], d["C"], d["N"])),
    lt(T.ATTN_V_B, lambda d: (d["H"], d["Vh"], d["C"])),
    lt(T.ATTN_GATE, lambda d: (d["H"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["Vh"])),
), _bm3_attn)


def _bm3_kv(d: dict) -> dict:
    return {
        KA.HEAD_COUNT_KV: [0 if _bm3_kda(il, d) else 1 for il in range(d["n_layer"])],
        KA.KEY_LENGTH: d["C"] + d["R"], KA.VALUE_LENGTH: d["C"],
        KA.KEY_LENGTH_MLA: d["N"] + d["R"], KA.VALUE_LENGTH_MLA: d["Vh"], KA.KV_LORA_RANK: d["C"],
        KR.DIMENSION_COUNT: d["R"], KS.CONV_KERNEL: d["Ck"], gguf.Keys.KDA.HEAD_DIM: d["Hd"],
        "{arch}.kda.gate_lower_bound": -5.0,
        KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"],
        KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"], KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True,
        KL.EXPERT_WEIGHTS_SCALE: 2.5, **moe_kv(d),
    }


def _bm3_kind(il: int, d: dict) -> str:
    return ("kda" if _bm3_kda(il, d) else "mla") + "/" + _dense_moe_kind(il, d)


_BAILINGMOE3 = ArchSpec(
    layer=(lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),) + _BM3_KDA + _BM3_MLA + FFN[:1] + only(FFN[1:], _dense)
    + only(MOE[1:], _moe) + (_EXP_PROBS_B,) + only(SHARED_EXPERT, _moe),
    dims=lambda d: {**d, "Hd": 16, "Ck": 4, "Vh": 16},
    extra_kv=_bm3_kv,
    kind=_bm3_kind,
    parity_layers=8,
    features=("hybrid", "recurrent", "kda", "conv", "mla", "gated-attn", "dense-lead", "moe", "shared-expert",
              "expert-bias", "sigmoid-gating"),
)

SPECS: dict[str, ArchSpec] = {
    "qwen2moe": _QWEN2MOE,
    "olmoe": _OLMOE,
    "ernie4_5-moe": _ERNIE45_MOE,
    "hunyuan-moe": _HUNYUAN_MOE,
    "glm4moe": _GLM4MOE,
    "minimax-m2": _MINIMAX_M2,
    "bailingmoe": _BAILINGMOE,
    "bailingmoe2": _BAILINGMOE2,
    "gpt-oss": _GPT_OSS,
    "dots1": _DOTS1,
    "granitemoe": _GRANITEMOE,
    "phimoe": _PHIMOE,
    "grovemoe": _GROVEMOE,
    # a hybrid (KDA recurrent + gated MLA attention): a stage owning only one kind relies on 0015's
    # graph inputs kept allocated
    "bailingmoe3": _BAILINGMOE3,
}
