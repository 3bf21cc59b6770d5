"""Dense packing of small integer codes into bytes, and lossless 1-bit boolean masks.

Element ``i`` of a flat code sequence with ``bits`` bits per code lands in byte
``i * bits // 8`` at bit offset ``(i * bits) % 8`` (little-endian within the byte), so
``8 // bits`` consecutive codes share one byte. The same layout is produced by the Triton
quantization kernel (:mod:`gact_graph.kernels.quantize`), which packs each group on its own.

Everything here is vectorized torch and runs on any device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PackedMask",
    "SUPPORTED_BITS",
    "code_table",
    "pack_bits",
    "pack_mask",
    "packed_nbytes",
    "unpack_bits",
]

SUPPORTED_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to pack ``numel`` codes of ``bits`` bits each."""
    _check_bits(bits)
    return (numel * bits + 7) // 8


def pack_bits(codes: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """Pack unsigned codes (each ``< 2**bits``) into a flat ``uint8`` tensor.

    Args:
        codes: ``uint8`` tensor of any shape; it is read in flattened (row-major) order.
            Values must already fit in ``bits`` bits (higher bits are not masked off).
        bits: bits per code, one of ``1, 2, 4, 8``.
        out: optional 1-D ``uint8`` destination of exactly the packed size.

    Returns:
        A 1-D ``uint8`` tensor of ``ceil(codes.numel() * bits / 8)`` bytes on ``codes.device``.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    need = packed_nbytes(flat.numel(), bits)
    if out is None:
        out = torch.empty(need, dtype=torch.uint8, device=codes.device)
    elif out.shape != (need,) or out.dtype != torch.uint8:
        raise ValueError(
            f"out must be a uint8 tensor of shape ({need},), got {out.dtype} {out.shape}"
        )
    if bits == 8:
        return out.copy_(flat)
    per_byte = 8 // bits
    tail = (-flat.numel()) % per_byte
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    lanes = flat.view(-1, per_byte)
    out.copy_(lanes[:, 0])
    for j in range(1, per_byte):
        out |= lanes[:, j] << (j * bits)
    return out


@functools.lru_cache(maxsize=32)
def code_table(bits: int, device: torch.device, dtype: torch.dtype = torch.uint8) -> Tensor:
    """``(256, 8 // bits)`` table: row ``b`` holds the codes packed in byte ``b``, in order.

    Unpacking by table lookup (one gather) is several times faster than shift-and-mask passes;
    a floating ``dtype`` gives the codes ready for dequantization.
    """
    _check_bits(bits)
    per_byte = 8 // bits
    byte = torch.arange(256, dtype=torch.int32)[:, None]
    shift = torch.arange(per_byte, dtype=torch.int32)[None, :] * bits
    return ((byte >> shift) & ((1 << bits) - 1)).to(device=device, dtype=dtype)


def unpack_bits(packed: Tensor, bits: int, numel: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes as a flat tensor.

    ``dtype`` (default ``uint8``) may be a floating type to get the codes already converted.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} bytes, got {packed.numel()}")
    flat = packed.reshape(-1)[:need]
    if bits == 8:
        return flat.to(dtype, copy=True)
    table = code_table(bits, flat.device, dtype)
    return table.index_select(0, flat.to(torch.int32)).view(-1)[:numel]


@dataclass(frozen=True)
class PackedMask:
    """A boolean tensor stored losslessly at 1 bit per element (e.g. ReLU or dropout masks).

    Attributes:
        data: packed ``uint8`` bits, ``ceil(numel / 8)`` bytes.
        shape: shape of the original mask.
    """

    data: Tensor
    shape: torch.Size

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: ``ceil(numel / 8)``."""
        return self.data.numel()

    def numel(self) -> int:
        return math.prod(self.shape)

    def unpack(self) -> Tensor:
        """The original boolean mask (same shape and device), contiguous."""
        codes = unpack_bits(self.data, 1, self.numel())
        return codes.view(torch.bool).view(self.shape)


def pack_mask(mask: Tensor) -> PackedMask:
    """Pack a boolean tensor at 1 bit per element; :meth:`PackedMask.unpack` restores it."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    codes = mask.reshape(-1).view(torch.uint8) if mask.is_contiguous() else mask.to(torch.uint8)
    return PackedMask(pack_bits(codes.reshape(-1), 1), mask.shape)
