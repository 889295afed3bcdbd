"""Quantization during a build: each tensor's target type, whether the engine can run it, and the conversion.

Three steps, in this order:

- `never_quantized`: llama.cpp's own rule for which tensors a quantizer may touch (1-D tensors, norms,
  biases, routers, position tables... are never quantized: the engine runs them in F32 ops that abort on
  a quantized operand). A recipe rule whose pattern matches such a tensor does not apply to it.
- `choose`: the target type of every other tensor, from the recipe's first matching rule or its default.
- `check_target`: whether the pinned engine can run that type for that tensor (row width a multiple of
  the type's block, a type the build can produce from the source's); a refusal names the tensor, the type,
  the rule that asked for it and what to do. `convert` then makes the bytes while the stage is written.

Only `gguf`'s public API is used: a type can be produced (or read) when `gguf.quants.quantize`
(`dequantize`) accepts one block of it; the others raise NotImplementedError.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from functools import cache

import gguf
import numpy as np

from dgr.core.errors import RecipeError
from dgr.gguf.model import TensorInfo, tensor_nbytes
from dgr.toolchain.recipe import KEEP, LoadedRecipe

Q = gguf.GGMLQuantizationType
# Converted by numpy directly (exact casts, no block structure).
_NUMPY_TYPES = {Q.F32: np.float32, Q.F16: np.float16}
# Tables of integers (DeepSeek V4's token -> expert map is I32): data, not weights; never converted.
_INTEGER_TYPES = (Q.I8, Q.I16, Q.I32, Q.I64)

# llama.cpp's rule, transcribed from `tensor_allows_quantization` in the pinned src/llama-quant.cpp
# (keep the order and the comments of that function; when the pin moves, diff that function and
# update these tables): a tensor is quantized only when it has at least 2 dimensions, its name ends
# in "weight", and no entry below excludes it.
_NEVER_PARTS = (
    ("_norm.weight", "a norm"),
    ("ffn_gate_inp.weight", "an expert router"),
    ("ffn_gate_tid2eid.weight", "a token -> expert table"),
    ("altup", "a tiny altup matrix"),
    ("laurel", "a tiny laurel matrix"),
    ("per_layer_model_proj", "a per-layer projection llama.cpp keeps"),
    ("ssm_conv1d", "an SSM conv1d kernel"),
    ("shortconv.conv.weight", "a short-conv kernel"),
    ("indexer.k_proj.weight", "a tiny indexer projection"),
    ("indexer.q_proj.weight", "a tiny indexer projection"),
    *((f"time_mix_{x}.weight", "an RWKV time-mix table") for x in (
        "first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2", "decay_w1", "decay_w2",
        "lerp_fused")),
    ("attn_rel_b.weight", "a relative position bias"),
    (".position_embd", "a position table"),
    ("sam.pos_embd", "a position table"),
    ("sam.neck.", "a vision neck tensor"),
    ("sam.net_", "a vision tensor"),
    (".rel_pos", "a relative position table"),
    (".patch_embd", "a patch embedding"),
    (".patch_merger", "a patch merger"),
    ("a.rvq.codebook", "an audio codebook"),
    ("mm.a.code_embd", "an audio codebook"),
)
# LLM_TN(arch)(LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES, "weight"): the same name in every arch.
_NEVER_NAMES = {"position_embd.weight": "a position table", "token_types.weight": "a token-type table"}
# Exclusions llama.cpp makes for one architecture only (llama-arch.cpp's name for it).
_NEVER_PARTS_OF_ARCH = {
    "glm5-next": tuple((p, "a tensor llama.cpp keeps for glm5-next") for p in (
        "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
        "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
        "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")),
}


def n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last one longer than 1 (a [4096, 1] tensor is 1-D)."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def never_quantized(name: str, shape: tuple[int, ...] | None, arch: str | None = None,
                    src: gguf.GGMLQuantizationType | None = None) -> str | None:
    """Why llama.cpp never quantizes tensor `name` (a few words), or None when it may be quantized.

    `shape` is in ggml order (ne0 first); None skips the dimension test (a name-only question)."""
    if src in _INTEGER_TYPES:
        return f"an integer table ({src.name})"
    if shape is not None and n_dims(shape) < 2:
        return "1-D"
    if not name.endswith("weight"):
        return "not a weight" if not name.endswith("bias") else "a bias"
    if name in _NEVER_NAMES:
        return _NEVER_NAMES[name]
    for part, why in _NEVER_PARTS + _NEVER_PARTS_OF_ARCH.get(arch or "", ()):
        if part in name:
            return why
    return None


@dataclass(frozen=True)
class Choice:
    """A tensor's target type and which entry of the recipe's [quantization] asked for it."""

    type: gguf.GGMLQuantizationType
    asked: str                 # the type name (or KEEP) the recipe asked for: its matching rule's, or the default
    rule: int | None = None    # index into quantization.rules; None: quantization.default
    kept: str | None = None    # why that ask was not applied: llama.cpp never quantizes this tensor

    def where(self, recipe: LoadedRecipe) -> str:
        """The recipe entry that chose this type, as a user finds it in the file."""
        if self.rule is None:
            return f'quantization.default = "{recipe.recipe.quantization.default}"'
        r = recipe.recipe.quantization.rules[self.rule]
        return f'quantization.rules[{self.rule}] {{ pattern = "{r.pattern}", type = "{r.type}" }}'


def choose(name: str, src: gguf.GGMLQuantizationType, recipe: LoadedRecipe,
           shape: tuple[int, ...] | None = None, arch: str | None = None) -> Choice:
    """The type tensor `name` (now `src`) gets in the bundle: the first matching rule, else the default;
    the source's type for a tensor llama.cpp never quantizes (`kept` says why)."""
    q = recipe.recipe.quantization
    asked, rule = q.default, None
    for i, r in enumerate(q.rules):
        if fnmatch.fnmatchcase(name, r.pattern):
            asked, rule = r.type, i
            break
    if asked == KEEP:
        return Choice(src, asked, rule)
    why = never_quantized(name, shape, arch, src)
    if why is not None:
        return Choice(src, asked, rule, kept=why)
    return Choice(gguf.GGMLQuantizationType[asked], asked, rule)


