r"""Error-bounded bits (AC-GC, Evans & Aamodt, NeurIPS 2021): per-tensor bits chosen so that the
gradient variance compression adds stays below ``loss_bound`` times the gradient's own.

**The condition.** AC-GC bounds the expected loss increase of SGD with compressed activations:
if the error compression adds to the parameter gradient satisfies
:math:`E\lVert \hat g - g \rVert^2 \le e^2\, V^2`, :math:`V^2` the second moment
:math:`E\lVert g \rVert^2` of the uncompressed gradient, then
:math:`E\lVert \hat g\rVert^2 \le (1 + e^2)\, V^2`, and the convergence bound of SGD (whose
variance term is :math:`V^2`) holds with :math:`V^2` replaced by :math:`(1 + e^2) V^2`: the loss
reached after :math:`T` steps is bounded by the uncompressed bound with its variance term
scaled by :math:`(1 + e^2)`.

**What we compare.** The sensitivities of :mod:`gact_graph.policy.sensitivity` give the added
variance of tensor :math:`l` at :math:`b_l` bits, :math:`c_l\, S(b_l)`, :math:`S(b) =
(2^b-1)^{-2}` (expected squared error of the whole parameter gradient, with the group ranges of
the tensor in :math:`c_l`). With unbiased stochastic rounding, drawn independently per tensor,
the errors of different tensors are uncorrelated to first order and their variances add, so
:math:`E\lVert \hat g - g\rVert^2 = V_q = \sum_l c_l S(b_l)`. :math:`V^2` is estimated from the
probed step's own backward: the probe measures :math:`\lVert \hat g\rVert^2` of that step, whose
expectation is :math:`\lVert g\rVert^2 + V_q^{\mathrm{ran}}` (the plan the step ran with), so
:math:`\hat V^2 = \max(\lVert \hat g\rVert^2 - V_q^{\mathrm{ran}}, 0)`, smoothed by the same
EMA as the sensitivities. In full-batch training :math:`\lVert g\rVert^2` *is* the second
moment (the only randomness is dropout, which the EMA averages over re-estimations). The plan
then satisfies

.. math::
    \sum_l c_l\, S(b_l) \le e^2\, \hat V^2

with the fewest bytes (:func:`allocate_bits_bounded`): no bit budget to tune.

**What it assumes.** (1) The first-order variance model: the sensitivities are exact for
tensors a node reads linearly (a linear layer's input), first order otherwise. (2) Independent,
unbiased rounding across tensors (the controller derives one seed per tensor and step). (3) The
estimates hold between re-estimations: the bound is checked at each estimate on the current
:math:`c_l` and :math:`\hat V^2`; as training shrinks the gradient the bound tightens and the
next estimate adds bits. Steps before the first estimate run at ``bits`` (as the adaptive
policy does), so the bound holds from the first plan on. (4) AC-GC's own: an L-smooth loss and
a step size small enough for the scaled variance term (:math:`\alpha \le 1/(L(1+e^2))`).

**Infeasible bounds.** With 32 (kept as is) in the ladder every bound is feasible (zero added
variance). A ladder without it may be unable to meet a bound: every tensor then gets the
ladder's top width and a warning names the smallest ratio the ladder can reach.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gact_graph.policy.adaptive import (
    ADAPTER_OPTIONS,
    DEFAULT_LADDER,
    Adapter,
    allocator_inputs,
    backtrack,
    dp_units,
    mck_table,
    plan_cost_bits,
)
from gact_graph.policy.sensitivity import S

__all__ = ["AcgcAdapter", "BoundInfeasible", "allocate_bits_bounded", "attach_acgc"]

#: cells of the DP table (tensors x cost states) before the costs are rounded up to a coarser
#: unit; 2 M cells (1 MiB packed) keep a re-plan's table bounded whatever the model's depth
_DP_CELLS = 1 << 21


class BoundInfeasible(ValueError):
    """Even the ladder's top width for every tensor adds more variance than the bound allows."""

    def __init__(self, least_variance: float, max_variance: float) -> None:
        self.least_variance = least_variance
        self.max_variance = max_variance
        super().__init__(
            f"the variance bound {max_variance:.4g} cannot be met: the ladder's top width for "
            f"every tensor still adds {least_variance:.4g} (add 32 to the ladder, or raise "
            f"loss_bound)"
        )


