"""The pack hook's lean path against the plain one it replaces.

`_reference_pack` below is the pack hook written with `core.saved`'s helpers, one step at a
time: a weak reference to every storage, a `ViewKey`, `view_bytes`, the `min_bytes` rule asked
after the plan. The controller's own `_pack` skips the weak reference for tensors it keeps by
reference (their `Stored` keeps the storage alive), builds the record without formatting it and
decides the `min_bytes` rule before the plan; none of that may change what is stored, what the
stats say or what backward gets.
"""

import types
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import BatchNorm, GCN2Conv, GCNConv

from gact_graph import compress_gnn
from gact_graph.core.controller import Stored, mix_seed
from gact_graph.core.quantize import exceeds_fp32_range, pack_bool_mask, quantize
from gact_graph.core.saved import (
    is_autocast_param_copy,
    is_plain_strided,
    storage_ref,
    view_bytes,
    view_key,
)


def _reference_store(ctl, name, t, cdata):
    nbytes = view_bytes(t)
    if cdata in ctl._params or is_autocast_param_copy(t, ctl._params):
        return Stored(name, "param", t, None, nbytes, 0, t._version)
    if cdata in ctl._inputs:
        return Stored(name, "input", t, None, nbytes, 0, t._version)
    lossless = ctl._lossless.get(cdata)
    if lossless is not None and not lossless[0].expired():
        return Stored(name, lossless[1], t, None, nbytes, nbytes, t._version)
    if t.dtype == torch.bool:
        if ctl.keeps_as_is(t):
            return Stored(name, "mask", t, None, nbytes, nbytes, t._version)
        packed = pack_bool_mask(t)
        return Stored(name, "mask", packed, None, nbytes, packed.nbytes)
    if not t.is_floating_point():
        return Stored(name, "index", t, None, nbytes, nbytes, t._version)
    bits = ctl.bits_for(name)
    if bits is None or bits >= 32 or t.numel() < ctl.config.min_numel or ctl.keeps_as_is(t):
        return Stored(name, "activation", t, None, nbytes, nbytes, t._version)
    if exceeds_fp32_range(t):
        return Stored(name, "activation", t, None, nbytes, nbytes, t._version)
    seed = mix_seed(
        ctl.config.seed,
        ctl.step,
        ctl._step_forwards,
        len(ctl._records),
        ctl.seed_salt.get(name, 0),
    )
    q = quantize(t.detach(), bits, group_size=ctl.config.group_size, seed=seed)
    return Stored(name, "activation", q, bits, nbytes, q.nbytes)


def _reference_remember(ctl, stored, t):
    rec = {
        "name": stored.name,
        "kind": stored.kind,
        "shape": tuple(t.shape),
        "dtype": str(t.dtype).replace("torch.", ""),
        "bits": stored.bits,
        "orig_bytes": stored.orig_bytes,
        "stored_bytes": stored.stored_bytes,
        "uses": 1,
    }
    ctl._records.append(rec)
    ctl._record_of[stored.name] = rec
    ctl._live.append(weakref.ref(stored))
    return stored


def _reference_pack(ctl, t):
    if ctl._records_forward != ctl._forward_id:
        ctl._records_forward = ctl._forward_id
        ctl._records = []
        ctl._record_of = {}
        ctl._live = []
    name = ctl._next_name()
    if not is_plain_strided(t):
        return _reference_remember(
            ctl, Stored(name, "other", t, None, view_bytes(t), view_bytes(t)), t
        )
    ref = storage_ref(t)
    key = view_key(t, ref)
    hit = ctl._dedup.get(key)
    if hit is not None:
        hit_ref, hit_stored = hit[0], hit[1]()
        if hit_stored is not None and not hit_ref.expired():
            ctl._record_of[hit_stored.name]["uses"] += 1
            return hit_stored
    stored = _reference_store(ctl, name, t, ref.cdata)
    ctl._dedup[key] = (ref, weakref.ref(stored))
    return _reference_remember(ctl, stored, t)


