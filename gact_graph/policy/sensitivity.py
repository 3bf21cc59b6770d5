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

Two estimators.

:func:`~gact_graph.policy.two_seed.two_seed_sensitivity` is GACT's Algorithm 1, the
reference: for each tensor it runs the training step twice with two rounding seeds for that
tensor only (everything else, dropout included, identical) and sets
:math:`c_l = \lVert g_1 - g_2 \rVert^2 / (2 S(b_l))`. It costs ``2 L`` forward+backward passes
for ``L`` tensors.

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

The probe is one class made of three collaborators, one module each:
:mod:`~gact_graph.policy.probe_hooks` (arming, and the hooks that record what the step reads),
:mod:`~gact_graph.policy.probe_estimates` (the closed form and the replay at one node, and the
sums into :math:`c_l`) and :mod:`~gact_graph.policy.probe_walk` (the partial backwards that
carry a replay's noise to the parameters). The noise model they share is
:mod:`~gact_graph.policy.rounding`; Algorithm 1 is :mod:`~gact_graph.policy.two_seed`.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from gact_graph.policy.probe_estimates import ProbeEstimates
from gact_graph.policy.probe_hooks import ProbeHooks
from gact_graph.policy.probe_walk import ProbeWalk, Seeds
from gact_graph.policy.rounding import (
    S,
    element_step,
    nonzero_counts,
    per_element,
    rounding_variance_factor,
    row_rounding_variance,
)
from gact_graph.policy.two_seed import flat_grads as _flat_grads  # noqa: F401 (tests compare gradients with it)
from gact_graph.policy.two_seed import two_seed_sensitivity

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
    "nonzero_counts",
    "row_rounding_variance",
]


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


class SensitivityProbe(ProbeHooks, ProbeEstimates, ProbeWalk):
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
        share: which tensors to probe, by name (``None``: every one). The adaptive planner
            spreads one re-estimation over several steps with it (`gact_graph.policy.spread`);
            a tensor's estimate does not depend on which others are probed beside it.

    Besides the estimates it counts, per tensor, the work its estimate cost (``work``: elements
    of the gradients its replays and walks fed to a backward node), and which tensors one
    node read (``read_together``): what the planner partitions the tensors by.
    """

    def __init__(
        self,
        ctl,
        min_numel: int = 0,
        seed: int = 0,
        closed_form: bool = True,
        share: Callable[[str], bool] | None = None,
    ) -> None:
        self.ctl = ctl
        self.share = share
        #: name -> elements of the gradients fed to backward nodes for its estimate
        self.work: dict[str, int] = {}
        #: names of the candidate tensors one node read, for nodes that read several
        self.read_together: list[tuple[str, ...]] = []
        self._working: str | None = None  # the tensor whose walk runs now
        #: when the probed step's forward first saved a tensor (``time.perf_counter``)
        self.started: float | None = None
        self.closed_form = closed_form
        self.min_numel = min_numel
        self.seed = seed
        self.armed = False
        self.hooked = False  # a forward with a graph was hooked
        self.ran = False  # its backward touched at least one node
        self.compressed = False  # its forward quantized at least one tensor
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
        # Stored -> its `rounding_variance_factors` (a device tensor until `_factors` reads it)
        self._kappa = weakref.WeakKeyDictionary()
        # Stored -> `nonzero_counts`: its per-row rounding variance, compactly
        self._nonzeros = weakref.WeakKeyDictionary()
        self._matmul_k: dict[int, tuple[int, bool]] = {}  # id(node) -> `matmul_kind`
        # noise to propagate, deferred to the pre-hook of the first node it enters:
        # id(node) -> [Seeds of every replay whose noise enters that node]; see `_defer`
        self._pending: dict[int, list[Seeds]] = {}
        self._open: dict[str, int] = {}  # name -> seeds of it still pending
        self._reads_done: dict[str, int] = {}  # name -> reads of it probed so far

    @property
    def grad_sq(self) -> float:
        """Squared norm of the parameter gradient of the probed backward (0 before it)."""
        return float(self._grad_sq)

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
