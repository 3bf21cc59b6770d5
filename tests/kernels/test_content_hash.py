"""The adjacency cache's one-launch content hash (`gact_graph.kernels.content_hash`) equals the
chunked PyTorch hash of `gact_graph.sparse.content_hash`, for every dtype it reads, sizes around
its block, values that overflow int64 products, and the cache's check through ``hash_pair``.

The kernel runs on CUDA, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported): ``test_interpreter_in_subprocess`` re-runs this file so.
"""

import warnings

import pytest
import torch

from gact_graph.kernels import content_hash as ch
from gact_graph.sparse import content_hash as hashing
from tests.kernels.interpreted import (
    DEVICE,
    HAS_TRITON,
    interpreter_test,
    kernel_test,
)


def _torch_pair(t: torch.Tensor) -> torch.Tensor:
    """The chunked PyTorch hash on CPU (the reference; never the kernel, even when forced)."""
    flat = t.detach().cpu().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64)
    return hashing._torch_hash_pair(flat)


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(n, generator=gen, dtype=torch.float64) * 1e3
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


@kernel_test
@pytest.mark.parametrize("dtype", ch.HASHABLE_DTYPES)
@pytest.mark.parametrize("n", [1, ch.BLOCK - 1, ch.BLOCK, 3 * ch.BLOCK + 17])
def test_kernel_equals_the_torch_hash(dtype, n):
    t = _values(dtype, n, seed=n)
    got = ch.triton_hash_pair(t.to(DEVICE), hashing._M1, hashing._M2, hashing._M3)
    assert torch.equal(got.cpu(), _torch_pair(t))


@kernel_test
def test_kernel_sees_a_swap_and_an_empty_tensor():
    a = torch.arange(5000).to(DEVICE)
    b = a.clone()
    b[100], b[101] = a[101], a[100]
    args = (hashing._M1, hashing._M2, hashing._M3)
    assert not torch.equal(ch.triton_hash_pair(a, *args), ch.triton_hash_pair(b, *args))
    empty = ch.triton_hash_pair(torch.empty(0, dtype=torch.int64, device=DEVICE), *args)
    assert empty.tolist() == [0, 0] == _torch_pair(torch.empty(0, dtype=torch.int64)).tolist()


@kernel_test
def test_hash_pair_takes_the_kernel_and_keeps_its_value(monkeypatch):
    """Through `hash_pair` (what every forward's graph check calls): the kernel path on CUDA
    (or forced), with the value of the PyTorch path; an edge index's rows (views) included."""
    monkeypatch.setenv("GACT_GRAPH_FORCE_TRITON", "1")
    ei = _values(torch.int64, 2 * 7000, seed=3).view(2, 7000).to(DEVICE)
    assert hashing._hash_on_triton(ei.reshape(-1))
    for part in (ei, ei[0], ei[1], ei.to(torch.int32)):
        assert torch.equal(hashing.hash_pair(part).cpu(), _torch_pair(part))
    # the first use's comparison with the PyTorch ops trusted the kernel (no fallback taken)
    for dtype in (torch.int64, torch.int32):
        assert hashing._TRITON_HASH_TRUSTED[(ei.device, dtype)] is True
    # bool is not read by the kernel: the PyTorch path takes it
    mask = torch.ones(10, dtype=torch.bool, device=DEVICE)
    assert not hashing._hash_on_triton(mask)
    assert torch.equal(hashing.hash_pair(mask).cpu(), _torch_pair(mask))


@pytest.mark.parametrize("fault", ["raises", "disagrees"])
def test_a_kernel_that_fails_or_disagrees_is_set_aside_with_a_warning(monkeypatch, fault):
    """A kernel that cannot build on the user's GPU, or hashes differently there, must neither
    stop training nor key the cache by a second hash: warn once, then the PyTorch ops serve."""
    calls = []

    def broken(flat, *args):
        calls.append(flat.numel())
        if fault == "raises":
            raise RuntimeError("no kernel image for this device")
        return torch.zeros(2, dtype=torch.int64, device=flat.device)

    monkeypatch.setattr(ch, "triton_hash_pair", broken)
    monkeypatch.setattr(hashing, "_hash_on_triton", lambda flat: True)
    monkeypatch.setattr(hashing, "_TRITON_HASH_TRUSTED", {})
    t = _values(torch.int64, 9000, seed=5)
    with pytest.warns(RuntimeWarning, match="Triton content hash is not used"):
        first = hashing.hash_pair(t)
    assert torch.equal(first, _torch_pair(t))
    assert hashing._TRITON_HASH_TRUSTED[(t.device, t.dtype)] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(hashing.hash_pair(t), first)
    assert calls == [9000]  # set aside after its first use


def test_bad_input_is_named():
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    args = (hashing._M1, hashing._M2, hashing._M3)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        ch.triton_hash_pair(torch.zeros(2, 3, dtype=torch.int64), *args)
    with pytest.raises(TypeError, match="bool"):
        ch.triton_hash_pair(torch.zeros(3, dtype=torch.bool), *args)


test_interpreter_in_subprocess = interpreter_test(OMP_NUM_THREADS="1")
