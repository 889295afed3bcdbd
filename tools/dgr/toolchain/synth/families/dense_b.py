"""Synthetic specs of the dense_b family group (see dgr.toolchain.synth.families).

Decoders that differ from llama in their norms or block shape: LayerNorm with biases (phi2, stablelm,
starcoder2, falcon, bloom), non-parametric LayerNorm (olmo), post-norms (olmo2, exaone4, plamo3),
parallel attention/FFN blocks (phi2, command-r, cohere2, falcon), fused projections (phi3, qwen, falcon,
bloom, mpt, plamo3), ALiBi instead of rope (refact, bloom, mpt), per-input steps that only the first
stage runs (bloom's embedding norm, mpt's position embedding) and sliding-window/global layer mixes
(cohere2, olmo2 as Olmo 3 writes it, exaone4 32B, plamo3, laguna, which is also a dense-lead MoE).
Each spec writes exactly the tensors and keys the arch's load_arch_hparams/load_arch_tensors in the
pinned llama.cpp read (src/models/<arch>.cpp).
"""

from __future__ import annotations

import numpy as np

from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, KR, MOE, NORM, OUTPUT_NORM_BIAS, QKV_BIAS,
                                      SHARED_EXPERT, ArchSpec, T, after_lead as _moe, dense_lead as _dense_lead, lt,
                                      moe_kv, only, swa_kind, swa_kv)

# Pieces of the common groups (dgr.toolchain.synth.spec.ATTN = norm, q, k, v, out; FFN = norm, gate, up, down).
_ATTN_NORM, _Q, _K, _V, _OUT = ATTN
_FFN_NORM, _GATE, _UP, _DOWN = FFN
_QKV = (_Q, _K, _V)

# LayerNorm (LLM_NORM) archs read the plain layer_norm_epsilon key, not the RMS one.
_LN_EPS = {KA.LAYERNORM_EPS: 1e-5}

_ATTN_NORM_B = lt(T.ATTN_NORM, lambda d: (d["E"],), BIAS, "bias")
_FFN_NORM_B = lt(T.FFN_NORM, lambda d: (d["E"],), BIAS, "bias")
_OUT_B = lt(T.ATTN_OUT, lambda d: (d["E"],), BIAS, "bias")
_UP_B = lt(T.FFN_UP, lambda d: (d["F"],), BIAS, "bias")
_DOWN_B = lt(T.FFN_DOWN, lambda d: (d["E"],), BIAS, "bias")
_ATTN_POST_NORM = lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM)
_FFN_POST_NORM = lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM)


def _fused_qkv(d: dict) -> tuple[int, int]:
    return (d["H"] * d["D"] + 2 * d["K"] * d["D"], d["E"])


def _rope_factors(shape: tuple[int, ...], rng, d: dict) -> np.ndarray:
    # divisors of the rope frequencies (llama3-style scaling): 1 for the fast dims up to 4 for the slow
    return np.linspace(1.0, 4.0, shape[0], dtype=np.float32)





def _laguna_kind(il: int, d: dict) -> str:
    # dense lead or MoE, and the global layer every swa_pattern-th from layer 0 (dense_first pattern)
    return f"{'dense' if _dense_lead(il, d) else 'moe'}-{'full' if il % d['swa_pattern'] == 0 else 'swa'}"


def _swa4(d: dict) -> dict:
    # the pattern these archs ship with (load_swa_pattern(ml, 4)): three sliding layers, then a global one
    return {**d, "swa_pattern": 4}


