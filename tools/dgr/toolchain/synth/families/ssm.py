"""Synthetic specs of the ssm family group (see dgr.toolchain.synth.families): state-space and short-convolution
mixers, pure (mamba, mamba2) and hybrid with attention (jamba, falcon-h1, nemotron_h(_moe),
granitehybrid, lfm2(moe), plamo2). A hybrid's layer kind is its mixer (attention or recurrent, as
llama.cpp decides it per layer from head_count_kv), so the parity cuts cross both kinds, and some
stages own no layer of one kind.

The recurrent state is tiny on purpose (d_state 16, d_conv 4, one group) and the SSM tables get the
values a trained model has, so the scan stays stable: A negative (-exp(A_log), A_log = log 1..n),
D ones, dt bias the inverse softplus of a small step. Extra dims: di inner size, ds state size,
dc conv kernel, dr dt rank (mamba) or SSM head count (mamba2), ng groups.
"""

from __future__ import annotations

import gguf
import numpy as np

from dgr.toolchain.synth.spec import ATTN, BIAS, F32, FFN, KA, KL, KS, MOE, NORM, ArchSpec, T, lt, moe_kv, only


def _ssm_dims(d: dict) -> dict:
    # mamba's expansion factor 2 (the only one llama.cpp's mamba loader accepts), tiny state
    return {**d, "di": 2 * d["E"], "ds": 16, "dc": 4, "dr": max(1, d["E"] // 16), "ng": 1}


def _mamba2_dims(d: dict) -> dict:
    # SSM heads of width 16 (dr is the head count in mamba2's hparams)
    d = _ssm_dims(d)
    return {**d, "dr": d["di"] // 16}


def _a_neg(shape, rng, d) -> np.ndarray:
    """A = -exp(A_log), A_log = log(1..n) (S4D-real init): -1, -2, ... -n along the state axis, or
    over the heads when there is one A per head (mamba2's (n_head, 1))."""
    if shape[-1] == 1:
        return -np.arange(1, shape[0] + 1, dtype=np.float32).reshape(shape)
    return np.broadcast_to(-np.arange(1, shape[-1] + 1, dtype=np.float32), shape).copy()


def _ones(shape, rng, d) -> np.ndarray:
    return np.ones(shape, dtype=np.float32)


def _dt_bias(shape, rng, d) -> np.ndarray:
    """inverse softplus of a step drawn in [0.001, 0.1] (mamba's dt init)"""
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=shape)).astype(np.float32)
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)


def _ssm_kv(d: dict) -> dict:
    return {KS.CONV_KERNEL: d["dc"], KS.INNER_SIZE: d["di"], KS.STATE_SIZE: d["ds"],
            KS.TIME_STEP_RANK: d["dr"], KS.GROUP_COUNT: d["ng"]}


def _conv_dim(d: dict) -> int:
    return d["di"] + 2 * d["ng"] * d["ds"]


# mamba (v1) mixer: in-proj to x and z, depthwise conv, x-proj to dt/B/C, dt-proj, selective scan
MAMBA = (
    lt(T.SSM_IN, lambda d: (2 * d["di"], d["E"])),
    lt(T.SSM_CONV1D, lambda d: (d["di"], d["dc"]), F32),
    lt(T.SSM_CONV1D, lambda d: (d["di"],), F32, "bias"),
    lt(T.SSM_X, lambda d: (d["dr"] + 2 * d["ds"], d["di"])),
    lt(T.SSM_DT, lambda d: (d["di"], d["dr"])),
    lt(T.SSM_DT, lambda d: (d["di"],), F32, "bias", init=_dt_bias),
    lt(T.SSM_A, lambda d: (d["di"], d["ds"]), F32, "", init=_a_neg),
    lt(T.SSM_D, lambda d: (d["di"],), F32, "", init=_ones),
    lt(T.SSM_OUT, lambda d: (d["E"], d["di"])),
)

