"""Memory: what a training step saves and holds, stock PyG FP32 against ``compress_gnn``, and
what that buys. One subcommand per measurement:

    python benchmarks/memory.py activations   # saved bytes and peak of a step, per method
    python benchmarks/memory.py pointwise     # bytes the pointwise ops save (CPU)
    python benchmarks/memory.py activation-bias   # what ELU / GELU / SiLU keep: bias, bytes
    python benchmarks/memory.py scaling       # deepest / widest GCN and GCNII under a budget
    python benchmarks/memory.py probe-peak    # GAT / GATv2 worst step: user's work or probe's
    python benchmarks/memory.py trace         # where a step's peak is (a diagnostic)

``python benchmarks/memory.py SUBCOMMAND --help`` says what each measures and its flags.
Figures: docs/results/memory.md, scaling.md, gpu.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.datasets import load_dataset  # noqa: E402
from gact_graph.models import build_model, preset  # noqa: E402

# ------------------------------------------------------------------------------ activations
#: method -> compress_gnn keyword arguments (None: stock PyG, nothing installed)
METHODS = {
    "stock": None,
    "lossless": {"bits": None},
    "int4": {"bits": 4, "adaptive": False},
    "int2": {"bits": 2, "adaptive": False},
    "pointwise": {"bits": None, "sparse": False},
    "int2-nopw": {"bits": 2, "adaptive": False, "pointwise": False},
}


def _activations_one(args: argparse.Namespace, model_name: str, method: str) -> dict:
    """One (model, method) in this process: saved bytes, then the peak of one step."""
    from gact_graph.memory import PeakMemory, saved_bytes_stats

    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    device = torch.device(args.device)
    kwargs = {"seed": args.seed}
    if args.dataset.startswith("synthetic"):
        kwargs["scale"] = args.scale
    data = load_dataset(args.dataset, **kwargs)
    x, edge_index, y = data.x.to(device), data.edge_index.to(device), data.y.to(device)
    train = data.train_mask.to(device)
    cfg = preset(model_name, args.dataset)["model"]
    torch.manual_seed(args.seed)
    model = build_model(model_name, data.num_features, data.num_classes, **cfg).to(device)
    model.train()

    def forward():
        return model(x, edge_index)

    def step():
        out = forward()
        loss = F.cross_entropy(out[train], y[train])
        loss.backward()
        model.zero_grad(set_to_none=True)

    result = {
        "model": model_name,
        "method": method,
        "model_config": cfg,
        "num_nodes": int(data.num_nodes),
        "num_edges": int(edge_index.size(1)),
        "num_features": int(data.num_features),
    }
    ctl = None
    if method == "stock":
        stats = saved_bytes_stats(model, forward)
        result["saved_bytes"] = stats["total"]["orig_bytes"]
        if not args.saved_only:
            step()  # warm-up
    else:
        ctl = compress_gnn(model, **METHODS[method])
        if args.saved_only:
            forward()  # warm-up: builds the shared adjacency
        else:
            step()  # warm-up: builds the shared adjacency
        out = forward()  # the stats of one forward
        stats = ctl.stats()
        result["saved_bytes"] = stats["total"]["stored_bytes"]
        result["saved_orig_bytes"] = stats["total"]["orig_bytes"]
        del out
        model.zero_grad(set_to_none=True)
        paths = ctl.module_paths
        result["module_paths"] = {
            p: v for p, v in paths.items() if "conv" in p and p.count(".") == 1
        }
    result["saved_by_kind"] = {
        k: v["stored_bytes" if ctl is not None else "orig_bytes"]
        for k, v in stats["by_kind"].items()
    }

    if args.saved_only:
        if ctl is not None:
            ctl.remove()
        return result
    _release_free_memory(device)
    t0 = time.perf_counter()
    with PeakMemory(device) as pm:
        step()
    result["step_seconds"] = time.perf_counter() - t0
    result["peak_bytes"] = pm.peak_bytes
    result["base_bytes"] = pm.baseline_bytes
    if ctl is not None:
        result["live_after_backward"] = ctl.stats()["live_stored_bytes"]
        ctl.remove()
    return result


def _release_free_memory(device) -> None:
    """Hand memory freed by the warm-up back to the OS, so the measured step's RSS peak is its
    own (glibc keeps freed heap pages otherwise, and the step would reuse them unseen)."""
    import ctypes

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _mb(b: float) -> str:
    return f"{b / 2**20:9.1f}"


def activations_table(results: list[dict]) -> str:
    head = (
        f"{'model':<6} {'method':<10} {'saved MB':>9} {'x stock':>8} {'peak MB':>9} "
        f"{'step MB':>9} {'x stock':>8} {'sec':>6}"
    )
    rows = [head, "-" * len(head)]
    stock = {r["model"]: r for r in results if r.get("method") == "stock" and "error" not in r}
    for r in results:
        if "error" in r:
            rows.append(f"{r['model']:<6} {r['method']:<10} ERROR {r['error'][:60]}")
            continue
        s = stock.get(r["model"])
        ratio_saved = f"{s['saved_bytes'] / r['saved_bytes']:8.2f}" if s else f"{'':>8}"
        if "peak_bytes" not in r:  # --saved-only
            rows.append(f"{r['model']:<6} {r['method']:<10} {_mb(r['saved_bytes'])} {ratio_saved}")
            continue
        step = r["peak_bytes"] - r["base_bytes"]
        s_step = (s["peak_bytes"] - s["base_bytes"]) if s else 0
        ratio_step = f"{s_step / step:8.2f}" if s and step > 0 else f"{'':>8}"
        rows.append(
            f"{r['model']:<6} {r['method']:<10} {_mb(r['saved_bytes'])} {ratio_saved} "
            f"{_mb(r['peak_bytes'])} {_mb(step)} {ratio_step} {r['step_seconds']:6.1f}"
        )
    return "\n".join(rows)


def _activations_worker(args, model: str, method: str) -> dict:
    """One (model, method) in a fresh subprocess: its RESULT row, or the error it ended with."""
    cmd = [
        sys.executable, __file__, "activations", "--worker", model, method, "--dataset",
        args.dataset, "--scale", str(args.scale), "--device", args.device, "--seed",
        str(args.seed),
    ] + (["--saved-only"] if args.saved_only else [])  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            r = {"model": model, "method": method, "error": " | ".join(tail)}
        else:
            r = json.loads(lines[-1][len("RESULT ") :])
    except subprocess.TimeoutExpired:
        r = {"model": model, "method": method, "error": f"timeout {args.timeout}s"}
    r["wall_seconds"] = time.perf_counter() - t0
    return r


def _activations_report(args, results: list[dict]) -> None:
    report = {
        "benchmark": "activation_memory",
        "dataset": args.dataset,
        "scale": args.scale,
        "device": args.device,
        "peak_measure": "cuda max_memory_allocated" if args.device.startswith("cuda")
        else "process peak RSS (VmHWM)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "results": results,
    }  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


def activations(args) -> None:
    """Activation memory of one full-batch training step: stock PyG FP32 vs ``compress_gnn``.

    For each model (GCN 3 x 256 with BatchNorm, GAT 3 layers x 3 heads x 128, GCNII 16 x 256:
    the ogbn-arxiv presets of `gact_graph.models.preset`) on the synthetic ogbn-arxiv-sized
    graph and each method:

    - ``stock``: PyTorch Geometric as is, FP32;
    - ``lossless``: ``compress_gnn(model, bits=None)`` (sparse paths and dedup, no
      quantization);
    - ``int4`` / ``int2``: ``compress_gnn(model, bits=4 / 2, adaptive=False)`` (fixed bits);
    - ``pointwise``: only the pointwise ops of `gact_graph.ops` (1-bit masks, regenerated
      dropout, inverted activations), everything else lossless (``bits=None, sparse=False``):
      what those ops save alone;
    - ``int2-nopw``: ``int2`` with ``pointwise=False``, so ``int2`` against it is what the
      pointwise ops add on top of quantization and the graph-aware paths,

    it measures

    - saved-for-backward bytes of one forward: stock via `gact_graph.memory.saved_bytes_stats`
      (``total.orig_bytes``), ours via ``ctl.stats()["total"]["stored_bytes"]`` (the same
      accounting: parameters and the model's inputs are excluded, the shared adjacency counted
      once);
    - peak memory of one forward + backward (`gact_graph.memory.PeakMemory`: CUDA max
      allocated on GPU, process peak RSS on CPU) after one warm-up step, so one-time work
      (building the shared adjacency, lazy init) is not in it; ``peak - base`` is what the
      step itself added (on CPU the warm-up's freed heap is returned to the OS first with
      ``malloc_trim``, so the step's own allocations show in the RSS).

    Every (model, method) runs in a fresh subprocess so peaks never mix. Prints a table and
    writes JSON (``--json``). Full scale (``--scale 1``) needs more than 13 GB for stock GAT.
    ``--scale 0.05`` is a small CPU run (minutes)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print("RESULT " + json.dumps(_activations_one(args, *args.worker)), flush=True)
        return
    models = harness.names(args.models)
    methods = harness.names(args.methods)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {list(METHODS)}")
    configs = [(model, method) for model in models for method in methods]
    results: list[dict | None] = [None] * len(configs)
    # each configuration is its own process, so CUDA peaks never mix (the counters are per
    # process); --jobs runs several at once: most of a run's wall time is start-up
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_activations_worker, args, *c): i for i, c in enumerate(configs)}
        for fut in as_completed(futures):
            r = fut.result()
            results[futures[fut]] = r
            print(f"  done {r['model']}/{r['method']} in {r['wall_seconds']:.0f}s", file=sys.stderr)
            # partial runs keep their rows
            _activations_report(args, [x for x in results if x is not None])
    print(activations_table(results))
    print(f"wrote {args.json}")