SPECS: dict[str, ArchSpec] = {
    # phi2: one LayerNorm (with bias) feeds attention and a GELU MLP in parallel; biases everywhere,
    # a biased head, partial rotary (half the head). Separate q/k/v: a fused attn_qkv WITH a fused bias
    # does not load as a stage yet (create_tensor_qkv skips a non-owned layer's qkv bias uncounted)
    "phi2": ArchSpec(
        layer=(_ATTN_NORM, _ATTN_NORM_B, *_QKV, *QKV_BIAS, _OUT, _OUT_B, _UP, _UP_B, _DOWN, _DOWN_B),
        globals=(OUTPUT_NORM_BIAS, lt(T.OUTPUT, lambda d: (d["V"],), BIAS, "bias")),
        extra_kv=lambda d: {**_LN_EPS, KR.DIMENSION_COUNT: d["D"] // 2},
        features=("dense", "layernorm", "parallel-attn-ffn", "bias", "qkv-bias", "partial-rope"),
    ),
    # phi3: fused qkv and fused gate|up (SwiGLU over a 2*n_ff projection); the SWA key is ignored by
    # the pinned llama.cpp (disabled for Phi), so none is written. (general.name carries no arch: llama-vocab
    # gives a model whose name contains "phi3" the Phi-3 token attributes, which look up a "</s>" the
    # synthetic vocabulary lacks.)
    "phi3": ArchSpec(
        layer=(_ATTN_NORM, lt(T.ATTN_QKV, _fused_qkv), _OUT, _FFN_NORM,
               lt(T.FFN_UP, lambda d: (2 * d["F"], d["E"])), _DOWN),
        features=("dense", "fused-qkv", "fused-gate-up"),
    ),
    # stablelm (2-1.6B shape): LayerNorm with bias before attention and FFN, q/k/v biases
    "stablelm": ArchSpec(
        layer=(_ATTN_NORM, _ATTN_NORM_B, *_QKV, *QKV_BIAS, _OUT, _FFN_NORM, _FFN_NORM_B, _GATE, _UP, _DOWN),
        globals=(OUTPUT_NORM_BIAS,),
        extra_kv=lambda d: dict(_LN_EPS),
        features=("dense", "layernorm", "qkv-bias"),
    ),
    # starcoder2: LayerNorm with bias, biased q/k/v/out and GELU MLP, tied head
    "starcoder2": ArchSpec(
        layer=(_ATTN_NORM, _ATTN_NORM_B, *_QKV, *QKV_BIAS, _OUT, _OUT_B, _FFN_NORM, _FFN_NORM_B,
               _UP, _UP_B, _DOWN, _DOWN_B),
        globals=(OUTPUT_NORM_BIAS,),
        tied=True,
        extra_kv=lambda d: dict(_LN_EPS),
        features=("dense", "layernorm", "bias", "qkv-bias", "tied"),
    ),
    # command-r: one LayerNorm (no bias) feeds attention and FFN in parallel; the head is always the
    # token embedding, scaled by logit_scale
    "command-r": ArchSpec(
        layer=(_ATTN_NORM, *_QKV, _OUT, _GATE, _UP, _DOWN),
        tied=True,
        extra_kv=lambda d: {**_LN_EPS, KL.LOGIT_SCALE: 0.0625},
        features=("dense", "layernorm", "parallel-attn-ffn", "tied", "logit-scale"),
    ),
    # cohere2: command-r's parallel block over three sliding-window layers and one global layer
    # (rope only on the sliding ones)
    "cohere2": ArchSpec(
        layer=(_ATTN_NORM, *_QKV, _OUT, _GATE, _UP, _DOWN),
        tied=True,
        dims=_swa4,
        extra_kv=lambda d: {**_LN_EPS, **swa_kv(d), KL.LOGIT_SCALE: 0.0625},
        kind=swa_kind,
        parity_layers=8,
        features=("swa", "nope-global", "layernorm", "parallel-attn-ffn", "tied", "logit-scale"),
    ),
    # olmo: LayerNorm without weights (no norm tensors at all, not even output_norm)
    "olmo": ArchSpec(
        layer=(*_QKV, _OUT, _GATE, _UP, _DOWN),
        output_norm=False,
        extra_kv=lambda d: dict(_LN_EPS),
        features=("dense", "non-parametric-layernorm"),
    ),
    # olmo2 with a sliding window (how Olmo 3 is written): no pre-norms, RMS post-norms after
    # attention and FFN, q/k norms over the whole projection; sliding and global layers
    "olmo2": ArchSpec(
        layer=(*_QKV, _OUT,
               lt(T.ATTN_Q_NORM, lambda d: (d["H"] * d["D"],), NORM),
               lt(T.ATTN_K_NORM, lambda d: (d["K"] * d["D"],), NORM),
               _ATTN_POST_NORM, _GATE, _UP, _DOWN, _FFN_POST_NORM),
        dims=_swa4,
        extra_kv=swa_kv,
        kind=swa_kind,
        parity_layers=8,
        features=("swa", "post-norm", "qk-norm"),
    ),
    # exaone: llama-shaped (RMS pre-norms, SwiGLU) with the llama3-style rope frequency factors
    # (rope_freqs.weight, one table every stage reads: the splitter's shared class)
    "exaone": ArchSpec(
        layer=(*ATTN, *FFN),
        globals=(lt(T.ROPE_FREQS, lambda d: (d["D"] // 2,), F32, init=_rope_factors),),
        features=("dense", "rope-freqs"),
    ),
    # exaone4 (32B shape: the pinned llama.cpp turns sliding windows on only for 64 layers): post-norms,
    # per-head q/k norms, rope only on the sliding layers, three sliding then one global
    "exaone4": ArchSpec(
        layer=(*_QKV, _OUT,
               lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM), lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM),
               _ATTN_POST_NORM, _GATE, _UP, _DOWN, _FFN_POST_NORM),
        dims=_swa4,
        extra_kv=swa_kv,
        kind=swa_kind,
        parity_layers=64,
        features=("swa", "nope-global", "post-norm", "qk-norm"),
    ),
    # qwen (v1): fused qkv with bias, no GQA (the fused width is 3*n_embd), FFN width n_ff/2
    "qwen": ArchSpec(
        layer=(_ATTN_NORM, lt(T.ATTN_QKV, lambda d: (3 * d["E"], d["E"])),
               lt(T.ATTN_QKV, lambda d: (3 * d["E"],), BIAS, "bias"), _OUT, _FFN_NORM,
               lt(T.FFN_GATE, lambda d: (d["F"] // 2, d["E"])), lt(T.FFN_UP, lambda d: (d["F"] // 2, d["E"])),
               lt(T.FFN_DOWN, lambda d: (d["E"], d["F"] // 2))),
        dims=lambda d: {**d, "K": d["H"]},
        features=("dense", "fused-qkv", "qkv-bias"),
    ),
    # refact: ALiBi (no rope, no positions), llama-shaped otherwise
    "refact": ArchSpec(
        layer=(*ATTN, *FFN),
        features=("dense", "alibi"),
    ),
    # falcon (7B shape): one LayerNorm (with bias) feeds attention and a GELU MLP in parallel, fused qkv
    "falcon": ArchSpec(
        layer=(_ATTN_NORM, _ATTN_NORM_B, lt(T.ATTN_QKV, _fused_qkv), _OUT, _UP, _DOWN),
        globals=(OUTPUT_NORM_BIAS,),
        extra_kv=lambda d: dict(_LN_EPS),
        features=("dense", "layernorm", "parallel-attn-ffn", "fused-qkv"),
    ),
    # bloom: a LayerNorm on the token embedding (first stage only), ALiBi, fused qkv, biases, tied head
    "bloom": ArchSpec(
        layer=(_ATTN_NORM, _ATTN_NORM_B, lt(T.ATTN_QKV, _fused_qkv),
               lt(T.ATTN_QKV, lambda d: (_fused_qkv(d)[0],), BIAS, "bias"), _OUT, _OUT_B,
               _FFN_NORM, _FFN_NORM_B, _UP, _UP_B, _DOWN, _DOWN_B),
        globals=(lt(T.TOKEN_EMBD_NORM, lambda d: (d["E"],), NORM),
                 lt(T.TOKEN_EMBD_NORM, lambda d: (d["E"],), BIAS, "bias"), OUTPUT_NORM_BIAS),
        tied=True,
        extra_kv=lambda d: dict(_LN_EPS),
        features=("dense", "layernorm", "embd-norm", "alibi", "fused-qkv", "bias", "tied"),
    ),
    # mpt: ALiBi and fused qkv; the optional learned position embedding is written too, so the split
    # exercises mpt's first-stage-only position add (llama.cpp applies both when both are present)
    "mpt": ArchSpec(
        layer=(_ATTN_NORM, lt(T.ATTN_QKV, _fused_qkv), _OUT, _FFN_NORM, _UP, _DOWN),
        globals=(lt(T.POS_EMBD, lambda d: (d["ctx"], d["E"])),),
        tied=True,
        extra_kv=lambda d: {**_LN_EPS, KA.MAX_ALIBI_BIAS: 8.0},
        features=("dense", "layernorm", "alibi", "pos-embd", "fused-qkv", "tied"),
    ),
    # plamo3: fused qkv, per-head q/k norms, pre- and post-norms around attention and FFN, fused
    # gate|up, sliding and global layers with their own rope base
    "plamo3": ArchSpec(
        layer=(_ATTN_NORM, lt(T.ATTN_QKV, _fused_qkv),
               lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM), lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM),
               _OUT, lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM, ""), _FFN_NORM,
               lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM, ""),
               lt(T.FFN_UP, lambda d: (2 * d["F"], d["E"])), _DOWN),
        dims=_swa4,
        extra_kv=lambda d: {**swa_kv(d), KR.FREQ_BASE_SWA: 1000.0},
        kind=swa_kind,
        parity_layers=8,
        features=("swa", "swa-rope-base", "fused-qkv", "fused-gate-up", "qk-norm", "post-norm"),
    ),
    # laguna (XS.2 shape): a dense lead then sigmoid-routed MoE with a routing bias and a shared expert,
    # a softplus per-head attention output gate, q/k norms, a global layer every 4th from layer 0 and
    # sliding ones between (plain rope with their own base there)
    "laguna": ArchSpec(
        layer=(_ATTN_NORM, *_QKV, _OUT,
               lt(T.ATTN_Q_NORM, lambda d: (d["D"],), NORM), lt(T.ATTN_K_NORM, lambda d: (d["D"],), NORM),
               lt(T.ATTN_GATE, lambda d: (d["H"], d["E"])), _FFN_NORM,
               *only((_GATE, _UP, _DOWN), _dense_lead),
               *only(MOE[1:] + SHARED_EXPERT, _moe),
               lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", _moe)),
        dims=_swa4,
        extra_kv=lambda d: {
            **moe_kv(d), **swa_kv(d), KR.FREQ_BASE_SWA: 1000.0, KL.LEADING_DENSE_BLOCK_COUNT: d["L"],
            KL.EXPERT_SHARED_FEED_FORWARD_LENGTH: d["G"], KL.EXPERT_GATING_FUNC: 2,
            KL.EXPERT_WEIGHTS_NORM: True, KL.EXPERT_WEIGHTS_SCALE: 1.5,
        },
        kind=_laguna_kind,
        parity_layers=8,
        features=("moe", "dense-lead", "shared-expert", "swa", "attn-out-gate", "qk-norm"),
    ),
}
