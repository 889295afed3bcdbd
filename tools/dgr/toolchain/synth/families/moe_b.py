"""Synthetic specs of the moe_b family group (see dgr.toolchain.synth.families): DeepSeek-style MLA and other MoE decoders.

Dims beyond dgr.toolchain.synth.spec's (set by dgr.toolchain.synth.generic.layer_dims): Q q lora rank, C kv lora rank, R rope head
dim, N no-rope head dim, V value head dim, S shared experts, L dense lead. MLA_ATTN is dgr.toolchain.synth.spec's
(deepseek2's row in dgr.toolchain.synth.generic uses the same).
"""

from __future__ import annotations

import numpy as np

from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, KR, MLA_ATTN, MOE, NORM, QK_NORM, ArchSpec, T,
                                      after_lead as _moe, dense_lead as _dense, dense_moe_kind as _dense_moe_kind, lt,
                                      moe_kv, only, swa_kind)

# shared experts of width G * S (deepseek's n_ff_exp * n_expert_shared), MoE layers only
SHEXP_S = (
    lt(T.FFN_GATE_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=_moe),
    lt(T.FFN_UP_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=_moe),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"] * d["S"]), when=_moe),
)
# ffn_norm everywhere, a dense FFN in the lead layers, routed + shared experts after
DENSE_LEAD_MOE = FFN[:1] + only(FFN[1:], _dense) + only(MOE[1:], _moe) + SHEXP_S
DS2_FFN = DENSE_LEAD_MOE + (lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _moe),)


def _mla_kv(d: dict) -> dict:
    # one KV head of width C + R, value width C (absorbed MLA); the real head sizes are the *_mla keys
    return {
        KA.HEAD_COUNT_KV: 1, KA.KEY_LENGTH: d["C"] + d["R"], KA.VALUE_LENGTH: d["C"],
        KA.KEY_LENGTH_MLA: d["N"] + d["R"], KA.VALUE_LENGTH_MLA: d["V"],
        KA.Q_LORA_RANK: d["Q"], KA.KV_LORA_RANK: d["C"], KR.DIMENSION_COUNT: d["R"],
    }


def _deepseek2_like_kv(d: dict) -> dict:
    # gating func 2 = sigmoid, which uses exp_probs_b as the routing bias
    return {
        **_mla_kv(d), KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"],
        KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_SCALE: 1.5, KL.EXPERT_WEIGHTS_NORM: True, **moe_kv(d),
    }


def _deepseek_kv(d: dict) -> dict:
    # deepseek (v1): plain GQA attention, softmax routing, a dense lead and shared experts
    return {KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"], KL.EXPERT_WEIGHTS_SCALE: 1.0,
            **moe_kv(d)}


# MLA with an explicit kv_b (not absorbed) at head dim D: rope on the last R dims, D - R without rope
def _mla_kvb(d: dict) -> tuple[int, int]:
    return (d["H"] * (d["D"] - d["R"] + d["D"]), d["C"])


def _minicpm3_kv(d: dict) -> dict:
    # the decompressed keys and values are per head (MHA): as many KV heads as heads
    return {KA.HEAD_COUNT_KV: d["H"], KA.Q_LORA_RANK: d["Q"], KA.KV_LORA_RANK: d["C"], KR.DIMENSION_COUNT: d["R"]}


def _rope_factors(shape, rng, d):
    # longrope-style per-dimension frequency factors near 1 (they change the rope, so they matter)
    return 1.0 + rng.random(shape, dtype=np.float32)


