r"""Per-tensor gradient sensitivity :math:`c_l` of activation compression (GACT, Sec. 4).

With every saved tensor :math:`X_l` quantized to :math:`b_l` bits by unbiased stochastic
rounding, the extra variance of the parameter gradient is, to first order,

.. math::
    \mathrm{Var}[\hat g] - \mathrm{Var}[g] \approx \sum_l c_l\, S(b_l), \qquad
    S(b) = (2^b - 1)^{-2},

where :math:`c_l = \sum_i (R_{g(i)}^2 / 6)\, \lVert J_l[:, i] \rVert^2`: :math:`R_g` the value range
of the quantization group of element :math:`i` (the rounding step is
:math:`R_g / (2^b - 1)` and the rounding variance averages :math:`\mathrm{step}^2 / 6` over a
uniform fractional part), :math:`J_l` the Jacobian of the parameter gradient with respect to the
value of :math:`X_l` that the backward pass reads.

Two estimators live here.

:func:`two_seed_sensitivity` is GACT's Algorithm 1, the reference: for each tensor it runs the
training step twice with two rounding seeds for that tensor only (everything else, dropout
included, identical) and sets :math:`c_l = \lVert g_1 - g_2 \rVert^2 / (2 S(b_l))`. It costs
``2 L`` forward+backward passes for ``L`` tensors.

:class:`SensitivityProbe` (the one the adaptive planner uses) costs no extra forward or backward
pass. It rides along the *user's own* backward. The rounding noise of :math:`X_l` enters the
backward pass at one place only: the autograd node(s) that unpack :math:`X_l`. At each such
node the probe

1. replays the node on the same incoming gradient with :math:`\hat X_l + \varepsilon`,
   :math:`\varepsilon` a Rademacher vector scaled to the rounding variance of each group,
   :math:`\kappa_l\, \mathrm{step}_g^2 / 6` (exact zeros, e.g. ReLU outputs on a level, get
   none; :math:`\kappa_l` compares the true :math:`f(1-f)` of a 16k-element sample of
   :math:`X_l`, taken when it is packed, with the uniform average 1/6: 0 for binary features
   that rounding keeps exact, below 1 for skewed groups), which gives the perturbation
   :math:`\delta` of every gradient the node emits (exact in expectation for nodes linear in
   :math:`X_l`, e.g. ``grad_W = G^T X``; a finite difference at the rounding scale of the
   current bits otherwise);
2. adds :math:`\delta` to the parameter gradient directly where the node feeds a parameter, and
   otherwise propagates it to the parameters with one re-entrant partial backward from that
   node (``torch.autograd.grad`` on a ``GradientEdge``, graph retained), which is the exact
   linear map the noise goes through;
3. sums the perturbations of all nodes that read :math:`X_l` (same noise draw, so shared tensors
   are counted with their correlations) and sets
   :math:`c_l = (2^{b_l} - 1)^2 \lVert \cdot \rVert^2`.

No forward is repeated and nothing is re-quantized; the cost is one replay of each node that
holds a compressed tensor (about one extra backward in all) plus the partial backwards for
tensors whose noise flows into activation gradients (none for ``X`` saved by a linear layer,
since ``grad_X = G W`` does not read it). Tensors whose backward use is piecewise constant in
``X`` (a ReLU mask recomputed from a quantized output) are seen to first order only, i.e. as
zero; the pointwise path stores such masks losslessly in one bit instead.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from gact_graph.core.chunked import RowChunked, row_ranges
from gact_graph.core.quantize import QTensor, quantize
from gact_graph.core.saved import tensors_in
from gact_graph.switches import lean_backward, scratch

__all__ = [
    "S",
    "SensitivityProbe",
    "element_step",
    "per_element",
    "grad_sq_norm",
    "spearman",
    "two_seed_sensitivity",
    "probe_sensitivity",
    "rounding_variance_factor",
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


def spearman(a: Iterable[float], b: Iterable[float]) -> float:
    """Spearman rank correlation (average ranks for ties); ``nan`` when either side is constant."""
    x = torch.as_tensor(list(a), dtype=torch.float64)
    y = torch.as_tensor(list(b), dtype=torch.float64)
    if x.numel() != y.numel():
        raise ValueError("spearman needs two sequences of the same length")
    rx, ry = _rank(x), _rank(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = (rx.norm() * ry.norm()).item()
    return float((rx @ ry).item() / den) if den > 0 else float("nan")


def _rank(v: Tensor) -> Tensor:
    order = torch.argsort(v, stable=True)
    ranks = torch.empty_like(v)
    ranks[order] = torch.arange(v.numel(), dtype=v.dtype)
    # average the ranks of ties
    sv = v[order]
    i = 0
    n = v.numel()
    while i < n:
        j = i
        while j + 1 < n and sv[j + 1] == sv[i]:
            j += 1
        if j > i:
            ranks[order[i : j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def grad_sq_norm(params: Iterable[Tensor]) -> float:
    """Squared norm of the ``.grad`` of ``params`` (missing grads count as zero)."""
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().square().sum())
    return total


# ---------------------------------------------------------------------------------- Alg. 1
def _snapshot_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _frozen_buffers(model: nn.Module):
    """Extra passes must not move BatchNorm running statistics: restore buffers afterwards."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


