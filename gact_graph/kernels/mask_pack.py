"""A boolean mask packed to 1 bit per element in one Triton launch.

`gact_graph.kernels.bitpack.pack_bits` packs with PyTorch ops: a copy and seven shift-or
passes, each a kernel launch on a GPU, for every ReLU or dropout mask a step saves. This
kernel reads each mask byte once and writes each packed byte once, in the same layout
(element ``i`` is bit ``i % 8`` of byte ``i // 8``; the bits past the end of the last byte are
0), so `PackedMask.unpack` reads its output unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton is optional: the PyTorch packing never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["triton_pack_mask"]

#: packed bytes per program (8 x as many mask bytes read)
BLOCK = 1024

if triton is not None:

    @triton.jit
    def _pack_mask_kernel(x_ptr, out_ptr, n, n_bytes, BLOCK: tl.constexpr):
        byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        lane = tl.arange(0, 8)
        idx = byte[:, None] * 8 + lane[None, :]
        x = tl.load(x_ptr + idx, mask=idx < n, other=0)
        bits = (x.to(tl.int32) & 1) << lane[None, :]
        tl.store(out_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < n_bytes)


def triton_pack_mask(flat: Tensor) -> Tensor:
    """The 1-bit packing of the contiguous 1-D ``uint8`` tensor ``flat`` (a boolean mask's
    bytes, each 0 or 1) as ``ceil(n / 8)`` bytes on its device, from one launch."""
    if triton is None:
        raise RuntimeError("triton_pack_mask needs Triton")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"triton_pack_mask takes a contiguous 1-D tensor, got {tuple(flat.shape)}")
    if flat.dtype != torch.uint8:
        raise TypeError(f"triton_pack_mask reads uint8 (a bool mask's bytes), got {flat.dtype}")
    n = flat.numel()
    n_bytes = (n + 7) // 8
    out = torch.empty(n_bytes, dtype=torch.uint8, device=flat.device)
    if n:
        grid = (triton.cdiv(n_bytes, BLOCK),)
        _pack_mask_kernel[grid](flat, out, n, n_bytes, BLOCK=BLOCK)
    return out
