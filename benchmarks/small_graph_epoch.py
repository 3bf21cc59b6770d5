"""Epoch time on a small graph: stock PyG FP32 vs ``compress_gnn``'s default mode, side by side.

The graph is the seeded synthetic stand-in with CiteSeer's statistics (3,327 nodes, 9,104 stored
edges, 3,703 features, 6 classes, 20 training nodes per class; `gact_graph.datasets.synthetic`),
the models the Planetoid presets of `gact_graph.models.preset`: GCN 2 x 16, GAT 2 layers x 8 heads
x 8, GCNII 16 x 64 (the preset's 64 layers cut to 16). An epoch is one training step (forward
on every node, loss on the training nodes, backward, Adam step, ``ctl.iterate(step_fn)``) and
one evaluation forward under ``torch.no_grad`` (``--no-eval`` drops it). The methods take their
epochs in turn (round robin, so a slow patch of the machine hits every method alike); reported
per model and method: the median epoch time over the timed epochs, its ratio to stock's, and
the mean (the default mode re-plans in epochs 0, 1, 3, 7, 15, 31, ...: they move the mean, not
the median).

Methods: ``stock`` (no compression), ``default`` (``compress_gnn(model)``: adaptive 2-bit
average; on CUDA tensors under 1 MiB are kept as they are), ``default-min_bytes0`` (the same
with that rule off: every tensor above ``min_numel`` quantized), ``default-min_bytes1MiB`` (the
CUDA rule set explicitly: on a CPU, what the default mode does on a GPU), ``fixed-2bit``.

Examples::

    python benchmarks/small_graph_epoch.py --device cuda --json results/small_graph_epoch.json
    python benchmarks/small_graph_epoch.py --dry          # seconds on a CPU: checks the script
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import command_line, names, run_env, start_run, sync  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.datasets.synthetic import load_synthetic  # noqa: E402
from gact_graph.models import build_model, preset  # noqa: E402

METHODS = {
    "stock": None,
    "default": {},
    "default-min_bytes0": {"min_bytes": 0},
    "default-min_bytes1MiB": {"min_bytes": 1 << 20},  # CUDA's default rule, on any device
    "fixed-2bit": {"bits": 2, "adaptive": False},
}
#: CiteSeer (PyG's Planetoid): nodes, stored (directed) edges
CITESEER_NODES, CITESEER_EDGES = 3_327, 9_104
#: model -> (preset name, depth override)
MODELS = {"gcn": ("gcn", None), "gat": ("gat", None), "gcnii-16": ("gcnii", 16)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default="stock,default,default-min_bytes0")
    p.add_argument("--warmup", type=int, default=3, help="untimed epochs")
    p.add_argument("--epochs", type=int, default=50, help="timed epochs")
    p.add_argument("--no-eval", action="store_true", help="an epoch is the training step only")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry", action="store_true", help="tiny CPU run (a tenth of the graph)")
    p.add_argument("--json", default="results/small_graph_epoch.json")
    return p.parse_args(argv)


def make_graph(args: argparse.Namespace, device: torch.device):
    if args.dry:  # a tenth of the graph and 64 features: seconds on one CPU core
        data = load_synthetic("synthetic-citeseer", num_nodes=333, num_edges=910, seed=args.seed)
        data.x = data.x[:, :64].contiguous()
    else:
        data = load_synthetic(
            "synthetic-citeseer",
            num_nodes=CITESEER_NODES,
            num_edges=CITESEER_EDGES,
            seed=args.seed,
        )
    return data.to(device)


def time_model(label: str, data, methods: list[str], device, args) -> list[dict]:
    name, depth = MODELS[label]
    cfg = preset(name, "citeseer")
    if depth:
        cfg["model"]["num_layers"] = depth if not args.dry else min(depth, 4)
    torch.manual_seed(args.seed)
    base = build_model(name, data.num_features, int(data.num_classes), **cfg["model"]).to(device)
    x, ei, y = data.x, data.edge_index, data.y
    train, val = data.train_mask, data.val_mask
    runs = []
    for m in methods:
        model = copy.deepcopy(base).train()
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        ctl = None if METHODS[m] is None else compress_gnn(model, **METHODS[m])

        def step_fn(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, ei)[train], y[train])
            loss.backward()
            return loss

        runs.append({"method": m, "model": model, "opt": opt, "ctl": ctl, "fn": step_fn,
                     "times": [], "error": None})  # fmt: skip
    del base

    def epoch(run) -> float:
        sync(device)
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
        sync(device)
        return time.perf_counter() - t0

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for e in range(args.warmup + args.epochs):
            for run in runs:
                if run["error"]:
                    continue
                try:
                    dt = epoch(run)
                except Exception as exc:  # reported in the table, the others go on
                    run["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                if e >= args.warmup:
                    run["times"].append(dt)
    stock = next((r for r in runs if r["method"] == "stock" and r["times"]), None)
    stock_t = statistics.median(stock["times"]) if stock else None
    rows = []
    for run in runs:
        t = statistics.median(run["times"]) if run["times"] else None
        rows.append({
            "model": label,
            "method": run["method"],
            "compress": METHODS[run["method"]],
            "median_epoch_s": t,
            "mean_epoch_s": statistics.fmean(run["times"]) if run["times"] else None,
            "ratio_to_stock": (t / stock_t) if t and stock_t else None,
            "epoch_times_s": run["times"],
            "val_acc": float(run["val_acc"]) if "val_acc" in run else None,
            "error": run["error"],
        })  # fmt: skip
        if run["ctl"] is not None:
            run["ctl"].remove()
    return rows


def table(results: list[dict]) -> str:
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


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.dry:
        args.device, args.warmup, args.epochs = "cpu", 1, 3
    device = start_run(args.device, args.threads)
    methods = names(args.methods)
    models = names(args.models, lower=True)
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    data = make_graph(args, device)
    env = run_env(device)
    header = {
        "benchmark": "small_graph_epoch",
        "command": command_line(argv),
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
        rows = time_model(label, data, methods, device, args)
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
    print(table(results))
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
