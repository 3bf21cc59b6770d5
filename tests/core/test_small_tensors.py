"""Float tensors under ``min_bytes`` are kept as they are (on CUDA by default, anywhere when set).

A small graph's step would otherwise pay the quantizer's launches and Python per saved tensor
for a few kilobytes saved; on CPU the default stays 0 (nothing changes), so these tests set the
option.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.core.controller import CUDA_MIN_BYTES
from gact_graph.core.quantize import QTensor


class _Net(nn.Module):
    """Saves a narrow (small) and a wide (large) activation."""

    def __init__(self):
        super().__init__()
        self.narrow = nn.Linear(16, 4)  # saves its input x (kept by reference: an input)
        self.mid = nn.Linear(4, 256)  # saves relu(narrow(x)): 4 columns, small
        self.out = nn.Linear(256, 3)  # saves relu(mid(...)): 256 columns, large

    def forward(self, x):
        return self.out(F.relu(self.mid(F.relu(self.narrow(x)))))


def _run(model, x, y, **kwargs):
    ctl = compress_gnn(model, adaptive=False, min_numel=0, pointwise=False, sparse=False, **kwargs)
    try:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return grads, ctl.stats()["tensors"]
    finally:
        ctl.remove()


def _data(rows=200):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, 16, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _activation_bits(records):
    return {r["shape"]: r["bits"] for r in records if r["kind"] == "activation"}


def test_cpu_default_quantizes_small_tensors_as_before():
    torch.manual_seed(0)
    x, y = _data()
    _, records = _run(_Net(), x, y, bits=2)
    assert _activation_bits(records) == {(200, 4): 2, (200, 256): 2}


def test_tensors_under_min_bytes_are_kept_and_the_rest_quantized():
    torch.manual_seed(0)
    x, y = _data()
    limit = 200 * 4 * 4 + 1  # just above the narrow activation, far below the wide one
    _, records = _run(_Net(), x, y, bits=2, min_bytes=limit)
    assert _activation_bits(records) == {(200, 4): None, (200, 256): 2}
    kept = [r for r in records if r["shape"] == (200, 4)]
    assert all(r["stored_bytes"] == r["orig_bytes"] == 200 * 4 * 4 for r in kept)
    # a limit equal to a tensor's size keeps it no longer: "under" is strict
    _, records = _run(_Net(), x, y, bits=2, min_bytes=200 * 4 * 4)
    assert _activation_bits(records)[(200, 4)] == 2


def test_everything_kept_gives_the_lossless_gradients_exactly():
    torch.manual_seed(0)
    model = _Net()
    x, y = _data()
    lossless, _ = _run(model, x, y, bits=None)
    kept, records = _run(model, x, y, bits=2, min_bytes=1 << 30)
    assert all(r["bits"] is None for r in records)
    for name in lossless:
        assert torch.equal(kept[name], lossless[name]), name


def test_a_memory_budget_policy_is_never_overridden():
    torch.manual_seed(0)
    model = _Net()
    x, y = _data()
    ctl = compress_gnn(model, adaptive=False, min_numel=0, pointwise=False, sparse=False,
                       bits=2, min_bytes=1 << 30)  # fmt: skip
    try:
        ctl.bits_policy = lambda name: 4  # what the budget planner installs
        model(x).sum().backward()
        bits = _activation_bits(ctl.stats()["tensors"])
        assert bits == {(200, 4): 4, (200, 256): 4}
    finally:
        ctl.remove()


def test_cuda_default_is_a_mebibyte():
    assert CUDA_MIN_BYTES == 1 << 20
    if not torch.cuda.is_available():
        return
    model = _Net().cuda()
    x, y = (t.cuda() for t in _data(rows=4096))  # (4096, 256) fp32 = 4 MiB; (4096, 4) = 64 KiB
    _, records = _run(model, x, y, bits=2)
    assert _activation_bits(records) == {(4096, 4): None, (4096, 256): 2}
    _, records = _run(model, x, y, bits=2, min_bytes=0)
    assert _activation_bits(records) == {(4096, 4): 2, (4096, 256): 2}


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1MiB"])
def test_bad_min_bytes_raises(bad):
    with pytest.raises(ValueError, match="min_bytes"):
        compress_gnn(_Net(), min_bytes=bad)


def test_quantized_payloads_stay_quantized():
    """The wide activation really is a `QTensor` (the rule touches only small tensors)."""
    torch.manual_seed(0)
    model = _Net()
    x, y = _data()
    ctl = compress_gnn(model, adaptive=False, min_numel=0, pointwise=False, sparse=False,
                       bits=2, min_bytes=1 << 12)  # fmt: skip
    try:
        out = model(x)
        payloads = [type(w().payload) for w in ctl._live if w() is not None]
        assert QTensor in payloads
        out.sum().backward()
    finally:
        ctl.remove()
