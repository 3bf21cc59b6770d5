r"""The memory-budget planner (Adacc, seed 004): one option per unit, least step time, peak
under the budget.

A *unit* is what one decision covers: a saved tensor outside every checkpoint segment, or a
CB1 segment (its inputs and every tensor saved inside it). Each `Option` of a unit says what
it costs:

- ``resident``: bytes held from the forward until backward consumes them;
- ``transient``: bytes held only while backward recomputes the unit (recomputed segments),
  or fetches it back (swapped tensors); backward handles one such unit at a time, so only
  the largest transient counts;
- ``seconds``: time the option adds to a step (compress + decompress, recompute, copies);
- ``variance``: gradient variance the option adds (:math:`c_l S(b)`, zero where the
  sensitivity is unknown; options below the default bits are not offered there).

**Program.** Binary :math:`x_{u,o}` (unit :math:`u` takes option :math:`o`) and a continuous
:math:`z` (the largest transient):

.. math::
    \min \sum_{u,o} t_{u,o} x_{u,o} \quad\text{s.t.}\quad \sum_o x_{u,o} = 1,\;
    z \ge \sum_o r^{tr}_{u,o} x_{u,o}\;\forall u,\;
    \sum_{u,o} r^{res}_{u,o} x_{u,o} + z \le C,\;
    \sum_{u,o} v_{u,o} x_{u,o} \le V.

Solved with ``scipy.optimize.milp`` (HiGHS, already a dependency through scipy); when scipy's
MILP is missing, does not finish within ``time_limit`` seconds, or returns no solution, a greedy
fallback (`greedy_plan`) runs: start from the smallest option of every unit, fix the variance
by the cheapest variance reduction per byte, then take the largest time saving per added byte
while everything fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Option",
    "Unit",
    "Plan",
    "solve_plan",
    "smallest_memory",
    "least_plan",
    "greedy_plan",
    "load_solver",
]


@dataclass(frozen=True)
class Option:
    """One way to hold a unit (see the module docstring for the fields)."""

    mode: str  # "keep", "compress", "recompute", "swap"
    bits: int  # 32 for kept as is
    resident: int
    transient: int = 0
    seconds: float = 0.0
    variance: float = 0.0

    @property
    def label(self) -> str:
        if self.mode == "keep":
            return "keep"
        if self.mode == "compress":
            return f"{self.bits}b"
        return f"{self.mode}@{'fp32' if self.bits >= 32 else f'{self.bits}b'}"


@dataclass
class Unit:
    """What one decision covers: ``kind`` is ``"tensor"`` or ``"segment"``."""

    name: str
    kind: str
    options: list[Option]
    #: the tensors (names, orig bytes) the unit holds, for the report
    orig_bytes: int = 0


@dataclass
class Plan:
    """The chosen option of every unit and what it predicts."""

    choice: dict[str, Option] = field(default_factory=dict)
    solver: str = ""

    @property
    def resident(self) -> int:
        return sum(o.resident for o in self.choice.values())

    @property
    def transient(self) -> int:
        return max((o.transient for o in self.choice.values()), default=0)

    @property
    def memory(self) -> int:
        """Bytes the units hold at the worst moment: every resident byte and the largest
        transient."""
        return self.resident + self.transient

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.choice.values())

    @property
    def variance(self) -> float:
        return sum(o.variance for o in self.choice.values())


def _memory(choice: Sequence[Option]) -> int:
    return sum(o.resident for o in choice) + max((o.transient for o in choice), default=0)


def _check(units: Sequence[Unit]) -> None:
    for u in units:
        if not u.options:
            raise ValueError(f"unit {u.name!r} has no option")


def load_solver() -> bool:
    """Import ``scipy.optimize``'s MILP now and run it once (`_warm_solver`); whether it is
    there. The budget planner calls it when it is attached, before any step: imported lazily
    at the first plan (the profile step's ``ctl.iterate()``), its libraries (~30 MiB of
    resident memory) came after the CPU meter's baseline and before every planned step, so
    each planned step seemed to hold them and the rectifier fell back to the least plan."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    _warm_solver()
    return True


_WARMED = False


