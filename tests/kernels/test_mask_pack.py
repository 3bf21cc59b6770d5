"""The one-launch mask packing (`gact_graph.kernels.mask_pack`) writes the bytes of the PyTorch
packing (`gact_graph.kernels.bitpack.pack_mask`) for sizes around a byte and a block, any
shape and strides, and the controller stores masks through it (`pack_bool_mask`) with the same
bytes, gradients and stats.

The kernel runs on CUDA, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported): ``test_interpreter_in_subprocess`` re-runs this file so.
"""

import pytest
import torch

from gact_graph.core.quantize import pack_bool_mask
from gact_graph.kernels.bitpack import PackedMask, pack_mask
from tests.kernels.interpreted import (
    DEVICE,
    interpreter_test,
    kernel_test,
)


def _mask(shape, seed, p=0.4):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) > p).to(DEVICE)


@kernel_test
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1023 * 8, 1024 * 8, 1024 * 8 + 1, 30001])
def test_kernel_writes_the_pytorch_packing(n):
    from gact_graph.kernels.mask_pack import triton_pack_mask

    mask = _mask((n,), n)
    got = triton_pack_mask(mask.view(torch.uint8))
    want = pack_mask(mask.cpu()).data
    assert got.dtype == torch.uint8 and got.device.type == DEVICE
    assert torch.equal(got.cpu(), want)
    if n:  # every bit matters: all-ones and all-zeros masks too
        ones = torch.ones(n, dtype=torch.bool, device=DEVICE)
        want = pack_mask(ones.cpu()).data
        assert torch.equal(triton_pack_mask(ones.view(torch.uint8)).cpu(), want)
        zeros = torch.zeros(n, dtype=torch.bool, device=DEVICE)
        assert not triton_pack_mask(zeros.view(torch.uint8)).any()


@kernel_test
@pytest.mark.parametrize("make", ["shape", "transposed", "strided", "scalar"])
def test_pack_bool_mask_takes_any_layout(monkeypatch, make):
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    base = _mask((37, 29), 3)
    mask = {
        "shape": base.view(37, 29),
        "transposed": base.t(),
        "strided": base[:, ::3],
        "scalar": base[0, 0],
    }[make]
    packed = pack_bool_mask(mask)
    assert isinstance(packed, PackedMask) and packed.shape == mask.shape
    assert torch.equal(packed.data.cpu(), pack_mask(mask.cpu()).data)
    assert torch.equal(packed.unpack(), mask)


def test_pack_bool_mask_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        pack_bool_mask(torch.zeros(4))


@kernel_test
def test_controller_stores_masks_with_the_kernel(monkeypatch):
    """A compressed forward with ReLU masks gives the same gradients and stats through the
    kernel as through the PyTorch packing."""
    from gact_graph import compress_gnn

    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 33), torch.nn.ReLU(),
            torch.nn.Linear(33, 4),
        ).to(DEVICE)  # fmt: skip
        ctl = compress_gnn(model, bits=2, adaptive=False, min_bytes=0)
        x = torch.randn(50, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        model(x).square().sum().backward()
        masks = [t for t in ctl.stats()["tensors"] if t["kind"] == "mask"]
        grads = [p.grad.cpu() for p in model.parameters()]
        ctl.remove()
        return masks, grads

    from gact_graph.kernels import mask_pack

    calls = []
    kernel = mask_pack.triton_pack_mask
    monkeypatch.setattr(mask_pack, "triton_pack_mask", lambda t: calls.append(1) or kernel(t))
    ref_masks, ref_grads = run()
    assert DEVICE == "cuda" or not calls  # on CPU, unforced: the PyTorch packing
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    masks, grads = run()
    assert len(calls) >= 2  # each ReLU's mask went through the kernel
    assert len(masks) == 2 and masks == ref_masks
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


test_interpreter_in_subprocess = interpreter_test(OMP_NUM_THREADS="1")
