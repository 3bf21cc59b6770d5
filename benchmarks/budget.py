"""Memory budget: does ``compress_gnn(model, memory_budget=B)`` meet B, at what step time, and
what does each step under it hold? One subcommand per measurement:

    python benchmarks/budget.py table          # small models at 30/10/5 % of stock (CPU)
    python benchmarks/budget.py floors         # what any full-batch step holds, per model
    python benchmarks/budget.py gcnii64        # stock PyG GCNII-64 on 20,000 nodes (CPU)
    python benchmarks/budget.py worst-step     # any step heavier than the planned ones? (CPU)
    python benchmarks/budget.py rss-baseline   # a budget just above fixed 1 bit's worst step
    python benchmarks/budget.py probe-cost     # the sensitivity probe's cost against its bound
    python benchmarks/budget.py products       # GAT at ogbn-products' size under 16 GiB (GPU)

``python benchmarks/budget.py SUBCOMMAND --help`` says what each measures and its flags.
Figures: docs/results/budget.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN2Conv

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    GraphInputs,
    build_model,
    cuda_budget,
    dispatch,
    subcommand,
)
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.budget import BudgetError  # noqa: E402
from gact_graph.budget.profile import LiveBytes, PeakBytes  # noqa: E402
from gact_graph.config import format_bytes, parse_bytes  # noqa: E402
from gact_graph.core.meter import StepMeter  # noqa: E402
from gact_graph.datasets import dataset_info  # noqa: E402

MIB = 2**20

#: ogbn-products' statistics: 100 features, 47 classes, 50.5 directed edges per node
_PRODUCTS = {"features": 100, "classes": 47, "degree": 50.5}
#: model -> (builder name, layers, nodes[, graph statistics]); hidden 64; the statistics
#: default to 16 features, 8 classes and 8 edges per node (`_graph`)
MODELS = {
    "gcn": ("gcn", 3, 8_000),
    "gat": ("gat", 3, 3_000),
    "gcnii": ("gcnii", 8, 4_000),
    "gcnii64": ("gcnii", 64, 1_000),
    # the same model where the graph, not the model's fixed overheads, dominates: 10 % of
    # stock lies above what the fixed settings hold here (on 1,000 nodes no setting reaches it)
    "gcnii64-8k": ("gcnii", 64, 8_000),
    # GAT at ogbn-products' statistics: 100 features, 47 classes, 50.5 directed edges per
    # node (123.7 M / 2.45 M), on 3,000 nodes
    "gat-products": ("gat", 3, 3_000, _PRODUCTS),
    # the other three models on the same statistics: stock PyG's message passing keeps edge-level
    # tensors (E x C per layer) that this library's SpMM never makes, as on the real graphs
    "gcn-products": ("gcn", 3, 8_000, _PRODUCTS),
    "gcnii-products": ("gcnii", 8, 4_000, _PRODUCTS),
    "gcnii64-products": ("gcnii", 64, 1_000, _PRODUCTS),
}
_STATS = {"features": 16, "classes": 8, "degree": 8}
FIXED = [(b, lvl) for lvl in ("L1", "CB1") for b in (1, 2, 4, 8)]


# ------------------------------------------------------------------------------ shared
def _stats(model_key: str) -> dict:
    spec = MODELS[model_key]
    return {**_STATS, **(spec[3] if len(spec) > 3 else {})}


def _graph(n: int, f: int = 16, seed: int = 0, classes: int = 8, degree: float = 8):
    """``n`` nodes, ``degree * n`` random directed edges (the `MODELS` graphs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g)
    ei = torch.randint(0, n, (2, round(degree * n)), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, ei, y


def _model_graph(model_key: str):
    """`MODELS`' model ``model_key`` (built from seed 0) and its graph."""
    name, layers, n = MODELS[model_key][:3]
    st = _stats(model_key)
    x, ei, y = _graph(n, st["features"], classes=st["classes"], degree=st["degree"])
    torch.manual_seed(0)
    model = build_model(name, st["features"], st["classes"], num_layers=layers, hidden_channels=64)
    return model, (x, ei, y)


def graph(n: int, deg: int = 6, feat: int = 16, seed: int = 0):
    """A random graph of ``n`` nodes, ``deg`` edges a node made undirected, 4 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, feat, generator=g)
    ei = torch.randint(0, n, (2, deg * n), generator=g)
    return x, torch.cat([ei, ei.flip(0)], 1), torch.randint(0, 4, (n,), generator=g)


class StockGCNII(torch.nn.Module):
    """Stock PyG GCNII: ``GCN2Conv`` layers (alpha 0.1, theta 0.5) with ``cached=True`` (each
    layer keeps its own normalized graph from the first step on), a ``Linear`` in and out,
    dropout 0.1 before each."""

    def __init__(self, features: int, classes: int, layers: int, width: int) -> None:
        super().__init__()
        self.lin_in = torch.nn.Linear(features, width)
        self.lin_out = torch.nn.Linear(width, classes)
        self.convs = torch.nn.ModuleList(
            GCN2Conv(width, 0.1, 0.5, i + 1, cached=True) for i in range(layers)
        )

    def forward(self, x, ei):
        x0 = h = self.lin_in(F.dropout(x, 0.1, self.training)).relu()
        for conv in self.convs:
            h = conv(F.dropout(h, 0.1, self.training), x0, ei).relu()
        return self.lin_out(F.dropout(h, 0.1, self.training))


def _status(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (0 where absent)."""
    out = dict.fromkeys(fields, 0)
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1]) * 1024
    return out


def _rss(field: str) -> int:
    return _status(field)[field]


def _anonymous(total: str) -> int:
    """``total`` (VmRSS or VmHWM) less the file-backed and shared pages resident now (as the
    planner's CPU meter reads it: libraries' code paged in is no tensor of the step)."""
    st = _status(total, "RssFile", "RssShmem")
    return st[total] - st["RssFile"] - st["RssShmem"]


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _fresh(argv: list[str], **env: str) -> tuple[dict | None, str]:
    """This script with ``argv`` in a fresh process (``env`` added to the environment): the JSON
    of its line ``RESULT ...``, or None and what the process printed last."""
    p = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                       env=dict(os.environ, **env), cwd=ROOT)  # fmt: skip
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), ""
    return None, p.stderr or p.stdout


