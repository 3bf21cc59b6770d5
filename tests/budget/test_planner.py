"""The planner's program: the MILP against brute force, the greedy fallback, infeasibility;
size classes: plans scaled from a profile for a batch of another size."""

import itertools
import random

import pytest
import torch

from gact_graph.budget.planner import (
    Option,
    Unit,
    greedy_plan,
    least_plan,
    smallest_memory,
    solve_plan,
)


def _units(seed: int, n: int = 4) -> list[Unit]:
    rng = random.Random(seed)
    units = []
    for i in range(n):
        size = rng.randint(1_000, 100_000)
        opts = [Option("keep", 32, size, 0, 0.0, 0.0)]
        for b in (2, 4, 8):
            opts.append(Option("compress", b, size * b // 32, 0, rng.uniform(1, 3) / b, 1.0 / b))
        opts.append(Option("recompute", 2, size // 64, size // 16, rng.uniform(2, 6), 0.5))
        units.append(Unit(f"u{i}", "segment", opts, size))
    return units


def _brute(units, capacity, var_cap):
    best = None
    for combo in itertools.product(*[u.options for u in units]):
        mem = sum(o.resident for o in combo) + max(o.transient for o in combo)
        var = sum(o.variance for o in combo)
        if mem > capacity or (var_cap is not None and var > var_cap):
            continue
        t = sum(o.seconds for o in combo)
        if best is None or t < best - 1e-12:
            best = t
    return best


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force(seed):
    units = _units(seed)
    total = sum(u.orig_bytes for u in units)
    for frac, var_cap in [(0.5, None), (0.2, None), (0.3, 1.5)]:
        cap = frac * total
        want = _brute(units, cap, var_cap)
        plan = solve_plan(units, cap, var_cap)
        if want is None:
            assert plan is None
            continue
        assert plan is not None and plan.solver == "milp"
        assert plan.memory <= cap
        assert var_cap is None or plan.variance <= var_cap * (1 + 1e-9)
        assert plan.seconds == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_fallback_is_feasible(seed):
    units = _units(seed)
    cap = 0.3 * sum(u.orig_bytes for u in units)
    plan = solve_plan(units, cap, 2.0, solver="greedy")
    optimum = _brute(units, cap, 2.0)
    if optimum is None:
        assert plan is None
        return
    assert plan is not None and plan.solver == "greedy"
    assert plan.memory <= cap and plan.variance <= 2.0 * (1 + 1e-9)
    assert plan.seconds >= optimum - 1e-9


def test_largest_transient_counts_once():
    a = Unit("a", "segment", [Option("recompute", 2, 10, 100, 1.0)], 0)
    b = Unit("b", "segment", [Option("recompute", 2, 10, 60, 1.0)], 0)
    assert solve_plan([a, b], 120).memory == 120  # 10 + 10 + max(100, 60)
    assert solve_plan([a, b], 119) is None
    assert greedy_plan([a, b], 119) is None


def test_smallest_memory_is_a_lower_bound_of_feasible_plans():
    units = _units(3)
    least, solver = smallest_memory(units)
    assert solver == "milp"
    assert solve_plan(units, least) is not None
    assert solve_plan(units, least - 1) is None


@pytest.mark.parametrize("seed", range(4))
def test_least_plan_holds_the_brute_force_least_memory(seed):
    units = _units(seed)
    for var_cap in (None, 2.0):
        combos = [
            c for c in itertools.product(*[u.options for u in units])
            if var_cap is None or sum(o.variance for o in c) <= var_cap * (1 + 1e-9)
        ]  # fmt: skip
        want = min(sum(o.resident for o in c) + max(o.transient for o in c) for c in combos)
        plan = least_plan(units, var_cap)
        assert set(plan.choice) == {u.name for u in units} and plan.solver == "milp"
        assert plan.memory == want
        assert var_cap is None or plan.variance <= var_cap * (1 + 1e-9)
        assert smallest_memory(units, var_cap) == (want, "milp")


def test_time_is_minimized_when_memory_allows():
    u = Unit("t", "tensor", [Option("keep", 32, 100, 0, 0.0), Option("compress", 2, 7, 0, 1.0)])
    assert solve_plan([u], 1000).choice["t"].mode == "keep"
    assert solve_plan([u], 50).choice["t"].bits == 2


def test_unit_without_options_is_an_error():
    with pytest.raises(ValueError, match="no option"):
        solve_plan([Unit("x", "tensor", [])], 10)


def test_load_solver_solves_once_per_process(monkeypatch):
    """The solver's first runs page its code in: `load_solver` (at attach) does it once per
    process, so no measured step pays it (planned steps held 1.4 MiB more without it)."""
    pytest.importorskip("scipy.optimize")
    from gact_graph.budget import planner

    capacities = []
    real = planner._milp

    def counted(units, capacity, *args):
        capacities.append(capacity)
        return real(units, capacity, *args)

    monkeypatch.setattr(planner, "_milp", counted)
    monkeypatch.setattr(planner, "_WARMED", False)
    assert planner.load_solver()
    # least memory, then least time above it, below it (infeasible) and without a cap
    assert capacities[0] is None and len(capacities) == 4
    assert capacities[2] < capacities[1] and capacities[2] < capacities[3]
    assert planner.load_solver() and len(capacities) == 4


def test_a_batch_larger_than_every_size_class_gets_a_plan_scaled_from_the_nearest_profile():
    """A mini-batch a little larger than the profiled one, whose plan no longer fits once
    scaled: solved again from that profile with its bytes scaled (no 1-bit profile step),
    within the budget's margin; refused (None) when no plan fits even so."""
    from gact_graph.budget.planner import Option, Plan, Unit
    from gact_graph.budget.state import PlanState, SizeClasses

    def unit(name):
        return Unit(
            name,
            "tensor",
            [
                Option("keep", 32, 1000, seconds=0.0),
                Option("compress", 4, 130, seconds=1.0),
                Option("compress", 2, 70, seconds=2.0),
            ],
        )

    units = [unit("a"), unit("b")]
    profiled = ((100, 16), "torch.float32", "cpu"), ((2, 400), "torch.int64", "cpu")
    plan = Plan({"a": units[0].options[1], "b": units[1].options[1]})  # 4 bits: 260
    state = PlanState(profiled, plan, units, rest=100, fixed=50, transient=40,
                      variance_cap=None, profile_step=0)  # fmt: skip
    classes = SizeClasses()
    classes.add(state, limit=8)
    budget, margin = 500, 0.1  # usable 450: the profiled shape predicts 450
    assert state.predicted == 450
    larger = ((110, 16), "torch.float32", "cpu"), ((2, 440), "torch.int64", "cpu")
    assert classes.find(larger, budget, margin) == (None, 1.0)  # 4 bits scaled: 486 > 450
    rescaled = classes.rescaled(larger, budget, margin)
    assert rescaled is not None and rescaled.signature == larger
    assert rescaled.fixed == 55 and rescaled.transient == 44
    assert {o.bits for o in rescaled.plan.choice.values()} <= {2, 4}
    assert 2 in {o.bits for o in rescaled.plan.choice.values()}
    assert rescaled.predicted <= budget * (1 - margin)
    assert state.plan is plan and state.fixed == 50  # the profiled class is unchanged
    much_larger = ((400, 16), "torch.float32", "cpu"), ((2, 1600), "torch.int64", "cpu")
    assert classes.rescaled(much_larger, budget, margin) is None
    twice = ((200, 16), "torch.float32", "cpu"), ((2, 800), "torch.int64", "cpu")
    assert classes.rescaled(twice, 10**6, margin) is None  # far from the profile: profile again


def _classes_where_a_larger_batch_fits_only_below_the_bound():
    """A size class profiled at 100 nodes whose plan (2 bits, variance 8, its cap) predicts
    330 of a usable 360 (budget 400, margin 0.1): scaled to 1.2x, 2 + 2 bits hold 168 of the
    152 bytes free, 2 + 1 bits 132 but add variance 20 > 8. Returns the classes, the profiled
    state, the budget and margin."""
    from gact_graph.budget.planner import Option, Plan, Unit
    from gact_graph.budget.state import PlanState, SizeClasses

    def unit(name):
        return Unit(name, "tensor", [
            Option("keep", 32, 1000, seconds=0.0),
            Option("compress", 2, 70, seconds=2.0, variance=4.0),
            Option("compress", 1, 40, seconds=3.0, variance=16.0),
        ])  # fmt: skip

    units = [unit("a"), unit("b")]
    plan = Plan({"a": units[0].options[1], "b": units[1].options[1]})  # 2 bits: 140, var 8
    state = PlanState(_sig(100), plan, units, rest=100, fixed=50, transient=40,
                      variance_cap=8.0, profile_step=0)  # fmt: skip
    classes = SizeClasses()
    classes.add(state, limit=8)
    return classes, state, 400, 0.1


def _sig(nodes: int) -> tuple:
    """The input signature of a batch of ``nodes`` nodes and 4 edges per node."""
    return ((nodes, 16), "torch.float32", "cpu"), ((2, 4 * nodes), "torch.int64", "cpu")


def test_a_batch_that_fits_only_below_the_accuracy_bound_gets_a_relaxed_scaled_plan():
    """A mini-batch a little larger than the profiled one, where every plan within the
    class's accuracy bound (its variance cap) is too large once scaled but one below it
    fits: that plan, solved from the profile with the bound relaxed as a profile's own plan
    is (``relaxed="relaxed"``), instead of None (a 1-bit profile step). A class of it admits
    a larger shape only within the budget's margin (only a plan admitted by the profile
    step's measurement is judged against the budget itself)."""
    classes, state, budget, margin = _classes_where_a_larger_batch_fits_only_below_the_bound()
    assert state.predicted == 330
    larger = _sig(120)  # 1.2x
    assert classes.find(larger, budget, margin) == (None, 1.0)  # 2 bits scaled: 376 > 360
    rescaled = classes.rescaled(larger, budget, margin)
    assert rescaled is not None and rescaled.relaxed == "relaxed"
    assert rescaled.variance_cap is None
    assert 1 in {o.bits for o in rescaled.plan.choice.values()}
    assert rescaled.predicted <= budget * (1 - margin)
    assert state.relaxed == "" and state.variance_cap == 8.0  # the profiled class unchanged
    classes.add(rescaled, limit=8)
    # 10 % beyond the relaxed class: 364 predicted, within the budget but not its margin
    found, scale = classes.find(_sig(132), budget, margin)
    assert found is None, (found, scale)


def test_the_planner_warns_once_when_a_rescaled_plan_relaxes_the_accuracy_bound():
    """`BudgetPlanner` says, once per run, that a batch's plan scaled from a profile is below
    the accuracy bound, naming the scale; a rescaled plan within the bound says nothing."""
    import warnings

    from gact_graph import compress_gnn

    classes, _, budget, margin = _classes_where_a_larger_batch_fits_only_below_the_bound()
    ctl = compress_gnn(torch.nn.Linear(16, 16), memory_budget=budget, budget_margin=margin)
    try:
        planner = ctl.budget
        planner.size_classes = classes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            within, _ = planner._size_class(_sig(104))  # 2 bits scaled: 343 of 360
            assert within is not None and within.relaxed == ""
            assert not [w for w in caught if "accuracy bound" in str(w.message)]
            first, _ = planner._size_class(_sig(120))
            second, _ = planner._size_class(_sig(135))  # beyond every class: rescaled again
        assert first.relaxed == "relaxed" and second.relaxed == "relaxed"
        said = [str(w.message) for w in caught if "accuracy bound" in str(w.message)]
        assert len(said) == 1, said
        assert "1.20x the size of a profiled one" in said[0] and "relaxes it" in said[0]
        assert planner.plans[_sig(120)] is first and planner.plans[_sig(135)] is second
    finally:
        ctl.remove()


def test_a_rescaled_plan_falls_back_to_a_farther_class_where_the_nearest_leaves_no_room():
    """Two classes: a profile and a class scaled from it by 1.3 (more edges). A batch with
    a few more nodes is nearest the scaled class (1.04x), whose figures scaled again (1.35x
    the profile's transient in all) leave no room, while the profile scaled by this batch's
    own ratio (1.25x) does: the plan comes from the profile, not a 1-bit profile step."""
    from gact_graph.budget.planner import Option, Plan, Unit
    from gact_graph.budget.state import PlanState, SizeClasses

    def sig(nodes, edges):
        return ((nodes, 16), "torch.float32", "cpu"), ((2, edges), "torch.int64", "cpu")

    def unit(four_bits, two_bits):
        return Unit("a", "tensor", [
            Option("keep", 32, 1000, seconds=0.0),
            Option("compress", 4, four_bits, seconds=1.0),
            Option("compress", 2, two_bits, seconds=2.0),
        ])  # fmt: skip

    def state(signature, u, option, transient, **kw):
        return PlanState(signature, Plan({"a": u.options[option]}), [u], rest=100, fixed=0,
                         transient=transient, variance_cap=None, profile_step=0, **kw)  # fmt: skip

    profile = state(sig(100, 400), unit(70, 40), 1, 160)  # 4 bits: predicts 330
    scaled = state(sig(100, 520), unit(91, 52), 2, 208, scaled_from=sig(100, 400), scaled_by=1.3)
    classes = SizeClasses()
    classes.add(profile, limit=8)
    classes.add(scaled, limit=8)
    budget, margin = 400, 0.1  # usable 360
    batch = sig(104, 500)  # 1.25x the profile's edges, 1.04x the scaled class's nodes
    assert classes.find(batch, budget, margin) == (None, 1.0)  # 387.5 and 370.4 > 360
    plan = classes.rescaled(batch, budget, margin)
    assert plan is not None, "only the nearest class (2 bits scaled: 372 > 360) was tried"
    assert plan.scaled_from == sig(100, 400) and plan.scaled_by == 1.25
    assert plan.transient == 200 and plan.predicted == 350 <= budget * (1 - margin)
    assert {o.bits for o in plan.plan.choice.values()} == {2}
