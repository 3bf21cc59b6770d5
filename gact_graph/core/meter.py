"""A training step's peak memory, from the root forward's start to ``ctl.iterate()``: what
`Controller.report()` splits into its parts and the memory-budget planner judges a step by."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["StepMeter"]


def _status(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (a field the kernel does not report reads 0;
    OSError where the file cannot be read)."""
    out = dict.fromkeys(fields, 0)
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1]) * 1024
    if not any(out.values()):
        raise OSError(f"none of {fields} in /proc/self/status")
    return out


def _anonymous(total: str) -> int:
    """``total`` (VmRSS or VmHWM) less the file-backed and shared pages resident now."""
    st = _status(total, "RssFile", "RssShmem")
    return st[total] - st["RssFile"] - st["RssShmem"]


class StepMeter:
    """Peak memory of one training step, from the root forward's start to ``ctl.iterate()``.

    CUDA: ``max_memory_allocated`` (absolute; ``start`` is ``memory_allocated`` then). CPU: the
    process's anonymous resident memory: VmHWM (reset at the start through
    ``/proc/self/clear_refs``) less the file-backed and shared pages resident when it is read;
    ``start`` is the anonymous resident set then. File-backed pages are left out because they
    are the libraries' code and read-only data, paged in as an op first runs (a fresh process's
    first steps page in megabytes of it) and dropped by the kernel under pressure: no tensor
    or allocation of the step. Since file pages only grow during a step, subtracting the
    count read at the end never overstates the step's anonymous peak. On CPU the resident set
    follows live bytes only when the C allocator returns freed memory
    (``MALLOC_MMAP_THRESHOLD_``); otherwise a step can reuse memory freed before it, and glibc
    keeps what it freed (`BudgetPlanner` then judges steps by counted tensor bytes).
    ``sync=False`` reads CUDA's counters without waiting for the device: the allocator counts
    on the host, as ops are queued, so the figures are the same and the step is not stalled.
    """

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync
        self.start = 0
        self.available = True

    def begin(self) -> None:
        """Start the step's peak anew (process-wide: the device's peak counter is reset)."""
        if self.device.type == "cuda":
            if self.sync:
                torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = _anonymous("VmRSS")
        except OSError:  # not Linux, or no permission: no measurement, the bound stands
            self.available = False

    def current(self) -> int | None:
        """The anonymous resident set now (CPU; None on CUDA or where it cannot be read)."""
        if self.device.type == "cuda" or not self.available:
            return None
        with contextlib.suppress(OSError):
            return _anonymous("VmRSS")
        return None

    def peak(self) -> int | None:
        """The step's peak: absolute on CUDA, the anonymous resident set's high-water mark on
        CPU (None where it cannot be read)."""
        if self.device.type == "cuda":
            if self.sync:
                torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        if not self.available:
            return None
        with contextlib.suppress(OSError):
            return _anonymous("VmHWM")
        return None
