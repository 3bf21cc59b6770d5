"""The adjacency cache's content hash in one Triton launch (a graph's check in each forward).

`gact_graph.sparse.content_hash` hashes a graph's tensors (the edge index, its weights) to see
whether a cached adjacency still matches them. The PyTorch version makes a dozen elementwise
passes per chunk of the tensor, each one a kernel launch and an int64 temporary; this kernel
reads each element once and writes nothing but the two sums. Per element ``i`` with value
``v`` (integers sign-extended to int64, floats as the bits of their float64 value), all
arithmetic mod 2**64 and right shifts arithmetic, as in the PyTorch version::

    m  = i * M1;  m = (m ^ (m >> 31)) * M2;  m = m ^ (m >> 27)
    a  = (v ^ m) * M3;  h1 += a ^ (a >> 29)
    b  = (v + m) * M1;  h2 += b ^ (b >> 32)

Each program adds its block's two sums into the output with an atomic add: a sum mod 2**64
does not depend on its order, so the result is exact and deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton is optional: the PyTorch hash never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["HASHABLE_DTYPES", "triton_hash_pair"]

#: input dtypes the kernel reads directly (others are converted by the caller)
HASHABLE_DTYPES = (
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
)
#: elements per program
BLOCK = 4096

if triton is not None:

    @triton.jit
    def _hash_kernel(x_ptr, out_ptr, n, M1, M2, M3, BLOCK: tl.constexpr, FLOAT: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        valid = offs < n
        x = tl.load(x_ptr + offs, mask=valid, other=0)
        if FLOAT:
            v = x.to(tl.float64).to(tl.int64, bitcast=True)
        else:
            v = x.to(tl.int64)
        m = offs * M1
        m = (m ^ (m >> 31)) * M2
        m = m ^ (m >> 27)
        a = (v ^ m) * M3
        a = a ^ (a >> 29)
        b = (v + m) * M1
        b = b ^ (b >> 32)
        zero = tl.zeros_like(a)
        tl.atomic_add(out_ptr, tl.sum(tl.where(valid, a, zero), axis=0))
        tl.atomic_add(out_ptr + 1, tl.sum(tl.where(valid, b, zero), axis=0))


def triton_hash_pair(flat: Tensor, m1: int, m2: int, m3: int) -> Tensor:
    """``(h1, h2)`` of the contiguous 1-D tensor ``flat`` (a dtype in `HASHABLE_DTYPES`) as an
    int64 [2] tensor on its device, from one launch; ``m1``..``m3`` are the hash's odd
    multipliers as int64 values."""
    if triton is None:
        raise RuntimeError("triton_hash_pair needs Triton")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"triton_hash_pair takes a contiguous 1-D tensor, got {tuple(flat.shape)}")
    if flat.dtype not in HASHABLE_DTYPES:
        raise TypeError(f"triton_hash_pair cannot read {flat.dtype}")
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    n = flat.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _hash_kernel[grid](flat, out, n, m1, m2, m3, BLOCK=BLOCK, FLOAT=flat.is_floating_point())
    return out