_MINICPM3_ATTN = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q_A_NORM, lambda d: (d["Q"],), NORM),
    lt(T.ATTN_KV_A_NORM, lambda d: (d["C"],), NORM),
    lt(T.ATTN_Q_A, lambda d: (d["Q"], d["E"])),
    lt(T.ATTN_Q_B, lambda d: (d["H"] * d["D"], d["Q"])),
    lt(T.ATTN_KV_A_MQA, lambda d: (d["C"] + d["R"], d["E"])),
    lt(T.ATTN_KV_B, _mla_kvb),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
)
# routed experts of width F (the models whose expert FFN is feed_forward_length)
_MOE_F = (
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"])),
    lt(T.FFN_GATE_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_UP_EXP, lambda d: (d["X"], d["F"], d["E"])),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["F"])),
)
_DBRX = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_QKV, lambda d: (d["H"] * d["D"] + 2 * d["K"] * d["D"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["D"])),
    lt(T.ATTN_OUT_NORM, lambda d: (d["E"],), NORM),
) + _MOE_F
# arctic: a dense residual FFN (E x E) and, in parallel off the attention input, the routed experts
_ARCTIC = ATTN + (
    lt(T.FFN_NORM, lambda d: (d["E"],), NORM),
    lt(T.FFN_GATE, lambda d: (d["E"], d["E"])),
    lt(T.FFN_UP, lambda d: (d["E"], d["E"])),
    lt(T.FFN_DOWN, lambda d: (d["E"], d["E"])),
    lt(T.FFN_NORM_EXP, lambda d: (d["E"],), NORM),
) + _MOE_F
# grok: post-attention norm, an optional dense FFN summed with the experts (grok-2; written here so the
# split covers it), a post-FFN norm
_GROK = ATTN + (lt(T.ATTN_OUT_NORM, lambda d: (d["E"],), NORM),) + FFN + MOE[1:] + (
    lt(T.LAYER_OUT_NORM, lambda d: (d["E"],), NORM),
)


def _grok_kv(d: dict) -> dict:
    # grok's graph uses kq scale 1 and soft-caps attention and router logits (its defaults: 30)
    return {**moe_kv(d), "{arch}.attention.output_scale": 0.25, "{arch}.logit_scale": 0.5,
            "{arch}.embedding_scale": 2.0}



def _swa_pattern3(d: dict) -> dict:
    # every third layer full attention (which ones depends on the arch's dense_first); for smallthinker
    # (dense first: 0 and 3 full) llama.cpp's default no-rope step 4 also leaves layers 0 and 4 without rope
    return {**d, "swa_pattern": 3}


def _smallthinker_kv(d: dict) -> dict:
    # llama.cpp forces the window to 4096 (so at this context SWA and full attention see the same keys,
    # but the layers still differ: full layers have their own KV cache and rope base)
    return {**moe_kv(d), KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"],
            KR.FREQ_BASE_SWA: 5000.0, KL.EXPERT_GATING_FUNC: 2}



# cohere2moe: parallel attention and FFN off one norm (no ffn_norm), a dense lead, fused gate_up experts,
# a shared expert of its own width (expert_shared_feed_forward_length = 2 G here)
_COHERE2MOE = ATTN + only(FFN[1:], _dense) + (
    lt(T.FFN_GATE_INP, lambda d: (d["X"], d["E"]), when=_moe),
    lt(T.FFN_GATE_UP_EXP, lambda d: (d["X"], 2 * d["G"], d["E"]), when=_moe),
    lt(T.FFN_DOWN_EXP, lambda d: (d["X"], d["E"], d["G"]), when=_moe),
    lt(T.FFN_GATE_SHEXP, lambda d: (2 * d["G"], d["E"]), when=_moe),
    lt(T.FFN_UP_SHEXP, lambda d: (2 * d["G"], d["E"]), when=_moe),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], 2 * d["G"]), when=_moe),
)


def _cohere2moe_kv(d: dict) -> dict:
    return {**moe_kv(d), KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"],
            KL.LOGIT_SCALE: 0.5, KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: 1,
            KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: 2 * d["G"], KL.EXPERT_WEIGHTS_NORM: True,
            KR.FREQ_BASE_SWA: 5000.0}


def _cohere2moe_kind(il: int, d: dict) -> str:
    # dense first: layer il is full attention when il % pattern == 0 (no rope past the dense lead)
    return ("dense-" if _dense(il, d) else "moe-") + ("full" if il % d["swa_pattern"] == 0 else "swa")



