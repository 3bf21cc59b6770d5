"""The content hash of a graph's index and weight tensors.

The adjacency cache recognizes a graph given again as a copy, a view, or once as COO and once as
CSR by the values of its tensors, not their storage: a 128-bit position-dependent hash, equal
for equal values whatever their integer or float width. Its two sums stay on the tensor's device
(`hash_pair`), so checking a cached graph needs no host sync; on CUDA they take one Triton
launch, checked once against the chunked PyTorch ops that serve everywhere else.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from gact_graph.kernels import force_triton, triton_available

__all__ = ["content_hash"]


def _hash_chunk(device: torch.device) -> int:
    """Elements `content_hash` takes at once (the hash does not depend on it). Four int64
    temporaries of this many are alive at once: small on CPU, where the budget planner reads a
    small graph's first step from the resident set and a larger chunk would be its highest
    moment; large on a GPU, where each chunk costs a dozen kernel launches. The figures behind
    the two sizes are in docs/design.md (memory budget: the graph's first step)."""
    return 1 << 16 if device.type == "cpu" else 1 << 20


_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def _as_int64_values(t: Tensor) -> Tensor:
    """Values as int64: integers by value (int32 and int64 of equal values agree), floats by
    the bits of their float64 value (float32 and float64 of equal values agree)."""
    if t.is_floating_point():
        return t.to(torch.float64).view(torch.int64)
    if t.dtype == torch.bool:
        return t.to(torch.int64)
    return t.to(torch.int64)


def _hash_on_triton(flat: Tensor) -> bool:
    """Whether `hash_pair` runs the one-launch Triton kernel (`gact_graph.kernels.content_hash`,
    CUDA; CPU tensors only when the kernel tests force it) rather than the chunked PyTorch ops:
    both give the same two sums."""
    if not (flat.is_cuda or force_triton()) or not triton_available():
        return False
    from gact_graph.kernels.content_hash import HASHABLE_DTYPES

    return flat.dtype in HASHABLE_DTYPES and flat.is_contiguous()


def hash_pair(t: Tensor) -> Tensor:
    """`content_hash`'s two 64-bit sums as one int64 [2] tensor on ``t``'s device: no host sync,
    so a cached graph is checked against it with device ops."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    if _hash_on_triton(flat):  # one launch, no temporaries (every forward's check on a GPU)
        pair = _checked_triton_hash_pair(flat)
        if pair is not None:
            return pair
    return _torch_hash_pair(flat)


#: (device, dtype) -> whether the Triton hash agreed with the PyTorch one on its first use there
_TRITON_HASH_TRUSTED: dict[tuple[torch.device, torch.dtype], bool] = {}


def _checked_triton_hash_pair(flat: Tensor) -> Tensor | None:
    """The Triton kernel's pair, or None where it is not trusted. On its first use per device
    and dtype the kernel's pair is compared with the PyTorch ops' (one read to the host, once):
    a cache key computed two ways would mistake every graph for a new one, or worse, a changed
    graph for the cached one, so a kernel that fails to build or disagrees is set aside with a
    warning and the PyTorch path serves from then on."""
    from gact_graph.kernels.content_hash import triton_hash_pair

    key = (flat.device, flat.dtype)
    trusted = _TRITON_HASH_TRUSTED.get(key)
    if trusted is False:
        return None
    if trusted:
        return triton_hash_pair(flat, _M1, _M2, _M3)
    try:
        pair = triton_hash_pair(flat, _M1, _M2, _M3)
        agrees = torch.equal(pair, _torch_hash_pair(flat))
        problem = "" if agrees else "its hash differs from the PyTorch reference's"
    except Exception as exc:  # a kernel that cannot build here must not stop training
        pair, problem = None, f"{type(exc).__name__}: {exc}"
    _TRITON_HASH_TRUSTED[key] = not problem
    if problem:
        warnings.warn(
            f"gact_graph: the Triton content hash is not used on {flat.device} for "
            f"{flat.dtype} ({problem}); the graph check uses PyTorch ops there instead "
            "(correct, more kernel launches). Please report this with your GPU and Triton version.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return pair


def _torch_hash_pair(flat: Tensor) -> Tensor:
    """`hash_pair` by PyTorch ops, in bounded chunks: the CPU path and the kernel's oracle."""
    n = flat.numel()
    chunk = _hash_chunk(flat.device)
    pair = None
    for start in range(0, n, chunk):
        # in place where the tensor is this loop's own (``v`` may be the caller's int64 data):
        # four chunk-sized int64 tensors at once, not seven (a graph's first step builds its
        # adjacency, and on a small graph this hash of its edge index can be that step's peak)
        v = _as_int64_values(flat[start : start + chunk] if n > chunk else flat)
        m = torch.arange(start, start + v.numel(), dtype=torch.int64, device=flat.device)
        m.mul_(_M1).bitwise_xor_(m >> 31).mul_(_M2).bitwise_xor_(m >> 27)
        a = torch.bitwise_xor(v, m).mul_(_M3)
        h1 = a.bitwise_xor_(a >> 29).sum()
        b = torch.add(v, m, out=a).mul_(_M1)
        h2 = b.bitwise_xor_(b >> 32).sum()
        # one chunk (a graph of up to `_hash_chunk` entries: every step's check) needs no
        # running sum: its pair is the hash (int64 sums wrap alike in either order)
        part = torch.stack((h1, h2))
        pair = part if pair is None else pair.add_(part)
        del v, m, a, b
    return pair


def content_hash(t: Tensor | None) -> tuple:
    """A 128-bit hash of a tensor's shape and values (not of its layout, strides or dtype
    width): position-dependent mixing summed with int64 wrap-around, in bounded chunks."""
    if t is None:
        return ("none",)
    return hash_key(t, hash_pair(t).tolist())  # (to the host: a sync on a GPU)


def hash_key(t: Tensor, pair: list[int]) -> tuple:
    """`content_hash` of ``t`` from its `hash_pair`, read to the host."""
    return ("float" if t.is_floating_point() else "int", tuple(t.shape), pair[0], pair[1])
