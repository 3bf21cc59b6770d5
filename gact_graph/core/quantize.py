r"""Per-group stochastic-rounding quantization of activations (ActNN / GACT style).

A tensor ``x`` is viewed as a 2-D matrix ``(R, C)`` with ``C = x.shape[-1]`` (a 1-D tensor as
``(N, 1)``, a 0-dim tensor as ``(1, 1)``) and cut into groups that follow rows
(:func:`group_layout`). Each group of ``g`` elements (``g`` a multiple of 8) stores
``b``-bit codes, packed densely (:mod:`gact_graph.kernels.bitpack`), plus two bf16 numbers:

* ``lo_b``: the group minimum rounded *down* to bf16;
* ``scale_b``: :math:`(\mathrm{hi} - \mathrm{lo}_b) / (2^b - 1)` rounded *up* to bf16 (and
  bumped one bf16 step more if fp32 rounding left :math:`\mathrm{lo}_b + (2^b-1)\,\mathrm{scale}_b`
  below ``hi``), so every element lies inside the representable range
  :math:`[\mathrm{lo}_b,\ \mathrm{lo}_b + (2^b-1)\,\mathrm{scale}_b]` and clamping never biases.

Quantization is stochastic rounding,

.. math::
    q = \mathrm{rne}\big(\min(t + u - \tfrac12,\ 2^b - 1)\big), \qquad
    t = (x - \mathrm{lo}_b) \cdot \mathrm{fl}(1 / \mathrm{scale}_b), \qquad u \sim U[0, 1),

every operation in fp32 (``rne``: round half to even, which is :math:`\lfloor t + u \rfloor`
except at exact ties), with ``u`` from a counter-based hash of ``(seed, element offset)``
(:mod:`gact_graph.kernels.rng`), and dequantization is :math:`\mathrm{lo}_b + q\,\mathrm{scale}_b`
in fp32, cast to the input dtype. It is unbiased, :math:`E[\hat x] = x`, up to fp32 rounding of
``t`` (a relative error of about 2**-23, as the rounding of ``x - lo_b`` already was), ``u``
having 16 bits (a bias of at most 2**-16 of a step), ties, and the final cast to fp16/bf16;
per-element variance
:math:`\mathrm{scale}_b^2\, f (1 - f) \le \mathrm{scale}_b^2 / 4`, ``f`` the fractional part.
The form is chosen for the GPU: one multiply instead of a division, and a rounding done by an
fp32 add instead of conversion instructions (:mod:`gact_graph.kernels.quantize`).
The product ``q * scale_b`` is exact in fp32 (8-bit integer times 8-bit bf16 significand), so
fused and unfused multiply-add give the same bits.

Special groups:

* **Constant groups** (``hi == lo``) come back *exactly*: the fp32 value ``v`` is split over the
  metadata, ``lo`` holding the top 16 bits of ``v``, ``scale`` holding bits 1..15 with its sign
  bit set as a flag (a negative bf16 ``scale`` never occurs otherwise), and every code holding
  bit 0 of ``v``. Constant zero (and any bf16-exact constant) therefore stores ``scale = -0.0``
  and all-zero codes.
* **Non-finite groups** (any NaN or +-Inf, or a range too wide for fp32/bf16, i.e. beyond
  ~3.39e38) store ``lo = scale = NaN`` and zero codes, so the whole group dequantizes to NaN
  and other groups are unaffected. Nothing syncs with the device or raises, which keeps AMP's
  ``GradScaler`` able to see the non-finite values and skip the step.

All arithmetic is fp32: fp64 inputs are quantized from their fp32 rounding.

Example::

    >>> x = torch.randn(1000, 64)
    >>> q = quantize(x, bits=2, seed=0)
    >>> q.nbytes  # 250 groups of 256 codes * 2 bits + 4 bytes of metadata each
    17000
    >>> q.dequantize().shape
    torch.Size([1000, 64])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gact_graph.kernels import force_triton, triton_available
from gact_graph.kernels.bitpack import SUPPORTED_BITS, PackedMask, pack_mask
from gact_graph.kernels.layout import META_BYTES_PER_GROUP, GroupLayout, group_layout

__all__ = [
    "GroupLayout",
    "META_BYTES_PER_GROUP",
    "QTensor",
    "SUPPORTED_BITS",
    "exceeds_fp32_range",
    "group_layout",
    "pack_bool_mask",
    "quantize",
]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _use_triton(t: Tensor) -> bool:
    if force_triton():
        if not triton_available():
            raise RuntimeError(
                "GACT_GRAPH_FORCE_TRITON=1 but Triton is not installed: pip install triton"
            )
        return True
    return t.is_cuda and triton_available()


@dataclass(eq=False)
class QTensor:
    """A quantized tensor: packed codes plus bf16 per-group metadata.

    Attributes:
        packed: 1-D ``uint8`` codes, group after group (``g * bits / 8`` bytes each).
        meta: ``(num_groups, 2)`` bf16, columns ``lo_b`` and ``scale_b`` (see the module
            docstring for the encoding of constant and non-finite groups).
        bits: bits per code.
        shape, dtype: of the original tensor.
        layout: the :class:`GroupLayout` used.
        seed: seed of the stochastic rounding.
    """

    packed: Tensor
    meta: Tensor
    bits: int
    shape: torch.Size
    dtype: torch.dtype
    layout: GroupLayout
    seed: int

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def group_size(self) -> int:
        """The effective group size ``g`` (not the requested ``G``)."""
        return self.layout.group_size

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def nbytes(self) -> int:
        """True bytes held: packed codes plus 4 bytes of metadata per group."""
        return self.packed.numel() * self.packed.element_size() + (
            self.meta.numel() * self.meta.element_size()
        )

    def numel(self) -> int:
        return math.prod(self.shape)

    def dequantize(self) -> Tensor:
        """The reconstruction, with the original shape, dtype and device; contiguous."""
        from gact_graph.kernels import quantize as kq

        fn = kq.triton_dequantize if _use_triton(self.packed) else kq.dequantize_reference
        return fn(self.packed, self.meta, self.bits, self.shape, self.dtype, self.layout)

    def row_step(self) -> int:
        """Rows per group (1 when groups split rows): `rows` must start on a multiple."""
        return self.layout.rows_per_group

    def rows(self, r0: int, r1: int) -> QTensor:
        """Rows ``r0:r1`` of the 2-D ``(R, C)`` view, as a ``(r1 - r0, C)`` `QTensor` that
        shares this one's codes and metadata (a group never straddles two rows' worth of
        groups, so a row range is a range of groups). ``r0`` must be a multiple of
        `row_step`; its dequantization equals the same rows of `dequantize`."""
        lay = self.layout
        k, n = lay.rows_per_group, lay.groups_per_row
        if not (0 <= r0 <= r1 <= lay.rows) or r0 % k:
            raise ValueError(f"rows {r0}:{r1} of {lay.rows} do not start on a group (step {k})")
        if k > 1:
            first, last = r0 // k, -(-r1 // k)
        else:
            first, last = r0 * n, r1 * n
        bpg = lay.packed_nbytes(self.bits) // max(lay.num_groups, 1)
        sub = GroupLayout(last - first, lay.group_size, r1 - r0, lay.cols, n, k)
        return QTensor(
            self.packed[first * bpg : last * bpg],
            self.meta[first:last],
            self.bits,
            torch.Size((r1 - r0, lay.cols)),
            self.dtype,
            sub,
            self.seed,
        )

    def group_params(self) -> tuple[Tensor, Tensor]:
        """Per-group fp32 ``(lo, scale)`` with ``dequant = lo + code * scale``.

        ``scale`` is 0 for constant groups (``lo`` is then their exact value) and NaN for
        non-finite groups. The stochastic-rounding variance of an element is at most
        ``scale**2 / 4``.
        """
        from gact_graph.kernels import quantize as kq

        lo, scale, const = kq.decode_meta(self.meta)
        if self.num_groups:
            bpg = self.layout.packed_nbytes(self.bits) // self.num_groups
            first_code = self.packed.view(self.num_groups, bpg)[:, 0] & 1
            lo = torch.where(const, lo + first_code.to(torch.float32) * scale, lo)
            scale = torch.where(const, torch.zeros_like(scale), scale)
        return lo, scale


def exceeds_fp32_range(x: Tensor) -> bool:
    """True for a float64 tensor with finite values that fp32 cannot hold (they would become
    inf and their group NaN). Only float64 is read (a device sync); other dtypes fit."""
    if x.dtype != torch.float64 or x.numel() == 0:
        return False
    big = x.abs() > torch.finfo(torch.float32).max
    return bool((big & torch.isfinite(x)).any())


def quantize(x: Tensor, bits: int, group_size: int = 256, seed: int | None = None) -> QTensor:
    """Quantize ``x`` per group to ``bits`` bits with unbiased stochastic rounding.

    Args:
        x: floating tensor (fp32, fp16, bf16 or fp64) of any shape and strides.
        bits: bits per element, one of ``1, 2, 4, 8``.
        group_size: target group size ``G`` (see :func:`group_layout`).
        seed: seed of the rounding noise; ``None`` draws one from torch's default CPU
            generator, so results are reproducible under ``torch.manual_seed``. Equal seeds and
            inputs give identical results, on the Triton and the reference path alike.

    Returns:
        A :class:`QTensor`; ``.dequantize()`` reconstructs ``x``.
    """
    _check_bits(bits)
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"quantize expects a floating-point tensor, got {got}")
    if exceeds_fp32_range(x):
        raise ValueError(
            "quantize works in fp32, and this float64 tensor holds finite values beyond fp32's "
            "range (|x| > 3.4e38), which would come back as NaN; keep it unquantized"
        )
    layout = group_layout(x.shape, group_size)
    if seed is None:
        # from the CPU generator (never a device tensor, whatever the default device): no sync
        seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu").item())
    seed = int(seed)
    from gact_graph.kernels import quantize as kq

    fn = kq.triton_quantize if _use_triton(x) else kq.quantize_reference
    packed, meta = fn(x, bits, layout, seed)
    return QTensor(packed, meta, bits, x.shape, x.dtype, layout, seed)


def pack_bool_mask(mask: Tensor) -> PackedMask:
    """``mask`` (bool) at 1 bit per element, as `gact_graph.kernels.bitpack.pack_mask` packs it:
    on CUDA with Triton in one launch (`gact_graph.kernels.mask_pack`), same bytes; elsewhere
    the PyTorch packing."""
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    if not _use_triton(mask):
        return pack_mask(mask)
    from gact_graph.kernels.mask_pack import triton_pack_mask  # imports Triton

    codes = mask.reshape(-1).contiguous().view(torch.uint8)
    return PackedMask(triton_pack_mask(codes), mask.shape)
