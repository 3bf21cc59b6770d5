"""Issue 14's GPU row: a GAT on a graph of ogbn-products' size (2,449,029 nodes, 123.7 M
directed edges, 100 features, 47 classes) trained full-batch under
``compress_gnn(model, memory_budget="16GiB")``.

The graph is `benchmarks.largest_graph.fast_graph` (uniform random pairs at products' average
degree, both directions, made on the device). The model is the ogbn-arxiv GAT preset (3 layers,
3 heads, BatchNorm, residual, ELU) at each width per head of ``--hidden`` in turn, widest first;
the run stops at the first width that trains. Each width is one attempt:

- the allocator is capped at the budget (``torch.cuda.set_per_process_memory_fraction``): an
  attempt that the planner admits but that allocates past the budget dies with an
  out-of-memory error, so "trains" means every step really stayed inside the budget;
- ``--steps`` steps (the planner's profile step first), each with its own peak
  (``max_memory_allocated``: absolute, graph and parameters included, which is what the budget
  bounds), its time, and the planner's prediction;
- a budget the planner cannot meet ends the attempt with ``BudgetError`` and the smallest
  feasible budget it names.

    python benchmarks/budget_products.py --json products.json          # on a GPU
    python benchmarks/budget_products.py --device cpu --nodes 3000 --budget 200MiB  # mechanics

Prints a line per step and a table; writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import build_model, cuda_budget  # noqa: E402
from benchmarks.largest_graph import PRODUCTS, fast_graph  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.budget import BudgetError  # noqa: E402
from gact_graph.config import format_bytes, parse_bytes  # noqa: E402

_MIB = 1 << 20


def _peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def attempt(graph, hidden: int, budget: int, steps: int, device: torch.device) -> dict:
    """Train the products GAT at ``hidden`` per head for ``steps`` steps under ``budget``."""
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
            if device.type == "cuda":
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
            peak = _peak(device)
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
        if device.type == "cuda":
            torch.cuda.empty_cache()
    peaks = [s["peak"] for s in out["steps"] if s["peak"] is not None]
    if peaks:
        out["worst_peak"] = max(peaks)
    times = [s["seconds"] for s in out["steps"][2:]]
    if times:
        out["median_step_seconds"] = sorted(times)[len(times) // 2]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--nodes", type=int, default=PRODUCTS.num_nodes)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--hidden", default="128,64,32", help="widths per head to try, widest first")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
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
    graph = fast_graph(args.nodes, device)
    info["edges"] = int(graph.edge_index.size(1))
    info["graph_seconds"] = time.perf_counter() - t0
    secs = info["graph_seconds"]
    print(f"# graph: {args.nodes:,} nodes, {info['edges']:,} directed edges on {device} "
          f"({secs:.1f} s); budget {format_bytes(budget)}", flush=True)  # fmt: skip
    for hidden in (int(h) for h in args.hidden.split(",")):
        if device.type == "cuda":
            with cuda_budget(budget, device):
                res = attempt(graph, hidden, budget, args.steps, device)
        else:
            res = attempt(graph, hidden, budget, args.steps, device)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
