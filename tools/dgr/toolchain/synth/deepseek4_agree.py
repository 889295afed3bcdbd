"""A synthetic DeepSeek V4 (`deepseek4`) whose MTP drafts agree with its trunk at a chosen rate.

Random-weight V4 drafts are almost never accepted, so they cannot show what speculative decoding does when
drafts are good. This writer keeps `synth_deepseek4`'s file (every tensor, every key, the whole compute
path: hyper-connections, compressed attention, hash and learned routing, the MTP block) and sets a few
tensors so that both heads are lookup tables:

* Every block's residual contribution is zero: `attn_output_b`, `ffn_down_exps` and `ffn_down_shexp` are
  zeros in the main blocks and in the MTP block (the attention, routers and experts still run on random
  weights). A hyper-connection layer then maps its streams to sum_src comb[dst, src] * stream_src with
  comb > 0 (softmax + Sinkhorn), so streams that start as copies of the token embedding e_t stay positive
  multiples of it, and so does the head's mix (sigmoid weights > 0). After `output_norm` the trunk's
  logits are output.weight @ (sqrt(embd) * e_t): the history does not matter, only the last token.
* The embeddings are orthonormal (`embd` >= n_vocab: rows of a random orthogonal matrix), and row u of
  `output.weight` is `logit` / sqrt(embd) times the sum of e_t over the tokens t with succ(t) = u. So the
  trunk's logits are exactly `logit` at succ(t) and 0 elsewhere (up to rounding): its greedy next token
  is succ(t). succ walks one cycle through the normal tokens in a seeded random order; the three control
  tokens (end-of-text among them) lead into the cycle and are never produced.
* The MTP block gets the drawn token's embedding through `nextn.eh_proj` = [P | 0]: the trunk's hidden
  state (the hnorm half) is ignored, and P = sum_t e_pi(t) e_t^T maps e_t to e_pi(t) exactly. The MTP
  output goes through the same hc head, `output_norm` and `output.weight` (the file has no
  nextn.shared_head_* tensors), so its draft after t is succ(pi(t)). pi(t) = t on the agreeing cycle
  positions (draft = the trunk's next token) and pi(t) = succ(t) elsewhere (the draft skips a token).

Acceptance. With the token x_0 just drawn and the trunk's continuation x_1, x_2, ... (x_i = succ^i(x_0)),
the k chained drafts d_1..d_k (`Engine.mtp_draft(.., x_0, k)`) satisfy: d_j == x_j exactly when x_0 ..
x_{j-1} all agree. (A draft that skipped runs ahead of the trunk by 1..j cycle steps and cannot come back;
the cycle is longer than any draft.) So a verification step accepts the run of agreeing tokens that starts
at x_0, capped at k. `agree` = r marks round(r * L) of the L cycle positions as agreeing: at random
positions (`spread="random"`, the default: about independent, so draft j matches at rate ~ r**j and a
step accepts r + r**2 + ... + r**k drafts on average) or evenly spaced (`spread="even"`: any window of
n positions holds n * r agreeing ones to within one, but the pattern is periodic and a speculative run can
lock onto it: at 0.8 with 4 drafts every step starts a run of 4 and accepts all 4). `agreement_layout`
rebuilds the layout from (agree, seed, spread) and gives exact predictions: `matches`, `accepted`, `rates`
(over a whole cycle) and `speculate` (a speculative greedy run). With seed 0 and 4 drafts, `rates` is
[.80, .63, .47, .36] at 0.8 and [.50, .25, .11, .05] at 0.5. The engine drafts only on an include_mtp
last stage (`dgr.mtp` set): build a bundle with `include_mtp = true`, or set the key on a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from dgr.core.errors import DgrError
from dgr.toolchain.synth.deepseek4 import ARCH, DeepSeek4Shape, make_shape, synth_deepseek4, tensor_inventory
from dgr.toolchain.synth.tokenizer import tokenizer_vocab

SPREADS = ("random", "even")
DEFAULT_EMBD = 272   # the smallest multiple of 16 that holds the synthetic vocabulary (267) orthonormally
_NORMAL = 1          # gguf.TokenType.NORMAL
_LAYOUT_SALT = 0xA9EE  # the layout's random stream, apart from the weights' (seeded by `seed` alone)


def _bad(what: str) -> DgrError:
    return DgrError(f"dgr synth --arch {ARCH} --mtp-agree: {what}")


@dataclass(frozen=True)
class AgreeLayout:
    """Which token follows which in the trunk, and where the MTP block's draft agrees with it.

    `cycle` holds the normal tokens in successor order (the trunk's greedy next token after cycle[i] is
    cycle[i + 1], wrapping); `agree[i]` says whether the MTP draft after cycle[i] is that token too (else
    it is cycle[i + 2]). Tokens outside the cycle (the control tokens) lead to cycle[0], and agree."""

    cycle: tuple[int, ...]
    agree: tuple[bool, ...]
    n_vocab: int

    @property
    def length(self) -> int:
        return len(self.cycle)

    @property
    def rate(self) -> float:
        """The fraction of cycle positions whose first draft agrees (round(agree * L) / L)."""
        return sum(self.agree) / self.length

    @cached_property
    def _pos(self) -> dict[int, int]:
        return {t: i for i, t in enumerate(self.cycle)}

    def succ(self, t: int) -> int:
        """The trunk's greedy next token after `t`."""
        i = self._pos.get(int(t))
        return self.cycle[0] if i is None else self.cycle[(i + 1) % self.length]

    def agrees(self, t: int) -> bool:
        i = self._pos.get(int(t))
        return True if i is None else self.agree[i]

    def draft(self, t: int) -> int:
        """The MTP block's greedy draft after `t`: succ(t) where `t` agrees, else succ(succ(t))."""
        n = self.succ(t)
        return n if self.agrees(t) else self.succ(n)

    def walk(self, t: int, n: int) -> list[int]:
        """The trunk's next `n` greedy tokens after `t`."""
        out = []
        for _ in range(n):
            t = self.succ(t)
            out.append(t)
        return out

    def drafts(self, t: int, k: int) -> list[int]:
        """The k chained drafts after `t` (each drafted after the previous one)."""
        out = []
        for _ in range(k):
            t = self.draft(t)
            out.append(t)
        return out

    def matches(self, t: int, k: int) -> list[bool]:
        """Whether each of the k drafts after `t` equals the trunk's token at its position."""
        return [d == x for d, x in zip(self.drafts(t, k), self.walk(t, k))]

    def accepted(self, t: int, k: int) -> int:
        """Drafts a greedy verification step accepts after `t`: the leading matches."""
        m = self.matches(t, k)
        return m.index(False) if False in m else k

    def rates(self, k: int) -> list[float]:
        """Over every cycle position as the drawn token: the fraction at which draft j (1..k) matches.
        Their sum is the mean number of drafts a step accepts when steps start at uniform positions."""
        hits = np.zeros(k)
        for t in self.cycle:
            hits += np.array(self.matches(t, k), dtype=float)
        return list(hits / self.length)

    def speculate(self, t: int, k: int, n_steps: int) -> list[int]:
        """Drafts accepted at each of `n_steps` steps of speculative greedy decoding with k MTP drafts,
        starting from the drawn token `t` (each step moves on by accepted + 1 tokens)."""
        out = []
        for _ in range(n_steps):
            a = self.accepted(t, k)
            out.append(a)
            t = self.walk(t, a + 1)[-1]
        return out