def _mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def _counted_step(model, ctl, g, opt, table) -> int:
    """One Adam step on ``g`` = ``(x, edge_index, y)`` with ``ctl.iterate()``: the peak of
    tensor bytes it creates (`PeakBytes` over ``table``)."""
    x, ei, y = g
    with PeakBytes(table) as counter:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        opt.step()
        ctl.iterate()
    return counter.peak


def counted_steps(model, ctl, graph, steps: int, lr: float = 1e-3, counted=None) -> list[int]:
    """Train ``model`` (compressed by ``ctl``) ``steps`` Adam steps on ``graph`` = ``(x,
    edge_index, y)``: each step's peak in counted tensor bytes, what the planner's counted
    meter sees (parameters, ``x`` and ``edge_index``, and what earlier steps left alive:
    `PeakBytes` around the whole step, ``ctl.iterate()`` included). Appended to ``counted``
    (a new list by default) as each step ends, so a step that raises leaves the earlier ones."""
    x, ei, _ = graph
    static = sum(p.untyped_storage().nbytes() for p in model.parameters())
    static += sum(t.untyped_storage().nbytes() for t in (x, ei))
    opt = torch.optim.Adam(model.parameters(), lr)
    table, counted = {}, [] if counted is None else counted
    for _ in range(steps):
        counted.append(static + _counted_step(model, ctl, graph, opt, table))
    return counted


# ------------------------------------------------------------------------------ table
def _tensors_alive(before=()):
    """Every CPU tensor reachable from Python now, one per storage, and their bytes (between
    two steps that is everything a step starts with: parameters, optimizer state, inputs,
    cached adjacency); storages of ``before`` (the baseline's) left out."""
    from torch.multiprocessing.reductions import StorageWeakRef

    gc.collect()
    seen = {StorageWeakRef(t.untyped_storage()).cdata: (t, 0) for t in before}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
            continue
        if obj.device.type != "cpu":
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen.setdefault(StorageWeakRef(storage).cdata, (obj, storage.nbytes()))
    return [t for t, n in seen.values() if n], sum(n for _, n in seen.values())


def _train(model_key: str, setting: dict | None, n: int, steps: int, count: bool = False) -> dict:
    """One run of `table` in this process (a fresh one: see `table`)."""
    before = []  # count: the tensors alive at the baseline (kept alive, so never re-used)
    name, layers = MODELS[model_key][:2]
    stats = _stats(model_key)

    def one_run(nodes, layers, setting, steps, record):
        x, ei, y = _graph(nodes, stats["features"], classes=stats["classes"],
                          degree=stats["degree"])  # fmt: skip
        torch.manual_seed(0)
        model = build_model(name, stats["features"], stats["classes"], num_layers=layers,
                            hidden_channels=64)  # fmt: skip
        ctl = compress_gnn(model, **setting) if setting is not None else None
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        peaks, times, probed, starts = [], [], [], []
        counted = []  # count=True: each step's peak of tensor bytes (what existed + created)
        adapter = getattr(ctl, "adapter", None)
        try:
            for _ in range(steps):
                seen = getattr(adapter, "n_estimates", 0)
                meter = None
                if count:
                    opt.zero_grad(set_to_none=True)  # the step's own first act, not counted
                    held, held_bytes = _tensors_alive(before)
                    meter = LiveBytes(exclude=held + before)
                    del held
                    meter.__enter__()
                _reset_hwm()
                starts.append(_rss("VmRSS") - record)
                t0 = time.perf_counter()
                try:
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x, ei), y).backward()
                    opt.step()
                    if ctl is not None:
                        ctl.iterate()
                finally:
                    if meter is not None:
                        meter.__exit__(None, None, None)
                times.append(time.perf_counter() - t0)
                peaks.append(_rss("VmHWM") - record)
                probed.append(getattr(adapter, "n_estimates", 0) != seen)
                if meter is not None:
                    counted.append(held_bytes + meter.peak)
        finally:
            extra = {}
            if ctl is not None and getattr(ctl, "budget", None) is not None:
                st = ctl.budget.plan_state
                if st is not None:
                    extra = {
                        "predicted": st.predicted,
                        "choices": {n: o.label for n, o in st.plan.choice.items()},
                        "solver": st.plan.solver,
                    }
            if ctl is not None:
                ctl.remove()
        if count:
            extra["counted"] = counted
        return peaks, times, probed, starts, extra

    warm = {"bits": 1, "adaptive": False, "opt_level": "CB1"}
    for s in (warm, None, setting):  # libraries, thread pools, kernels: before the baseline
        try:
            one_run(256, min(layers, 3), s, 2, 0)
        except BudgetError:
            pass
    gc.collect()
    base = _rss("VmRSS")
    if count:  # the tensors of the baseline are not the run's, as in the resident set
        before.extend(_tensors_alive()[0])
    out = {"model": model_key, "setting": setting, "nodes": n}
    try:
        peaks, times, probed, starts, extra = one_run(n, layers, setting, steps, base)
    except BudgetError as exc:
        out.update(error=str(exc), least_budget=exc.least_budget, exact=exc.exact)
        return out
    out.update(peaks=peaks, starts=starts, times=times, probed=probed, peak=max(peaks))
    out["extra"] = extra
    # steady: steps after the first (the planner's profile step) without a sensitivity probe;
    # mean: every step after the first, probes included (what a run of this length pays)
    steady = [t for i, (t, p) in enumerate(zip(times, probed)) if i >= 1 and not p]
    out["step_time"] = statistics.median(steady or times[1:] or times)
    out["mean_time"] = statistics.fmean(times[1:] or times)
    return out


def floor_bytes(model_key: str) -> dict[str, int]:
    """What any full-batch training step of ``model_key`` holds whatever is compressed: its
    inputs, the adjacency (CSR with self-loops: int64 row pointers, int32 columns, fp32
    weights), the parameters with their gradients and two Adam states, and one layer's input
    and output in fp32 at the moment it computes (GCNII also its initial residual ``x0``)."""
    name, _, n = MODELS[model_key][:3]
    model, (x, ei, y) = _model_graph(model_key)
    width = 64 * (3 if name == "gat" else 1)  # GAT: 3 heads of 64
    act = n * width * 4
    out = {
        "inputs": sum(t.numel() * t.element_size() for t in (x, ei, y)),
        "adjacency": (n + 1) * 8 + (ei.size(1) + n) * 8,
        "parameters x 4": 4 * sum(p.numel() * p.element_size() for p in model.parameters()),
        "one layer in + out": 2 * act + (act if name == "gcnii" else 0),
    }
    out["floor"] = sum(out.values())
    return out


