"""Speed: what ``compress_gnn`` costs in time against stock PyG FP32, from a whole training step
down to one kernel. One subcommand per measurement:

    python benchmarks/speed.py step       # step time per method, ogbn-arxiv presets
    python benchmarks/speed.py epoch      # epoch time on a CiteSeer-sized graph
    python benchmarks/speed.py host       # host work per step: ops, syncs, Python calls
    python benchmarks/speed.py adapt      # what adaptive bits cost over fixed bits
    python benchmarks/speed.py quantize   # quantize / dequantize bandwidth against a copy
    python benchmarks/speed.py gat-edge   # the fused GAT / GATv2 edge stage against stock

``python benchmarks/speed.py SUBCOMMAND --help`` says what each measures and its flags.
Figures: docs/results/gpu.md, host_overhead.md, adaptive.md, bench_quantize_cpu.md.

``gact_graph`` is imported inside each subcommand, not here: ``host --tree DIR`` imports it from
another checkout.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's benchmarks
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402

CUDA = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------ shared
def _copies(base, settings: dict[str, dict | None], make_opt, make_fn) -> list[dict]:
    """One copy of ``base`` per setting (``None``: stock), from the same weights, each with its
    optimizer (``make_opt(model)``), controller and step closure (``make_fn(model, opt,
    name)``: GACT's ``step_fn``)."""
    from gact_graph import compress_gnn

    runs = []
    for name, kwargs in settings.items():
        model = copy.deepcopy(base).train()
        opt = make_opt(model)
        ctl = None if kwargs is None else compress_gnn(model, **kwargs)
        runs.append({"method": name, "model": model, "opt": opt, "ctl": ctl, "compress": kwargs,
                     "fn": make_fn(model, opt, name), "times": [], "error": None})  # fmt: skip
    return runs


def _round_robin(runs: list[dict], warmup: int, rounds: int, timed, deadline=None) -> None:
    """``warmup + rounds`` rounds in which each run takes its turn (``timed(run)``: seconds),
    so a slow patch of the machine hits every run alike; the timed rounds' times go to
    ``run["times"]``. A run that raises is reported (``run["error"]``), the others go on. Past
    ``deadline`` (after at least one timed round) the rounds stop."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # adaptive advice, L2-on-CPU notes
        for r in range(warmup + rounds):
            if r >= warmup + 1 and deadline is not None and time.perf_counter() > deadline:
                break
            for run in runs:
                if run["error"]:
                    continue
                try:
                    dt = timed(run)
                except Exception as exc:  # reported in the table, the others go on
                    run["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                if r >= warmup:
                    run["times"].append(dt)


def _medians(runs: list[dict]) -> tuple[dict[str, float | None], float | None]:
    """Each run's median time, and stock's."""
    med = {r["method"]: statistics.median(r["times"]) if r["times"] else None for r in runs}
    return med, med.get("stock")


def _release(runs: list[dict]) -> None:
    for run in runs:
        if run["ctl"] is not None:
            run["ctl"].remove()
    runs.clear()


def _write_json(path, res, indent: int = 2) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=indent))


# ------------------------------------------------------------------------------ step
STEP_METHODS = {
    "stock": None,
    "L1-4bit": {"bits": 4, "adaptive": False},
    "L1-2bit": {"bits": 2, "adaptive": False},
    "L1-2bit-adaptive": {"bits": 2, "adaptive": True},
    "L2-2bit": {"bits": 2, "adaptive": False, "opt_level": "L2"},  # swap to pinned host memory
    "lossless": {"bits": None},
    # mixed precision: the step's forward under torch.autocast (bf16), backward outside it
    "stock-amp": None,
    "L1-2bit-amp": {"bits": 2, "adaptive": False},
    # fixed 2 bits with the fused attention kernels handed dequantized copies in every step
    # (`gact_graph.switches.ROWS_IN_EVERY_STEP` off) instead of reading the packed codes
    "L1-2bit-dense-reads": {"bits": 2, "adaptive": False},
}
#: methods whose forward runs under torch.autocast(device, dtype=torch.bfloat16)
AMP = {"stock-amp", "L1-2bit-amp"}
#: methods whose steps run with `gact_graph.switches.ROWS_IN_EVERY_STEP` off
DENSE_READS = {"L1-2bit-dense-reads"}


def _time_model(name, data, method_names, device, args, deadline) -> list[dict]:
    from gact_graph import switches
    from gact_graph.models import build_model, preset

    cfg = preset(name, args.dataset)
    if args.layers:
        cfg["model"]["num_layers"] = args.layers
    torch.manual_seed(args.seed)
    base = build_model(name, data.num_features, int(data.num_classes), **cfg["model"]).to(device)
    x, edge_index, y, mask = data.x, data.edge_index, data.y, data.train_mask
    settings = {}
    for m in method_names:
        kwargs = STEP_METHODS[m]
        if kwargs is not None and args.graph_check is not None:
            kwargs = {**kwargs, "graph_check": args.graph_check}
        settings[m] = kwargs

    def make_fn(model, opt, m):
        def step_fn(amp=m in AMP):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                out = model(x, edge_index)
            loss = F.cross_entropy(out[mask].float(), y[mask])
            loss.backward()
            return loss

        return step_fn

    runs = _copies(base, settings, lambda m: torch.optim.Adam(m.parameters(), lr=cfg["lr"]),
                   make_fn)  # fmt: skip
    del base
    for run in runs:
        run["peaks"], run["step_peaks"] = [], []

    def one_step(run) -> float:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            rest = torch.cuda.memory_allocated(device)
        switches.ROWS_IN_EVERY_STEP = run["method"] not in DENSE_READS
        harness.sync(device)
        t0 = time.perf_counter()
        run["fn"]()
        run["opt"].step()
        if run["ctl"] is not None:
            run["ctl"].iterate(run["fn"])
        harness.sync(device)
        dt = time.perf_counter() - t0
        if device.type == "cuda":  # every step: re-planning steps are often warm-ups
            peak = torch.cuda.max_memory_allocated(device)
            run["peaks"].append(peak)
            run["step_peaks"].append(peak - rest)
        return dt

    _round_robin(runs, args.warmup, args.steps, one_step, deadline)
    med, stock_t = _medians(runs)
    rows = []
    for run in runs:
        t = med[run["method"]]
        rows.append({
            "model": name,
            "method": run["method"],
            "compress": run["compress"],
            "median_step_s": t,
            "step_times_s": run["times"],
            "ratio_to_stock": (t / stock_t) if t and stock_t else None,
            "peak_bytes": max(run["peaks"]) if run["peaks"] else None,
            # per step (warm-ups included): max allocated minus what was allocated before it
            "step_peak_bytes": run["step_peaks"],
            "worst_step": max(range(len(run["step_peaks"])), key=run["step_peaks"].__getitem__)
            if run["step_peaks"] else None,
            "error": run["error"],
        })  # fmt: skip
    _release(runs)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def step(args) -> dict:
    """Training step time: stock PyG FP32 vs ``compress_gnn``, measured in the same run.

    For each model (the ogbn-arxiv presets of `gact_graph.models.preset`: GCN 3 x 256 with
    BatchNorm, GAT 3 layers x 3 heads x 128, GCNII 16 x 256) one copy per method is made from
    the same initial weights; the copies then take their steps in turn (stock, L1 4-bit, L1
    2-bit, ...: round robin, so a slow patch of the machine hits every method alike). A step
    is forward, loss on the training nodes, backward, Adam step and ``ctl.iterate(step_fn)``.
    Reported per method: median step time of the timed rounds and its ratio to stock's; on
    CUDA also the peak memory of a step (``max_memory_allocated``, reset before each step) over
    *every* step, warm-ups included (the default adaptive mode re-plans on steps 0, 1, 3, 7,
    ...), and the worst step's peak above what was allocated before it, with its ratio to the
    fixed-bit method of the same bits (``L1-2bit``), the figure bounded at 1.10.

    ``--device cuda`` runs at full arxiv size; ``--device cpu --scale 0.02 --threads 1`` on a
    CPU."""
    from gact_graph.datasets import load_dataset

    t_start = time.perf_counter()
    device = harness.start_run(args.device, args.threads)
    on_cuda = device.type == "cuda"
    scale = args.scale if args.scale is not None else (1.0 if on_cuda else 0.02)
    data = load_dataset(args.dataset, scale=scale, seed=args.seed).to(device)
    method_names = harness.names(args.methods)
    for m in method_names:
        if m not in STEP_METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(STEP_METHODS)}")
    notes = []
    if any(STEP_METHODS[m] and STEP_METHODS[m].get("adaptive") for m in method_names):
        ok, why = harness.adaptive_works()
        if not ok:
            method_names = [m for m in method_names if not (STEP_METHODS[m] or {}).get("adaptive")]
            notes.append(f"adaptive dropped: compress_gnn(adaptive=True) fails ({why[:160]})")
    models = harness.names(args.models, lower=True)
    env = harness.run_env(device)
    header = {
        "benchmark": "step_time",
        "command": harness.command_line(args.argv),
        "env": env,
        "graph": {
            "dataset": args.dataset,
            "scale": scale,
            "num_nodes": int(data.num_nodes),
            "num_edges": int(data.edge_index.shape[1]),
        },  # fmt: skip
        "warmup": args.warmup,
        "steps": args.steps,
        "notes": notes,
    }
    print(f"# step time: {env['device']}, {args.dataset} x{scale:g} "
          f"({data.num_nodes} nodes, {data.edge_index.shape[1]} edges)")  # fmt: skip
    for n in notes:
        print(f"# {n}")
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for i, name in enumerate(models):
        deadline = None
        if args.time_budget is not None:
            left = args.time_budget - (time.perf_counter() - t_start)
            deadline = time.perf_counter() + max(0.0, left) / (len(models) - i)
        rows = _time_model(name, data, method_names, device, args, deadline)
        results.extend(rows)
        for r in rows:
            t = "-" if r["median_step_s"] is None else f"{1e3 * r['median_step_s']:.1f} ms"
            ratio = "" if r["ratio_to_stock"] is None else f" x{r['ratio_to_stock']:.2f}"
            err = f" ERROR {r['error'][:100]}" if r["error"] else ""
            print(f"  {name:6s} {r['method']:18s} {t}{ratio}{err}", flush=True)
        harness.write_results(out_path, header, results)
    print()
    print(step_table(results))
    print(f"\nwrote {out_path} ({time.perf_counter() - t_start:.0f}s)")
    return {**header, "results": results}


def step_table(results: list[dict]) -> str:
    lines = [
        "| model | method | median step | x stock | peak (CUDA) | worst step above rest "
        "| x fixed 2-bit | timed steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fixed = {
        r["model"]: max(r["step_peak_bytes"])
        for r in results
        if r["method"] == "L1-2bit" and r.get("step_peak_bytes")
    }
    for r in results:
        t = "error" if r["error"] else "-"
        if r["median_step_s"] is not None:
            t = f"{1e3 * r['median_step_s']:.1f} ms"
        ratio = "-" if r["ratio_to_stock"] is None else f"{r['ratio_to_stock']:.2f}"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        worst, vs_fixed = "-", "-"
        if r.get("step_peak_bytes"):
            w = max(r["step_peak_bytes"])
            worst = f"{w / 2**20:,.0f} MiB (step {r['worst_step']})"
            if fixed.get(r["model"]):
                vs_fixed = f"{w / fixed[r['model']]:.2f}"
        lines.append(f"| {r['model']} | {r['method']} | {t} | {ratio} | {peak} | {worst} | "
                     f"{vs_fixed} | {len(r['step_times_s'])} |")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------ epoch
EPOCH_METHODS = {
    "stock": None,
    "default": {},
    "default-min_bytes0": {"min_bytes": 0},
    "default-min_bytes1MiB": {"min_bytes": 1 << 20},  # CUDA's default rule, on any device
    "fixed-2bit": {"bits": 2, "adaptive": False},
}
#: CiteSeer (PyG's Planetoid): nodes, stored (directed) edges
CITESEER_NODES, CITESEER_EDGES = 3_327, 9_104
#: model -> (preset name, depth override)
EPOCH_MODELS = {"gcn": ("gcn", None), "gat": ("gat", None), "gcnii-16": ("gcnii", 16)}


def _epoch_model(label: str, data, methods: list[str], device, args) -> list[dict]:
    from gact_graph.models import build_model, preset

    name, depth = EPOCH_MODELS[label]
    cfg = preset(name, "citeseer")
    if depth:
        cfg["model"]["num_layers"] = depth if not args.dry else min(depth, 4)
    torch.manual_seed(args.seed)
    base = build_model(name, data.num_features, int(data.num_classes), **cfg["model"]).to(device)
    x, ei, y = data.x, data.edge_index, data.y
    train, val = data.train_mask, data.val_mask

    def make_opt(model):
        return torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])

    def make_fn(model, opt, _):
        def step_fn():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, ei)[train], y[train])
            loss.backward()
            return loss

        return step_fn

    runs = _copies(base, {m: EPOCH_METHODS[m] for m in methods}, make_opt, make_fn)
    del base

    def one_epoch(run) -> float:
        harness.sync(device)
        t0 = time.perf_counter()
        model = run["model"]
        model.train()
        run["fn"]()
        run["opt"].step()
        if run["ctl"] is not None:
            run["ctl"].iterate(run["fn"])
        if not args.no_eval:
            model.eval()
            with torch.no_grad():
                pred = model(x, ei).argmax(-1)
                run["val_acc"] = (pred[val] == y[val]).float().mean()  # stays on the device
        harness.sync(device)
        return time.perf_counter() - t0

    _round_robin(runs, args.warmup, args.epochs, one_epoch)
    med, stock_t = _medians(runs)
    rows = []
    for run in runs:
        t = med[run["method"]]
        rows.append({
            "model": label,
            "method": run["method"],
            "compress": run["compress"],
            "median_epoch_s": t,
            "mean_epoch_s": statistics.fmean(run["times"]) if run["times"] else None,
            "ratio_to_stock": (t / stock_t) if t and stock_t else None,
            "epoch_times_s": run["times"],
            "val_acc": float(run["val_acc"]) if "val_acc" in run else None,
            "error": run["error"],
        })  # fmt: skip
    _release(runs)
    return rows


def epoch_table(results: list[dict]) -> str:
    lines = [
        "| model | method | median epoch | x stock | mean epoch | timed epochs |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        med = "error" if r["error"] else "-"
        if r["median_epoch_s"] is not None:
            med = f"{1e3 * r['median_epoch_s']:.2f} ms"
        ratio = "-" if r["ratio_to_stock"] is None else f"{r['ratio_to_stock']:.2f}"
        mean = "-" if r["mean_epoch_s"] is None else f"{1e3 * r['mean_epoch_s']:.2f} ms"
        lines.append(f"| {r['model']} | {r['method']} | {med} | {ratio} | {mean} "
                     f"| {len(r['epoch_times_s'])} |")  # fmt: skip
    return "\n".join(lines)


def epoch(args) -> dict:
    """Epoch time on a small graph: stock PyG FP32 vs ``compress_gnn``'s default mode.

    The graph is the seeded synthetic stand-in with CiteSeer's statistics (3,327 nodes, 9,104
    stored edges, 3,703 features, 6 classes, 20 training nodes per class;
    `gact_graph.datasets.synthetic`), the models the Planetoid presets of
    `gact_graph.models.preset`: GCN 2 x 16, GAT 2 layers x 8 heads x 8, GCNII 16 x 64 (the
    preset's 64 layers cut to 16). An epoch is one training step (forward on every node, loss
    on the training nodes, backward, Adam step, ``ctl.iterate(step_fn)``) and one evaluation
    forward under ``torch.no_grad`` (``--no-eval`` drops it). The methods take their epochs in
    turn (round robin); reported per model and method: the median epoch time over the timed
    epochs, its ratio to stock's, and the mean (the default mode re-plans in epochs 0, 1, 3,
    7, 15, 31, ...: they move the mean, not the median).

    Methods: ``stock`` (no compression), ``default`` (``compress_gnn(model)``: adaptive 2-bit
    average; on CUDA tensors under 1 MiB are kept as they are), ``default-min_bytes0`` (the
    same with that rule off: every tensor above ``min_numel`` quantized),
    ``default-min_bytes1MiB`` (the CUDA rule set explicitly: on a CPU, what the default mode
    does on a GPU), ``fixed-2bit``. ``--dry`` checks the subcommand in seconds on a CPU."""
    from gact_graph.datasets.synthetic import load_synthetic

    if args.dry:
        args.device, args.warmup, args.epochs = "cpu", 1, 3
    device = harness.start_run(args.device, args.threads)
    methods = harness.names(args.methods)
    models = harness.names(args.models, lower=True)
    for m in methods:
        if m not in EPOCH_METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(EPOCH_METHODS)}")
    for m in models:
        if m not in EPOCH_MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(EPOCH_MODELS)}")
    if args.dry:  # a tenth of the graph and 64 features: seconds on one CPU core
        data = load_synthetic("synthetic-citeseer", num_nodes=333, num_edges=910, seed=args.seed)
        data.x = data.x[:, :64].contiguous()
    else:
        data = load_synthetic("synthetic-citeseer", num_nodes=CITESEER_NODES,
                              num_edges=CITESEER_EDGES, seed=args.seed)  # fmt: skip
    data = data.to(device)
    env = harness.run_env(device)
    header = {
        "benchmark": "small_graph_epoch",
        "command": harness.command_line(args.argv),
        "env": env,
        "graph": {
            "dataset": "synthetic-citeseer",
            "num_nodes": int(data.num_nodes),
            "num_edges": int(data.edge_index.shape[1]),
            "num_features": int(data.num_features),
            "num_classes": int(data.num_classes),
            "train_nodes": int(data.train_mask.sum()),
        },
        "warmup": args.warmup,
        "epochs": args.epochs,
        "eval": not args.no_eval,
        "dry": args.dry,
    }
    g = header["graph"]
    print(f"# small-graph epoch: {env['device']}, {g['num_nodes']} nodes, {g['num_edges']} "
          f"edges, {g['num_features']} features, {g['num_classes']} classes")  # fmt: skip
    results = []
    for label in models:
        rows = _epoch_model(label, data, methods, device, args)
        results.extend(rows)
        for r in rows:
            t = "-" if r["median_epoch_s"] is None else f"{1e3 * r['median_epoch_s']:.2f} ms"
            ratio = "" if r["ratio_to_stock"] is None else f" x{r['ratio_to_stock']:.2f}"
            err = f" ERROR {r['error'][:100]}" if r["error"] else ""
            print(f"  {label:9s} {r['method']:20s} {t}{ratio}{err}", flush=True)
    out = {**header, "results": results}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print()
    print(epoch_table(results))
    print(f"\nwrote {path}")
    return out


# ------------------------------------------------------------------------------ host
#: aten ops that on CUDA read a value back to the host or size their output from the data
SYNC_OPS = {
    "_local_scalar_dense", "nonzero", "nonzero_static", "unique", "_unique", "_unique2",
    "unique_consecutive", "unique_dim", "equal", "masked_select", "is_nonzero",
    "repeat_interleave", "bincount", "histc", "argwhere",
}  # fmt: skip
#: Tensor methods that copy to the host (on CUDA: a sync)
HOST_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")


def _caller() -> str:
    """The innermost gact_graph frame of the current stack (else the innermost one outside
    torch and this script)."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if "gact_graph" in f.filename:
            return f"{f.filename.split('gact_graph')[-1].lstrip('/')}:{f.lineno} {f.name}"
    for f in reversed(frames):
        if "/torch/" not in f.filename and not f.filename.endswith("speed.py"):
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return "?"


