"""How deep, how wide, how large a graph: the largest configuration that completes a training
step (forward, backward, optimizer step) under a memory budget.

This is the search behind ``benchmarks/memory.py scaling`` (deepest / widest GCN and GCNII,
GACT Table 4) and ``benchmarks/largest_graph.py`` (largest full-batch graph), and of the deep tests
(``tests/benchmarks/``), which import it as ``benchmarks.harness``. It is benchmark machinery,
not part of the installed package.

Two ways to enforce the budget:

- **CUDA**: the real thing. ``torch.cuda.set_per_process_memory_fraction`` caps the caching
  allocator at the budget and a configuration fits when its steps finish without
  ``OutOfMemoryError``; the peak (``max_memory_allocated``) is reported too.
- **CPU** (runs anywhere): byte accounting. A configuration fits when

  ``parameters + buffers + gradients + optimizer state + graph inputs + saved tensors``

  stays within the budget, all counted as if alive at once (at the end of forward the saved
  tensors peak while parameters, the optimizer state and, from the second step on, gradients are
  alive too). Saved tensors are measured by the controller's own accounting:
  ``Controller.stats()["total"]["stored_bytes"]`` for compression and the stock-accounting
  controller of :func:`gact_graph.memory.saved_bytes_stats` (nothing compressed, no graph-aware
  path, every tensor by reference) for stock PyG, so both sides count exactly the same way.
  Transient workspaces of forward and backward are not counted. A forward that crosses the
  budget is stopped early (a check every few convolutions), so a trial that does not fit costs
  little time and little RAM. Opt level L2 (swap to host memory) has no device to swap from on
  CPU: its bookkeeping runs with plain copies (``swap_simulate=True``, every payload) and the
  accounting leaves out what it moved, as a GPU would.

`search_max` is the search: exponential growth from a start value until a trial fails, then
binary search between the last success and the first failure (optionally stopping at a relative
tolerance, under a deadline or at a cap).

The scripts' shared start and record are here too: `subcommand` (one measurement of a script),
`start_run` (threads, device), `names` (a comma-separated flag), `run_env` and `command_line`
(what a JSON says about its run), `budget_meaning` (what a budget limits on the device),
`write_results` (the JSON, rewritten after every result so that a run cut short keeps what it
found).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Method",
    "GraphInputs",
    "StepResult",
    "SearchResult",
    "BudgetExceeded",
    "build_model",
    "adaptive_works",
    "opt_level_works",
    "default_methods",
    "run_step",
    "cuda_budget",
    "search_max",
    "max_depth",
    "max_width",
    "gib",
    "names",
    "start_run",
    "run_env",
    "budget_meaning",
    "command_line",
    "write_results",
    "sync",
    "subcommand",
    "dispatch",
]

_GIB = 1 << 30


class BudgetExceeded(RuntimeError):
    """Raised inside a CPU trial's forward when the accounted bytes pass the budget."""


@dataclass(frozen=True)
class Method:
    """One way to train: stock PyG FP32 (``compress=None``) or ``compress_gnn(**compress)``.

    Args:
        name: label in tables and JSON (``"stock"``, ``"L1 2-bit"``, ...).
        compress: keyword arguments of :func:`gact_graph.compress_gnn`; ``None`` for stock.
        steps: training steps per trial (``None``: 1 for fixed bits on CPU, 2 on CUDA so the
            optimizer state exists during a forward, 3 for adaptive bits so the plan made from
            the first steps' sensitivities is the one measured).
    """

    name: str
    compress: dict[str, Any] | None = None
    steps: int | None = None

    @property
    def is_stock(self) -> bool:
        return self.compress is None

    def num_steps(self, device: torch.device) -> int:
        if self.steps is not None:
            return self.steps
        if self.compress is not None and self.compress.get("adaptive"):
            return 3
        return 2 if device.type == "cuda" else 1


@dataclass
class GraphInputs:
    """The tensors of a full-batch node-classification step, on one device."""

    x: Tensor
    edge_index: Tensor
    y: Tensor
    train_mask: Tensor | None = None

    @classmethod
    def from_data(cls, data, device: torch.device | str = "cpu") -> GraphInputs:
        mask = getattr(data, "train_mask", None)
        return cls(
            x=data.x.to(device),
            edge_index=data.edge_index.to(device),
            y=data.y.to(device),
            train_mask=None if mask is None else mask.to(device),
        )

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]

    @property
    def num_edges(self) -> int:
        return self.edge_index.shape[1]

    @property
    def nbytes(self) -> int:
        ts = [self.x, self.edge_index, self.y, self.train_mask]
        return sum(_tensor_bytes(t) for t in ts if t is not None)


