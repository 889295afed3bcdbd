"""Sampling on the last stage (numpy): greedy, temperature, top-k, top-p, seeded per position.

The draw for position p uses a generator seeded by (seed, p), not a running stream: re-prefilling at a
new epoch after a cache miss reproduces exactly the text the first epoch would have produced.
"""

from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
           seed: int = 0, position: int = 0) -> int:
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    if 0 < top_k < len(order):
        order = order[:top_k]
    z = z[order]
    p = np.exp(z - z.max())
    p /= p.sum()
    if 0.0 < top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    rng = np.random.default_rng([seed, position])
    return int(order[rng.choice(len(order), p=p)])