# mamba2 mixer: one in-proj to z, xBC and dt, conv over xBC, scalar A per head, grouped RMS norm
MAMBA2 = (
    lt(T.SSM_IN, lambda d: (d["di"] + _conv_dim(d) + d["dr"], d["E"])),
    lt(T.SSM_CONV1D, lambda d: (_conv_dim(d), d["dc"]), F32),
    lt(T.SSM_CONV1D, lambda d: (_conv_dim(d),), F32, "bias"),
    lt(T.SSM_DT, lambda d: (d["dr"],), F32, "bias", init=_dt_bias),
    lt(T.SSM_A, lambda d: (d["dr"], 1), F32, "", init=_a_neg),
    lt(T.SSM_D, lambda d: (d["dr"], 1), F32, "", init=_ones),
    lt(T.SSM_NORM, lambda d: (d["ng"], d["di"] // d["ng"]), NORM),
    lt(T.SSM_OUT, lambda d: (d["E"], d["di"])),
)

_PRE_NORM = (lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),)


# jamba: mamba (v1, with RMS-normed dt/B/C) mixers, attention every 4th layer (no RoPE; a layer with
# head_count_kv 0 is a mamba layer), MoE FFN on every other layer, dense FFN on the rest
def _jamba_attn(il: int, d: dict) -> bool:
    return il % 4 == 3


def _jamba_recr(il: int, d: dict) -> bool:
    return not _jamba_attn(il, d)


def _odd(il: int, d: dict) -> bool:
    return il % 2 == 1


def _even(il: int, d: dict) -> bool:
    return il % 2 == 0


def _jamba_kv(d: dict) -> dict:
    return {**_ssm_kv(d), **moe_kv(d), KS.GROUP_COUNT: None,
            KA.HEAD_COUNT_KV: [d["K"] if _jamba_attn(il, d) else 0 for il in range(d["n_layer"])]}


_JAMBA_MOE = (  # jamba's experts are n_ff wide
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_UP_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["F"])),
)

JAMBA = (
    _PRE_NORM
    + only(MAMBA[:5] + (lt(T.SSM_DT_NORM, lambda d: (d["dr"],), NORM),) + MAMBA[5:]
           + (lt(T.SSM_B_NORM, lambda d: (d["ds"],), NORM), lt(T.SSM_C_NORM, lambda d: (d["ds"],), NORM)),
           _jamba_recr)
    + only(ATTN[1:], _jamba_attn)
    + FFN[:1] + only(FFN[1:], _even) + only(_JAMBA_MOE, _odd)
)


# falcon-h1: every layer runs attention (RoPE) and a mamba2 mixer side by side on the same normed input,
# adds both to the residual, then a SwiGLU FFN (its norm is a bare blk.N.ffn_norm, no .weight suffix)
FALCON_H1 = (
    _PRE_NORM + ATTN[1:] + MAMBA2
    + (lt(T.FFN_NORM, lambda d: (d["E"],), NORM, ""),) + FFN[1:]
)


# nemotron-h: each block is ONE of a mamba2 mixer (M), attention without RoPE (A) or a squared-ReLU
# MLP (F), all behind the same pre-norm; a layer with head_count_kv 0 and feed_forward_length 0 is
# recurrent. nemotron_h_moe (same loader and graph) makes the F blocks sigmoid-routed MoE with a
# shared expert. Pattern over the parity model: every kind on both sides of every cut, and stages
# that own no attention or no recurrent layer.
_NEMOTRON_PATTERN = "MFAMFMAF"


def _nem(c: str):
    return lambda il, d: _NEMOTRON_PATTERN[il % len(_NEMOTRON_PATTERN)] == c


def _nemotron_kv(d: dict) -> dict:
    pat = [_NEMOTRON_PATTERN[il % len(_NEMOTRON_PATTERN)] for il in range(d["n_layer"])]
    return {**_ssm_kv(d), KA.LAYERNORM_EPS: 1e-5,
            KA.HEAD_COUNT_KV: [d["K"] if c == "A" else 0 for c in pat],
            KL.FEED_FORWARD_LENGTH: [d["F"] if c == "F" else 0 for c in pat]}


def _nemotron_moe_kv(d: dict) -> dict:
    return {**_nemotron_kv(d), **moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"],
            KL.EXPERT_SHARED_COUNT: 1, KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 2.5}


def _nemotron_kind(moe: bool):
    names = {"M": "recurrent", "A": "attn", "F": "moe" if moe else "ffn"}
    return lambda il, d: names[_NEMOTRON_PATTERN[il % len(_NEMOTRON_PATTERN)]]


_NEMOTRON_MIXERS = _PRE_NORM + only(MAMBA2, _nem("M")) + only(ATTN[1:], _nem("A"))
NEMOTRON_H = _NEMOTRON_MIXERS + only((
    lt(T.FFN_UP, lambda d: (d["F"], d["E"])),
    lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
), _nem("F"))
NEMOTRON_H_MOE = _NEMOTRON_MIXERS + only((
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias"),
    lt(T.FFN_UP_EXP, lambda d: (d["X"], d["G"], d["E"])),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["G"])),
    lt(T.FFN_UP_SHEXP, lambda d: (d["G"], d["E"])),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"])),
), _nem("F"))


