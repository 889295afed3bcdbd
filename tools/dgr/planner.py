"""Placement: from workers' memory (and relative speed) to half-open layer ranges. Pure and deterministic.

One stage per worker, in the order the workers are listed (the pipeline order). A stage's weight
bytes are its layers' bytes plus the tensors only it carries (token embedding on the first stage,
output norm and head on the last) plus tables every stage carries. The plan minimises the slowest
stage's bytes / speed (bytes stand in for time: a forward pass reads every weight once) subject to
each stage fitting its worker's memory; among equally good plans the one with the earliest cuts wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr.errors import RecipeError


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    memory: int
    speed: float = 1.0


@dataclass(frozen=True)
class Plan:
    ranges: tuple[tuple[int, int], ...]
    stage_bytes: tuple[int, ...]


def stage_bytes(layer_bytes: list[int], begin: int, end: int, index: int, count: int,
                input_bytes: int, output_bytes: int, shared_bytes: int) -> int:
    b = sum(layer_bytes[begin:end]) + shared_bytes
    if index == 0:
        b += input_bytes
    if index == count - 1:
        b += output_bytes
    return b


def plan(layer_bytes: list[int], workers: list[WorkerSpec], *, input_bytes: int = 0,
         output_bytes: int = 0, shared_bytes: int = 0) -> Plan:
    """Contiguous ranges covering every layer once, one per worker, fitting memory, balanced."""
    n, k = len(layer_bytes), len(workers)
    if k == 0:
        raise RecipeError("placement.workers: no workers to place layers on")
    if k > n:
        raise RecipeError(f"placement.workers: {k} workers but the model has only {n} layers; "
                          f"list at most {n} workers (each stage holds at least one layer)")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(j: int, a: int, b: int) -> float | None:
        w = workers[j]
        total = prefix[b] - prefix[a] + shared_bytes + (input_bytes if j == 0 else 0) \
            + (output_bytes if j == k - 1 else 0)
        if total > w.memory:
            return None
        return total / w.speed

    inf = float("inf")
    # best[j][b]: minimal max-cost placing layers [0, b) on workers 0..j; cut[j][b]: where stage j starts.
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[-1] * (n + 1) for _ in range(k)]
    for b in range(1, n + 1):
        c = cost(0, 0, b)
        if c is not None:
            best[0][b] = c
            cut[0][b] = 0
    for j in range(1, k):
        for b in range(j + 1, n + 1):
            for a in range(j, b):
                if best[j - 1][a] == inf:
                    continue
                c = cost(j, a, b)
                if c is None:
                    continue
                m = max(best[j - 1][a], c)
                if m < best[j][b]:  # strict: the earliest cut wins ties
                    best[j][b] = m
                    cut[j][b] = a
    if best[k - 1][n] == inf:
        total = prefix[n] + input_bytes + output_bytes + shared_bytes * k
        mem = sum(w.memory for w in workers)
        raise RecipeError(
            f"placement.workers: the model does not fit: it needs {total} bytes of weights over {k} stages "
            f"(largest layer {max(layer_bytes)} bytes, first stage also {input_bytes}, last also {output_bytes}) "
            f"and the workers have {mem} bytes together ({', '.join(f'{w.name}={w.memory}' for w in workers)}); "
            f"add workers or memory, or quantize to a smaller type")
    ranges: list[tuple[int, int]] = []
    b = n
    for j in range(k - 1, -1, -1):
        a = cut[j][b]
        ranges.append((a, b))
        b = a
    ranges.reverse()
    sizes = tuple(stage_bytes(layer_bytes, a, b, i, k, input_bytes, output_bytes, shared_bytes)
                  for i, (a, b) in enumerate(ranges))
    return Plan(tuple(ranges), sizes)