@dataclass
class StepResult:
    """Outcome of one trial.

    ``reason``: ``"ok"`` (fits), ``"budget"`` (CPU accounting over budget), ``"oom"`` (CUDA out
    of memory), ``"error"`` (anything else: ``error`` holds the message; not a memory verdict).
    ``bytes``: the CPU accounting (``params``, ``grads``, ``optimizer``, ``inputs``, ``saved``,
    ``total``), measured as far as the trial got. ``peak_bytes``: CUDA ``max_memory_allocated``
    (0 on CPU). ``loss_finite``: every step's loss was finite.
    """

    fits: bool
    reason: str
    bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    seconds: float = 0.0
    steps_done: int = 0
    loss_finite: bool = True
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchResult:
    """Outcome of `search_max`: ``best`` is the largest value that fit (0: not even the
    start), ``first_fail`` the smallest value seen to fail (``None``: none failed),
    ``capped``/``timed_out`` say why the search stopped early, ``error`` a non-memory failure."""

    best: int
    first_fail: int | None
    trials: list[dict[str, Any]]
    capped: bool = False
    timed_out: bool = False
    error: str | None = None
    seconds: float = 0.0
    best_result: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------ models
def build_model(
    name: str,
    in_channels: int,
    out_channels: int,
    *,
    num_layers: int,
    hidden_channels: int,
    **overrides: Any,
) -> nn.Module:
    """``gact_graph.models`` model ``name`` with its published ogbn-arxiv setup
    (:func:`gact_graph.models.preset`), depth and width replaced (``hidden_channels`` is per head
    for GAT)."""
    from gact_graph.models import build_model as _build
    from gact_graph.models import preset

    kwargs = preset(name, "ogbn-arxiv")["model"]
    kwargs.update(num_layers=num_layers, hidden_channels=hidden_channels, **overrides)
    return _build(name, in_channels, out_channels, **kwargs)


# ------------------------------------------------------------------------------ methods
def _tiny_graph(seed: int = 0) -> GraphInputs:
    g = torch.Generator().manual_seed(seed)
    n = 64
    src = torch.randint(0, n, (256,), generator=g)
    dst = torch.randint(0, n, (256,), generator=g)
    return GraphInputs(
        x=torch.randn(n, 32, generator=g),
        edge_index=torch.stack([torch.cat([src, dst]), torch.cat([dst, src])]),
        y=torch.randint(0, 4, (n,), generator=g),
    )


def _probe(compress: dict[str, Any], steps: int = 3) -> tuple[bool, str]:
    """Whether ``compress_gnn(model, **compress)`` trains a tiny GCN for ``steps`` steps."""
    graph = _tiny_graph()
    torch.manual_seed(0)
    model = build_model("gcn", 32, 4, num_layers=2, hidden_channels=64)
    res = run_step(lambda: model, graph, Method("probe", dict(compress, min_numel=0), steps=steps))
    return res.reason == "ok", res.error or ""


def adaptive_works() -> tuple[bool, str]:
    """``(works, why not)``: does ``compress_gnn(..., adaptive=True)`` train at present?"""
    return _probe({"bits": 2, "adaptive": True})


def opt_level_works(level: str) -> tuple[bool, str]:
    """``(works, why not)``: is opt level ``level`` implemented (not just accepted by the config)?

    L1 is the baseline; any other level must come with its module ``gact_graph.policy.levels``
    (the config accepts ``"L2"`` before swapping exists, and then it would silently be L1)."""
    import importlib.util

    from gact_graph.config import OPT_LEVELS

    if level not in OPT_LEVELS:
        return False, f"unknown opt level {level!r}"
    if level not in ("L0", "L1") and importlib.util.find_spec("gact_graph.policy.levels") is None:
        return False, "gact_graph.policy.levels does not exist yet"
    return _probe({"bits": 2, "opt_level": level})