# granitehybrid (granite 4.0 H): mamba2 mixers with attention (RoPE) every 4th layer like jamba, then
# on every layer a softmax-routed MoE FFN with a shared expert; granite's embedding, residual,
# attention and logit scales
def _granite_hybrid_kv(d: dict) -> dict:
    return {**_ssm_kv(d), **moe_kv(d), KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"],
            KA.HEAD_COUNT_KV: [d["K"] if _jamba_attn(il, d) else 0 for il in range(d["n_layer"])],
            KL.EMBEDDING_SCALE: 12.0, KL.RESIDUAL_SCALE: 0.22, KL.LOGIT_SCALE: 8.0, KA.SCALE: 0.0078125}


GRANITE_HYBRID = (
    _PRE_NORM + only(MAMBA2, _jamba_recr) + only(ATTN[1:], _jamba_attn)
    + FFN[:1] + _JAMBA_MOE + (
        lt(T.FFN_GATE_SHEXP, lambda d: (d["G"], d["E"])),
        lt(T.FFN_UP_SHEXP, lambda d: (d["G"], d["E"])),
        lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"])),
    )
)


# lfm2: gated short-convolution blocks (conv state of l_cache - 1 steps) with attention blocks (RoPE,
# QK norm) between them, a SwiGLU FFN on every block; its final norm is named token_embd_norm (an
# output tensor despite the name). lfm2moe: the same graph, a dense lead, then sigmoid-routed MoE.
# Pattern after LFM2-1.2B (attention at 2, 5, 8, 10, ...): C conv, A attention.
_LFM2_PATTERN = "CCACCACA"


def _lfm2_attn(il: int, d: dict) -> bool:
    return _LFM2_PATTERN[il % len(_LFM2_PATTERN)] == "A"


def _lfm2_conv(il: int, d: dict) -> bool:
    return not _lfm2_attn(il, d)


def _lfm2_kv(d: dict) -> dict:
    return {gguf.Keys.ShortConv.L_CACHE: 3,  # the conv kernel: a state of l_cache - 1 steps
            KA.HEAD_COUNT_KV: [d["K"] if _lfm2_attn(il, d) else 0 for il in range(d["n_layer"])]}


def _lfm2_dense(il: int, d: dict) -> bool:
    return il < d["L"]


def _lfm2_moe(il: int, d: dict) -> bool:
    return il >= d["L"]


def _lfm2moe_kv(d: dict) -> dict:
    # gating func 2 = sigmoid (routing bias exp_probs_b)
    return {**_lfm2_kv(d), **moe_kv(d), KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_GATING_FUNC: 2}