# exaone-moe: qk-norm, rope only on the sliding layers (pattern as gemma's: every 3rd layer full), a dense
# lead, sigmoid routing with a bias, shared expert; the optional per-dimension rope_freqs (shared)
_EXAONE_MOE = ATTN + QK_NORM + DS2_FFN


def _exaone_moe_kv(d: dict) -> dict:
    return {**moe_kv(d), KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"],
            KR.FREQ_BASE_SWA: 5000.0, KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: 1,
            KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 2.0}


def _exaone_moe_kind(il: int, d: dict) -> str:
    return ("dense-" if _dense(il, d) else "moe-") + swa_kind(il, d)



# afmoe: gated attention (sigmoid gate before wo), qk-norm, pre and post norms, NoPE every 4th layer (the
# full-attention one at pattern 4), a dense lead, sigmoid routing with a bias, a shared expert
_AFMOE = ATTN + QK_NORM + (
    lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_GATE, lambda d: (d["H"] * d["D"], d["E"])),
    lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM),
) + DS2_FFN


def _afmoe_kv(d: dict) -> dict:
    return {**moe_kv(d), KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: d["swa_pattern"],
            KR.FREQ_BASE_SWA: 5000.0, KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"],
            KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 2.0}



# step35: per-layer head counts (the sliding layers have HS = H + 2 heads, the full ones H), a head-wise
# sigmoid attention gate, qk-norm, half the rope dims on full layers (with rope_freqs), the SWA layout
# as an explicit per-layer array, a dense first layer, sigmoid routing with a bias, an always-on shared
# expert, per-layer swiglu clamps
def _st35_swa(il: int, d: dict) -> bool:
    return il % 3 != 0


def _st35_full(il: int, d: dict) -> bool:
    return not _st35_swa(il, d)


def _st35_attn(heads: str, when) -> tuple:
    return (
        lt(T.ATTN_Q, lambda d: (d[heads] * d["D"], d["E"]), when=when),
        lt(T.ATTN_OUT, lambda d: (d["E"], d[heads] * d["D"]), when=when),
        lt(T.ATTN_GATE, lambda d: (d[heads], d["E"]), when=when),
    )


_STEP35 = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_K, lambda d: (d["K"] * d["D"], d["E"])),
    lt(T.ATTN_V, lambda d: (d["K"] * d["D"], d["E"])),
) + _st35_attn("HS", _st35_swa) + _st35_attn("H", _st35_full) + QK_NORM + DENSE_LEAD_MOE + (
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _moe),
)


def _step35_kv(d: dict) -> dict:
    n = d["n_layer"]
    return {
        **moe_kv(d), KA.HEAD_COUNT: [d["HS"] if _st35_swa(il, d) else d["H"] for il in range(n)],
        KA.HEAD_COUNT_KV: [d["K"]] * n, KA.SLIDING_WINDOW: d["swa"],
        KA.SLIDING_WINDOW_PATTERN: [_st35_swa(il, d) for il in range(n)], KR.FREQ_BASE_SWA: 5000.0,
        KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"], KL.EXPERT_GATING_FUNC: 2, KL.EXPERT_WEIGHTS_NORM: True,
        KL.EXPERT_WEIGHTS_SCALE: 2.0, "{arch}.swiglu_clamp_exp": [7.0] * n, "{arch}.swiglu_clamp_shexp": [7.0] * n,
    }


# deepseek32: deepseek2's MLA + MoE plus a lightning indexer in every layer (its keys live in the DSA
# cache's second llama_kv_cache, a copy of the model's hparams, range included, so patch 0003 already
# limits it to the owned layers). Dims: IN indexer heads, IH indexer head size (a multiple of 64: the
# keys get a Hadamard rotation of at least 64x64); top_k 8, below the prompt length, so the sparse
# selection matters
_DS32_INDEXER = (
    lt(T.INDEXER_K_NORM, lambda d: (d["IH"],), NORM),
    lt(T.INDEXER_K_NORM, lambda d: (d["IH"],), BIAS, "bias"),
    lt(T.INDEXER_PROJ, lambda d: (d["IN"], d["E"])),
    lt(T.INDEXER_ATTN_K, lambda d: (d["IH"], d["E"])),
    lt(T.INDEXER_ATTN_Q_B, lambda d: (d["IN"] * d["IH"], d["Q"])),
)


