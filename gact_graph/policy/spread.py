r"""One re-estimation of the adaptive plan spread over several consecutive steps.

A probed step costs the user's step plus the probe's work, most of it the partial backwards
that carry each replayed tensor's noise down to the parameters
(:mod:`~gact_graph.policy.probe_walk`). That work is a sum over tensors, and a tensor's
estimate does not depend on which other tensors are probed in the same step. So the
:class:`~gact_graph.policy.adaptive.Adapter` may split the tensors into ``n`` *shares* and probe
one share per step, ``n`` consecutive steps; the plan is made when the last share is in, from
one complete estimate (each tensor's value from the step that probed it).

**Partition** (:func:`partition_shares`): by the work each tensor's estimate cost the last
time it was probed, as the probe counts it (``SensitivityProbe.work``: elements of the
gradients its replays and walks fed to backward nodes, the same count on every device).
Tensors one backward node reads together (GATv2's ``x_l`` and ``x_r``) form one group and go
into one share. Groups are placed largest first, each into the share with the least work so
far (ties to the lower index, then by name): deterministic, and within the largest group of
the least possible. The last share also takes every tensor the partition does not name
(first seen since), so that each tensor is probed exactly once per re-estimation.

**How many shares** (:func:`choose_shares`): the fewest whose largest share's part of the
estimate's measured extra time fits in ``allowance`` plain steps (2: a probed step then costs
about 3 plain steps), at most ``max_shares``; 1 where the probe is cheap, against a plain step
or in seconds (under ``min_seconds``, a quarter second: spreading would save less than that
once per re-estimation and delay the plan, and a small model's probe, whose cost one stall of
a shared machine's clock can multiply, is never spread on a misreading).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "MAX_SHARES",
    "ALLOWANCE",
    "MIN_SECONDS",
    "choose_shares",
    "groups_of",
    "partition_shares",
]

#: most steps one re-estimation is spread over
MAX_SHARES = 8
#: a probed step's extra time allowed, in plain steps
ALLOWANCE = 2.0
#: extra seconds of a complete estimate below which it is not spread
MIN_SECONDS = 0.25


def groups_of(names: Iterable[str], together: Iterable[Sequence[str]]) -> list[list[str]]:
    """``names`` in groups: names that appear in one entry of ``together`` (directly or
    through a chain of entries) share a group; each group sorted, groups in order of their
    first name. Names of ``together`` not in ``names`` are left out."""
    names = list(dict.fromkeys(names))
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for entry in together:
        known = [n for n in entry if n in parent]
        for a, b in zip(known, known[1:]):
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(root(n), []).append(n)
    return sorted((sorted(g) for g in out.values()), key=lambda g: g[0])


def partition_shares(
    work: Mapping[str, float], n: int, together: Iterable[Sequence[str]] = ()
) -> list[list[str]]:
    """The tensors of ``work`` (name -> counted work) in at most ``n`` non-empty shares of
    about equal work (see the module docstring); fewer when there are fewer groups."""
    if n < 1:
        raise ValueError(f"the number of shares must be >= 1, got {n}")
    groups = groups_of(sorted(work), together)
    weight = [sum(max(0.0, float(work[m])) for m in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda i: (-weight[i], groups[i][0]))
    n = min(n, len(groups)) or 1
    load = [0.0] * n
    shares: list[list[str]] = [[] for _ in range(n)]
    for i in order:
        k = min(range(n), key=lambda j: (load[j], j))
        load[k] += weight[i]
        shares[k].extend(groups[i])
    return [sorted(s) for s in shares if s]


def largest_part(work: Mapping[str, float], shares: Sequence[Sequence[str]]) -> float:
    """The largest share's part of the total work (1.0 for one share or no work)."""
    total = sum(max(0.0, float(v)) for v in work.values())
    if total <= 0 or len(shares) <= 1:
        return 1.0
    return max(sum(max(0.0, float(work[m])) for m in s) for s in shares) / total


def choose_shares(
    extra_seconds: float,
    plain_seconds: float | None,
    work: Mapping[str, float],
    together: Iterable[Sequence[str]] = (),
    allowance: float = ALLOWANCE,
    max_shares: int = MAX_SHARES,
    min_seconds: float = MIN_SECONDS,
) -> int:
    """The number of shares for the next re-estimation: the fewest ``n <= max_shares`` whose
    largest share (`partition_shares` of ``work``) takes at most ``allowance *
    plain_seconds`` of the measured ``extra_seconds`` a complete estimate costs (shares split
    the time as they split the counted work); else the ``n`` with the smallest largest share.
    1 when the cost or the plain step is not known (``None``, zero, not finite), or when
    ``extra_seconds`` is under ``min_seconds``."""
    if max_shares < 1:
        raise ValueError(f"max_shares must be >= 1, got {max_shares}")
    if allowance <= 0:
        raise ValueError(f"allowance must be > 0, got {allowance}")
    ok = all(v is not None and math.isfinite(v) and v > 0 for v in (extra_seconds, plain_seconds))
    if not ok or not work or extra_seconds < min_seconds:
        return 1
    together = list(together)
    limit = allowance * plain_seconds
    best, best_part = 1, math.inf
    for n in range(1, max_shares + 1):
        shares = partition_shares(work, n, together)
        part = largest_part(work, shares)
        if part * extra_seconds <= limit:
            return len(shares)
        if part < best_part - 1e-12:
            best, best_part = len(shares), part
        if len(shares) < n:  # no more groups to split
            break
    return best