# ------------------------------------------------------------------------------ pointwise
class _Op(nn.Module):
    def __init__(self, op, then_linear=False, width=256):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(width, 8) if then_linear else None

    def forward(self, x):
        y = self.op(x * 1.0)  # x * 1.0: the op's input is an activation, not the model input
        return self.lin(y) if self.lin is not None else y


OPS = {
    "relu": torch.relu,
    "leaky_relu(0.2)": lambda t: F.leaky_relu(t, 0.2),
    "hardtanh": F.hardtanh,
    "relu6": F.relu6,
    "clamp(-1,1)": lambda t: torch.clamp(t, -1, 1),
    "dropout(0.5)": lambda t: F.dropout(t, 0.5),
    "elu": F.elu,
    "gelu": F.gelu,
    "silu": F.silu,
}


def _per_element(n=20000, f=256):
    from gact_graph.memory import saved_bytes_stats

    rows = []
    x = torch.randn(n, f, requires_grad=True)
    numel = n * f
    for name, op in OPS.items():
        for then_linear in (False, True):
            m = _Op(op, then_linear, f)
            stock = saved_bytes_stats(m, lambda m=m: m(x))["total"]["orig_bytes"]
            row = {"op": name, "then_linear": then_linear, "stock": stock / numel}
            for bits in (None, 2):
                for pw in (False, True):
                    with compress_gnn(
                        m, bits=bits, adaptive=False, pointwise=pw, sparse=False
                    ) as ctl:
                        out = m(x)
                        st = ctl.stats()
                        del out
                    row[f"bits={bits},pointwise={pw}"] = st["total"]["stored_bytes"] / numel
            rows.append(row)
    return rows


