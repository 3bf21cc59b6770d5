"""Counter-based uniform random numbers, bit-identical in torch and Triton.

Stochastic rounding needs one ``u ~ U[0, 1)`` per element. Drawing it from a stateful
generator would tie the result to the launch configuration; instead ``u`` is a pure function
of ``(seed, offset)``, where ``offset`` is the element's flat int64 index in the padded group
matrix. Both implementations below compute, with all arithmetic mod 2**32::

    key = lowbias32(seed ^ lowbias32(hi32(offset) + 0x9E3779B9))
    h   = lowbias32(lo32(offset) ^ key)
    u   = (h >> 8) * 2**-24                      # top 24 bits, exact in fp32

``lowbias32`` is Chris Wellons' integer hash (https://nullprogram.com/blog/2018/07/31/).
Folding the high word of the offset into the key keeps tensors with more than 2**32
elements free of repeats. Only the low 32 bits of ``seed`` are used.

The torch reference works in int32 and relies on two's-complement wraparound for the
multiplies (what ATen does on CPU and CUDA); right shifts are arithmetic there, so each one is
masked back to a logical shift. The Triton helper uses ``uint32``.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton is optional: the references below never need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "lowbias32_int",
    "rng_key",
    "uniform_bits_range_",
    "uniform_bits_to_float",
    "uniform_range_reference",
    "uniform_reference",
]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_INV_2_24 = 1.0 / 16777216.0


def _as_int32(v: int) -> int:
    """The signed int32 with the same low 32 bits as ``v``."""
    v &= _MASK32
    return v - (1 << 32) if v >= (1 << 31) else v


def lowbias32_int(x: int) -> int:
    """``lowbias32`` on a Python int (the specification the tensor versions are tested against)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _MUL1) & _MASK32
    x ^= x >> 15
    x = (x * _MUL2) & _MASK32
    x ^= x >> 16
    return x


def rng_key(seed: int, hi32: int = 0) -> int:
    """Per-(seed, high offset word) key, an unsigned 32-bit int."""
    return lowbias32_int((seed & _MASK32) ^ lowbias32_int((hi32 + _GOLDEN) & _MASK32))


def _lowbias32_(x: Tensor, tmp: Tensor | None = None) -> Tensor:
    """In-place ``lowbias32`` on an int32 tensor of 32-bit patterns (``tmp``: scratch buffer)."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    for shift, mul in ((16, _MUL1), (15, _MUL2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (32 - shift)) - 1  # arithmetic -> logical shift
        x ^= tmp
        if mul is not None:
            x *= _as_int32(mul)
    return x


def _low_word_int32(v: Tensor) -> Tensor:
    v = v & _MASK32
    return torch.where(v >= (1 << 31), v - (1 << 32), v).to(torch.int32)


def uniform_bits_to_float(h: Tensor) -> Tensor:
    """Hash words -> ``u = (h >> 8) * 2**-24`` (fp32)."""
    return ((h >> 8) & 0xFFFFFF).to(torch.float32).mul_(_INV_2_24)


def uniform_reference(seed: int, offsets: Tensor) -> Tensor:
    """``u`` in ``[0, 1)`` (fp32, multiples of 2**-24) for arbitrary int64 ``offsets``."""
    offsets = offsets.to(torch.int64)
    hi = _low_word_int32(offsets >> 32)
    hi += _as_int32(_GOLDEN)
    key = _lowbias32_(hi)
    key ^= _as_int32(seed)
    key = _lowbias32_(key)
    h = _low_word_int32(offsets)
    h ^= key
    return uniform_bits_to_float(_lowbias32_(h))


_ARANGE: dict[torch.device, Tensor] = {}


def _arange_int32(n: int, device: torch.device) -> Tensor:
    """``arange(n)`` in int32 from a per-device cache (``torch.arange`` is slow on CPU)."""
    cached = _ARANGE.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
        _ARANGE[device] = cached
    return cached[:n]


def uniform_bits_range_(out: Tensor, seed: int, start: int) -> Tensor:
    """Hash words of offsets ``start + arange(out.numel())`` into the int32 tensor ``out``.

    ``u = (out >> 8 & 0xFFFFFF) * 2**-24`` (see :func:`uniform_bits_to_float`). The key is
    constant while the high word of the offset is, so it is computed on the host once per
    2**32-aligned segment and no int64 temporaries are needed.
    """
    flat = out.view(-1)
    tmp = torch.empty_like(flat)
    done, count = 0, flat.numel()
    while done < count:
        first = start + done
        seg = min(count - done, (1 << 32) - (first & _MASK32))
        h = flat[done : done + seg]
        torch.add(_arange_int32(seg, flat.device), _as_int32(first), out=h)
        h ^= _as_int32(rng_key(seed, first >> 32))
        _lowbias32_(h, tmp[:seg])
        done += seg
    return out


def uniform_range_reference(
    seed: int, start: int, count: int, device: torch.device | str = "cpu"
) -> Tensor:
    """:func:`uniform_reference` for ``offsets = start + arange(count)`` (``count < 2**31``)."""
    h = torch.empty(count, dtype=torch.int32, device=device)
    return uniform_bits_to_float(uniform_bits_range_(h, seed, start))


if triton is not None:

    @triton.jit
    def lowbias32(x):
        """``lowbias32`` on a ``uint32`` tensor."""
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def uniform(seed, offsets):
        """fp32 ``u`` in ``[0, 1)`` for int64 ``offsets``; same values as the reference."""
        hi = (offsets >> 32).to(tl.uint32) + 0x9E3779B9
        key = lowbias32(seed.to(tl.uint32) ^ lowbias32(hi))
        h = lowbias32(offsets.to(tl.uint32) ^ key)
        return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