# ---------------------------------------------------------------------------------- solver
def allocate_bits_bounded(
    c: Sequence[float],
    D: Sequence[int],
    max_variance: float,
    ladder: Sequence[int] = DEFAULT_LADDER,
    meta_bytes: Sequence[int] | None = None,
    *,
    max_cells: int = _DP_CELLS,
) -> list[int]:
    r"""Bits per tensor with the fewest bits in all subject to
    :math:`\sum_l c_l S(b_l) \le` ``max_variance``: the mirror of
    :func:`~gact_graph.policy.adaptive.allocate_bits` (same costs, metadata included, same
    ladder), objective and constraint swapped.

    Solved by one multiple-choice-knapsack DP over the extra cost above the cheapest plan:
    ``f[w]`` is the least variance of a plan costing at most ``w`` units more, and the answer
    is the plan at the smallest ``w`` with ``f[w] <= max_variance``. The unit is the gcd of all
    cost increments (exact) unless the table would exceed ``max_cells``; then costs are rounded
    *up* to a coarser unit (the variance is always the true one, so the bound still holds) and
    single downgrades that keep the bound are taken afterwards, largest saving first.
    Tensors with :math:`c_l = 0` get the cheapest width.

    Args:
        c: sensitivities :math:`c_l \ge 0`.
        D: elements the codes of each tensor cover
            (:func:`~gact_graph.policy.adaptive.tensor_costs`).
        max_variance: the bound on the added variance (:math:`e^2 \hat V^2`), ``>= 0``.
        ladder: allowed bit widths, a subset of ``(1, 2, 4, 8, 32)``.
        meta_bytes: group-metadata bytes of each tensor (0 if omitted).
        max_cells: size limit of the exact DP table.

    Returns:
        One ladder value per tensor. Raises :class:`BoundInfeasible` when the ladder's top
        width for every tensor still exceeds the bound.
    """
    lad, cs, D, meta = allocator_inputs(c, D, ladder, meta_bytes)
    n = len(cs)
    bound = float(max_variance)
    if not bound >= 0 or math.isinf(bound):
        raise ValueError(f"max_variance must be finite and >= 0, got {max_variance}")
    costs = [[plan_cost_bits([b], [int(d)], [m]) for b in lad] for d, m in zip(D, meta)]
    vals = [[cl * S(b) for b in lad] for cl in cs]
    least = sum(min(row) for row in vals)
    # a hair of slack: sums of the same floats in another order must not flip feasibility
    tol = bound * 1e-12
    if least > bound + tol:
        raise BoundInfeasible(least, bound)
    choice = [min(range(len(lad)), key=lambda j, row=row: (row[j], j)) for row in costs]
    live = [i for i in range(n) if cs[i] > 0]  # c = 0: the cheapest width is free of noise
    if live:
        sub = _dp_min_cost(
            [vals[i] for i in live], [costs[i] for i in live], bound + tol, max_cells
        )
        for i, j in zip(live, sub):
            choice[i] = j
        _downgrade(choice, vals, costs, bound + tol)
    return [lad[j] for j in choice]


def _dp_min_cost(vals, costs, bound: float, max_cells: int) -> list[int]:
    """The cheapest choice per item with summed value <= ``bound`` (see the caller)."""
    inc = [[x - min(row) for x in row] for row in costs]
    span = sum(max(row) for row in inc)  # extra cost of the dearest plan
    w, states, _ = dp_units(inc, span, max_cells)
    states = max(states, sum(max(row) for row in w) + 1)  # rounding up may widen the span
    f, picks = mck_table(vals, w, states)
    cap = int(np.flatnonzero(f <= bound)[0])  # f[-1] is the least variance: feasible
    return backtrack(picks, w, cap)


def _downgrade(choice: list[int], vals, costs, bound: float) -> None:
    """Take single moves to a cheaper width while the bound holds, largest saving first (after
    a coarse DP its rounded costs may have hidden some)."""
    var = sum(vals[i][j] for i, j in enumerate(choice))
    while True:
        best = None
        for i, j in enumerate(choice):
            for k in range(len(vals[i])):
                saving = costs[i][j] - costs[i][k]
                extra = vals[i][k] - vals[i][j]
                if saving > 0 and var + extra <= bound and (best is None or saving > best[0]):
                    best = (saving, i, k, extra)
        if best is None:
            return
        _, i, k, extra = best
        choice[i] = k
        var += extra