def _run(model: str, setting: dict | None, steps: int, count: bool = False) -> dict:
    argv = ["table", "--child", "--model", model, "--setting", json.dumps(setting),
            "--steps", str(steps)] + (["--count"] if count else [])  # fmt: skip
    res, err = _fresh(argv, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    return res if res is not None else {"model": model, "setting": setting, "error": err[-2000:]}


def _counted(model: str, setting: dict, steps: int) -> int | None:
    """The run of ``setting`` again in a fresh process with every op's outputs counted
    (`gact_graph.budget.profile.LiveBytes` around each step, on top of the tensors alive
    when it starts): its worst step's peak of tensor bytes (None where it failed)."""
    res = _run(model, setting, steps, count=True)
    counted = res.get("extra", {}).get("counted")
    return max(counted) if counted else None


def _within(counted: int | None, budget: int) -> bool:
    return counted is not None and counted <= budget


def table(args) -> None:
    """The small models' table: stock, fixed settings and the planner at 30/10/5 % of stock.

    For each model (GCN, GAT, GCNII, 64-layer GCNII on a small synthetic graph) every run is a
    fresh process with ``MALLOC_MMAP_THRESHOLD_`` set low, so that the resident set follows live
    bytes; it first warms up (one compressed and one stock step of a tiny model: libraries,
    thread pools), then takes its baseline RSS, builds graph and model, and trains ``--steps``
    steps. A run's *peak* is the largest resident set above that baseline over **every** step
    (the planner's profile step included); its *step time* is the median of the steps after the
    first two.

    Each planner run that trains (and each rerun at a named budget that is admitted) runs
    again in a fresh process with its tensor bytes counted: before every step the tensors
    alive (parameters, optimizer state, inputs, the cached adjacency; found through ``gc``),
    plus the peak of what the step creates and still holds, counted at every op
    (`gact_graph.budget.profile.LiveBytes`). That is the byte accounting next to the resident
    set, and the figure a GPU's ``max_memory_allocated`` follows; it is the worst step's. A
    budget is *met* when both the resident set and the counted bytes stay within it in every
    step.

    - stock: no compression; its peak sets the budgets (``--fractions``, default 30/10/5 %);
    - brute force: fixed ``bits`` in {1, 2, 4, 8} x ``opt_level`` in {L1, CB1}
      (``adaptive=False``; L2 only on CUDA, so not here);
    - side by side: where the planner trains and a fixed setting fits, ``--pairs`` (2) further
      runs of each, alternating planner and fastest fitting fixed setting; the step times
      compared are the medians over the three runs of each, the planner's peak is its worst
      step over all three;
    - planner: ``memory_budget=B`` with the defaults (adaptive sensitivities, 2-bit
      reference); where it refuses B naming a budget it admits (``BudgetError.least_budget``,
      ``exact=True``), a further run at that budget checks that it is admitted and met.

    Prints a table and writes JSON (``--json``). CPU only."""
    if args.child:
        torch.set_num_threads(1)
        setting = json.loads(args.setting)
        res = _train(args.model, setting, MODELS[args.model][2], args.steps, count=args.count)
        print("RESULT " + json.dumps(res))
        return
    results = []
    print(
        f"{'model':<8} {'budget':>6} {'B MiB':>7} | {'planner MiB':>11} {'bytes MiB':>9} "
        f"{'pred MiB':>8} "
        f"{'met':>4} {'steady':>7} {'mean':>7} | {'fastest fitting fixed':<22} {'steady':>7} "
        f"{'mean':>7} | {'ratio steady':>12} {'ratio mean':>10}"
    )
    for model in args.models:
        stock = _run(model, None, args.steps)
        settings = {f"{b}-bit {lvl}": {"bits": b, "adaptive": False, "opt_level": lvl}
                    for b, lvl in FIXED}  # fmt: skip
        fixed = {k: _run(model, v, args.steps) for k, v in settings.items()}
        row = {"model": model, "stock": stock, "fixed": fixed, "budgets": []}
        if "peak" not in stock:
            print(f"{model}: stock failed: {stock.get('error')}")
            results.append(row)
            continue
        print(
            f"{model:<8} stock peak {_mib(stock['peak'])} MiB, {1e3 * stock['step_time']:.1f} ms; "
            + ", ".join(
                f"{k} {_mib(v.get('peak'))} MiB {1e3 * v.get('step_time', 0):.0f} ms"
                for k, v in fixed.items()
            )
        )
        for frac in args.fractions:
            budget = int(frac * stock["peak"])
            extra_setting = json.loads(args.planner_setting)
            mine = {"memory_budget": budget, **extra_setting}
            plan = _run(model, mine, args.steps)
            fits = {k: v for k, v in fixed.items() if "peak" in v and v["peak"] <= budget}
            best = min(fits, key=lambda k: fits[k]["step_time"]) if fits else None
            entry = {"fraction": frac, "budget": budget, "planner": plan, "fastest_fixed": best}
            planner_runs, fixed_runs = [plan], [fits[best]] if best else []
            if "peak" in plan and best:  # side by side: alternating fresh processes
                for _ in range(args.pairs):
                    planner_runs.append(_run(model, mine, args.steps))
                    fixed_runs.append(_run(model, settings[best], args.steps))
                entry["repeats"] = {"planner": planner_runs[1:], "fixed": fixed_runs[1:]}
            if "peak" in plan:  # again, counting tensor bytes at every op (slower)
                entry["counted"] = _counted(model, mine, args.steps)
            if plan.get("exact"):  # refused naming a figure it admits: admitted and met?
                at_named = {"memory_budget": plan["least_budget"], **extra_setting}
                entry["at_named"] = _run(model, at_named, args.steps)
                if "peak" in entry["at_named"]:
                    entry["at_named_counted"] = _counted(model, at_named, args.steps)
            row["budgets"].append(entry)
            counted = entry.get("counted")
            trained = "peak" in plan and all("peak" in r for r in planner_runs)
            peak = max(r["peak"] for r in planner_runs) if trained else None
            entry["peak"] = peak  # the worst step of every planner run of this row
            met = trained and peak <= budget and _within(counted, budget)
            ms = {}
            for key in ("step_time", "mean_time"):  # medians over the runs
                p = 1e3 * statistics.median(r[key] for r in planner_runs) if trained else None
                timed = [r[key] for r in fixed_runs if "peak" in r]
                b = 1e3 * statistics.median(timed) if timed else None
                ms[key] = (p, b, p / b if p and b else None)
            entry["ratio"] = ms["step_time"][2]
            entry["ratio_mean"] = ms["mean_time"][2]
            pred = plan.get("extra", {}).get("predicted")

            def f(v, spec=".1f"):
                return "-" if v is None else format(v, spec)

            print(
                f"{model:<8} {frac:>6.0%} {_mib(budget):>7} | "
                f"{_mib(peak) if trained else 'error':>11} "
                f"{_mib(counted):>9} {_mib(pred):>8} "
                f"{('yes' if met else 'NO'):>4} {f(ms['step_time'][0]):>7} "
                f"{f(ms['mean_time'][0]):>7} | {best or 'none fits':<22} "
                f"{f(ms['step_time'][1]):>7} {f(ms['mean_time'][1]):>7} | "
                f"{f(ms['step_time'][2], '.2f'):>12} {f(ms['mean_time'][2], '.2f'):>10}"
            )
            if "error" in plan:
                lines = plan["error"].strip().splitlines() or [""]
                print(f"         planner: {lines[-1][-400:]}")
                again = entry.get("at_named")
                if again is not None:
                    named = plan["least_budget"]
                    if "peak" in again:
                        both = entry.get("at_named_counted")
                        ok = again["peak"] <= named and _within(both, named)
                        said = (
                            f"admitted, every step at most {_mib(again['peak'])} MiB, "
                            f"{_mib(both)} MiB of tensors: {'met' if ok else 'NOT met'}"
                        )
                    else:
                        said = "REFUSED: " + again.get("error", "")[:200]
                    print(f"         at the named {_mib(named)} MiB: {said}")
            else:
                probes = [i for i, p in enumerate(plan["probed"]) if p]
                times = " ".join(f"{1e3 * t:.0f}" for t in plan["times"])
                peaks = " ".join(_mib(p) for p in plan["peaks"])
                print(f"         planner per step ms: {times}; probe steps {probes}")
                print(f"         planner per step peak MiB: {peaks}")
                if len(planner_runs) > 1:

                    def steadies(runs):
                        return " ".join(f"{1e3 * r['step_time']:.0f}" for r in runs if "peak" in r)

                    worst = " ".join(_mib(r.get("peak")) for r in planner_runs)
                    print(
                        f"         {len(planner_runs)} runs each, alternating: planner steady "
                        f"{steadies(planner_runs)} ms (worst steps {worst} MiB), {best} "
                        f"{steadies(fixed_runs)} ms"
                    )
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def floors(args) -> None:
    """What any full-batch step of each `MODELS` model holds whatever is compressed
    (`floor_bytes`)."""
    for model in args.models:
        parts = floor_bytes(model)
        text = ", ".join(f"{k} {v / MIB:.2f}" for k, v in parts.items())
        print(f"{model:<8} {text} MiB")


# ------------------------------------------------------------------------------ gcnii64
def _gcnii64_child(nodes: int, edges: int, steps: int, setting: dict | None) -> dict:
    from torch_geometric.utils import to_undirected

    g = torch.Generator().manual_seed(0)
    x = torch.randn(nodes, 64, generator=g)
    ei = to_undirected(torch.randint(0, nodes, (2, edges), generator=g), num_nodes=nodes)
    y = torch.randint(0, 8, (nodes,), generator=g)
    torch.manual_seed(0)
    model = StockGCNII(64, 8, 64, 64)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    out: dict = {"setting": setting, "edges": int(ei.size(1))}
    try:
        ctl = compress_gnn(model, **setting) if setting is not None else None
        peaks, times = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                _reset_hwm()
                start = _anonymous("VmRSS")
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, ei), y).backward()
                opt.step()
                if ctl is not None:
                    ctl.iterate()
                times.append(time.perf_counter() - t0)
                peaks.append(_anonymous("VmHWM") - start)
    except BudgetError as exc:
        out.update(refused=True, least_budget=exc.least_budget, exact=exc.exact,
                   message=str(exc)[:600])  # fmt: skip
        return out
    out.update(peaks=peaks, times=times)
    planner = getattr(ctl, "budget", None) if ctl is not None else None
    if planner is not None:
        out["history"] = [[h["phase"], h["meter"], h["measured"]] for h in planner.history]
        out["budget"] = planner.budget
        st = planner.plan_state
        out["relaxed"] = st.relaxed
        out["predicted"] = st.predicted
        out["least_budget"] = st.least_budget
    return out


