"""`allocate_bits`: optimal against brute force, budget met exactly, metadata counted."""

import itertools
import random
import tracemalloc

import pytest

from gact_graph.core.quantize import group_layout, quantize
from gact_graph.policy.adaptive import (
    DEFAULT_LADDER,
    allocate_bits,
    budget_bits,
    plan_cost_bits,
    tensor_costs,
)
from gact_graph.policy.sensitivity import S


def _objective(c, bits):
    return sum(cl * S(b) for cl, b in zip(c, bits))


def _brute_force(c, D, budget, ladder, meta):
    best = None
    for bits in itertools.product(ladder, repeat=len(c)):
        if plan_cost_bits(bits, D, meta) <= budget:
            v = _objective(c, bits)
            if best is None or v < best:
                best = v
    return best


def _no_upgrade_fits(bits, D, budget, ladder, meta):
    spent = plan_cost_bits(bits, D, meta)
    for i, b in enumerate(bits):
        for up in (x for x in ladder if x > b):
            trial = list(bits)
            trial[i] = up
            if plan_cost_bits(trial, D, meta) <= budget:
                return False, (i, b, up, budget - spent)
    return True, None


def _instance(rng, n, group_size=64):
    shapes = [(rng.randint(1, 40), rng.choice([8, 16, 24, 64, 100])) for _ in range(n)]
    D, meta = zip(*(tensor_costs(s, group_size) for s in shapes))
    # sensitivities spanning orders of magnitude, some exactly zero
    c = [0.0 if rng.random() < 0.1 else 10 ** rng.uniform(-4, 2) for _ in range(n)]
    return c, list(D), list(meta)


@pytest.mark.parametrize("trial", range(40))
def test_optimal_on_brute_forceable_instances_and_budget_met_exactly(trial):
    rng = random.Random(trial)
    n = rng.randint(1, 6)
    ladder = DEFAULT_LADDER if trial % 3 else (1, 2, 4, 8)
    c, D, meta = _instance(rng, n)
    avg = rng.choice([1, 1.5, 2, 2.5, 3, 4, 5.5])
    budget = budget_bits(avg, D, meta)
    bits = allocate_bits(c, D, budget, ladder, meta)
    assert len(bits) == n and all(b in ladder for b in bits)
    assert plan_cost_bits(bits, D, meta) <= budget  # never exceeded
    ok, why = _no_upgrade_fits(bits, D, budget, ladder, meta)
    assert ok, f"an upgrade still fits in the slack: {why}"
    best = _brute_force(c, D, budget, ladder, meta)
    assert _objective(c, bits) <= best * (1 + 1e-9) + 1e-15


@pytest.mark.parametrize("trial", range(10))
def test_coarse_dp_on_large_tensors_keeps_budget_and_is_near_optimal(trial):
    # real-size tensors with a tiny DP table force the rounded-up (coarse) path
    rng = random.Random(100 + trial)
    n = 5
    shapes = [(rng.randint(10_000, 200_000), rng.choice([64, 128, 256, 300])) for _ in range(n)]
    D, meta = map(list, zip(*(tensor_costs(s) for s in shapes)))
    c = [10 ** rng.uniform(-3, 3) for _ in range(n)]
    budget = budget_bits(rng.choice([2, 3, 4]), D, meta)
    bits = allocate_bits(c, D, budget, DEFAULT_LADDER, meta, max_cells=2_000)
    assert plan_cost_bits(bits, D, meta) <= budget
    assert _no_upgrade_fits(bits, D, budget, DEFAULT_LADDER, meta)[0]
    best = _brute_force(c, D, budget, DEFAULT_LADDER, meta)
    assert _objective(c, bits) <= best * 1.01


