"""Inverted activations: save the *output* plus a 1-bit branch indicator, not the input.

Stock autograd keeps the input ``x`` of ELU, GELU and SiLU and evaluates ``f'(x)`` in backward.
Following "Inverted Activations" (Novikov & Oseledets, 2024), these Functions keep the output
``y = f(x)`` and one bit that says on which monotone branch of ``f`` the input lay, and rebuild
``f'(f^{-1}(y))`` in backward. The next layer almost always saves ``y`` anyway (a linear layer
saves its input), and the controller stores a storage saved twice once, so the activation's own
save shrinks from a full tensor to one bit per element.

- ELU has a closed form: ``f'(x) = 1`` for ``x > 0`` and ``y + alpha`` otherwise. Given the
  indicator, backward is exact (bit-identical to PyTorch's own in-place ``elu_`` backward, which
  reads the output too; within one rounding of ``alpha`` of the out-of-place backward). Because
  the negative branch is *linear* in ``y``, a stochastically rounded ``y`` still gives an
  unbiased gradient.
- GELU (``approximate='none'`` / ``'tanh'``) and SiLU are not monotone: each has one minimum
  ``(x*, y_min)``. The indicator says ``x >= x*``. Backward looks ``f'`` up in tables built once
  in float64 and interpolated linearly in float32 (the paper's appendix uses tables too):

  * around the minimum and on the right branch the table variable is
    ``s = ±sqrt(y - y_min)`` (``+`` right of the minimum): ``x(s)`` and ``f'(x(s))`` are smooth
    through ``s = 0`` where ``x(y)`` itself has a square-root singularity;
  * far out on the left branch (``y -> 0-`` as ``x -> -inf``) the variable is
    ``u = log(-y)``, and the table holds ``f'(x)/y``, a slowly varying ratio, so tiny outputs
    keep a tiny but relatively accurate derivative;
  * right of the table ``f'`` is 1 to float64 precision.

  The residual error is dominated by the information ``y`` has lost, not by the tables (which
  are float32-accurate, <= 3e-7, away from the minimum): near the minimum ``f'`` varies like
  ``sqrt(2 f''(x*) (y - y_min))``, so the rounding of ``y`` itself (an ulp of ``y_min``, 1.5e-8
  for GELU in float32) moves it by up to ~1e-4. Measured max/mean |error| against PyTorch's own
  backward, float32: GELU 1.1e-4 / 8.7e-8, GELU-tanh 1.1e-4 / 3.7e-8, SiLU 7.7e-5 / 1.0e-7;
  float16: <= 7.1e-3 / 1.4e-4; bfloat16: <= 1.5e-2 / 9.0e-4 (`measure_error` reproduces them).
  float64 inputs are left to PyTorch.

Double backward: ELU's backward is differentiable in ``y`` and gives the exact second
derivative; GELU/SiLU tables are not, so a ``create_graph=True`` backward through them raises
(compress with ``pointwise=False`` for higher-order gradients through them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gact_graph.config import DOUBLE_BACKWARD_HELP
from gact_graph.switches import is_scratch

__all__ = [
    "EluFunction",
    "InvertedFunction",
    "InvertedSpec",
    "INVERTED_SPECS",
    "elu",
    "gelu",
    "silu",
    "inverse_derivative",
    "measure_error",
]

#: dtypes whose outputs the table path inverts accurately enough (float64 keeps the stock path).
TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# The functions, in float64 (only used to build tables and to measure)
# --------------------------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715


def _gelu_f(x: Tensor) -> Tensor:
    return x * 0.5 * torch.special.erfc(-x / math.sqrt(2.0))


def _gelu_df(x: Tensor) -> Tensor:
    cdf = 0.5 * torch.special.erfc(-x / math.sqrt(2.0))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf


def _gelu_tanh_f(x: Tensor) -> Tensor:
    # 0.5 (1 + tanh z) = sigmoid(2z): stable far out on the left.
    z = _SQRT_2_OVER_PI * (x + _TANH_A * x**3)
    return x * torch.sigmoid(2.0 * z)


def _gelu_tanh_df(x: Tensor) -> Tensor:
    z = _SQRT_2_OVER_PI * (x + _TANH_A * x**3)
    s = torch.sigmoid(2.0 * z)
    dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_A * x * x)
    return s + x * 2.0 * s * (1.0 - s) * dz


def _silu_f(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _silu_df(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@dataclass(frozen=True)
class InvertedSpec:
    """A non-monotone activation with one minimum, and how its tables are laid out.

    ``x_right``: beyond it ``f'(x) == 1`` to float64 precision. ``x_far``: left bound of the
    bisection (``|f(x_far)|`` below the smallest float32 subnormal).
    """

    name: str
    f: Callable[[Tensor], Tensor]
    df: Callable[[Tensor], Tensor]
    x_right: float
    x_far: float = -150.0
    near_size: int = 16384
    tail_size: int = 4096
    #: the left branch switches from the s-table to the log-table at y = y_min * tail_switch.
    tail_switch: float = 0.1
    #: lowest log(-y) tabulated; below it f'/y is held constant.
    u_low: float = -104.0


INVERTED_SPECS: dict[str, InvertedSpec] = {
    "gelu": InvertedSpec("gelu", _gelu_f, _gelu_df, x_right=9.0),
    "gelu_tanh": InvertedSpec("gelu_tanh", _gelu_tanh_f, _gelu_tanh_df, x_right=9.0),
    "silu": InvertedSpec("silu", _silu_f, _silu_df, x_right=40.0),
}


@dataclass
class _Tables:
    x_star: float  # argmin, float64
    y_min: float  # min value, float64
    y_min_hi: float  # y_min rounded to float32
    y_min_lo: float  # y_min - y_min_hi
    s_lo: float
    s_hi: float
    near_inv_h: float
    near: Tensor  # f'(x(s)) on a uniform s grid, with slopes (`_with_slopes`)
    y_switch: float
    u_lo: float
    u_hi: float
    tail_inv_h: float
    tail: Tensor  # f'(x(u)) / y on a uniform u = log(-y) grid, with slopes


def _bisect(spec: InvertedSpec, y: Tensor, lo: float, hi: float, increasing: bool) -> Tensor:
    """x in [lo, hi] with f(x) = y on a monotone branch, in float64 (vectorized bisection)."""
    a = torch.full_like(y, lo)
    b = torch.full_like(y, hi)
    for _ in range(64):  # (hi - lo) / 2**64 is below float64 resolution of x
        m = 0.5 * (a + b)
        fm = spec.f(m)
        go_right = (fm < y) if increasing else (fm > y)
        a = torch.where(go_right, m, a)
        b = torch.where(go_right, b, m)
    return 0.5 * (a + b)


def _argmin(spec: InvertedSpec) -> float:
    # f' is increasing around the minimum: bisect f'(x) = 0 on [-3, 0].
    a, b = torch.tensor(-3.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    for _ in range(64):
        m = 0.5 * (a + b)
        if spec.df(m) < 0:
            a = m
        else:
            b = m
    return float(0.5 * (a + b))


_TABLE_CACHE: dict[tuple[str, torch.device], _Tables] = {}
_CPU_TABLES: dict[str, _Tables] = {}


def _build_tables(spec: InvertedSpec) -> _Tables:
    f64 = torch.float64
    x_star = _argmin(spec)
    y_min = float(spec.f(torch.tensor(x_star, dtype=f64)))
    y_switch = y_min * spec.tail_switch
    s_lo = -math.sqrt(y_switch - y_min)
    s_hi = math.sqrt(float(spec.f(torch.tensor(spec.x_right, dtype=f64))) - y_min)
    s = torch.linspace(s_lo, s_hi, spec.near_size, dtype=f64)
    y = y_min + s * s
    right = s >= 0
    x = torch.empty_like(s)
    x[right] = _bisect(spec, y[right], x_star, spec.x_right + 1.0, increasing=True)
    x[~right] = _bisect(spec, y[~right], spec.x_far, x_star, increasing=False)
    near = spec.df(x)
    near[s == 0] = 0.0
    u_hi = math.log(-y_switch)
    u = torch.linspace(spec.u_low, u_hi, spec.tail_size, dtype=f64)
    yt = -torch.exp(u)
    xt = _bisect(spec, yt, spec.x_far, x_star, increasing=False)
    tail = spec.df(xt) / yt
    return _Tables(
        x_star=x_star,
        y_min=y_min,
        y_min_hi=float(torch.tensor(y_min, dtype=torch.float32)),
        y_min_lo=y_min - float(torch.tensor(y_min, dtype=torch.float32)),
        s_lo=s_lo,
        s_hi=s_hi,
        near_inv_h=(spec.near_size - 1) / (s_hi - s_lo),
        near=_with_slopes(near.float()),
        y_switch=y_switch,
        u_lo=spec.u_low,
        u_hi=u_hi,
        tail_inv_h=(spec.tail_size - 1) / (u_hi - spec.u_low),
        tail=_with_slopes(tail.float()),
    )


def _tables(name: str, device: torch.device) -> _Tables:
    key = (name, device)
    t = _TABLE_CACHE.get(key)
    if t is None:
        cpu = _CPU_TABLES.get(name)
        if cpu is None:
            cpu = _CPU_TABLES[name] = _build_tables(INVERTED_SPECS[name])
        t = _Tables(**{**cpu.__dict__, "near": cpu.near.to(device), "tail": cpu.tail.to(device)})
        _TABLE_CACHE[key] = t
    return t


def _with_slopes(values: Tensor) -> Tensor:
    """``[2, n]``: each node's value and the slope to the next node (0 after the last)."""
    slopes = torch.zeros_like(values)
    slopes[:-1] = values[1:] - values[:-1]
    return torch.stack([values, slopes])