def _gcnii64_run(args, setting: dict | None) -> dict:
    argv = ["gcnii64", "--child", json.dumps(setting), "--nodes", str(args.nodes),
            "--edges", str(args.edges), "--steps", str(args.steps)]  # fmt: skip
    res, err = _fresh(argv, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads),
                      PYTHONPATH=str(ROOT))  # fmt: skip
    if res is None:
        raise RuntimeError(err[-3000:])
    name = json.dumps(res["setting"])
    if res.get("refused"):
        text = f"{name:<48} refused, naming {_mib(res['least_budget'])} MiB (exact={res['exact']})"
    else:
        text = f"{name:<48} worst {_mib(max(res['peaks'])):>8} MiB; steps " + " ".join(
            _mib(p) for p in res["peaks"]
        )
        if "history" in res:
            text += "\n    planner's meter: " + " ".join(
                f"{h[0][:4]} {_mib(h[2])}" for h in res["history"]
            )
    print(text, flush=True)
    return res


def gcnii64(args) -> None:
    """Stock PyG GCNII-64 over 20,000 nodes: the case where the profile step once was the
    heaviest step (a budget 5x above what fixed 2 bits needs was refused).

    Stock PyG GCNII: 64 ``GCN2Conv`` layers x 64 (alpha 0.1, theta 0.5, ``cached=True``), a
    ``Linear`` in and out, dropout 0.1; a random graph of 20,000 nodes and 100,000 edges made
    undirected, 64 features, 8 classes, Adam. Every setting runs in a fresh process with
    ``MALLOC_MMAP_THRESHOLD_=65536`` (the resident set follows live bytes) and ``--threads``
    threads. A step's peak is the anonymous resident set's high-water mark (file-backed pages
    left out) above the step's start (``/proc/self/clear_refs`` reset before it); a run's
    figure is its worst step. Planner runs also print what the planner's own meter judged per
    step (resident set above the process before training).

    Settings: stock; fixed 2 bits and fixed 1 bit (``adaptive=False``, L1); the default mode
    (``compress_gnn(model)``); ``memory_budget`` at ``--fraction`` of stock's worst step, and
    where that is refused, a rerun at the named figure (``BudgetError.least_budget``).

    Prints a table and the verdicts: the profile step's peak over fixed 1 bit's (target <=
    1.2x), whether the budget was admitted and met in every step (by the planner's meter and
    by the resident set above each step's start)."""
    if args.child is not None:
        res = _gcnii64_child(args.nodes, args.edges, args.steps, json.loads(args.child))
        print("RESULT " + json.dumps(res))
        return
    runs = {}
    if not args.only_budget:
        runs["stock"] = _gcnii64_run(args, None)
        runs["fixed2"] = _gcnii64_run(args, {"bits": 2, "adaptive": False})
        runs["fixed1"] = _gcnii64_run(args, {"bits": 1, "adaptive": False})
        runs["default"] = _gcnii64_run(args, {})
    if args.budget_mib is not None:
        budget = int(args.budget_mib * MIB)
    else:
        budget = int(args.fraction * max(runs["stock"]["peaks"]))
    runs["budget"] = _gcnii64_run(args, {"memory_budget": budget})
    if runs["budget"].get("refused"):
        runs["rerun"] = _gcnii64_run(args, {"memory_budget": runs["budget"]["least_budget"]})
    fixed1 = max(runs["fixed1"]["peaks"]) if "fixed1" in runs else None
    print(f"\nbudget {_mib(budget)} MiB")
    for key in ("budget", "rerun"):
        r = runs.get(key)
        if r is None or r.get("refused"):
            continue
        b = r["budget"]
        by_meter = all(m is not None and m <= b for _, _, m in r["history"])
        by_step = max(r["peaks"]) <= b
        print(
            f"{key}: admitted at {_mib(b)} MiB ({r['relaxed'] or 'within the accuracy bound'}); "
            f"profile step {_mib(r['peaks'][0])} MiB"
            + (
                ""
                if fixed1 is None
                else f" = {r['peaks'][0] / fixed1:.2f}x fixed 1 bit's worst ({_mib(fixed1)})"
            )
            + f"; met in every step: planner's meter {by_meter}, "
            f"resident set above each step's start {by_step}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


# ------------------------------------------------------------------------------ worst-step
def run_counted(model_key: str, steps: int, **kw) -> dict:
    """`MODELS`' ``model_key`` under ``compress_gnn(**kw)`` for ``steps`` steps: each step
    counted (`counted_steps`) and by the planner's meter, and the worst step over the planned
    steps by both."""
    model, g = _model_graph(model_key)
    ctl = compress_gnn(model, **kw)
    counted: list[int] = []
    out: dict = {"setting": dict(kw)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counted_steps(model, ctl, g, steps, counted=counted)
    except BudgetError as e:
        out.update(refused=str(e), least=e.least_budget)
    out["counted"] = counted
    planner = getattr(ctl, "budget", None)
    if planner is not None:
        hist = planner.history
        probe = [h.get("probe", False) for h in hist]  # (older checkouts record none)
        out["steps"] = [[h["phase"], p, h["meter"], h["measured"]] for h, p in zip(hist, probe)]
        at = [i for i, h in enumerate(hist) if h["phase"] == "planned" and not probe[i]]
        every = [h["measured"] for h in hist if h["measured"] is not None]
        if at and every:
            out["worst_over_planned"] = max(every) / max(hist[i]["measured"] for i in at)
            out["worst_over_planned_counted"] = max(counted) / max(counted[i] for i in at)
    ctl.remove()
    return out


def worst_step(args) -> None:
    """The CPU proxy of the GPU row "worst step <= the planned steps + 5 %": under
    ``memory_budget=``, is any step (the profile step, the step the sensitivity probe runs
    in, a re-planning step) heavier than the planned steps? And does the profile step hold no
    more than a fixed 1-bit step?

    One process (run it with and without ``MALLOC_MMAP_THRESHOLD_``: the planner's meter is
    the anonymous resident set with it, counted tensor bytes without). The model is one of
    `MODELS` (default its GAT: 3 layers, 3 heads x 64, 3,000 nodes, 8 edges a node, 16
    features). It trains fixed 1 bit (``adaptive=False``) for ``--steps`` steps, then
    ``memory_budget=`` at each ``--budget-mib`` and at ``--above`` (default 0.5 %) over fixed
    1 bit's worst step, each for ``--steps`` steps. Every step is measured by the planner's
    meter (its history) and by an independent count of tensor bytes (`counted_steps`)."""
    torch.set_num_threads(1)
    fixed1 = run_counted(args.model, args.steps, bits=1, adaptive=False)
    runs = {"fixed1": fixed1}
    budgets = [int(b * MIB) for b in args.budget_mib]
    budgets.append(int(max(fixed1["counted"]) * (1 + args.above)))
    for b in budgets:
        runs[f"budget {b / MIB:.2f} MiB"] = run_counted(args.model, args.steps, memory_budget=b)
    for key, r in runs.items():
        line = f"{key}: counted MiB " + " ".join(f"{c / MIB:.2f}" for c in r["counted"])
        if r.get("steps"):
            line += "\n    planner " + " ".join(
                f"{p[0][:2]}{'+probe' if p[1] else ''}:{p[3] / MIB:.2f}" for p in r["steps"]
            )
            line += f" ({r['steps'][0][2]})"
        if "worst_over_planned" in r:
            line += (
                f"\n    worst step / planned steps: {r['worst_over_planned']:.3f} (planner's "
                f"meter), {r['worst_over_planned_counted']:.3f} (counted)"
            )
        if "refused" in r:
            line += f"\n    refused: {r['refused'][:300]}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


# ------------------------------------------------------------------------------ rss-baseline
def _rss_run(steps: int, **kw):
    torch.manual_seed(0)
    model = StockGCNII(16, 4, 24, 32)
    x, ei, y = graph(1500)
    static = sum(p.untyped_storage().nbytes() for p in model.parameters())
    static += sum(t.untyped_storage().nbytes() for t in (x, ei))
    ctl = compress_gnn(model, **kw)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    meter, base, out = StepMeter(torch.device("cpu")), None, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            meter.begin()
            if base is None:  # as the planner: what the process held before training
                base = meter.start - static
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x, ei), y).backward()
            opt.step()
            ctl.iterate()
            out.append(meter.peak() - base)
    planner = getattr(ctl, "budget", None)
    ctl.remove()
    return out, planner


