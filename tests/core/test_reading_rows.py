"""Compressed matrices read by rows in every step: a Function that sets
``reads_rows_every_step`` (the fused graph-attention Functions; the chunked row readers, GAT's
and GATv2's stages and the normalized-input BatchNorm, have it off and are switched on here)
wraps its ``ctx.saved_tensors`` in `reading_rows`, and the controller's unpack hook hands it a
compressed 2-D activation as a `RowChunked` rather than a dequantized copy
(`Stored.unpack_rows`). The gradients of a compressed step equal, bit for bit, those of the
same step with that path switched off (`ROWS_IN_EVERY_STEP`); with grad mode on the unpack
is `Stored.unpack`'s; a step the sensitivity probe watches is handed dense copies (the probe
writes its noise into them) and gives the same estimates.

The fused Triton path runs here under Triton's CPU interpreter at a tiny size
(``test_interpreter_in_subprocess`` re-runs its fused test with ``TRITON_INTERPRET=1``).
"""

import pytest
import torch
import torch.nn.functional as F

from gact_graph import compress_gnn, switches
from gact_graph.config import DOUBLE_BACKWARD_HELP
from gact_graph.core.chunked import RowChunked
from gact_graph.core.controller import Stored
from gact_graph.core.quantize import quantize
from gact_graph.models import build_model
from gact_graph.sparse import gat as sgat
from gact_graph.sparse import gat_fused as sfused
from gact_graph.sparse import gatv2 as sgatv2
from tests.kernels.interpreted import DEVICE, interpreter_test, kernel_test


@pytest.fixture
def handed(monkeypatch):
    """Counts of what the controller's row-reading unpack hands back, by type name."""
    counts: dict[str, int] = {}
    unpack_rows = Stored.unpack_rows

    def spy(self):
        t = unpack_rows(self)
        name = type(t).__name__
        counts[name] = counts.get(name, 0) + 1
        return t

    monkeypatch.setattr(Stored, "unpack_rows", spy)
    return counts


def _graph(n=60, e=240, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    ei = torch.randint(0, n, (2, e), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return x, ei, y


def _model(name):
    if name == "gcn":
        return build_model("gcn", 12, 4, num_layers=3, hidden_channels=16, dropout=0.2,
                           batch_norm=True)  # fmt: skip
    return build_model(name, 12, 4, num_layers=2, hidden_channels=8, heads=2, dropout=0.2,
                       attn_dropout=0.1, batch_norm=True)  # fmt: skip


def _compressed_step(name, rows, monkeypatch, graph=None, steps=2, **compress):
    """Gradients (name -> tensor) of the last of ``steps`` compressed training steps of a
    fresh seeded model, with `ROWS_IN_EVERY_STEP` = ``rows``."""
    monkeypatch.setattr(switches, "ROWS_IN_EVERY_STEP", rows)
    x, ei, y = graph if graph is not None else _graph()
    torch.manual_seed(0)
    model = _model(name).to(x.device)
    ctl = compress_gnn(model, **{"bits": 2, "adaptive": False, "min_numel": 0, **compress})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x, ei), y).backward()
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            opt.step()
            ctl.iterate()
    finally:
        ctl.remove()
    return grads


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _row_readers_every_step(monkeypatch):
    """Patch the chunked row readers (GAT's and GATv2's chunked stages, the BatchNorm) to
    read rows in every step too, as the fused Functions do by default."""
    from gact_graph.ops.batchnorm import BatchNormFunction

    monkeypatch.setattr(BatchNormFunction, "reads_rows_every_step", True)
    monkeypatch.setattr(sgat.GatAttentionFunction, "reads_rows_every_step", True)
    monkeypatch.setattr(sgatv2.GatV2AttentionFunction, "reads_rows_every_step", True)


@pytest.mark.parametrize("name", ["gat", "gatv2", "gcn"])
def test_chunked_path_is_handed_dense_copies_by_default(name, monkeypatch, handed):
    """On the chunked (CPU) path a plain step's backward is handed dequantized copies (its
    row readers' ``reads_rows_every_step`` is off: reading in parts costs more CPU time there
    than the copy's memory repays); the switch makes no difference to the gradients."""
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    on = _compressed_step(name, True, monkeypatch)
    off = _compressed_step(name, False, monkeypatch)
    assert "RowChunked" not in handed, handed
    _assert_same(on, off)


@pytest.mark.parametrize("name", ["gat", "gatv2", "gcn"])
def test_chunked_row_readers_in_every_step_bit_for_bit(name, monkeypatch, handed):
    """With the chunked row readers switched on in every step: every gradient of a fixed
    2-bit step equals, bit for bit, that of the step handed dequantized copies; row-read
    matrices were handed (the BatchNorms' normalized inputs, GAT's and GATv2's features)."""
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    _row_readers_every_step(monkeypatch)
    dense = _compressed_step(name, False, monkeypatch)
    assert "RowChunked" not in handed, handed
    rows = _compressed_step(name, True, monkeypatch)
    # each step: one per BatchNorm (1 in GAT / GATv2, 2 in the GCN), 1 per GAT layer, 2 per
    # GATv2 layer
    per_step = {"gat": 1 + 2, "gatv2": 1 + 2 * 2, "gcn": 2}[name]
    assert handed.get("RowChunked") == 2 * per_step, handed
    _assert_same(rows, dense)


