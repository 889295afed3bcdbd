"""Synthetic specs of the linear family group (see dgr.toolchain.synth.families): linear attention and recurrent
architectures (gated delta-net and lightning-attention hybrids, RWKV6) and qwen3vlmoe's text path.

Recurrent state is per layer (patch 0003 allocates it for the owned layers only), so a seam carries
the residual alone. Hybrids put full attention in every 4th layer and write 8 layers, so the cuts
cross attention/recurrent both ways. Not here: rwkv7 and arwkv7 carry the first layer's value
(`v_first`) to every later layer, a second stream across a seam that the boundary does not have.

Dims added by the `dims` hooks: see each group's comment.
"""

from __future__ import annotations

import gguf
import numpy as np

from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, KR, KS, MOE, NORM, OUTPUT_NORM_BIAS, QK_NORM,
                                      SHARED_EXPERT, ArchSpec, LayerTensor, T, lt, moe_kv, only)


def _neg_a(shape, rng, d):
    # -exp(A_log) in the checkpoint: a negative decay rate keeps the delta-net gate below 1
    return -rng.uniform(0.5, 1.5, size=shape).astype(np.float32)


# Gated delta-net dims: Sk head (state) size, Gk key heads (ssm group count), Gv value heads (time-step
# rank), Ck conv kernel, I inner size (Gv * Sk).
def _delta_dims(d: dict) -> dict:
    # head_v_dim = d_inner / n_v_heads must equal the state size (llama.cpp sizes its tensors that way)
    d.update(Sk=16, Gk=2, Gv=4, Ck=4)
    d["I"] = d["Gv"] * d["Sk"]
    return d


def _full_attn_every_4(il: int, d: dict) -> bool:
    # llama.cpp's default full_attention_interval for qwen3next / qwen35 (written explicitly below)
    return (il + 1) % 4 == 0


def _recr(il: int, d: dict) -> bool:
    return not _full_attn_every_4(il, d)


def _delta_kv(d: dict) -> dict:
    return {
        KS.CONV_KERNEL: d["Ck"], KS.INNER_SIZE: d["I"], KS.STATE_SIZE: d["Sk"], KS.TIME_STEP_RANK: d["Gv"],
        KS.GROUP_COUNT: d["Gk"], KL.FULL_ATTENTION_INTERVAL: 4,
    }


def _conv_dim(d: dict) -> int:
    return 2 * d["Gk"] * d["Sk"] + d["I"]


# Full attention layers of the gated hybrids: Q carries a gate (twice the width), q/k norm.
_GATED_ATTN = only((
    lt(T.ATTN_Q, lambda d: (2 * d["H"] * d["D"], d["E"])),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
) + QK_NORM, _full_attn_every_4)

# Gated delta-net layers (the fused qkv + gate layout, not the legacy ssm_in one).
_DELTA_NET = only((
    lt(T.ATTN_QKV, lambda d: (_conv_dim(d), d["E"])),
    lt(T.ATTN_GATE, lambda d: (d["I"], d["E"])),
    lt(T.SSM_CONV1D, lambda d: (_conv_dim(d), d["Ck"])),
    lt(T.SSM_DT, lambda d: (d["Gv"],), BIAS, "bias"),
    lt(T.SSM_A, lambda d: (d["Gv"],), F32, "", init=_neg_a),
    lt(T.SSM_BETA_ALPHA, lambda d: (2 * d["Gv"], d["E"])),
    lt(T.SSM_NORM, lambda d: (d["Sk"],), NORM),
    lt(T.SSM_OUT, lambda d: (d["E"], d["I"])),
), _recr)

_NORMS = (lt(T.ATTN_NORM, lambda d: (d["E"],), NORM), lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM))
_SHEXP_GATE = lt(T.FFN_GATE_INP_SHEXP, lambda d: (d["E"],))