def _op_counter():
    """A `TorchDispatchMode` that counts dispatched aten ops, their outputs and bytes, and
    data-dependent ones by caller."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.syncs: collections.Counter = collections.Counter()
            self.allocs = 0
            self.alloc_bytes = 0
            self.bytes_by_op: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            if name in SYNC_OPS:
                self.syncs[(name, _caller())] += 1
            # a view or one of the inputs returned: no new storage
            aliases = any(r.alias_info is not None for r in func._schema.returns)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                # a sparse tensor built from existing parts reports its dense size: not counted
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and not aliases:
                    self.allocs += 1
                    self.alloc_bytes += t.numel() * t.element_size()
                    self.bytes_by_op[(name, _caller())] += t.numel() * t.element_size()
            return out

    return Counter()


def _python_calls(step) -> tuple[int, int]:
    """(function calls, calls of the pointwise mode's ``__torch_function__``) in one ``step()``,
    as cProfile counts them."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof)
    mode = sum(
        v[1]
        for (path, _, name), v in stats.stats.items()
        if name == "__torch_function__" and path.replace("\\", "/").endswith("ops/mode.py")
    )
    return stats.total_calls, mode


class HostCalls:
    """Patches Tensor.item/tolist/cpu/numpy/__bool__ to count calls by caller while active."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.saved: dict = {}

    def __enter__(self):
        for name in HOST_METHODS:
            orig = getattr(torch.Tensor, name)
            self.saved[name] = orig

            def wrapped(t, *a, _orig=orig, _name=name, **k):
                self.calls[(_name, _caller())] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)


def host(args) -> dict:
    """Host-side cost of one training step: dispatched aten ops, possible host syncs, Python
    time.

    On a GPU a step of a mid-sized graph is a few tens of milliseconds, so per-step host work
    (one more kernel launch per saved tensor, a ``.item()`` that waits for the device, Python
    in the pack/unpack hooks) shows in the step time although a CPU run hardly sees it. This
    counts that work on the CPU, where it is deterministic:

    * **ops/step**: aten ops dispatched in one steady-state step (forward, loss, backward,
      optimizer step, ``ctl.iterate``), counted by a ``TorchDispatchMode``, with the most
      frequent kinds;
    * **possible syncs/step**: ops that read a device value to the host or whose output shape
      depends on the data (``_local_scalar_dense`` from ``.item()``/``bool()``, ``nonzero``,
      ``unique``, ``equal``, ``masked_select``, ...), and calls of
      ``Tensor.item/tolist/cpu/numpy`` and ``bool()``, each with the line of ``gact_graph``
      that made it;
    * **allocations/step**: tensors the dispatched ops return, and their bytes;
    * **Python calls/step**: function calls cProfile counts in one steady-state step (Python
      functions and the builtins they call), and how many of them are the pointwise mode's
      ``__torch_function__`` (``gact_graph/ops/mode.py``);
    * **step time on a tiny graph**, where the arithmetic is negligible and the time is the
      host's (on CPU the median CPU time of the process, one thread: less sensitive than wall
      time to other processes on a shared machine; on CUDA wall time).

    ``--tree DIR`` imports ``gact_graph`` from another checkout (e.g. a ``git worktree add``
    of an older commit), so two trees are compared with the same command."""
    sys.path.insert(0, str(Path(args.tree).resolve()) if args.tree else str(ROOT))
    import gact_graph
    from gact_graph.datasets.synthetic import load_synthetic
    from gact_graph.models import build_model, preset

    torch.set_num_threads(1)
    device = torch.device(args.device)
    data = load_synthetic("synthetic", num_nodes=args.nodes, num_edges=args.edges, seed=0)
    data.x = data.x[:, : args.features].contiguous()
    data = data.to(device)
    x, ei, y = data.x, data.edge_index, data.y
    num_classes = int(y.max()) + 1
    mask = torch.zeros(args.nodes, dtype=torch.bool, device=device)
    mask[: args.nodes // 2] = True
    cfg = preset(args.model, "ogbn-arxiv")
    if args.layers:
        cfg["model"]["num_layers"] = args.layers
    if args.hidden:
        cfg["model"]["hidden_channels"] = args.hidden
    torch.manual_seed(0)
    base = build_model(args.model, x.shape[1], num_classes, **cfg["model"]).to(device)
    extra = {}
    if args.graph_check is not None:
        extra["graph_check"] = args.graph_check
    if args.min_bytes is not None:
        extra["min_bytes"] = args.min_bytes
    kwargs = {
        "stock": None,
        "fixed-2bit": {"bits": 2, "adaptive": False, **extra},
        "default": dict(extra),
    }
    tree = str(Path(gact_graph.__file__).parents[1])
    results = {"tree": tree, "model": args.model, "nodes": args.nodes,
               "edges": int(ei.shape[1]), "extra": extra, "methods": {}}  # fmt: skip

    def make_fn(model, opt, _):
        def step_fn():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, ei)[mask], y[mask])
            loss.backward()
            return loss

        return step_fn

    for m in args.methods.split(","):
        (run,) = _copies(base, {m: kwargs[m]}, lambda m: torch.optim.Adam(m.parameters(), 1e-3),
                         make_fn)  # fmt: skip
        opt, ctl, step_fn = run["opt"], run["ctl"], run["fn"]

        def step(opt=opt, ctl=ctl, step_fn=step_fn):
            step_fn()
            opt.step()
            if ctl is not None:
                ctl.iterate(step_fn)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(args.warmup):
                step()
            counter, calls = _op_counter(), HostCalls()
            with counter, calls:
                step()
            py_calls, mode_calls = _python_calls(step)
            cuda_syncs = None
            if device.type == "cuda":  # the syncs CUDA reports, as warnings, in one step
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                cuda_syncs = [str(w.message)[:120] for w in seen if "synchroniz" in str(w.message)]
                torch.cuda.synchronize()
            if args.cprofile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    step()
                prof.disable()
                print(f"== cProfile, {m}, {args.steps} steps (tottime: own time)")
                stats = pstats.Stats(prof).sort_stats("tottime")
                stats.print_stats(args.cprofile)
                if args.callers:
                    stats.print_callers(args.callers)
            # CPU: the process's CPU time (other processes on a shared machine disturb it less);
            # CUDA: wall time, the device waited for
            clock = time.perf_counter if device.type == "cuda" else time.process_time
            times = []
            for _ in range(args.steps):
                t0 = clock()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(clock() - t0)
        results["methods"][m] = {
            "ops_per_step": sum(counter.ops.values()),
            "top_ops": counter.ops.most_common(args.top),
            "ops": dict(counter.ops),
            "allocs_per_step": counter.allocs,
            "top_alloc_bytes": [[k[0], k[1], n] for k, n in counter.bytes_by_op.most_common(6)],
            "alloc_bytes_per_step": counter.alloc_bytes,
            "possible_syncs": sorted(
                [[f"aten.{k[0]}", k[1], n] for k, n in counter.syncs.items()], key=lambda r: -r[2]
            ),
            "host_calls": sorted(
                [[k[0], k[1], n] for k, n in calls.calls.items()], key=lambda r: -r[2]
            ),
            "py_calls_per_step": py_calls,
            "mode_calls_per_step": mode_calls,
            "median_step_us": 1e6 * statistics.median(times),
            "cuda_syncs": cuda_syncs,
        }
        if ctl is not None:
            ctl.remove()
    stock = results["methods"].get("stock")
    for m, r in results["methods"].items():
        ratio = r["median_step_us"] / stock["median_step_us"] if stock else None
        ratio = "" if ratio is None else f" ({ratio:.2f}x stock)"
        print(f"== {args.model} {m} {extra or ''}: {r['ops_per_step']} ops/step, "
              f"{r['allocs_per_step']} allocs ({r['alloc_bytes_per_step'] / 1e6:.2f} MB), "
              f"{r['py_calls_per_step']} Python calls ({r['mode_calls_per_step']} in the mode), "
              f"{r['median_step_us']:.0f} us/step{ratio}")  # fmt: skip
        print("   top ops: " + ", ".join(f"{k} {n}" for k, n in r["top_ops"]))
        for name, where, n in r["top_alloc_bytes"]:
            print(f"   alloc {n / 1e6:.2f} MB by {name} at {where}")
        for name, where, n in r["possible_syncs"]:
            print(f"   sync? {name} x{n} at {where}")
        for name, where, n in r["host_calls"]:
            print(f"   host {name} x{n} at {where}")
        if r["cuda_syncs"] is not None:
            print(f"   CUDA reported {len(r['cuda_syncs'])} syncs in a step")
            for msg in collections.Counter(r["cuda_syncs"]).most_common(8):
                print(f"     {msg[1]}x {msg[0]}")
    _write_json(args.json, results, indent=1)
    return results


# ------------------------------------------------------------------------------ adapt
def adapt(args) -> dict:
    """Cost of adaptive bit allocation, measured side by side in one run.

    Two copies of the same model train in lockstep on the same graph (their steps alternate,
    so machine load hits both alike): one with fixed ``--bits`` (rounded down to a quantizer
    width), one adaptive at an average of ``--bits``. Reported:

    * step time of each (forward, backward, optimizer step, ``ctl.iterate()``), and the
      adaptive run's extra time as a fraction of its training time;
    * time of one sensitivity estimate by the probe (the extra time of a probed step) and by
      GACT's Algorithm 1 (``two_seed_sensitivity``, two passes per tensor), in units of one
      training step."""
    from gact_graph import compress_gnn
    from gact_graph.datasets import load_dataset
    from gact_graph.models import build_model, preset
    from gact_graph.policy.sensitivity import two_seed_sensitivity

    kw = {} if args.scale is None else {"scale": args.scale}
    data = load_dataset(args.dataset, root=args.root, **kw)
    cfg = preset(args.model, args.dataset)
    if args.layers is not None:
        cfg["model"]["num_layers"] = args.layers
    torch.manual_seed(args.seed)
    base = build_model(args.model, data.num_features, data.num_classes, **cfg["model"])
    fixed_bits = max(b for b in (1, 2, 4, 8) if b <= args.bits)
    models, ctls, opts = {}, {}, {}
    for kind in ("fixed", "adaptive"):
        m = copy.deepcopy(base)
        models[kind] = m
        opts[kind] = torch.optim.Adam(m.parameters(), lr=cfg["lr"])
        if kind == "fixed":
            ctls[kind] = compress_gnn(m, bits=fixed_bits, adaptive=False)
        else:
            ctls[kind] = compress_gnn(m, bits=args.bits, adaptive=True)
    mask = data.train_mask

    def step_fn(kind):
        def step():
            opts[kind].zero_grad(set_to_none=True)
            out = models[kind](data.x, data.edge_index)
            loss = F.cross_entropy(out[mask], data.y[mask])
            loss.backward()
            return loss

        return step

    times = {"fixed": [], "adaptive": []}
    probed = []
    for _ in range(args.steps):
        for kind in ("fixed", "adaptive"):
            before = ctls[kind].adapter.n_estimates if kind == "adaptive" else 0
            t0 = time.perf_counter()
            step_fn(kind)()
            opts[kind].step()
            ctls[kind].iterate(step_fn(kind))
            times[kind].append(time.perf_counter() - t0)
            if kind == "adaptive":
                probed.append(ctls[kind].adapter.n_estimates > before)

    ad = ctls["adaptive"].adapter
    n_tensors = len(ad.tensors)
    t_fixed = sum(times["fixed"])
    t_adapt = sum(times["adaptive"])
    plain = [t for t, pr in zip(times["adaptive"], probed) if not pr]
    probe_steps = [t for t, pr in zip(times["adaptive"], probed) if pr]
    step_med = statistics.median(times["fixed"])
    # one estimate by each estimator, on the adaptive model, timed back to back
    alg1 = []
    for _ in range(args.alg1_repeats):
        t0 = time.perf_counter()
        two_seed_sensitivity(ctls["adaptive"], step_fn("adaptive"), names=list(ad.tensors))
        alg1.append(time.perf_counter() - t0)
    probe_extra = (
        statistics.median(probe_steps) - statistics.median(plain) if probe_steps and plain else None
    )
    res = {
        "dataset": args.dataset,
        "model": args.model,
        "bits": args.bits,
        "fixed_bits": fixed_bits,
        "steps": args.steps,
        "tensors": n_tensors,
        "estimates": ad.n_estimates,
        "step_s_fixed_median": step_med,
        "step_s_adaptive_median": statistics.median(times["adaptive"]),
        "train_s_fixed": t_fixed,
        "train_s_adaptive": t_adapt,
        "adaptive_extra_fraction": (t_adapt - t_fixed) / t_adapt,
        "probe_s_in_hooks": ad.probe_seconds,
        "probe_fraction_in_hooks": ad.overhead(),
        "probe_estimate_extra_s": probe_extra,
        "probe_estimate_in_steps": None if probe_extra is None else probe_extra / step_med,
        "alg1_estimate_s": statistics.fmean(alg1),
        "alg1_estimate_in_steps": statistics.fmean(alg1) / step_med,
        "final_plan": dict(ctls["adaptive"].plan),
    }
    print(f"{args.model} on {args.dataset}: {n_tensors} compressed tensors, {args.steps} steps")
    print(f"{'':32} {'fixed':>10} {'adaptive':>10}")
    med_ad = res["step_s_adaptive_median"]
    print(f"{'median step (ms)':32} {1e3 * step_med:>10.1f} {1e3 * med_ad:>10.1f}")
    print(f"{'total train time (s)':32} {t_fixed:>10.2f} {t_adapt:>10.2f}")
    print(
        f"adaptive extra time: {100 * res['adaptive_extra_fraction']:.1f}% of its training time "
        f"({ad.n_estimates} estimates; time inside the probe {100 * ad.overhead():.1f}%)"
    )
    if probe_extra is not None:
        print(
            f"one estimate: probe {res['probe_estimate_in_steps']:.2f} steps, "
            f"Algorithm 1 {res['alg1_estimate_in_steps']:.1f} steps"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    for c in ctls.values():
        c.remove()
    return res


# ------------------------------------------------------------------------------ quantize
def median_seconds(fn, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        harness.sync(device)
        t0 = time.perf_counter()
        fn()
        harness.sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_seconds(fn, repeats: int, rounds: int = 3) -> float:
    """Device seconds per call of ``fn`` (CUDA), without the host's launch path that the
    wall-clock figures of :func:`median_seconds` include (see ``launch_ms``)."""
    from gact_graph.kernels.quantize import launch_ms

    fn()
    torch.cuda.synchronize()
    return launch_ms(fn, repeats, rounds) / 1e3


def _quantize_run(args: argparse.Namespace) -> dict:
    from gact_graph.core.quantize import _use_triton, quantize

    device = torch.device(args.device)
    rows = args.numel // args.cols if args.numel else args.rows
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, args.cols, generator=gen)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    result = {
        "device": name,
        "path": "triton" if _use_triton(base.to(device)) else "reference",
        "shape": [rows, args.cols],
        "group_size": args.group_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "dtypes": {},
        "rows": [],
    }
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x = base.to(device, dtype)
        x_bytes = x.numel() * x.element_size()
        t_copy = median_seconds(x.clone, device, args.repeats, args.warmup)
        copy_gbps = 2 * x_bytes / 1e9 / t_copy  # a copy reads and writes
        result["dtypes"][dtype_name] = {"copy_ms": t_copy * 1e3, "copy_gbps": copy_gbps}
        if device.type == "cuda":
            t_copy_dev = device_seconds(x.clone, args.repeats)
            result["dtypes"][dtype_name]["copy_device_ms"] = t_copy_dev * 1e3
        for bits in args.bits:
            q = quantize(x, bits, args.group_size, seed=0)
            t_q = median_seconds(
                lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0),
                device,
                args.repeats,
                args.warmup,
            )
            t_d = median_seconds(q.dequantize, device, args.repeats, args.warmup)
            moved = (x_bytes + q.nbytes) / 1e9  # either direction
            device_cols = {}
            if device.type == "cuda":  # the same three without the host's launch path
                dev_copy_gbps = 2 * x_bytes / 1e9 / t_copy_dev
                for name, fn in (
                    ("quantize", lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0)),
                    ("dequantize", q.dequantize),
                ):
                    t = device_seconds(fn, args.repeats)
                    device_cols[f"{name}_device_ms"] = t * 1e3
                    device_cols[f"{name}_device_pct_copy_bw"] = 100 * moved / t / dev_copy_gbps
            result["rows"].append(
                {
                    **device_cols,
                    "dtype": dtype_name,
                    "bits": bits,
                    "quantize_ms": t_q * 1e3,
                    "quantize_gbps": moved / t_q,
                    "quantize_pct_copy_bw": 100 * moved / t_q / copy_gbps,
                    "quantize_x_copy": t_q / t_copy,
                    "dequantize_ms": t_d * 1e3,
                    "dequantize_gbps": moved / t_d,
                    "dequantize_pct_copy_bw": 100 * moved / t_d / copy_gbps,
                    "dequantize_x_copy": t_d / t_copy,
                    "nbytes": q.nbytes,
                    "compression": x_bytes / q.nbytes,
                }
            )
    return result


def _quantize_table(res: dict) -> str:
    head = (
        f"device={res['device']} path={res['path']} shape={tuple(res['shape'])} "
        f"G={res['group_size']} threads={res['threads']} torch={res['torch']}\n"
    )
    for name, c in res["dtypes"].items():
        head += f"{name} x.clone(): {c['copy_ms']:.3g} ms ({c['copy_gbps']:.4g} GB/s read+write)\n"
    lines = [
        "| dtype | bits | quantize ms | GB/s | % copy bw | dequantize ms | GB/s | % copy bw "
        "| compression |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['bits']} | {r['quantize_ms']:.3g} | {r['quantize_gbps']:.4g} "
            f"| {r['quantize_pct_copy_bw']:.0f} % | {r['dequantize_ms']:.3g} "
            f"| {r['dequantize_gbps']:.4g} | {r['dequantize_pct_copy_bw']:.0f} % "
            f"| {r['compression']:.3g}x |"
        )
    dev = [r for r in res["rows"] if "quantize_device_ms" in r]
    if dev:
        lines += ["", "Device time only (CUDA events, launches back to back):", "",
                  "| dtype | bits | quantize ms | % copy bw | dequantize ms | % copy bw |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in dev:
            lines.append(
                f"| {r['dtype']} | {r['bits']} | {r['quantize_device_ms']:.3g} "
                f"| {r['quantize_device_pct_copy_bw']:.0f} % | {r['dequantize_device_ms']:.3g} "
                f"| {r['dequantize_device_pct_copy_bw']:.0f} % |"
            )
    return head + "\n" + "\n".join(lines)


def _sass_row(kind: str, tname: str, bits: int, cfg, group_size: int) -> str:
    """One row of :func:`sass_report`: compile ``kind`` for sm_90 and count its SASS. The launch
    compiled is the one the launcher makes for a dense ``(64, group_size)`` tensor under
    ``cfg`` (recorded on CPU tensors, nothing runs; ``tests/kernels/compiled.py``), so its
    signature and specialization are the device's."""
    import re
    import subprocess
    import tempfile

    import triton

    from gact_graph.kernels import quantize as kq
    from tests.kernels.compiled import compile_launch, recorded_launches

    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    fn = kq._quantize_pack_kernel if kind == "quantize" else kq._unpack_dequantize_kernel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[tname]
    x = torch.zeros(64, group_size, dtype=dtype)
    with kq.forced_config(cfg), recorded_launches(fn) as launches:
        if kind == "quantize":
            kq.triton_quantize(x, bits, group_size, 0)
        else:
            packed, meta = kq.quantize_reference(x, bits, group_size, 0)
            kq.triton_dequantize(packed, meta, bits, x.shape, dtype, group_size)
    (launch,) = launches
    cx = launch.constexprs()
    groups, h, t, v = cx["GROUPS"], cx["H"], cx["T"], cx["V"]
    k = compile_launch(launch, 90)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        usage = subprocess.run([str(nvdisasm.parent / "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", usage)
    n = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln))
    per_thread = groups * h * t * v / (32 * launch.kwargs["num_warps"])
    ptx = k.asm["ptx"]
    ld = sorted(set(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx)))
    st = sorted(set(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx)))
    bar = len(re.findall(r"\bbar\.sync\b", ptx))
    return (f"| {kind} | {tname} | {bits} | {n / per_thread:.1f} | {' '.join(ld)} "
            f"| {' '.join(st)} | {bar} | {regs.group(1) if regs else '?'} "
            f"| {tuple(cfg)} |")  # fmt: skip


