"""How many CPUs this process may run on: the thread count for CPU training and tests.

``os.cpu_count()``, and torch's default thread count with it, counts the machine's CPUs. A
container or a batch job is often granted fewer: an affinity mask (``taskset``, cpusets) and a
CFS bandwidth quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``).
More threads than that oversubscribe: each OpenMP barrier waits for threads the scheduler has
parked, and a step can take several times longer than on fewer threads.
"""

from __future__ import annotations

import math
import os

__all__ = ["usable_cpus", "cgroup_cpu_limit"]

#: where the cgroup hierarchy is mounted (module attributes so that tests can point them at a
#: fake hierarchy)
CGROUP_ROOT = "/sys/fs/cgroup"
#: the process's cgroup membership, one ``id:controllers:path`` line per hierarchy
PROC_CGROUP = "/proc/self/cgroup"


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by its cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, n if limit is None else min(n, limit))


def cgroup_cpu_limit() -> int | None:
    """CPUs granted by the cgroup CPU quota (rounded up), or ``None`` without a quota.

    Reads the process's own cgroup and each of its ancestors (the tightest quota wins): cgroup v2
    ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``), cgroup v1
    ``cpu.cfs_quota_us`` (``-1``: none) over ``cpu.cfs_period_us``.
    """
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified hierarchy
            mounts, read = [CGROUP_ROOT], _read_cpu_max
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy,
            # mounted under its controller list ("cpu,cpuacct") or, on some systems, as "cpu"
            mounts = list(dict.fromkeys([controllers, "cpu"]))
            mounts, read = [os.path.join(CGROUP_ROOT, m) for m in mounts], _read_cfs
        else:
            continue
        for mount in mounts:
            for folder in _self_and_ancestors(mount, path):
                quota = read(folder)
                if quota is not None:
                    limits.append(quota)
    return min(limits) if limits else None


def _self_and_ancestors(mount: str, path: str) -> list[str]:
    """``mount/a/b``, ``mount/a``, ``mount`` for ``path`` ``/a/b``. Inside a container the
    path may name the host's cgroup, absent from the container's view: its mount point is then
    the container's own cgroup, so the root is always read."""
    parts = [p for p in path.split("/") if p]
    return [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]


def _quota(quota_us: str, period_us: str) -> int | None:
    quota, period = int(quota_us), int(period_us)
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def _read_cpu_max(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()
    except OSError:
        return None
    return None if quota == "max" else _quota(quota, period)


def _read_cfs(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = f.read().strip()
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = f.read().strip()
    except OSError:
        return None
    return _quota(quota, period)