# ---------------------------------------------------------------------------------- adapter
class AcgcAdapter(Adapter):
    r"""Chooses bits per tensor so that the added gradient variance stays below
    ``loss_bound`` :math:`e^2` times the measured gradient second moment
    (``compress_gnn(model, policy="acgc", loss_bound=e2)``; see the module docstring).

    It is the adaptive :class:`~gact_graph.policy.adaptive.Adapter` with the allocation step
    replaced: the same probe, sensitivity EMA, schedule, observation of new tensors and state;
    at each estimate it also updates :math:`\hat V^2` (an EMA of the probed step's
    :math:`\lVert\hat g\rVert^2` minus the compression variance of the plan that step ran
    with) and plans with :func:`allocate_bits_bounded` under :math:`e^2 \hat V^2`. ``bits`` is
    the width of tensors before their first estimate. A re-plan keeps the plan in force while it
    still meets the bound and costs at most ``hysteresis`` (10 %) more bytes than the new one.

    Only the probe measures the gradient's norm in the same backward, so ``estimator`` must be
    ``"probe"``. ``alert_share`` defaults to 1 (never): the bound already caps the share.
    """

    def __init__(
        self,
        config,
        loss_bound: float,
        ladder: Sequence[int] = DEFAULT_LADDER,
        ema: float = 0.5,
        max_interval: int = 512,
        estimator: str = "probe",
        alert_share: float = 1.0,
        hysteresis: float = 0.1,
        max_shares: int | None = None,
    ) -> None:
        if estimator != "probe":
            raise ValueError(
                f"policy='acgc' needs estimator='probe' (it measures the gradient's norm in the "
                f"probed backward), got {estimator!r}"
            )
        if isinstance(loss_bound, bool) or not isinstance(loss_bound, (int, float)):
            raise TypeError(f"loss_bound must be a number, got {loss_bound!r}")
        if not (math.isfinite(loss_bound) and loss_bound > 0):
            raise ValueError(f"loss_bound must be finite and > 0, got {loss_bound}")
        super().__init__(
            config, ladder, ema, max_interval, estimator, alert_share, hysteresis, max_shares
        )
        self.loss_bound = float(loss_bound)
        #: EMA of the uncompressed gradient's squared norm, V^2 (None before the first estimate)
        self.grad_var: float | None = None
        #: predicted added variance of the plan in force, and its ratio to ``grad_var``
        self.plan_variance: float | None = None
        self.ratio: float | None = None
        self.infeasible = False
        self._measured: tuple[float, dict[str, int]] | None = None

    # ---------------------------------------------------------------- estimates
    def _update(
        self, ctl, est: dict[str, float], grad_sq: float | None, failed=(), start=None
    ) -> None:
        # The base class updates the sensitivities and then calls make_plan; V^2 must be
        # updated in between (it needs the new c_l of the plan this step ran with).
        if grad_sq is not None and math.isfinite(grad_sq):
            ran = {n: ctl.plan.get(n, self.default_bits) for n in self.tensors}
            self._measured = (float(grad_sq), ran)
        try:
            super()._update(ctl, est, grad_sq, failed, start)
        finally:
            self._measured = None

    def _observe_gradient(self, grad_sq: float, ran: dict[str, int]) -> None:
        v_ran = sum(self.c.get(n, 0.0) * S(b) for n, b in ran.items())
        v2 = max(grad_sq - v_ran, 0.0)
        old = self.grad_var
        self.grad_var = v2 if old is None else self.ema * old + (1 - self.ema) * v2

    # ---------------------------------------------------------------- planning
    def _sensitivities(self, names: list[str]) -> list[float]:
        """Estimates of ``names``; a tensor without one counts as sensitive as the median
        estimate per element (as the adaptive plan does)."""
        per_el = sorted(self.c[n] / max(1, self.tensors[n][1]) for n in names if n in self.c)
        fill = per_el[len(per_el) // 2] if per_el else 1.0
        return [self.c[n] if n in self.c else fill * self.tensors[n][1] for n in names]

    def max_variance(self) -> float | None:
        """The bound on the added variance, :math:`e^2 \\hat V^2` (None before an estimate)."""
        return None if self.grad_var is None else self.loss_bound * self.grad_var

    def make_plan(self, keep: dict[str, int] | None = None) -> dict[str, int]:
        """The cheapest plan whose predicted added variance meets the bound (see the class)."""
        if self._measured is not None:
            self._observe_gradient(*self._measured)
            self._measured = None
        names = list(self.tensors)
        if not names:
            return {}
        bound = self.max_variance()
        if bound is None:  # nothing measured yet: keep what is in force
            return {n: (keep or {}).get(n, self.default_bits) for n in names}
        D = [self.tensors[n][1] for n in names]
        meta = [self.tensors[n][2] for n in names]
        c = self._sensitivities(names)
        try:
            bits = allocate_bits_bounded(c, D, bound, self.ladder, meta)
            self.infeasible = False
        except BoundInfeasible as exc:
            bits = [self.ladder[-1]] * len(names)
            self.infeasible = True
            ratio = exc.least_variance / self.grad_var if self.grad_var else math.inf
            self._warn_once(
                "infeasible",
                f"gact_graph: loss_bound={self.loss_bound:g} cannot be met with the ladder "
                f"{self.ladder}: {self.ladder[-1]} bits for every tensor still adds "
                f"{ratio:.3g} times the gradient's squared norm; every tensor gets "
                f"{self.ladder[-1]} bits (add 32 to the ladder or raise loss_bound)",
                depth=4,  # make_plan <- Adapter._update <- AcgcAdapter._update <- _take
            )
        if keep is not None and all(keep.get(n) in self.ladder for n in names):
            old = [keep[n] for n in names]
            old_var = sum(cl * S(b) for cl, b in zip(c, old))
            new_cost = plan_cost_bits(bits, D, meta)
            if old_var <= bound and plan_cost_bits(old, D, meta) <= new_cost * (
                1 + self.hysteresis
            ):
                bits = old
        var = sum(cl * S(b) for cl, b in zip(c, bits))
        self.plan_variance = var
        self.ratio = var / self.grad_var if self.grad_var else (0.0 if var == 0 else math.inf)
        return dict(zip(names, bits))

    # ---------------------------------------------------------------- reporting
    def average_bits(self, plan: dict[str, int] | None = None) -> float | None:
        """The ``bits`` an adaptive plan would need for the same bytes: (plan cost minus group
        metadata) over the elements, i.e. the average at which
        :func:`~gact_graph.policy.adaptive.budget_bits` equals the plan's cost."""
        plan = plan if plan is not None else (self._ctl.plan if self._ctl is not None else {})
        names = list(self.tensors)
        if not names:
            return None
        D = [self.tensors[n][1] for n in names]
        meta = [self.tensors[n][2] for n in names]
        cost = plan_cost_bits([plan.get(n, self.default_bits) for n in names], D, meta)
        return (cost - 8 * sum(meta)) / sum(D)

    def summary(self, plan: dict[str, int] | None = None) -> dict[str, Any]:
        """The plan's numbers: bound, measured :math:`\\hat V^2`, predicted added variance and
        its ratio, average bits, bits per tensor."""
        plan = plan if plan is not None else (self._ctl.plan if self._ctl is not None else {})
        return {
            "policy": "acgc",
            "loss_bound": self.loss_bound,
            "grad_var": self.grad_var,
            "added_variance": self.plan_variance,
            "ratio": self.ratio,
            "infeasible": self.infeasible,
            "average_bits": self.average_bits(plan),
            "estimates": self.n_estimates,
            "bits": {n: plan.get(n, self.default_bits) for n in self.tensors},
        }

    def report(self, plan: dict[str, int] | None = None) -> str:
        """The adaptive table (bits, sensitivity, variance per tensor) under a header with the
        bound, the achieved ratio and the average bits."""
        s = self.summary(plan)
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.3g}"
        avg = "-" if s["average_bits"] is None else f"{s['average_bits']:.2f}"
        v2 = "-" if s["grad_var"] is None else f"{s['grad_var']:.3e}"
        head = (
            f"acgc plan: loss_bound {self.loss_bound:g}, added variance / gradient variance "
            f"{ratio} (bound {self.loss_bound:g}{', INFEASIBLE' if self.infeasible else ''}), "
            f"gradient variance {v2}, average {avg} bits"
        )
        table = super().report(plan).split("\n")
        # the base header speaks of an average budget and its last line of a budget in KB:
        # neither exists here
        return "\n".join([head, *table[1:-1], table[-1].split(", ", 1)[-1]])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            loss_bound=self.loss_bound,
            grad_var=self.grad_var,
            plan_variance=self.plan_variance,
            ratio=self.ratio,
            infeasible=self.infeasible,
        )
        return state

    @classmethod
    def check_state(cls, state: Any) -> None:
        super().check_state(state)
        for key in ("loss_bound", "grad_var", "plan_variance", "ratio"):
            v = state.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(
                    f"gact_graph state_dict: adapter {key} must be a number or None, got {v!r}"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a state saved with another loss_bound is refused (or, strict=False, announced) by
        # Controller.load_state_dict, which compares the configs
        super().load_state_dict(state)
        g = state.get("grad_var")
        self.grad_var = None if g is None else float(g)
        v = state.get("plan_variance")
        self.plan_variance = None if v is None else float(v)
        r = state.get("ratio")
        self.ratio = None if r is None else float(r)
        self.infeasible = bool(state.get("infeasible", False))


def attach_acgc(ctl) -> AcgcAdapter:
    """Give ``ctl`` an :class:`AcgcAdapter` built from its config (``compress_gnn`` does this for
    ``policy="acgc"``); ``ctl.remove()`` detaches it."""
    opts = {k: ctl.config.extra[k] for k in ADAPTER_OPTIONS if k in ctl.config.extra}
    adapter = AcgcAdapter(ctl.config, ctl.config.loss_bound, **opts)
    ctl.adapter = adapter
    ctl.add_undo(adapter.detach)
    adapter.attach(ctl)
    return adapter