def sass_report(bits_list, group_size: int = 256, dtypes=("fp32", "bf16"), configs=None) -> str:
    """SASS instructions per element of the quantize / dequantize kernels (sm_90, no GPU), with
    the PTX's global load / store widths, its barriers (a layout change through shared memory)
    and the registers per thread (they bound how many programs an SM holds), for each
    configuration in ``configs`` (default: each direction's untuned one)."""
    from gact_graph.kernels import quantize as kq

    default = configs is None
    lines = [
        "| kernel | dtype | bits | SASS / element | loads | stores | bar.sync | registers "
        "| config |",
        "|---|---|---:|---:|---|---|---:|---:|---|",
    ]
    for kind in ("quantize", "dequantize"):
        for tname in dtypes:
            for bits in bits_list:
                for cfg in [kq.DEFAULTS[kind]] if default else configs:
                    lines.append(_sass_row(kind, tname, bits, cfg, group_size))
    return "\n".join(lines)


def config_report(args: argparse.Namespace) -> dict:
    """Device time of each direction under each of the tuner's configurations, measured as
    CUDA-event time over back-to-back launches (no host wait between them), next to the
    configuration the tuner chooses; ``--dry`` lists what would be timed."""
    from gact_graph.core.quantize import quantize
    from gact_graph.kernels import quantize as kq

    rows = args.numel // args.cols if args.numel else args.rows
    res = {"shape": [rows, args.cols], "configs": [list(c) for c in kq.CONFIGS], "rows": []}
    if args.dry:
        res["rows"] = [{"dtype": d, "bits": b} for d in args.dtypes for b in args.bits]
        return res
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, args.cols, generator=gen)
    for dtype_name in args.dtypes:
        x = base.to(device, getattr(torch, dtype_name))
        x_bytes = x.numel() * x.element_size()
        t_copy = device_seconds(x.clone, args.repeats)
        for bits in args.bits:
            q = quantize(x, bits, args.group_size, seed=0)
            moved = (x_bytes + q.nbytes) / 1e9
            row = {"dtype": dtype_name, "bits": bits, "copy_ms": t_copy * 1e3, "configs": {}}
            for cfg in kq.CONFIGS:
                with kq.forced_config(cfg):
                    t_q = device_seconds(
                        lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0), args.repeats
                    )
                    t_d = device_seconds(q.dequantize, args.repeats)
                row["configs"][str(tuple(cfg))] = {
                    "quantize_ms": t_q * 1e3,
                    "quantize_pct_copy_bw": 100 * moved / t_q / (2 * x_bytes / 1e9 / t_copy),
                    "dequantize_ms": t_d * 1e3,
                    "dequantize_pct_copy_bw": 100 * moved / t_d / (2 * x_bytes / 1e9 / t_copy),
                }
            res["rows"].append(row)
    res["tuned"] = {str(k): [list(c), {str(tuple(a)): ms for a, ms in t.items()}]
                    for k, (c, t) in kq.tuning_log().items()}  # fmt: skip
    return res


