"""Sensitivity estimation: the one-pass probe against GACT's Algorithm 1 (two seeds per tensor)."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch_geometric.nn import GCNConv

from gact_graph import compress_gnn
from gact_graph.core.quantize import quantize
from gact_graph.models import GAT
from gact_graph.policy.sensitivity import (
    S,
    SensitivityProbe,
    _flat_grads,
    element_step,
    per_element,
    probe_sensitivity,
    rounding_variance_factor,
    spearman,
    two_seed_sensitivity,
)


def _graph(n=300, e=1800, f=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    return torch.randn(n, f, generator=g), ei, torch.randint(0, classes, (n,), generator=g)


class _WideNarrowGCN(nn.Module):
    """GCN with widths that change a lot from layer to layer (so sensitivities spread)."""

    def __init__(self, widths=(16, 96, 24, 8, 4)):
        super().__init__()
        self.convs = nn.ModuleList(GCNConv(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.bns = nn.ModuleList(nn.BatchNorm1d(b) for b in widths[1:-1])

    def forward(self, x, edge_index):
        for conv, bn in zip(self.convs[:-1], self.bns):
            x = torch.relu(bn(conv(x, edge_index)))
            x = nn.functional.dropout(x, 0.3, self.training)
        return self.convs[-1](x, edge_index)


def _step_fn(model, x, ei, y):
    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x, ei), y).backward()

    return step


def _averaged_probe(ctl, step, k, state=None):
    state = torch.get_rng_state() if state is None else state
    runs = []
    for seed in range(k):
        torch.set_rng_state(state)  # same dropout as Algorithm 1 sees
        runs.append(probe_sensitivity(ctl, step, seed=seed))
    torch.set_rng_state(state)
    return {n: sum(r[n] for r in runs) / k for n in runs[0]}


def test_element_step_is_the_rounding_step_of_each_group():
    for shape in [(100, 24), (37, 300), (1000,), (6, 5, 40), ()]:
        x = torch.randn(shape) * (torch.linspace(0.1, 5, shape[-1]) if shape else 1.0)
        q = quantize(x, 2, group_size=64, seed=1)
        lo, scale = q.group_params()
        step, lo_el = element_step(q), per_element(q, lo)
        assert step.shape == x.shape == lo_el.shape
        x_hat = q.dequantize()
        ok = step > 0
        codes = (x_hat - lo_el)[ok] / step[ok]
        # every value is its group's minimum plus a whole number (0..3) of its group's steps
        assert torch.allclose(codes, codes.round(), atol=1e-3)
        if codes.numel():
            assert codes.round().min() >= 0 and codes.round().max() <= 3
        assert ((x_hat - x).abs() <= step * (1 + 1e-3) + 1e-6).all()


def test_probe_is_exact_in_expectation_for_a_linear_layer():
    # grad_W = G^T X: E||G^T eps||^2 = sum_n ||G_n||^2 sum_k step_nk^2 / 6 (GACT's analysis)
    torch.manual_seed(0)
    lin = nn.Linear(48, 6, bias=False)
    x0 = torch.randn(500, 32)
    pre = nn.Linear(32, 48)
    model = nn.Sequential(pre, lin)  # pre's output is read in backward by lin only
    target = torch.randn(500, 6)
    ctl = compress_gnn(model, bits=4, adaptive=False, min_numel=0, sparse=False, pointwise=False)
    g_out = {}
    lin.register_full_backward_hook(lambda m, gi, go: g_out.__setitem__("G", go[0].detach()))

    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x0), target).backward()

    step()
    (rec,) = [r for r in ctl.stats()["tensors"] if r["kind"] == "activation"]
    name = rec["name"]
    assert rec["bits"] == 4
    # the analytical value, from the stored groups and the incoming gradient
    captured = {}
    orig = ctl._pack

    def spy(t):
        s = orig(t)
        captured[s.name] = s
        return s

    ctl._pack = spy
    step()
    del ctl._pack
    q = captured[name].payload
    step_el = element_step(q)
    x_hat = q.dequantize()
    var_unit = torch.where(x_hat == 0, 0.0, step_el.square() / 6) * (2**4 - 1) ** 2
    analytic = float((g_out["G"].square().sum(1, keepdim=True) * var_unit).sum())
    est = sum(probe_sensitivity(ctl, step, seed=s)[name] for s in range(8)) / 8
    assert est == pytest.approx(analytic, rel=0.1)
    ref = two_seed_sensitivity(ctl, step, names=[name], repeats=4)[name]
    assert ref == pytest.approx(analytic, rel=0.35)  # Alg. 1 sees the true f(1-f), not 1/6
    ctl.remove()


def test_probe_replays_single_output_nodes_and_sums_shared_reads():
    # The tanh output is read by TanhBackward (one output, grad = G (1 - y^2)) and by the
    # next linear layer: one stored tensor, two nodes, one noise draw for both.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 6))
    x0, target = torch.randn(400, 32), torch.randn(400, 6)
    ctl = compress_gnn(model, bits=4, adaptive=False, min_numel=0, sparse=False, pointwise=False)

    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x0), target).backward()

    step()
    (rec,) = [r for r in ctl.stats()["tensors"] if r["kind"] == "activation"]
    assert rec["uses"] == 2
    ref = two_seed_sensitivity(ctl, step, names=[rec["name"]], repeats=4)[rec["name"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no node may fail to replay
        est = sum(probe_sensitivity(ctl, step, seed=s)[rec["name"]] for s in range(4)) / 4
    assert 0.6 < est / ref < 1.6, (est, ref)
    ctl.remove()


def test_probe_agrees_with_algorithm_1_on_a_small_gcn():
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = _WideNarrowGCN()
    ctl = compress_gnn(model, bits=4, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    step()
    ref = two_seed_sensitivity(ctl, step, repeats=4)
    est = _averaged_probe(ctl, step, 4)
    names = sorted(ref)
    assert len(names) >= 5 and set(est) == set(names)
    rho = spearman([ref[n] for n in names], [est[n] for n in names])
    assert rho > 0.8, (rho, ref, est)
    ratios = sorted(est[n] / ref[n] for n in names if ref[n] > 0)
    assert 0.5 < ratios[len(ratios) // 2] < 2.0  # same scale, not only the same ranks
    ctl.remove()


def _small_gat(bits):
    """A 3-layer GAT with BatchNorm and both dropouts, compressed at ``bits``, after one step:
    ``(ctl, step)``."""
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GAT(16, 8, 4, num_layers=3, heads=2, dropout=0.3, attn_dropout=0.1, batch_norm=True)
    ctl = compress_gnn(model, bits=bits, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    step()
    return ctl, step


def test_probe_agrees_with_algorithm_1_on_a_small_gat():
    ctl, step = _small_gat(4)
    # BatchNorm saves its normalized input, whose sensitivity is close to its neighbours':
    # 8 repeats on both sides keep the ranks out of the noise (measured rho 0.85; 4: 0.80)
    ref = two_seed_sensitivity(ctl, step, repeats=8)
    est = _averaged_probe(ctl, step, 8)
    names = sorted(ref)
    assert len(names) >= 5 and set(est) == set(names)
    rho = spearman([ref[n] for n in names], [est[n] for n in names])
    assert rho > 0.8, (rho, ref, est)
    ratios = sorted(est[n] / ref[n] for n in names if ref[n] > 0)
    assert 0.5 < ratios[len(ratios) // 2] < 2.0
    ctl.remove()


@pytest.mark.parametrize("bits", [2, 4])
def test_sum_of_c_times_S_predicts_the_measured_compression_variance(bits):
    # The additive model behind the allocator and the alert: Var[g] = sum_l c_l S(b_l).
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = _WideNarrowGCN()
    ctl = compress_gnn(model, bits=bits, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    state = torch.get_rng_state()
    step()
    used = {r["name"]: r["bits"] for r in ctl.stats()["tensors"] if r["bits"]}
    c = _averaged_probe(ctl, step, 2, state)  # the dropout draw of the runs below
    predicted = sum(c[n] * S(used[n]) for n in c)
    params = list(model.parameters())
    grads = []
    for s in range(6):  # every tensor re-seeded: ctl.step enters every rounding seed
        ctl.step = 1000 + s
        torch.set_rng_state(state)
        step()
        grads.append(_flat_grads(params))
    g = torch.stack(grads)
    measured = float((g - g.mean(0)).square().sum()) / (len(grads) - 1)
    assert 0.5 < measured / predicted < 2.0, (measured, predicted)
    ctl.remove()


def test_probing_leaves_the_training_gradient_unchanged():
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = _WideNarrowGCN()
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    state = torch.get_rng_state()
    step()
    ref = _flat_grads(list(model.parameters()))
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    c = probe_sensitivity(ctl, step)
    assert c and all(math.isfinite(v) and v >= 0 for v in c.values())
    assert torch.equal(_flat_grads(list(model.parameters())), ref)
    # and the probe leaves nothing behind
    assert "_unpack" not in ctl.__dict__ and "_pack" not in ctl.__dict__
    ctl.remove()


def test_probe_waits_for_a_forward_with_a_graph_and_counts_one_pass():
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = _WideNarrowGCN()
    ctl = compress_gnn(model, bits=4, adaptive=False, min_numel=256)  # no adapter's probe
    probe = SensitivityProbe(ctl, min_numel=256)
    probe.arm()
    with torch.no_grad():
        model(x, ei)  # no graph: not hooked
    assert not probe.hooked
    calls = []
    step = _step_fn(model, x, ei, y)

    def counted():
        calls.append(1)
        step()

    counted()
    assert probe.hooked and probe.ran and len(calls) == 1
    c = probe.result()
    assert len(c) >= 5 and probe.grad_sq > 0
    probe.close()
    ctl.remove()


def test_rounding_variance_factor_sees_on_grid_and_smooth_data():
    torch.manual_seed(0)
    smooth = torch.randn(3000, 64)
    assert rounding_variance_factor(smooth, quantize(smooth, 2, seed=0)) == pytest.approx(
        1.0, abs=0.1
    )
    binary = (torch.rand(3000, 300) < 0.1).float() * 0.25  # bag-of-words features
    # at 1 bit the step is exactly 0.25: every value sits on a level, rounding is exact
    assert rounding_variance_factor(binary, quantize(binary, 1, seed=0)) == 0.0
    # at 2 bits the bf16 step 0.0835 > 0.25 / 3 leaves 0.25 just below a level: nearly exact
    assert rounding_variance_factor(binary, quantize(binary, 2, seed=0)) < 0.1


def test_probe_matches_algorithm_1_on_nearly_exact_binary_features():
    torch.manual_seed(0)
    binary = (torch.rand(3000, 300) < 0.1).float() * 0.25
    lin = nn.Linear(300, 16)

    class Model(nn.Module):  # the binary tensor is made inside the forward, so it is saved
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x * 1.0)

    model = Model()
    y = torch.randn(3000, 16)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0, sparse=False, pointwise=False)

    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(binary), y).backward()

    step()
    ref = two_seed_sensitivity(ctl, step, repeats=2)
    (name,) = ref
    est = sum(probe_sensitivity(ctl, step, seed=s)[name] for s in range(2)) / 2
    assert 0.5 < est / ref[name] < 2.0, (est, ref)
    ctl.remove()


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


class _CheckpointedMLP(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant
        )
        return self.c(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_probe_steps_do_not_add_checkpointed_gradients_twice(reentrant):
    """A reentrant checkpoint's node accumulates its parameters' gradients into ``.grad``
    inside its backward: replaying it to probe must not do so a second time."""
    import copy

    torch.manual_seed(0)
    model = _CheckpointedMLP(reentrant)
    stock = copy.deepcopy(model)
    x = torch.randn(512, 64)
    stock(x).square().sum().backward()
    ctl = compress_gnn(model, bits=8, min_numel=0, pointwise=False)
    for step in range(4):  # steps 0, 1 and 3 probe (the backing-off schedule)
        model.zero_grad()
        model(x).square().sum().backward()
        for p, q in zip(model.parameters(), stock.parameters()):  # 8-bit noise: < 1 %
            assert ((p.grad - q.grad).norm() / q.grad.norm()).item() < 0.02, step  # 2x: 1.0
        ctl.iterate()
    assert ctl.adapter.n_estimates >= 2
    assert all(math.isfinite(c) for c in ctl.adapter.c.values()) and ctl.adapter.c


@pytest.mark.parametrize("widths", [(16, 96, 24, 8, 4), (16, 300, 600, 8, 4)])
def test_closed_form_matmul_estimate_is_the_replays_expectation(widths):
    """A linear layer's input is estimated in closed form (no replay, no tensor-sized
    temporary): alpha^2 sum_i ||G_i||^2 s_i is what the replay's Rademacher draw gives in
    expectation. Averaged over 64 draws the replay agrees within its sampling error; the
    tensors the closed form does not cover (BatchNorm's) are estimated the same either way.
    The second width puts 300 and 600 features in a row, so groups split rows there."""
    torch.manual_seed(0)
    x, ei, y = _graph(n=400, e=3000)
    model = _WideNarrowGCN(widths).eval()  # no dropout: every run sees the same graph
    ctl = compress_gnn(model, bits=2, adaptive=False)
    step = _step_fn(model, x, ei, y)
    state = torch.get_rng_state()
    closed = probe_sensitivity(ctl, step, seed=0)
    torch.set_rng_state(state)
    replays = []
    for seed in range(64):
        torch.set_rng_state(state)
        replays.append(probe_sensitivity(ctl, step, seed=seed, closed_form=False))
    ctl.remove()
    mean = {n: sum(r[n] for r in replays) / len(replays) for n in replays[0]}
    linear = [n for n in closed if ".lin#" in n]
    assert linear and set(closed) == set(mean)
    for n in closed:
        draws = torch.tensor([r[n] for r in replays], dtype=torch.float64)
        err = 4 * draws.std().item() / math.sqrt(len(draws)) + 1e-12 * mean[n]
        if n in linear:
            assert abs(closed[n] - mean[n]) <= err, (n, closed[n], mean[n], err)
        assert closed[n] > 0, n


def test_partial_backwards_run_lean_with_the_same_estimates(monkeypatch):
    """Inside the probe's partial backwards, a matmul and BatchNorm read their compressed
    input a row chunk at a time (`RowChunked`), GAT's backward takes its two-pass variant
    (`lean_backward`), BatchNorm's replay writes into the probe's noisy copy (`scratch`) and
    the partial backwards are walked by hand a node at a time with the gradients that meet
    summed (`_walk`: the attention logits' and the features' meet at the linear layer), all
    for memory (issues 13, 14): the estimates are those of the dense one-pass backward."""
    from gact_graph import switches as lean
    from gact_graph.ops import batchnorm
    from gact_graph.policy import probe_hooks, sensitivity

    ctl, step = _small_gat(2)
    state = torch.get_rng_state()
    made, lean_calls, scratch_calls, merged = [], [], [], []
    real_chunked, real_is_lean = probe_hooks.RowChunked, lean.is_lean
    real_scratch, real_merge = lean.is_scratch, sensitivity.SensitivityProbe._merge

    def chunked(q):
        made.append(tuple(q.shape))
        return real_chunked(q)

    def is_lean():
        lean_calls.append(real_is_lean())
        return lean_calls[-1]

    def is_scratch(t):
        scratch_calls.append(real_scratch(t))
        return scratch_calls[-1]

    def merge(pending, edges, grads):
        keys = [(id(e.node), e.output_nr) for e in edges]
        merged.append(sum(k in pending for k in keys) + len(keys) - len(set(keys)))
        real_merge(pending, edges, grads)

    monkeypatch.setattr(probe_hooks, "RowChunked", chunked)
    monkeypatch.setattr("gact_graph.sparse.gat.is_lean", is_lean)
    monkeypatch.setattr(batchnorm, "is_scratch", is_scratch)
    monkeypatch.setattr(sensitivity.SensitivityProbe, "_merge", staticmethod(merge))
    bn_chunks = []
    real_ranges = batchnorm.row_ranges
    monkeypatch.setattr(batchnorm, "row_ranges", lambda q: bn_chunks.append(1) or real_ranges(q))
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    got = probe_sensitivity(ctl, step, seed=5)
    assert made and any(lean_calls), (made, lean_calls)
    assert any(scratch_calls) and any(merged), (scratch_calls, merged)
    assert bn_chunks  # BatchNorm read its normalized input a row chunk at a time

    monkeypatch.setattr(probe_hooks, "RowChunked", lambda q: q.dequantize())
    monkeypatch.setattr("gact_graph.sparse.gat.is_lean", lambda: False)
    monkeypatch.setattr(batchnorm, "is_scratch", lambda t: False)
    monkeypatch.setattr(  # one plain partial backward per replay
        sensitivity.SensitivityProbe, "_walk", lambda self, acc, e, g: self._grad_into(acc, e, g)
    )
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    dense = probe_sensitivity(ctl, step, seed=5)
    assert set(got) == set(dense) and len(got) >= 5
    for name in got:
        assert got[name] == pytest.approx(dense[name], rel=1e-4, abs=1e-12), name
    ctl.remove()


@pytest.mark.parametrize("shape", [(500, 64), (40, 700), (33, 256), (7, 3)])
def test_row_rounding_variance_from_compact_counts_is_the_definition(shape):
    """``s_i = kappa * sum_j step_ij^2 / 6 * [x_ij != 0]``, from `nonzero_counts` (held from
    pack to backward in the narrowest integer type) and the tensor's own metadata."""
    from gact_graph.policy.sensitivity import nonzero_counts, row_rounding_variance

    g = torch.Generator().manual_seed(1)
    x = torch.relu(torch.randn(shape, generator=g))  # about half zeros
    q = quantize(x, 2, seed=0)
    counts = nonzero_counts(x, q)
    assert counts.dtype in (torch.uint8, torch.int16)
    assert counts.element_size() * counts.numel() <= shape[0] * 2 * max(1, shape[1] // 256 + 1)
    want = 0.7 * (element_step(q).double().square() / 6 * (x != 0)).sum(1)
    got = row_rounding_variance(q, counts, 0.7)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-12)


def test_walk_carries_seeds_that_meet_as_one_gradient():
    """The probe's partial backward is walked by hand, latest node first, and the seeds that
    reach one node input are summed there (`SensitivityProbe._walk`): the nodes below run
    once, on one gradient, where carrying the small seed apart (GAT's attention logits beside
    its features, both from one linear layer) ran them once per seed while the other seed
    waited. The parameter's gradient is the plain partial backward's."""
    from gact_graph.policy.sensitivity import SensitivityProbe

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(5, 8)
    runs = []

    class Below(torch.autograd.Function):  # a Python node: the walk hands it to the engine
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            runs.append(g.shape)
            return g

    z = Below.apply(x @ w) * 2.0
    small, big = z.sum(-1), z * 3.0  # 5 and 40 elements: the small one is an eighth
    seeds = [torch.randn(5), torch.randn(5, 8)]
    (want,) = torch.autograd.grad([small, big], [w], seeds, retain_graph=True)
    runs.clear()
    probe = SensitivityProbe.__new__(SensitivityProbe)
    probe._params, probe._param_ids = [w], {id(w)}
    acc: dict = {}
    edges = [GradientEdge(small.grad_fn, 0), GradientEdge(big.grad_fn, 0)]
    probe._walk(acc, edges, [s.clone() for s in seeds])
    assert runs == [torch.Size([5, 8])]  # once, on the summed gradient
    torch.testing.assert_close(acc[id(w)].float(), want, rtol=1e-5, atol=1e-6)


def test_walk_sends_parameter_only_subgraphs_to_one_partial_backward(monkeypatch):
    """Gradients that reach a small computation on parameters alone (GAT's attention vector
    folded into the weight, ``W^T a``) are not walked a node at a time: they go to the
    parameters in the partial backward that ends the walk. The parameters' gradients are the
    plain partial backward's."""
    from gact_graph.policy.sensitivity import SensitivityProbe

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    a = nn.Parameter(torch.randn(8))
    x = torch.randn(5, 8)
    h = x @ w
    folded = (w.t() @ a)[:, None]  # parameters only
    s = h @ folded
    seed = torch.randn(5, 1)
    want = torch.autograd.grad([s], [w, a], [seed], retain_graph=True)
    probe = SensitivityProbe.__new__(SensitivityProbe)
    probe._params, probe._param_ids = [w, a], {id(w), id(a)}
    ran = []
    real = SensitivityProbe._run_alone

    def run_alone(self, acc, fn, edges, grads):
        ran.append(fn.name())
        return real(self, acc, fn, edges, grads)

    monkeypatch.setattr(SensitivityProbe, "_run_alone", run_alone)
    acc: dict = {}
    probe._walk(acc, [GradientEdge(s.grad_fn, 0)], [seed.clone()])
    assert ran == ["MmBackward0", "MmBackward0"], ran  # s's and h's, not the folded vector's
    for p, g in zip((w, a), want):
        torch.testing.assert_close(acc[id(p)].float(), g, rtol=1e-5, atol=1e-6)


def test_a_node_with_two_replayed_inputs_carries_the_first_before_the_second_replay(
    monkeypatch,
):
    """GATv2's attention node reads two compressed inputs (``x_l``, ``x_r``) and each replay
    emits two N x H x C gradient differences: the first replay's are carried down to the
    parameters before the second replay runs (deferred, both pairs would wait together), with
    the estimates the deferred walks give (same noise, same walk, another time)."""
    from gact_graph.models import GATv2
    from gact_graph.policy import sensitivity

    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GATv2(16, 8, 4, num_layers=3, heads=2, dropout=0.3, attn_dropout=0.1)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    step()
    state = torch.get_rng_state()
    probe_cls = sensitivity.SensitivityProbe
    real_probe, real_propagate = probe_cls._probe, probe_cls._propagate
    events = []

    def probe(self, node, stored, *args, **kwargs):
        out = real_probe(self, node, stored, *args, **kwargs)
        events.append(("replay", node.name(), stored.name))
        return out

    def propagate(self, seeds):
        if not seeds.done:
            events.append(("carry", seeds.name))
        real_propagate(self, seeds)

    monkeypatch.setattr(probe_cls, "_probe", probe)
    monkeypatch.setattr(probe_cls, "_propagate", propagate)
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    got = probe_sensitivity(ctl, step, seed=3)
    v2 = [i for i, e in enumerate(events) if e[0] == "replay" and "GatV2" in e[1]]
    assert len(v2) >= 4, events  # two inputs per attention layer, at least two layers
    pairs = [(i, j) for i, j in zip(v2, v2[1:]) if events[i][1] == events[j][1]]
    assert pairs, events
    for i, j in pairs[::2]:  # the node's first replay, then its second
        assert events[i + 1] == ("carry", events[i][2]), events[i : j + 1]

    # the same estimates when every replay's seeds wait for the node they enter
    monkeypatch.setattr(
        probe_cls, "_probe", lambda self, *a, **k: real_probe(self, *a, **k) and None
    )
    monkeypatch.setattr(probe_cls, "_propagate", real_propagate)
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    deferred = probe_sensitivity(ctl, step, seed=3)
    assert set(got) == set(deferred) and len(got) >= 6
    for name in got:
        assert got[name] == pytest.approx(deferred[name], rel=1e-4, abs=1e-12), name
    ctl.remove()


def test_walk_runs_pass_through_nodes_inside_the_call_that_feeds_them(monkeypatch):
    """Views, clones, adds and splits run inside the partial backward of the node that feeds
    them, not in a call of their own: fewer calls per walk, the same estimates (the walk is
    linear in its seeds, so where and in how many calls a node runs changes only the order of
    additions)."""
    from gact_graph.policy import probe_walk

    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GAT(16, 8, 4, num_layers=3, heads=2, dropout=0.3, batch_norm=True, residual=True)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=256)
    step = _step_fn(model, x, ei, y)
    step()
    state = torch.get_rng_state()
    real_run = SensitivityProbe._run_alone
    ran: list[str] = []

    def run_alone(self, acc, fn, edges, grads):
        ran.append(fn.name())
        return real_run(self, acc, fn, edges, grads)

    monkeypatch.setattr(SensitivityProbe, "_run_alone", run_alone)
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    got = probe_sensitivity(ctl, step, seed=3)
    merged = list(ran)
    ran.clear()
    monkeypatch.setattr(probe_walk, "passes_through", lambda fn: False)
    torch.set_rng_state(state)
    ctl._step_forwards = 0  # and the rounding of the step's first forward
    alone = probe_sensitivity(ctl, step, seed=3)
    ctl.remove()
    assert set(got) == set(alone) and len(got) >= 6
    assert sum(v > 0 for v in got.values()) >= 4
    for name in got:
        assert got[name] == pytest.approx(alone[name], rel=1e-5, abs=1e-12), name
    passing = [n for n in ran if n in probe_walk._PASS_THROUGH]
    assert passing, ran  # the model's walks do meet such nodes ...
    # ... and run them in other nodes' calls only (a walk may start at one: its seeds' node)
    assert len(merged) <= len(ran) - len(passing) // 2, (len(merged), len(ran))


