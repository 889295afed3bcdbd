"""Random-weight models with a real model's shape (`dgr synth --shape llama-7b`): the compute per token real users
see, without downloading a model.

The weights are written already quantized, in llama.cpp's Q4_K_M mix (attention and FFN matrices Q4_K; attn_v,
ffn_down and the output head Q6_K; norms and biases F32), as random blocks whose scales make every matrix's
values about N(0, 0.02²)-sized. Each tensor is made and written on its own (the largest, a 152k-token head, is
under 0.5 GB), so the whole model is never in memory; the bytes depend only on the shape and the seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.toolchain.synth.generic import ARCHS, add_kv, layer_dims
from dgr.toolchain.synth.spec import BIAS, NORM
from dgr.toolchain.synth.tokenizer import add_tokenizer

log = get_logger(__name__)

Q = gguf.GGMLQuantizationType
KL, KA, T = gguf.Keys.LLM, gguf.Keys.Attention, gguf.MODEL_TENSOR


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    vocab: int
    context: int = 4096
    rope_base: float = 10000.0
    what: str = ""


SHAPES = {
    "llama-7b": Shape("llama", 32, 4096, 11008, 32, 32, 32000, rope_base=10000.0,
                      what="Llama-2-7B: 32 layers, width 4096, FFN 11008, 32 heads, vocabulary 32000"),
    "qwen2-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, 152064, context=32768, rope_base=1000000.0,
                      what="Qwen2-7B: 28 layers, width 3584, FFN 18944, 28 heads (4 KV), vocabulary 152064"),
}

# llama.cpp's Q4_K_M: these matrices in Q6_K, every other matrix Q4_K (1-D tensors stay F32)
_Q6K = (T.ATTN_V, T.FFN_DOWN, T.OUTPUT)
_STD = 0.02


def _random_blocks(rng: np.random.Generator, qtype: Q, n_blocks: int) -> np.ndarray:
    """`n_blocks` blocks of `qtype` with random quants and scales chosen so the values are about N(0, 0.02²)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    if qtype == Q.Q4_K:
        # w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit: dmin = 7.5 d centres it; std ~ 256 d
        d = np.float16(_STD / 256)
        b[:, 0:2] = np.frombuffer(d.tobytes(), np.uint8)
        b[:, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:
        # w = d * sc * (q - 32), sc int8, q 6-bit: std ~ 74 * 18.5 d
        b[:, 208:210] = np.frombuffer(np.float16(_STD / (74 * 18.5)).tobytes(), np.uint8)
    else:
        raise DgrError(f"no random blocks for {qtype.name}")
    return b


def _qtype(tensor: gguf.MODEL_TENSOR) -> Q:
    return Q.Q6_K if tensor in _Q6K else Q.Q4_K


def synth_shape(name: str, path: str | Path, *, seed: int = 0, layers: int | None = None) -> Path:
    """Write the `name` shape (SHAPES) to `path`; `layers` writes fewer layers of the same width (tests)."""
    if name not in SHAPES:
        raise DgrError(f"dgr synth: unknown --shape {name!r}; shapes: {', '.join(SHAPES)}")
    s = SHAPES[name]
    spec = ARCHS[s.arch]
    n_layer = layers or s.layers
    dims = layer_dims(s.arch, n_layer, s.embd, n_ff=s.n_ff, context=s.context)
    dims.update(H=s.n_head, K=s.n_head_kv, D=s.embd // s.n_head, V=s.vocab, ctx=s.context)
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_name(f"dgr-synth-{name}-s{seed}")
    w.add_description(f"dgr synth --shape {name} --seed {seed}: random Q4_K_M weights of {s.what}")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    kv = {KL.CONTEXT_LENGTH: s.context, KL.EMBEDDING_LENGTH: s.embd, KL.BLOCK_COUNT: n_layer,
          KL.FEED_FORWARD_LENGTH: s.n_ff, KA.HEAD_COUNT: s.n_head, KA.HEAD_COUNT_KV: s.n_head_kv,
          gguf.Keys.Rope.FREQ_BASE: s.rope_base, KA.LAYERNORM_RMS_EPS: 1e-6, KL.VOCAB_SIZE: s.vocab}
    for key, val in kv.items():
        add_kv(w, key.format(arch=s.arch), val)
    add_tokenizer(w, vocab=s.vocab)

    # (name, numpy shape, kind): every tensor's info goes first, then the data one tensor at a time
    plan: list[tuple[str, tuple[int, ...], gguf.MODEL_TENSOR | None]] = \
        [(gguf.TENSOR_NAMES[T.TOKEN_EMBD] + ".weight", (s.vocab, s.embd), T.TOKEN_EMBD)]
    for il in range(n_layer):
        for lt_ in spec.layer:
            if lt_.when is not None and not lt_.when(il, dims):
                continue
            base = gguf.TENSOR_NAMES[lt_.tensor].format(bid=il)
            quant = lt_.kind not in (NORM, BIAS) and len(lt_.shape(dims)) == 2
            plan.append((f"{base}.{lt_.suffix}" if lt_.suffix else base, tuple(lt_.shape(dims)),
                         lt_.tensor if quant else None))
    plan.append((gguf.TENSOR_NAMES[T.OUTPUT_NORM] + ".weight", (s.embd,), None))
    plan.append((gguf.TENSOR_NAMES[T.OUTPUT] + ".weight", (s.vocab, s.embd), T.OUTPUT))
    for tname, shape, tensor in plan:
        if tensor is None:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            qt = _qtype(tensor)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            if shape[-1] % block:
                raise DgrError(f"{tname}: rows of {shape[-1]} are not whole {qt.name} blocks of {block}")
            row = shape[-1] // block * size
            w.add_tensor_info(tname, (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (tname, shape, tensor) in enumerate(plan):
        if tensor is None:
            data = np.ones(shape, np.float32) if tname.endswith("norm.weight") else \
                rng.standard_normal(shape, dtype=np.float32) * _STD
        else:
            qt = _qtype(tensor)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            data = _random_blocks(rng, qt, shape[0] * shape[-1] // block).reshape(shape[0], -1)
        w.write_tensor_data(data)
        if k % 16 == 0:
            log.info("synth %s: %d/%d tensors written", name, k + 1, len(plan))
    w.close()
    return path