def test_a_function_that_does_not_read_rows_gets_dense_copies(monkeypatch, handed):
    """``reads_rows_every_step`` on then off on a Function class (the GCN's BatchNorm): with
    it off its backward is handed dense copies, with the same gradients."""
    from gact_graph.ops.batchnorm import BatchNormFunction

    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    _row_readers_every_step(monkeypatch)
    rows = _compressed_step("gcn", True, monkeypatch, steps=1)
    assert handed.get("RowChunked") == 2, handed
    handed.clear()
    monkeypatch.setattr(BatchNormFunction, "reads_rows_every_step", False)
    dense = _compressed_step("gcn", True, monkeypatch, steps=1)
    assert "RowChunked" not in handed and handed.get("Tensor", 0) > 0, handed
    _assert_same(rows, dense)


def test_unpack_rows_only_with_grad_off():
    """`Stored.unpack_rows` gives a `RowChunked` of a compressed 2-D activation only inside
    `reading_rows` with grad mode off; else `Stored.unpack`'s tensor (with grad mode on, as
    under ``create_graph``, its double-backward error for a compressed tensor); never for
    other kinds or shapes."""
    x = torch.randn(24, 5)
    q = quantize(x, 2, group_size=10, seed=0)
    stored = Stored("x", "activation", q, 2, x.numel() * 4, q.nbytes)
    with torch.no_grad():
        plain = stored.unpack_rows()
        assert type(plain) is torch.Tensor and torch.equal(plain, q.dequantize())
        with switches.reading_rows():
            r = stored.unpack_rows()
            assert isinstance(r, RowChunked) and r.q is q
            assert torch.equal(r.dense(), plain)
            other = Stored("i", "input", q, 2, 0, 0)
            assert type(other.unpack_rows()) is torch.Tensor
            q3 = quantize(x.view(4, 6, 5), 2, group_size=10, seed=0)
            assert type(Stored("x3", "activation", q3, 2, 0, 0).unpack_rows()) is torch.Tensor
    with torch.enable_grad(), switches.reading_rows():
        with pytest.raises(RuntimeError, match="carries no graph") as got:
            stored.unpack_rows()
        assert DOUBLE_BACKWARD_HELP in str(got.value)
        # a payload unpack hands back with grad on (lossless, bits None): dense
        lossless = Stored("y", "activation", q, None, 0, 0)
        assert type(lossless.unpack_rows()) is torch.Tensor


def test_create_graph_stays_dense(monkeypatch, handed):
    """A compressed step's backward with ``create_graph=True`` is handed no `RowChunked`: it
    fails with the same double-backward error as with the path switched off."""
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    _row_readers_every_step(monkeypatch)
    errors = []
    for rows in (False, True):
        monkeypatch.setattr(switches, "ROWS_IN_EVERY_STEP", rows)
        x, ei, y = _graph()
        torch.manual_seed(0)
        model = _model("gatv2")
        ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0)
        try:
            loss = F.cross_entropy(model(x, ei), y)
            with pytest.raises(RuntimeError) as got:
                torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            errors.append(str(got.value))
        finally:
            ctl.remove()
    assert errors[0] == errors[1] and DOUBLE_BACKWARD_HELP in errors[0]
    assert "RowChunked" not in handed, handed


def test_probed_step_is_handed_dense_copies(monkeypatch, handed):
    """The default mode's first step is probed: the probe wraps the unpack hook and its
    user's backward gets dense copies (none through the row-reading hook), and the estimates
    equal, bit for bit, those with the path switched off."""
    from gact_graph.policy import sensitivity

    monkeypatch.setattr(sfused, "EDGE_KERNEL", "chunked")
    _row_readers_every_step(monkeypatch)
    estimates = []
    result = sensitivity.SensitivityProbe.result
    monkeypatch.setattr(sensitivity.SensitivityProbe, "result",
                        lambda self: estimates.append(result(self)) or estimates[-1])  # fmt: skip
    grads = {}
    for rows in (False, True):
        handed.clear()
        grads[rows] = _compressed_step("gatv2", rows, monkeypatch, steps=1, adaptive=True)
        assert "RowChunked" not in handed, handed
    assert len(estimates) == 2 and estimates[0] and estimates[0] == estimates[1]
    _assert_same(grads[True], grads[False])


@kernel_test
def test_fused_step_gradients_bit_for_bit(monkeypatch, handed):
    """On the fused Triton path (a tiny GAT, interpreted on CPU): the backward kernels read
    the features' packed codes in every step (`CodedFeatures`), and every gradient equals,
    bit for bit, that of the step whose kernels are handed dequantized copies."""
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    kinds = []
    kernel_features = sfused._kernel_features
    monkeypatch.setattr(sfused, "_kernel_features",
                        lambda x, shape: kinds.append(type(kernel_features(x, shape)).__name__)
                        or kernel_features(x, shape))  # fmt: skip
    x, ei, y = _graph(n=8, e=20)
    graph = (x.to(DEVICE), ei.to(DEVICE), y.to(DEVICE))
    out = {}
    for rows in (False, True):
        kinds.clear()
        out[rows] = _compressed_step("gat", rows, monkeypatch, graph=graph, steps=1)
        out[rows, "kinds"] = sorted(kinds)
    assert out[False, "kinds"] == ["Tensor", "Tensor"], out[False, "kinds"]
    assert out[True, "kinds"] == ["CodedFeatures", "CodedFeatures"], out[True, "kinds"]
    _assert_same(out[True], out[False])


test_interpreter_in_subprocess = interpreter_test(select="fused and not subprocess")
