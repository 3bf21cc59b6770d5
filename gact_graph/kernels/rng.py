"""Counter-based uniform random numbers, bit-identical in torch and Triton.

Stochastic rounding needs one ``u ~ U[0, 1)`` per element. Drawing it from a stateful
generator would tie the result to the launch configuration; instead ``u`` is a pure function
of ``(seed, offset)``, where ``offset`` is the element's flat int64 index in the padded group
matrix. One 32-bit hash serves the two elements of a pair ``p = offset >> 1``: the even offset
takes its low 16 bits, the odd one its high 16 bits. Both implementations below compute, with
all arithmetic mod 2**32::

    key = lowbias32(seed ^ lowbias32(hi32(p) + 0x9E3779B9))
    h   = lowbias32(lo32(p) + key)
    u   = ((h >> (16 * (offset & 1))) & 0xFFFF) * 2**-16      # exact in fp32

``lowbias32`` is Chris Wellons' integer hash (https://nullprogram.com/blog/2018/07/31/); its
low and high halves are separately well mixed, so the two uniforms of a pair are independent to
the tests' resolution (``tests/kernels/test_kernels_quantize.py``). Sixteen bits of ``u`` bias a
stochastic rounding by at most ``2**-16`` of a quantization step (``docs/design.md``, the
quantizer). Folding the high word of the pair index into the key keeps tensors with more than
2**33 elements free of repeats. Only the low 32 bits of ``seed`` are used.

The torch reference works in int32 and relies on two's-complement wraparound for the
multiplies (what ATen does on CPU and CUDA); right shifts are arithmetic there, so each one is
masked back to a logical shift. The Triton helpers use ``uint32``.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

try:  # Triton is optional: the references below never need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = [
    "U_BITS",
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
_INV_2_16 = 1.0 / 65536.0
#: bits of resolution of each uniform
U_BITS = 16


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
    """Per-element 16-bit words (any integer dtype, low 16 bits used) -> ``u = h * 2**-16``."""
    return (h.to(torch.int32) & 0xFFFF).to(torch.float32).mul_(_INV_2_16)


def _split_halves(h: Tensor, offsets: Tensor) -> Tensor:
    """The 16-bit half of each pair's hash word ``h`` that ``offsets`` selects (int32)."""
    shift = (offsets & 1).to(torch.int32) * 16
    return torch.bitwise_right_shift(h, shift) & 0xFFFF


def uniform_reference(seed: int, offsets: Tensor) -> Tensor:
    """``u`` in ``[0, 1)`` (fp32, multiples of 2**-16) for arbitrary int64 ``offsets``."""
    offsets = offsets.to(torch.int64)
    pair = offsets >> 1
    hi = _low_word_int32(pair >> 32)
    hi += _as_int32(_GOLDEN)
    key = _lowbias32_(hi)
    key ^= _as_int32(seed)
    key = _lowbias32_(key)
    h = _low_word_int32(pair)
    h += key
    return uniform_bits_to_float(_split_halves(_lowbias32_(h), offsets))


_ARANGE: dict[torch.device, Tensor] = {}


def _arange_int32(n: int, device: torch.device) -> Tensor:
    """``arange(n)`` in int32 from a per-device cache (``torch.arange`` is slow on CPU)."""
    cached = _ARANGE.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
        _ARANGE[device] = cached
    return cached[:n]


def uniform_bits_range_(out: Tensor, seed: int, start: int) -> Tensor:
    """The 16-bit words of offsets ``start + arange(out.numel())``, into the int32 tensor ``out``.

    ``u = out * 2**-16`` (see :func:`uniform_bits_to_float`). The hash words of the pairs the
    range touches are computed once each; read as int16 (little-endian: low half first) they
    are the elements' words in offset order. The key is constant while the high word of the
    pair index is, so it is computed on the host once per 2**32-pair segment and no int64
    temporaries are needed.
    """
    flat = out.view(-1)
    count = flat.numel()
    if count == 0:
        return out
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        raise RuntimeError("uniform_bits_range_ reads int32 words as int16 halves (little-endian)")
    p0 = start >> 1
    pairs = ((start + count - 1) >> 1) - p0 + 1
    words = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    tmp = torch.empty_like(words)
    done = 0
    while done < pairs:
        first = p0 + done
        seg = min(pairs - done, (1 << 32) - (first & _MASK32))
        h = words[done : done + seg]
        torch.add(
            _arange_int32(seg, flat.device), _as_int32(first + rng_key(seed, first >> 32)), out=h
        )
        _lowbias32_(h, tmp[:seg])
        done += seg
    del tmp
    halves = words.view(torch.int16)[start & 1 : (start & 1) + count]
    flat.copy_(halves)
    flat &= 0xFFFF  # the int16 halves' sign extension cleared
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
    def halves_to_u_half(h):
        """The pair's two ``u - 1/2`` (fp32, exact) from its hash word ``h`` (``uint32``): low
        half, high half. ``u = m * 2**-16`` is built as the float ``1 + m * 2**-16`` (``m`` in
        the top mantissa bits) minus 1, so no integer-to-float conversion is needed."""
        lo = ((h << 7) & 0x007FFF80) | 0x3F800000
        hi = ((h >> 9) & 0x007FFF80) | 0x3F800000
        return lo.to(tl.float32, bitcast=True) - 1.5, hi.to(tl.float32, bitcast=True) - 1.5

    @triton.jit
    def uniform(seed, offsets):
        """fp32 ``u`` in ``[0, 1)`` for int64 ``offsets``; same values as the reference."""
        pair = offsets >> 1
        hi = (pair >> 32).to(tl.uint32) + 0x9E3779B9
        key = lowbias32(seed.to(tl.uint32) ^ lowbias32(hi))
        h = lowbias32(pair.to(tl.uint32) + key)
        m = (h >> ((offsets & 1) * 16).to(tl.uint32)) & 0xFFFF
        return m.to(tl.float32) * (1.0 / 65536.0)
