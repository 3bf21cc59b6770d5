"""Measuring memory the way users feel it: bytes saved for backward, and peak memory."""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["count_saved_bytes", "saved_bytes_stats", "peak_memory", "PeakMemory"]


def saved_bytes_stats(model: nn.Module, fn: Callable[[], Any]) -> dict[str, Any]:
    """`Controller.stats()` of running ``fn()`` (a forward of ``model``) with stock PyTorch
    behaviour: nothing compressed, no graph-aware path, every saved tensor kept by reference.

    The accounting is the controller's own, so stock and compressed figures compare exactly.
    ``fn``'s result is dropped before returning, releasing what was saved.
    """
    from gact_graph.config import CompressionConfig
    from gact_graph.core.controller import Controller

    ctl = Controller(model, CompressionConfig(bits=None, sparse=False, pointwise=False))
    try:
        out = fn()
        stats = ctl.stats()
        del out
    finally:
        ctl.remove()
    return stats


def count_saved_bytes(fn: Callable[[], Any], model: nn.Module) -> int:
    """Bytes stock autograd holds for backward after ``fn()`` runs a forward of ``model``
    (parameters and the model's inputs excluded: they are alive anyway)."""
    return saved_bytes_stats(model, fn)["total"]["orig_bytes"]


class PeakMemory:
    """Peak memory during a ``with`` block: CUDA max allocated on a CUDA device, else the
    process's peak resident set (VmHWM, reset at entry where Linux allows it)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.baseline_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        else:
            _reset_rss_peak()
            self.baseline_bytes = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self.peak_bytes = _rss_bytes("VmHWM")


@contextlib.contextmanager
def peak_memory(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    with PeakMemory(device) as pm:
        yield pm


def _reset_rss_peak() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _rss_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
