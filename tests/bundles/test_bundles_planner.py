"""Placement planner properties: cover every layer once, respect memory, balance work (optimal vs brute force),
and weigh the output head (work and memory) and the token embedding (memory only) as they really are."""

from __future__ import annotations

import itertools
import random

import pytest

from dgr.core.errors import RecipeError
from dgr.toolchain.planner import WorkerSpec, balanced, plan, stage_bytes, stage_work


def brute_force(layer_bytes, workers, inp, out, shared):
    n, k = len(layer_bytes), len(workers)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + cuts + (n,)
        costs = []
        for j in range(k):
            b = stage_bytes(layer_bytes, bounds[j], bounds[j + 1], j, k, inp, out, shared)
            if b > workers[j].memory:
                break
            costs.append(stage_work(layer_bytes, bounds[j], bounds[j + 1], j, k, out) / workers[j].speed)
        else:
            m = max(costs)
            if best is None or m < best:
                best = m
    return best


@pytest.mark.parametrize("seed", range(40))
def test_plan_properties_random(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    k = rng.randint(1, min(n, 4))
    layer_bytes = [rng.randint(1, 100) for _ in range(n)]
    inp, out, shared = rng.randint(0, 150), rng.randint(0, 150), rng.randint(0, 5)
    total = sum(layer_bytes) + inp + out + shared * k
    workers = [WorkerSpec(f"w{j}", rng.randint(total // k, total), rng.choice([0.5, 1.0, 2.0, 3.0]))
               for j in range(k)]
    optimum = brute_force(layer_bytes, workers, inp, out, shared)
    if optimum is None:
        with pytest.raises(RecipeError, match="does not fit"):
            plan(layer_bytes, workers, input_bytes=inp, output_bytes=out, shared_bytes=shared)
        return
    p = plan(layer_bytes, workers, input_bytes=inp, output_bytes=out, shared_bytes=shared)
    # covers all layers exactly once, contiguous, half-open, one non-empty range per worker
    assert len(p.ranges) == k and p.ranges[0][0] == 0 and p.ranges[-1][1] == n
    assert all(a < b for a, b in p.ranges) and all(p.ranges[i][1] == p.ranges[i + 1][0] for i in range(k - 1))
    # respects memory
    assert all(sb <= w.memory for sb, w in zip(p.stage_bytes, workers))
    # balanced: no plan has a lower slowest stage (work: layers, plus the head on the last)
    assert max(sw / w.speed for sw, w in zip(p.stage_work, workers)) == pytest.approx(optimum)
    # deterministic
    assert plan(layer_bytes, workers, input_bytes=inp, output_bytes=out, shared_bytes=shared) == p


def test_plan_uniform_layers_split_evenly_and_speed_shifts_work():
    even = plan([10] * 12, [WorkerSpec("a", 10**6), WorkerSpec("b", 10**6), WorkerSpec("c", 10**6)])
    assert even.ranges == ((0, 4), (4, 8), (8, 12))
    fast_first = plan([10] * 12, [WorkerSpec("a", 10**6, 2.0), WorkerSpec("b", 10**6, 1.0)])
    assert fast_first.ranges == ((0, 8), (8, 12))


def test_plan_respects_a_small_worker_and_reports_misfits():
    p = plan([10] * 10, [WorkerSpec("big", 1000), WorkerSpec("small", 25)])
    assert p.ranges == ((0, 8), (8, 10)) and p.stage_bytes == (80, 20)
    with pytest.raises(RecipeError, match="does not fit.*big=50, small=25"):
        plan([10] * 10, [WorkerSpec("big", 50), WorkerSpec("small", 25)])
    with pytest.raises(RecipeError, match="3 workers but the model has only 2 layers"):
        plan([1, 1], [WorkerSpec("a", 9), WorkerSpec("b", 9), WorkerSpec("c", 9)])


def test_a_heavy_head_takes_layers_off_the_last_stage():
    """12 layers of 10 and an output head of 40 (a large vocabulary): the last stage, which also runs the
    head, gets fewer layers; counting layers alone would give 6 and 6 (and a last stage of 100 against 60)."""
    p = plan([10] * 12, [WorkerSpec("a", 10**6), WorkerSpec("b", 10**6)], output_bytes=40)
    assert p.ranges == ((0, 8), (8, 12))
    assert p.stage_work == (80, 80) and p.stage_bytes == (80, 80)
    assert balanced([10] * 12, 3, output_bytes=40).ranges == ((0, 5), (5, 10), (10, 12))


def test_the_embedding_weighs_memory_not_work():
    """A token embedding is a lookup (one row per token): it must fit the first stage's memory but does not
    slow it down, so it does not push layers off the first stage."""
    p = plan([10] * 12, [WorkerSpec("a", 10**6), WorkerSpec("b", 10**6)], input_bytes=50)
    assert p.ranges == ((0, 6), (6, 12))
    assert p.stage_bytes == (110, 60) and p.stage_work == (60, 60)
    # ...but it still has to fit: with room for the embedding and 4 layers only, the first stage takes 4
    tight = plan([10] * 12, [WorkerSpec("a", 90), WorkerSpec("b", 10**6)], input_bytes=50)
    assert tight.ranges == ((0, 4), (4, 12))
