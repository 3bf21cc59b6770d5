"""The sensitivity probe's bound (`gact_graph.budget.probe_cost`): at least what the probe adds
to a step, counted, on several models, and far below the bound from shapes alone; a budget
between the two now gets a probe step (and sensitivities) with every step within it."""

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.budget.profile import PeakBytes
from gact_graph.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 2**20


def _graph(n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 6 * n), generator=g)
    return x, torch.cat([ei, ei.flip(0)], 1), torch.randint(0, 4, (n,), generator=g)


def _model(name: str):
    torch.manual_seed(0)
    if name == "sage":
        from torch_geometric.nn.models import GraphSAGE

        return GraphSAGE(16, 64, 3, 4)
    kw = {"hidden_channels": 64, "num_layers": 3, "dropout": 0.0}
    if name == "gcn_bn":
        return build_model("gcn", 16, 4, batch_norm=True, **kw)
    if name == "gat":
        return build_model("gat", 16, 4, heads=3, **kw)
    if name == "gatv2":
        return build_model("gatv2", 16, 4, heads=3, **{**kw, "hidden_channels": 32})
    if name == "gcnii":
        return build_model("gcnii", 16, 4, **{**kw, "num_layers": 4})
    return build_model(name, 16, 4, **kw)


def _step(model, ctl, graph, opt, table) -> int:
    x, ei, y = graph
    with PeakBytes(table) as counter:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        opt.step()
        ctl.iterate()
    return counter.peak


def _probe_extra(name: str, n: int) -> int:
    """What the probe adds to a step of ``compress_gnn(model, bits=2)``, counted: the probed
    step less the same plan's step before it."""
    model, graph = _model(name), _graph(n)
    ctl = compress_gnn(model, bits=2)
    adapter = ctl.adapter
    adapter.next_estimate = sys.maxsize  # no probe until armed below
    adapter.detach()
    opt, table, peaks = torch.optim.Adam(model.parameters(), 1e-3), {}, []
    for s in range(4):
        if s == 3:
            adapter.next_estimate = ctl.step
            adapter.attach(ctl)
            adapter.next_estimate = ctl.step + 1
        peaks.append(_step(model, ctl, graph, opt, table))
    assert adapter.n_estimates == 1
    ctl.remove()
    return peaks[3] - peaks[2]


def _estimates(name: str, n: int) -> tuple[int, int]:
    """The planner's bound after its profile step, and the bound from shapes alone."""
    model, graph = _model(name), _graph(n)
    ctl = compress_gnn(model, bits=2, memory_budget="4GiB")
    planner = ctl.budget
    _step(model, ctl, graph, torch.optim.Adam(model.parameters(), 1e-3), {})
    need = next(iter(planner._profile_inputs.values())).probe_need
    largest = max(t.orig_bytes for t in planner._records())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ctl.remove()
    return need, planner.PROBE_ACTIVATIONS * largest + params


@pytest.mark.parametrize(
    "name,n,tight",
    [("gcn", 3000, True), ("gcn_bn", 3000, True), ("sage", 3000, True),
     ("gcnii", 600, True), ("gcnii", 1500, True), ("gat", 3000, False), ("gatv2", 2000, False)],
)  # fmt: skip
def test_the_probe_bound_covers_what_the_probe_adds(name, n, tight):
    """Measured <= bound everywhere; within 3x where the probe's work is its forward sample or
    closed forms (GCN, SAGE, BatchNorm, GCNII); the attention models' replays are bounded
    against each node's own backward, looser (docs/results/budget.md has the figures), but
    below the bound from shapes. GCNII on 600 nodes: the sample's fixed cost, about the bound
    from shapes there (which was below what it added in some runs)."""
    pytest.importorskip("torch_geometric")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = _probe_extra(name, n)
        need, shapes = _estimates(name, n)
    assert extra <= need, (name, extra / MiB, need / MiB)
    if (name, n) != ("gcnii", 600):
        assert need < shapes, (name, need / MiB, shapes / MiB)
    if tight:  # within 3x, or a few row vectors per tensor where the probe adds nearly nothing
        assert need <= 3 * extra + 128 * 1024, (name, extra / MiB, need / MiB)


def _counted_run(budget, steps: int):
    model, graph = _model("gcn"), _graph(3000)
    x, ei, _ = graph
    static = sum(p.untyped_storage().nbytes() for p in model.parameters())
    static += sum(t.untyped_storage().nbytes() for t in (x, ei))
    kw = {"memory_budget": budget} if budget is not None else {"bits": 1, "adaptive": False}
    ctl = compress_gnn(model, **kw)
    opt, table = torch.optim.Adam(model.parameters(), 1e-3), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peaks = [static + _step(model, ctl, graph, opt, table) for _ in range(steps)]
    planner = getattr(ctl, "budget", None)
    sens = dict(ctl.adapter.c) if getattr(ctl.adapter, "c", None) else {}
    ctl.remove()
    return peaks, planner, sens


def test_a_budget_the_shape_bound_left_without_probe_now_probes_within_it(monkeypatch):
    """GCN 3 x 64 on 3,000 nodes: 1 MiB above fixed 1 bit's worst step is above fixed 1 bit
    plus what the probe adds, below fixed 1 bit plus the bound from shapes (4.4 MiB): a probe
    step runs, sensitivities are known, and every step is within the budget."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    fixed1, _, _ = _counted_run(None, 3)
    budget = max(fixed1) + MiB
    peaks, planner, sens = _counted_run(budget, 5)
    assert any(h["probe"] for h in planner.history), planner.history
    assert sens
    for h, counted in zip(planner.history, peaks):
        assert h["measured"] <= budget and counted <= budget, (peaks, planner.history, budget)


def test_a_size_class_probe_runs_only_in_a_batch_it_fits_scaled():
    """A probe armed for a size class's plan (at its profiled sizes) runs in the next batch
    only where the plan's bytes and the probe's estimate, scaled by that batch's sizes, fit
    the budget; never for another plan or a profile step."""
    from types import SimpleNamespace

    from gact_graph.budget.apply import BudgetPlanner

    plan, other = SimpleNamespace(rest=100), SimpleNamespace(rest=100)
    planner = SimpleNamespace(budget=1000, _probe_for=(plan, 800, 100))  # 900 at scale 1
    fits = BudgetPlanner._probe_fits
    assert fits(planner, plan, 1.0)
    assert fits(planner, plan, 1.1)  # 100 + 800 * 1.1 = 980
    assert not fits(planner, plan, 1.2)  # 100 + 960 > 1000
    assert not fits(planner, other, 1.0) and not fits(planner, None, 1.0)
    planner._probe_for = None
    assert not fits(planner, plan, 1.0)
