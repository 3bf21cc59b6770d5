"""The package's own work steps past the forward's pointwise mode (`switches.package_work`):
the mode no longer sees the pack hook's, the adjacency cache's, the SpMM's or the fused graph
attention's torch calls, sees every call of the user's forward as before, and other modes are
left where they are. A compressed GCN, GAT and GATv2 forward + backward give the same output,
gradients, stored payloads and stats, bit for bit, as with a mode that sees every call (the
package's work routed through it, as if `package_work` did nothing)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gact_graph import compress_gnn
from gact_graph.ops.mode import PointwiseMode
from gact_graph.switches import PACKAGE_MODE_ATTR, package_work

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv, GATv2Conv, GCNConv  # noqa: E402

from gact_graph.sparse import gat_fused as sfused  # noqa: E402


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


class SeesAll(SeenPointwise):
    """The recording pointwise mode with `package_work` stepping past it switched off: it is
    handed the package's own calls too, as the mode was before `package_work`."""


setattr(SeesAll, PACKAGE_MODE_ATTR, False)


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


class AttentionNet(torch.nn.Module):
    """Two attention layers (attention dropout on) with the user's ELU and dropout between."""

    def __init__(self, conv):
        super().__init__()
        self.conv1 = conv(8, 4, heads=3, dropout=0.3)
        self.conv2 = conv(12, 4, heads=1, dropout=0.3)

    def forward(self, x, edge_index):
        h = F.elu(self.conv1(x, edge_index))
        h = F.dropout(h, p=0.5, training=self.training)
        return self.conv2(h, edge_index)


MODELS = {
    "gcn": Net,
    "gat": lambda: AttentionNet(GATConv),
    "gatv2": lambda: AttentionNet(GATv2Conv),
}


def _graph():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    ei = torch.randint(0, 40, (2, 160), generator=g)
    return x, ei


def _payload(stored) -> list:
    """What a stored tensor holds, as comparable items (tensors cloned)."""
    p = stored.payload
    if isinstance(p, torch.Tensor):
        return [p.detach().clone()]
    if dataclasses.is_dataclass(p):
        items = [getattr(p, f.name) for f in dataclasses.fields(p)]
        return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in items]
    with torch.no_grad():  # a graph-aware store: what it hands back
        return [type(p).__name__, stored.unpack().detach().clone()]


def _run(model="gcn", mode_factory=None):
    torch.manual_seed(0)
    net = MODELS[model]()
    ctl = compress_gnn(net, bits=2, adaptive=False)
    seen = []
    if mode_factory is not None:  # swap the installed pointwise mode for a recording one
        ctl._context_factories[:] = [lambda: seen.append(mode_factory()) or seen[-1]]
    stored = []
    pack = ctl._pack  # record what the pack hook stores (the hook is looked up per forward)
    ctl._pack = lambda t: stored.append(pack(t)) or stored[-1]
    x, ei = _graph()
    torch.manual_seed(1)
    out = net(x, ei)
    saved = [(s.name, s.kind, s.bits, s.stored_bytes, _payload(s)) for s in stored]
    del stored[:]
    out.square().sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    stats = ctl.stats()["total"]
    paths = dict(ctl.module_paths)
    ctl.remove()
    return {"out": out.detach(), "grads": grads, "saved": saved, "stats": stats,
            "seen": seen, "paths": paths, "rng": torch.get_rng_state()}  # fmt: skip


def _assert_same_bits(a, b):
    torch.testing.assert_close(a["out"], b["out"], rtol=0, atol=0)
    assert len(a["grads"]) == len(b["grads"])
    for g, r in zip(a["grads"], b["grads"]):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert len(a["saved"]) == len(b["saved"])
    for sa, sb in zip(a["saved"], b["saved"]):
        assert sa[:4] == sb[:4]
        assert len(sa[4]) == len(sb[4])
        for u, v in zip(sa[4], sb[4]):
            if isinstance(u, torch.Tensor):
                assert u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v), sa[0]
            else:
                assert u == v, sa[0]
    assert a["stats"] == b["stats"]
    assert torch.equal(a["rng"], b["rng"])  # the same draws were made


def test_a_compressed_forward_hands_the_mode_only_the_users_calls():
    new = _run("gcn", SeenPointwise)
    funcs = [f for m in new["seen"] for f in m.funcs]
    # the pack hook's storage and view look-ups and the cache's checks are not among them
    own = ("untyped_storage", "storage_offset", "stride", "equal", "sparse_csr_tensor")
    for name in own:
        assert name not in funcs, name
    assert {"relu", "dropout"} <= set(funcs)  # the user's ops still reach the mode ...
    assert new["seen"][0].counts.get("relu") == 1 and new["seen"][0].counts.get("dropout") == 1
    ref = _run("gcn", SeesAll)  # ... and nothing else changes
    ref_funcs = [f for m in ref["seen"] for f in m.funcs]
    assert {"untyped_storage", "storage_offset"} <= set(ref_funcs)  # the names above are reached
    assert ref["seen"][0].counts == new["seen"][0].counts
    _assert_same_bits(new, ref)


#: torch calls of the chunked edge stage (`GatAttentionFunction`, `GatV2AttentionFunction`),
#: the node logits and the layer's checks, none of which the mode rewrites
ATTENTION_OWN = ("index_add_", "scatter_reduce_", "searchsorted", "cumsum_", "bernoulli_",
                 "untyped_storage")  # fmt: skip


@pytest.mark.parametrize("model", ["gat", "gatv2"])
def test_a_compressed_attention_forward_hands_the_mode_only_the_users_calls(model):
    new = _run(model, SeenPointwise)
    assert new["paths"]["conv1"] == new["paths"]["conv2"] == "sparse-fused"  # patched stage
    funcs = [f for m in new["seen"] for f in m.funcs]
    for name in ATTENTION_OWN:
        assert name not in funcs, name
    assert {"linear", "elu", "dropout"} <= set(funcs)  # the user's projections and ops
    counts = new["seen"][0].counts
    assert counts.get("elu") == 1 and counts.get("dropout") == 1  # still rewritten
    ref = _run(model, SeesAll)
    ref_funcs = set(f for m in ref["seen"] for f in m.funcs)
    assert set(ATTENTION_OWN) <= ref_funcs  # the names above are reached by the layer's work
    assert len(ref_funcs) > len(set(funcs))
    assert ref["seen"][0].counts == counts
    _assert_same_bits(new, ref)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(
    not sfused.triton_available() or not (INTERPRETED or torch.cuda.is_available()),
    reason="the fused kernels need Triton and CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("model", ["gat", "gatv2"])
def test_the_fused_kernels_forward_steps_past_the_mode_too(model, monkeypatch):
    """On CPU only under ``TRITON_INTERPRET=1`` (tensors stay on CPU: the kernels' forward is
    what is checked)."""
    if not INTERPRETED:
        pytest.skip("the models here run on CPU tensors")
    monkeypatch.setattr(sfused, "EDGE_KERNEL", "triton")
    new = _run(model, SeenPointwise)
    ref = _run(model, SeesAll)
    funcs = set(f for m in new["seen"] for f in m.funcs)
    ref_funcs = set(f for m in ref["seen"] for f in m.funcs)
    assert "untyped_storage" in ref_funcs and "untyped_storage" not in funcs
    assert ref_funcs - funcs - {"linear", "elu", "dropout"}  # the kernels' wrappers' calls
    _assert_same_bits(new, ref)
