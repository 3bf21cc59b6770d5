r"""Training-mode BatchNorm that saves its *normalized* input :math:`\hat x` instead of
:math:`x`.

Why: stock BatchNorm saves :math:`x` and rebuilds :math:`\hat x = (x - \mu)\, r` in backward
(:math:`r = 1/\sqrt{\sigma^2 + \epsilon}` per channel). Quantization groups follow rows (one
node's features), so the rounding step of a row is set by the row's widest feature, while
:math:`r` is set per feature: a feature whose spread across nodes is small next to the row's
range (a large mean, a narrow distribution) has its rounding error multiplied by a large
:math:`r`. Measured on a 16-layer ResGCN at 2 bits: gradient errors ~1e4 x the gradient,
inf/NaN at 64 layers (``tests/test_scale_deep.py``). :math:`\hat x` has zero mean and unit
variance in every channel, so its rows' ranges are O(1) and no channel amplifies the rounding
error. It costs the same bytes as :math:`x`, needs no inversion (works with any ``weight``,
zeros included), and backward needs nothing else:

.. math::
    \partial\beta = \textstyle\sum g, \quad \partial\gamma = \sum g\,\hat x, \quad
    \partial x = \frac{\gamma r}{M}\big(M g - \partial\beta - \hat x\, \partial\gamma\big)

(sums over the ``M`` elements of a channel). Lossless (``bits=None``) it matches PyTorch's
BatchNorm gradients within float rounding.

Only batch-statistics mode is intercepted (``training=True``); eval-mode BatchNorm saves
nothing node-level beyond its input and runs PyTorch's op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gact_graph.config import DOUBLE_BACKWARD_HELP
from gact_graph.core.chunked import RowChunked, row_ranges
from gact_graph.switches import is_scratch, reading_rows

__all__ = ["BatchNormFunction", "batch_norm"]


def _channel_dot(g: Tensor, xh: Tensor, dims: list[int]) -> Tensor:
    """``(g * xh).sum(dims)``; for (N, C) inputs summed over row chunks, so that no N x C
    product is held."""
    if g.dim() != 2:
        return (g * xh).sum(dims)
    out = g.new_zeros(g.shape[1])
    step = max(1, (1 << 18) // max(g.shape[1], 1))
    for r0 in range(0, g.shape[0], step):
        out += (g[r0 : r0 + step] * xh[r0 : r0 + step]).sum(0)
    return out


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


class BatchNormFunction(torch.autograd.Function):
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training=True, ...)``
    saving :math:`\\hat x`, the per-channel ``invstd`` and the weight.

    Inside the sensitivity probe's partial backwards (`reads_row_chunks`) a compressed 2-D
    :math:`\\hat x` arrives as a `RowChunked` and is dequantized a row chunk at a time: the
    probe replays this backward on top of the user's, and a whole dequantized copy would add
    one input-sized tensor to the probed step's peak (GCN + BatchNorm). A plain step's backward
    is handed the dense copy (``reads_rows_every_step`` off): reading in chunks costs CPU time
    that one input-sized copy does not repay there."""

    reads_row_chunks = True
    reads_rows_every_step = False

    @staticmethod
    def forward(ctx, x, running_mean, running_var, weight, bias, momentum, eps):
        y, mean, invstd = torch.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        # in float32 at least: x - mean cancels most of x's digits when a channel's mean is
        # large next to its spread
        acc = torch.promote_types(x.dtype, torch.float32)
        # one input-sized tensor, scaled in place: the subtraction's result and the product
        # at once would be the forward's widest moment of a GCN layer (input, convolution
        # output, BatchNorm output, normalized input and that temporary)
        xhat = torch.sub(x, _channel_view(mean.to(acc), x.dim())).to(acc)
        xhat.mul_(_channel_view(invstd.to(acc), x.dim()))
        xhat = xhat.to(x.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(xhat, invstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "gact_graph: the normalized-input batch_norm is differentiable once; "
                + DOUBLE_BACKWARD_HELP
            )
        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            xhat, invstd, weight = ctx.saved_tensors
        nd = grad.dim()
        dims = [0, *range(2, nd)]
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        chunks = None
        if isinstance(xhat, RowChunked) and not xhat.transposed:
            chunks = xhat.q  # read below a row chunk at a time
        g = grad.to(acc)
        xh = None if chunks is not None else xhat.to(acc)
        m = g.numel() // g.shape[1]
        dbeta = g.sum(dims)
        if chunks is None:
            dgamma = _channel_dot(g, xh, dims)
        else:
            dgamma = g.new_zeros(g.shape[1])
            for r0, r1 in row_ranges(chunks):
                dgamma += (g[r0:r1] * chunks.rows(r0, r1).dequantize().to(acc)).sum(0)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dx = scale * (m g - dbeta - xh dgamma), written so that one input-sized tensor
            # is made (the probe replays this backward on top of the user's: it adds up)
            scale = invstd.to(acc) / m
            if weight is not None:
                scale = scale * weight.to(acc)
            a, b = _channel_view(-scale * dgamma, nd), _channel_view(scale * m, nd)
            c = _channel_view(scale * dbeta, nd)
            if chunks is None:
                # the probe's replay: written into its own noisy copy of xhat (`scratch`)
                dx = xh.mul_(a) if is_scratch(xhat) and xh is xhat else xh * a
                dx.addcmul_(g, b).sub_(c)
            else:
                dx = torch.empty_like(g)
                for r0, r1 in row_ranges(chunks):
                    part = torch.mul(chunks.rows(r0, r1).dequantize().to(acc), a, out=dx[r0:r1])
                    part.addcmul_(g[r0:r1], b).sub_(c)
            dx = dx.to(grad.dtype)
        if weight is not None and ctx.needs_input_grad[3]:
            dw = dgamma.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[4]:
            db = dbeta.to(ctx.bias_dtype)
        return dx, None, None, dw, db, None, None


def batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Training-mode (batch statistics) BatchNorm through `BatchNormFunction`."""
    if x.dim() < 2:
        raise ValueError(f"batch_norm expects (N, C, ...) input, got shape {tuple(x.shape)}")
    if x.numel() == 0:  # an empty graph: stock returns an empty output and saves nothing
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    if x.numel() // x.shape[1] == 1:  # stock's check: one value per channel has no variance
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {x.shape}"
        )
    return BatchNormFunction.apply(x, running_mean, running_var, weight, bias, momentum, eps)