def agreement_layout(agree: float, *, seed: int = 0, spread: str = "random") -> AgreeLayout:
    """The layout `synth_deepseek4_agreeing(.., agree=agree, seed=seed, spread=spread)` writes."""
    if not 0.0 <= agree <= 1.0:
        raise _bad(f"the agreement rate must be in [0, 1], got {agree}")
    if spread not in SPREADS:
        raise _bad(f"spread must be one of {', '.join(SPREADS)}, got {spread!r}")
    tokens, types, _ = tokenizer_vocab()
    normal = np.array([i for i, ty in enumerate(types) if ty == _NORMAL], dtype=np.int64)
    rng = np.random.default_rng([seed, _LAYOUT_SALT])
    cycle = tuple(int(t) for t in rng.permutation(normal))
    n_len = len(cycle)
    n_agree = int(round(agree * n_len))
    if spread == "random":
        mask = np.zeros(n_len, dtype=bool)
        mask[rng.permutation(n_len)[:n_agree]] = True
    else:  # evenly spaced: position i agrees when floor(i * n / L) steps up at i
        idx = np.arange(n_len)
        mask = ((idx + 1) * n_agree) // n_len > (idx * n_agree) // n_len
    return AgreeLayout(cycle=cycle, agree=tuple(bool(x) for x in mask), n_vocab=len(tokens))