def _flat_grads(params: list[Tensor]) -> Tensor:
    parts = [
        p.grad.detach().reshape(-1).double()
        if p.grad is not None
        else torch.zeros(p.numel(), dtype=torch.float64, device=p.device)
        for p in params
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def two_seed_sensitivity(
    ctl, step_fn: Callable[[], Any], names: Iterable[str] | None = None, repeats: int = 1
) -> dict[str, float]:
    """GACT Algorithm 1: ``c_l = ||g(seed_1) - g(seed_2)||^2 / (2 S(b_l))``, re-seeding only the
    rounding of tensor ``l`` between two runs of ``step_fn`` (forward, zero_grad, backward).

    Dropout and every other random choice are replayed identically (the RNG state is restored
    before each run) and BatchNorm buffers are restored afterwards, so the two gradients differ
    only by the rounding noise of tensor ``l``. ``names`` defaults to every tensor the last
    forward quantized. ``repeats`` averages that many independent seed pairs. Costs
    ``2 * repeats * len(names)`` runs of ``step_fn`` (one more when ``names`` is None).
    """
    params = [p for p in ctl.model.parameters() if p.requires_grad]
    rng = _snapshot_rng()
    old_salt = dict(ctl.seed_salt)
    out: dict[str, float] = {}
    with _frozen_buffers(ctl.model):
        if names is None:
            _restore_rng(rng)
            step_fn()
            names = [r["name"] for r in ctl.stats()["tensors"] if r["bits"] is not None]
        names = list(names)
        for name in names:
            total, bits = 0.0, None
            for r in range(repeats):
                grads = []
                for salt in (1000 + 2 * r, 1001 + 2 * r):
                    ctl.seed_salt[name] = salt
                    _restore_rng(rng)
                    step_fn()
                    grads.append(_flat_grads(params))
                    rec = next((t for t in ctl.stats()["tensors"] if t["name"] == name), None)
                    bits = None if rec is None else rec["bits"]
                if bits is None:  # not quantized in this run: no rounding noise to measure
                    break
                total += float((grads[0] - grads[1]).square().sum()) / (2.0 * S(bits))
            ctl.seed_salt.pop(name, None)
            if bits is not None:
                out[name] = total / repeats
    ctl.seed_salt.clear()
    ctl.seed_salt.update(old_salt)
    _restore_rng(rng)
    return out


# ---------------------------------------------------------------------------------- probe
def _stable_seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _grouped(q: QTensor, t: Tensor, fill: float) -> Tensor:
    """``t`` (shaped like ``q``'s tensor) as a ``(num_groups, m)`` matrix, one row per
    quantization group, padded with ``fill`` where a group is not full."""
    lay = q.layout
    t2 = t.reshape(lay.rows, lay.cols)
    if lay.rows_per_group > 1:
        pad = lay.num_groups * lay.rows_per_group - lay.rows
        if pad:
            t2 = torch.cat([t2, t2.new_full((pad, lay.cols), fill)])
        return t2.reshape(lay.num_groups, lay.rows_per_group * lay.cols)
    pad = lay.groups_per_row * lay.group_size - lay.cols
    if pad:
        t2 = torch.cat([t2, t2.new_full((lay.rows, pad), fill)], dim=1)
    return t2.reshape(lay.num_groups, lay.group_size)


def _ungrouped(q: QTensor, v: Tensor) -> Tensor:
    """Inverse of `_grouped`."""
    lay = q.layout
    if lay.rows_per_group > 1:
        return v.reshape(-1, lay.cols)[: lay.rows].reshape(q.shape)
    return v.reshape(lay.rows, -1)[:, : lay.cols].reshape(q.shape)


def _group_steps(q: QTensor) -> tuple[Tensor, Tensor]:
    lo, scale = q.group_params()
    ok = torch.isfinite(lo) & torch.isfinite(scale)
    return torch.where(ok, lo, 0.0)[:, None], torch.where(ok, scale, 0.0)[:, None]


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
    replay's estimate of a ReLU output at 2 bits came out a third too low."""
    n = x.numel()
    if n == 0 or q.num_groups == 0:
        return 1.0
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
    lo, step = _group_steps(q)
    lo_s, st_s = lo[gid, 0], step[gid, 0]
    u = (xs - lo_s) / torch.where(st_s > 0, st_s, 1.0)
    f = u - torch.floor(u)
    ff = torch.nan_to_num(f * (1 - f), nan=0.0).clamp_(0.0, 0.25)
    st2 = torch.where(st_s > 0, st_s.square(), 0.0)
    if on == "x_hat":
        lower = lo_s + (u - f) * st_s
        p_zero = (1 - f) * (lower == 0) + f * ((lower + st_s) == 0)
        nonzero = torch.nan_to_num(1 - p_zero, nan=0.0).clamp_(0.0, 1.0)
    elif on == "x":
        nonzero = (xs != 0).float()
    else:
        raise ValueError(f"on must be 'x' or 'x_hat', got {on!r}")
    den = float((st2 * nonzero).sum())
    return 6.0 * float((st2 * ff).sum()) / den if den > 0 else 1.0


#: elements per chunk when the probe walks a tensor: its temporaries stay ~1 MB, never
#: tensor-sized (a tensor-sized temporary on a probed step is what issue 13 is about)
_CHUNK = 1 << 18


def _add_rounding_noise_(q: QTensor, x: Tensor, seed: int, kappa: float = 1.0) -> Tensor:
    """Add to ``x`` (contiguous, shaped like ``q``'s tensor) in place a Rademacher vector scaled
    per element to ``kappa`` times the average stochastic-rounding variance of its group,
    ``step^2 / 6`` (the mean of ``f (1 - f)`` over a uniform fractional part ``f``; ``kappa``
    from :func:`rounding_variance_factor`), zero on exact zeros (ReLU outputs sitting on a
    level have no rounding noise). Drawn in row chunks, so the only temporaries are
    chunk-sized; the same ``seed`` gives the same draw."""
    lay = q.layout
    if q.num_groups == 0 or kappa <= 0 or x.numel() == 0:
        return x
    _, step = _group_steps(q)
    std = step[:, 0].float() * math.sqrt(kappa / 6.0)  # per group
    rpg, gpr, g = lay.rows_per_group, lay.groups_per_row, lay.group_size
    x2 = x.view(lay.rows, lay.cols)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    for r0, r1 in row_ranges(q, _CHUNK):
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
    split into groups), in the narrowest integer type that holds them. A row vector of fp32
    variances per tensor was a tenth of a 64-layer GCNII's compressed activations at 2 bits;
    this is a quarter of that or less. Computed in row chunks (`row_ranges`)."""
    lay = q.layout
    rows, cols = x.shape
    rpg, gpr, g = lay.rows_per_group, lay.groups_per_row, lay.group_size
    most = cols if rpg > 1 else g
    dtype = torch.uint8 if most <= 255 else torch.int16 if most <= 32767 else torch.int32
    shape = (rows,) if rpg > 1 else (rows, gpr)
    out = torch.zeros(shape, dtype=dtype, device=x.device)
    for r0, r1 in row_ranges(q, _CHUNK):
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
    `_add_rounding_noise_` draws from, with ``counts`` from `nonzero_counts`."""
    lay = q.layout
    if q.num_groups == 0 or kappa <= 0 or lay.rows == 0:
        return torch.zeros(lay.rows, dtype=torch.float32, device=counts.device)
    _, step = _group_steps(q)
    var = step[:, 0].float().square() * (kappa / 6.0)  # per group
    if lay.rows_per_group > 1:  # a group holds rpg whole rows
        rows = torch.arange(lay.rows, device=counts.device)
        return counts.float() * var[rows // lay.rows_per_group]
    return (counts.float() * var.view(lay.rows, lay.groups_per_row)).sum(1)


#: autograd nodes that pass a gradient on unchanged in norm (shape or dtype only)
_NORM_PRESERVING = frozenset(
    {"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
     "TransposeBackward0", "PermuteBackward0", "ToCopyBackward0"}
)  # fmt: skip


def _matmul_kind(node, param_ids: set[int]) -> tuple[int, bool] | None:
    """For ``mm`` / ``addmm`` nodes whose ``mat2`` is a parameter or computed from parameters
    only: ``(position of mat2 among the node's inputs, exact)``, ``exact`` when mat2's gradient
    reaches one parameter through norm-preserving nodes only (a linear layer's weight), else
    ``False`` (e.g. GAT's attention vector folded into the weight, ``W^T a``); ``None`` for
    every other node."""
    try:
        name = node.name()
    except Exception:  # Python Function nodes without a name
        return None
    k = {"MmBackward0": 1, "AddmmBackward0": 2}.get(name)
    if k is None or len(node.next_functions) <= k:
        return None
    fn = node.next_functions[k][0]
    var = getattr(_past_norm_preserving(fn), "variable", None)
    if var is not None and id(var) in param_ids:
        return k, True
    return (k, False) if fn is not None and _parameters_only(fn, param_ids) else None


def _parameters_only(fn, param_ids: set[int], limit: int = 32) -> bool:
    """Whether the graph below ``fn`` is a small computation on parameters alone: at most
    ``limit`` nodes, every path ending in a parameter's ``AccumulateGrad`` (an input that needs
    no gradient, or any activation, makes it ``False``), so a partial backward from ``fn``
    touches parameter-sized tensors only."""
    seen: set[int] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if len(seen) > limit:
            return False
        var = getattr(f, "variable", None)
        if var is not None:
            if id(var) not in param_ids:
                return False
            continue
        for nxt, _ in f.next_functions:
            if nxt is None:
                return False
            stack.append(nxt)
    return True


def _shares_storage(t: Tensor, others: Iterable[Tensor]) -> bool:
    """Whether ``t`` shares memory with any of ``others`` (so writing into it is not safe)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def _past_norm_preserving(fn):
    """The first node at or below ``fn`` that is not a single-input norm-preserving node."""
    while fn is not None and fn.name() in _NORM_PRESERVING and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    return fn


class _Seeds:
    """The noise one replay put into the gradients of activations: ``grads[i]`` enters the
    graph at ``edges[i]``; carried to the parameters together (same noise draw)."""

    __slots__ = ("name", "edges", "grads", "done")

    def __init__(self, name: str, edges: list, grads: list[Tensor]) -> None:
        self.name, self.edges, self.grads, self.done = name, edges, grads, False


class SensitivityProbe:
    """Estimates :math:`c_l` for every compressed tensor of one training step, during that
    step's own backward (see the module docstring).

    Lifecycle: :meth:`arm` before the forward to probe (it routes the controller's unpack
    through the probe and registers a forward hook on the model); the forward hook hooks every
    autograd node of the forward's graph; the user's ``backward()`` runs the probe; then
    :meth:`result` returns ``{name: c_l}`` and :meth:`close` removes what is left.

    Args:
        ctl: the `Controller`.
        min_numel: tensors smaller than this are not probed (the controller never quantizes
            them).
        seed: seed of the probing noise (each tensor derives its own).
    """

    def __init__(self, ctl, min_numel: int = 0, seed: int = 0, closed_form: bool = True) -> None:
        self.ctl = ctl
        self.closed_form = closed_form
        self.min_numel = min_numel
        self.seed = seed
        self.armed = False
        self.hooked = False  # a forward with a graph was hooked
        self.ran = False  # its backward touched at least one node
        self.seconds = 0.0  # wall time spent inside the probe
        # squared norm of the parameter gradient of the probed backward, summed on the device
        # (read once, by `grad_sq`)
        self._grad_sq: Tensor | float = 0.0
        self.failed: dict[str, str] = {}
        self._acc: dict[str, dict[int, Tensor]] = {}
        # name -> squared norm of its parameter-gradient noise, kept on the device (a 0-d fp64
        # tensor, or a float for estimates made on the host) until `result` reads them all
        self._sq: dict[str, Tensor | float] = {}
        self._bits: dict[str, int] = {}
        self._numel: dict[str, int] = {}
        self._override: dict[int, Tensor] = {}
        self._node_handles: list[Any] = []
        self._fwd_handle = None
        self._tls = threading.local()
        self._params: list[Tensor] = []
        self._param_ids: set[int] = set()
        self._ctl_own: dict[str, Any] = {}
        self._kappa = weakref.WeakKeyDictionary()  # Stored -> rounding_variance_factor
        # Stored -> (`nonzero_counts`, kappa): its per-row rounding variance, compactly
        self._nonzeros = weakref.WeakKeyDictionary()
        self._matmul_k: dict[int, tuple[int, bool]] = {}  # id(node) -> `_matmul_kind`
        # noise to propagate, deferred to the pre-hook of the first node it enters:
        # id(node) -> [_Seeds of every replay whose noise enters that node]; see `_defer`
        self._pending: dict[int, list[_Seeds]] = {}
        self._open: dict[str, int] = {}  # name -> seeds of it still pending
        self._reads_done: dict[str, int] = {}  # name -> reads of it probed so far

    @property
    def grad_sq(self) -> float:
        """Squared norm of the parameter gradient of the probed backward (0 before it)."""
        return float(self._grad_sq)

    # ---------------------------------------------------------------- arming
    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        ctl = self.ctl
        # the controller enters its saved-tensor hooks with ``self._pack`` / ``self._unpack``
        self._ctl_own = {k: ctl.__dict__[k] for k in ("_pack", "_unpack") if k in ctl.__dict__}
        inner_pack, inner_unpack = ctl._pack, ctl._unpack
        self._ctl_unpack = inner_unpack

        def pack(t):
            return self._pack(t, inner_pack)

        def unpack(stored):
            return self._unpack(stored, inner_unpack)

        ctl._pack = pack
        ctl._unpack = unpack
        self._fwd_handle = ctl.model.register_forward_hook(self._after_forward)
        ctl.add_handle(self._fwd_handle)

    def _restore_unpack(self) -> None:
        ctl = self.ctl
        for k in ("_pack", "_unpack"):
            if k in self._ctl_own:
                setattr(ctl, k, self._ctl_own[k])
            else:
                ctl.__dict__.pop(k, None)

    def _after_forward(self, module, args, output) -> None:
        if self.hooked:
            return
        roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        if not roots:  # a forward without a graph (eval, no_grad): wait for the next one
            return
        self.hooked = True
        self._fwd_handle.remove()
        self._fwd_handle = None
        self._restore_unpack()
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_ids = {id(p) for p in self._params}
        seen: set[int] = set()
        keep: list[Any] = []
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            var = getattr(node, "variable", None)
            if var is not None:  # AccumulateGrad of a leaf
                if id(var) in self._param_ids:
                    self._node_handles.append(node.register_prehook(self._leaf_hook))
                continue
            self._node_handles.append(node.register_prehook(self._pre_hook(node)))
            self._node_handles.append(node.register_hook(self._post_hook(node)))
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in seen:
                    stack.append(nxt)

    # ---------------------------------------------------------------- hooks
    def _busy(self) -> bool:
        return getattr(self._tls, "busy", False)

    @contextlib.contextmanager
    def _inside(self):
        """The probe's own work (replays, partial backwards): its hooks stand aside, and the
        backward kernels it runs take their lower-memory variants (`lean_backward`), since
        all of it adds to what the user's backward holds."""
        self._tls.busy = True
        try:
            with lean_backward():
                yield
        finally:
            self._tls.busy = False

    def _pack(self, t: Tensor, inner):
        stored = inner(t)
        p = getattr(stored, "payload", None)
        if isinstance(p, QTensor) and stored not in self._kappa:
            t0 = time.perf_counter()
            # the probe's own work (`lean_backward` marks it so): what it keeps here lives
            # until the probe's estimate, which a step without the probe never holds
            with torch.no_grad(), lean_backward():
                seed = _stable_seed(self.seed, stored.name, "kappa")
                kappa = rounding_variance_factor(t, p, seed=seed)
                # the replay draws its noise on the non-zeros of the dequantized copy
                self._kappa[stored] = rounding_variance_factor(t, p, seed=seed, on="x_hat")
                if self.closed_form and t.dim() == 2:  # what a matmul may read
                    self._nonzeros[stored] = (nonzero_counts(t, p), kappa)
            self.seconds += time.perf_counter() - t0
        return stored

    def _unpack(self, stored, inner):
        over = self._override.get(id(stored))
        if over is not None:
            return over
        mat1 = getattr(self._tls, "chunked_mat1", None)
        rows = getattr(self._tls, "chunked_rows", False)
        if (mat1 is not None or rows) and self._busy() and stored.kind == "activation":
            p = stored.payload
            if isinstance(p, QTensor) and not torch.is_grad_enabled():
                if tuple(p.shape) == mat1 or (rows and len(p.shape) == 2):
                    return RowChunked(p)
        t = inner(stored)
        if not self._busy():
            reads = getattr(self._tls, "reads", None)
            if reads is not None:
                keep = getattr(self._tls, "keep_values", True)
                reads.append((stored, t if keep else None, tuple(t.shape)))
        return t

    def _leaf_hook(self, grad_outputs):
        if self._busy():
            return None
        g = grad_outputs[0]
        if g is not None:
            self._grad_sq = self._grad_sq + g.detach().double().square().sum()
        return None

    def _pre_hook(self, node):
        python_node = not callable(node)

        # decided once per node, when the forward's graph is hooked
        kind = _matmul_kind(node, self._param_ids) if self.closed_form else None
        if kind is not None:
            self._matmul_k[id(node)] = kind
        matmul = kind is not None

        def hook(grad_outputs):
            # inside a partial backward, a matmul reads its compressed mat1 in row chunks
            shapes = self._matmul_shapes(node) if self._busy() else None
            self._tls.chunked_mat1 = None if shapes is None else shapes[0]
            # ... and a Function of this package that says it reads any compressed matrix so
            # (``reads_row_chunks``, e.g. the BatchNorm saving its normalized input)
            fwd_cls = getattr(node, "_forward_cls", None)
            self._tls.chunked_rows = self._busy() and getattr(fwd_cls, "reads_row_chunks", False)
            if not self._busy():
                for seeds in self._pending.pop(id(node), ()):
                    self._propagate(seeds)
                self._tls.reads = []
                # a matmul's estimate is closed-form: it needs no dequantized copy kept alive
                self._tls.keep_values = not matmul
                # a Python node may accumulate into .grad itself (reentrant checkpoint runs a
                # nested backward): see whether it does, so that its replay can be undone
                self._tls.grad_state = self._grad_state() if python_node else None
            return None

        return hook

    def _matmul_shapes(self, node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(mat1, mat2)`` shapes of an ``mm`` / ``addmm`` node whose ``mat2`` is a parameter
        or a function of parameters (`_matmul_kind`), when ``mat1`` cannot be mistaken for
        ``mat2`` (equal shapes); else ``None``. Such a node reads ``mat1`` only for
        ``mat1^T G``, which `RowChunked` computes a row chunk at a time."""
        kind = self._matmul_k.get(id(node))
        if kind is None:
            return None
        if kind[0] == 1:
            mat1, mat2 = node._saved_self_sym_sizes, node._saved_mat2_sym_sizes
        else:
            mat1, mat2 = node._saved_mat1_sym_sizes, node._saved_mat2_sym_sizes
        mat1, mat2 = tuple(int(v) for v in mat1), tuple(int(v) for v in mat2)
        return None if mat1 == mat2 else (mat1, mat2)

    def _grad_state(self) -> list[tuple[int, int]]:
        return [(-1, -1) if p.grad is None else (id(p.grad), p.grad._version) for p in self._params]

    def _post_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            self._tls.chunked_mat1 = None
            self._tls.chunked_rows = False
            if self._busy():
                return None
            reads = getattr(self._tls, "reads", None)
            self._tls.reads = None
            before = getattr(self._tls, "grad_state", None)
            side_effects = before is not None and before != self._grad_state()
            if not reads:
                return None
            t0 = time.perf_counter()
            with self._inside():
                self.ran = True
                done: set[int] = set()
                for i in range(len(reads)):
                    stored, x_hat, shape = reads[i]
                    reads[i] = None  # the probe may write its noise into x_hat: hold it once
                    if id(stored) in done or not self._is_candidate(stored):
                        continue
                    done.add(id(stored))
                    try:
                        if self._matmul_closed_form(node, stored, shape, grad_outputs):
                            continue
                        if x_hat is None:  # a matmul that reads it otherwise: dequantize again
                            x_hat = self._ctl_unpack(stored)
                        self._probe(node, stored, x_hat, grad_inputs, grad_outputs, side_effects)
                    except Exception as exc:  # a node we cannot replay: say so, never break
                        self.failed.setdefault(stored.name, f"{type(exc).__name__}: {exc}")
                    x_hat = None
            self.seconds += time.perf_counter() - t0
            return None

        return hook

    def _is_candidate(self, stored) -> bool:
        # Compressed tensors, and those the plan keeps at 32 bits; never tensors the graph-aware
        # paths keep lossless on purpose (attention logits, adjacency weights).
        if stored.kind != "activation":
            return False
        p = stored.payload
        if isinstance(p, QTensor):
            return True
        return (
            isinstance(p, Tensor)
            and p.is_floating_point()
            and p.numel() >= max(1, self.min_numel)
            and (self.ctl.plan.get(stored.name) or 0) >= 32
        )

    # ---------------------------------------------------------------- the estimate
    def _matmul_closed_form(self, node, stored, shape, grad_outputs) -> bool:
        r"""The estimate of a tensor read as ``mat1`` by ``mm``/``addmm`` whose ``mat2`` is a
        parameter or a function of parameters only (`_matmul_kind`): the noise reaches
        ``grad_mat2`` as :math:`\delta = \alpha\, \varepsilon^T G` and nothing else
        (``grad_mat1 = G\, mat2^T`` does not read ``mat1``; ActNN's analysis of linear layers).

        - ``mat2`` a parameter (a linear layer's weight): :math:`E\lVert\delta\rVert^2 =
          \alpha^2 \sum_i \lVert G_i\rVert^2 s_i` exactly, with :math:`s_i` the row's
          rounding variance (`row_rounding_variance`, taken when the tensor was packed);
        - ``mat2`` computed from parameters (GAT's attention vector folded into the weight):
          one draw of :math:`\delta` (``K x M``, the size of ``mat2``), summed over row chunks of
          a noise with each row's variance :math:`s_i` spread evenly over its ``K`` columns,
          then carried to the parameters by a partial backward from ``mat2``'s node, which
          touches parameter-sized tensors only.

        No replay and no temporary larger than a row chunk either way. Readers of one tensor
        estimated this way are counted without their cross-correlations (each draws its own
        noise). ``False`` when the node is not such a matmul: the replay estimates it."""
        counts = self._nonzeros.get(stored)
        # the tensor must be mat1 (unambiguously: equal shapes could be either operand)
        shapes = self._matmul_shapes(node)
        if counts is None or shapes is None or grad_outputs[0] is None:
            return False
        mat1, mat2 = shapes
        if tuple(shape) != mat1:
            return False
        k, exact = self._matmul_k[id(node)]
        row_var = row_rounding_variance(stored.payload, *counts)
        g = grad_outputs[0]
        alpha = float(getattr(node, "_saved_alpha", 1.0))
        if exact:
            g_sq = torch.linalg.vector_norm(g, dim=1, dtype=torch.float32).square_()
            energy = (g_sq.double() * row_var.double()).sum() * alpha**2
            self._sq[stored.name] = self._sq.get(stored.name, 0.0) + energy
        else:
            if math.prod(mat2) > math.prod(mat1):  # not small: the replay is no dearer
                return False
            delta = self._sketch_grad_mat2(stored, row_var, g, alpha)
            fn, nr = node.next_functions[k]
            acc = self._acc.setdefault(stored.name, {})
            self._grad_into(acc, [GradientEdge(fn, nr)], [delta])
        self._bits[stored.name] = stored.payload.bits
        self._numel[stored.name] = stored.payload.numel()
        self.ran = True
        self._finish_read(stored.name)
        return True

    def _sketch_grad_mat2(self, stored, row_var: Tensor, g: Tensor, alpha: float) -> Tensor:
        """One draw of ``alpha * eps^T g`` (see `_matmul_closed_form`), in row chunks."""
        rows, cols = g.shape[0], int(stored.payload.shape[-1])
        n = self._reads_done.get(stored.name, 0)
        gen = torch.Generator(device=g.device)
        gen.manual_seed(_stable_seed(self.seed, stored.name, "sketch", n))
        delta = torch.zeros(cols, g.shape[1], dtype=torch.float32, device=g.device)
        step = max(1, _CHUNK // max(cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            z = torch.randint(0, 2, (r1 - r0, cols), generator=gen, device=g.device)
            z = z.float().mul_(2).sub_(1).mul_((row_var[r0:r1] / cols).sqrt_()[:, None])
            delta.addmm_(z.t(), g[r0:r1].float())
        return delta.mul_(alpha).to(g.dtype)

    def _noisy(self, stored, x_hat: Tensor, reusable: bool) -> tuple[Tensor, int]:
        """``x_hat`` plus its probing noise: drawn again at every read from the tensor's own
        seed (the same draw each time, so the nodes reading one tensor see correlated noise),
        never cached (a cache held a full-precision copy of every probed tensor until the end
        of backward, which made re-planning steps peak at 2.3x the fixed-bit step). Added in
        place when ``reusable`` (a dequantized copy nothing else holds), else to a copy."""
        p = stored.payload
        seed = _stable_seed(self.seed, stored.name)
        noisy = x_hat if reusable and x_hat.is_contiguous() else x_hat.contiguous().clone()
        if isinstance(p, QTensor):
            bits = p.bits
            _add_rounding_noise_(p, noisy, seed, self._kappa.get(stored, 1.0))
        else:  # kept as is (planned 32 bits): the noise 8-bit rounding would add
            bits = 8
            q8 = quantize(p.detach(), 8, self.ctl.config.group_size, seed=0)
            _add_rounding_noise_(q8, noisy, seed, rounding_variance_factor(p, q8, seed=seed))
        self._bits[stored.name] = bits
        self._numel[stored.name] = x_hat.numel()
        return noisy, bits

    def _replay(self, node, grad_outputs):
        if callable(node):  # C++ nodes (one output comes back bare, not in a tuple)
            out = node(*grad_outputs)
            return out if isinstance(out, tuple) else (out,)
        # Python autograd.Function nodes: materialize missing gradients as the engine would
        gos = []
        for g, meta in zip(grad_outputs, node._input_metadata):
            if g is None:
                g = torch.zeros(tuple(meta.shape), dtype=meta.dtype, device=meta.device)
            gos.append(g)
        out = node.apply(*gos)
        return out if isinstance(out, tuple) else (out,)

    def _replay_noisy(self, node, stored, noisy, grad_outputs):
        self._override[id(stored)] = noisy
        try:
            with scratch(noisy):  # the probe's own copy, read no more after the replay
                return self._replay(node, grad_outputs)
        finally:
            self._override.pop(id(stored), None)

    def _replay_undone(self, replay) -> tuple[Any, list[Tensor | None]]:
        """Run ``replay()`` of a node that accumulates into parameters' ``.grad`` itself; put
        every ``.grad`` back as it was and return what the replay added to each."""
        kept = [p.grad for p in self._params]
        for p, g in zip(self._params, kept):
            if g is not None:
                p.grad = g.clone()  # the replay accumulates into this copy, not the real one
        try:
            out = replay()
            added = [
                None if p.grad is None or p.grad is g else p.grad - (0 if g is None else g)
                for p, g in zip(self._params, kept)
            ]
        finally:
            for p, g in zip(self._params, kept):
                p.grad = g
        return out, added

    def _probe(
        self, node, stored, x_hat, grad_inputs, grad_outputs, side_effects: bool = False
    ) -> None:
        """Replay ``node`` with ``x_hat`` plus noise; what the noise changes in a parameter's
        gradient is added at once, what it changes in an activation's gradient is carried to
        the parameters by a partial backward from the node it enters (`_defer`)."""
        # the backward's own tensors: nothing here may write into them
        theirs = [t for t in (*grad_inputs, *grad_outputs) if isinstance(t, Tensor)]
        reusable = isinstance(stored.payload, QTensor) and not _shares_storage(x_hat, theirs)
        noisy, bits = self._noisy(stored, x_hat, reusable)
        del x_hat
        acc = self._acc.setdefault(stored.name, {})
        if side_effects:
            # e.g. torch.utils.checkpoint(use_reentrant=True): the node's parameter gradients
            # never leave it, they are accumulated into .grad inside. Replay it clean and noisy,
            # take the difference of what each added, and leave .grad as the real backward set
            # it (replaying into the real .grad added the gradients twice).
            out, noisy_added = self._replay_undone(
                lambda: self._replay_noisy(node, stored, noisy, grad_outputs)
            )
            _, clean_added = self._replay_undone(lambda: self._replay(node, grad_outputs))
            for p, a, b in zip(self._params, noisy_added, clean_added):
                if a is not None:
                    self._add(acc, p, a - (0 if b is None else b))
        else:
            out = self._replay_noisy(node, stored, noisy, grad_outputs)
        out = list(out)
        # the noisy copy is the probe's own: an output written into it (a lean backward's,
        # `scratch`) may be reused for its difference, unless two outputs share it
        if sum(isinstance(o, Tensor) and _shares_storage(o, [noisy]) for o in out) > 1:
            theirs.append(noisy)
        edges, seeds = [], []
        for k, base in enumerate(grad_inputs):
            o = out[k] if k < len(out) else None
            out[k : k + 1] = [None]  # one reference less: `d` may reuse its memory
            if o is None or base is None or not o.is_floating_point():
                continue
            if o.shape != base.shape:  # the engine sums broadcast gradients after the node
                o = o.sum_to_size(base.shape)
            # in place where the replay's output is its own tensor: one tensor less at a time
            d = o.detach().sub_(base) if not _shares_storage(o, theirs) else (o - base).detach()
            del o
            if not bool(d.any()):
                continue
            fn, nr = node.next_functions[k]
            if fn is None:
                continue
            var = getattr(fn, "variable", None)
            if var is not None:
                if id(var) in self._param_ids:
                    self._add(acc, var, d)
                continue
            edges.append(GradientEdge(fn, nr))
            seeds.append(d)
        noisy = out = d = None  # released before the deferred partial backward runs
        if edges:
            self._defer(_Seeds(stored.name, edges, seeds))
        self._finish_read(stored.name)

    def _defer(self, seeds: _Seeds) -> None:
        """Carry a replay's noise in the gradients it emits to the parameters later, in one
        partial backward from the first of the nodes it enters to run (its pre-hook): by then
        the user's backward has released the gradients of the replayed node, so the partial
        backward runs on top of one tensor fewer or two than it would right after the replay,
        and none of the nodes below has run yet."""
        for edge in seeds.edges:
            self._pending.setdefault(id(edge.node), []).append(seeds)
        self._open[seeds.name] = self._open.get(seeds.name, 0) + 1

    def _propagate(self, seeds: _Seeds) -> None:
        """The partial backward deferred by `_defer` (once, from whichever node runs first)."""
        if seeds.done:
            return
        seeds.done = True
        t0 = time.perf_counter()
        name = seeds.name
        edges, grads = seeds.edges, seeds.grads
        seeds.edges, seeds.grads = [], []
        with self._inside():
            try:
                self._walk(self._acc.setdefault(name, {}), edges, grads)
            except Exception as exc:  # never break the user's backward
                self.failed.setdefault(name, f"{type(exc).__name__}: {exc}")
            finally:
                edges = grads = None
        self.seconds += time.perf_counter() - t0
        self._open[name] -= 1
        self._finish_read(name, read=False)

    def _walk(self, acc: dict[int, Tensor], edges: list, grads: list[Tensor]) -> None:
        """Carry the seeds ``grads`` at ``edges`` to the parameters (into ``acc``) by hand, one
        node at a time, latest in forward order first (as the engine orders them: no node left
        feeds the one that runs), with the gradients that reach one node input summed into one
        tensor as soon as both exist. A partial backward holds the gradients it starts from
        to its end; walked so, each is released once its node has run, and seeds that meet
        below (GAT's attention logits and features, both from one linear layer's output) go
        on as one gradient rather than as a full partial backward each while the other waits
        (on a GPU the default mode's worst GAT step held three N x H tensors more so). Where
        a node cannot be run alone (`_runnable`), the rest is one partial backward. The sum
        over parameters is linear in the seeds: walking changes only the order of additions."""
        pending: dict[tuple[int, int], list] = {}
        self._merge(pending, edges, grads)  # (empties ``grads``)
        edges.clear()
        while pending:
            node = max((e.node for e, _ in pending.values()), key=lambda n: n._sequence_nr())
            if not self._runnable(node):
                break
            keys = [k for k, (e, _) in pending.items() if e.node is node]
            run_edges, run_grads = [], []
            for k in keys:
                e, g = pending.pop(k)
                run_edges.append(e)
                run_grads.append(g)
            del g
            self._merge(pending, *self._run_alone(acc, node, run_edges, run_grads))
        if pending:
            rest = list(pending.values())
            pending.clear()
            self._grad_into(acc, [e for e, _ in rest], [g for _, g in rest])

    @staticmethod
    def _merge(pending: dict, edges: list, grads: list[Tensor]) -> None:
        """Add ``grads`` into ``pending`` (node input -> [edge, gradient]); a gradient already
        there takes the new one in place unless its memory is shared (an add node hands one
        tensor to both its inputs)."""
        for e, g in zip(edges, grads):
            key = (id(e.node), e.output_nr)
            if key not in pending:
                pending[key] = [e, g]
                continue
            have = pending[key][1]
            others = [t for k, (_, t) in pending.items() if k != key] + [g]
            pending[key][1] = have.add_(g) if not _shares_storage(have, others) else have + g
            del have, others
        grads.clear()

    @staticmethod
    def _runnable(fn) -> bool:
        """Whether the walk may run ``fn`` alone: C++ nodes and this package's own Functions
        (another Python node may accumulate into ``.grad`` itself, e.g. a reentrant
        checkpoint), not a leaf's accumulator, and with somewhere to send its gradients."""
        ours = getattr(getattr(fn, "_forward_cls", None), "__module__", "").startswith("gact_graph")
        if (not callable(fn) and not ours) or getattr(fn, "variable", None) is not None:
            return False
        return any(nxt is not None for nxt, _ in fn.next_functions)

    def _run_alone(self, acc: dict[int, Tensor], fn, edges: list, grads: list[Tensor]):
        """Run ``fn`` on ``grads`` (at its outputs ``edges``; the list is emptied, so that
        the gradients go once ``fn`` has run) in a backward of its own (``torch.autograd.grad``
        stopped at its input edges, as the partial backwards do: a checkpoint segment counts
        its unpacks per backward pass). What reaches a parameter is added to ``acc``; returns
        the edges and gradients it sends further."""
        targets: dict[tuple[int, int], GradientEdge] = {}
        for nxt, nnr in fn.next_functions:
            if nxt is not None:
                targets.setdefault((id(nxt), nnr), GradientEdge(nxt, nnr))
        ins = list(targets.values())
        held = list(grads)
        grads.clear()
        out = list(torch.autograd.grad(edges, ins, held, retain_graph=True, allow_unused=True))
        held.clear()
        next_edges, next_grads = [], []
        for k, target in enumerate(ins):
            o, out[k] = out[k], None
            # an all-zero gradient goes on as well: testing for one reads the whole tensor (and
            # waits for the device) at every node, which costs more than the rare branch it
            # would spare
            if o is None or not o.is_floating_point():
                continue
            var = getattr(target.node, "variable", None)
            if var is not None:
                if id(var) in self._param_ids:
                    self._add(acc, var, o)
                continue
            next_edges.append(target)
            next_grads.append(o)
        return next_edges, next_grads

    def _grad_into(self, acc: dict[int, Tensor], edges: list, seeds: list[Tensor]) -> None:
        """Add to ``acc`` what ``seeds`` at ``edges`` give each parameter's gradient."""
        if not self._params:
            return
        res = torch.autograd.grad(edges, self._params, seeds, retain_graph=True, allow_unused=True)
        for p, r in zip(self._params, res):
            if r is not None:
                self._add(acc, p, r)

    def _finish_read(self, name: str, read: bool = True) -> None:
        """Count one probed read of ``name``; once every read of it is probed and all its
        deferred seeds are carried, reduce its parameter-sized vectors to a squared norm rather
        than hold them until the end of backward."""
        if read:
            self._reads_done[name] = self._reads_done.get(name, 0) + 1
        rec = getattr(self.ctl, "_record_of", {}).get(name)
        if rec is None or self._reads_done.get(name, 0) < rec.get("uses", 1):
            return
        if self._open.get(name, 0) == 0 and name in self._acc:
            acc = self._acc.pop(name)
            self._sq[name] = self._sq.get(name, 0.0) + sum(v.square().sum() for v in acc.values())

    @staticmethod
    def _add(acc: dict[int, Tensor], p: Tensor, d: Tensor) -> None:
        d = d.detach().to(torch.float64).reshape(p.shape)
        prev = acc.get(id(p))
        acc[id(p)] = d if prev is None else prev + d

    def result(self) -> dict[str, float]:
        """``{name: c_l}`` for every compressed tensor the probed backward read."""
        t0 = time.perf_counter()
        sq = dict(self._sq)
        for name, acc in self._acc.items():
            sq[name] = sq.get(name, 0.0) + sum(v.square().sum() for v in acc.values())
        out = {name: float(v) * (2.0 ** self._bits[name] - 1.0) ** 2 for name, v in sq.items()}
        for name in self._bits:  # read, but its noise reached no parameter
            out.setdefault(name, 0.0)
        for name in self.failed:
            out.pop(name, None)
        self.seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self._fwd_handle is not None:
            self._fwd_handle.remove()
            self._fwd_handle = None
        if self.armed and not self.hooked:
            self._restore_unpack()
        for h in self._node_handles:
            h.remove()
        self._node_handles.clear()
        self._matmul_k.clear()
        self._pending.clear()
        self._open.clear()
        self._reads_done.clear()
        self._override.clear()
        self._acc.clear()
        self._sq.clear()
        self.armed = False


def probe_sensitivity(
    ctl, step_fn: Callable[[], Any], seed: int = 0, closed_form: bool = True
) -> dict[str, float]:
    """Run ``step_fn`` once under a :class:`SensitivityProbe` and return ``{name: c_l}``
    (the convenience form for tests and benchmarks; the adaptive planner instead probes the
    user's own next training step)."""
    probe = SensitivityProbe(
        ctl, min_numel=ctl.config.min_numel, seed=seed, closed_form=closed_form
    )
    probe.arm()
    try:
        step_fn()
        if probe.failed:
            warnings.warn(
                f"gact_graph: could not probe {sorted(probe.failed)}: "
                f"{next(iter(probe.failed.values()))}",
                stacklevel=2,
            )
        return probe.result()
    finally:
        probe.close()
