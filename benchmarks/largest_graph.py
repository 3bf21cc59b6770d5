"""Largest graph on which full-batch 3-layer GAT and GCN complete a training step: stock PyG
FP32 vs ``compress_gnn``.

Graphs have ogbn-products statistics (2.45M nodes, 61.9M undirected edges: ~25.3 undirected
edges per node, stored in both directions; 100 features; 47 classes) scaled in the number of
nodes with the average degree kept, to below and beyond the real size. Models are the
published ogbn setups of `gact_graph.models.preset` (GCN 3 x 256 with BatchNorm; GAT 3 layers,
3 heads x 128, BatchNorm, residual); ``--hidden`` narrows them.

The budget (see `benchmarks/harness.py`):

- ``--device cuda``: real OOM under ``--budget-gb`` (default: the whole device), enforced with
  ``torch.cuda.set_per_process_memory_fraction``;
- ``--device cpu``: byte accounting (parameters, gradients, optimizer state, graph inputs and
  saved tensors, as the controller counts them) under ``--budget-gb``.

Graph generator (``--generator``): ``dataset`` builds each candidate with
``load_dataset("synthetic-ogbn-products", num_nodes=N)`` (planted classes, heavy-tailed
degrees; seconds per 100k nodes on CPU), ``fast`` draws uniform random edges with the same
count directly on the device (what memory depends on is N, E and the feature width, not where
the edges go); default: ``dataset`` on CPU, ``fast`` on CUDA, where candidates have millions of
nodes.

Examples::

    python benchmarks/largest_graph.py --device cuda --budget-gb 16
    python benchmarks/largest_graph.py --device cpu --budget-gb 0.0625 --rel-tol 0.1
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
    Method,
    StepResult,
    budget_meaning,
    build_model,
    command_line,
    cuda_budget,
    default_methods,
    gib,
    names,
    run_env,
    run_step,
    search_max,
    start_run,
    write_results,
)
from gact_graph.datasets import dataset_info, load_dataset  # noqa: E402
from gact_graph.models import preset  # noqa: E402

PRODUCTS = dataset_info("ogbn-products")
#: undirected edges per node of ogbn-products (each stored in both directions once built)
AVG_DEGREE = PRODUCTS.num_edges / PRODUCTS.num_nodes


def fast_graph(num_nodes: int, device: torch.device, seed: int = 0) -> GraphInputs:
    """Uniform random graph with products' size per node, made on ``device``: both directions
    of ``round(AVG_DEGREE * num_nodes)`` random pairs, 100 features, 47 classes, 8% train."""
    g = torch.Generator(device=device).manual_seed(seed)
    pairs = round(AVG_DEGREE * num_nodes)
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


def dataset_graph(num_nodes: int, device: torch.device, seed: int = 0) -> GraphInputs:
    data = load_dataset("synthetic-ogbn-products", num_nodes=num_nodes, seed=seed)
    return GraphInputs.from_data(data, device)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="memory budget in GiB (default: the whole device on CUDA, 1/16 on CPU)",
    )
    p.add_argument("--models", default="gat,gcn")
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=None, help="width (per head for GAT)")
    p.add_argument("--bits", default="2", help="compressed methods' bits, e.g. 4,2")
    p.add_argument("--no-adaptive", action="store_true", help="fixed bits even if adaptive works")
    p.add_argument("--generator", choices=["dataset", "fast"], default=None)
    p.add_argument("--unit", type=int, default=None, help="node granularity of the search")
    p.add_argument("--max-nodes", type=int, default=None, help="cap of the search")
    p.add_argument("--rel-tol", type=float, default=0.05)
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for all searches (shared out evenly)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    p.add_argument("--json", default="results/largest_graph.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = start_run(args.device, args.threads)
    on_cuda = device.type == "cuda"
    if args.budget_gb is not None:
        budget_gb = args.budget_gb
    elif on_cuda:
        budget_gb = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        budget_gb = 1 / 16
    budget = gib(budget_gb)
    generator = args.generator or ("fast" if on_cuda else "dataset")
    make_graph = fast_graph if generator == "fast" else dataset_graph
    unit = args.unit or (1024 if on_cuda else 64)  # stock GAT fits few nodes: start small
    cap = args.max_nodes or (200_000_000 if on_cuda else 2_000_000)
    bits = tuple(int(b) for b in args.bits.split(","))
    methods, notes = default_methods(bits, adaptive=False if args.no_adaptive else None, l2=False)
    models = names(args.models, lower=True)
    env = run_env(device, budget=budget_meaning(on_cuda))
    header = {
        "benchmark": "largest_graph",
        "command": command_line(argv),
        "env": env,
        "budget_gb": budget_gb,
        "graph": {
            "statistics": "ogbn-products",
            "avg_undirected_degree": AVG_DEGREE,
            "num_features": PRODUCTS.num_features,
            "num_classes": PRODUCTS.num_classes,
            "generator": generator,
            "real_num_nodes": PRODUCTS.num_nodes,
        },
        "num_layers": args.num_layers,
        "hidden": args.hidden,
        "rel_tol": args.rel_tol,
        "notes": notes,
    }
    print(f"# largest graph: {env['device']}, budget {budget_gb:g} GiB ({env['budget']})")
    print(f"# products statistics, generator '{generator}', search unit {unit} nodes")
    for n in notes:
        print(f"# {n}")

    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    gc.freeze()
    results: list[dict] = []
    jobs = [(model, method) for model in models for method in methods]
    with cuda_budget(budget, device) if on_cuda else contextlib.nullcontext():
        for i, (model, method) in enumerate(jobs):
            deadline = None
            if args.time_budget is not None:
                left = args.time_budget - (time.perf_counter() - t_start)
                deadline = time.perf_counter() + max(0.0, left) / (len(jobs) - i)
            res, sizes = largest(model, method, args, device, budget, make_graph, unit, cap,
                                 deadline)  # fmt: skip
            row = {
                "model": model,
                "method": method.name,
                "compress": method.compress,
                "max_nodes": res.best,
                "max_edges": sizes.get(res.best),
                "x_real_products": res.best / PRODUCTS.num_nodes,
                **res.to_dict(),
            }
            results.append(row)
            flag = " (capped)" if res.capped else " (timed out)" if res.timed_out else ""
            if res.error:
                flag = f" ERROR {res.error[:100]}"
            print(
                f"  {model:4s} {method.name:22s} -> {res.best} nodes{flag} "
                f"[{len(res.trials)} trials, {res.seconds:.1f}s]",
                flush=True,
            )
            write_results(out_path, header, results)
    print()
    print(table(results))
    print(f"\nwrote {out_path} ({time.perf_counter() - t_start:.0f}s)")
    return {**header, "results": results}


def largest(model, method: Method, args, device, budget, make_graph, unit, cap, deadline):
    sizes: dict[int, int] = {}

    def trial(num_nodes: int):
        try:
            graph = make_graph(num_nodes, device, args.seed)
        except torch.OutOfMemoryError:  # the graph alone does not fit under the cap
            graph = None
        if graph is None:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return StepResult(fits=False, reason="oom")
        sizes[num_nodes] = graph.num_edges
        hidden = args.hidden or preset(model, "ogbn-products")["model"]["hidden_channels"]

        def make():
            torch.manual_seed(args.seed)
            return build_model(model, PRODUCTS.num_features, PRODUCTS.num_classes,
                               num_layers=args.num_layers, hidden_channels=hidden)  # fmt: skip

        res = run_step(make, graph, method, budget_bytes=None if device.type == "cuda" else budget)
        del graph  # before the next candidate is made
        if args.verbose:
            b = res.bytes
            print(
                f"      {num_nodes:>10} nodes {sizes[num_nodes]:>11} edges {res.reason:6s} "
                f"total {b.get('total', 0) / 2**20:9.1f} MiB saved {b.get('saved', 0) / 2**20:9.1f}"
                f" MiB peak {res.peak_bytes / 2**20:9.1f} MiB {res.seconds:6.1f}s",
                flush=True,
            )
        return res

    res = search_max(trial, start=unit, unit=unit, cap=cap, rel_tol=args.rel_tol,
                     deadline=deadline)  # fmt: skip
    return res, sizes


def _fmt(row: dict) -> str:
    if row.get("error"):
        return "error"
    s = f"{row['max_nodes']:,}"
    if row.get("capped"):
        return ">=" + s
    if row.get("timed_out"):
        return f">={s}*"
    if row.get("first_fail") is not None:
        s += f" (fails at {row['first_fail']:,})"
    return s


def table(results: list[dict]) -> str:
    lines = [
        "| model | method | max nodes | edges (directed) | x real products | x stock |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    stock = {r["model"]: r for r in results if r["method"].startswith("stock")}
    for r in results:
        base = stock.get(r["model"])
        ratio = "-"
        ok = base and base["max_nodes"] and not r.get("error") and not base.get("error")
        if ok and not base.get("capped") and not base.get("timed_out"):
            bound = ">=" if r.get("capped") or r.get("timed_out") else ""
            ratio = f"{bound}{r['max_nodes'] / base['max_nodes']:.1f}"
        edges = f"{r['max_edges']:,}" if r.get("max_edges") else "-"
        lines.append(
            f"| {r['model']} | {r['method']} | {_fmt(r)} | {edges} | "
            f"{r['x_real_products']:.3g} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
