"""The synthetic models' tokenizer: a byte-level GPT-2 style BPE (the 256 byte symbols, a few merges,
three control tokens), written the same way by every synthetic writer."""
from __future__ import annotations

import gguf

# A few merges so the BPE path is exercised; each merged token is added to the vocabulary.
_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("r", "e"))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_symbols() -> list[str]:
    """The GPT-2 byte-to-symbol table: printable bytes map to themselves, the rest to U+0100 onwards."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


def tokenizer_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the synthetic byte-level BPE tokenizer."""
    tokens = byte_symbols() + ["".join(m) for m in _MERGES] + list(SPECIALS)
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in _MERGES]


def add_tokenizer(w: gguf.GGUFWriter, vocab: int | None = None) -> None:
    """Write the synthetic byte-level BPE tokenizer's metadata (shared by every synthetic writer); `vocab` pads the
    token list with unused tokens to a real model's head width (dgr.toolchain.synth.shapes)."""
    tokens, types, merges = tokenizer_vocab()
    if vocab is not None:
        if vocab < len(tokens):
            raise ValueError(f"a vocabulary of {vocab} is smaller than the synthetic tokenizer's {len(tokens)} tokens")
        pad = vocab - len(tokens)
        tokens, types = tokens + [f"<|unused_{k}|>" for k in range(pad)], types + [int(gguf.TokenType.NORMAL)] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(SPECIALS[0]))
    w.add_eos_token_id(tokens.index(SPECIALS[0]))
    w.add_add_bos_token(False)