def _qwen3next_kv(d: dict) -> dict:
    return {**_delta_kv(d), **moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"]}


# qwen35 / qwen35moe: the same hybrid, with separate beta and alpha projections (no legacy ssm_in path)
_DELTA_NET_35 = only((
    lt(T.ATTN_QKV, lambda d: (_conv_dim(d), d["E"])),
    lt(T.ATTN_GATE, lambda d: (d["I"], d["E"])),
    lt(T.SSM_CONV1D, lambda d: (_conv_dim(d), d["Ck"])),
    lt(T.SSM_DT, lambda d: (d["Gv"],), BIAS, "bias"),
    lt(T.SSM_A, lambda d: (d["Gv"],), F32, "", init=_neg_a),
    lt(T.SSM_BETA, lambda d: (d["Gv"], d["E"])),
    lt(T.SSM_ALPHA, lambda d: (d["Gv"], d["E"])),
    lt(T.SSM_NORM, lambda d: (d["Sk"],), NORM),
    lt(T.SSM_OUT, lambda d: (d["E"], d["I"])),
), _recr)


def _qwen35_kv(d: dict) -> dict:
    # interleaved M-RoPE: four sections of rotary pairs summing to n_rot / 2 (text uses the first three)
    return {**_delta_kv(d), KR.DIMENSION_SECTIONS: [3, 3, 2, 0]}


def _qwen35moe_kv(d: dict) -> dict:
    return {**_qwen35_kv(d), **moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"]}


# kimi-linear: Kimi delta attention (KDA: per-channel gates, q/k/v short convs) in 3 of 4 layers, MLA
# attention without rope in the 4th (absorbed form: one KV head of width C + R, value width C), a dense
# lead layer, then MoE with a shared expert and a sigmoid router with a bias. Dims: Hd KDA head size,
# C kv lora rank, R rope part of the MLA key (llama.cpp reads it as n_rot), N its no-rope part, Vh MLA
# value head size, L dense lead.
def _kimi_dims(d: dict) -> dict:
    d.update(Hd=16, Ck=4, Vh=16, L=1)
    return d


def _kimi_dense(il: int, d: dict) -> bool:
    return il < d["L"]


def _kimi_moe(il: int, d: dict) -> bool:
    return il >= d["L"]


def _kda_inner(d: dict) -> int:
    return d["H"] * d["Hd"]


_KDA = only((
    lt(T.SSM_CONV1D_Q, lambda d: (_kda_inner(d), 1, d["Ck"])),
    lt(T.SSM_CONV1D_K, lambda d: (_kda_inner(d), 1, d["Ck"])),
    lt(T.SSM_CONV1D_V, lambda d: (_kda_inner(d), 1, d["Ck"])),
    lt(T.ATTN_Q, lambda d: (_kda_inner(d), d["E"])),
    lt(T.ATTN_K, lambda d: (_kda_inner(d), d["E"])),
    lt(T.ATTN_V, lambda d: (_kda_inner(d), d["E"])),
    lt(T.SSM_F_A, lambda d: (d["Hd"], d["E"])),
    lt(T.SSM_F_B, lambda d: (_kda_inner(d), d["Hd"])),
    lt(T.SSM_BETA, lambda d: (d["H"], d["E"])),
    lt(T.SSM_A, lambda d: (d["H"], 1), F32, "", init=_neg_a),
    lt(T.SSM_DT, lambda d: (_kda_inner(d),), BIAS, "bias"),
    lt(T.SSM_G_A, lambda d: (d["Hd"], d["E"])),
    lt(T.SSM_G_B, lambda d: (_kda_inner(d), d["Hd"])),
    lt(T.SSM_NORM, lambda d: (d["Hd"],), NORM),
    lt(T.ATTN_OUT, lambda d: (d["E"], _kda_inner(d))),
), _recr)

_KIMI_MLA = only((
    lt(T.ATTN_KV_A_NORM, lambda d: (d["C"],), NORM),
    lt(T.ATTN_Q, lambda d: (d["H"] * (d["N"] + d["R"]), d["E"])),
    lt(T.ATTN_KV_A_MQA, lambda d: (d["C"] + d["R"], d["E"])),
    lt(T.ATTN_K_B, lambda d: (d["H"], d["C"], d["N"])),
    lt(T.ATTN_V_B, lambda d: (d["H"], d["Vh"], d["C"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["Vh"])),
), _full_attn_every_4)

_KIMI_FFN = FFN[:1] + only(FFN[1:], _kimi_dense) + only(MOE[1:], _kimi_moe) + (
    lt(T.FFN_GATE_SHEXP, lambda d: (d["G"], d["E"]), when=_kimi_moe),
    lt(T.FFN_UP_SHEXP, lambda d: (d["G"], d["E"]), when=_kimi_moe),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"]), when=_kimi_moe),
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _kimi_moe),
)


def _kimi_kv(d: dict) -> dict:
    # head_count_kv per layer marks the kinds: 0 = a KDA (recurrent) layer, 1 = an MLA layer
    return {
        KA.HEAD_COUNT_KV: [0 if _recr(il, d) else 1 for il in range(d["n_layer"])],
        KA.KEY_LENGTH: d["C"] + d["R"], KA.VALUE_LENGTH: d["C"],
        KA.KEY_LENGTH_MLA: d["N"] + d["R"], KA.VALUE_LENGTH_MLA: d["Vh"], KA.KV_LORA_RANK: d["C"],
        KR.DIMENSION_COUNT: d["R"], KS.CONV_KERNEL: d["Ck"], gguf.Keys.KDA.HEAD_DIM: d["Hd"],
        KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: 1, KL.EXPERT_GATING_FUNC: 2,
        KL.EXPERT_WEIGHTS_SCALE: 2.0, **moe_kv(d),
    }


# RWKV6 (Finch) and its Qwen2-derived variant: every layer a time mix (WKV / gated linear attention,
# token shift) and a channel mix or FFN; the state is per layer (token shift + wkv state). Dims: Tm time
# mix lora width, Td time decay lora width; the wkv head size is the head dim D.
def _rwkv_dims(d: dict) -> dict:
    d.update(Tm=8, Td=16)
    return d


def _vec(tensor) -> LayerTensor:
    # the lerp / decay vectors ggml broadcasts as [n_embd, 1, 1] (F32: they enter element-wise ops)
    return lt(tensor, lambda d: (1, 1, d["E"]), F32)


_RWKV6_TIME_MIX_IN = (
    lt(T.TIME_MIX_W1, lambda d: (5 * d["Tm"], d["E"])),
    lt(T.TIME_MIX_W2, lambda d: (5, d["E"], d["Tm"])),
    _vec(T.TIME_MIX_LERP_X),
    lt(T.TIME_MIX_LERP_FUSED, lambda d: (5, 1, 1, d["E"]), F32),
    lt(T.TIME_MIX_DECAY, lambda d: (d["E"],), F32),
    lt(T.TIME_MIX_DECAY_W1, lambda d: (d["Td"], d["E"])),
    lt(T.TIME_MIX_DECAY_W2, lambda d: (d["E"], d["Td"])),
)

_RWKV6 = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM), lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.ATTN_NORM_2, lambda d: (d["E"],), NORM), lt(T.ATTN_NORM_2, lambda d: (d["E"],), BIAS, "bias"),
) + _RWKV6_TIME_MIX_IN + (
    lt(T.TIME_MIX_FIRST, lambda d: (d["E"] // d["D"], d["D"]), F32),
    lt(T.TIME_MIX_KEY, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_VALUE, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_RECEPTANCE, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_GATE, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_LN, lambda d: (d["E"],), NORM), lt(T.TIME_MIX_LN, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.TIME_MIX_OUTPUT, lambda d: (d["E"], d["E"])),
    _vec(T.CHANNEL_MIX_LERP_K),
    _vec(T.CHANNEL_MIX_LERP_R),
    lt(T.CHANNEL_MIX_KEY, lambda d: (d["F"], d["E"])),
    lt(T.CHANNEL_MIX_VALUE, lambda d: (d["E"], d["F"])),
    lt(T.CHANNEL_MIX_RECEPTANCE, lambda d: (d["E"], d["E"])),
)


def _rwkv_kv(d: dict) -> dict:
    return {
        gguf.Keys.WKV.HEAD_SIZE: d["D"], KL.TIME_MIX_EXTRA_DIM: d["Tm"], KL.TIME_DECAY_EXTRA_DIM: d["Td"],
        KA.LAYERNORM_EPS: 1e-5, KA.HEAD_COUNT_KV: d["H"],
    }


def _rwkv6_kv(d: dict) -> dict:
    # rescale_every_n_layers halves the residual after every 2nd layer (global numbering: crosses seams)
    return {**_rwkv_kv(d), KL.RESCALE_EVERY_N_LAYERS: 2, KL.TOKEN_SHIFT_COUNT: 2}


# rwkv6qwen2: no bonus (time_mix_first absent: gated linear attention), grouped k/v heads with biases,
# RMS norms and a SwiGLU FFN, one token shift per layer
_RWKV6QWEN2 = (lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),) + _RWKV6_TIME_MIX_IN + (
    lt(T.TIME_MIX_KEY, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.TIME_MIX_VALUE, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.TIME_MIX_RECEPTANCE, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_GATE, lambda d: (d["E"], d["E"])),
    lt(T.TIME_MIX_KEY, lambda d: (d["K"] * d["D"],), BIAS, "bias"),
    lt(T.TIME_MIX_VALUE, lambda d: (d["K"] * d["D"],), BIAS, "bias"),
    lt(T.TIME_MIX_RECEPTANCE, lambda d: (d["E"],), BIAS, "bias"),
    lt(T.TIME_MIX_OUTPUT, lambda d: (d["E"], d["E"])),
) + FFN


def _rwkv6qwen2_kv(d: dict) -> dict:
    return {**_rwkv_kv(d), KA.HEAD_COUNT_KV: d["K"], KL.TOKEN_SHIFT_COUNT: 1}


# minimax-01: lightning (linear) attention layers with a fused silu qkv, an output norm and a sigmoid
# gate, softmax attention every 4th layer here (8 in the checkpoint), MoE in every layer with the FFN
# width as expert width, both residuals scaled by residual_scale
_LIGHTNING = only((
    lt(T.ATTN_NORM_2, lambda d: (d["H"] * d["D"],), NORM),
    lt(T.ATTN_QKV, lambda d: (3 * d["H"] * d["D"], d["E"])),
    lt(T.ATTN_GATE, lambda d: (d["H"] * d["D"], d["E"])),
), _recr)

_MINIMAX01_MOE = (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_UP_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["F"])),
)


