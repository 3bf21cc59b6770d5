r"""Adaptive bit allocation (GACT, Liu et al., ICML 2022, Sec. 4): bits per saved tensor from
its measured gradient sensitivity, under a memory budget.

**Objective.** With tensor :math:`l` stored at :math:`b_l` bits, compression adds
:math:`\sum_l c_l\, S(b_l)` to the variance of the gradient, :math:`S(b) = (2^b - 1)^{-2}`
(``S(32) = 0``: kept as is). :func:`allocate_bits` minimizes it over a ladder of bit widths.

**Budget** (in bits). For an average of ``bits`` bits per element, the budget is what storing
*every* compressible tensor at exactly ``bits`` bits would cost, group metadata included:

.. math::
    B = \sum_l \big(\mathrm{bits} \cdot D_l + 8\, M_l\big),

:math:`D_l` the elements the codes cover (the padded element count of the tensor's
:func:`~gact_graph.core.quantize.group_layout`), :math:`M_l` the bytes of its per-group metadata
(4 per group). A plan costs :math:`\sum_l \mathrm{cost}_l(b_l)` with
:math:`\mathrm{cost}_l(b) = b D_l + 8 M_l` for ``b < 32`` and :math:`32 D_l` for 32 (no
metadata), i.e. exactly ``8 * QTensor.nbytes``; so fixed ``bits=2`` and adaptive ``bits=2`` hold
the same bytes, and a fractional average (``bits=3``) mixes widths. "Compressible" means what
the controller would quantize: float activations of at least ``min_numel`` elements that the
graph-aware paths do not keep lossless.

**Solver.** Exact dynamic programming over the budget in units of the gcd of all costs
(a multiple-choice knapsack) whenever the table is small (``L * states <= 2**21`` and
``states <= 2**15``: under 2 MiB of host memory), otherwise
the same DP on costs rounded *up* to a coarser unit (so the budget still holds), polished by
pairwise exchanges with the true costs. Either way the
slack left is then filled by the upgrade with the largest variance reduction per bit that still
fits, until none fits: the budget is never exceeded, no single upgrade fits in what remains, and
on instances small enough to brute-force the result is optimal.

**Adapter.** :class:`Adapter` (``ctl.adapter`` when ``adaptive=True``) keeps the sensitivity
estimates (an EMA over re-estimations) and the plan, and decides when to re-estimate; the
estimates come from :class:`gact_graph.policy.sensitivity.SensitivityProbe`, which rides along the
user's own backward pass (no extra passes).
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from functools import reduce
from typing import Any

import numpy as np
import torch

from gact_graph.config import PLAN_BITS
from gact_graph.kernels.layout import META_BYTES_PER_GROUP, group_layout
from gact_graph.policy.sensitivity import S, SensitivityProbe, two_seed_sensitivity
from gact_graph.policy.spread import ALLOWANCE, MAX_SHARES, choose_shares, partition_shares

__all__ = [
    "Adapter",
    "attach_adapter",
    "DEFAULT_LADDER",
    "allocate_bits",
    "budget_bits",
    "plan_cost_bits",
    "tensor_costs",
]

#: Bit widths a plan may use: what the quantizer packs, and 32 (kept as is).
DEFAULT_LADDER = PLAN_BITS
#: Size limits of the exact DP (`dp_units`): table cells (tensors x capacity states, packed two
#: to a byte: 1 MiB) and capacity states (three float64 work buffers: 768 KiB). The DP runs on
#: the host at ``ctl.iterate()``, so its table counts in a CPU step's peak (docs/design.md,
#: "Allocation"). Beyond them the costs are rounded up to a coarser unit and `_exchange` polishes.
_DP_CELLS = 1 << 21
_DP_STATES = 1 << 15


# ---------------------------------------------------------------------------------- costs
def tensor_costs(shape: Sequence[int], group_size: int = 256) -> tuple[int, int]:
    """``(D, meta_bytes)`` of a tensor of ``shape``: elements its codes cover (padded to whole
    groups) and bytes of its group metadata, as :class:`~gact_graph.core.quantize.QTensor` holds
    them."""
    lay = group_layout(shape, group_size)
    return lay.padded_numel, lay.num_groups * META_BYTES_PER_GROUP


def _cost(bits: int, d: int, meta: int) -> int:
    return 32 * d if bits >= 32 else bits * d + 8 * meta


def budget_bits(avg_bits: float, D: Sequence[int], meta_bytes: Sequence[int] | None = None) -> int:
    """The budget of an average of ``avg_bits`` bits per element: ``floor(sum(avg_bits * D_l +
    8 * meta_bytes_l))``, the cost of every tensor at ``avg_bits`` with its metadata."""
    meta = [0] * len(D) if meta_bytes is None else list(meta_bytes)
    return int(math.floor(sum(avg_bits * d + 8 * m for d, m in zip(D, meta)) + 1e-9))


def plan_cost_bits(
    bits: Sequence[int], D: Sequence[int], meta_bytes: Sequence[int] | None = None
) -> int:
    """Bits a plan costs (codes plus metadata; 32 means kept as is, no metadata)."""
    meta = [0] * len(D) if meta_bytes is None else list(meta_bytes)
    return sum(_cost(b, d, m) for b, d, m in zip(bits, D, meta))


def _check_ladder(ladder: Sequence[int]) -> tuple[int, ...]:
    lad = tuple(sorted(set(int(b) for b in ladder)))
    if not lad or any(b not in PLAN_BITS for b in lad):
        raise ValueError(f"ladder must be a non-empty subset of {PLAN_BITS}, got {tuple(ladder)}")
    return lad


def allocator_inputs(
    c: Sequence[float], D: Sequence[int], ladder: Sequence[int], meta_bytes
) -> tuple[tuple[int, ...], list[float], list[int], list[int]]:
    """The inputs of an allocator (this module's and `policy.acgc`'s), checked: the ladder
    sorted, the sensitivities, sizes and metadata bytes as lists of one entry per tensor."""
    lad = _check_ladder(ladder)
    n = len(c)
    if len(D) != n or (meta_bytes is not None and len(meta_bytes) != n):
        raise ValueError("c, D and meta_bytes must have one entry per tensor")
    meta = [0] * n if meta_bytes is None else [int(m) for m in meta_bytes]
    cs = [float(v) for v in c]
    if any(not math.isfinite(v) or v < 0 for v in cs):
        raise ValueError("sensitivities must be finite and >= 0")
    return lad, cs, [int(d) for d in D], meta


# ---------------------------------------------------------------------------------- solver
def allocate_bits(
    c: Sequence[float],
    D: Sequence[int],
    budget_bits: float,
    ladder: Sequence[int] = DEFAULT_LADDER,
    meta_bytes: Sequence[int] | None = None,
    *,
    max_cells: int = _DP_CELLS,
    max_states: int = _DP_STATES,
) -> list[int]:
    r"""Bits per tensor minimizing :math:`\sum_l c_l S(b_l)` subject to
    :math:`\sum_l \mathrm{cost}_l(b_l) \le` ``budget_bits`` (see the module docstring).

    Args:
        c: sensitivities :math:`c_l \ge 0`.
        D: elements the codes of each tensor cover (use :func:`tensor_costs`).
        budget_bits: the budget in bits (use :func:`budget_bits`).
        ladder: allowed bit widths, a subset of ``(1, 2, 4, 8, 32)``.
        meta_bytes: group-metadata bytes of each tensor (0 if omitted); counted for every
            width below 32.
        max_cells: size limit of the exact DP table (``L * budget states``); larger problems
            run the DP on costs rounded up to a coarser unit.
        max_states: the same for the budget states alone (the DP's work buffers).

    Returns:
        One ladder value per tensor. Raises ``ValueError`` if even the cheapest plan does not
        fit.
    """
    lad, cs, Ds, meta = allocator_inputs(c, D, ladder, meta_bytes)
    if not cs:
        return []
    costs = [[_cost(b, d, m) for b in lad] for d, m in zip(Ds, meta)]
    vals = [[cl * S(b) for b in lad] for cl in cs]
    base = sum(min(row) for row in costs)
    budget = int(math.floor(budget_bits))
    if budget < base:
        raise ValueError(f"budget of {budget_bits} bits is below the cheapest plan ({base} bits)")
    inc = [[x - min(row) for x in row] for row in costs]  # all >= 0
    choice, exact = _dp(vals, inc, budget - base, max_cells, max_states)
    _fill_slack(choice, vals, costs, budget)
    if not exact:
        _exchange(choice, vals, costs, budget)
        _fill_slack(choice, vals, costs, budget)
    return [lad[j] for j in choice]


def _dp(vals, inc, slack: int, max_cells: int, max_states: int) -> tuple[list[int], bool]:
    """Multiple-choice knapsack by DP over capacity (``f[w]``: best value with extra cost
    <= ``w`` units); exact when the unit is the gcd of all increments."""
    w, states, exact = dp_units(inc, slack, max_cells, max_states)
    _, picks = mck_table(vals, w, states)
    return backtrack(picks, w, states - 1), exact


def dp_units(
    inc, span: int, max_cells: int, max_states: int = _DP_STATES
) -> tuple[list[list[int]], int, bool]:
    """The cost increments ``inc`` (>= 0) in DP units, the number of capacity states up to
    ``span``, and whether the unit is exact: the gcd of all increments, unless the table
    (items x states) would exceed ``max_cells`` or the states ``max_states``; then a coarser
    unit, costs rounded *up* so that whatever the DP admits still fits the true costs."""
    n = max(1, len(inc))
    unit = reduce(math.gcd, [x for row in inc for x in row if x > 0], 0) or 1
    states = span // unit + 1
    limit = max(2, min(max_cells // n, max_states))
    exact = states <= limit
    if not exact:
        unit = max(unit, -(-span // (limit - 1)))
        states = span // unit + 1
    return [[-(-x // unit) for x in row] for row in inc], states, exact


def mck_table(vals, w, states: int) -> tuple[np.ndarray, np.ndarray]:
    """Multiple-choice knapsack table: ``f[s]``, the least summed value of one choice per item
    whose summed weight ``w[i][j]`` is at most ``s``, and ``picks``, each item's choice at each
    capacity (`backtrack` reads a plan from it). Shared by this module's allocator (least
    variance under a cost) and `policy.acgc`'s (least cost under a variance).

    Memory: the choices are packed two to a byte (at most 16 per item; a ladder has 5), and
    the per-item work reuses three capacity-sized buffers. The table is built at a re-planning
    step, where it adds to that step's resident memory on the host (a deep model's table can
    exceed a small graph's own tensors)."""
    n, m = len(vals), len(vals[0])
    if m > 16:
        raise ValueError(f"at most 16 choices per item, got {m}")
    f = np.zeros(states, dtype=np.float64)
    best, cand = np.empty(states), np.empty(states)
    better = np.empty(states, dtype=bool)
    arg = np.zeros(states + (states & 1), dtype=np.uint8)  # even length: packs into bytes
    picks = np.empty((n, len(arg) // 2), dtype=np.uint8)
    for i in range(n):
        best.fill(np.inf)
        arg.fill(0)
        for j in range(m):
            wj = w[i][j]
            if wj >= states:
                continue
            cand[:wj] = np.inf
            np.add(f[: states - wj], vals[i][j], out=cand[wj:])
            np.less(cand, best, out=better)
            np.copyto(best, cand, where=better)
            arg[:states][better] = j
        np.left_shift(arg[1::2], 4, out=picks[i])
        picks[i] |= arg[0::2]
        f, best = best, f  # the old f is not needed any more: next item's work buffer
    return f, picks


def backtrack(picks: np.ndarray, w, cap: int) -> list[int]:
    """The choice per item of the plan `mck_table` found at capacity ``cap``."""
    choice = [0] * len(picks)
    for i in range(len(picks) - 1, -1, -1):
        j = (int(picks[i, cap >> 1]) >> (4 * (cap & 1))) & 15
        choice[i] = j
        cap -= w[i][j]
    return choice


def _exchange(choice: list[int], vals, costs, budget: int) -> None:
    """Local search after the coarse DP: take the best move of two tensors at once (any pair
    of rungs, one of them possibly unchanged: single moves are pairs too) while it lowers the
    objective within the true budget. Vectorized over all pairs (rows of ``_PAIR_ROWS`` moves
    at a time, so the work buffers stay under 1 MiB for a few hundred tensors): a loop over
    pairs in Python took 4-8 s on 200 tensors."""
    V = np.asarray(vals, dtype=np.float64)
    C = np.asarray(costs, dtype=np.int64)
    n, m = V.shape
    if n < 2:
        return
    rows = np.arange(n)
    owner = np.repeat(rows, m)
    for _ in range(4 * n):  # every move lowers the objective; a bound all the same
        cur = np.asarray(choice)
        cur_v, cur_c = V[rows, cur], C[rows, cur]
        slack = budget - int(cur_c.sum())
        gain = (cur_v[:, None] - V).ravel()  # moving tensor i to rung a lowers it by this
        extra = (C - cur_c[:, None]).ravel()  # ... and costs this many more bits
        tol = 1e-12 * float(np.abs(cur_v).sum())
        best, at = tol, None
        for lo in range(0, n * m, _PAIR_ROWS):
            hi = min(lo + _PAIR_ROWS, n * m)
            g = gain[lo:hi, None] + gain[None, :]
            bad = extra[lo:hi, None] + extra[None, :] > slack
            bad |= owner[lo:hi, None] == owner[None, :]
            g[bad] = -np.inf
            k = int(np.argmax(g))
            if g.flat[k] > best:
                best, at = float(g.flat[k]), (lo + k // (n * m), k % (n * m))
        if at is None:
            return
        for flat in at:
            choice[flat // m] = flat % m


#: moves per row block of `_exchange`'s pair table
_PAIR_ROWS = 64


def _fill_slack(choice: list[int], vals, costs, budget: int) -> None:
    """Upgrade while some single upgrade fits: best variance reduction per bit first."""
    m = len(vals[0]) if vals else 0
    spent = sum(costs[i][j] for i, j in enumerate(choice))
    while True:
        best, best_key = None, None
        for i, j in enumerate(choice):
            for k in range(j + 1, m):
                extra = costs[i][k] - costs[i][j]
                if spent + extra > budget:
                    continue
                gain = vals[i][j] - vals[i][k]
                key = (gain / extra if extra > 0 else float("inf"), -extra, -i)
                if best_key is None or key > best_key:
                    best, best_key = (i, k, extra), key
        if best is None:
            return
        i, k, extra = best
        choice[i] = k
        spent += extra


# ---------------------------------------------------------------------------------- adapter
class Adapter:
    r"""Chooses bits per tensor for a `Controller` from measured sensitivity (``adaptive=True``).

    **Estimates.** The first training step that saves tensors is probed (no extra pass; see
    :class:`~gact_graph.policy.sensitivity.SensitivityProbe`), and at every later
    re-estimation the next step is. Each estimate updates an exponential moving average of
    :math:`c_l` per tensor name (weight ``ema`` on the old value). With
    ``estimator="two_seed"`` GACT's Algorithm 1 runs instead, which needs ``step_fn`` and costs
    two passes per tensor.

    **Plan.** After each estimate, :func:`allocate_bits` spends the budget of an average of
    ``config.bits`` bits. Before the first estimate, every tensor gets the widest quantizer
    width not above the average (e.g. 2 for ``bits=3``): it never exceeds the budget. Tensors
    first seen after a plan was made get that width too until the next estimate. A re-plan
    keeps the plan in force unless the new one predicts more than ``hysteresis`` (10 %) less
    compression variance.

    **Schedule.** Without ``config.adapt_interval``, re-estimation starts every step and the
    interval doubles (up to ``max_interval``) while the plan is stable (at most 5 % of the
    planned elements change width at an estimate), and halves when it is not.
    ``adapt_interval=k`` re-estimates every ``k`` steps.

    **Spread re-estimation.** Where a complete estimate costs more than ``share_allowance``
    (2) plain steps of extra time, the next re-estimations are spread over ``shares``
    consecutive steps, each probing a share of the tensors (`gact_graph.policy.spread`): the
    fewest shares, at most ``max_shares`` (8, and at most ``adapt_interval``), whose largest
    share's part of that time fits; one step where it is under a quarter second, and always
    one under ``torch.use_deterministic_algorithms(True)`` or ``max_shares=1`` (the count
    follows a clock, so a spread schedule is not the same in two runs). The time is
    the wall clock the adapter already reads between ``iterate`` calls: a probed step's time
    less the median of recent plain steps (the first estimate, before any plain step, counts
    the probe's own time against the rest of its step). Which tensors go together is decided
    by the work the probe counts for each (`SensitivityProbe.work`). The first estimate is
    complete; so is one the memory-budget planner arms through
    `attach`. The plan is made when the last share is in, from every tensor's estimate of the
    step that probed it, and the schedule counts from the step the re-estimation started:
    the next one starts ``interval`` steps after it, and never before the last share.

    **Share and alert.** At each estimate, the compression variance of the new plan,
    :math:`V_q = \sum_l c_l S(b_l)`, is compared with what the rest of the gradient holds: the
    probed step measured :math:`E\lVert g \rVert^2 = \lVert \bar g \rVert^2 + V_s + V_q^{old}`
    (signal, sampling/dropout variance, compression variance of the plan it ran with), so the
    share (``last_share``, ``history``) is :math:`V_q / (E\lVert g\rVert^2 - V_q^{old} + V_q)`.
    Full-batch training has no sampling variance, so the gradient's own squared norm is the
    scale compared with (GACT Sec. 4.2 compares with the SGD variance).

    The warning reads another number, ``noise_share``: the compression variance of the plan in
    force from *this* probe's estimates alone over the same step's measured
    :math:`E\lVert g\rVert^2`, and fires (once) when it is above ``alert_share`` (default 0.5)
    at two estimates in a row. The share above uses the EMA of the estimates, which remembers the
    first steps' large gradients: once a run converges (its gradient falls by 10^5 or more while
    the EMA only halves per estimate) it read 100 % on healthy runs; and a first estimate that
    exceeds the measured mean square (``rest`` 0) says the estimate is off, not that the noise
    dominates. Both numbers of one backward scale together with the gradient.
    """

    def __init__(
        self,
        config,
        ladder: Sequence[int] = DEFAULT_LADDER,
        ema: float = 0.5,
        max_interval: int = 512,
        estimator: str = "probe",
        alert_share: float = 0.5,
        hysteresis: float = 0.1,
        max_shares: int | None = None,
    ) -> None:
        if config.bits is None:
            raise ValueError("adaptive compression needs an average bits budget, not None")
        if estimator not in ("probe", "two_seed"):
            raise ValueError(f"estimator must be 'probe' or 'two_seed', got {estimator!r}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        if max_shares is None:
            max_shares = MAX_SHARES
        if isinstance(max_shares, bool) or not isinstance(max_shares, int) or max_shares < 1:
            raise ValueError(f"max_shares must be a positive int, got {max_shares!r}")
        self.avg_bits = float(config.bits)
        self.group_size = int(config.group_size)
        self.min_numel = int(config.min_numel)
        self.seed = int(config.seed)
        self.fixed_interval = config.adapt_interval
        self.ladder = _check_ladder(ladder)
        if self.ladder[0] > self.avg_bits:
            raise ValueError(f"ladder {self.ladder} has nothing at or below bits={self.avg_bits}")
        self.ema = float(ema)
        self.max_interval = int(max_interval)
        self.estimator = estimator
        self.alert_share = float(alert_share)
        self.hysteresis = float(hysteresis)
        #: width of tensors not (yet) in the plan: the widest quantizer width <= the average
        self.default_bits = max(b for b in self.ladder if b <= self.avg_bits and b < 32)
        #: name -> (shape, D, meta bytes) of every tensor the plan covers
        self.tensors: dict[str, tuple[tuple[int, ...], int, int]] = {}
        #: name -> EMA of the sensitivity c_l
        self.c: dict[str, float] = {}
        self.n_estimates = 0
        self.interval = 1 if self.fixed_interval is None else int(self.fixed_interval)
        self.next_estimate = 0  # step whose forward/backward is probed next
        self.last_share: float | None = None
        #: this probe's compression variance of the plan in force over the measured mean square
        self.noise_share: float | None = None
        self._loud = 0  # consecutive estimates with noise_share above alert_share
        self.history: list[dict[str, Any]] = []
        self.warned: set[str] = set()
        self.probe_seconds = 0.0
        self.train_seconds = 0.0
        self._last_call: float | None = None
        self._probe: SensitivityProbe | None = None
        self._ctl = None
        #: steps the next re-estimation is spread over (`gact_graph.policy.spread`)
        self.shares = 1
        self.max_shares = max_shares
        self.share_allowance = ALLOWANCE
        #: name -> work its estimate cost when last probed (`SensitivityProbe.work`)
        self.work: dict[str, float] = {}
        #: tensors one backward node reads together (kept in one share)
        self.together: list[tuple[str, ...]] = []
        #: extra seconds the last complete re-estimation cost, summed over its shares
        self.estimate_seconds: float | None = None
        self._plain: list[float] = []  # wall seconds of recent steps without a probe
        self._plain_guess: float | None = None  # a plain step, told by the first probed one
        #: the re-estimation in progress (`_start`), or None
        self._progress: dict[str, Any] | None = None

    # ---------------------------------------------------------------- wiring
    def attach(self, ctl) -> None:
        """Called once by `compress_gnn`: arm the probe for the very first step. The memory
        budget's planner calls it too, to have the coming step probed: that probe is complete
        (every tensor in one step, a re-estimation in progress given up), since the planner
        measures that step."""
        self._ctl = ctl
        if self._progress is not None:
            self._cancel()
        if self.estimator == "probe" and self.next_estimate <= ctl.step:
            self._arm(ctl)

    def _arm(self, ctl, share=None) -> None:
        if self._probe is None:
            self._probe = SensitivityProbe(
                ctl, self.min_numel, seed=self.seed + self.n_estimates, share=share
            )
            self._probe.arm()

    def _start(self, ctl) -> None:
        """Arm the probe for the coming step, the first re-estimation's step: the first share
        of a spread one where ``shares`` > 1 and the work of each tensor is known, else every
        tensor."""
        if self.shares > 1 and self.n_estimates > 0 and self.tensors:
            work = {n: float(self.work.get(n, 0.0)) for n in self.tensors}
            parts = partition_shares(work, self.shares, self.together)
            if len(parts) > 1:
                self._progress = {
                    "start": ctl.step + 1,
                    "shares": parts,
                    "done": 0,
                    "est": {},
                    "grad_sq": [],
                    "failed": {},
                    "extra": 0.0,
                }
                self._arm(ctl, self._share_of(self._progress))
                return
        self._arm(ctl)

    @staticmethod
    def _share_of(progress: dict[str, Any]):
        """The names the next share of ``progress`` probes, as a predicate: its part of the
        partition, or for the last share every name no earlier share took (tensors first seen
        since the partition included)."""
        parts, k = progress["shares"], progress["done"]
        if k < len(parts) - 1:
            mine = frozenset(parts[k])
            return mine.__contains__
        earlier = frozenset(n for part in parts[:-1] for n in part)
        return lambda name: name not in earlier

    def _cancel(self) -> None:
        """Give up the re-estimation in progress: the estimates of its shares so far are
        dropped, the plan in force stays, and its probe is closed."""
        self._progress = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    def detach(self) -> None:
        """Close the probe armed for the coming step (``ctl.remove()``; the memory-budget
        planner's pause), and give up a re-estimation in progress."""
        self._cancel()

    def progress(self) -> dict[str, Any]:
        """Where re-estimation stands: ``in_progress`` (a spread re-estimation has begun and
        its plan is not made yet), ``shares_done`` / ``shares`` of it and the step it
        ``started`` at (``None`` when none is in progress), and ``next_shares``, the steps
        the next one is spread over."""
        prog = self._progress
        return {
            "in_progress": prog is not None,
            "shares_done": None if prog is None else prog["done"],
            "shares": None if prog is None else len(prog["shares"]),
            "started": None if prog is None else prog["start"],
            "next_shares": self.shares,
            "next_estimate": self.next_estimate,
        }

    def bits_for(self, name: str) -> int:
        """Width of a tensor the plan does not cover yet."""
        return self.default_bits

    # ---------------------------------------------------------------- per step
    def maybe_adapt(self, ctl, step_fn: Callable[[], Any] | None = None) -> None:
        """Called by ``ctl.iterate(step_fn)`` once per step, after the optimizer step."""
        now = time.perf_counter()
        seconds = None if self._last_call is None else now - self._last_call
        if seconds is not None:
            self.train_seconds += seconds
        try:
            if self.estimator == "two_seed":
                if ctl.step >= self.next_estimate:
                    self._observe(ctl)
                    if step_fn is None:
                        self._warn_once(
                            "step_fn",
                            "gact_graph: estimator='two_seed' needs ctl.iterate(step_fn) to "
                            "re-estimate sensitivities; keeping the current plan",
                        )
                    else:
                        t0 = time.perf_counter()
                        est = two_seed_sensitivity(ctl, step_fn, names=list(self.tensors))
                        self.probe_seconds += time.perf_counter() - t0
                        self._update(ctl, est, grad_sq=None)
                return
            probe = self._probe
            if (probe is None or not probe.hooked) and seconds is not None:
                self._plain.append(seconds)  # a step without a probe: what a plain one costs
                del self._plain[:-16]
            if probe is not None and probe.hooked and not probe.compressed:
                # Nothing was quantized (every tensor under ``min_bytes``, or kept by a
                # graph-aware path): nothing to estimate, and arming again at once would hook
                # every step's graph for nothing. Look again later, on the usual doubling
                # schedule, in case larger inputs come.
                probe.close()
                self._probe = None
                self._progress = None
                if self.fixed_interval is None:
                    self.interval = min(self.max_interval, self.interval * 2)
                self.next_estimate = ctl.step + self.interval
            elif probe is not None and probe.hooked and probe.ran:
                self._observe(ctl)  # the tensors of the probed forward
                est = probe.result()
                self.probe_seconds += probe.seconds
                failed = dict(probe.failed)
                grad_sq = probe.grad_sq
                extra = self._extra(probe, now, seconds)
                self.work.update(probe.work)
                for names in probe.read_together:
                    if names not in self.together:
                        self.together.append(names)
                probe.close()
                self._probe = None
                if failed:
                    self._warn_once(
                        "failed",
                        f"gact_graph: could not probe the sensitivity of {sorted(failed)} "
                        f"({next(iter(failed.values()))}); they keep their current bits",
                    )
                self._take(ctl, est, grad_sq, failed, extra)
            elif probe is not None and probe.hooked:  # its forward had no backward: retry
                probe.close()
                self._probe = None
            if self._probe is None:
                if self._progress is not None:  # the next share, in the coming step
                    self._arm(ctl, self._share_of(self._progress))
                elif ctl.step + 1 >= self.next_estimate:
                    self._start(ctl)
        finally:
            self._last_call = time.perf_counter()

    def _extra(self, probe, now: float, seconds: float | None) -> float:
        """Extra seconds the probed step that just ended cost: its time less the median
        plain step; before any plain step (the first estimate), the probe's own time, and the
        rest of the step is taken for a plain one."""
        if seconds is None and probe.started is not None:
            seconds = now - probe.started
        if self._plain:
            return max(0.0, (seconds or 0.0) - statistics.median(self._plain))
        if seconds is not None and self._plain_guess is None:
            self._plain_guess = max(0.0, seconds - probe.seconds)
        return probe.seconds

    def _take(self, ctl, est: dict[str, float], grad_sq, failed: dict[str, str], extra) -> None:
        """The estimates of one probed step: the plan is made from them, or, in a spread
        re-estimation, from them and its earlier shares' once the last share is in."""
        prog = self._progress
        if prog is None:
            self._update(ctl, est, grad_sq=grad_sq, failed=set(failed))
            self._choose_shares(extra)
            return
        prog["est"].update(est)
        prog["grad_sq"].append(grad_sq)
        prog["failed"].update(failed)
        prog["extra"] += extra
        prog["done"] += 1
        if prog["done"] < len(prog["shares"]):
            return
        self._progress = None
        known = [g for g in prog["grad_sq"] if g is not None and math.isfinite(g)]
        # the shares' steps each measured E|g|^2 of their own step: their mean stands for the
        # step the complete estimate would have probed
        mean_sq = sum(known) / len(known) if known else None
        estimate = {n: v for n, v in prog["est"].items() if n not in prog["failed"]}
        self._update(
            ctl, estimate, grad_sq=mean_sq, failed=set(prog["failed"]), start=prog["start"]
        )
        self.history[-1]["shares"] = len(prog["shares"])
        self._choose_shares(prog["extra"])

    def _choose_shares(self, extra: float) -> None:
        """``shares`` for the next re-estimation, from the extra time of the one just made
        (`gact_graph.policy.spread.choose_shares`)."""
        self.estimate_seconds = extra
        plain = self._plain_seconds()
        work = {n: float(self.work.get(n, 0.0)) for n in self.tensors}
        n = choose_shares(extra, plain, work, self.together, self.share_allowance, self.max_shares)
        if n < self.shares:
            # fewer shares only where the estimate fits them with room: a cost near the line
            # would otherwise alternate between a complete estimate over it and a spread one
            # under it
            n = max(n, choose_shares(
                extra, plain, work, self.together, 0.75 * self.share_allowance, self.shares
            ))  # fmt: skip
        if self.fixed_interval is not None:
            n = min(n, int(self.fixed_interval))  # one re-estimation ends before the next
        if torch.are_deterministic_algorithms_enabled():
            n = 1  # the count follows a clock; a run that asks to be reproducible is not spread
        self.shares = max(1, n)

    def _plain_seconds(self) -> float | None:
        """What a step without a probe costs: the median of the recent ones, else what the
        first probed step left beside its probe (``None`` before that)."""
        return statistics.median(self._plain) if self._plain else self._plain_guess

    def _observe(self, ctl) -> None:
        """Add the tensors the last forward quantized (or kept at a planned 32 bits), and take
        the sizes of known ones from it: a tensor's role keeps its name from mini-batch to
        mini-batch while its size changes, and the budget must be that of the probed batch."""
        for r in ctl.stats()["tensors"]:
            name = r["name"]
            if r["kind"] != "activation":
                continue
            if r["bits"] is None and (ctl.plan.get(name) or 0) < 32:
                continue  # kept lossless by a graph-aware path or below min_numel
            shape = tuple(r["shape"])
            d, meta = tensor_costs(shape, self.group_size)
            self.tensors[name] = (shape, d, meta)

    def _update(
        self, ctl, est: dict[str, float], grad_sq: float | None, failed=(), start=None
    ) -> None:
        """Take one complete estimate (``start``: the step its re-estimation began, this step
        by default): the EMA, the plan, the share and alert, and the schedule."""
        start = ctl.step if start is None else start
        prev = dict(self.c)
        # A step whose gradients overflowed (fp16 without a scaler, a diverging loss) gives
        # NaN/Inf estimates: they must not reach the plan, and must not stop training.
        bad = sorted(n for n, v in est.items() if not (math.isfinite(v) and v >= 0))
        if bad:
            self._warn_once(
                "nonfinite",
                f"gact_graph: non-finite sensitivity estimates for {bad} at step {ctl.step} "
                f"(non-finite gradients?); they keep their previous estimate",
                depth=2,  # <- _update <- _take <- maybe_adapt
            )
        if grad_sq is not None and not math.isfinite(grad_sq):
            grad_sq = None
        for name, val in est.items():
            if name not in self.tensors or name in bad:
                continue
            old = self.c.get(name)
            self.c[name] = val if old is None else self.ema * old + (1 - self.ema) * val
        self.n_estimates += 1
        old_plan = {n: ctl.plan.get(n, self.default_bits) for n in self.tensors}
        plan = self.make_plan(keep=old_plan)
        ctl.plan.update(plan)
        # Compression share of the gradient's mean square under the plan now in force: the
        # probed step measured E|g|^2 = signal + sampling variance + V_q(plan it ran with).
        v_q_old = sum(self.c.get(n, 0.0) * S(old_plan[n]) for n in self.tensors)
        v_q = sum(self.c.get(n, 0.0) * S(plan[n]) for n in self.tensors)
        share = noise = None
        if grad_sq is not None and grad_sq > 0:
            rest = max(grad_sq - v_q_old, 0.0)
            share = v_q / (rest + v_q) if rest + v_q > 0 else 0.0
            self.last_share = share
            # this probe's own estimates (the EMA's where it measured none) against its step
            now = {n: est[n] if n in est and n not in bad else self.c.get(n, 0.0) for n in plan}
            v_now = sum(now[n] * S(plan[n]) for n in plan)
            noise = self.noise_share = v_now / grad_sq
            self._loud = self._loud + 1 if noise > self.alert_share else 0
            if self._loud >= 2:
                plural = "" if self.avg_bits == 1 else "s"
                self._warn_once(
                    "alert",
                    f"gact_graph: activation compression dominates the gradient noise: at two "
                    f"estimates in a row its variance under the plan in force was over "
                    f"{self.alert_share:.0%} of the gradient's measured mean square ({noise:.1%} "
                    f"at step {ctl.step}: {v_now:.3g} of {grad_sq:.3g}) at an average of "
                    f"{self.avg_bits:g} bit{plural}; raise bits",
                    depth=2,  # <- _update <- _take <- maybe_adapt
                )
        stable = self._stable(prev, old_plan, plan)
        if self.fixed_interval is None:
            if stable:
                self.interval = min(self.max_interval, self.interval * 2)
            elif self.n_estimates > 1:
                self.interval = max(1, self.interval // 2)
        # counted from the re-estimation's first step, never before the step after this one
        self.next_estimate = max(start + self.interval, ctl.step + 1)
        self.history.append(
            {
                "step": ctl.step,
                "share": share,
                "noise_share": noise,
                "v_q": v_q,
                "grad_sq": grad_sq,
                "interval": self.interval,
                "stable": stable,
                "start": start,
                "shares": 1,
            }
        )
        del self.history[:-64]

    def _stable(self, prev: dict[str, float], old_plan, plan) -> bool:
        """The plan is what training feels: stable when at most 5 % of the planned elements
        changed width (single estimates are noisy, so their ranks alone would keep the
        schedule busy for nothing)."""
        if not prev:
            return False
        total = sum(self.tensors[n][1] for n in plan) or 1
        changed = sum(self.tensors[n][1] for n in plan if plan[n] != old_plan.get(n))
        return changed <= 0.05 * total

    # ---------------------------------------------------------------- planning
    def budget(self) -> int:
        """Budget in bits of the tensors the plan covers (see the module docstring)."""
        D = [t[1] for t in self.tensors.values()]
        meta = [t[2] for t in self.tensors.values()]
        return budget_bits(self.avg_bits, D, meta)

    def make_plan(self, keep: dict[str, int] | None = None) -> dict[str, int]:
        """Allocate the budget over the known tensors from the current estimates.

        Tensors without an estimate count as sensitive as the median estimate per element.
        With ``keep`` (the plan in force), that plan stays unless the new one lowers the
        predicted variance by more than ``hysteresis`` (relative): single estimates are noisy,
        and flipping widths on noise buys nothing.
        """
        names = list(self.tensors)
        if not names:
            return {}
        D = [self.tensors[n][1] for n in names]
        meta = [self.tensors[n][2] for n in names]
        per_el = sorted(self.c[n] / max(1, self.tensors[n][1]) for n in names if n in self.c)
        fill = per_el[len(per_el) // 2] if per_el else 1.0
        c = [self.c[n] if n in self.c else fill * d for n, d in zip(names, D)]
        budget = self.budget()
        bits = allocate_bits(c, D, budget, self.ladder, meta)
        if keep is not None and all(keep.get(n) in self.ladder for n in names):
            old = [keep[n] for n in names]
            new_var = sum(cl * S(b) for cl, b in zip(c, bits))
            old_var = sum(cl * S(b) for cl, b in zip(c, old))
            if plan_cost_bits(old, D, meta) <= budget and old_var <= new_var * (
                1 + self.hysteresis
            ):
                bits = old
        return dict(zip(names, bits))

    # ---------------------------------------------------------------- misc
    def _warn_once(self, key: str, msg: str, depth: int = 0) -> None:
        # stacklevel points at the user's ``ctl.iterate()`` call
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(msg, stacklevel=4 + depth)

    def overhead(self) -> float:
        """Time spent estimating sensitivities as a fraction of the time between ``iterate``
        calls (the training time, estimation included)."""
        return self.probe_seconds / self.train_seconds if self.train_seconds > 0 else 0.0

    def rows(self, plan: dict[str, int] | None = None) -> list[dict[str, Any]]:
        plan = plan if plan is not None else (self._ctl.plan if self._ctl is not None else {})
        out = []
        for name, (shape, d, meta) in self.tensors.items():
            b = plan.get(name, self.default_bits)
            c = self.c.get(name)
            out.append(
                {
                    "name": name,
                    "shape": shape,
                    "bits": b,
                    "c": c,
                    "var": None if c is None else c * S(b),
                    "bytes": _cost(b, d, meta) // 8,
                }
            )
        return out

    def report(self, plan: dict[str, int] | None = None) -> str:
        """A table: every planned tensor, its bits, sensitivity and share of the variance."""
        rows = self.rows(plan)
        total_var = sum(r["var"] or 0.0 for r in rows) or 1.0
        lines = [
            f"adaptive plan: average {self.avg_bits:g} bits, {self.n_estimates} estimates, "
            f"next at step {self.next_estimate}, estimation overhead {100 * self.overhead():.1f}%"
            + ("" if self.last_share is None else f", compression share {self.last_share:.3g}"),
            self._spread_line(),
            f"{'tensor':<40} {'shape':<18} {'bits':>4} {'c_l':>10} {'c_l*S(b)':>10} "
            f"{'var %':>6} {'KB':>9}",
        ]
        for r in rows:
            c = "-" if r["c"] is None else f"{r['c']:.3e}"
            v = "-" if r["var"] is None else f"{r['var']:.3e}"
            pct = "-" if r["var"] is None else f"{100 * r['var'] / total_var:.1f}"
            lines.append(
                f"{r['name']:<40} {str(r['shape']):<18} {r['bits']:>4} {c:>10} {v:>10} "
                f"{pct:>6} {r['bytes'] / 1024:>9.1f}"
            )
        used = sum(_cost(r["bits"], *self.tensors[r["name"]][1:]) for r in rows)
        lines.append(f"budget {self.budget() / 8 / 1024:.1f} KB, plan {used / 8 / 1024:.1f} KB")
        return "\n".join(lines)

    def _spread_line(self) -> str:
        prog = self._progress
        if prog is not None:
            return (
                f"re-estimation in progress: {prog['done']} of {len(prog['shares'])} shares "
                f"probed (started at step {prog['start']}); the plan changes after the last"
            )
        if self.shares > 1:
            return f"re-estimations spread over {self.shares} steps (one share of tensors each)"
        return "re-estimations in one step"

    def plot(self, plan: dict[str, int] | None, path: str) -> str:
        """Save a bar chart of bits and sensitivity per tensor of ``plan`` to ``path``
        (``Controller.plot_bits``; needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:  # optional dependency
            raise ImportError(
                "plot_bits needs matplotlib: pip install matplotlib (or gact_graph[plot])"
            ) from exc
        rows = self.rows(plan)
        names = [r["name"] for r in rows]
        x = np.arange(len(rows))
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(rows) + 2), 6), sharex=True)
        ax1.bar(x, [r["bits"] for r in rows], color="tab:blue")
        ax1.set_ylabel("bits")
        ax1.set_yscale("log", base=2)
        ax1.set_title(f"adaptive plan, average {self.avg_bits:g} bits")
        ax2.bar(x, [r["c"] or 0.0 for r in rows], color="tab:orange")
        ax2.set_ylabel("sensitivity c_l")
        if any((r["c"] or 0) > 0 for r in rows):
            ax2.set_yscale("log")
        ax2.set_xticks(x)
        ax2.set_xticklabels(names, rotation=90, fontsize=7)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {
            "avg_bits": self.avg_bits,
            "ladder": list(self.ladder),
            "tensors": {n: [list(s), d, m] for n, (s, d, m) in self.tensors.items()},
            "c": dict(self.c),
            "n_estimates": self.n_estimates,
            "interval": self.interval,
            "next_estimate": self.next_estimate,
            "last_share": self.last_share,
            "warned": sorted(self.warned),
            "probe_seconds": self.probe_seconds,
            "train_seconds": self.train_seconds,
            "shares": self.shares,
            "work": dict(self.work),
            "together": [list(t) for t in self.together],
            "estimate_seconds": self.estimate_seconds,
            "progress": _copy_progress(self._progress),
        }

    @classmethod
    def check_state(cls, state: Any) -> None:
        """Raise a ``TypeError``/``ValueError`` naming what is wrong with an adapter state
        (``Controller.load_state_dict`` calls it before it changes anything)."""
        where = "gact_graph state_dict: adapter"
        if not isinstance(state, dict):
            raise TypeError(f"{where} state must be a dict, got {state!r}")
        missing = sorted({"tensors", "c", "n_estimates", "interval", "next_estimate"} - set(state))
        if missing:
            raise ValueError(f"{where} state lacks {missing} (not a state of Adapter.state_dict())")
        tensors = state["tensors"]
        if not isinstance(tensors, dict):
            raise TypeError(f"{where} tensors must be a dict, got {tensors!r}")
        for name, entry in tensors.items():
            ok = isinstance(entry, (list, tuple)) and len(entry) == 3
            shape, d, meta = entry if ok else (None, None, None)
            ok = ok and isinstance(shape, (list, tuple)) and all(_is_count(n) for n in shape)
            if not (ok and _is_count(d) and _is_count(meta)):
                raise ValueError(
                    f"{where} tensor {name!r} is {entry!r}; each entry is [shape, elements, "
                    "metadata bytes] with non-negative ints"
                )
        c = state["c"]
        if not isinstance(c, dict):
            raise TypeError(f"{where} c must be a dict of sensitivities, got {c!r}")
        for name, v in c.items():
            if not _is_number(v) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{where} sensitivity of {name!r} is {v!r}; finite and >= 0")
        for key, least in (("n_estimates", 0), ("interval", 1), ("next_estimate", 0)):
            v = state[key]
            if not _is_count(v) or v < least:
                raise ValueError(f"{where} {key} must be an int >= {least}, got {v!r}")
        for key in ("last_share", "probe_seconds", "train_seconds", "estimate_seconds"):
            v = state.get(key)
            if v is not None and not _is_number(v):
                raise ValueError(f"{where} {key} must be a number, got {v!r}")
        _check_spread_state(state, where)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = {n: (tuple(s), int(d), int(m)) for n, (s, d, m) in state["tensors"].items()}
        self.c = {n: float(v) for n, v in state["c"].items()}
        self.n_estimates = int(state["n_estimates"])
        self.interval = int(state["interval"])
        self.next_estimate = int(state["next_estimate"])
        self.last_share = state.get("last_share")
        self.warned = set(state.get("warned", ()))
        self.probe_seconds = float(state.get("probe_seconds", 0.0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        # states saved before estimates were spread have none of these: one step each
        self.shares = int(state.get("shares", 1))
        self.work = {n: float(v) for n, v in state.get("work", {}).items()}
        self.together = [tuple(t) for t in state.get("together", [])]
        self.estimate_seconds = state.get("estimate_seconds")
        self._progress = _copy_progress(state.get("progress"))
        ctl = self._ctl
        if self._progress is not None:
            # the re-estimation goes on at its next share, in the coming step
            if self._probe is not None:
                self._probe.close()
                self._probe = None
            if ctl is not None and self.estimator == "probe":
                self._arm(ctl, self._share_of(self._progress))
        # a probe armed for a step the resumed run has already passed must not linger
        elif self._probe is not None and ctl is not None and self.next_estimate > ctl.step:
            self._probe.close()
            self._probe = None


def _copy_progress(prog: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of a re-estimation in progress that shares nothing with ``prog``."""
    if prog is None:
        return None
    return {
        "start": int(prog["start"]),
        "shares": [list(p) for p in prog["shares"]],
        "done": int(prog["done"]),
        "est": {n: float(v) for n, v in prog["est"].items()},
        "grad_sq": [None if g is None else float(g) for g in prog["grad_sq"]],
        "failed": {n: str(m) for n, m in prog["failed"].items()},
        "extra": float(prog["extra"]),
    }


def _check_spread_state(state: dict[str, Any], where: str) -> None:
    """Raise naming what is wrong with the spread re-estimation's part of an adapter state
    (absent in states saved before estimates were spread: nothing to check then)."""
    shares = state.get("shares", 1)
    if not _is_count(shares) or shares < 1:
        raise ValueError(f"{where} shares must be an int >= 1, got {shares!r}")
    work = state.get("work", {})
    if not isinstance(work, dict) or not all(
        isinstance(n, str) and _is_number(v) and v >= 0 for n, v in work.items()
    ):
        raise ValueError(f"{where} work must map tensor names to numbers >= 0, got {work!r}")
    together = state.get("together", [])
    if not isinstance(together, (list, tuple)) or not all(
        isinstance(t, (list, tuple)) and all(isinstance(n, str) for n in t) for t in together
    ):
        raise ValueError(f"{where} together must be a list of lists of names, got {together!r}")
    prog = state.get("progress")
    if prog is None:
        return
    what = f"{where} progress (a re-estimation in progress)"
    if not isinstance(prog, dict):
        raise TypeError(f"{what} must be a dict or None, got {prog!r}")
    missing = sorted({"start", "shares", "done", "est", "grad_sq", "failed", "extra"} - set(prog))
    if missing:
        raise ValueError(f"{what} lacks {missing}")
    parts = prog["shares"]
    if (
        not isinstance(parts, (list, tuple))
        or len(parts) < 2
        or not all(
            isinstance(p, (list, tuple)) and all(isinstance(n, str) for n in p) for p in parts
        )
    ):
        raise ValueError(f"{what} shares must be two or more lists of names, got {parts!r}")
    if not _is_count(prog["start"]):
        raise ValueError(f"{what} start must be an int >= 0, got {prog['start']!r}")
    done = prog["done"]
    if not _is_count(done) or done >= len(parts):
        raise ValueError(f"{what} done must be an int in [0, {len(parts)}), got {done!r}")
    est, failed, grad_sq = prog["est"], prog["failed"], prog["grad_sq"]
    if not isinstance(est, dict) or not all(_is_number(v) for v in est.values()):
        raise ValueError(f"{what} est must map names to numbers, got {est!r}")
    if not isinstance(failed, dict):
        raise ValueError(f"{what} failed must be a dict, got {failed!r}")
    if (
        not isinstance(grad_sq, (list, tuple))
        or len(grad_sq) != done
        or not all(g is None or _is_number(g) for g in grad_sq)
    ):
        raise ValueError(f"{what} grad_sq must hold one number (or None) per share done")
    if not _is_number(prog["extra"]):
        raise ValueError(f"{what} extra must be a number, got {prog['extra']!r}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: keys of ``CompressionConfig.extra`` (``compress_gnn(..., **extra)``) the adapter reads (each
#: listed, with what it does, in `gact_graph.config.EXTRA_OPTIONS`)
ADAPTER_OPTIONS = (
    "ladder", "ema", "max_interval", "estimator", "alert_share", "hysteresis", "max_shares",
)  # fmt: skip


def attach_adapter(ctl) -> Adapter:
    """Give ``ctl`` an :class:`Adapter` built from its config (``compress_gnn`` does this when
    ``adaptive=True``); ``ctl.remove()`` detaches it."""
    opts = {k: ctl.config.extra[k] for k in ADAPTER_OPTIONS if k in ctl.config.extra}
    adapter = Adapter(ctl.config, **opts)
    ctl.adapter = adapter
    ctl.add_undo(adapter.detach)
    adapter.attach(ctl)
    return adapter