def rss_baseline(args) -> None:
    """A budget just above fixed 1 bit's worst step, with fixed 1 bit measured by the
    planner's own resident-set meter (`StepMeter`: the anonymous resident set above the
    process before training) rather than counted: GCNII-24 x 32 on 1,500 nodes
    (`tests/budget/test_rerun.py`'s `_counted_steps` model), one process. Run it with
    ``MALLOC_MMAP_THRESHOLD_`` set (the planner's meter is then the resident set); prints fixed
    1 bit's steps and, at each factor over its worst step, the planner's steps or its
    refusal."""
    torch.set_num_threads(1)
    _rss_run(1, bits=1, adaptive=False)  # warm-up: what a process's first step sets up once
    fixed1, _ = _rss_run(4, bits=1, adaptive=False)
    print("fixed 1 bit, MiB:", " ".join(f"{v / MIB:.3f}" for v in fixed1))
    for f in args.factors:
        budget = int(max(fixed1) * f)
        planner = None  # the previous run's model and planner: freed before this one starts
        gc.collect()
        try:
            _, planner = _rss_run(5, memory_budget=budget)
        except BudgetError as e:
            print(f"x{f} ({budget / MIB:.3f} MiB): refused, naming {e.least_budget / MIB:.2f} MiB")
            continue
        steps = " ".join(f"{h['phase'][:2]}:{h['measured'] / MIB:.3f}" for h in planner.history)
        print(f"x{f} ({budget / MIB:.3f} MiB): {steps} ({planner.meter})")


