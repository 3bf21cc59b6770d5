"""The package's own work steps past the forward's pointwise mode (`switches.package_work`):
the mode no longer sees the pack hook's, the adjacency cache's or the SpMM's torch calls, sees
every call of the user's forward as before, and other modes are left where they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gact_graph import compress_gnn
from gact_graph.ops.mode import PointwiseMode
from gact_graph.switches import package_work

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GCNConv  # noqa: E402


class Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class SeenPointwise(PointwiseMode):
    """The pointwise mode, recording the name of every call it is handed."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs)


def test_steps_past_the_pointwise_mode_only_and_puts_it_back():
    @package_work
    def work(x):
        return x.numel(), torch._C._len_torch_function_stack()

    x = torch.ones(3)
    with SeenPointwise() as pw:
        assert work(x) == (3, 0)  # the mode is off the stack inside
        assert torch._C._len_torch_function_stack() == 1
        x.numel()
    assert pw.funcs == ["numel"]  # only the call outside the package's work
    with Seen() as other:  # a mode of someone else's stays and sees everything
        assert work(x) == (3, 1)
    assert other.funcs == ["numel"]
    with SeenPointwise() as pw, Seen() as other:  # not innermost: left alone, sees it too
        assert work(x) == (3, 2)
    assert pw.funcs == ["numel"] and other.funcs == ["numel"]


def test_the_mode_comes_back_after_an_exception():
    @package_work
    def fails():
        raise KeyError("x")

    with SeenPointwise() as pw:
        with pytest.raises(KeyError):
            fails()
        assert torch._C._len_torch_function_stack() == 1
        torch.ones(1).sum()
    assert pw.funcs == ["ones", "sum"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(8, 16)
        self.conv2 = GCNConv(16, 4)

    def forward(self, x, edge_index):
        h = F.relu(self.conv1(x, edge_index))
        h = F.dropout(h, p=0.5, training=self.training)
        return self.conv2(h, edge_index)


def _graph():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    ei = torch.randint(0, 40, (2, 160), generator=g)
    return x, ei


def _run(mode_factory=None):
    torch.manual_seed(0)
    model = Net()
    ctl = compress_gnn(model, bits=2, adaptive=False)
    seen = []
    if mode_factory is not None:  # swap the installed pointwise mode for a recording one
        ctl._context_factories[:] = [lambda: seen.append(mode_factory()) or seen[-1]]
    x, ei = _graph()
    torch.manual_seed(1)
    out = model(x, ei)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = ctl.stats()["total"]
    ctl.remove()
    return out.detach(), grads, stats, seen


def test_a_compressed_forward_hands_the_mode_only_the_users_calls():
    out, grads, stats, seen = _run(SeenPointwise)
    funcs = [f for m in seen for f in m.funcs]
    # the pack hook's storage and view look-ups and the cache's checks are not among them
    for own in ("untyped_storage", "storage_offset", "stride", "equal", "sparse_csr_tensor"):
        assert own not in funcs, own
    assert {"relu", "dropout"} <= set(funcs)  # the user's ops still reach the mode ...
    assert seen[0].counts.get("relu") == 1 and seen[0].counts.get("dropout") == 1  # rewritten
    ref_out, ref_grads, ref_stats, _ = _run()  # ... and nothing else changes
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert stats == ref_stats