def default_methods(
    bits: tuple[int, ...] = (4, 2), *, adaptive: bool | None = None, l2: bool | None = None
) -> tuple[list[Method], list[str]]:
    """Stock FP32, L1 at each of ``bits`` (adaptive when it works, else fixed) and L2 2-bit
    (when implemented). ``adaptive``/``l2``: ``None`` decides by probing, ``False`` leaves out.

    Returns ``(methods, notes)``; the notes say what was probed and chosen.
    """
    notes: list[str] = []
    use_adaptive = False
    if adaptive is None or adaptive:
        ok, why = adaptive_works()
        use_adaptive = ok
        notes.append(
            "adaptive bits: compress_gnn(adaptive=True) works, L1 rows use adaptive bits "
            "(average budget = bits)"
            if ok
            else f"adaptive bits: unavailable ({why[:160]}); L1 rows use fixed bits"
        )
    else:
        notes.append("adaptive bits: off by request; L1 rows use fixed bits")
    methods = [Method("stock FP32")]
    for b in bits:
        kind = "adaptive" if use_adaptive else "fixed"
        methods.append(Method(f"L1 {b}-bit {kind}", {"bits": b, "adaptive": use_adaptive}))
    if l2 is None or l2:
        ok, why = opt_level_works("L2")
        if ok:
            b = min(bits)
            methods.append(
                Method(f"L2 {b}-bit", {"bits": b, "adaptive": use_adaptive, "opt_level": "L2"})
            )
            notes.append("opt level L2: implemented, included")
        else:
            notes.append(f"opt level L2: not included ({why[:160]})")
    return methods, notes


# ------------------------------------------------------------------------------ one trial
def _tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, Tensor):
                total += _tensor_bytes(v)
    return total


class _CpuGuard:
    """Forward pre-hooks on the message-passing layers that stop a forward whose accounted
    bytes already exceed the budget (checked every ``every`` layers: stats() is linear in the
    number of saved tensors)."""

    def __init__(self, model: nn.Module, saved_fn: Callable[[], int], limit: int) -> None:
        from torch_geometric.nn.conv import MessagePassing

        convs = [m for m in model.modules() if isinstance(m, MessagePassing)]
        self.every = max(1, len(convs) // 16)
        self.saved_fn = saved_fn
        self.limit = limit
        self.count = 0
        self.last = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in convs]

    def _hook(self, module, args) -> None:
        self.count += 1
        if self.count % self.every:
            return
        saved = self.last = self.saved_fn()
        if saved > self.limit:
            raise BudgetExceeded(f"saved tensors passed {self.limit} bytes during forward")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def run_step(
    model_fn: Callable[[], nn.Module],
    graph: GraphInputs,
    method: Method,
    *,
    budget_bytes: int | None = None,
    lr: float = 1e-3,
    optimizer: str = "adam",
) -> StepResult:
    """Build the model and train it for ``method.num_steps`` full-batch steps on ``graph``.

    On CUDA the caller caps the allocator (see `cuda_budget`) and an OOM is the verdict; on
    CPU ``budget_bytes`` is enforced by the accounting described in the module docstring
    (``None``: no budget, just measure). The model and everything it allocated are released
    before returning.
    """
    device = graph.device
    on_cuda = device.type == "cuda"
    t0 = time.perf_counter()
    res = StepResult(fits=False, reason="error", bytes={"inputs": graph.nbytes})
    res.bytes["total"] = graph.nbytes
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        _train(model_fn, graph, method, None if on_cuda else budget_bytes, lr, optimizer, res)
    except torch.OutOfMemoryError:  # CUDA (and CPU allocator) out of memory
        res.reason = "oom"
    except BudgetExceeded:  # from a forward outside the step loop (an adaptive re-estimation)
        res.reason = "budget"
    except Exception as exc:  # not a memory verdict: reported, never counted as "fits"
        res.reason, res.error = "error", f"{type(exc).__name__}: {exc}"
    # Out of the except clauses: the traceback, and the trial's frames and tensors it held,
    # are gone. Young generations only: a full collection walks every object of the process
    # (seconds with torch_geometric loaded) and a trial's garbage is young; after an OOM,
    # everything, so the next trial starts from an empty cache.
    if res.reason == "oom":
        gc.collect()
    else:
        gc.collect(1)
    if on_cuda:
        torch.cuda.synchronize(device)
        res.peak_bytes = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.empty_cache()
    res.seconds = time.perf_counter() - t0
    return res