def _model_bytes(model, data, steps=3):
    from gact_graph.memory import saved_bytes_stats

    model.train()
    x, ei = data.x, data.edge_index

    def fwd():
        return model(x, ei)

    stock = saved_bytes_stats(model, fwd)
    res = {"stock_MB": stock["total"]["orig_bytes"] / 2**20}
    for sparse in (False, True):
        for bits in (None, 2):
            for pw in (False, True):
                with compress_gnn(
                    model, bits=bits, adaptive=False, pointwise=pw, sparse=sparse
                ) as ctl:
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        out = fwd()
                        st = ctl.stats()
                        out.square().mean().backward()
                        times.append(time.perf_counter() - t0)
                        ctl.iterate()
                    key = f"sparse={sparse},bits={bits},pointwise={pw}"
                    res[key + "_MB"] = st["total"]["stored_bytes"] / 2**20
                    res[key + "_by_kind_MB"] = {
                        k: round(v["stored_bytes"] / 2**20, 3)
                        for k, v in st["by_kind"].items()
                        if v["count"]
                    }
                    res[key + "_step_s"] = sorted(times)[len(times) // 2]
    return res


def pointwise(args) -> None:
    """Bytes saved for backward by the pointwise ops: per element (each op alone), and on a
    3-layer GCN (256 hidden, BN, ReLU, dropout .5) and a GAT (ELU) on a 20k-node random graph.

    Run with ``OMP_NUM_THREADS=1``; writes ``OUT`` (default bench_pointwise.json)."""
    from gact_graph.datasets import make_synthetic_graph
    from gact_graph.models import GAT, GCN

    torch.manual_seed(0)
    out = {"per_element": _per_element(), "per_element_bf16_note": "float32 inputs, CPU"}
    print(
        f"{'op':<16} {'next saves y':<12} {'stock':>7} {'ours':>7} {'stock@2b':>9} {'ours@2b':>8}"
    )
    for r in out["per_element"]:
        print(
            f"{r['op']:<16} {str(r['then_linear']):<12} {r['stock']:>7.3f} "
            f"{r['bits=None,pointwise=True']:>7.3f} {r['bits=2,pointwise=False']:>9.3f} "
            f"{r['bits=2,pointwise=True']:>8.3f}"
        )
    data = make_synthetic_graph(20000, 137000, 128, 40, seed=0)
    print("graph:", data.num_nodes, "nodes", data.edge_index.size(1), "directed edges")
    out["graph"] = {"nodes": data.num_nodes, "edges": data.edge_index.size(1), "features": 128}
    torch.manual_seed(0)
    gcn = GCN(128, 256, 40, num_layers=3, dropout=0.5, batch_norm=True)
    out["gcn"] = _model_bytes(gcn, data)
    torch.manual_seed(0)
    gat = GAT(128, 64, 40, num_layers=3, heads=3, dropout=0.5, activation="elu")
    out["gat"] = _model_bytes(gat, data)
    for k in ("gcn", "gat"):
        print(k, json.dumps(out[k], indent=1))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


# ------------------------------------------------------------------------------ activation-bias
ACTS = {"elu": F.elu, "gelu": F.gelu, "silu": F.silu}


def bias_ratio(act, pointwise: bool, seeds: int, bits: int, n: int = 64, hidden: int = 64):
    from torch_geometric.nn import GCNConv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn = GCNConv(16, hidden), nn.BatchNorm1d(hidden)
            self.conv2 = GCNConv(hidden, 4)

        def forward(self, x, ei):
            return self.conv2(act(self.bn(self.conv1(x, ei))), ei)

    torch.manual_seed(0)
    model = Net()

    def grads():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, runs = grads(), []
    for seed in range(seeds):
        kw = dict(adaptive=False, min_numel=0, seed=seed, pointwise=pointwise)
        with compress_gnn(model, bits=bits, **kw):
            runs.append(grads())
    runs = torch.stack(runs)
    mean = runs.mean(0)
    floor = ((runs - mean).square().sum(1).mean() / (seeds - 1)).sqrt()
    return float((mean - ref).norm() / floor)


class _LinActLin(nn.Module):
    def __init__(self, act, dropout: bool):
        super().__init__()
        self.a, self.c, self.act, self.dropout = nn.Linear(64, 256), nn.Linear(256, 8), act, dropout

    def forward(self, x):
        h = self.act(self.a(x))
        return self.c(F.dropout(h, 0.5) if self.dropout else h)


def bytes_per_element(act, dropout: bool, bits: int | None) -> float:
    x = torch.randn(4096, 64)

    def stored(fn) -> int:
        torch.manual_seed(0)
        model = _LinActLin(fn, dropout)
        with compress_gnn(model, bits=bits, adaptive=False, min_numel=0, sparse=False) as ctl:
            out = model(x)
            nbytes = ctl.stats()["total"]["stored_bytes"]
            out.sum().backward()
        return nbytes

    return (stored(act) - stored(lambda t: t * 1)) / (4096 * 256)


def activation_bias(args) -> None:
    """Bias and bytes of what ELU, GELU and SiLU keep for backward (`gact_graph.ops.inverted`).

    Bias: GCNConv -> BatchNorm -> activation -> GCNConv on a 64-node random graph, fixed bits
    (``compress_gnn(model, bits, adaptive=False, min_numel=0)``), the gradient of every
    parameter averaged over ``--seeds`` rounding seeds. Printed: the error of that mean against
    stock's gradient over the noise floor (the spread of one seed's gradient over
    sqrt(seeds)); about 1 where the rounding is unbiased, growing like sqrt(seeds) where it is
    not. With the pointwise ops (``pointwise=True``) and on the generic path
    (``pointwise=False``: the input quantized).

    Bytes: what the activation adds to ``ctl.stats()``'s stored bytes per element of its input
    (a 4096 x 256 Linear -> activation -> Linear, against the same model with ``t * 1`` in its
    place), where the next layer keeps the output itself and where dropout sits between. Run
    with ``OMP_NUM_THREADS=1``."""
    print(f"error of the mean over the noise floor, {args.bits} bits, {args.seeds} seeds")
    for name, act in ACTS.items():
        ours, generic = (bias_ratio(act, pw, args.seeds, args.bits) for pw in (True, False))
        print(f"  {name:5s} pointwise {ours:5.2f}   generic {generic:5.2f}", flush=True)
    print("bytes per element the activation adds (pointwise), next layer keeps y / dropout between")
    for name, act in ACTS.items():
        row = [
            f"bits={bits}: {bytes_per_element(act, False, bits):.3f} / "
            f"{bytes_per_element(act, True, bits):.3f}"
            for bits in (None, 4, 2)
        ]
        print(f"  {name:5s}", "   ".join(row), flush=True)


# ------------------------------------------------------------------------------ scaling
GACT_TABLE4 = {
    "source": "GACT (Liu et al., ICML 2022) Table 4: GCN on ogbn-arxiv, 16 GB GPU",
    "max_depth": {"FP32": 24, "GACT": 152, "GACT+swap": 240},
    "max_width": {"FP32": 2464, "GACT": 3948, "GACT+swap": 4244},
}


def scaling(args) -> dict:
    """Deepest and widest GCN / GCNII that complete a training step under a memory budget.

    The GACT anchor (Table 4, 16 GB GPU, GCN on ogbn-arxiv): 24 layers in FP32, 152 with
    compression, 240 with compression + swap; hidden width 2464 / 3948 / 4244. This runs the
    same experiment for stock PyG FP32 and ``compress_gnn`` at L1 4 and 2 bits (adaptive when
    ``adaptive=True`` works, else fixed bits; it prints which) and L2 (compression + swap)
    when that opt level is implemented.

    The search (exponential, then binary) and the budget live in `benchmarks/harness.py`:

    - ``--device cuda``: ``torch.cuda.set_per_process_memory_fraction`` caps the allocator at
      ``--budget-gb`` and a configuration fits when its steps finish without OOM;
    - ``--device cpu``: byte accounting (parameters, gradients, optimizer state, graph inputs
      and the saved tensors as the controller counts them); runs anywhere, on small graphs.

    ``--device cuda --budget-gb 16`` compares with GACT Table 4 (16 GB, ogbn-arxiv-sized
    graph); ``--device cpu --budget-gb 0.03125 --num-nodes 2000 --depth-hidden 64
    --width-layers gcn=3,gcnii=8 --rel-tol 0.1`` is a few minutes on a CPU. Prints a table
    and writes JSON (``--json``)."""
    t_start = time.perf_counter()
    device = harness.start_run(args.device, args.threads)
    on_cuda = device.type == "cuda"
    budget_gb = args.budget_gb if args.budget_gb is not None else (16.0 if on_cuda else 1 / 32)
    budget = harness.gib(budget_gb)
    kwargs = {"seed": args.seed}
    if args.num_nodes is not None:
        kwargs["num_nodes"] = args.num_nodes
    elif args.scale is not None:
        kwargs["scale"] = args.scale
    elif not on_cuda:
        kwargs["num_nodes"] = 2000
    data = load_dataset(args.dataset, **kwargs)
    graph = harness.GraphInputs.from_data(data, device)
    gc.freeze()  # what exists now lives all run: keep it out of every trial's collection
    num_classes = int(data.num_classes)
    bits = tuple(int(b) for b in args.bits.split(","))
    methods, notes = harness.default_methods(
        bits, adaptive=False if args.no_adaptive else None, l2=False if args.no_l2 else None
    )
    if not on_cuda and any(m.compress and m.compress.get("opt_level") == "L2" for m in methods):
        notes.append(
            "L2 on CPU: swap bookkeeping simulated (swap_simulate=True); the accounting leaves "
            "out the compressed payloads it moved off the device, as a GPU would"
        )
    models = harness.names(args.models, lower=True)
    width_layers = {}
    for part in args.width_layers.split(","):
        name, _, value = part.partition("=")
        width_layers[name.strip().lower()] = int(value)
    searches = harness.names(args.searches)
    jobs = [(m, s, meth) for m in models for s in searches for meth in methods]

    env = harness.run_env(device, budget=harness.budget_meaning(on_cuda))
    header = {
        "benchmark": "scaling",
        "command": harness.command_line(args.argv),
        "env": env,
        "budget_gb": budget_gb,
        "graph": {"dataset": args.dataset, "num_nodes": graph.num_nodes,
                  "num_edges": graph.num_edges, "num_features": int(graph.x.shape[1]),
                  "num_classes": num_classes, "input_bytes": graph.nbytes},
        "depth_hidden": args.depth_hidden,
        "width_layers": width_layers,
        "rel_tol": args.rel_tol,
        "notes": notes,
        "reference": GACT_TABLE4,
    }  # fmt: skip
    print(f"# scaling: {env['device']}, budget {budget_gb:g} GiB ({env['budget']})")
    print(f"# graph {args.dataset}: {graph.num_nodes} nodes, {graph.num_edges} edges")
    for n in notes:
        print(f"# {n}")

    results: list[dict] = []
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cm = harness.cuda_budget(budget, device) if on_cuda else contextlib.nullcontext()
    with cm:
        for i, (model, search, method) in enumerate(jobs):
            deadline = None
            if args.time_budget is not None:
                left = args.time_budget - (time.perf_counter() - t_start)
                deadline = time.perf_counter() + max(0.0, left) / (len(jobs) - i)
            common = dict(out_channels=num_classes, budget_bytes=None if on_cuda else budget,
                          rel_tol=args.rel_tol, deadline=deadline, seed=args.seed,
                          progress=_progress if args.verbose else None)  # fmt: skip
            if search == "depth":
                res = harness.max_depth(model, graph, method, hidden_channels=args.depth_hidden,
                                        cap=args.max_depth, start=2, **common)  # fmt: skip
                fixed = {"hidden_channels": args.depth_hidden}
            elif search == "width":
                layers = width_layers.get(model, 3)
                res = harness.max_width(model, graph, method, num_layers=layers,
                                        unit=args.width_unit, start=args.width_unit,
                                        cap=args.max_width, **common)  # fmt: skip
                fixed = {"num_layers": layers}
            else:
                raise SystemExit(f"unknown search {search!r}")
            row = {"model": model, "search": search, "method": method.name,
                   "compress": method.compress, **fixed, **res.to_dict()}  # fmt: skip
            results.append(row)
            flag = " (capped)" if res.capped else " (timed out)" if res.timed_out else ""
            if res.error:
                flag = f" ERROR {res.error[:100]}"
            print(f"  {model:6s} {search:5s} {method.name:22s} -> {res.best}{flag} "
                  f"[{len(res.trials)} trials, {res.seconds:.1f}s]", flush=True)  # fmt: skip
            harness.write_results(out_path, header, results)
    print()
    print(scaling_table(results))
    print(f"\nwrote {out_path} ({time.perf_counter() - t_start:.0f}s)")
    return {**header, "results": results}


def _progress(rec: dict) -> None:
    b = rec.get("bytes", {})
    print(f"      {rec['value']:>6} {rec['reason']:6s} total {b.get('total', 0) / 2**20:8.2f} MiB "
          f"saved {b.get('saved', 0) / 2**20:8.2f} MiB peak {rec.get('peak_bytes', 0) / 2**20:8.1f}"
          f" MiB {rec['seconds']:6.1f}s", flush=True)  # fmt: skip


def _fmt(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "error"
    s = str(row["best"])
    if row.get("capped"):
        s = f">={s}"
    elif row.get("timed_out"):
        s = f">={s}*"
    elif (
        row.get("first_fail") is not None
        and row["first_fail"] - row["best"] > 1
        and (row["search"] == "depth" or row["first_fail"] - row["best"] > 8)
    ):
        s = f"{s}-{row['first_fail'] - 1}"  # bracket left by --rel-tol
    return s


def scaling_table(results: list[dict]) -> str:
    """Markdown table: per model and method, max depth / max width and the ratio to stock."""
    by = {(r["model"], r["search"], r["method"]): r for r in results}
    models = list(dict.fromkeys(r["model"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    lines = [
        "| model | method | max depth | x stock | max width | x stock |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for model in models:
        stock = next((m for m in methods if m.startswith("stock")), None)
        for method in methods:
            cells = []
            for search in ("depth", "width"):
                row = by.get((model, search, method))
                base = by.get((model, search, stock)) if stock else None
                ratio = "-"
                ok = row and base and not row.get("error") and not base.get("error")
                if ok and base["best"] and not base.get("capped") and not base.get("timed_out"):
                    bound = ">=" if row.get("capped") or row.get("timed_out") else ""
                    ratio = f"{bound}{row['best'] / base['best']:.1f}"
                cells += [_fmt(row), ratio]
            lines.append(f"| {model} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ probe-peak
def _dataless(t) -> bool:
    """A tensor subclass that holds no data of its own (a `RowChunked`, whose codes belong to
    its compressed tensor): its storage reports its full size but has no memory."""
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return True
    return False


def _cpu_meter(skip_dataless: bool):
    """`PeakBytes`, or (``skip_dataless``) one that does not count `_dataless` outputs, which
    it counts at their full size."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from gact_graph.budget.profile import PeakBytes

    if not skip_dataless:
        return PeakBytes

    class WithoutDataless(PeakBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            peak = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            dataless = [t for t in torch.utils._pytree.tree_leaves(out) if _dataless(t)]
            for t in dataless:
                known = self.table.pop(StorageWeakRef(t.untyped_storage()).cdata, None)
                if known is not None:
                    self.bytes -= known[1]
            if dataless:
                self.peak = max(peak, self.bytes)
            return out

    return WithoutDataless


def _tracing_meter(base, min_bytes: int, snapshots: list):
    """`PeakBytes` that also keeps, for every new storage of at least ``min_bytes``, the op,
    shape and frames that made it, and appends to ``snapshots`` the live ones at each new
    peak (``(peak bytes, where, [(bytes, op, shape, frames)])``, the last one the step's)."""

    def frames(skip: int) -> str:
        keep = ("gact_graph", "benchmarks", "autograd")
        stack = [f for f in traceback.extract_stack()[:-skip] if any(k in f.filename for k in keep)]
        return " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in stack[::-1][:4])

    class Tracing(base):
        def __init__(self):
            self.sites = {}
            super().__init__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = set(self.table)
            peak = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for k in set(self.table) - before:
                if self.table[k][1] >= min_bytes:
                    shape = next((tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                                  if isinstance(t, torch.Tensor)), ())  # fmt: skip
                    self.sites[k] = (str(func), shape, frames(3))
            if self.peak > peak:
                live = [(n, *self.sites.get(k, ("?", (), "")))
                        for k, (ref, n) in self.table.items()
                        if n >= min_bytes and not ref.expired()]  # fmt: skip
                snapshots.append((self.peak, frames(3), sorted(live, key=lambda t: -t[0])))
            return out

    return Tracing()


class _Meter:
    """Peak bytes above a step's start, overall and inside the probe's work."""

    def __init__(self, device: torch.device, trace_bytes: int | None = None,
                 skip_dataless: bool = False) -> None:  # fmt: skip
        self.device = device
        self.cpu = None
        self.trace_bytes, self.snapshots = trace_bytes, []
        self.skip_dataless = skip_dataless
        self.start = 0
        self.peak = 0
        self.probe_peak = 0

    def _now_peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return self.cpu.peak - self.start

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu._sweep()
            self.cpu.peak = self.cpu.bytes

    @contextlib.contextmanager
    def step(self):
        self.peak = self.probe_peak = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
        else:
            self.snapshots.clear()
            base = _cpu_meter(self.skip_dataless)
            meter = base() if self.trace_bytes is None else _tracing_meter(
                base, self.trace_bytes, self.snapshots
            )  # fmt: skip
            with meter as self.cpu:
                self.start = self.cpu.start
                yield
        self.peak = max(self.peak, self._now_peak())

    @contextlib.contextmanager
    def probe_work(self):
        """Count what runs inside as the probe's (the peaks before it are kept)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.peak = max(self.peak, self._now_peak())
        self._reset()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            inside = self._now_peak()
            self.probe_peak = max(self.probe_peak, inside)
            self.peak = max(self.peak, inside)
            self._reset()


def _instrument(meter: _Meter, paths: dict[str, int]):
    """Wrap the probe's replays and partial backwards in ``meter.probe_work`` and count the
    edge-stage Functions' forwards in ``paths``; returns the undo."""
    from gact_graph.policy import sensitivity
    from gact_graph.sparse import gat as sgat
    from gact_graph.sparse import gat_fused as sfused
    from gact_graph.sparse import gatv2 as sgatv2

    undo = []
    for name in ("_probe", "_propagate"):
        orig = getattr(sensitivity.SensitivityProbe, name)

        def wrapped(self, *args, _orig=orig, **kwargs):
            if meter.cpu is None and meter.device.type != "cuda":
                return _orig(self, *args, **kwargs)
            with meter.probe_work():
                return _orig(self, *args, **kwargs)

        setattr(sensitivity.SensitivityProbe, name, wrapped)
        undo.append((sensitivity.SensitivityProbe, name, orig))
    for cls in (sfused.GatFusedFunction, sfused.GatV2FusedFunction, sgat.GatAttentionFunction,
                sgatv2.GatV2AttentionFunction):  # fmt: skip
        orig = cls.forward

        def forward(ctx, *args, _orig=orig, _name=cls.__name__):
            paths[_name] = paths.get(_name, 0) + 1
            return _orig(ctx, *args)

        cls.forward = staticmethod(forward)
        undo.append((cls, "forward", staticmethod(orig)))
    return lambda: [setattr(obj, name, f) for obj, name, f in undo]


@contextlib.contextmanager
def _edge_stage(args):
    """``args.edge_kernel`` as `sfused.EDGE_KERNEL`, and (``args.kernel_reads == "dequantized"``)
    the fused Functions made to take their compressed features dequantized whole."""
    from gact_graph.sparse import gat_fused as sfused

    kernel = getattr(args, "edge_kernel", sfused.EDGE_KERNEL)
    codes = getattr(args, "kernel_reads", "codes") == "codes"
    fused = (sfused.GatFusedFunction, sfused.GatV2FusedFunction)
    before = sfused.EDGE_KERNEL, [cls.reads_row_chunks for cls in fused]
    sfused.EDGE_KERNEL = kernel
    for cls in fused:
        cls.reads_row_chunks = codes
    try:
        yield
    finally:
        sfused.EDGE_KERNEL = before[0]
        for cls, reads in zip(fused, before[1]):
            cls.reads_row_chunks = reads


def probe_peak_run(model_name: str, adaptive: bool, args, device: torch.device) -> dict:
    """``model_name`` (``gat`` or ``gatv2``) at 2 bits, fixed or adaptive, for ``args.steps``
    steps: each step's peak and its probe's, in N x H x C fp32 units (see `probe_peak`)."""
    with _edge_stage(args):
        torch.manual_seed(0)
        n, f = args.nodes, args.features
        x = torch.randn(n, f, device=device)
        ei = torch.randint(0, n, (2, args.degree * n), device=device)
        y = torch.randint(0, 8, (n,), device=device)
        model = harness.build_model(model_name, f, 8, num_layers=args.layers,
                                    hidden_channels=args.hidden)  # fmt: skip
        model = model.to(device)
        ctl = compress_gnn(model, bits=2, adaptive=adaptive)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        unit = n * args.heads * args.hidden * 4
        trace = getattr(args, "trace", False) and device.type == "cpu"
        skip = getattr(args, "skip_dataless", False)
        meter, paths = _Meter(device, unit // 5 if trace else None, skip), {}
        undo = _instrument(meter, paths)
        steps = []
        try:
            for i in range(args.steps):
                opt.zero_grad(set_to_none=True)
                paths.clear()
                with meter.step():
                    F.cross_entropy(model(x, ei), y).backward()
                opt.step()
                ctl.iterate()
                if trace and meter.snapshots:
                    peak, where, live = max(meter.snapshots, key=lambda snap: snap[0])
                    print(f"{model_name} step {i}: peak {(peak - meter.start) / unit:.2f} "
                          f"at {where}")  # fmt: skip
                    for nbytes, op, shape, made in live:
                        print(f"  {nbytes / unit:5.2f}  {op} {shape}  {made}")
                steps.append({
                    "step": i,
                    "peak_units": round(meter.peak / unit, 2),
                    "probe_peak_units": round(meter.probe_peak / unit, 2),
                    "edge_stage": dict(paths),
                })  # fmt: skip
        finally:
            undo()
            ctl.remove()
    return {"model": model_name, "mode": "default" if adaptive else "fixed 2-bit",
            "unit_bytes": unit, "steps": steps}  # fmt: skip


def edge_stage_peak(model_name: str, reads: str, args) -> dict:
    """Peak bytes (CPU, the planner's meter without dataless tensors) of one fused edge
    stage's backward (`GatFusedFunction` / `GatV2FusedFunction`, statistics recomputed as a
    compressing controller has them), its (N * H) x C features saved at 2 bits and handed
    back as a `RowChunked` (``reads="codes"``: what the probe hands a Function that reads row
    chunks; the kernels read the packed codes) or dequantized whole (``"dequantized"``), in
    units of one N x H x C fp32 tensor, with the number of new tensors of at least one unit."""
    from gact_graph.core.chunked import RowChunked
    from gact_graph.core.quantize import quantize
    from gact_graph.kernels import gat_rows
    from gact_graph.sparse import gat_fused as sfused

    torch.manual_seed(0)
    n, heads, channels = args.nodes, args.heads, args.hidden
    ei = torch.randint(0, n, (2, args.degree * n))
    ei = torch.cat([ei, torch.arange(n).repeat(2, 1)], 1)
    order = torch.argsort(ei[1], stable=True)
    col = ei[0, order].to(torch.int32)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(ei[1], minlength=n).cumsum(0)
    transpose = gat_rows.csr_transpose(rowptr, col, n)
    shape = (n * heads, channels)
    x = torch.randn(n, heads, channels, requires_grad=True)
    x_r = torch.randn(n, heads, channels, requires_grad=True)
    a_src, a_dst = (torch.randn(n, heads, requires_grad=True) for _ in range(2))
    att = torch.randn(1, heads, channels, requires_grad=True)

    def pack(t):
        return quantize(t.detach(), 2, seed=1) if tuple(t.shape) == shape else t

    def unpack(p):
        if isinstance(p, torch.Tensor):
            return p
        return RowChunked(p) if reads == "codes" else p.dequantize()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        if model_name == "gat":
            leaves = (x, a_src, a_dst)
            out = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, transpose=transpose)
        else:
            leaves = (x, x_r, att)
            out = sfused.gatv2_attention_fused(*leaves, rowptr, col, 0.2, transpose=transpose,
                                             recompute_stats=True)  # fmt: skip
    grad = torch.randn(out.shape)
    unit = n * heads * channels * 4
    with _cpu_meter(skip_dataless=True)() as meter:
        grads = torch.autograd.grad(out, leaves, grad)
        big = sum(1 for g in grads if g.numel() * 4 >= unit)
        peak = meter.peak - meter.start
    return {"model": model_name, "reads": reads, "peak_units": round(peak / unit, 2),
            "gradients_of_one_unit": big}  # fmt: skip


def probe_peak(args) -> None:
    """Per-step peak of a GAT / GATv2 under fixed 2-bit and the default (adaptive) mode.

    The peak is split into where it lies: the user's own forward and backward, or the
    sensitivity probe's work (its replays of an autograd node, `SensitivityProbe._probe`, and
    the partial backwards that carry their noise to the parameters,
    `SensitivityProbe._propagate`); and which edge stage each attention layer ran (the fused
    Triton Function or the chunked one).

    A re-planning step of the default mode probes every compressed tensor; the default mode's
    worst step is such a step when the probe's work peaks above the user's backward. The
    figures are in units of one N x H x C fp32 tensor of a hidden layer (the size of one
    projected feature tensor), so CPU and GPU runs at different sizes compare.

    Memory: on CUDA ``torch.cuda.max_memory_allocated`` above the bytes allocated at the
    step's start; on CPU the live bytes of tensors created during the step
    (`gact_graph.budget.profile.PeakBytes`, the budget planner's meter; no allocator
    involved). ``--device cuda`` runs at arxiv size, both models; ``--device cpu --nodes
    10000 --hidden 32`` on a CPU.

    ``--edge-kernel triton`` runs the fused Triton kernels wherever they apply (on CPU only
    under ``TRITON_INTERPRET=1``: slow, use a few hundred nodes); ``--kernel-reads
    dequantized`` has the fused Functions handed their compressed features dequantized whole
    inside the probe, as they were before they read the packed codes
    (`gact_graph.sparse.gat_fused._kernel_features`).

    ``--edge-stage`` measures one fused edge stage's backward alone (`edge_stage_peak`), its
    compressed features handed to it as the probe hands them (read by rows: the kernels read
    the packed codes) or dequantized whole, with the planner's meter (CPU; RowChunked not
    counted). ``--skip-dataless`` (CPU): the planner's meter counts a tensor subclass without
    data of its own (the probe's `RowChunked`) at its full size; this leaves it out.
    ``--trace`` (CPU): at each step's peak, print the tensors alive of at least a fifth of a
    unit, each with its op, shape and the frames that made it (slow; for finding what holds a
    peak)."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    results = []
    if args.edge_stage:
        for name in args.models.split(","):
            for reads in ("dequantized", "codes"):
                res = edge_stage_peak(name, reads, args)
                results.append(res)
                print(f"{name:6s} backward, features read as {reads:11s}: peak "
                      f"{res['peak_units']:5.2f} (N x H x C units; its gradients: "
                      f"{res['gradients_of_one_unit']})", flush=True)  # fmt: skip
        args.models = ""
    for name in filter(None, args.models.split(",")):
        for adaptive in (False, True):
            res = probe_peak_run(name, adaptive, args, device)
            results.append(res)
            for s in res["steps"]:
                print(f"{name:6s} {res['mode']:12s} step {s['step']}: peak {s['peak_units']:6.2f}"
                      f"  probe's work {s['probe_peak_units']:6.2f}  (N x H x C units)"
                      f"  {s['edge_stage']}", flush=True)  # fmt: skip
        fixed, default = results[-2], results[-1]
        worst = max(s["peak_units"] for s in default["steps"])
        print(f"{name}: worst step, default / fixed 2-bit = "
              f"{worst / max(s['peak_units'] for s in fixed['steps']):.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device":
                                   str(device), "results": results}, indent=1))  # fmt: skip


# ------------------------------------------------------------------------------ trace
TRACE_MODES = {"fixed": {"bits": 2, "adaptive": False}, "default": {"bits": 2}}


def _stepper(base, data, cfg, setting):
    model = copy.deepcopy(base).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    ctl = None if setting is None else compress_gnn(model, **setting)
    mask = data.train_mask

    def fn():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(data.x, data.edge_index)[mask], data.y[mask])
        loss.backward()
        return loss

    def step():
        fn()
        opt.step()
        if ctl is not None:
            ctl.iterate(fn)

    return step, ctl


def live_at_peak(snapshot: dict, top: int) -> list[str]:
    """Replay the allocator trace of ``snapshot``; the largest groups of blocks alive at the
    moment the most bytes were (grouped by their innermost frames in this project or PyG)."""
    live, cur, best, at_best = {}, 0, 0, {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    groups: collections.Counter = collections.Counter()
    for e in at_best.values():
        frames = [f for f in e.get("frames", []) if "gact_graph" in f["filename"]
                  or "torch_geometric" in f["filename"]][:4]  # fmt: skip
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
        groups[where] += e["size"]
    lines = [f"trace peak {best / 2**20:.0f} MiB above the step's start"]
    lines += [f"  {b / 2**20:8.1f} MiB  {k or '(outside)'}" for k, b in groups.most_common(top)]
    return lines


def trace(args) -> None:
    """Where a step's peak is: the tensors alive at the worst moment of one training step,
    grouped by the source lines that allocated them, for the fixed-bit and the default
    (adaptive) mode.

    On CUDA it records the caching allocator's history
    (`torch.cuda.memory._record_memory_history`, Python stacks) over one step (``--step``; the
    default mode probes steps 0, 1, 3, 7, ...), replays the trace to the moment the most bytes
    were live, and prints the largest groups. ``--profile`` adds a kernel table of one
    fixed-bit step and one stock step (`torch.profiler`), with the host syncs counted. The
    model is an ogbn-arxiv preset of `gact_graph.models.preset` on a synthetic graph of that
    dataset's statistics, as in ``benchmarks/speed.py step``.

    A diagnostic, not a benchmark: it writes no JSON; the figures it explains come from
    ``benchmarks/speed.py step`` (worst step above rest, per mode)."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    scale = args.scale if args.scale is not None else (1.0 if cuda else 0.01)
    data = load_dataset(args.dataset, scale=scale, seed=0).to(dev)
    cfg = preset(args.model, args.dataset)
    torch.manual_seed(0)
    base = build_model(args.model, data.num_features, int(data.num_classes), **cfg["model"])
    base = base.to(dev)
    print(f"# {args.model} on {args.dataset} x{scale:g} ({data.num_nodes} nodes), {dev}")
    if cuda:
        for name, setting in TRACE_MODES.items():
            step, ctl = _stepper(base, data, cfg, setting)
            for s in range(args.step + 1):
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                rest = torch.cuda.memory_allocated(dev)
                if s == args.step:
                    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
                step()
                torch.cuda.synchronize(dev)
                if s == args.step:
                    with tempfile.TemporaryDirectory() as tmp:
                        path = os.path.join(tmp, "snapshot.pickle")
                        torch.cuda.memory._dump_snapshot(path)
                        with open(path, "rb") as f:
                            snapshot = pickle.load(f)
                    torch.cuda.memory._record_memory_history(enabled=None)
                peak = torch.cuda.max_memory_allocated(dev) - rest
                print(f"{name} step {s}: peak above rest {peak / 2**20:.0f} MiB", flush=True)
            print(f"## {name}, step {args.step}: " + "\n".join(live_at_peak(snapshot, args.top)))
            ctl.remove()
            del step, ctl
            torch.cuda.empty_cache()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        for name, setting in [("stock", None), ("fixed", TRACE_MODES["fixed"])]:
            step, ctl = _stepper(base, data, cfg, setting)
            for _ in range(3):
                step()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                step()
                if cuda:
                    torch.cuda.synchronize(dev)
            print(f"\n## profile {name}: {1e3 * (time.perf_counter() - t0):.1f} ms (profiled)")
            events = prof.key_averages()
            print(events.table(sort_by=key, row_limit=28, max_name_column_width=60))
            syncs = ("Synchronize", "cudaMemcpy", "_local_scalar_dense", "nonzero")
            for e in events:
                if any(s in e.key for s in syncs):
                    print(f"  host sync {e.key}: {e.count}")
            if ctl is not None:
                ctl.remove()
            del step, ctl


# ------------------------------------------------------------------------------ command line
def main(argv=None):
    cuda = "cuda" if torch.cuda.is_available() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = harness.subcommand(sub, activations)
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument("--scale", type=float, default=1.0, help="synthetic graph scale")
    p.add_argument("--models", default="gcn,gat,gcnii")
    p.add_argument("--methods", default="stock,lossless,int4,int2")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="activation_memory.json", help="where to write results")
    p.add_argument(
        "--jobs", type=int, default=1,
        help="configurations run at once (CUDA peaks are per process; on CPU the peak RSS is "
        "per process too, but the processes share the cores)",
    )  # fmt: skip
    p.add_argument("--timeout", type=int, default=3600, help="seconds per configuration")
    p.add_argument(
        "--saved-only", action="store_true",
        help="measure saved bytes from forward passes only (no backward, no peak): what a "
        "full-scale table costs on a CPU",
    )  # fmt: skip
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)

    p = harness.subcommand(sub, pointwise)
    p.add_argument("out", nargs="?", default="bench_pointwise.json", metavar="OUT")

    p = harness.subcommand(sub, activation_bias)
    p.add_argument("--seeds", type=int, default=128)
    p.add_argument("--bits", type=int, default=4)

    p = harness.subcommand(sub, scaling)
    p.add_argument("--device", default=cuda)
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="memory budget in GiB (default: 16 on CUDA, 1/32 on CPU)",
    )
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument(
        "--scale", type=float, default=None, help="synthetic graph scale (default: 1.0 on CUDA)"
    )
    p.add_argument(
        "--num-nodes", type=int, default=None, help="synthetic graph nodes (default on CPU: 2000)"
    )
    p.add_argument("--models", default="gcn,gcnii")
    p.add_argument("--searches", default="depth,width", help="depth, width or both")
    p.add_argument("--depth-hidden", type=int, default=256, help="width of the depth search")
    p.add_argument(
        "--width-layers", default="gcn=3,gcnii=16", help="depth of the width search, per model"
    )
    p.add_argument("--max-depth", type=int, default=4096, help="cap of the depth search")
    p.add_argument("--max-width", type=int, default=1 << 15, help="cap of the width search")
    p.add_argument("--width-unit", type=int, default=8)
    p.add_argument(
        "--rel-tol",
        type=float,
        default=0.0,
        help="stop the binary search when within this fraction (0: exact)",
    )
    p.add_argument("--bits", default="4,2")
    p.add_argument("--no-adaptive", action="store_true", help="fixed bits even if adaptive works")
    p.add_argument("--no-l2", action="store_true")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for all searches (shared out evenly; each search returns the "
        "best value verified when its share runs out)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    p.add_argument("--json", default="results/scaling.json")

    p = harness.subcommand(sub, probe_peak)
    p.add_argument("--device", default=cuda)
    p.add_argument("--models", default="gat,gatv2")
    p.add_argument("--nodes", type=int, default=169_343)
    p.add_argument("--degree", type=int, default=7, help="random edges per node")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128, help="channels per head")
    p.add_argument("--heads", type=int, default=3, help="the preset's heads (for the unit)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps 0 and 1 are probed")
    p.add_argument(
        "--edge-kernel",
        default="auto",
        choices=["auto", "triton", "chunked"],
        help="sparse.gat_fused.EDGE_KERNEL (triton on CPU: under TRITON_INTERPRET=1)",
    )
    p.add_argument(
        "--kernel-reads",
        default="codes",
        choices=["codes", "dequantized"],
        help="what the fused kernels' backward reads of a compressed input inside "
        "the probe: its packed codes, or a dequantized copy",
    )
    p.add_argument(
        "--edge-stage",
        action="store_true",
        help="CPU: one fused edge stage's backward alone (edge_stage_peak)",
    )
    p.add_argument("--json", default=None)
    p.add_argument(
        "--skip-dataless",
        action="store_true",
        help="CPU: do not count tensor subclasses without data (RowChunked), which "
        "the planner's meter counts at their full size",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="CPU: print the tensors alive at each step's peak and what made them",
    )

    p = harness.subcommand(sub, trace)
    p.add_argument("--device", default=cuda)
    p.add_argument("--model", default="gat", choices=["gcn", "gat", "gcnii"])
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument("--scale", type=float, default=None, help="default: 1.0 CUDA, 0.01 CPU")
    p.add_argument("--step", type=int, default=3, help="the step traced (0-based)")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--profile", action="store_true", help="kernel tables of fixed and stock")

    return harness.dispatch(ap, argv)


if __name__ == "__main__":
    main()
