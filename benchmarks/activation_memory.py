"""Activation memory of one full-batch training step: stock PyG FP32 vs ``compress_gnn``.

For each model (GCN 3 x 256 with BatchNorm, GAT 3 layers x 3 heads x 128, GCNII 16 x 256: the
ogbn-arxiv presets of `gact_graph.models.preset`) on the synthetic ogbn-arxiv-sized graph and
each method:

- ``stock``: PyTorch Geometric as is, FP32;
- ``lossless``: ``compress_gnn(model, bits=None)`` (sparse paths and dedup, no quantization);
- ``int4`` / ``int2``: ``compress_gnn(model, bits=4 / 2, adaptive=False)`` (fixed bits);
- ``pointwise``: only the pointwise ops of `gact_graph.ops` (1-bit masks, regenerated dropout,
  inverted activations), everything else lossless (``bits=None, sparse=False``): what those ops
  save alone;
- ``int2-nopw``: ``int2`` with ``pointwise=False``, so ``int2`` against it is what the
  pointwise ops add on top of quantization and the graph-aware paths,

it measures

- saved-for-backward bytes of one forward: stock via `gact_graph.memory.saved_bytes_stats`
  (``total.orig_bytes``), ours via ``ctl.stats()["total"]["stored_bytes"]`` (the same
  accounting: parameters and the model's inputs are excluded, the shared adjacency counted
  once);
- peak memory of one forward + backward (`gact_graph.memory.PeakMemory`: CUDA max allocated
  on GPU, process peak RSS on CPU) after one warm-up step, so one-time work (building the
  shared adjacency, lazy init) is not in it; ``peak - base`` is what the step itself added
  (on CPU the warm-up's freed heap is returned to the OS first with ``malloc_trim``, so the
  step's own allocations show in the RSS).

Every (model, method) runs in a fresh subprocess so peaks never mix. Prints a table and writes
JSON (``--json``). Full scale (``--scale 1``) needs more than 13 GB for stock GAT.

Examples::

    python benchmarks/activation_memory.py --scale 0.05            # small, CPU, minutes
    python benchmarks/activation_memory.py --device cuda --json memory.json   # full scale
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: method -> compress_gnn keyword arguments (None: stock PyG, nothing installed)
METHODS = {
    "stock": None,
    "lossless": {"bits": None},
    "int4": {"bits": 4, "adaptive": False},
    "int2": {"bits": 2, "adaptive": False},
    "pointwise": {"bits": None, "sparse": False},
    "int2-nopw": {"bits": 2, "adaptive": False, "pointwise": False},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
        "--saved-only",
        action="store_true",
        help="measure saved bytes from forward passes only (no backward, no peak): what a\n"
        "full-scale table costs on a CPU",
    )
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- one configuration
def run_one(args: argparse.Namespace, model_name: str, method: str) -> dict:
    """One (model, method) in this process: saved bytes, then the peak of one step."""
    import warnings

    import torch
    import torch.nn.functional as F

    from gact_graph import compress_gnn
    from gact_graph.datasets import load_dataset
    from gact_graph.memory import PeakMemory, saved_bytes_stats
    from gact_graph.models import build_model, preset

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
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------- driver
def _mb(b: float) -> str:
    return f"{b / 2**20:9.1f}"


def table(results: list[dict]) -> str:
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


def _run_worker(args, model: str, method: str) -> dict:
    """One (model, method) in a fresh subprocess: its RESULT row, or the error it ended with."""
    cmd = [
        sys.executable, __file__, "--worker", model, method, "--dataset", args.dataset,
        "--scale", str(args.scale), "--device", args.device, "--seed", str(args.seed),
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


def _write_report(args, results: list[dict]) -> None:
    import torch

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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print("RESULT " + json.dumps(run_one(args, *args.worker)), flush=True)
        return 0

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {list(METHODS)}")
    configs = [(model, method) for model in models for method in methods]
    results: list[dict | None] = [None] * len(configs)
    # each configuration is its own process, so CUDA peaks never mix (the counters are per
    # process); --jobs runs several at once: most of a run's wall time is start-up
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_run_worker, args, *c): i for i, c in enumerate(configs)}
        for fut in as_completed(futures):
            r = fut.result()
            results[futures[fut]] = r
            print(f"  done {r['model']}/{r['method']} in {r['wall_seconds']:.0f}s", file=sys.stderr)
            _write_report(args, [x for x in results if x is not None])  # partial runs keep rows
    print(table(results))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