class _Mixed(nn.Module):
    """Saves every kind: parameters, the input, a view saved twice, transposed and expanded
    views, an index made in forward, a bool mask, a sparse tensor and small and large floats."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(24, 32)
        self.wide = nn.Linear(32, 512)
        self.out = nn.Linear(512, 5)

    def forward(self, x):
        h = self.lin(x)  # saves the input x and the weight
        e = h.exp()  # saves its output e
        h = e * e  # saves e twice more: one stored copy, three uses
        h = h.t().contiguous().t()  # a transposed view saved by mm below
        idx = torch.arange(h.shape[0] - 1, -1, -1)
        h = h.index_select(0, idx)  # saves idx (int64)
        h = h.masked_fill(h > 2.0, 0.0)  # saves a bool mask
        s = torch.eye(h.shape[0]).to_sparse()
        h = torch.sparse.mm(s, h)  # saves a sparse tensor
        b = self.lin.bias.expand(h.shape[0], -1)  # an expanded view of a parameter
        h = h * b
        return self.out(torch.tanh(self.wide(h)))  # a large activation (512 columns)


class _GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = GCNConv(40, 16)
        self.bn = BatchNorm(16)
        self.c2 = GCNConv(16, 4)

    def forward(self, x, ei):
        h = F.dropout(x, 0.5, self.training)
        h = F.relu(self.bn(self.c1(h, ei)))
        return self.c2(F.dropout(h, 0.5, self.training), ei)


class _GCNII(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.inp = nn.Linear(40, 16)
        self.convs = nn.ModuleList(GCN2Conv(16, 0.1, 0.5, k + 1) for k in range(layers))
        self.outp = nn.Linear(16, 4)

    def forward(self, x, ei):
        h = h0 = F.relu(self.inp(F.dropout(x, 0.5, self.training)))
        for conv in self.convs:
            h = F.relu(conv(F.dropout(h, 0.5, self.training), h0, ei))
        return self.outp(h)


def _graph(n=400, e=1600, f=40):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, f, generator=g), torch.randint(0, n, (2, e), generator=g)


def _step(make, args, reference, **kwargs):
    """One forward and backward; stats read after forward and after backward, gradients."""
    torch.manual_seed(0)
    model = make()
    ctl = compress_gnn(model, adaptive=False, **kwargs)
    if reference:  # the forward's hooks call ``ctl._pack``: the instance attribute wins
        ctl._pack = types.MethodType(_reference_pack, ctl)
    try:
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the sparse tensor's beta warning
            y = model(*args)
        mid = ctl.stats()
        y.square().sum().backward()
        after = ctl.stats()
        report = ctl.report()
        grads = [p.grad.clone() for p in model.parameters()]
        return y.detach(), mid, after, report, grads
    finally:
        ctl.remove()


_CASES = {
    "mixed": (_Mixed, lambda: (torch.randn(64, 24),)),
    "gcn": (_GCN, _graph),
    "gcnii": (_GCNII, _graph),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("min_bytes", [0, 40_000, 1 << 20])
def test_lean_pack_gives_the_reference_stats_report_and_gradients(case, min_bytes):
    make, data = _CASES[case]
    args = data()
    kwargs = {"bits": 2, "min_numel": 0, "min_bytes": min_bytes}
    ref = _step(make, args, True, **kwargs)
    new = _step(make, args, False, **kwargs)
    assert torch.equal(new[0], ref[0])
    assert new[1] == ref[1]  # after forward: every record, every byte, the live bytes
    assert new[2] == ref[2]  # after backward (everything released)
    assert new[3] == ref[3]
    for a, b in zip(new[4], ref[4], strict=True):
        assert torch.equal(a, b)
    kinds = {r["kind"] for r in new[1]["tensors"]}
    if case == "mixed":  # the case saves every kind the controller tells apart
        assert kinds == {"param", "input", "activation", "index", "mask", "other"}
        assert max(r["uses"] for r in new[1]["tensors"]) == 3
    records = new[1]["tensors"]
    assert all(type(r["shape"]) is tuple and type(r["dtype"]) is str for r in records)
    quantized = [r for r in records if r["bits"] is not None]
    assert bool(quantized) == (min_bytes < (1 << 20))  # the rule decides as before


def test_kept_tensors_unpack_as_the_very_tensor_and_dedup_to_one_stored():
    model = nn.Linear(8, 8)
    ctl = compress_gnn(model, adaptive=False, bits=2, min_bytes=1 << 20)
    try:
        ctl._forward_id += 1
        t = torch.randn(100, 8)
        a, b = ctl._pack(t), ctl._pack(t)
        view = ctl._pack(t.t())
        assert a is b and view is not a
        assert ctl._unpack(a) is t and ctl._unpack(view).data_ptr() == t.data_ptr()
        assert ctl._record_of[a.name]["uses"] == 2
        t.add_(1.0)  # a new version: a new entry, not the old one
        c = ctl._pack(t)
        assert c is not a and ctl._unpack(c) is t
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            ctl._unpack(a)
    finally:
        ctl.remove()


def test_a_kept_entry_no_longer_hits_once_its_stored_is_released():
    ctl = compress_gnn(nn.Linear(8, 8), adaptive=False, bits=2, min_bytes=1 << 20)
    try:
        ctl._forward_id += 1
        t = torch.randn(100, 8)
        first = ctl._pack(t)
        name = first.name
        del first  # autograd released it: its entry must not answer for the storage any more
        second = ctl._pack(t)
        assert second.name != name
        assert [r["uses"] for r in ctl.stats()["tensors"]] == [1, 1]
    finally:
        ctl.remove()


@pytest.mark.parametrize("min_bytes", [0, 1 << 20])
def test_a_saved_activation_modified_in_place_still_raises(min_bytes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            e = self.lin(x).exp()  # exp saves its output
            self.saved = e
            return e * 2.0

    m = M()
    with compress_gnn(m, adaptive=False, bits=None, min_bytes=min_bytes):
        y = m(torch.randn(4, 8))
        m.saved.add_(1.0)  # kept by reference (lossless): the change must not go unnoticed
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_kept_tensor_whose_storage_was_swapped_no_longer_answers_for_the_old_one():
    ctl = compress_gnn(nn.Linear(8, 8), adaptive=False, bits=2, min_bytes=1 << 20)
    try:
        ctl._forward_id += 1
        a = torch.randn(100, 8)
        a.add_(0.0)  # version 1, as `c` below gets from its own ``set_``
        held = ctl._pack(a)
        # `c` views a's storage at the same offset, shape, stride, dtype and version
        c = torch.empty(0).set_(a.untyped_storage(), 0, (100, 8), (8, 1))
        assert c._version == a._version
        a.set_(torch.zeros(100, 8))  # `held` now holds other memory
        got = ctl._pack(c)
        assert got is not held and torch.equal(ctl._unpack(got), c)
    finally:
        ctl.remove()