def _deepseek32_kv(d: dict) -> dict:
    return {**_deepseek2_like_kv(d), "{arch}.attention.indexer.head_count": d["IN"],
            "{arch}.attention.indexer.key_length": d["IH"], "{arch}.attention.indexer.top_k": 8}



# mimo2: per-layer KV heads (sliding layers KS = 2, full ones 1), value head VD narrower than the key
# head, attention sinks, a value scale, the SWA layout as an explicit array, a dense first layer then
# sigmoid-routed experts with a bias
def _mimo2_swa(il: int, d: dict) -> bool:
    return il % 3 != 2


def _mimo2_kv_heads(il: int, d: dict) -> int:
    return 2 if _mimo2_swa(il, d) else 1


def _mimo2_kvt(kv: int) -> tuple:
    when = (lambda il, d: _mimo2_kv_heads(il, d) == kv)
    return (
        lt(T.ATTN_K, lambda d: (kv * d["D"], d["E"]), when=when),
        lt(T.ATTN_V, lambda d: (kv * d["VD"], d["E"]), when=when),
    )


_MIMO2 = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q, lambda d: (d["H"] * d["D"], d["E"])),
    lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d["VD"])),
    lt(T.ATTN_SINKS, lambda d: (d["H"],), F32),
) + _mimo2_kvt(1) + _mimo2_kvt(2) + FFN[:1] + only(FFN[1:], _dense) + only(MOE[1:], _moe) + (
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _moe),
)


def _mimo2_kv(d: dict) -> dict:
    n = d["n_layer"]
    return {
        **moe_kv(d), KA.HEAD_COUNT_KV: [_mimo2_kv_heads(il, d) for il in range(n)], KA.VALUE_LENGTH: d["VD"],
        KA.SLIDING_WINDOW: d["swa"], KA.SLIDING_WINDOW_PATTERN: [_mimo2_swa(il, d) for il in range(n)],
        KR.FREQ_BASE_SWA: 5000.0, "{arch}.attention.value_scale": 0.5,
    }



# glm-dsa: deepseek32's layout, but only the layers marked full in attention.indexer.types run the
# indexer; a shared layer reuses the top-k of the full one before it. That top-k does not cross a seam,
# so a stage must begin at a full-indexer layer (the model file refuses others): the kinds below name
# the full layer whose top-k a layer uses, so every cut falls on a full layer
_GLM_DSA_FULL = (1, 1, 0, 1, 1, 0)


def _glm_dsa_full(il: int, d: dict) -> bool:
    return bool(_GLM_DSA_FULL[il % len(_GLM_DSA_FULL)])


def _glm_dsa_kind(il: int, d: dict) -> str:
    src = max(j for j in range(il + 1) if _glm_dsa_full(j, d))
    return ("dense" if _dense(il, d) else "moe") + f"-topk{src}"


def _glm_dsa_kv(d: dict) -> dict:
    return {**_deepseek32_kv(d),
            "{arch}.attention.indexer.types": [int(_glm_dsa_full(il, d)) for il in range(d["n_layer"])]}



# dots3note: absorbed MLA in every layer, with narrower latent/heads on the sliding layers (CS, NS, VS),
# the DSA indexer on the full layers only, a norm on the shared rope key, a head-wise sigmoid output gate,
# a dense lead, sigmoid routing with a bias, shared experts
def _dots3_swa(il: int, d: dict) -> bool:
    return il % 3 != 2


def _dots3_full(il: int, d: dict) -> bool:
    return not _dots3_swa(il, d)