# ------------------------------------------------------------------------------ probe-cost
def make(name: str):
    """The models of `probe_cost` (3 layers of 64, from seed 0; ``sage_<act>``: PyG's
    GraphSAGE with that activation)."""
    from gact_graph.models import build_model as build

    torch.manual_seed(0)
    kw = {"hidden_channels": 64, "num_layers": 3, "dropout": 0.0}
    if name == "sage" or name.startswith("sage_"):
        from torch_geometric.nn.models import GraphSAGE

        return GraphSAGE(16, 64, 3, 4, act=name.partition("_")[2] or "relu")
    if name == "gcn_bn":
        return build("gcn", 16, 4, batch_norm=True, **kw)
    if name == "gat":
        return build("gat", 16, 4, heads=3, **kw)
    if name == "gatv2":
        return build("gatv2", 16, 4, heads=3, **{**kw, "hidden_channels": 32})
    if name == "gcnii":
        return build("gcnii", 16, 4, **{**kw, "num_layers": 4})
    return build(name, 16, 4, **kw)


def _hold_probe(ctl) -> None:
    """Hold the adapter's probe back until `_arm_probe`."""
    adapter = ctl.adapter
    adapter.next_estimate = sys.maxsize
    adapter.detach()


def _arm_probe(ctl) -> None:
    adapter = ctl.adapter
    adapter.next_estimate = ctl.step
    adapter.attach(ctl)
    adapter.next_estimate = ctl.step + 1


def measured(name: str, n: int) -> int:
    """What the probe adds to a step of ``make(name)`` at 2 bits on ``graph(n)``: the fourth
    step's counted peak (the probe armed) less the third's (the same plan)."""
    model, g = make(name), graph(n)
    ctl = compress_gnn(model, bits=2)
    _hold_probe(ctl)
    opt, table, peaks = torch.optim.Adam(model.parameters(), 1e-3), {}, []
    for s in range(4):
        if s == 3:
            _arm_probe(ctl)
        peaks.append(_counted_step(model, ctl, g, opt, table))
    ctl.remove()
    return peaks[3] - peaks[2]


def _profiled(name: str, n: int):
    """``make(name)`` after the planner's profile step (``memory_budget="4GiB"``) on
    ``graph(n)``: ``(model, ctl)``; the caller removes ``ctl``."""
    model, g = make(name), graph(n)
    ctl = compress_gnn(model, bits=2, memory_budget="4GiB")
    _counted_step(model, ctl, g, torch.optim.Adam(model.parameters(), 1e-3), {})
    return model, ctl


def bounds(name: str, n: int) -> tuple[int, int]:
    """The planner's bound of the probe's cost and the bound from shapes alone."""
    model, ctl = _profiled(name, n)
    planner = ctl.budget
    need = next(iter(planner._profile_inputs.values())).probe_need
    largest = max(t.orig_bytes for t in planner._records())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ctl.remove()
    return need, planner.PROBE_ACTIVATIONS * largest + params


def profile_records(name: str, n: int) -> tuple[int, list, tuple]:
    """The profile step's peak, its `BackwardReads` node records (``memory_budget``) and
    `probe_terms` of them (the forward's term, per node its read's and its walk's)."""
    from gact_graph.budget.probe_cost import probe_terms

    model, ctl = _profiled(name, n)
    planner = ctl.budget
    peak, nodes = planner._reads_peak, list(planner._reads.nodes)
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    terms = probe_terms(planner._reads, step_peak=peak, param_bytes=params)
    ctl.remove()
    return peak, nodes, terms


def replay_rises(name: str, n: int) -> list[tuple[str, int, int]]:
    """In the probed step of `measured`'s schedule: per replay, the node's name, the bytes
    live when it began and how far they rose during it (its differences included)."""
    from gact_graph.policy.sensitivity import SensitivityProbe

    model, (x, ei, y) = make(name), graph(n)
    ctl = compress_gnn(model, bits=2)
    _hold_probe(ctl)
    opt, out, live = torch.optim.Adam(model.parameters(), 1e-3), [], None
    probe = SensitivityProbe._probe

    def spy(self, node, *args, **kw):
        live._sweep()
        start = live.mark()
        try:
            return probe(self, node, *args, **kw)
        finally:
            out.append((type(node).__name__, start, live.since_mark() - start))

    SensitivityProbe._probe = spy
    try:
        for s in range(4):
            if s == 3:
                _arm_probe(ctl)
            out.clear()
            with LiveBytes() as live:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, ei), y).backward()
                opt.step()
                ctl.iterate()
    finally:
        SensitivityProbe._probe = probe
        ctl.remove()
    return out


