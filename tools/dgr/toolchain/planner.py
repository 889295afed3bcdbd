"""Placement: from workers' memory (and relative speed) to half-open layer ranges. Pure and deterministic.

One stage per worker, in the order the workers are listed (the pipeline order). Two measures per stage:

- memory: its layers' bytes plus the tensors only it carries (token embedding on the first stage, output
  norm and head on the last) plus tables every stage carries. Each stage must fit its worker's memory.
- work: the bytes a token's forward pass reads there (decoding is bound by reading every weight once):
  its layers' bytes, plus the output head on the last stage. The token embedding is memory only (a
  lookup reads one row per token), and so are the small shared tables.

The plan minimises the slowest stage's work / speed subject to each stage fitting; among equally good
plans the one with the earliest cuts wins. So the last stage of a large-vocabulary model, whose head
weighs as much as several layers, gets fewer layers; the first keeps its share of layers however big
the embedding is, as long as it fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from dgr.core.errors import RecipeError

# The memory of a worker that has no limit (a scaffold balancing stages by work alone).
UNLIMITED = 1 << 62


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    memory: int
    speed: float = 1.0


@dataclass(frozen=True)
class Plan:
    ranges: tuple[tuple[int, int], ...]
    stage_bytes: tuple[int, ...]        # memory each stage holds
    stage_work: tuple[int, ...] = ()    # bytes each stage reads per token (the balanced measure)


def stage_bytes(layer_bytes: list[int], begin: int, end: int, index: int, count: int,
                input_bytes: int, output_bytes: int, shared_bytes: int) -> int:
    """The memory stage `index` of `count` holds with layers [begin, end)."""
    b = sum(layer_bytes[begin:end]) + shared_bytes
    if index == 0:
        b += input_bytes
    if index == count - 1:
        b += output_bytes
    return b


def stage_work(layer_bytes: list[int], begin: int, end: int, index: int, count: int, output_bytes: int) -> int:
    """The bytes stage `index` of `count` reads per token with layers [begin, end): its layers, and the head
    on the last stage (the token embedding is a lookup: memory, not work)."""
    return sum(layer_bytes[begin:end]) + (output_bytes if index == count - 1 else 0)


def plan(layer_bytes: list[int], workers: list[WorkerSpec], *, input_bytes: int = 0,
         output_bytes: int = 0, shared_bytes: int = 0) -> Plan:
    """Contiguous ranges covering every layer once, one per worker, fitting memory, balancing work / speed."""
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
        layers = prefix[b] - prefix[a]
        memory = layers + shared_bytes + (input_bytes if j == 0 else 0) + (output_bytes if j == k - 1 else 0)
        if memory > w.memory:
            return None
        return (layers + (output_bytes if j == k - 1 else 0)) / w.speed

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
    work = tuple(stage_work(layer_bytes, a, b, i, k, output_bytes) for i, (a, b) in enumerate(ranges))
    return Plan(tuple(ranges), sizes, work)


def balanced(layer_bytes: list[int], n_stages: int, *, input_bytes: int = 0, output_bytes: int = 0,
             shared_bytes: int = 0) -> Plan:
    """`n_stages` equal workers without a memory limit: the ranges that balance work alone."""
    return plan(layer_bytes, [WorkerSpec(f"stage{i}", UNLIMITED) for i in range(n_stages)],
                input_bytes=input_bytes, output_bytes=output_bytes, shared_bytes=shared_bytes)