def _train(model_fn, graph, method, budget_bytes, lr, optimizer, res: StepResult) -> None:
    """The body of `run_step`: fills ``res``; raises on OOM and on errors. ``budget_bytes``
    is the CPU accounting budget (``None`` on CUDA)."""
    from gact_graph import compress_gnn
    from gact_graph.config import CompressionConfig
    from gact_graph.core.controller import Controller

    device = graph.device
    acct = res.bytes
    model = model_fn().to(device)
    model.train()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    acct["params"] = sum(_tensor_bytes(p) for p in params) + sum(
        _tensor_bytes(b) for b in model.buffers()
    )
    acct["grads"] = sum(_tensor_bytes(p) for p in trainable)
    if optimizer == "adam":
        opt = torch.optim.Adam(trainable, lr=lr)
        acct["optimizer"] = 2 * acct["grads"]  # exp_avg, exp_avg_sq; measured after a step
    elif optimizer == "sgd":
        opt = torch.optim.SGD(trainable, lr=lr)
        acct["optimizer"] = 0
    else:
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    acct["saved"] = 0
    fixed = acct["params"] + acct["grads"] + acct["optimizer"] + acct["inputs"]
    acct["total"] = fixed
    if budget_bytes is not None and fixed > budget_bytes:
        res.reason = "budget"
        return

    compress = None if method.is_stock else dict(method.compress)
    simulate_swap = (
        device.type != "cuda" and compress is not None and compress.get("opt_level") == "L2"
    )
    ctl = guard = None
    try:
        with warnings.catch_warnings():
            # adaptive-bit advice ("raise bits"), L2-on-CPU notes: for training runs, not here
            warnings.simplefilter("ignore", UserWarning)
            if compress is None:
                ctl = Controller(model, CompressionConfig(bits=None, sparse=False, pointwise=False))
            else:
                if simulate_swap:  # no device to swap from: run the swap's bookkeeping on CPU,
                    # for every payload (the size floor is about copy overhead on a GPU, and
                    # the small graphs a CPU can run would otherwise swap nothing)
                    compress.setdefault("swap_simulate", True)
                    compress.setdefault("swap_min_bytes", 0)
                ctl = compress_gnn(model, **compress)
            swap = getattr(ctl, "level_manager", None) if simulate_swap else None
            swapped_before = [0]

            def device_saved() -> int:
                """Saved bytes that stay on the device (L2 on CPU: minus what it swapped out
                during this forward, as it would on a GPU)."""
                saved = int(ctl.stats()["total"]["stored_bytes"])
                if swap is not None:
                    saved -= swap.counters["offloaded_bytes"] - swapped_before[0]
                return saved

            if budget_bytes is not None:
                guard = _CpuGuard(model, device_saved, budget_bytes - fixed)

            mask = graph.train_mask

            def forward_loss() -> Tensor:
                out = model(graph.x, graph.edge_index)
                if mask is not None:
                    return F.cross_entropy(out[mask], graph.y[mask])
                return F.cross_entropy(out, graph.y)

            def step_fn() -> Tensor:  # GACT's closure, for the adaptive re-estimation
                opt.zero_grad(set_to_none=True)
                loss = forward_loss()
                loss.backward()
                return loss

            for _ in range(method.num_steps(device)):
                opt.zero_grad(set_to_none=True)
                if swap is not None:
                    swapped_before[0] = swap.counters["offloaded_bytes"]
                try:
                    loss = forward_loss()
                except BudgetExceeded:
                    acct["saved"] = max(acct["saved"], guard.last)  # when it was stopped
                    acct["total"] = fixed + acct["saved"]
                    res.reason = "budget"
                    return
                saved = device_saved()
                if swap is not None:
                    acct["swapped"] = int(ctl.stats()["total"]["stored_bytes"]) - saved
                acct["saved"] = max(acct["saved"], saved)
                acct["total"] = fixed + acct["saved"]
                if budget_bytes is not None and acct["total"] > budget_bytes:
                    res.reason = "budget"
                    return
                loss.backward()
                res.loss_finite &= bool(torch.isfinite(loss.detach()).item())
                del loss
                opt.step()
                ctl.iterate(step_fn)
                res.steps_done += 1
    finally:
        if guard is not None:
            guard.remove()
        if ctl is not None:
            ctl.remove()
    acct["optimizer"] = _optimizer_state_bytes(opt)  # exact, now that it exists
    acct["total"] = sum(acct[k] for k in ("params", "grads", "optimizer", "inputs", "saved"))
    if budget_bytes is not None and acct["total"] > budget_bytes:
        res.reason = "budget"
    else:
        res.fits, res.reason = True, "ok"


