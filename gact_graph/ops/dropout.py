"""Dropout that saves the random-number generator's state instead of its mask.

What stock PyTorch (2.13) saves for ``F.dropout(x, p, training=True)``:

- CPU, and in-place dropout on any device: ATen's ``_dropout_impl`` draws
  ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)`` and returns ``x * noise``;
  autograd's ``MulBackward0`` keeps ``noise`` — a full tensor of ``x``'s dtype (4 bytes per
  element in float32).
- CUDA, out of place: the fused ``native_dropout`` kernel returns ``(out, mask)`` and keeps the
  ``bool`` mask (1 byte per element).

`DropoutFunction` replays the same ATen calls in forward, so the output (and the generator's
state afterwards) are bit-identical to stock dropout under the same seed, but saves only the
generator's state from just before the draw (5056 bytes on CPU, 16 bytes on CUDA, whatever
the tensor size; the controller counts it as a lossless ``index`` tensor). Backward rebuilds
the mask bit for bit:

- generic path: the state is loaded into a *private* `torch.Generator` and the same
  ``bernoulli_`` is drawn into a tensor with the same sizes and strides; the caller's
  generator is never touched, so the training RNG stream is unaffected;
- CUDA fused path: ``native_dropout`` takes no generator, so the default CUDA generator is set
  to the saved state, the kernel re-run, and the caller's state restored: on the gradient
  itself where that gives ``native_dropout_backward``'s result bit for bit (`_same_draw`), on an
  input-sized dummy for the mask otherwise. The kernel's
  vectorization (hence which random number lands on which element) depends on the input's
  alignment and density, so this path is used only for dense inputs aligned like a fresh
  allocation; otherwise (and while a CUDA graph is being captured) the ``bool`` mask itself is
  saved (1 bit per element once the controller packs it).

Gradients are ``grad * noise`` (``MulBackward0``) and ``native_dropout_backward(grad, mask,
1/(1-p))`` respectively: the very expressions PyTorch evaluates. ``p == 0``, ``p == 1``,
``training=False`` and empty inputs are left to PyTorch (identity, or a multiplication by a
zero scalar), as are devices other than CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DropoutFunction", "dropout", "can_regenerate"]

#: inputs at this alignment take the same vectorized path in ``native_dropout`` as a fresh
#: allocation (the caching allocator aligns to 512 bytes; the kernel needs at most 16).
_FRESH_ALIGNMENT = 256


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def can_regenerate(x: Tensor) -> bool:
    """Whether the fused CUDA kernel's mask for ``x`` can be replayed bit for bit."""
    if x.device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    return x.is_contiguous() and x.data_ptr() % _FRESH_ALIGNMENT == 0


def _same_draw(grad: Tensor, shape: tuple, dtype: torch.dtype, p: float) -> bool:
    """Whether ``native_dropout(grad, p)`` returns ``native_dropout_backward(grad, mask, 1 / (1 -
    p))`` bit for bit: it draws the forward's mask (the forward's input passed `can_regenerate`,
    so ``grad`` must too: contiguous, aligned like a fresh allocation, same size and dtype) and
    scales by the same float as the backward kernel (`_kernel_scale_is_exact`)."""
    return (
        grad.dtype == dtype
        and tuple(grad.shape) == shape
        and can_regenerate(grad)
        and _kernel_scale_is_exact(grad.device, p)
    )


_SCALE_EXACT: dict[tuple[str, float], bool] = {}


def _kernel_scale_is_exact(device: torch.device, p: float) -> bool:
    """Whether the forward kernel's ``1 / keep`` (float arithmetic in the kernel) equals
    ``float32(1 / (1 - p))``, the scale autograd hands ``native_dropout_backward`` (double
    arithmetic): they differ by an ulp for some ``p``. Read off the kernel once per device and
    ``p`` (a kept element of ``native_dropout(ones)`` is the scale; one host sync), with the
    caller's generator state restored."""
    key = (str(device), p)
    if key not in _SCALE_EXACT:
        ones = torch.ones(1 << 16, device=device)
        gen = _default_generator(device)
        drawn = _with_state(device, gen.get_state(), lambda: torch.native_dropout(ones, p, True)[0])
        kept = float(drawn.max())
        _SCALE_EXACT[key] = kept == float(torch.tensor(1.0 / (1.0 - p), dtype=torch.float32))
    return _SCALE_EXACT[key]


