"""Sampling on the last stage: greedy, temperature, top-k, top-p, seeded per position.

The draw for position p is keyed by (seed, p), not a running stream: re-prefilling at a new epoch after
a cache miss reproduces exactly the text the first epoch would have produced.

The same algorithm runs in C++ on the native data plane (`dgr_sample`, worker/engine/dgr_dataplane.cpp),
and a sampled token must not depend on the plane that drew it. So every step is an operation IEEE 754
rounds the same way everywhere: float64 division, subtraction, multiplication and addition one at a
time (no fused multiply-add), a stable sort, a sequential cumulative sum (numpy's `sum` adds pairwise;
`cumsum` adds in order), `exp` as a fixed polynomial (libm's and numpy's SIMD `exp` may differ in the
last bit), and an integer hash for the uniform draw. tests/test_native_plane.py checks that both give
the same token on thousands of random rows.
"""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
_LN2_HI = 6.93147180369123816490e-01        # ln 2 split in two (fdlibm's): k * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_EXP_TERMS = 13                              # Taylor terms of e^r, |r| <= ln2/2: relative error < 1e-16
_EXP_MIN = -745.0                            # e^x is 0 in float64 below this


def exp_fixed(d: np.ndarray) -> np.ndarray:
    """e^d for float64 d <= 0, by range reduction (d = k ln2 + r) and a Horner polynomial in r."""
    d = np.maximum(np.asarray(d, dtype=np.float64), _EXP_MIN)
    k = np.floor(d * _INV_LN2 + 0.5)
    r = (d - k * _LN2_HI) - k * _LN2_LO
    p = np.ones_like(r)
    for n in range(_EXP_TERMS, 0, -1):
        p = 1.0 + (r / float(n)) * p
    return np.ldexp(p, k.astype(np.int32))


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) keyed by (seed, position)."""
    x = _splitmix(_splitmix(seed & _M64) ^ (position & _M64))
    return (x >> 11) * (1.0 / (1 << 53))


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
           seed: int = 0, position: int = 0) -> int:
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature <= 0.0:
        return int(np.argmax(logits))                # the first maximum
    z = logits / np.float64(temperature)
    order = np.argsort(-z, kind="stable")             # descending, ties in index order
    if 0 < top_k < len(order):
        order = order[:top_k]
    zs = z[order]
    c = np.cumsum(exp_fixed(zs - zs[0]))              # unnormalized, in order: c[-1] is the mass
    n = len(c)
    if 0.0 < top_p < 1.0:                             # the smallest head whose share reaches top_p
        n = min(n, int(np.searchsorted(c / c[-1], np.float64(top_p), side="left")) + 1)
    target = uniform(seed, position) * c[n - 1]
    i = min(n - 1, int(np.searchsorted(c[:n], target, side="right")))
    return int(order[i])
