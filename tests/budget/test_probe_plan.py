"""The plan the memory budget's sensitivity-probe step runs (`BudgetPlanner._probe_plan`): every
compressible tensor at the default width, what the adaptive allocator probes its own first
estimate at; it fits the budget with the probe's estimate, the plan in force comes back after
it, and the sensitivities it measures agree with the allocator's own (a probe at 1 bit, the
least plan, measures other values on an attention model)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.budget import NAMED_SLACK, NAMED_SLACK_BYTES
from gact_graph.models import build_model
from gact_graph.policy.sensitivity import spearman
from tests.budget.test_apply import _graph

#: tiny ops on a shared 2-core machine: one thread avoids OpenMP barrier waits
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str = "gcnii"):
    torch.manual_seed(0)
    if name == "gat":
        return build_model("gat", 16, 4, hidden_channels=16, num_layers=3, heads=2, dropout=0.0)
    return build_model(name, 16, 4, hidden_channels=64, num_layers=4, dropout=0.0)


def _steps(model, ctl, graph, steps: int, lr: float = 1e-3, seen=None) -> None:
    """``steps`` Adam steps; ``seen`` (a list) gets, per step, the bits each compressed
    activation ran at (read before ``ctl.iterate()``, which may change the plan)."""
    x, ei, y = graph
    opt = torch.optim.Adam(model.parameters(), lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        opt.step()
        if seen is not None:
            seen.append(
                {
                    r["name"]: r["bits"]
                    for r in ctl.stats()["tensors"]
                    if r["kind"] == "activation" and r["bits"] is not None
                }
            )
        ctl.iterate()


def _least_budget(graph, name: str = "gcnii") -> int:
    """The planner's least admitted budget for ``graph`` (what it names, less the slack it
    adds for a rerun's measurement)."""
    model = _model(name)
    ctl = compress_gnn(model, memory_budget="1GiB")
    _steps(model, ctl, graph, 1)
    least = ctl.budget.plan_state.least_budget
    ctl.remove()
    return int((least - NAMED_SLACK_BYTES) / (1 + NAMED_SLACK))


def test_the_probe_step_runs_every_tensor_at_the_default_width_and_fits():
    graph = _graph(600)
    budget = 2 * _least_budget(graph)
    model = _model()
    ctl = compress_gnn(model, memory_budget=budget, budget_margin=0.3)
    planner, seen = ctl.budget, []
    _steps(model, ctl, graph, 1, seen=seen)
    in_force = dict(planner.plan_state.plan.choice)  # what the probe step sets aside
    assert planner.plan_state.relaxed == "" and planner._probe_step == 1
    armed_plan, held, need = planner._probe_for
    assert held + need <= budget
    # the probe's plan is in place for the coming step: every unit compressed at 2 bits
    assert {o.label for o in planner.plan_state.plan.choice.values()} == {"2b"}
    _steps(model, ctl, graph, 3, seen=seen)
    history = planner.history
    assert [h["probe"] for h in history] == [False, True, False, False]
    assert set(seen[0].values()) == {1}  # the profile step: every tensor at 1 bit
    assert seen[1] and set(seen[1].values()) == {planner.default_bits}  # the probe step
    assert history[1]["predicted"] == held  # what it was armed for
    assert all(h["measured"] <= budget for h in history)
    # after it, the plan in force is back and chosen again with the sensitivities
    assert planner._set_aside is None and ctl.adapter.c
    assert planner.plan_state.variance_cap is not None
    later = planner.plan_state.plan.choice
    assert set(later) == set(in_force)
    for name, bits in seen[2].items():  # the planned steps run the re-chosen plan's bits
        assert bits == planner.bits_for(name)
    ctl.remove()