def _lookup(table: Tensor, pos: Tensor) -> Tensor:
    """Linear interpolation of a `_with_slopes` table at fractional index ``pos`` (a contiguous
    float32 temporary, clamped to the table and overwritten)."""
    pos = pos.clamp_(0.0, table.shape[1] - 1.0)
    i = pos.to(torch.int32).view(-1)  # truncation == floor, pos >= 0
    frac = pos.sub_(i.view_as(pos))
    value = table[0].index_select(0, i).view_as(pos)
    slope = table[1].index_select(0, i).view_as(pos)
    return value.addcmul_(frac, slope)


def inverse_derivative(y: Tensor, right: Tensor, name: str) -> Tensor:
    """``f'(f^{-1}(y))`` in float32 for the activation ``name`` (see `INVERTED_SPECS`), where
    ``right`` says ``x >= x*`` (the branch right of the minimum). ``y`` may be lossy (e.g.
    dequantized): values outside a branch's range are clamped to it (``f'`` is 1 right of the
    table, 0 at the minimum and for ``y >= 0`` on the left branch)."""
    tb = _tables(name, y.device)
    y = y.float().contiguous()  # never modified in place below: it may be the saved output
    right = right.contiguous()
    # s = ±sqrt(y - y_min), y_min split in two float32 parts: the first difference is exact
    # near the minimum (Sterbenz), so s loses nothing to the rounding of y_min.
    s = (y - tb.y_min_hi).sub_(tb.y_min_lo).clamp_(min=0.0).sqrt_()
    s = s.mul_(right.to(torch.float32).mul_(2.0).sub_(1.0))  # + right of x*, - left
    d = _lookup(tb.near, s.sub_(tb.s_lo).mul_(tb.near_inv_h))
    del s  # the lookup's scratch: released before the far branch's temporaries
    # Far left branch (y_switch < y < 0): f' = y * ratio(log(-y)).
    tail = (y > tb.y_switch).logical_and_(right.logical_not())
    if y.is_cuda:  # dense: no host sync
        neg_y = y.neg().clamp_(min=0.0)
        u = neg_y.clamp(min=1e-45).log_()
        ratio = _lookup(tb.tail, u.sub_(tb.u_lo).mul_(tb.tail_inv_h))
        return torch.where(tail, neg_y.neg_().mul_(ratio), d)
    idx = tail.view(-1).nonzero().squeeze(1)  # usually a small fraction of the elements
    if idx.numel():
        neg_y = y.view(-1).index_select(0, idx).neg_().clamp_(min=0.0)
        u = neg_y.clamp(min=1e-45).log_()
        ratio = _lookup(tb.tail, u.sub_(tb.u_lo).mul_(tb.tail_inv_h))
        d.view(-1).index_copy_(0, idx, neg_y.neg_().mul_(ratio))
    return d


