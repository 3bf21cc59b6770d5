"""GACT's Algorithm 1, the reference estimator of the sensitivity :math:`c_l`: two training
steps per tensor that differ only in the rounding seed of that tensor (see
:mod:`gact_graph.policy.sensitivity` for the quantity and the one-pass probe that the adaptive
planner uses instead)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from gact_graph.policy.rounding import S

__all__ = ["flat_grads", "two_seed_sensitivity"]


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


def flat_grads(params: list[Tensor]) -> Tensor:
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
    # every run rounds as the same forward of the step: only tensor l's seed differs
    forwards = ctl._step_forwards
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
                    ctl._step_forwards = forwards
                    step_fn()
                    grads.append(flat_grads(params))
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
    ctl._step_forwards = forwards
    _restore_rng(rng)
    return out