@pytest.mark.parametrize("n, rows", [(67, 1_000), (5, 200_000)])
def test_default_dp_holds_under_two_mib_and_stays_near_the_exact_plan(n, rows):
    # mixed widths make the gcd of the costs small: the exact table would be large (64-layer
    # GCNII, 1,000 nodes: 67 x 132,505 states, 7 MiB at ctl.iterate(); 5 tensors of 200,000
    # rows: 60 MiB of work buffers)
    rng = random.Random(n)
    shapes = [(rows, 64)] * (n - 2) + [(rows, 16), (rows - 3, 7)]
    D, meta = map(list, zip(*(tensor_costs(s) for s in shapes)))
    c = [10 ** rng.uniform(-3, 3) for _ in range(n)]
    budget = budget_bits(2, D, meta) * 1.37
    tracemalloc.start()
    try:
        bits = allocate_bits(c, D, budget, DEFAULT_LADDER, meta)
        held = tracemalloc.get_traced_memory()[1]  # numpy reports its buffers here
    finally:
        tracemalloc.stop()
    assert held < 2.5 * 2**20
    assert plan_cost_bits(bits, D, meta) <= budget
    assert _no_upgrade_fits(bits, D, budget, DEFAULT_LADDER, meta)[0]
    exact = allocate_bits(c, D, budget, DEFAULT_LADDER, meta, max_cells=1 << 40, max_states=1 << 40)
    assert _objective(c, bits) <= _objective(c, exact) * 1.01


@pytest.mark.parametrize("avg", [1, 2, 4, 8])
def test_integer_average_with_equal_per_element_sensitivity_is_uniform(avg):
    shapes = [(1000, 64), (300, 256), (5000, 7), (2708, 16)]
    D, meta = map(list, zip(*(tensor_costs(s) for s in shapes)))
    bits = allocate_bits(D, D, budget_bits(avg, D, meta), DEFAULT_LADDER, meta)
    assert bits == [avg] * len(shapes)
    assert plan_cost_bits(bits, D, meta) == budget_bits(avg, D, meta)  # exactly the budget


def test_fractional_average_mixes_widths_and_fills_the_budget():
    shapes = [(1000, 64)] * 6
    D, meta = map(list, zip(*(tensor_costs(s) for s in shapes)))
    budget = budget_bits(3, D, meta)
    bits = allocate_bits([1.0] * 6, D, budget, DEFAULT_LADDER, meta)
    assert sorted(bits) == [2, 2, 2, 4, 4, 4]
    assert plan_cost_bits(bits, D, meta) == budget


def test_more_sensitive_tensor_gets_more_bits():
    D, meta = map(list, zip(*(tensor_costs((1000, 64)) for _ in range(2))))
    bits = allocate_bits([1.0, 1000.0], D, budget_bits(3, D, meta), DEFAULT_LADDER, meta)
    assert bits[1] > bits[0]


def test_cost_model_is_the_bytes_a_qtensor_holds():
    import torch

    for shape in [(1000, 64), (37, 300), (4096,), (3, 5, 7), (513, 256)]:
        d, meta = tensor_costs(shape, 256)
        lay = group_layout(shape, 256)
        for b in (1, 2, 4, 8):
            q = quantize(torch.randn(shape), b, 256, seed=0)
            assert plan_cost_bits([b], [d], [meta]) == 8 * q.nbytes == 8 * lay.nbytes(b)


def test_metadata_counts_toward_the_budget():
    D, meta = tensor_costs((1000, 64))
    # the budget of 2 bits/element without metadata cannot hold 2-bit codes plus metadata
    with pytest.raises(ValueError):
        allocate_bits([1.0], [D], 2 * D, (2, 4), [meta])
    assert allocate_bits([1.0], [D], 2 * D + 8 * meta, (2, 4), [meta]) == [2]


def test_zero_sensitivity_still_spends_the_budget_and_32_is_lossless():
    D, meta = map(list, zip(*(tensor_costs((64, 64)) for _ in range(2))))
    bits = allocate_bits([0.0, 0.0], D, 64 * sum(D), DEFAULT_LADDER, meta)
    assert bits == [32, 32]
    assert S(32) == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError):
        allocate_bits([1.0], [8], 100, ladder=(3,))
    with pytest.raises(ValueError):
        allocate_bits([-1.0], [8], 100)
    with pytest.raises(ValueError):
        allocate_bits([1.0, 2.0], [8], 100)
    assert allocate_bits([], [], 0) == []