def _minimax01_kv(d: dict) -> dict:
    return {**moe_kv(d), KL.RESIDUAL_SCALE: 0.9, KL.FULL_ATTENTION_INTERVAL: 4}


# qwen3vlmoe (text path): qwen3moe with interleaved M-RoPE and deepstack layers, which add the visual
# features' rows of the input (zeros for token input) to their output. 4 deepstack layers of 6 (3 in the
# checkpoints) so that a 3-stage cut starts a stage inside them.
def _deepstack(il: int, d: dict) -> bool:
    return il < 4


def _qwen3vlmoe_kv(d: dict) -> dict:
    return {**moe_kv(d), KR.DIMENSION_SECTIONS: [3, 3, 2, 0], KL.NUM_DEEPSTACK_LAYERS: 4}


def _delta_kind(il: int, d: dict) -> str:
    return "recurrent" if _recr(il, d) else "attention"


SPECS: dict[str, ArchSpec] = {
    # qwen3next: gated delta-net layers, full (gated, q/k-normed) attention every 4th layer, MoE with a
    # sigmoid-gated shared expert in every layer; 8 layers so that two attention layers exist
    "qwen3next": ArchSpec(
        layer=_NORMS + _GATED_ATTN + _DELTA_NET + MOE[1:] + SHARED_EXPERT + (_SHEXP_GATE,),
        extra_kv=_qwen3next_kv,
        dims=_delta_dims,
        kind=_delta_kind,
        features=("hybrid", "recurrent", "delta-net", "conv", "gated-attn", "qk-norm", "moe", "shared-expert"),
        parity_layers=8,
    ),
    # qwen35: the qwen3next layer pattern with dense FFNs and interleaved M-RoPE (4 positions per token)
    "qwen35": ArchSpec(
        layer=_NORMS + _GATED_ATTN + _DELTA_NET_35 + FFN[1:],
        extra_kv=_qwen35_kv,
        dims=_delta_dims,
        kind=_delta_kind,
        features=("hybrid", "recurrent", "delta-net", "conv", "gated-attn", "qk-norm", "mrope", "dense"),
        parity_layers=8,
    ),
    "qwen35moe": ArchSpec(
        layer=_NORMS + _GATED_ATTN + _DELTA_NET_35 + MOE[1:] + SHARED_EXPERT + (_SHEXP_GATE,),
        extra_kv=_qwen35moe_kv,
        dims=_delta_dims,
        kind=_delta_kind,
        features=("hybrid", "recurrent", "delta-net", "conv", "gated-attn", "qk-norm", "mrope", "moe",
                  "shared-expert"),
        parity_layers=8,
    ),
    "kimi-linear": ArchSpec(
        layer=(lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),) + _KDA + _KIMI_MLA + _KIMI_FFN,
        extra_kv=_kimi_kv,
        dims=_kimi_dims,
        kind=_delta_kind,
        features=("hybrid", "recurrent", "delta-net", "conv", "mla", "dense-lead", "moe", "shared-expert"),
        parity_layers=8,
    ),
    "minimax-01": ArchSpec(
        layer=ATTN[:1] + only(ATTN[1:4], _full_attn_every_4) + _LIGHTNING + ATTN[4:] + _MINIMAX01_MOE,
        tied=True,
        extra_kv=_minimax01_kv,
        kind=_delta_kind,
        features=("hybrid", "recurrent", "lightning-attn", "moe", "residual-scale", "tied"),
        parity_layers=8,
    ),
    "qwen3vlmoe": ArchSpec(
        layer=ATTN + QK_NORM + MOE,
        extra_kv=_qwen3vlmoe_kv,
        kind=lambda il, d: "deepstack" if _deepstack(il, d) else "layer",
        features=("moe", "qk-norm", "mrope", "deepstack"),
    ),
    "rwkv6": ArchSpec(
        layer=_RWKV6,
        globals=(lt(T.TOKEN_EMBD_NORM, lambda d: (d["E"],), NORM),
                 lt(T.TOKEN_EMBD_NORM, lambda d: (d["E"],), BIAS, "bias"), OUTPUT_NORM_BIAS),
        extra_kv=_rwkv6_kv,
        dims=_rwkv_dims,
        features=("recurrent", "rwkv", "token-shift", "layernorm", "embd-norm", "rescale"),
    ),
    "rwkv6qwen2": ArchSpec(
        layer=_RWKV6QWEN2,
        extra_kv=_rwkv6qwen2_kv,
        dims=_rwkv_dims,
        features=("recurrent", "rwkv", "token-shift", "gla", "gqa", "qkv-bias", "dense"),
    ),
}