@contextlib.contextmanager
def cuda_budget(budget_bytes: int, device: torch.device | str = "cuda"):
    """Cap this process's CUDA caching allocator at ``budget_bytes`` for the block (restored
    to the whole device afterwards)."""
    device = torch.device(device)
    if device.index is None:  # set_per_process_memory_fraction needs an index ("cuda" has none)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    frac = min(1.0, budget_bytes / total)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(frac, device)
    try:
        yield frac
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


# ------------------------------------------------------------------------------ search
def search_max(
    trial: Callable[[int], StepResult | bool],
    *,
    start: int = 1,
    unit: int = 1,
    cap: int | None = None,
    rel_tol: float = 0.0,
    deadline: float | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> SearchResult:
    """Largest ``v`` (a multiple of ``unit``, at least ``start``) with ``trial(v)`` fitting,
    assuming fitting is monotone (what fits at ``v`` fits at every smaller value).

    Exponential search (``start``, ``2 start``, ``4 start``, ...) until a trial fails or ``cap``
    is reached, then binary search between the last success and the first failure, stopping
    when they are one ``unit`` apart or within ``rel_tol`` of each other. ``deadline`` (a
    ``time.perf_counter()`` value) stops the search early with the best value verified so far
    (``timed_out``). A trial that errs (not a memory verdict) stops the search (``error``).
    ``progress`` is called with each trial's record as it completes.
    """
    t0 = time.perf_counter()
    if unit < 1 or start < unit:
        raise ValueError(f"need unit >= 1 and start >= unit, got start={start}, unit={unit}")
    cap_k = None if cap is None else cap // unit
    trials: list[dict[str, Any]] = []
    out = SearchResult(best=0, first_fail=None, trials=trials)

    def attempt(k: int) -> bool | None:
        r = trial(k * unit)
        if isinstance(r, bool):
            r = StepResult(fits=r, reason="ok" if r else "budget")
        rec = {"value": k * unit, **r.to_dict()}
        trials.append(rec)
        if progress is not None:
            progress(rec)
        if r.reason == "error":
            out.error = r.error
            return None
        if r.fits:
            out.best_result = rec
        return r.fits

    def late() -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            out.timed_out = True
            return True
        return False

    lo = math.ceil(start / unit)
    if cap_k is not None and lo > cap_k:
        raise ValueError(f"start {start} is above cap {cap}")
    ok = attempt(lo)
    if not ok:
        if ok is False:
            out.first_fail = lo * unit
        out.seconds = time.perf_counter() - t0
        return out
    hi = None
    while hi is None and not late():
        nxt = 2 * lo if cap_k is None else min(2 * lo, cap_k)
        if nxt == lo:
            out.capped = True
            break
        ok = attempt(nxt)
        if ok is None:
            break
        if ok:
            lo = nxt
        else:
            hi = nxt
    while hi is not None and hi - lo > 1 and (hi - lo) > rel_tol * lo and not late():
        mid = (lo + hi) // 2
        ok = attempt(mid)
        if ok is None:
            break
        if ok:
            lo = mid
        else:
            hi = mid
    out.best = lo * unit
    out.first_fail = None if hi is None else hi * unit
    out.seconds = time.perf_counter() - t0
    return out


def max_depth(
    model: str,
    graph: GraphInputs,
    method: Method,
    *,
    hidden_channels: int,
    out_channels: int,
    budget_bytes: int | None,
    start: int = 2,
    cap: int | None = 4096,
    rel_tol: float = 0.0,
    deadline: float | None = None,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    **model_kwargs: Any,
) -> SearchResult:
    """Deepest ``model`` (``"gcn"``, ``"gcnii"``, ``"gat"``) of width ``hidden_channels`` that
    trains on ``graph`` under the budget (see `run_step`)."""

    def trial(depth: int) -> StepResult:
        size = {"num_layers": depth, "hidden_channels": hidden_channels}
        return _step_of(model, graph, method, out_channels, budget_bytes, seed, size, model_kwargs)

    return search_max(
        trial, start=start, unit=1, cap=cap, rel_tol=rel_tol, deadline=deadline, progress=progress
    )


def max_width(
    model: str,
    graph: GraphInputs,
    method: Method,
    *,
    num_layers: int,
    out_channels: int,
    budget_bytes: int | None,
    unit: int = 8,
    start: int = 8,
    cap: int | None = 1 << 16,
    rel_tol: float = 0.0,
    deadline: float | None = None,
    seed: int = 0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    **model_kwargs: Any,
) -> SearchResult:
    """Widest ``model`` (hidden channels, a multiple of ``unit``) with ``num_layers`` layers
    that trains on ``graph`` under the budget (see `run_step`)."""

    def trial(width: int) -> StepResult:
        size = {"num_layers": num_layers, "hidden_channels": width}
        return _step_of(model, graph, method, out_channels, budget_bytes, seed, size, model_kwargs)

    return search_max(
        trial, start=start, unit=unit, cap=cap, rel_tol=rel_tol, deadline=deadline,
        progress=progress,
    )  # fmt: skip


def _step_of(
    model: str,
    graph: GraphInputs,
    method: Method,
    out_channels: int,
    budget_bytes: int | None,
    seed: int,
    size: dict[str, int],
    model_kwargs: dict[str, Any],
) -> StepResult:
    """`run_step` of ``model`` at ``size`` (its depth and width), built from seed ``seed``."""

    def make() -> nn.Module:
        torch.manual_seed(seed)
        return build_model(model, graph.x.shape[1], out_channels, **size, **model_kwargs)

    return run_step(make, graph, method, budget_bytes=budget_bytes)


def gib(x: float) -> int:
    """``x`` GiB in bytes."""
    return int(x * _GIB)


def names(text: str, lower: bool = False) -> list[str]:
    """The names of a comma-separated flag (``"gcn, GAT,"`` -> ``["gcn", "GAT"]``), blanks
    dropped; ``lower``: in lower case."""
    out = [part.strip() for part in text.split(",") if part.strip()]
    return [part.lower() for part in out] if lower else out


def start_run(device: str, threads: int | None) -> torch.device:
    """``torch.device(device)``, after setting torch's CPU threads to ``threads`` when given."""
    if threads:
        torch.set_num_threads(threads)
    return torch.device(device)


def run_env(device: torch.device, **extra: Any) -> dict[str, Any]:
    """Where a benchmark ran, for its JSON: the device's name, torch's version, torch's CPU
    threads, then ``extra``."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    )
    return {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            **extra}  # fmt: skip


def budget_meaning(on_cuda: bool) -> str:
    """What a memory budget limits on this device (see the module docstring)."""
    if on_cuda:
        return "CUDA allocator cap (set_per_process_memory_fraction)"
    return "byte accounting: params + buffers + grads + optimizer state + inputs + saved tensors"


def command_line(argv: list[str] | None) -> str:
    """The command a benchmark's JSON records: ``argv`` when ``main`` was called with it (as
    the tests do), else this process's arguments."""
    return " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


def write_results(path: Path, header: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """``{**header, "results": results}`` as JSON at ``path``, replaced whole (through a
    temporary file): a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**header, "results": results}, indent=1, default=str))
    os.replace(tmp, path)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA stream) before a timer reads the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def subcommand(sub, fn: Callable, name: str | None = None) -> argparse.ArgumentParser:
    """The subcommand ``name`` (default: ``fn``'s name, ``-`` for ``_``) of the subparsers
    ``sub``: it runs ``fn(args)`` and its help is ``fn``'s docstring."""
    doc = inspect.cleandoc(fn.__doc__)
    first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].replace("%", "%%")
    p = sub.add_parser(name or fn.__name__.replace("_", "-"), help=first, description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.set_defaults(func=fn)
    return p


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parse ``argv`` and run the subcommand it names (`subcommand`) with its arguments, where
    ``args.argv`` is ``argv`` (what a JSON records as its command: `command_line`)."""
    args = parser.parse_args(argv)
    func = vars(args).pop("func")  # not a setting: kept out of a JSON of `vars(args)`
    args.argv = argv
    return func(args)
