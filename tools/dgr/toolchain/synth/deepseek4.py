"""Tiny random-weight DeepSeek V4 (`deepseek4`) GGUF models that the pinned llama.cpp loads and runs.

V4 is the target of dgr and does not fit the row-per-architecture table of `dgr.toolchain.synth.generic`: its residual is
a hyper-connection (mHC) of `hc_mult` streams, the first `hash_layers` layers route experts by a
token-id table instead of a router bias, each layer has its own attention compression ratio (0: sliding
window only, 4: compressed + lightning indexer, 128: heavily compressed), and an optional MTP block
follows the main layers. So it has its own writer; `dgr synth --arch deepseek4` calls `synth_deepseek4`.

What the pinned llama.cpp (b11312) requires, found in `src/models/deepseek4.cpp` (load_arch_hparams,
load_arch_tensors) and by loading files: `head_count_kv` 1, `key_length` == `value_length`,
`expert_gating_func` 4 (sqrt-softplus), `hyper_connection.count` 4, a compress-ratio array covering every
block including MTP (0 there), ratios from {0, 4, 128}, `n_head` divisible by `output_group_count`,
an indexer key length that is a multiple of 64; hash layers hold an I32 `ffn_gate_tid2eid` table of
shape {n_expert_used, n_vocab}, the other layers an `exp_probs_b` bias. `block_count` counts the MTP
block too; `nextn_predict_layers` says how many of the last blocks are MTP.

The tensor names below mirror `src/llama-arch.cpp` of the pin (the installed `gguf` package predates
V4, so it cannot name them); metadata keys come from `gguf.Keys` where it has them, else from
`dgr.gguf.model.V4Keys`. Output is deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from dgr.core.errors import DgrError
from dgr.gguf.model import V4Keys
from dgr.toolchain.synth.registry import register_writer
from dgr.toolchain.synth.tokenizer import add_tokenizer, tokenizer_vocab  # shared by all synthetic models

KA = gguf.Keys.Attention  # metadata key templates ("{arch}...."), formatted with ARCH
KL = gguf.Keys.LLM

ARCH = "deepseek4"

# Compression ratios the pinned loader accepts (the MTP block always has 0).
COMPRESS_RATIOS = (0, 4, 128)
CSA_RATIO = 4     # compressed sparse attention: compressor + lightning indexer
HCA_RATIO = 128   # heavily compressed attention: compressor only
EXPERT_GATING_SQRT_SOFTPLUS = 4  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
INDEXER_KEY_MULTIPLE = 64

# Tensor kinds (how values are drawn): "w" weight (normal * scale, in the file's dtype), "one" RMS-norm
# multiplier (ones), "small" F32 vector (normal * scale), "tid2eid" I32 hash-routing table.

# Model-level tensors: token embedding (first stage), hyper-connection head + output norm + head (last).
GLOBAL_INPUT = ("token_embd.weight",)
GLOBAL_OUTPUT = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight",
                 "output_norm.weight", "output.weight")


@dataclass(frozen=True)
class DeepSeek4Shape:
    """Hyper-parameters of a synthetic V4. `compress_ratios` covers the main layers only; the MTP
    block (when `mtp`) always gets ratio 0, as upstream requires."""

    layers: int = 4
    embd: int = 128
    hc_mult: int = 4
    n_head: int = 4
    # key_length == value_length (K-only MQA: one KV head). Not equal to the indexer key length, as in
    # the real model (512 vs 128): when they are equal, llama.cpp Hadamard-rotates every V4 K cache,
    # not only the indexer's (src/llama-kv-cache.cpp:328), which is another code path.
    head_dim: int = 128
    rope_dim: int = 16
    q_lora_rank: int = 64
    o_groups: int = 2
    o_lora_rank: int = 32
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    expert_ff: int = 64
    indexer_heads: int = 2
    indexer_dim: int = 64
    indexer_top_k: int = 8
    sliding_window: int = 32
    hash_layers: int = 3
    compress_ratios: tuple[int, ...] = field(default=())
    mtp: bool = True
    context: int = 1024
    sinkhorn_iters: int = 20
    n_vocab: int = 0              # filled from the tokenizer

    @property
    def n_blocks(self) -> int:
        """`block_count`: main layers plus the MTP block."""
        return self.layers + (1 if self.mtp else 0)

    @property
    def all_ratios(self) -> tuple[int, ...]:
        """The `attention.compress_ratios` array as written: one entry per block, MTP last with 0."""
        return tuple(self.compress_ratios) + ((0,) if self.mtp else ())

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def validate(self) -> None:
        def bad(what: str) -> DgrError:
            return DgrError(f"dgr synth --arch deepseek4: {what}")

        if self.layers < 1:
            raise bad(f"--layers must be >= 1, got {self.layers}")
        if self.hc_mult != 4:
            raise bad(f"hc_mult must be 4 (the pinned graph asserts it), got {self.hc_mult}")
        if len(self.compress_ratios) != self.layers:
            raise bad(f"compress ratios must give one ratio per main layer ({self.layers}), "
                      f"got {len(self.compress_ratios)}")
        if any(r not in COMPRESS_RATIOS for r in self.compress_ratios):
            raise bad(f"compress ratios must be from {COMPRESS_RATIOS}, got {list(self.compress_ratios)}")
        if not 0 <= self.hash_layers <= self.layers:
            raise bad(f"--hash-layers must be in [0, {self.layers}], got {self.hash_layers}")
        if self.n_head % self.o_groups:
            raise bad(f"n_head {self.n_head} must be divisible by the output group count {self.o_groups}")
        if self.indexer_dim % INDEXER_KEY_MULTIPLE:
            raise bad(f"indexer key length must be a multiple of {INDEXER_KEY_MULTIPLE}, got {self.indexer_dim}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise bad(f"rope dim must be even and in (0, head_dim={self.head_dim}], got {self.rope_dim}")
        if self.head_dim == self.indexer_dim:
            raise bad(f"head dim and indexer key length must differ (both {self.head_dim}): equal sizes switch "
                      f"llama.cpp to rotating every V4 K cache, unlike the real model")
        if self.rope_dim > self.indexer_dim:
            raise bad(f"rope dim {self.rope_dim} must not exceed the indexer key length {self.indexer_dim}")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise bad(f"experts used ({self.n_expert_used}) must be in [1, n_expert={self.n_expert}]")
        if self.embd < 16 or self.embd % 16:
            raise bad(f"--embd must be a multiple of 16, got {self.embd}")


def default_ratios(layers: int) -> tuple[int, ...]:
    """Ratios cycling 0, 4, 128 so that every attention kind appears from three layers on (and the hash
    region, layers 0-2, holds one of each)."""
    return tuple(COMPRESS_RATIOS[i % 3] for i in range(layers))


def layer_kinds(layers: int, hash_layers: int | None = None) -> list[str]:
    """Each main layer's kind as `dgr parity --synth` cuts across it: hash-routed or learned routing, and
    the attention's compression ratio (defaults as `make_shape`'s)."""
    hl = min(3, layers) if hash_layers is None else hash_layers
    return [f"{'hash' if il < hl else 'routed'}-c{r}" for il, r in enumerate(default_ratios(layers))]


def _block_shapes(s: DeepSeek4Shape, il: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name suffix -> (numpy shape, kind) of block `il`. numpy shapes are ggml's ne reversed."""
    E, H, D, Q = s.embd, s.n_head, s.head_dim, s.q_lora_rank
    G, O, X, F = s.o_groups, s.o_lora_rank, s.n_expert, s.expert_ff
    hc_dim = s.hc_mult * E
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "attn_norm": ((E,), "one"),
        "attn_sinks": ((H,), "small"),
        "attn_q_a": ((Q, E), "w"),
        "attn_q_a_norm": ((Q,), "one"),
        "attn_q_b": ((H * D, Q), "w"),
        "attn_kv": ((D, E), "w"),
        "attn_kv_a_norm": ((D,), "one"),
        # stored 2-D (the loader reshapes it to {H*D/G, O, G})
        "attn_output_a": ((O * G, H * D // G), "w"),
        "attn_output_b": ((E, G * O), "w"),
        "hc_attn_fn": ((s.hc_mix, hc_dim), "w"),
        "hc_attn_base": ((s.hc_mix,), "small"),
        "hc_attn_scale": ((3,), "small"),
        "hc_ffn_fn": ((s.hc_mix, hc_dim), "w"),
        "hc_ffn_base": ((s.hc_mix,), "small"),
        "hc_ffn_scale": ((3,), "small"),
    }
    ratio = s.all_ratios[il]
    if ratio:
        coff = 2 if ratio == CSA_RATIO else 1
        out.update({
            "attn_compressor_kv": ((coff * D, E), "w"),
            "attn_compressor_gate": ((coff * D, E), "w"),
            "attn_compressor_ape": ((ratio, coff * D), "small"),
            "attn_compressor_norm": ((D,), "one"),
        })
    if ratio == CSA_RATIO:
        ID, IH = s.indexer_dim, s.indexer_heads
        out.update({
            "indexer.proj": ((IH, E), "w"),
            "indexer.attn_q_b": ((IH * ID, Q), "w"),
            "indexer_compressor_kv": ((2 * ID, E), "w"),
            "indexer_compressor_gate": ((2 * ID, E), "w"),
            "indexer_compressor_ape": ((ratio, 2 * ID), "small"),
            "indexer_compressor_norm": ((ID,), "one"),
        })
    out["ffn_gate_inp"] = ((X, E), "w")
    if il < s.hash_layers:
        out["ffn_gate_tid2eid"] = ((s.n_vocab, s.n_expert_used), "tid2eid")
    else:
        out["exp_probs_b"] = ((X,), "small")
    out.update({
        "ffn_norm": ((E,), "one"),
        "ffn_gate_exps": ((X, F, E), "w"),
        "ffn_down_exps": ((X, E, F), "w"),
        "ffn_up_exps": ((X, F, E), "w"),
        "ffn_gate_shexp": ((F * s.n_expert_shared, E), "w"),
        "ffn_down_shexp": ((E, F * s.n_expert_shared), "w"),
        "ffn_up_shexp": ((F * s.n_expert_shared, E), "w"),
    })
    if il >= s.layers:  # the MTP block
        out.update({
            "nextn.eh_proj": ((E, 2 * E), "w"),
            "nextn.enorm": ((E,), "one"),
            "nextn.hnorm": ((E,), "one"),
        })
    return out


def tensor_name(block: int, suffix: str) -> str:
    """Full GGUF tensor name; the router bias is the one `.bias` tensor."""
    return f"blk.{block}.{suffix}." + ("bias" if suffix == "exp_probs_b" else "weight")


def tensor_inventory(s: DeepSeek4Shape) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of the model in file order: (name, numpy shape, kind)."""
    E, V, hc = s.embd, s.n_vocab, s.hc_mult
    inv: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (V, E), "w")]
    for il in range(s.n_blocks):
        for suffix, (shape, kind) in _block_shapes(s, il).items():
            inv.append((tensor_name(il, suffix), shape, kind))
    inv += [
        ("output_hc_fn.weight", (hc, hc * E), "w"),
        ("output_hc_base.weight", (hc,), "small"),
        ("output_hc_scale.weight", (1,), "small"),
        ("output_norm.weight", (E,), "one"),
        ("output.weight", (V, E), "w"),
    ]
    return inv


def make_shape(
    *,
    layers: int = 4,
    embd: int = 128,
    hash_layers: int | None = None,
    compress_ratios: tuple[int, ...] | list[int] | None = None,
    mtp: bool = True,
    n_experts: int = 8,
    n_experts_used: int = 2,
    **overrides,
) -> DeepSeek4Shape:
    """The shape `synth_deepseek4` writes for these arguments (validated, vocabulary size filled)."""

    ratios = tuple(default_ratios(layers) if compress_ratios is None else compress_ratios)
    if hash_layers is None:
        hash_layers = min(3, layers)  # V4 has 3
    shape = DeepSeek4Shape(
        layers=layers, embd=embd, hash_layers=hash_layers, compress_ratios=ratios, mtp=mtp,
        n_expert=n_experts, n_expert_used=n_experts_used, n_vocab=len(tokenizer_vocab()[0]), **overrides,
    )
    shape.validate()
    return shape


def synth_deepseek4(
    path: str | Path,
    *,
    layers: int = 4,
    embd: int = 128,
    seed: int = 0,
    hash_layers: int | None = None,
    compress_ratios: tuple[int, ...] | list[int] | None = None,
    mtp: bool = True,
    n_experts: int = 8,
    n_experts_used: int = 2,
    dtype: str = "f32",
    scale: float = 0.02,
    values: dict[str, np.ndarray] | None = None,
    name: str | None = None,
    description: str | None = None,
    **overrides,
) -> Path:
    """Write a random-weight `deepseek4` GGUF to `path` and return it.

    `hash_layers` defaults to V4's 3 (fewer when there are fewer layers).
    `compress_ratios` gives one ratio from {0, 4, 128} per main layer (default: 0, 4, 128 repeating);
    the MTP block, when `mtp`, is appended with ratio 0. `overrides` set other `DeepSeek4Shape` fields
    (n_head, head_dim, sliding_window, ...). `dtype` is the type of the matrices (f32 or f16); norms,
    vectors and the hash table keep their own types.
    `values` replace chosen tensors' random values (name -> array of the tensor's shape, cast to its
    type; the random draws stay as they are, so every other tensor keeps its values); `name` and
    `description` replace general.name and general.description. Without them the file is as before.
    """

    if dtype not in ("f32", "f16"):
        raise DgrError(f"dgr synth --arch deepseek4: --dtype must be f32 or f16, got {dtype!r}")
    s = make_shape(layers=layers, embd=embd, hash_layers=hash_layers, compress_ratios=compress_ratios,
                   mtp=mtp, n_experts=n_experts, n_experts_used=n_experts_used, **overrides)
    rng = np.random.default_rng(seed)
    wdtype = np.float32 if dtype == "f32" else np.float16
    unknown = sorted(set(values or ()) - {t[0] for t in tensor_inventory(s)})
    if unknown:
        raise DgrError(f"synth_deepseek4: values for tensors the model does not have: {', '.join(unknown)}")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), ARCH)

    def k(template: str) -> str:  # a gguf (or V4Keys) key template for this architecture
        return template.format(arch=ARCH)

    ratios_txt = ",".join(map(str, s.compress_ratios))
    w.add_name(name or f"dgr-synth-{ARCH}-L{s.layers}{'+mtp' if s.mtp else ''}-E{s.embd}-s{seed}")
    w.add_description(description or f"dgr synth --arch {ARCH} --layers {s.layers} --embd {s.embd} --seed {seed} "
                      f"--hash-layers {s.hash_layers} --compress-ratios {ratios_txt}"
                      f"{'' if s.mtp else ' --no-mtp'}: random weights")
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(s.context)
    w.add_embedding_length(s.embd)
    w.add_uint32(k(KL.EMBEDDING_LENGTH_OUT), s.hc_mult * s.embd)
    w.add_block_count(s.n_blocks)
    if s.mtp:
        w.add_uint32(k(KL.NEXTN_PREDICT_LAYERS), 1)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(1)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rope_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s.n_vocab)
    w.add_uint32(k(KA.Q_LORA_RANK), s.q_lora_rank)
    w.add_uint32(k(KA.SLIDING_WINDOW), s.sliding_window)
    w.add_uint32(k(V4Keys.OUTPUT_GROUP_COUNT), s.o_groups)
    w.add_uint32(k(V4Keys.OUTPUT_LORA_RANK), s.o_lora_rank)
    w.add_key_value(k(V4Keys.COMPRESS_RATIOS), list(s.all_ratios), gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.UINT32)
    w.add_float32(k(V4Keys.COMPRESS_ROPE_FREQ_BASE), 160000.0)
    w.add_uint32(k(KA.Indexer.HEAD_COUNT), s.indexer_heads)
    w.add_uint32(k(KA.Indexer.KEY_LENGTH), s.indexer_dim)
    w.add_uint32(k(KA.Indexer.TOP_K), s.indexer_top_k)
    w.add_uint32(k(KL.EXPERT_COUNT), s.n_expert)
    w.add_uint32(k(KL.EXPERT_USED_COUNT), s.n_expert_used)
    w.add_uint32(k(KL.EXPERT_SHARED_COUNT), s.n_expert_shared)
    w.add_uint32(k(KL.EXPERT_FEED_FORWARD_LENGTH), s.expert_ff)
    w.add_float32(k(KL.EXPERT_WEIGHTS_SCALE), 1.5)
    w.add_bool(k(KL.EXPERT_WEIGHTS_NORM), True)
    w.add_uint32(k(KL.EXPERT_GATING_FUNC), EXPERT_GATING_SQRT_SOFTPLUS)
    w.add_key_value(k(KL.SWIGLU_CLAMP_EXP), [10.0] * s.n_blocks, gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.FLOAT32)
    w.add_key_value(k(KL.SWIGLU_CLAMP_SHEXP), [10.0] * s.n_blocks, gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.FLOAT32)
    w.add_uint32(k(V4Keys.HYPER_CONNECTION_COUNT), s.hc_mult)
    w.add_uint32(k(V4Keys.HYPER_CONNECTION_SINKHORN_ITERATIONS), s.sinkhorn_iters)
    w.add_float32(k(V4Keys.HYPER_CONNECTION_EPSILON), 1e-6)
    w.add_uint32(k(V4Keys.HASH_LAYER_COUNT), s.hash_layers)

    add_tokenizer(w)

    for tname, shape, kind in tensor_inventory(s):
        if kind == "one":
            data = np.ones(shape, dtype=np.float32)
        elif kind == "small":
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        elif kind == "tid2eid":
            # each token routes to n_expert_used distinct experts
            data = np.argsort(rng.random((shape[0], s.n_expert)), axis=1)[:, : shape[1]].astype(np.int32)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(wdtype)
        if values and tname in values:
            data = _replacement(tname, values[tname], data)
        w.add_tensor(tname, np.ascontiguousarray(data))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _replacement(tname: str, value, drawn: np.ndarray) -> np.ndarray:
    """`value` in place of the drawn `tname`: the same shape, cast to its type."""
    arr = np.asarray(value)
    if arr.shape != drawn.shape:
        raise DgrError(f"synth_deepseek4: values[{tname!r}] has shape {arr.shape}, the tensor {drawn.shape}")
    return arr.astype(drawn.dtype)


def synth_deepseek4_v4shape(path: str | Path, *, seed: int = 0, embd: int = 64, **kw) -> Path:
    """A file with the real model's layer structure (43 main layers + MTP, 3 hash layers, hc 4) at tiny
    width: for planners and inspectors, which look at the layer structure, not at the width."""
    return synth_deepseek4(path, layers=43, embd=embd, seed=seed, hash_layers=3, mtp=True,
                           **{"n_head": 2, "o_groups": 2, "o_lora_rank": 16, "q_lora_rank": 32,
                              "expert_ff": 32, "indexer_heads": 1, **kw})


register_writer(ARCH, write=synth_deepseek4, layer_kinds=layer_kinds)
