"""Tiny random-weight GGUF models that the pinned llama.cpp loads and runs.

Tests of every area use them: an architecture is exercised in seconds without downloading weights.
Each architecture is one row of `ARCHS` (its per-layer tensors and extra hyper-parameters); the
writer is shared. Output is deterministic: the same arguments give the same bytes.

The tokenizer is a byte-level GPT-2 style BPE: the 256 byte symbols, a few merges and three control
tokens, so any ASCII text tokenizes and detokenizes back to itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from dgr.core.errors import DgrError
from dgr.toolchain.synth.families import family_specs
from dgr.toolchain.synth.registry import OWN_WRITERS
from dgr.toolchain.synth.spec import (ATTN, BIAS, F32, FFN, KA, KL, MLA_ATTN, MOE, NORM, QK_NORM, QKV_BIAS, ArchSpec, T,
                                      Typed, after_lead, dense_lead, dense_moe_kind, lt, moe_kv, only, swa_kind, swa_kv)
from dgr.toolchain.synth.tokenizer import add_tokenizer, tokenizer_vocab

# deepseek2 (MLA attention, leading dense blocks, then MoE with shared experts). Dims: Q q lora rank,
# C kv lora rank, R rope head dim, N no-rope head dim, V value head dim, S shared experts, L dense lead.
_DS2_FFN = FFN[:1] + only(FFN[1:], dense_lead) + only(MOE[1:], after_lead) + (
    lt(T.FFN_EXP_PROBS_B, lambda d: (d["X"],), BIAS, "bias", after_lead),
    lt(T.FFN_GATE_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=after_lead),
    lt(T.FFN_UP_SHEXP, lambda d: (d["G"] * d["S"], d["E"]), when=after_lead),
    lt(T.FFN_DOWN_SHEXP, lambda d: (d["E"], d["G"] * d["S"]), when=after_lead),
)


def _deepseek2_kv(d: dict) -> dict:
    # MLA as the pinned llama.cpp reads it (absorbed form: one KV head of width C + R, value width C);
    # gating func 2 = sigmoid, which uses exp_probs_b as the routing bias.
    return {
        KA.HEAD_COUNT_KV: 1, KA.KEY_LENGTH: d["C"] + d["R"], KA.VALUE_LENGTH: d["C"],
        KA.KEY_LENGTH_MLA: d["N"] + d["R"], KA.VALUE_LENGTH_MLA: d["V"],
        KA.Q_LORA_RANK: d["Q"], KA.KV_LORA_RANK: d["C"], gguf.Keys.Rope.DIMENSION_COUNT: d["R"],
        KL.LEADING_DENSE_BLOCK_COUNT: d["L"], KL.EXPERT_SHARED_COUNT: d["S"], KL.EXPERT_GATING_FUNC: 2,
        KL.EXPERT_WEIGHTS_SCALE: 1.5, KL.EXPERT_WEIGHTS_NORM: True, **moe_kv(d),
    }


# The first architectures dgr ported (patches 0005-0009, 0014); later ones live in dgr.toolchain.synth.families.
CORE: dict[str, ArchSpec] = {
    "llama": ArchSpec(layer=ATTN + FFN, features=("dense",)),
    "qwen2": ArchSpec(layer=ATTN + QKV_BIAS + FFN, features=("dense", "qkv-bias")),
    "qwen3": ArchSpec(layer=ATTN + QK_NORM + FFN, features=("dense", "qk-norm")),
    "gemma3": ArchSpec(
        layer=ATTN + QK_NORM + (lt(T.ATTN_POST_NORM, lambda d: (d["E"],), NORM),) + FFN
        + (lt(T.FFN_POST_NORM, lambda d: (d["E"],), NORM),),
        tied=True,
        extra_kv=swa_kv,
        kind=swa_kind,
        features=("swa", "tied", "embd-scale"),
    ),
    "qwen3moe": ArchSpec(layer=ATTN + QK_NORM + MOE, extra_kv=moe_kv, features=("moe", "qk-norm")),
    "deepseek2": ArchSpec(layer=MLA_ATTN + _DS2_FFN, extra_kv=_deepseek2_kv,
                          kind=dense_moe_kind,
                          features=("mla", "dense-lead", "moe", "shared-expert")),
}


def _registry() -> dict[str, ArchSpec]:
    out = dict(CORE)
    for name, spec in family_specs().items():
        if name in out:
            raise DgrError(f"dgr synth: architecture {name!r} is defined twice")
        out[name] = spec
    return out


# Every architecture the table writer knows. Architectures that need a writer of their own (deepseek4)
# register it in dgr.toolchain.synth.registry.OWN_WRITERS.
ARCHS: dict[str, ArchSpec] = _registry()


def known_archs() -> list[str]:
    """Every architecture `dgr synth --arch` writes, sorted (what `dgr synth --list` prints)."""
    return sorted([*ARCHS, *OWN_WRITERS])


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
        raise DgrError(f"dgr synth: unknown --arch {arch!r}; known: {', '.join(known_archs())}")
    spec = ARCHS[arch]
    hd = spec.head_dim
    if layers < 1:
        raise DgrError(f"dgr synth: --layers must be >= 1, got {layers}")
    if embd < 2 * hd or embd % hd:
        raise DgrError(f"dgr synth: --embd must be a multiple of {hd} and >= {2 * hd}, got {embd}")
    if dtype not in ("f32", "f16"):
        raise DgrError(f"dgr synth: --dtype must be f32 or f16, got {dtype!r}")
    dims = layer_dims(arch, layers, embd, n_ff=n_ff, n_expert=n_expert, n_expert_used=n_expert_used, swa=swa,
                      swa_pattern=swa_pattern, context=context)
    tied = spec.tied if tied is None else tied
    rng = np.random.default_rng(seed)
    wdtype = np.float32 if dtype == "f32" else np.float16

    def values(lt_, shape) -> np.ndarray:
        if lt_.init is not None:
            return np.asarray(lt_.init(shape, rng, dims), dtype=np.float32)
        if lt_.kind == NORM:
            return np.ones(shape, dtype=np.float32)
        if lt_.kind in (BIAS, F32):
            return rng.standard_normal(shape, dtype=np.float32) * scale
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(wdtype)

    def tensor_name(lt_, il: int | None) -> str:
        base = gguf.TENSOR_NAMES[lt_.tensor]
        base = base.format(bid=il) if il is not None else base
        return f"{base}.{lt_.suffix}" if lt_.suffix else base

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    # no architecture in the name: llama.cpp's vocabulary code keys quirks on names ("phi3" wants "</s>")
    w.add_name(f"dgr-synth-L{layers}-E{embd}-s{seed}")
    w.add_description(f"dgr synth --arch {arch} --layers {layers} --embd {embd} --seed {seed}: random weights")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    kv = {
        KL.CONTEXT_LENGTH: context, KL.EMBEDDING_LENGTH: embd, KL.BLOCK_COUNT: layers,
        KL.FEED_FORWARD_LENGTH: dims["F"], KA.HEAD_COUNT: dims["H"], KA.HEAD_COUNT_KV: dims["K"],
        KA.KEY_LENGTH: dims["D"], KA.VALUE_LENGTH: dims["D"], gguf.Keys.Rope.DIMENSION_COUNT: dims["D"],
        gguf.Keys.Rope.FREQ_BASE: 10000.0, KA.LAYERNORM_RMS_EPS: 1e-6, KL.VOCAB_SIZE: dims["V"],
    }
    kv.update(spec.extra_kv(dims))
    for key, val in kv.items():
        if val is not None:
            add_kv(w, key.format(arch=arch), val)
    add_tokenizer(w)

    w.add_tensor(gguf.TENSOR_NAMES[T.TOKEN_EMBD] + ".weight", values(lt(T.TOKEN_EMBD, None), (dims["V"], embd)))
    for il in range(layers):
        for lt_ in spec.layer:
            if lt_.when is not None and not lt_.when(il, dims):
                continue
            w.add_tensor(tensor_name(lt_, il), values(lt_, lt_.shape(dims)))
    for lt_ in spec.globals:
        if lt_.when is None or lt_.when(-1, dims):
            w.add_tensor(tensor_name(lt_, None), values(lt_, lt_.shape(dims)))
    if spec.output_norm:
        w.add_tensor(gguf.TENSOR_NAMES[T.OUTPUT_NORM] + ".weight", np.ones((embd,), dtype=np.float32))
    if not tied:
        w.add_tensor(gguf.TENSOR_NAMES[T.OUTPUT] + ".weight", values(lt(T.OUTPUT, None), (dims["V"], embd)))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def layer_dims(arch: str, layers: int, embd: int, *, n_ff: int | None = None, n_expert: int = 4,
               n_expert_used: int = 2, swa: int = 8, swa_pattern: int = 2, context: int = 512) -> dict:
    """The dims a spec's shapes, metadata and layer kinds read, after the spec's own `dims` hook."""
    spec = ARCHS[arch]
    hd = spec.head_dim
    n_head = embd // hd
    dims = {
        "E": embd, "F": n_ff or 2 * embd, "H": n_head, "K": max(1, n_head // 2), "D": hd,
        "X": n_expert, "X_used": n_expert_used, "G": n_ff or embd, "swa": swa, "swa_pattern": swa_pattern,
        "Q": embd // 2, "C": embd // 2, "R": hd // 2, "N": hd, "V": len(tokenizer_vocab()[0]), "S": 1,
        "L": min(1, layers - 1), "n_layer": layers, "ctx": context,
    }
    return spec.dims(dict(dims)) if spec.dims else dims


def layer_kinds(arch: str, layers: int, embd: int = 64) -> list[str]:
    """Each layer's kind for `arch` (one kind for every layer when the spec does not say)."""
    if arch in OWN_WRITERS:
        return OWN_WRITERS[arch].layer_kinds(layers)
    spec = ARCHS[arch]
    dims = layer_dims(arch, layers, embd)
    return [spec.kind(il, dims) if spec.kind else "layer" for il in range(layers)]


def add_kv(w: gguf.GGUFWriter, key: str, val) -> None:
    """int -> u32, float -> f32, bool, str, list -> array (of its first element's type); Typed as given."""
    if isinstance(val, Typed):
        w.add_key_value(key, val.value, val.type, sub_type=val.sub_type)
    elif isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, float):
        w.add_float32(key, val)
    elif isinstance(val, int):
        w.add_uint32(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, (list, tuple)):
        w.add_array(key, list(val))
    else:
        raise TypeError(f"dgr synth: metadata {key} has an unsupported value {val!r}")