def test_the_probe_plan_is_solved_once_per_plan_in_force(monkeypatch):
    """Where the probe's estimate never fits, every planned step asks for the probe's plan
    again: it is solved once for the plan in force, and again once that plan changes."""
    import gact_graph.budget.probe_step as ps
    from gact_graph.budget.apply import BudgetPlanner

    solves = []
    real = ps.least_plan
    monkeypatch.setattr(ps, "least_plan", lambda units: solves.append(1) or real(units))
    monkeypatch.setattr(BudgetPlanner, "_probe_estimate", lambda self, tensors: 1 << 40)
    graph = _graph(600)
    model = _model()
    ctl = compress_gnn(model, memory_budget=2 * _least_budget(graph), budget_margin=0.3)
    planner = ctl.budget
    _steps(model, ctl, graph, 5)
    assert [h["probe"] for h in planner.history] == [False] * 5
    assert planner.plan_state.relaxed == "" and len(solves) == 1, solves
    state = planner.plan_state
    state.plan = dataclasses.replace(state.plan)  # the plan in force changes (a re-plan)
    assert planner._probe_plan(state).plan.choice and len(solves) == 2
    ctl.remove()


def test_a_plan_below_the_accuracy_bound_runs_no_probe():
    """With half the budget kept as margin, no plan at the default width fits: the plan in
    force relaxes the bound (no variance cap), so sensitivities would change nothing in it,
    and the probe's plan (every tensor at the default width) would hold more than its
    steps. No step probes."""
    graph = _graph(600)
    budget = 2 * _least_budget(graph)
    model = _model()
    ctl = compress_gnn(model, memory_budget=budget, budget_margin=0.5)
    with pytest.warns(UserWarning, match="accuracy bound"):
        _steps(model, ctl, graph, 3)
    planner = ctl.budget
    assert planner.plan_state.relaxed == "relaxed"
    assert not any(h["probe"] for h in planner.history)
    assert ctl.adapter.n_estimates == 0
    ctl.remove()


def _first_estimate(model, graph, **kw) -> dict[str, float]:
    """The sensitivities ``compress_gnn(model, **kw)`` gets from its first probe, with the
    learning rate 0 (every step sees the same weights)."""
    ctl = compress_gnn(model, **kw)
    for _ in range(4):
        _steps(model, ctl, graph, 1, lr=0.0)
        if ctl.adapter.n_estimates:
            break
    c = dict(ctl.adapter.c)
    ctl.remove()
    return c


@pytest.mark.parametrize("name, times", [("gat", 1.5), ("gcn", 2.0)])
def test_the_probe_steps_sensitivities_agree_with_the_allocators_own(name, times):
    """The probe step's sensitivities (every tensor at the default width) against the
    adaptive allocator's first estimate without a budget (its first step, every tensor at
    the default width), same weights: each probe draws its own rounding and noise, so they
    agree within the statistical tolerance of ``tests/policy`` (ranks above 0.8, each value
    within 35 %). On the GAT a probe at 1 bit (the least plan) is outside it: rounding at 1
    bit adds noise to the incoming gradients the probe's replays see, and the attention's
    replays are finite differences at the rounding scale. The budget (``times`` the least,
    30 % margin) makes the plan in force compress a tensor and leaves room for the probe."""
    graph = _graph(600)
    budget = int(times * _least_budget(graph, name))
    probed = _first_estimate(_model(name), graph, memory_budget=budget, budget_margin=0.3)
    own = _first_estimate(_model(name), graph)
    names = sorted(own)
    assert len(names) >= 3 and set(probed) == set(names)
    assert spearman([own[n] for n in names], [probed[n] for n in names]) > 0.8
    for n in names:
        assert probed[n] == pytest.approx(own[n], rel=0.35, abs=1e-12), n
    if name == "gat":
        at_one_bit = _first_estimate(_model(name), graph, bits=1)
        off = [at_one_bit[n] / own[n] for n in names if own[n] > 0]
        assert max(abs(r - 1) for r in off) > 0.35, off


def test_the_probe_step_stays_within_the_planned_steps_plus_five_percent():
    """The CPU proxy of the issue's row "worst step <= the planned steps + 5 %"
    (`benchmarks/budget.py worst-step`), on its GCNII (8 x 64, 4,000
    nodes) at 12 MiB, where the probe runs: the probe step, at the default width, against
    the planned steps after it, by the planner's counted meter and by an independent count.
    (The probe step ran the plan in force before; how much heavier that was depended on
    the plan the codec timings picked, up to 1.19x here.)"""
    from benchmarks.budget import run_counted

    out = run_counted("gcnii", 4, memory_budget=12 * 2**20)
    assert [s[1] for s in out["steps"]] == [False, True, False, False], out["steps"]
    assert out["worst_over_planned"] <= 1.05 and out["worst_over_planned_counted"] <= 1.05, out