def _replays(specs: list[str]) -> None:
    for spec in specs:
        name, n = spec.split(":")
        peak, nodes, (forward, terms) = profile_records(name, int(n))
        print(f"{name} {n}: profile step peak {peak / MIB:.3f} MiB (1 bit); nodes reading "
              "a compressed tensor in backward, MiB; then the bound's terms over the peak "
              "(probe_terms: at the node's read, in the walk from it):")  # fmt: skip

        def mib(v):
            return "-" if v is None else f"{v / MIB:.3f}"

        for rec, (read, walk) in zip(nodes, terms):
            reads = ", ".join(f"{r / MIB:.3f}" for r in rec.replayed) or "-"
            print(f"  live {rec.live / MIB:7.3f}  rise {rec.rise / MIB:7.3f} (own {mib(rec.own)})"
                  f"  stated lean {mib(rec.lean)}, in the walk {mib(rec.walk)}"
                  f"  replays {reads}  | terms {mib(read)}, {mib(walk)}")  # fmt: skip
        print(f"  the forward's term (work at a pack) {mib(forward)}")
        print("  probed step (2 bits), per replay: live when it began, rise during it, MiB:")
        for node, start, rise in replay_rises(name, int(n)):
            print(f"  {node:32s} {start / MIB:7.3f} {rise / MIB:7.3f}", flush=True)


def probe_cost(args) -> None:
    """What the adaptive allocator's sensitivity probe adds to a step, counted, against the
    budget planner's bound for it (`gact_graph.budget.probe_cost`) and the bound from shapes
    alone (six fp32 copies of the largest saved tensor plus the parameters).

    Measured: ``compress_gnn(model, bits=2)`` with the probe held back for three steps, then
    armed for the fourth; the probe's cost is the fourth step's counted peak (`PeakBytes`) less
    the third's (the same plan). Bound: the planner's, after its profile step on the same model
    and graph (``memory_budget="4GiB"``). CPU only (the bound from the profile step's counted
    reads). Models are ``NAME:NODES`` (`make`).

    With ``--replays``: per model, the profile step's records of the nodes that read a
    compressed tensor in backward (`BackwardReads`: MiB live at the first read, the rise after
    it and the node's own part of it, the bounds its Function states of its lean backward in a
    replay and in the walk where it states them, the reads a replay dequantizes; then the
    bound's terms over the profile step's peak at the node's read and in the walk from it,
    `probe_terms`: which one sets the bound) and, in the probed step, what was live when each
    replay began and how far the live bytes rose during it (`LiveBytes` around the step):
    where the bound's slack lies."""
    warnings.simplefilter("ignore")
    if args.replays:
        _replays(args.specs or ["gat:3000", "gatv2:2000"])
        return
    specs = args.specs or ["gcn:3000", "gcn_bn:3000", "sage:3000", "gcnii:600", "gcnii:1500",
                           "gat:1500", "gat:3000", "gatv2:2000"]  # fmt: skip
    print("model    nodes | probe adds MiB | bound MiB (x) | from shapes MiB (x)")
    for spec in specs:
        name, n = spec.split(":")
        extra = measured(name, int(n))
        need, shapes = bounds(name, int(n))
        ratio = need / extra if extra > 0 else float("inf")
        print(
            f"{name:8s} {int(n):5d} | {extra / MIB:14.3f} | {need / MIB:7.3f} ({ratio:5.1f}) "
            f"| {shapes / MIB:7.2f} ({shapes / max(extra, 1):5.1f})",
            flush=True,
        )


# ------------------------------------------------------------------------------ products
PRODUCTS = dataset_info("ogbn-products")


def fast_graph(num_nodes: int, device: torch.device, seed: int = 0) -> GraphInputs:
    """Uniform random graph with products' size per node, made on ``device``: both directions
    of products' undirected edge count per node of random pairs, 100 features, 47 classes, 8%
    train."""
    g = torch.Generator(device=device).manual_seed(seed)
    pairs = round(PRODUCTS.num_edges / PRODUCTS.num_nodes * num_nodes)
    src = torch.randint(0, num_nodes, (pairs,), device=device, generator=g)
    dst = torch.randint(0, num_nodes, (pairs,), device=device, generator=g)
    edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
    del src, dst
    return GraphInputs(
        x=torch.randn(num_nodes, PRODUCTS.num_features, device=device, generator=g),
        edge_index=edge_index,
        y=torch.randint(0, PRODUCTS.num_classes, (num_nodes,), device=device, generator=g),
        train_mask=torch.rand(num_nodes, device=device, generator=g) < 0.08,
    )


