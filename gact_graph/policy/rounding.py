r"""The model of stochastic-rounding noise that the sensitivity estimators share.

A tensor quantized to :math:`b` bits by unbiased stochastic rounding carries, per element, a
rounding error of variance :math:`\mathrm{step}_g^2 f (1 - f)` (``step_g`` the group's
rounding step, ``f`` the fractional position between two levels), :math:`\mathrm{step}^2 / 6`
on average over a uniform ``f``. Here: :func:`S`, the variance factor of ``b`` bits relative to
the range squared; the per-element step of a `QTensor`; :func:`rounding_variance_factor`, how
the true variance of a tensor compares with the uniform model; the probe's noise of that
variance (:func:`add_rounding_noise_`); and the per-row variance the closed form for linear
layers reads (:func:`nonzero_counts`, :func:`row_rounding_variance`).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import Tensor

from gact_graph.core.chunked import row_ranges
from gact_graph.core.quantize import QTensor

__all__ = [
    "CHUNK_ELEMS",
    "MAX_CHUNKS",
    "chunk_elems",
    "S",
    "add_rounding_noise_",
    "element_step",
    "group_steps",
    "nonzero_counts",
    "per_element",
    "rounding_variance_factor",
    "rounding_variance_factors",
    "row_rounding_variance",
    "stable_seed",
]


def S(bits: float) -> float:
    """Variance factor of ``bits``-bit stochastic rounding relative to the range squared:
    :math:`(2^b - 1)^{-2}`; ``0`` for 32 (lossless)."""
    if bits >= 32:
        return 0.0
    return 1.0 / (2.0**bits - 1.0) ** 2


def per_element(q: QTensor, values: Tensor) -> Tensor:
    """Expand one value per quantization group of ``q`` to every element, shaped like the
    original tensor (see :class:`~gact_graph.kernels.layout.GroupLayout` for which group holds
    what)."""
    lay = q.layout
    if lay.num_groups == 0:
        return values.new_zeros(q.shape)
    if lay.rows_per_group > 1:
        per_row = values.repeat_interleave(lay.rows_per_group)[: lay.rows]
        el = per_row[:, None].expand(lay.rows, lay.cols)
    else:
        el = values.view(lay.rows, lay.groups_per_row).repeat_interleave(lay.group_size, dim=1)
        el = el[:, : lay.cols]
    return el.reshape(q.shape)


def element_step(q: QTensor) -> Tensor:
    """The rounding step (``scale``) of the group of every element of ``q``, shaped like the
    original tensor (fp32; 0 for constant groups and for non-finite groups)."""
    _, scale = q.group_params()
    return per_element(q, torch.nan_to_num(scale.float(), nan=0.0, posinf=0.0, neginf=0.0))


def stable_seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def group_steps(q: QTensor) -> tuple[Tensor, Tensor]:
    lo, scale = q.group_params()
    ok = torch.isfinite(lo) & torch.isfinite(scale)
    return torch.where(ok, lo, 0.0)[:, None], torch.where(ok, scale, 0.0)[:, None]


def rounding_variance_factors(x: Tensor, q: QTensor, samples: int = 16384, seed: int = 0) -> Tensor:
    """`rounding_variance_factor` for ``on="x"`` and ``on="x_hat"`` from one sample of
    elements, as a 2-element fp32 tensor on ``x``'s device: nothing is read back to the host
    (the probe calls this in the forward, once per compressed tensor, and reads every
    tensor's factors at once when its backward first needs one)."""
    n = x.numel()
    if n == 0 or q.num_groups == 0:
        return torch.ones(2, dtype=torch.float32, device=x.device)
    lay = q.layout
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    idx = torch.randint(0, n, (min(samples, n),), generator=gen).to(x.device)
    xs = x.detach().reshape(-1)[idx].float()
    r, c = idx // lay.cols, idx % lay.cols
    if lay.rows_per_group > 1:
        gid = r // lay.rows_per_group
    else:
        gid = r * lay.groups_per_row + c // lay.group_size
    lo, step = group_steps(q)
    lo_s, st_s = lo[gid, 0], step[gid, 0]
    u = (xs - lo_s) / torch.where(st_s > 0, st_s, 1.0)
    f = u - torch.floor(u)
    ff = torch.nan_to_num(f * (1 - f), nan=0.0).clamp_(0.0, 0.25)
    st2 = torch.where(st_s > 0, st_s.square(), 0.0)
    lower = lo_s + (u - f) * st_s
    p_zero = (1 - f) * (lower == 0) + f * ((lower + st_s) == 0)
    on_x_hat = torch.nan_to_num(1 - p_zero, nan=0.0).clamp_(0.0, 1.0)
    nonzero = torch.stack([(xs != 0).float(), on_x_hat])
    den = (nonzero * st2).sum(1)
    num = 6.0 * (st2 * ff).sum()
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 1.0)


def rounding_variance_factor(
    x: Tensor, q: QTensor, samples: int = 16384, seed: int = 0, on: str = "x"
) -> float:
    """How the true stochastic-rounding variance of ``x`` quantized as ``q`` compares with the
    uniform-fraction model ``step^2 / 6`` on its non-zero elements:
    ``kappa = 6 * sum(step^2 f (1 - f)) / sum(step^2 [x != 0])`` over a random sample of
    elements (``f``: fractional position between two levels). 1 for smooth data, below 1 for
    skewed groups, 0 when every value sits on a level (binary or one-hot features, which
    stochastic rounding keeps exact). Costs ``samples`` gathers, whatever the tensor's size.

    ``on="x_hat"`` gives the factor for noise drawn on the non-zeros of a *dequantized* copy
    instead (what the replay sees): an element that rounds onto a level at 0 is zero there,
    so the denominator counts ``P(x_hat != 0)`` instead of ``[x != 0]``; without it the
    replay would underestimate tensors with many values near 0 (ReLU outputs at few bits).
    Both from one sample: `rounding_variance_factors`."""
    if on not in ("x", "x_hat"):
        raise ValueError(f"on must be 'x' or 'x_hat', got {on!r}")
    return float(rounding_variance_factors(x, q, samples, seed)[0 if on == "x" else 1])


