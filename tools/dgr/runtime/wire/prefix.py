"""Addresses of the prefix cache (docs/worker.md "Prefix cache"): a chain of hashes over blocks of token ids.

Block j's hash covers the tokens [0, (j+1) * PREFIX_BLOCK_TOKENS): it is BLAKE3 over the previous block's hash
and this block's ids (int32, little-endian). Two sequences share the hash of block j exactly when they share
their first (j+1) * PREFIX_BLOCK_TOKENS tokens. Each worker adds what else its state depends on (its stage,
the boundary dtype it received). The client sends them when it opens a session (the prompt's blocks) and when
it closes one (the blocks of every token the session ran), so workers never see a token they were not sent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import blake3
import numpy as np

PREFIX_BLOCK_TOKENS = 32
_SEED = b"dgr-prefix-v1"
HASH_BYTES = 16


def block_hashes(ids: Sequence[int], block_tokens: int = PREFIX_BLOCK_TOKENS) -> list[bytes]:
    """The hash of every whole block of `ids`, in order."""
    out: list[bytes] = []
    h = _SEED
    arr = np.asarray(ids, dtype="<i4")
    for j in range(len(arr) // block_tokens):
        h = blake3.blake3(h + arr[j * block_tokens:(j + 1) * block_tokens].tobytes()).digest(HASH_BYTES)
        out.append(h)
    return out


def prompt_blocks(ids: Sequence[int], block_tokens: int = PREFIX_BLOCK_TOKENS) -> list[bytes]:
    """The blocks a new session may restore: only those that end before the prompt's last token, whose
    logits row the last stage must compute."""
    return block_hashes(list(ids)[: max(0, len(ids) - 1)], block_tokens)


class PrefixRoutes:
    """Where conversations' prefixes were left: for each block hash (dgr.runtime.wire.prefix) the route of the last
    session that ran it and closed. RouteClients that share one (a gateway's pool) open a session whose prompt
    begins with a remembered prefix on that route, where every hop kept it. Thread-safe; at most `capacity`
    blocks, least recently remembered first out."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._routes: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, blocks: Sequence[bytes], route: Sequence[str]) -> None:
        r = tuple(route)
        with self._lock:
            for b in blocks:
                self._routes[b] = r
                self._routes.move_to_end(b)
            while len(self._routes) > self.capacity:
                self._routes.popitem(last=False)

    def lookup(self, blocks: Sequence[bytes]) -> tuple[str, ...] | None:
        """The route that kept the longest of these prefixes, or None."""
        with self._lock:
            for b in reversed(blocks):
                if b in self._routes:
                    return self._routes[b]
        return None
