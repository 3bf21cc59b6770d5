"""Deepest and widest GCN / GCNII that complete a training step under a memory budget.

The GACT anchor (Table 4, 16 GB GPU, GCN on ogbn-arxiv): 24 layers in FP32, 152 with
compression, 240 with compression + swap; hidden width 2464 / 3948 / 4244. This script runs
the same experiment for stock PyG FP32 and ``compress_gnn`` at L1 4 and 2 bits (adaptive when
``adaptive=True`` works, else fixed bits; it prints which) and L2 (compression + swap) when
that opt level is implemented.

The search (exponential, then binary) and the budget live in `benchmarks/harness.py`:

- ``--device cuda``: ``torch.cuda.set_per_process_memory_fraction`` caps the allocator at
  ``--budget-gb`` and a configuration fits when its steps finish without OOM.
- ``--device cpu``: byte accounting (parameters, gradients, optimizer state, graph inputs and
  the saved tensors as the controller counts them); runs anywhere, on small graphs.

Examples::

    # GPU, comparable with GACT Table 4 (16 GB, ogbn-arxiv-sized graph)
    python benchmarks/scaling.py --device cuda --budget-gb 16
    # CPU, small graph and budget (a few minutes)
    python benchmarks/scaling.py --device cpu --budget-gb 0.03125 --num-nodes 2000 \\
        --depth-hidden 64 --width-layers gcn=3,gcnii=8 --rel-tol 0.1

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    GraphInputs,
    budget_meaning,
    command_line,
    cuda_budget,
    default_methods,
    gib,
    max_depth,
    max_width,
    names,
    run_env,
    start_run,
    write_results,
)
from gact_graph.datasets import load_dataset  # noqa: E402

GACT_TABLE4 = {
    "source": "GACT (Liu et al., ICML 2022) Table 4: GCN on ogbn-arxiv, 16 GB GPU",
    "max_depth": {"FP32": 24, "GACT": 152, "GACT+swap": 240},
    "max_width": {"FP32": 2464, "GACT": 3948, "GACT+swap": 4244},
}


def _parse_layers(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        out[name.strip().lower()] = int(value)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = start_run(args.device, args.threads)
    on_cuda = device.type == "cuda"
    budget_gb = args.budget_gb if args.budget_gb is not None else (16.0 if on_cuda else 1 / 32)
    budget = gib(budget_gb)
    kwargs = {"seed": args.seed}
    if args.num_nodes is not None:
        kwargs["num_nodes"] = args.num_nodes
    elif args.scale is not None:
        kwargs["scale"] = args.scale
    elif not on_cuda:
        kwargs["num_nodes"] = 2000
    data = load_dataset(args.dataset, **kwargs)
    graph = GraphInputs.from_data(data, device)
    gc.freeze()  # what exists now lives all run: keep it out of every trial's collection
    num_classes = int(data.num_classes)
    bits = tuple(int(b) for b in args.bits.split(","))
    methods, notes = default_methods(
        bits, adaptive=False if args.no_adaptive else None, l2=False if args.no_l2 else None
    )
    if not on_cuda and any(m.compress and m.compress.get("opt_level") == "L2" for m in methods):
        notes.append(
            "L2 on CPU: swap bookkeeping simulated (swap_simulate=True); the accounting leaves "
            "out the compressed payloads it moved off the device, as a GPU would"
        )
    models = names(args.models, lower=True)
    width_layers = _parse_layers(args.width_layers)
    searches = names(args.searches)
    jobs = [(m, s, meth) for m in models for s in searches for meth in methods]

    env = run_env(device, budget=budget_meaning(on_cuda))
    header = {
        "benchmark": "scaling",
        "command": command_line(argv),
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
    cm = cuda_budget(budget, device) if on_cuda else contextlib.nullcontext()
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
                res = max_depth(model, graph, method, hidden_channels=args.depth_hidden,
                                cap=args.max_depth, start=2, **common)  # fmt: skip
                fixed = {"hidden_channels": args.depth_hidden}
            elif search == "width":
                layers = width_layers.get(model, 3)
                res = max_width(model, graph, method, num_layers=layers, unit=args.width_unit,
                                start=args.width_unit, cap=args.max_width, **common)  # fmt: skip
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
            write_results(out_path, header, results)
    print()
    print(table(results))
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


def table(results: list[dict]) -> str:
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


if __name__ == "__main__":
    main()