def target_type(name: str, src: gguf.GGMLQuantizationType, recipe: LoadedRecipe,
                shape: tuple[int, ...] | None = None, arch: str | None = None) -> gguf.GGMLQuantizationType:
    """The type tensor `name` (now `src`) gets in the bundle (see `choose`)."""
    return choose(name, src, recipe, shape, arch).type


def _gguf_handles(qtype: gguf.GGMLQuantizationType, probe) -> bool:
    """Whether a `gguf.quants` function implements `qtype`: numpy's own types always, else one block tried."""
    if qtype in _NUMPY_TYPES:
        return True
    try:
        probe(*gguf.GGML_QUANT_SIZES[qtype])
    except NotImplementedError:
        return False
    return True


@cache
def can_quantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the `gguf` package can produce `qtype` (probed on one zero block)."""
    if qtype in _INTEGER_TYPES:
        return False
    return _gguf_handles(qtype, lambda block, _: gguf.quants.quantize(np.zeros((1, block), np.float32), qtype))


@cache
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the `gguf` package can read `qtype` back to floats (probed on one zero block)."""
    if qtype in _INTEGER_TYPES:
        return False
    return _gguf_handles(qtype, lambda _, nbytes: gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype))


@cache
def producible() -> tuple[gguf.GGMLQuantizationType, ...]:
    """Every type a build can write (what `gguf.quants.quantize` implements), in enum order."""
    return tuple(t for t in gguf.GGMLQuantizationType if can_quantize(t))


def block_size(qtype: gguf.GGMLQuantizationType) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def check_target(t: TensorInfo, c: Choice, recipe: LoadedRecipe) -> None:
    """Raise RecipeError unless the pinned engine can run tensor `t` as `c.type` and the build can make it:
    the message names the tensor, the type, the recipe entry that asked for it and what to do."""
    dst = c.type
    if dst == t.type:
        return
    path, where = recipe.path, c.where(recipe)
    if not can_quantize(dst):
        names = ", ".join(q.name for q in producible())
        raise RecipeError(f"{path}: quantization: {where} makes tensor {t.name!r} {dst.name}, which needs the pinned "
                          f"llama.cpp quantizer (llama-quantize): the gguf package cannot produce {dst.name}. "
                          f"Use one of {names} in that entry, or keep")
    keep = f'{{ pattern = "{_every_layer(t.name)}", type = "keep" }}'
    width, block = t.shape[0], block_size(dst)
    if width % block:
        fit = [q.name for q in producible() if width % block_size(q) == 0]
        raise RecipeError(
            f"{path}: quantization: {where} makes tensor {t.name!r} {dst.name}, but its rows have {width} values, "
            f"not a multiple of {dst.name}'s block of {block}: llama.cpp cannot load such a tensor. Put the rule "
            f"{keep} first in quantization.rules, narrow that pattern, or use a type whose block divides {width} "
            f"({', '.join(fit) or 'none'})")
    if not can_dequantize(t.type):
        raise RecipeError(f"{path}: quantization: {where} converts tensor {t.name!r}, but it is {t.type.name}, "
                          f"which dgr cannot read back to floats to convert; keep its type: put the rule {keep} "
                          f"first in quantization.rules, or narrow that pattern")


def _every_layer(name: str) -> str:
    """The glob for tensor `name` in every layer: blk.7.attn_k_b.weight -> blk.*.attn_k_b.weight."""
    return re.sub(r"^blk\.\d+\.", "blk.*.", name)


def convert(raw: np.ndarray, t: TensorInfo, dst: gguf.GGMLQuantizationType) -> bytes:
    """The bytes of tensor `t` (its data `raw`, uint8) as `dst`: dequantized to f32, then quantized."""
    rows = raw.reshape(-1, tensor_nbytes((t.shape[0],), t.type))
    if t.type in _NUMPY_TYPES:
        floats = rows.view(_NUMPY_TYPES[t.type]).astype(np.float32)
    else:
        floats = gguf.quants.dequantize(rows, t.type).astype(np.float32)
    if dst in _NUMPY_TYPES:
        return floats.astype(_NUMPY_TYPES[dst]).tobytes()
    return gguf.quants.quantize(floats, dst).tobytes()