def _dots3_mla(c: str, n: str, v: str, when) -> tuple:
    return (
        lt(T.ATTN_KV_A_NORM, lambda d: (d[c],), NORM, when=when),
        lt(T.ATTN_Q_B, lambda d: (d["H"] * (d[n] + d["R"]), d["Q"]), when=when),
        lt(T.ATTN_KV_A_MQA, lambda d: (d[c] + d["R"], d["E"]), when=when),
        lt(T.ATTN_K_B, lambda d: (d["H"], d[c], d[n]), when=when),
        lt(T.ATTN_V_B, lambda d: (d["H"], d[v], d[c]), when=when),
        lt(T.ATTN_OUT, lambda d: (d["E"], d["H"] * d[v]), when=when),
    )


_DOTS3 = (
    lt(T.ATTN_NORM, lambda d: (d["E"],), NORM),
    lt(T.ATTN_Q_A_NORM, lambda d: (d["Q"],), NORM),
    lt(T.ATTN_K_NORM, lambda d: (d["R"],), NORM),
    lt(T.ATTN_Q_A, lambda d: (d["Q"], d["E"])),
    lt(T.ATTN_GATE, lambda d: (d["H"], d["E"])),
) + _dots3_mla("C", "N", "V", _dots3_full) + _dots3_mla("CS", "NS", "VS", _dots3_swa) + only(
    _DS32_INDEXER, _dots3_full) + DS2_FFN


def _dots3_kv(d: dict) -> dict:
    n = d["n_layer"]
    return {
        **_deepseek32_kv(d), KA.KEY_LENGTH_SWA: d["CS"] + d["R"], KA.VALUE_LENGTH_SWA: d["CS"],
        "{arch}.attention.kv_lora_rank_swa": d["CS"], "{arch}.attention.key_length_mla_swa": d["NS"] + d["R"],
        "{arch}.attention.value_length_mla_swa": d["VS"], KA.SLIDING_WINDOW: d["swa"],
        KA.SLIDING_WINDOW_PATTERN: [_dots3_swa(il, d) for il in range(n)], KR.FREQ_BASE_SWA: 5000.0,
        "{arch}.attention.indexer.types": [int(_dots3_full(il, d)) for il in range(n)],
    }


