"""The order in which the probe's walk runs the nodes it carries a replay's noise through
(`gact_graph.policy.probe_walk`): a linear layer's matmul that nothing pending can still reach
runs before the engine's next node, so a residual projection's gradient does not wait while
the branch beside it runs; the estimates are those of the engine's order."""

import pytest
import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from gact_graph import compress_gnn
from gact_graph.budget.profile import PeakBytes
from gact_graph.policy import probe_walk
from gact_graph.policy.sensitivity import SensitivityProbe, probe_sensitivity


def _engine_order(self, nodes, params_only, linear):
    """The walk's order before: the latest node in forward order, always."""
    return max(nodes, key=lambda n: n._sequence_nr())


def _residual_block():
    """``h = x W0``; a residual ``r = h W_res`` made first, then a branch ``tanh(h W_a) * 2``
    beside it, summed: ``(params, out, names of the branch's nodes)``."""
    torch.manual_seed(0)
    w0, w_res, w_a = (nn.Parameter(torch.randn(8, 8)) for _ in range(3))
    x = torch.randn(6, 8)
    h = x @ w0
    r = h @ w_res
    a = torch.tanh(h @ w_a) * 2.0
    return [w0, w_res, w_a], a + r, r.grad_fn


def _bare_probe(params):
    probe = SensitivityProbe.__new__(SensitivityProbe)
    probe._params, probe._param_ids = params, {id(p) for p in params}
    return probe


@pytest.mark.parametrize("order", ["walk", "engine"])
def test_a_ready_linear_matmul_runs_before_the_branch_beside_it(monkeypatch, order):
    """The residual's matmul runs right after the sum that feeds it, before the branch's nodes
    (the engine runs it last: it was made first); either way the parameters' gradients are
    the plain partial backward's."""
    params, out, res_node = _residual_block()
    seed = torch.randn_like(out)
    want = torch.autograd.grad([out], params, [seed], retain_graph=True)
    if order == "engine":
        monkeypatch.setattr(SensitivityProbe, "_next_node", _engine_order)
    ran = []
    real = SensitivityProbe._run_alone

    def run_alone(self, acc, fn, edges, grads):
        ran.append(fn)
        return real(self, acc, fn, edges, grads)

    monkeypatch.setattr(SensitivityProbe, "_run_alone", run_alone)
    acc: dict = {}
    _bare_probe(params)._walk(acc, [GradientEdge(out.grad_fn, 0)], [seed.clone()])
    names = [fn.name() for fn in ran]
    assert "TanhBackward0" in names, names
    at = next(i for i, fn in enumerate(ran) if fn is res_node)
    if order == "walk":
        assert at == 1, names  # right after the sum
    else:
        assert at > names.index("TanhBackward0"), names
    for p, g in zip(params, want):
        torch.testing.assert_close(acc[id(p)].float(), g, rtol=1e-5, atol=1e-6)


def test_ready_sees_a_path_from_a_pending_node_and_stops_at_its_limit():
    params, out, res_node = _residual_block()
    mul = out.grad_fn.next_functions[0][0]  # the branch's ``* 2``
    h_node = res_node.next_functions[0][0]  # ``x W0``: both branches reach it
    assert mul.name() == "MulBackward0" and h_node.name() == "MmBackward0"
    assert probe_walk.ready(res_node, [mul, res_node])
    assert not probe_walk.ready(h_node, [mul])
    assert not probe_walk.ready(h_node, [res_node])
    # a node far below the others is taken for not ready once the search passes its limit
    assert probe_walk.ready(h_node, [out.grad_fn.next_functions[1][0].next_functions[1][0]])
    assert not probe_walk.ready(res_node, [mul], limit=1)
    assert probe_walk.linear_in_parameters(res_node, {id(p) for p in params})
    assert not probe_walk.linear_in_parameters(mul, {id(p) for p in params})


def _gat_with_residual(n=3000, heads=3, hidden=64):
    """`benchmarks/budget.py`'s GAT (the ogbn-arxiv preset: BatchNorm, residual connections,
    dropouts, ELU) on a graph of ``n`` nodes, every tensor at 2 bits, after two steps:
    ``(ctl, step, bytes of one N x H x C fp32 tensor)``."""
    from benchmarks.budget import _graph
    from benchmarks.harness import build_model

    x, ei, y = _graph(n)
    torch.manual_seed(0)
    model = build_model("gat", 16, 8, num_layers=3, hidden_channels=hidden, heads=heads)
    assert model.convs[0].res is not None
    ctl = compress_gnn(model, bits=2, adaptive=False)

    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x, ei), y).backward()

    step()
    step()
    return ctl, step, n * heads * hidden * 4


def _probe_adds(ctl, step, state) -> tuple[int, dict[str, float]]:
    """What a probed step holds beyond a plain one, counted, and its estimates (both steps
    from the random state ``state``: the same dropout)."""
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    with PeakBytes() as plain:
        step()
    torch.set_rng_state(state)
    ctl._step_forwards = 0
    with PeakBytes() as probed:
        est = probe_sensitivity(ctl, step, seed=2)
    return probed.peak - plain.peak, est


def test_the_walk_holds_no_residual_gradient_beside_gats_edge_stage(monkeypatch):
    """`benchmarks/budget.py`'s GAT (3 x 64 x 3 heads, the ogbn-arxiv preset with BatchNorm
    and residual connections) on 3,000 nodes, every tensor at 2 bits: in the engine's order
    the walk from a layer's output held the residual projection's incoming gradient (N x H x
    C) while the edge stage and the feature projection ran, above the plain step's peak; run
    first, the probed step holds less than a quarter of one such tensor beyond a plain step,
    at least half of one less than in the engine's order, with the same estimates."""
    ctl, step, unit = _gat_with_residual()
    state = torch.get_rng_state()
    try:
        adds, est = _probe_adds(ctl, step, state)
        monkeypatch.setattr(SensitivityProbe, "_next_node", _engine_order)
        engine_adds, engine_est = _probe_adds(ctl, step, state)
    finally:
        ctl.remove()
    assert adds <= 0.25 * unit, (adds / unit, engine_adds / unit)
    assert engine_adds - adds >= 0.5 * unit, (adds / unit, engine_adds / unit)
    assert set(est) == set(engine_est) and len(est) >= 8
    assert sum(v > 0 for v in est.values()) >= 6
    for name in est:
        assert est[name] == pytest.approx(engine_est[name], rel=1e-5, abs=1e-12), name