def _branch(x: Tensor, name: str) -> Tensor:
    return x >= _tables(name, x.device).x_star


# --------------------------------------------------------------------------------------------
# autograd Functions
# --------------------------------------------------------------------------------------------
class EluFunction(torch.autograd.Function):
    """ELU saving its output and the 1-bit indicator ``x > 0``.

    In the sensitivity probe's replay (`lean_backward`) the saved output arrives as the
    probe's own noisy copy, which the backward may overwrite (`scratch`): the gradient is
    written into it, so that the replay makes no tensor of its own (`lean_backward_bytes`)."""

    @staticmethod
    def forward(ctx, x: Tensor, alpha: float, inplace: bool) -> Tensor:
        pos = x > 0
        if inplace:
            ctx.mark_dirty(x)
            y = torch._C._nn.elu_(x, alpha)
        else:
            y = torch._C._nn.elu(x, alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(y, pos)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked)
        ctx.shapes = (y.numel(), y.dtype)
        return y

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its output included; its saved tensors, ``grad`` and the unpacking of the
        saved indicator not: `gact_graph.budget.probe_cost` counts a packed mask's unpacking
        itself), in the sensitivity probe's replay of the saved output, ``layouts`` the group
        layouts of the compressed tensors the node read: the replay hands the output as its
        own noisy copy, which the backward writes into where ``grad`` has its dtype (`scratch`:
        nothing made); in half precision the float32 product and its cast. None in the probe's
        walk (``walk``: the output is dequantized whole inside the node) and for any other
        reads than the one output."""
        if walk or len(list(layouts)) != 1:
            return None
        numel, dtype = ctx.shapes
        if dtype in (torch.float16, torch.bfloat16):
            # the float32 (y + alpha) * grad beside its cast; then the cast beside the
            # selection's result, less
            return numel * (4 + torch.finfo(dtype).bits // 8)
        return 0

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, pos = ctx.saved_tensors
        if grad.dtype in (torch.float16, torch.bfloat16):
            # (y + alpha) * grad in float32, in one new tensor (``grad`` is widened exactly
            # inside the in-place product), then cast
            neg = y.to(torch.float32, copy=True).add_(ctx.alpha).mul_(grad).to(grad.dtype)
            return torch.where(pos, grad, neg), None, None
        # grad * (y + alpha) where x <= 0, grad elsewhere, in one new tensor rather than three:
        # the sensitivity probe runs this backward on top of the user's, so temporaries add up
        # (same rounding as PyTorch's elu_backward: (y + alpha) first, then times grad); in
        # the probe's replay, in its own copy of ``y`` (`scratch`), none
        if torch.is_grad_enabled():  # create_graph: no out= under autograd
            return torch.where(pos, grad, torch.add(y, ctx.alpha).mul_(grad)), None, None
        if is_scratch(y) and y.dtype == grad.dtype and y.shape == grad.shape:
            out = y.add_(ctx.alpha).mul_(grad)
        else:
            out = torch.add(y, ctx.alpha).mul_(grad)
        return torch.where(pos, grad, out, out=out), None, None


#: bytes per element `inverse_derivative` holds at once at most (CPU, float32 ``y``): the
#: derivative, the far branch's mask and, where every element lies on the far branch, its
#: indices (int64), the gathered outputs, their logarithms and the table lookup's index,
#: value and slope (4 bytes each); before that the lookup of the near table held the square
#: root, the index, the value and the slope (16). The CUDA path (dense) holds no more.
INVERSE_DERIVATIVE_BYTES = 4 + 1 + 8 + 4 * 5


class InvertedFunction(torch.autograd.Function):
    """GELU / SiLU saving the output and the 1-bit branch indicator ``x >= x*``."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str, approximate: str, inplace: bool) -> Tensor:
        right = _branch(x, name)
        if name == "silu":
            if inplace:
                ctx.mark_dirty(x)
                y = torch._C._nn.silu_(x)
            else:
                y = torch._C._nn.silu(x)
        else:
            y = F.gelu(x, approximate=approximate)
        ctx.name = name
        ctx.save_for_backward(y, right)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked)
        ctx.shapes = (y.numel(), y.dtype)
        return y

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its output included; its saved tensors, ``grad`` and the unpacking of the
        saved indicator not: `gact_graph.budget.probe_cost` counts a packed mask's unpacking
        itself), in the sensitivity probe's replay of the saved output (handed as the
        replay's dense copy), ``layouts`` the group layouts of the compressed tensors the node
        read: `inverse_derivative`'s tensors with every element on the far branch
        (`INVERSE_DERIVATIVE_BYTES`), a float32 copy of a half-precision output beside them;
        then the derivative beside the gradient's cast. None in the probe's walk (``walk``:
        the output is dequantized whole inside the node) and for any other reads than the
        one output."""
        if walk or len(list(layouts)) != 1:
            return None
        numel, dtype = ctx.shapes
        widened = 0 if dtype == torch.float32 else 4  # ``y.float()``
        return numel * (INVERSE_DERIVATIVE_BYTES + widened)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():
            # once_differentiable would let a create_graph backward run and silently drop the
            # second-order term whenever ``grad`` itself needs no gradient; refuse instead.
            raise RuntimeError(
                f"gact_graph: {ctx.name} rebuilds its derivative from the saved output by table "
                "lookup, which is differentiable once; " + DOUBLE_BACKWARD_HELP
            )
        y, right = ctx.saved_tensors
        # grad * f', into the derivative (its own tensor; ``grad`` is widened exactly inside
        # the product), then cast: one tensor fewer than a product beside the derivative
        d = inverse_derivative(y, right, ctx.name)
        return d.mul_(grad).to(grad.dtype), None, None, None


# --------------------------------------------------------------------------------------------
# functional entry points (also used by the TorchFunctionMode)
# --------------------------------------------------------------------------------------------
def elu(x: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.elu` that saves its output and a 1-bit indicator."""
    return EluFunction.apply(x, float(alpha), inplace)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """`torch.nn.functional.gelu` that saves its output and a 1-bit branch indicator."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    name = "gelu" if approximate == "none" else "gelu_tanh"
    return InvertedFunction.apply(x, name, approximate, False)


def silu(x: Tensor, inplace: bool = False) -> Tensor:
    """`torch.nn.functional.silu` that saves its output and a 1-bit branch indicator."""
    return InvertedFunction.apply(x, "silu", "none", inplace)


def measure_error(
    name: str,
    dtype: torch.dtype = torch.float32,
    lo: float = -12.0,
    hi: float = 12.0,
    n: int = 1_000_001,
) -> dict[str, float]:
    """Max and mean absolute error of ``f'(f^{-1}(y))`` against PyTorch's own backward from
    ``x``, over ``n`` evenly spaced inputs in ``[lo, hi]`` rounded to ``dtype`` (``y`` computed
    by PyTorch in ``dtype``). ``name``: ``"gelu"``, ``"gelu_tanh"`` or ``"silu"``."""
    x = torch.linspace(lo, hi, n, dtype=torch.float64).to(dtype).requires_grad_()
    if name == "silu":
        y = F.silu(x)
    else:
        y = F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")
    (ref,) = torch.autograd.grad(y, x, torch.ones_like(y))
    exact = INVERTED_SPECS[name].df(x.detach().double())
    ours = inverse_derivative(y.detach(), _branch(x.detach(), name), name).double()
    err = (ours - ref.double()).abs()
    ref_err = (ref.double() - exact).abs()
    return {
        "max_abs_err": float(err.max()),
        "mean_abs_err": float(err.mean()),
        "max_abs_err_vs_exact": float((ours - exact).abs().max()),
        "torch_max_abs_err_vs_exact": float(ref_err.max()),
    }