SPECS: dict[str, ArchSpec] = {
    "deepseek": ArchSpec(layer=ATTN + DENSE_LEAD_MOE, extra_kv=_deepseek_kv, kind=_dense_moe_kind,
                         features=("dense-lead", "moe", "shared-expert")),
    # mistral4 reuses deepseek2's hparams, tensors and graph (patch 0014's hook covers it)
    "mistral4": ArchSpec(layer=MLA_ATTN + DS2_FFN, extra_kv=_deepseek2_like_kv, kind=_dense_moe_kind,
                         features=("mla", "dense-lead", "moe", "shared-expert")),
    # minicpm3: MLA (q lora + kv_b), dense, embedding scale (first stage only), longrope factors (shared
    # tensors every stage needs; a short context selects rope_factors_short)
    "minicpm3": ArchSpec(layer=_MINICPM3_ATTN + FFN, extra_kv=_minicpm3_kv,
                         globals=(lt(T.ROPE_FACTORS_LONG, lambda d: (d["R"] // 2,), F32, init=_rope_factors),
                                  lt(T.ROPE_FACTORS_SHORT, lambda d: (d["R"] // 2,), F32, init=_rope_factors)),
                         features=("mla", "dense", "embd-scale", "rope-factors")),
    # dbrx: layernorm (no bias), fused qkv clamped, experts of width n_ff
    "dbrx": ArchSpec(layer=_DBRX, extra_kv=lambda d: {KA.LAYERNORM_EPS: 1e-5, KA.CLAMP_KQV: 8.0, **moe_kv(d)},
                     features=("moe", "layernorm", "fused-qkv", "clamp-kqv")),
    "arctic": ArchSpec(layer=_ARCTIC, extra_kv=moe_kv, features=("moe", "dense-residual-ffn")),
    # grok: embedding scale (build_inp_embd: first stage only), attention/router soft-capping, logit scale
    "grok": ArchSpec(layer=_GROK, extra_kv=_grok_kv,
                     features=("moe", "dense-plus-moe", "embd-scale", "softcap", "post-norm")),
    # smallthinker: the router reads the layer input before the norm; relu experts; iswa (dense first)
    "smallthinker": ArchSpec(layer=ATTN + MOE, extra_kv=_smallthinker_kv, dims=_swa_pattern3,
                             kind=lambda il, d: "full" if il % d["swa_pattern"] == 0 else "swa",
                             features=("moe", "swa", "nope", "router-pre-norm")),
    "cohere2moe": ArchSpec(layer=_COHERE2MOE, extra_kv=_cohere2moe_kv, dims=_swa_pattern3,
                           kind=_cohere2moe_kind,
                           features=("moe", "swa", "parallel-attn-ffn", "dense-lead", "shared-expert", "nope",
                                     "fused-gate-up")),
    "exaone-moe": ArchSpec(layer=_EXAONE_MOE, extra_kv=_exaone_moe_kv, dims=_swa_pattern3,
                           kind=_exaone_moe_kind,
                           globals=(lt(T.ROPE_FREQS, lambda d: (d["D"] // 2,), F32, init=_rope_factors),),
                           features=("moe", "swa", "qk-norm", "nope", "dense-lead", "shared-expert",
                                     "rope-factors")),
    "afmoe": ArchSpec(layer=_AFMOE, extra_kv=_afmoe_kv, dims=lambda d: {**d, "swa_pattern": 4},
                      kind=_exaone_moe_kind,
                      features=("moe", "swa", "qk-norm", "gated-attn", "nope", "embd-scale", "dense-lead",
                                "shared-expert", "post-norm")),
    "step35": ArchSpec(layer=_STEP35, extra_kv=_step35_kv, dims=lambda d: {**d, "HS": d["H"] + 2},
                       kind=lambda il, d: ("dense-" if _dense(il, d) else "moe-")
                       + ("swa" if _st35_swa(il, d) else "full"),
                       globals=(lt(T.ROPE_FREQS, lambda d: (d["D"] // 2,), F32, init=_rope_factors),),
                       features=("moe", "swa", "per-layer-heads", "gated-attn", "qk-norm", "partial-rope",
                                 "dense-lead", "shared-expert", "rope-factors")),
    "deepseek32": ArchSpec(layer=MLA_ATTN + _DS32_INDEXER + DS2_FFN, extra_kv=_deepseek32_kv,
                           dims=lambda d: {**d, "IN": 2, "IH": 64}, kind=_dense_moe_kind,
                           features=("mla", "sparse-attn", "indexer", "dense-lead", "moe", "shared-expert")),
    "mimo2": ArchSpec(layer=_MIMO2, extra_kv=_mimo2_kv, dims=lambda d: {**d, "VD": d["D"] // 2},
                      kind=lambda il, d: ("dense-" if _dense(il, d) else "moe-")
                      + ("swa" if _mimo2_swa(il, d) else "full"),
                      features=("moe", "swa", "per-layer-kv-heads", "attn-sinks", "value-scale", "dense-lead")),
    "glm-dsa": ArchSpec(layer=MLA_ATTN + only(_DS32_INDEXER, _glm_dsa_full) + DS2_FFN, extra_kv=_glm_dsa_kv,
                        dims=lambda d: {**d, "IN": 2, "IH": 64}, kind=_glm_dsa_kind,
                        features=("mla", "sparse-attn", "indexer", "shared-indexer", "dense-lead", "moe",
                                  "shared-expert")),
    "dots3note": ArchSpec(layer=_DOTS3, extra_kv=_dots3_kv,
                          dims=lambda d: {**d, "IN": 2, "IH": 64, "CS": d["C"] // 2, "NS": d["N"] // 2,
                                          "VS": d["V"] // 2},
                          kind=lambda il, d: ("dense-" if _dense(il, d) else "moe-")
                          + ("swa" if _dots3_swa(il, d) else "full"),
                          features=("mla", "swa", "sparse-attn", "indexer", "gated-attn", "dense-lead", "moe",
                                    "shared-expert")),
    # plm is not here: the pinned llama.cpp's plm graph aborts on a whole model (it flattens v_states
    # to 2-D before build_attn, whose cpy_v reads ne[1] as the head count)
}