_LFM2_MIXERS = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    *only(ATTN[1:] + (lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM), lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM)),
          _lfm2_attn),
    *only((
        lt(T.SHORTCONV_CONV, lambda d: (d["E"], 3), F32),
        lt(T.SHORTCONV_INPROJ, lambda d: (3 * d["E"], d["E"])),
        lt(T.SHORTCONV_OUTPROJ, lambda d: (d["E"], d["E"])),
    ), _lfm2_conv),
)
LFM2 = _LFM2_MIXERS + FFN
LFM2MOE = _LFM2_MIXERS + FFN[:1] + only(FFN[1:], _lfm2_dense) + only(MOE[1:] + (
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias"),), _lfm2_moe)
_LFM2_FINAL_NORM = (lt(T.TOKEN_EMBD_NORM, lambda d: (d["E"],), NORM),)


def _lfm2_kind(moe: bool):
    def kind(il: int, d: dict) -> str:
        mixer = "attn" if _lfm2_attn(il, d) else "conv"
        return mixer if not moe else f"{mixer}-{'dense' if _lfm2_dense(il, d) else 'moe'}"
    return kind


# plamo2: mamba mixers (one group-less B/C, dt/B/C RMS-normed, a scalar A and D per head) alternating
# with attention (fused QKV, per-head QK norm, RoPE) as PLaMo-2's mamba_step 2 does (attention on odd
# layers); every block sandwiches mixer and SwiGLU FFN between pre and post norms (bare names)
def _plamo2_attn(il: int, d: dict) -> bool:
    return il % 2 == 1


def _plamo2_recr(il: int, d: dict) -> bool:
    return not _plamo2_attn(il, d)


def _plamo2_dims(d: dict) -> dict:
    d = _mamba2_dims(d)
    return {**d, "ng": 0, "dt_dim": max(64, d["E"] // 16)}


def _plamo2_kv(d: dict) -> dict:
    return {**_ssm_kv(d), KA.HEAD_COUNT_KV: [d["K"] if _plamo2_attn(il, d) else 0 for il in range(d["n_layer"])]}


PLAMO2 = (
    _PRE_NORM
    + only((
        lt(T.SSM_IN, lambda d: (2 * d["di"], d["E"])),
        lt(T.SSM_CONV1D, lambda d: (d["di"], d["dc"]), F32),
        lt(T.SSM_X, lambda d: (d["dt_dim"] + 2 * d["ds"], d["di"])),
        lt(T.SSM_DT, lambda d: (d["dr"], d["dt_dim"])),
        lt(T.SSM_DT, lambda d: (d["dr"],), F32, "bias", init=_dt_bias),
        lt(T.SSM_A, lambda d: (d["dr"],), F32, "", init=_a_neg),
        lt(T.SSM_D, lambda d: (d["dr"],), F32, "", init=_ones),
        lt(T.SSM_OUT, lambda d: (d["E"], d["di"])),
        lt(T.SSM_DT_NORM, lambda d: (d["dt_dim"],), NORM, ""),
        lt(T.SSM_B_NORM, lambda d: (d["ds"],), NORM, ""),
        lt(T.SSM_C_NORM, lambda d: (d["ds"],), NORM, ""),
    ), _plamo2_recr)
    + only((
        lt(T.ATTN_QKV, lambda d: ((d["H"] + 2 * d["K"]) * d["D"], d["E"])),
        lt(T.ATTN_Q_NORM, lambda d: (d["H"], d["D"]), NORM),
        lt(T.ATTN_K_NORM, lambda d: (d["K"], d["D"]), NORM),
        lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
    ), _plamo2_attn)
    + (
        lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM, ""),
        lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
        lt(T.FFN_DOWN, lambda d: (d["E"], d["F"])),
        lt(T.FFN_UP, lambda d: (2 * d["F"], d["E"])),
        lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM, ""),
    )
)


def _attn_or_recr(is_attn):
    return lambda il, d: "attn" if is_attn(il, d) else "recurrent"


SPECS: dict[str, ArchSpec] = {
    "mamba": ArchSpec(layer=_PRE_NORM + MAMBA, dims=_ssm_dims, extra_kv=_ssm_kv,
                      kind=lambda il, d: "recurrent", features=("recurrent", "conv", "selective-scan")),
    "mamba2": ArchSpec(layer=_PRE_NORM + MAMBA2, dims=_mamba2_dims, extra_kv=_ssm_kv,
                       kind=lambda il, d: "recurrent", features=("recurrent", "conv", "ssd", "group-norm")),
    "jamba": ArchSpec(layer=JAMBA, dims=_ssm_dims, extra_kv=_jamba_kv, kind=_attn_or_recr(_jamba_attn),
                      parity_layers=8, features=("hybrid", "recurrent", "conv", "selective-scan", "moe", "no-rope")),
    "falcon-h1": ArchSpec(layer=FALCON_H1, dims=_mamba2_dims, extra_kv=_ssm_kv, kind=lambda il, d: "attn+recurrent",
                          features=("hybrid", "parallel-attn-ssm", "recurrent", "conv", "ssd", "group-norm")),
    "nemotron_h": ArchSpec(layer=NEMOTRON_H, dims=_mamba2_dims, extra_kv=_nemotron_kv, kind=_nemotron_kind(False),
                           parity_layers=8, features=("hybrid", "recurrent", "conv", "ssd", "group-norm", "no-rope",
                                                      "relu2")),
    "nemotron_h_moe": ArchSpec(layer=NEMOTRON_H_MOE, dims=_mamba2_dims, extra_kv=_nemotron_moe_kv,
                               kind=_nemotron_kind(True), parity_layers=8,
                               features=("hybrid", "recurrent", "conv", "ssd", "group-norm", "no-rope", "moe",
                                         "shared-expert", "relu2")),
    "granitehybrid": ArchSpec(layer=GRANITE_HYBRID, dims=_mamba2_dims, extra_kv=_granite_hybrid_kv,
                              kind=_attn_or_recr(_jamba_attn), parity_layers=8,
                              features=("hybrid", "recurrent", "conv", "ssd", "group-norm", "moe", "shared-expert",
                                        "embd-scale", "residual-scale", "logit-scale")),
    "lfm2": ArchSpec(layer=LFM2, extra_kv=_lfm2_kv, globals=_LFM2_FINAL_NORM, output_norm=False,
                     kind=_lfm2_kind(False), parity_layers=8,
                     features=("hybrid", "short-conv", "recurrent", "qk-norm")),
    "lfm2moe": ArchSpec(layer=LFM2MOE, extra_kv=_lfm2moe_kv, globals=_LFM2_FINAL_NORM, output_norm=False,
                        dims=lambda d: {**d, "L": 2}, kind=_lfm2_kind(True), parity_layers=8,
                        features=("hybrid", "short-conv", "recurrent", "qk-norm", "dense-lead", "moe")),
    "plamo2": ArchSpec(layer=PLAMO2, dims=_plamo2_dims, extra_kv=_plamo2_kv, kind=_attn_or_recr(_plamo2_attn),
                       features=("hybrid", "recurrent", "conv", "selective-scan", "qk-norm", "fused-qkv",
                                 "sandwich-norm")),
}