# what each block adds to the residual stream (attention output, routed and shared experts' down projections)
_RESIDUAL_WRITERS = ("attn_output_b.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def agreeing_values(layout: AgreeLayout, shape: DeepSeek4Shape, *, seed: int = 0,
                    logit: float = 16.0) -> dict[str, np.ndarray]:
    """The tensors `synth_deepseek4_agreeing` sets (name -> numpy array in the writer's shapes) for a model
    of this shape (with MTP, `embd` >= the vocabulary)."""
    V, E = layout.n_vocab, shape.embd
    if E < V:
        raise _bad(f"--embd must be at least the vocabulary size ({V}) for orthonormal embeddings, got {E}; "
                   f"use {DEFAULT_EMBD}")
    rng = np.random.default_rng([seed, _LAYOUT_SALT, 1])
    q, r = np.linalg.qr(rng.standard_normal((E, V)))
    emb = (q * np.sign(np.diag(r))).T                      # [V, E], orthonormal rows
    succ = np.array([layout.succ(t) for t in range(V)])
    pi = np.array([t if layout.agrees(t) else layout.succ(t) for t in range(V)])
    out_w = np.zeros((V, E))
    np.add.at(out_w, succ, emb)                            # row u: the sum of e_t over succ(t) = u
    eh = np.zeros((E, 2 * E))
    eh[:, :E] = emb[pi].T @ emb                            # e_t -> e_pi(t); the hidden-state half stays 0
    f32 = np.float32
    vals = {"token_embd.weight": emb.astype(f32), "output.weight": (out_w * (logit / np.sqrt(E))).astype(f32),
            f"blk.{shape.layers}.nextn.eh_proj.weight": eh.astype(f32)}
    for name, shp, _ in tensor_inventory(shape):
        if name.startswith("blk.") and name.split(".", 2)[2] in _RESIDUAL_WRITERS:
            vals[name] = np.zeros(shp, dtype=f32)
    return vals


def synth_deepseek4_agreeing(
    path: str | Path,
    *,
    agree: float,
    layers: int = 6,
    embd: int = DEFAULT_EMBD,
    seed: int = 0,
    hash_layers: int | None = 3,
    spread: str = "random",
    logit: float = 16.0,
    dtype: str = "f32",
    **kw,
) -> Path:
    """Write a `deepseek4` GGUF (with its MTP block) whose greedy MTP drafts agree with the trunk's greedy
    tokens at rate `agree` (module docstring); returns `path`. `agreement_layout(agree, seed=seed,
    spread=spread)` tells which tokens follow which and where drafts agree. `logit`: the winning logit of
    both heads (the rest are 0). Other keywords go to `synth_deepseek4` (compress_ratios, n_experts, ...;
    `mtp` must stay on)."""
    if not kw.pop("mtp", True):
        raise _bad("the model needs its MTP block (mtp=True)")
    if logit <= 0:
        raise _bad(f"logit must be > 0, got {logit}")
    layout = agreement_layout(agree, seed=seed, spread=spread)
    shape = make_shape(layers=layers, embd=embd, hash_layers=hash_layers, mtp=True,
                       **{k: v for k, v in kw.items() if k != "scale"})
    values = agreeing_values(layout, shape, seed=seed, logit=logit)
    tag = f"agree{agree:.2f}" + ("" if spread == "random" else f"-{spread}")
    return synth_deepseek4(
        path, layers=layers, embd=embd, seed=seed, hash_layers=hash_layers, mtp=True, dtype=dtype,
        values=values, name=f"dgr-synth-{ARCH}-{tag}-L{layers}+mtp-E{embd}-s{seed}",
        description=(f"dgr synth --arch {ARCH} --layers {layers} --embd {embd} --seed {seed} --mtp-agree {agree}: "
                     f"MTP drafts agree with the trunk at {layout.rate:.4f} of the cycle's "
                     f"{layout.length} tokens ({spread} spread); the layout is "
                     f"dgr.toolchain.synth.deepseek4_agree.agreement_layout({agree}, seed={seed}, "
                     f"spread={spread!r})"),
        **kw)