def _warm_solver() -> None:
    """Solve, once per process, programs shaped like the planner's (least memory; least time
    under a capacity and a variance cap, feasible and not; least time without a cap): the
    solver's code is paged in as it first runs, and the resident set keeps it. Left to the
    first profile step's plan, it came after that step's measurement and before every planned
    step, whose resident set then held it."""
    global _WARMED
    if _WARMED:
        return
    _WARMED = True
    rng = np.random.default_rng(0)
    units = []
    for i in range(96):
        size = 1000 * (1 + i % 7)
        options = [Option("keep", 32, 32 * size)]
        for bits in (1, 2, 4, 8):
            seconds, variance = 1e-4 * rng.random(), float(rng.random()) / 4**bits
            options.append(Option("compress", bits, bits * size + 64, 0, seconds, variance))
        if i % 4 == 0:
            options.append(Option("recompute", 32, size, 40 * size, 1e-3 * rng.random()))
        units.append(Unit(f"u{i}", "tensor", options))
    least = _milp(units, None, None, True, 5.0)
    if least is None:
        return
    memory = _memory(least)
    variance = 4 * sum(min(o.variance for o in u.options) for u in units)
    for capacity, cap in ((3 * memory, variance), (memory // 2, variance), (1.2 * memory, None)):
        _milp(units, capacity, cap, False, 5.0)


def _milp(
    units: Sequence[Unit],
    capacity: float | None,
    variance_cap: float | None,
    minimize_memory: bool,
    time_limit: float,
) -> list[Option] | None:
    """The program of the module docstring with ``scipy.optimize.milp``; ``None`` when scipy
    has no MILP, the solver stopped without a solution, or the program is infeasible."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError:
        return None
    index = [(i, j) for i, u in enumerate(units) for j in range(len(u.options))]
    n = len(index) + 1  # the last variable is z, the largest transient
    opts = [units[i].options[j] for i, j in index]
    res = np.array([o.resident for o in opts], dtype=np.float64)
    tra = np.array([o.transient for o in opts], dtype=np.float64)
    sec = np.array([o.seconds for o in opts], dtype=np.float64)
    var = np.array([o.variance for o in opts], dtype=np.float64)
    scale = max(1.0, float(res.max(initial=0.0)), float(tra.max(initial=0.0)))
    c = np.zeros(n)
    if minimize_memory:
        c[:-1] = res / scale
        c[-1] = 1.0
    else:  # time first; a byte-sized tie-break so that equal times take less memory
        tmax = max(float(sec.max(initial=0.0)), 1e-9)
        c[:-1] = sec / tmax + 1e-6 * res / scale
        c[-1] = 1e-6
    rows, lo, hi = [], [], []
    offset = 0
    for u in units:  # one option per unit; z >= its transient
        k = len(u.options)
        one = np.zeros(n)
        one[offset : offset + k] = 1.0
        rows.append(one)
        lo.append(1.0)
        hi.append(1.0)
        if tra[offset : offset + k].any():
            row = np.zeros(n)
            row[offset : offset + k] = tra[offset : offset + k] / scale
            row[-1] = -1.0
            rows.append(row)
            lo.append(-np.inf)
            hi.append(0.0)
        offset += k
    if capacity is not None:
        row = np.zeros(n)
        row[:-1] = res / scale
        row[-1] = 1.0
        rows.append(row)
        lo.append(-np.inf)
        hi.append(capacity / scale)
    if variance_cap is not None and var.any():
        vscale = max(float(var.max()), 1e-300)
        row = np.zeros(n)
        row[:-1] = var / vscale
        rows.append(row)
        lo.append(-np.inf)
        hi.append(variance_cap / vscale * (1 + 1e-9))
    integrality = np.ones(n)
    integrality[-1] = 0
    upper = np.ones(n)
    upper[-1] = np.inf
    result = milp(
        c,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(n), upper),
        options={"time_limit": float(time_limit), "presolve": True},
    )
    if result.x is None:
        return None
    x = result.x[:-1]
    choice: list[Option | None] = [None] * len(units)
    for (i, j), v in zip(index, x):
        if v > 0.5:
            choice[i] = units[i].options[j]
    if any(o is None for o in choice):
        return None
    picked = [o for o in choice if o is not None]
    # HiGHS works in floating point: check the answer against the true integers
    if capacity is not None and _memory(picked) > capacity:
        return None
    if variance_cap is not None and sum(o.variance for o in picked) > variance_cap * (1 + 1e-6):
        return None
    return picked


def _smallest_start(units: Sequence[Unit], variance_cap: float | None) -> list[Option] | None:
    """Greedy memory minimum: each unit's smallest option, then the cheapest variance
    reductions (variance saved per byte added) until the variance fits; None if it cannot."""
    choice = [min(u.options, key=lambda o: (o.resident + o.transient, o.seconds)) for u in units]
    if variance_cap is None:
        return choice
    var = sum(o.variance for o in choice)
    while var > variance_cap * (1 + 1e-9):
        best, best_key = None, None
        mem = _memory(choice)
        for i, u in enumerate(units):
            for o in u.options:
                dv = choice[i].variance - o.variance
                if dv <= 0:
                    continue
                trial = choice[:i] + [o] + choice[i + 1 :]
                dm = _memory(trial) - mem
                key = dv / max(dm, 1e-9) if dm > 0 else math.inf
                if best_key is None or key > best_key:
                    best, best_key = (i, o), key
        if best is None:
            return None
        choice[best[0]] = best[1]
        var = sum(o.variance for o in choice)
    return choice


def greedy_plan(
    units: Sequence[Unit], capacity: float, variance_cap: float | None = None
) -> list[Option] | None:
    """The fallback: the greedy memory minimum, then single-unit changes with the largest time
    saving per byte added while the memory stays within ``capacity`` and the variance within
    ``variance_cap``. ``None`` when even the minimum does not fit."""
    _check(units)
    choice = _smallest_start(units, variance_cap)
    if choice is None or _memory(choice) > capacity:
        return None
    var = sum(o.variance for o in choice)
    while True:
        best, best_key = None, None
        mem = _memory(choice)
        for i, u in enumerate(units):
            for o in u.options:
                dt = choice[i].seconds - o.seconds
                if dt <= 0:
                    continue
                if variance_cap is not None and var - choice[i].variance + o.variance > (
                    variance_cap * (1 + 1e-9)
                ):
                    continue
                trial = choice[:i] + [o] + choice[i + 1 :]
                m = _memory(trial)
                if m > capacity:
                    continue
                key = dt / max(m - mem, 1.0)
                if best_key is None or key > best_key:
                    best, best_key = (i, o), key
        if best is None:
            return choice
        var += best[1].variance - choice[best[0]].variance
        choice[best[0]] = best[1]


def least_plan(
    units: Sequence[Unit], variance_cap: float | None = None, time_limit: float = 5.0
) -> Plan:
    """The plan that holds the least memory among those that meet ``variance_cap`` (the
    MILP's optimum, or the greedy minimum when the MILP is unavailable); ties go to the
    faster option where the greedy minimum decides."""
    _check(units)
    picked = _milp(units, None, variance_cap, True, time_limit)
    solver = "milp"
    if picked is None:
        picked, solver = _smallest_start(units, variance_cap), "greedy"
        if picked is None:
            raise ValueError("no plan meets the variance bound, whatever the memory")
    return Plan({u.name: o for u, o in zip(units, picked)}, solver)


def smallest_memory(
    units: Sequence[Unit], variance_cap: float | None = None, time_limit: float = 5.0
) -> tuple[int, str]:
    """``(bytes, solver)``: the least memory any plan that meets ``variance_cap`` holds
    (`least_plan`'s)."""
    plan = least_plan(units, variance_cap, time_limit)
    return plan.memory, plan.solver


def solve_plan(
    units: Sequence[Unit],
    capacity: float,
    variance_cap: float | None = None,
    *,
    solver: str = "milp",
    time_limit: float = 5.0,
) -> Plan | None:
    """The fastest plan holding at most ``capacity`` bytes with variance at most
    ``variance_cap``; ``None`` when no plan fits. ``solver="greedy"`` skips the MILP."""
    if solver not in ("milp", "greedy"):
        raise ValueError(f"solver must be 'milp' or 'greedy', got {solver!r}")
    _check(units)
    picked, used = None, "greedy"
    if solver == "milp":
        picked = _milp(units, capacity, variance_cap, False, time_limit)
        used = "milp"
    if picked is None:
        picked, used = greedy_plan(units, capacity, variance_cap), "greedy"
    if picked is None:
        return None
    return Plan({u.name: o for u, o in zip(units, picked)}, used)