def _products_attempt(graph, hidden: int, budget: int, steps: int, device: torch.device) -> dict:
    """Train the products GAT at ``hidden`` per head for ``steps`` steps under ``budget``."""
    cuda = device.type == "cuda"
    out: dict = {"hidden_per_head": hidden, "steps": []}
    torch.manual_seed(0)
    model = build_model("gat", PRODUCTS.num_features, PRODUCTS.num_classes, num_layers=3,
                        hidden_channels=hidden).to(device)  # fmt: skip
    out["parameters"] = sum(p.numel() for p in model.parameters())
    ctl = compress_gnn(model, memory_budget=budget)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    mask = graph.train_mask
    try:
        for i in range(steps):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(graph.x, graph.edge_index)
            loss = F.cross_entropy(logits[mask], graph.y[mask])
            del logits
            loss.backward()
            opt.step()
            ctl.iterate()
            peak = None
            if cuda:
                torch.cuda.synchronize(device)
                peak = int(torch.cuda.max_memory_allocated(device))
            secs = time.perf_counter() - t0
            h = ctl.budget.history[-1] if ctl.budget.history else {}
            row = {"step": i, "phase": h.get("phase"), "peak": peak, "seconds": secs,
                   "predicted": h.get("predicted"), "measured": h.get("measured"),
                   "loss": loss.item()}  # fmt: skip
            out["steps"].append(row)
            print(f"  hidden {hidden}: step {i} {row['phase']}: peak "
                  f"{'-' if peak is None else format_bytes(peak)}, predicted "
                  f"{'-' if row['predicted'] is None else format_bytes(row['predicted'])}, "
                  f"{secs:.2f} s, loss {row['loss']:.4f}", flush=True)  # fmt: skip
        out["outcome"] = "trained"
        out["report"] = ctl.report()
    except BudgetError as exc:
        out["outcome"] = "BudgetError"
        out["least_budget"] = exc.least_budget
        out["error"] = str(exc)[:2000]
        print(f"  hidden {hidden}: BudgetError: {str(exc)[:600]}", flush=True)
    except torch.OutOfMemoryError as exc:
        out["outcome"] = "out of memory"
        out["error"] = str(exc)[:1000]
        out["note"] = "\n".join(getattr(exc, "__notes__", []))  # the planner's, if any
        # where: the innermost frames of the project's code
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "gact_graph" in f.filename]
        out["where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]]
        print(f"  hidden {hidden}: out of memory at {' < '.join(reversed(out['where']))}")
        print(f"  hidden {hidden}: out of memory: {str(exc)[:300]}", flush=True)
    finally:
        ctl.remove()
        del model, opt, ctl
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    peaks = [s["peak"] for s in out["steps"] if s["peak"] is not None]
    if peaks:
        out["worst_peak"] = max(peaks)
    times = [s["seconds"] for s in out["steps"][2:]]
    if times:
        out["median_step_seconds"] = sorted(times)[len(times) // 2]
    return out


def products(args) -> None:
    """A GAT on a graph of ogbn-products' size (2,449,029 nodes, 123.7 M directed edges, 100
    features, 47 classes) trained full-batch under ``compress_gnn(model,
    memory_budget="16GiB")``.

    The graph is `fast_graph` (uniform random pairs at products'
    average degree, both directions, made on the device). The model is the ogbn-arxiv GAT
    preset (3 layers, 3 heads, BatchNorm, residual, ELU) at each width per head of
    ``--hidden`` in turn, widest first; the run stops at the first width that trains. Each
    width is one attempt:

    - the allocator is capped at the budget (``torch.cuda.set_per_process_memory_fraction``):
      an attempt that the planner admits but that allocates past the budget dies with an
      out-of-memory error, so "trains" means every step really stayed inside the budget;
    - ``--steps`` steps (the planner's profile step first), each with its own peak
      (``max_memory_allocated``: absolute, graph and parameters included, which is what the
      budget bounds), its time, and the planner's prediction;
    - a budget the planner cannot meet ends the attempt with ``BudgetError`` and the smallest
      feasible budget it names.

    ``--device cpu --nodes 3000 --budget 200MiB`` checks the mechanics. Prints a line per step
    and a table; writes JSON."""
    args.nodes = args.nodes or PRODUCTS.num_nodes
    device = torch.device(args.device)
    budget = parse_bytes(args.budget)
    info = {"command": "python " + " ".join(sys.argv), "device": str(device), "nodes": args.nodes,
            "budget": budget, "attempts": []}  # fmt: skip
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    info["torch"] = torch.__version__

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(info, indent=1))

    t0 = time.perf_counter()
    g = fast_graph(args.nodes, device)
    info["edges"] = int(g.edge_index.size(1))
    info["graph_seconds"] = time.perf_counter() - t0
    secs = info["graph_seconds"]
    print(f"# graph: {args.nodes:,} nodes, {info['edges']:,} directed edges on {device} "
          f"({secs:.1f} s); budget {format_bytes(budget)}", flush=True)  # fmt: skip
    for hidden in (int(h) for h in args.hidden.split(",")):
        if device.type == "cuda":
            with cuda_budget(budget, device):
                res = _products_attempt(g, hidden, budget, args.steps, device)
        else:
            res = _products_attempt(g, hidden, budget, args.steps, device)
        info["attempts"].append(res)
        save()
        if res["outcome"] == "trained":
            break

    print("\n| hidden per head | outcome | worst step peak | budget | median step |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for a in info["attempts"]:
        worst = a.get("worst_peak")
        med = a.get("median_step_seconds")
        extra = f" (least {format_bytes(a['least_budget'])})" if a.get("least_budget") else ""
        print(f"| {a['hidden_per_head']} | {a['outcome']}{extra} | "
              f"{'-' if worst is None else format_bytes(worst)} | {format_bytes(budget)} | "
              f"{'-' if med is None else f'{med:.2f} s'} |")  # fmt: skip
    save()


# ------------------------------------------------------------------------------ command line
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = subcommand(sub, table)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--fractions", nargs="+", type=float, default=[0.30, 0.10, 0.05])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="further planner / fastest-fitting-fixed runs, alternating, for the "
        "step-time ratio (this machine's step times drift between runs; default 2)",
    )
    p.add_argument(
        "--planner-setting",
        default="{}",
        help="JSON of compress_gnn arguments added to the planner's runs",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)  # fmt: skip

    p = subcommand(sub, floors)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))

    p = subcommand(sub, gcnii64)
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--edges", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fraction", type=float, default=0.30)
    p.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="the budget in MiB (default: --fraction of stock's worst step)",
    )
    p.add_argument(
        "--only-budget",
        action="store_true",
        help="run the planner alone (with --budget-mib), no baselines",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # fmt: skip

    p = subcommand(sub, worst_step)
    p.add_argument("--model", default="gat", choices=list(MODELS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget-mib", nargs="*", type=float, default=[])
    p.add_argument("--above", type=float, default=0.005)
    p.add_argument("--json", default=None)

    p = subcommand(sub, rss_baseline)
    p.add_argument(
        "factors",
        nargs="*",
        type=float,
        default=[1.005],
        help="budgets as factors over fixed 1 bit's worst step",
    )

    p = subcommand(sub, probe_cost)
    p.add_argument("specs", nargs="*", metavar="NAME:NODES")
    p.add_argument("--replays", action="store_true", help="where the bound's slack lies")

    p = subcommand(sub, products)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nodes", type=int, default=None, help="default: ogbn-products' 2,449,029")
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--hidden", default="128,64,32", help="widths per head to try, widest first")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)

    dispatch(ap, argv)


if __name__ == "__main__":
    main()