def _with_state(device: torch.device, state: Tensor, draw):
    """``draw()`` with the default generator of ``device`` set to ``state``; the caller's state
    restored afterwards."""
    gen = _default_generator(device)
    caller = gen.get_state()
    gen.set_state(state)
    try:
        return draw()
    finally:
        gen.set_state(caller)


class DropoutFunction(torch.autograd.Function):
    """Training-mode dropout (``0 < p < 1``) whose backward regenerates the mask."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, inplace: bool) -> Tensor:
        gen = _default_generator(x.device)
        ctx.p = p
        ctx.meta = (tuple(x.shape), x.dtype, x.device)
        fused = x.device.type == "cuda" and not inplace
        ctx.fused = fused
        if fused:
            regen = can_regenerate(x)
            state = gen.get_state() if regen else None
            out, mask = torch.native_dropout(x, p, True)
            ctx.regen = regen
            ctx.save_for_backward(state if regen else mask)
            return out
        state = gen.get_state()
        noise = torch.empty_like(x)
        ctx.stride = noise.stride()
        noise.bernoulli_(1 - p)
        noise.div_(1 - p)
        ctx.save_for_backward(state)
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad: Tensor):
        (saved,) = ctx.saved_tensors
        shape, dtype, device = ctx.meta
        p = ctx.p
        if ctx.fused:
            scale = 1.0 / (1.0 - p)
            if ctx.regen and not torch.is_grad_enabled() and _same_draw(grad, shape, dtype, p):
                # The kernel's mask depends on the generator state and the input's size, dtype
                # and alignment only, never on its values, and its output is input * mask *
                # scale: run on the gradient, it returns native_dropout_backward's result bit
                # for bit, with no input-sized dummy and no second output (the mask, 1 byte an
                # element, is the only other tensor)
                out = _with_state(device, saved, lambda: torch.native_dropout(grad, p, True)[0])
                return out, None, None
            if ctx.regen:
                # only the mask is kept: the dummy and its dropped-out copy (two input-sized
                # tensors) are freed before the gradient is formed
                dummy = torch.empty(shape, dtype=dtype, device=device)
                mask = _with_state(device, saved, lambda: torch.native_dropout(dummy, p, True)[1])
                del dummy
            else:
                mask = saved
            if torch.is_grad_enabled():  # create_graph: PyTorch's differentiable formula
                return grad * (mask.type_as(grad) * scale), None, None
            return torch.ops.aten.native_dropout_backward(grad, mask, scale), None, None
        gen = torch.Generator(device=device)
        gen.set_state(saved)
        noise = torch.empty_strided(shape, ctx.stride, dtype=dtype, device=device)
        noise.bernoulli_(1 - p, generator=gen)
        noise.div_(1 - p)
        if torch.is_grad_enabled() or grad.dtype != noise.dtype:  # create_graph; autocast
            return grad * noise, None, None
        # the regenerated mask is this backward's own: the gradient goes into it (the same
        # products) rather than into a second input-sized tensor
        return noise.mul_(grad), None, None


def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.dropout` whose backward regenerates the mask from the saved RNG
    state instead of keeping it. Bit-identical outputs, gradients and RNG stream."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if (
        not training
        or p == 0.0
        or p == 1.0
        or x.numel() == 0
        or x.device.type not in ("cpu", "cuda")
    ):
        return torch.nn.functional.dropout(x, p, training, inplace)
    return DropoutFunction.apply(x, float(p), inplace)