#: elements per chunk when the probe walks a tensor: its temporaries stay ~1 MB, never
#: tensor-sized (a probed step must not hold a second copy of the tensor) ...
CHUNK_ELEMS = 1 << 18
#: ... or a tensor is walked in about this many chunks where that keeps fewer: each chunk
#: costs a dozen small operations (kernel launches on a GPU), so a tensor of tens of millions
#: of elements is walked in chunks of a sixty-fourth of it (temporaries of a few percent of
#: the tensor) rather than in hundreds of launch-bound ones
MAX_CHUNKS = 64


def chunk_elems(numel: int) -> int:
    """Elements per chunk for a probe's walk over a tensor of ``numel`` elements: `CHUNK_ELEMS`,
    or ``numel / MAX_CHUNKS`` where that is more (`row_ranges` rounds it to whole rows, so a
    tensor takes about `MAX_CHUNKS` chunks, never far more)."""
    return max(CHUNK_ELEMS, -(-numel // MAX_CHUNKS))


def add_rounding_noise_(q: QTensor, x: Tensor, seed: int, kappa: float = 1.0) -> Tensor:
    """Add to ``x`` (contiguous, shaped like ``q``'s tensor) in place a Rademacher vector scaled
    per element to ``kappa`` times the average stochastic-rounding variance of its group,
    ``step^2 / 6`` (the mean of ``f (1 - f)`` over a uniform fractional part ``f``; ``kappa``
    from :func:`rounding_variance_factor`), zero on exact zeros (ReLU outputs sitting on a
    level have no rounding noise). Drawn in row chunks, so the only temporaries are
    chunk-sized; the same ``seed`` gives the same draw."""
    lay = q.layout
    if q.num_groups == 0 or kappa <= 0 or x.numel() == 0:
        return x
    _, step = group_steps(q)
    std = step[:, 0].float() * math.sqrt(kappa / 6.0)  # per group
    rpg, gpr, g = lay.rows_per_group, lay.groups_per_row, lay.group_size
    x2 = x.view(lay.rows, lay.cols)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    for r0, r1 in row_ranges(q, chunk_elems(x.numel())):
        xc = x2[r0:r1]
        sign = torch.randint(0, 2, xc.shape, generator=gen, device=x.device, dtype=torch.int8)
        if rpg > 1:  # a group holds rpg whole rows
            s = std[torch.arange(r0, r1, device=x.device) // rpg][:, None]
        else:  # a row holds gpr groups of g columns
            s = std[r0 * gpr : r1 * gpr].view(r1 - r0, gpr).repeat_interleave(g, dim=1)
            s = s[:, : lay.cols]
        noise = sign.float().mul_(2).sub_(1).mul_(s).mul_(xc != 0)
        xc.add_(noise.to(xc.dtype))
    return x


def nonzero_counts(x: Tensor, q: QTensor) -> Tensor:
    """What `row_rounding_variance` needs of the 2-D ``x`` (quantized as ``q``) besides
    ``q``'s own metadata, taken when ``x`` is packed and held until its backward: the number of
    non-zeros of each row (groups of whole rows) or of each row's part of each group (rows
    split into groups), in the narrowest integer type that holds them: a quarter of a row
    vector of fp32 variances or less, which matters for deep models whose compressed tensors
    are small. Computed in row chunks (`row_ranges`)."""
    lay = q.layout
    rows, cols = x.shape
    rpg, gpr, g = lay.rows_per_group, lay.groups_per_row, lay.group_size
    most = cols if rpg > 1 else g
    dtype = torch.uint8 if most <= 255 else torch.int16 if most <= 32767 else torch.int32
    shape = (rows,) if rpg > 1 else (rows, gpr)
    out = torch.zeros(shape, dtype=dtype, device=x.device)
    for r0, r1 in row_ranges(q, chunk_elems(x.numel())):
        nz = x[r0:r1] != 0
        if rpg > 1:  # a group holds rpg whole rows
            out[r0:r1] = nz.sum(1, dtype=torch.int32).to(dtype)
        else:  # a row holds gpr groups of g columns
            pad = gpr * g - cols
            if pad:
                nz = torch.nn.functional.pad(nz, (0, pad))
            out[r0:r1] = nz.view(r1 - r0, gpr, g).sum(2, dtype=torch.int32).to(dtype)
        del nz
    return out


def row_rounding_variance(q: QTensor, counts: Tensor, kappa: float = 1.0) -> Tensor:
    """Per row ``i`` of ``q``'s 2-D tensor: the summed rounding variance of its elements,
    ``s_i = kappa * sum_j step_g(ij)^2 / 6 * [x_ij != 0]`` (fp32, shape ``(rows,)``), the model
    `add_rounding_noise_` draws from, with ``counts`` from `nonzero_counts`."""
    lay = q.layout
    if q.num_groups == 0 or kappa <= 0 or lay.rows == 0:
        return torch.zeros(lay.rows, dtype=torch.float32, device=counts.device)
    _, step = group_steps(q)
    var = step[:, 0].float().square() * (kappa / 6.0)  # per group
    if lay.rows_per_group > 1:  # a group holds rpg whole rows
        rows = torch.arange(lay.rows, device=counts.device)
        return counts.float() * var[rows // lay.rows_per_group]
    return (counts.float() * var.view(lay.rows, lay.groups_per_row)).sum(1)
