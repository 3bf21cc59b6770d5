"""The CPUs a process may use: affinity mask and cgroup CPU quota, read from a fake cgroup tree."""

from __future__ import annotations

import os

import pytest

from gact_graph import cpus


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """``cgroup(membership, {relative path: content})``: a fake ``/proc/self/cgroup`` and cgroup
    mount, on a machine with eight CPUs in the affinity mask."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)

    def make(membership: str, files: dict[str, str]) -> None:
        (tmp_path / "proc_cgroup").write_text(membership)
        for rel, content in files.items():
            path = tmp_path / "fs" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        (tmp_path / "fs").mkdir(exist_ok=True)
        monkeypatch.setattr(cpus, "PROC_CGROUP", str(tmp_path / "proc_cgroup"))
        monkeypatch.setattr(cpus, "CGROUP_ROOT", str(tmp_path / "fs"))

    return make


@pytest.mark.parametrize(
    ("membership", "files", "expected"),
    [
        ("0::/\n", {"cpu.max": "200000 100000\n"}, 2),  # cgroup v2, as a container sees it
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ("0::/\n", {"cpu.max": "50000 100000\n"}, 1),
        ("0::/\n", {"cpu.max": "max 100000\n"}, 8),  # no quota: the affinity mask
        ("0::/\n", {}, 8),  # no cpu controller
        # v2, the process in a nested cgroup: the tightest quota of it and its ancestors wins
        (
            "0::/job/step\n",
            {
                "cpu.max": "max 100000",
                "job/cpu.max": "300000 100000",
                "job/step/cpu.max": "max 100000",
            },
            3,
        ),
        # v1 (hybrid hierarchy, as on this machine): cpu controller mounted under its name
        (
            "4:cpu,cpuacct:/\n0::/\n",
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "400000\n",
                "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            },
            4,
        ),
        (
            "1:cpu:/\n2:cpuacct:/\n",
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            8,
        ),
        # v1, the host's path of the container's cgroup: the mount point itself is read
        (
            "3:cpu,cpuacct:/docker/abc\n",
            {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"},
            1,
        ),
    ],
)
def test_quota_caps_the_affinity_mask(cgroup, membership, files, expected):
    cgroup(membership, files)
    assert cpus.usable_cpus() == expected


def test_affinity_mask_below_the_quota(cgroup, monkeypatch):
    cgroup("0::/\n", {"cpu.max": "400000 100000"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)  # taskset -c 3
    assert cpus.usable_cpus() == 1


def test_no_cgroup_information(monkeypatch, tmp_path):
    monkeypatch.setattr(cpus, "PROC_CGROUP", str(tmp_path / "absent"))  # not Linux
    assert cpus.cgroup_cpu_limit() is None
    assert 1 <= cpus.usable_cpus() <= (os.cpu_count() or 1)