def test_pack_reads_no_scalar_and_backward_reads_every_factor_at_once(monkeypatch):
    """The rounding factors the probe takes when a tensor is packed stay on the device through
    the forward (no ``.item()`` / ``float()`` per tensor: each is a host sync on a GPU) and are
    read for every tensor in one transfer when backward first needs one; their values are
    `rounding_variance_factor`'s."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GAT(16, 8, 4, num_layers=3, heads=2, dropout=0.3, batch_norm=True, residual=True)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=256)

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    model(x, ei)  # first-call work (the adjacency cache) out of the way
    with Reads() as plain:  # what the step itself reads (the CPU quantizer reads a few)
        model(x, ei)
    probe = SensitivityProbe(ctl, min_numel=256, seed=1)
    probe.arm()
    with Reads() as reads:
        out = model(x, ei)
    assert probe.compressed and reads.n == plain.n
    kappas = dict(probe._kappa)
    assert len(kappas) >= 4 and all(isinstance(v, torch.Tensor) for v in kappas.values())
    stacks = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: stacks.append(1) or real_stack(*a, **k))
    first = next(iter(kappas))
    probe._factors(first)
    monkeypatch.setattr(torch, "stack", real_stack)
    assert len(stacks) == 1
    assert all(isinstance(v, tuple) for v in probe._kappa.values())
    for stored, pair in probe._kappa.items():
        assert pair == pytest.approx(tuple(kappas[stored].tolist()))
    nn.functional.cross_entropy(out, y).backward()
    probe.result()
    probe.close()
    ctl.remove()


def test_rounding_variance_factors_are_the_two_factors():
    from gact_graph.policy.rounding import rounding_variance_factors

    torch.manual_seed(0)
    x = torch.relu(torch.randn(500, 40))  # many exact zeros: the two factors differ
    q = quantize(x, 2, group_size=64, seed=0)
    both = rounding_variance_factors(x, q, seed=4)
    assert both.shape == (2,) and both.dtype == torch.float32
    on_x = rounding_variance_factor(x, q, seed=4)
    on_x_hat = rounding_variance_factor(x, q, seed=4, on="x_hat")
    assert (float(both[0]), float(both[1])) == (on_x, on_x_hat)
    assert on_x_hat > on_x > 0  # x_hat's zeros include values that round onto 0
    with pytest.raises(ValueError, match="on must be"):
        rounding_variance_factor(x, q, on="y")


def test_probe_chunks_stay_few_on_a_large_tensor(monkeypatch):
    """The probe's noise is drawn in about `MAX_CHUNKS` chunks however large the tensor (each
    chunk is a dozen launches on a GPU), in chunks of `CHUNK_ELEMS` below that size; on the CPU
    the draw is the same whatever the chunking."""
    from gact_graph.policy import rounding

    torch.manual_seed(0)
    x = torch.randn(3000, 24)
    q = quantize(x, 2, group_size=64, seed=0)
    want = rounding.add_rounding_noise_(q, x.clone(), 5, 0.7)
    assert rounding.chunk_elems(x.numel()) == rounding.CHUNK_ELEMS  # small: one chunk
    monkeypatch.setattr(rounding, "CHUNK_ELEMS", 24)  # one row a chunk, were it not bounded
    ranges = list(rounding.row_ranges(q, rounding.chunk_elems(x.numel())))
    assert rounding.MAX_CHUNKS <= len(ranges) <= rounding.MAX_CHUNKS + 2
    calls = []
    real = rounding.torch.randint
    monkeypatch.setattr(rounding.torch, "randint", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = rounding.add_rounding_noise_(q, x.clone(), 5, 0.7)
    monkeypatch.setattr(rounding.torch, "randint", real)
    assert len(calls) == len(ranges)
    assert torch.equal(got, want)
    counts = rounding.nonzero_counts(torch.relu(x), q)  # groups of whole rows: one per row
    assert torch.equal(counts, (torch.relu(x) != 0).sum(1).to(counts.dtype))
