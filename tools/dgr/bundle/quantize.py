"""Quantization during a build: each tensor's target type and the conversions `gguf` can make.

The target type comes from the recipe's rules; a conversion is checked before the build starts and
done while the stage file is written.

Only `gguf`'s public API is used: a type can be produced (or read) when `gguf.quants.quantize`
(`dequantize`) accepts one block of it; the others raise NotImplementedError, and for those a recipe
fails with what to do instead.
"""

from __future__ import annotations

import fnmatch
from functools import cache
from pathlib import Path

import gguf
import numpy as np

from dgr.errors import RecipeError
from dgr.ggufmodel import TensorInfo, tensor_nbytes
from dgr.recipe import KEEP, LoadedRecipe

Q = gguf.GGMLQuantizationType
# Converted by numpy directly (exact casts, no block structure).
_NUMPY_TYPES = {Q.F32: np.float32, Q.F16: np.float16}


def target_type(name: str, src: gguf.GGMLQuantizationType, recipe: LoadedRecipe) -> gguf.GGMLQuantizationType:
    """The type tensor `name` (now `src`) gets in the bundle: the first matching rule, else the default."""
    q = recipe.recipe.quantization
    chosen = q.default
    for rule in q.rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            chosen = rule.type
            break
    return src if chosen == KEEP else gguf.GGMLQuantizationType[chosen]


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
    return _gguf_handles(qtype, lambda block, _: gguf.quants.quantize(np.zeros((1, block), np.float32), qtype))


@cache
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether the `gguf` package can read `qtype` back to floats (probed on one zero block)."""
    return _gguf_handles(qtype, lambda _, nbytes: gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype))


def check_conversion(t: TensorInfo, dst: gguf.GGMLQuantizationType, recipe_path: Path) -> None:
    """Raise RecipeError (naming the tensor and the fix) unless `t` can be converted to `dst`."""
    if dst == t.type:
        return
    if not can_quantize(dst):
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} -> {dst.name} needs the pinned "
                          f"llama.cpp quantizer (llama-quantize); the gguf package cannot produce {dst.name}. "
                          f"Use one of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, or keep")
    block = gguf.GGML_QUANT_SIZES[dst][0]
    if t.shape[0] % block:
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} rows have {t.shape[0]} values, not a "
                          f"multiple of {dst.name}'s block of {block}; exclude it from that rule")
    if not can_dequantize(t.type):
        raise RecipeError(f"{recipe_path}: quantization: tensor {t.name!r} is {t.type.name}, which dgr cannot "
                          f"dequantize; keep its type")


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