def _configs_table(res: dict) -> str:
    lines = [f"shape={tuple(res['shape'])}; device ms (CUDA events, back-to-back launches)",
             "| dtype | bits | config | quantize ms | % copy bw | dequantize ms | % copy bw |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["rows"]:
        for cfg, c in r.get("configs", {str(tuple(k)): None for k in res["configs"]}).items():
            if c is None:
                lines.append(f"| {r['dtype']} | {r['bits']} | {cfg} | (dry) | | | |")
                continue
            lines.append(
                f"| {r['dtype']} | {r['bits']} | {cfg} | {c['quantize_ms']:.4g} "
                f"| {c['quantize_pct_copy_bw']:.0f} % | {c['dequantize_ms']:.4g} "
                f"| {c['dequantize_pct_copy_bw']:.0f} % |"
            )
    for key, (cfg, _) in res.get("tuned", {}).items():
        lines.append(f"tuner: {key} -> {tuple(cfg)}")
    return "\n".join(lines)


def quantize(args) -> None:
    """Throughput of `quantize` / `QTensor.dequantize` against a plain device copy.

    On CUDA this measures the Triton kernels, on CPU the PyTorch reference path. For each
    input dtype (fp32 and bf16 by default) and bit width it reports the median time and the
    bandwidth each direction reaches, counted on the bytes it really moves (quantize: reads the
    input, writes codes and metadata; dequantize: the reverse), as a share of the bandwidth of
    ``x.clone()`` of the same tensor measured in the same run (a copy reads and writes it: 100
    % = moving bytes as fast as a copy does). The time relative to the copy is reported too
    (``x copy``). The first call of each bit width tunes the kernels' launch configuration (on
    CUDA); the warmup calls absorb it. Shapes: (169343, 256) on CUDA, (16384, 256) on CPU;
    ``--dry`` is a few seconds on a CPU.

    ``--sass`` compiles the kernels for sm_90 (H100/H200) with Triton's bundled ``ptxas``,
    without a GPU, and prints the SASS instructions each thread executes per element of a
    dense 256-wide tensor, with the vector width of the loads and stores: the kernels'
    arithmetic cost, which bounds their bandwidth when it exceeds what the memory system needs
    (``--sass-all``: every tuner configuration, fp16 too).

    On CUDA the table has a second part: the same times from CUDA events around launches
    queued back to back (device time, without the host's launch path that the wall-clock
    median includes). ``--configs`` times each direction under every configuration the tuner
    chooses from, and prints the tuner's choices and timings."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sass:
        if args.sass_all:
            from gact_graph.kernels.quantize import CONFIGS

            print(sass_report(args.bits, args.group_size, ("fp32", "bf16", "fp16"), CONFIGS))
        else:
            print(sass_report(args.bits, args.group_size))
        return
    if args.dry:
        args.device, args.rows, args.numel, args.repeats, args.warmup = "cpu", 512, None, 2, 1
    cuda = args.device.startswith("cuda")
    if args.rows is None:
        args.rows = 169343 if cuda else 16384
    if args.repeats is None:
        args.repeats = 50 if cuda else 7
    if args.configs:
        if not cuda and not args.dry:
            raise SystemExit(
                "--configs times the Triton kernels: it needs --device cuda (or --dry)"
            )
        res = config_report(args)
        print(_configs_table(res))
    else:
        res = _quantize_run(args)
        print(_quantize_table(res))
    _write_json(args.json, res)


# ------------------------------------------------------------------------------ gat-edge
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_graph(num_nodes: int, num_edges: int, device: torch.device, seed: int = 0,
               dataset: str | None = None):  # fmt: skip
    """Random edges in both directions (or ``dataset``'s edges, e.g. ``synthetic-ogbn-arxiv``:
    heavy-tailed degrees), plus one self-loop per node: ``(edge_index, rowptr, col, num_nodes)``
    (the edge list in PyG's order, the destination-sorted CSR)."""
    if dataset is not None:  # (its edge list holds both directions already)
        from gact_graph.datasets import load_dataset

        data = load_dataset(dataset)
        ei, num_nodes = data.edge_index, data.num_nodes
        ei = ei[:, ei[0] != ei[1]]
    else:
        g = torch.Generator().manual_seed(seed)
        ei = torch.randint(0, num_nodes, (2, num_edges), generator=g)
        ei = ei[:, ei[0] != ei[1]]
        ei = torch.cat([ei, ei.flip(0)], 1)
    loops = torch.arange(num_nodes).expand(2, -1)
    ei = torch.cat([ei, loops], 1)
    dst, order = ei[1].sort(stable=True)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=num_nodes).cumsum(0)
    col = ei[0, order].to(torch.int32)
    return ei.to(device), rowptr.to(device), col.to(device), num_nodes


def stock_edge_stage(x, a_src, a_dst, edge_index, slope: float, p: float):
    """`GATConv`'s edge stage as PyG 2.8 runs it (edge_update, message, aggregate)."""
    from torch_geometric.utils import scatter, softmax

    src, dst = edge_index
    alpha = F.leaky_relu(a_src[src] + a_dst[dst], slope)
    alpha = softmax(alpha, dst, num_nodes=x.size(0))
    alpha = F.dropout(alpha, p, training=p > 0)
    return scatter(alpha.unsqueeze(-1) * x[src], dst, 0, x.size(0), reduce="sum")


def stock_gatv2_edge_stage(x_l, x_r, att, edge_index, slope: float, p: float):
    """`GATv2Conv`'s edge stage as PyG 2.8 runs it (message, aggregate)."""
    from torch_geometric.utils import scatter, softmax

    src, dst = edge_index
    x_j = x_l[src]
    z = F.leaky_relu(x_j + x_r[dst], slope)
    alpha = softmax((z * att).sum(-1), dst, num_nodes=x_l.size(0))
    alpha = F.dropout(alpha, p, training=p > 0)
    return scatter(alpha.unsqueeze(-1) * x_j, dst, 0, x_l.size(0), reduce="sum")


def _edge_timed(fn, device: torch.device, repeats: int) -> tuple[float, int | None]:
    """(median ms, peak bytes above the start or None) of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return triton.testing.do_bench(fn, warmup=10, rep=max(50, repeats)), peak
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), None


def _gat_edge_run(args: argparse.Namespace) -> dict:
    from gact_graph.kernels import gat_rows, triton_available
    from gact_graph.sparse import gat as sgat
    from gact_graph.sparse import gat_fused as sfused
    from gact_graph.sparse import gatv2 as sgatv2

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    ei, rowptr, col, n = make_graph(args.nodes, args.edges, device, dataset=args.dataset)
    h, c = args.heads, args.channels
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, c, generator=g).to(device, dtype).requires_grad_()
    a_src = torch.randn(n, h, generator=g).to(device).requires_grad_()
    a_dst = torch.randn(n, h, generator=g).to(device).requires_grad_()
    grad_out = torch.randn(n, h, c, generator=g).to(device, torch.promote_types(dtype, a_src.dtype))
    leaves = [x, a_src, a_dst]
    transpose = gat_rows.csr_transpose(rowptr, col, n)
    slope, p = 0.2, args.dropout

    def step(forward):
        def fn():
            for t in leaves:
                t.grad = None
            forward().backward(grad_out)

        fn.forward = forward
        return fn

    kernels_run = triton_available() and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if args.op == "gat":
        variants = {
            "stock PyG": step(lambda: stock_edge_stage(x, a_src, a_dst, ei, slope, p)),
            "chunked": step(lambda: sgat.gat_attention(x, a_src, a_dst, rowptr, col, slope, p)),
        }
        if kernels_run:
            variants["triton"] = step(
                lambda: sfused.gat_attention_fused(
                    x, a_src, a_dst, rowptr, col, slope, p, transpose
                )
            )
    else:  # GATv2: x_l = x, x_r and att in place of the node logits
        x_r = torch.randn(n, h, c, generator=g).to(device, dtype).requires_grad_()
        att = torch.randn(1, h, c, generator=g).to(device).requires_grad_()
        leaves[:] = [x, x_r, att]
        variants = {
            "stock PyG": step(lambda: stock_gatv2_edge_stage(x, x_r, att, ei, slope, p)),
            "chunked": step(lambda: sgatv2.gatv2_attention(x, x_r, att, rowptr, col, slope, p)),
        }
        if kernels_run:
            variants["triton"] = step(
                lambda: sfused.gatv2_attention_fused(x, x_r, att, rowptr, col, slope, p, transpose)
            )
    rows = []
    for name, fn in variants.items():
        ms, peak = _edge_timed(fn, device, args.repeats)
        with torch.no_grad():
            fwd_ms, _ = _edge_timed(fn.forward, device, args.repeats)
        rows.append({"variant": name, "ms": ms, "forward_ms": fwd_ms, "peak_bytes": peak})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_stock"] = r["ms"] / base
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    max_degree = int((rowptr[1:] - rowptr[:-1]).max()) if n else 0
    return {
        "op": args.op,
        "graph": args.dataset or "random",
        "max_in_degree": max_degree,
        "device": device_name,
        "nodes": n,
        "edges_with_loops": int(col.numel()),
        "heads": h,
        "channels": c,
        "dtype": args.dtype,
        "dropout": p,
        "triton": "ran" if kernels_run else "skipped (needs CUDA or TRITON_INTERPRET=1)",
        "rows": rows,
    }


def _gat_edge_table(res: dict) -> str:
    lines = [
        f"{res['op'].upper()} edge stage fwd+bwd on {res['device']}: {res['graph']} graph, "
        f"{res['nodes']:,} nodes, {res['edges_with_loops']:,} edges (max in-degree "
        f"{res['max_in_degree']:,}), H={res['heads']}, C={res['channels']}, "
        f"{res['dtype']}, dropout {res['dropout']}; triton {res['triton']}",
        f"{'variant':<12} {'fwd+bwd ms':>10} {'vs stock':>9} {'fwd ms':>9} {'peak MiB':>9}",
    ]
    for r in res["rows"]:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['variant']:<12} {r['ms']:>10.3f} {r['vs_stock']:>9.2f} {r['forward_ms']:>9.3f} "
            f"{peak:>9}"
        )
    return "\n".join(lines)


def gat_edge(args) -> None:
    """GAT's (or GATv2's) edge stage, forward + backward: the fused Triton kernels against the
    chunked PyTorch stage and stock PyG's message passing.

    The edge stage is everything between the node-level logits and the aggregated output: per
    edge ``a_src[src] + a_dst[dst]``, leaky ReLU, the softmax over each destination's edges,
    attention dropout, ``alpha * x'[src]`` summed into the destination. Stock is what
    `GATConv` runs (PyG's `softmax`, `F.dropout`, the gathered messages and `scatter`);
    "chunked" is `GatAttentionFunction`; "triton" is `GatFusedFunction`
    (`gact_graph.kernels.gat_edge`). Each row times one forward and one backward (into x',
    a_src, a_dst) of the same inputs; on CUDA with `triton.testing.do_bench` (median) and the
    peak memory above the inputs, on CPU with a wall clock; the forward alone (under no_grad)
    is timed too.

    The graph has ogbn-arxiv's size by default: 169,343 nodes, 1,166,243 random edges made
    undirected (both directions), self-loops added as GAT adds them; H = 3 heads of C = 128.
    ``--dataset synthetic-ogbn-arxiv`` takes heavy-tailed degrees instead; ``--dry-run`` is a
    tiny graph on CPU (under ``TRITON_INTERPRET=1`` the kernels too, interpreted)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run:
        args.nodes, args.edges, args.channels = (48, 160, 8) if interpreted else (200, 800, 12)
    if args.repeats is None:
        args.repeats = 100 if args.device.startswith("cuda") else 1 if interpreted else 3
    res = _gat_edge_run(args)
    print(_gat_edge_table(res))
    _write_json(args.json, res)


# ------------------------------------------------------------------------------ command line
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = harness.subcommand(sub, step)
    p.add_argument("--device", default=CUDA)
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument("--scale", type=float, default=None, help="default: 1.0 CUDA, 0.02 CPU")
    p.add_argument("--models", default="gcn,gat,gcnii")
    p.add_argument(
        "--methods",
        default="stock,L1-4bit,L1-2bit,L1-2bit-adaptive",
        help=f"comma list of {', '.join(STEP_METHODS)} (adaptive is dropped if it does not work)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--steps", type=int, default=10, help="timed rounds")
    p.add_argument(
        "--time-budget", type=float, default=None, help="seconds in all; fewer rounds if short"
    )
    p.add_argument("--layers", type=int, default=None, help="override the presets' depth")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--graph-check",
        default=None,
        choices=("forward", "version"),
        help="compress_gnn's graph_check for every compressed method (default: its own default)",
    )
    p.add_argument("--json", default="results/step_time.json")

    p = harness.subcommand(sub, epoch)
    p.add_argument("--device", default=CUDA)
    p.add_argument("--models", default=",".join(EPOCH_MODELS))
    p.add_argument("--methods", default="stock,default,default-min_bytes0")
    p.add_argument("--warmup", type=int, default=3, help="untimed epochs")
    p.add_argument("--epochs", type=int, default=50, help="timed epochs")
    p.add_argument("--no-eval", action="store_true", help="an epoch is the training step only")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry", action="store_true", help="tiny CPU run (a tenth of the graph)")
    p.add_argument("--json", default="results/small_graph_epoch.json")

    p = harness.subcommand(sub, host)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: syncs counted by CUDA)")
    p.add_argument("--tree", default=None, help="checkout to import gact_graph from")
    p.add_argument("--model", default="gcn", help="gcn, gat, gatv2 or gcnii (arxiv presets)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--hidden", type=int, default=None, help="override the preset's width")
    p.add_argument("--nodes", type=int, default=400, help="tiny graph: host time dominates")
    p.add_argument("--edges", type=int, default=2000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument(
        "--methods", default="stock,fixed-2bit,default", help="stock, fixed-2bit, default"
    )
    p.add_argument("--graph-check", default=None, help="forward or version (passed when not None)")
    p.add_argument("--min-bytes", type=int, default=None, help="passed when not None")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before counting")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--top", type=int, default=12, help="op kinds listed")
    p.add_argument("--cprofile", type=int, default=0, help="list the N functions of most own time")
    p.add_argument("--callers", default=None, help="with --cprofile: callers of these (regex)")
    p.add_argument("--json", default=None)

    p = harness.subcommand(sub, adapt)
    p.add_argument("--dataset", default="cora")
    p.add_argument("--root", default=None)
    p.add_argument("--scale", type=float, default=None, help="synthetic graphs only")
    p.add_argument("--model", choices=["gcn", "gat", "gcnii"], default="gcn")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--bits", type=float, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--alg1-repeats", type=int, default=1, help="estimates timed per estimator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)

    p = harness.subcommand(sub, quantize)
    p.add_argument("--device", default=CUDA)
    p.add_argument("--rows", type=int, default=None, help="default 169343 (cuda) / 16384 (cpu)")
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--numel", type=int, default=None, help="overrides --rows: numel // cols rows")
    p.add_argument("--bits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--dry", action="store_true", help="tiny CPU run: checks the command works")
    p.add_argument("--sass", action="store_true", help="SASS instructions per element (no GPU)")
    p.add_argument(
        "--sass-all",
        action="store_true",
        help="with --sass: every tuner configuration and fp16 too, not the default's",
    )
    p.add_argument(
        "--configs",
        action="store_true",
        help="device time under each tuner configuration, and the tuner's choice "
        "(CUDA; with --dry: list what would be timed)",
    )
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=None, help="default 50 (cuda) / 7 (cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")

    p = harness.subcommand(sub, gat_edge)
    p.add_argument("--device", default=CUDA)
    p.add_argument("--op", choices=["gat", "gatv2"], default="gat")
    p.add_argument("--nodes", type=int, default=169_343)
    p.add_argument("--edges", type=int, default=1_166_243, help="before both directions")
    p.add_argument(
        "--dataset",
        default=None,
        help="take this dataset's edges instead of random ones, e.g. synthetic-ogbn-arxiv",
    )
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=None, help="default 100 (cuda) / 3 (cpu)")
    p.add_argument("--dry-run", action="store_true", help="a tiny graph, to check it runs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")

    return harness.dispatch(ap, argv)


if __name__ == "__main__":
    main()
