"""How a tensor is cut into quantization groups: the plain data type that the quantizer, its
kernels and the bit allocator share (it lives with the kernels, the lowest layer, so that they
import nothing from the layers above them)."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["GroupLayout", "META_BYTES_PER_GROUP", "group_layout"]

#: bytes of per-group metadata: bf16 ``lo`` and bf16 ``scale``.
META_BYTES_PER_GROUP = 4


class GroupLayout(NamedTuple):
    """How a tensor is cut into quantization groups (see :func:`group_layout`).

    Element ``(r, c)`` of the ``(rows, cols)`` view belongs to group
    ``(r // rows_per_group) * groups_per_row + c // group_size`` (the second term only when
    ``rows_per_group == 1``) at position ``(r % rows_per_group) * cols + c % group_size``.
    """

    num_groups: int
    group_size: int  #: effective ``g``: elements per group including padding, a multiple of 8
    rows: int
    cols: int
    groups_per_row: int  #: ``n`` (> 1 only when a row is split)
    rows_per_group: int  #: ``k`` (> 1 only when a group holds several whole rows)

    @property
    def row_width(self) -> int:
        """Elements of one row inside a group: ``cols`` when groups hold rows, else ``g``."""
        return self.cols if self.rows_per_group > 1 else self.group_size

    @property
    def padded_numel(self) -> int:
        return self.num_groups * self.group_size

    def packed_nbytes(self, bits: int) -> int:
        """Bytes of packed codes: ``num_groups * g * bits / 8`` (exact since ``8 | g``)."""
        return self.num_groups * self.group_size * bits // 8

    def nbytes(self, bits: int) -> int:
        """Bytes a :class:`QTensor` with this layout holds: codes plus bf16 ``lo``/``scale``."""
        return self.packed_nbytes(bits) + self.num_groups * META_BYTES_PER_GROUP


def _round_up_8(v: int) -> int:
    return (v + 7) // 8 * 8


def group_layout(shape: Sequence[int] | torch.Size, group_size: int = 256) -> GroupLayout:
    """Group layout of a tensor of ``shape``, without quantizing anything.

    With ``(R, C)`` the 2-D view and ``G = group_size``:

    * ``C >= G``: each row is split into ``n`` groups of ``g = round_up_8(ceil(C / n))``
      elements, ``n = ceil(C / G)`` (recounted as ``ceil(C / g)`` so no group is empty); the
      last group of a row is padded.
    * ``C < G``: a group holds ``k = G // C`` whole rows, ``g = round_up_8(k * C)``; the last
      group may hold fewer rows.

    A group therefore never holds part of a row together with part of another row.

    Args:
        shape: tensor shape (any number of dimensions, including 0).
        group_size: target group size ``G`` (a positive int).
    """
    try:
        valid = not isinstance(group_size, bool) and operator.index(group_size) >= 1
    except TypeError:
        valid = False
    if not valid:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    group_size = operator.index(group_size)
    shape = tuple(int(s) for s in shape)
    cols = shape[-1] if len(shape) >= 1 else 1
    if len(shape) == 1:
        rows, cols = shape[0], 1
    else:
        rows = math.prod(shape[:-1])
    if rows == 0 or cols == 0:
        return GroupLayout(0, 8, rows, cols, 1, 1)
    if cols >= group_size:
        n = -(-cols // group_size)
        g = _round_up_8(-(-cols // n))
        n = -(-cols // g)
        return GroupLayout(rows * n, g, rows, cols, n, 1)
    k = min(group_size // cols, rows)  # never a group larger than the tensor needs
    g = _round_up_8(k * cols)
    return GroupLayout(-(-rows // k), g, rows, cols, 1, k)
