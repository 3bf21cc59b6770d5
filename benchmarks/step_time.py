"""Training step time: stock PyG FP32 vs ``compress_gnn``, measured in the same run.

For each model (the ogbn-arxiv presets of `gact_graph.models.preset`: GCN 3 x 256 with
BatchNorm, GAT 3 layers x 3 heads x 128, GCNII 16 x 256) one copy per method is made from the
same initial weights; the copies then take their steps in turn (stock, L1 4-bit, L1 2-bit,
...: round robin, so a slow patch of the machine hits every method alike). A step is forward,
loss on the training nodes, backward, Adam step and ``ctl.iterate(step_fn)``. Reported per
method: median step time of the timed rounds and its ratio to stock's; on CUDA also the peak
memory of a step (``max_memory_allocated``, reset before each step) over *every* step, warm-ups
included (the default adaptive mode re-plans on steps 0, 1, 3, 7, ...), and the worst step's
peak above what was allocated before it, with its ratio to the fixed-bit method of the same
bits (``L1-2bit``), the figure issue 13 bounds at 1.10.

Examples::

    python benchmarks/step_time.py --device cuda                       # full arxiv size
    python benchmarks/step_time.py --device cpu --scale 0.02 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    adaptive_works,
    command_line,
    names,
    run_env,
    start_run,
    sync,
    write_results,
)
from gact_graph import compress_gnn, switches  # noqa: E402
from gact_graph.datasets import load_dataset  # noqa: E402
from gact_graph.models import build_model, preset  # noqa: E402

METHODS = {
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument("--scale", type=float, default=None, help="default: 1.0 CUDA, 0.02 CPU")
    p.add_argument("--models", default="gcn,gat,gcnii")
    p.add_argument(
        "--methods",
        default="stock,L1-4bit,L1-2bit,L1-2bit-adaptive",
        help=f"comma list of {', '.join(METHODS)} (adaptive is dropped if it does not work)",
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
    return p.parse_args(argv)


def time_model(name, data, method_names, device, args, deadline) -> list[dict]:
    cfg = preset(name, args.dataset)
    if args.layers:
        cfg["model"]["num_layers"] = args.layers
    torch.manual_seed(args.seed)
    base = build_model(name, data.num_features, int(data.num_classes), **cfg["model"]).to(device)
    x, edge_index, y, mask = data.x, data.edge_index, data.y, data.train_mask
    runs = []
    for m in method_names:
        model = copy.deepcopy(base)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
        kwargs = METHODS[m]
        if kwargs is not None and args.graph_check is not None:
            kwargs = {**kwargs, "graph_check": args.graph_check}
        ctl = None if kwargs is None else compress_gnn(model, **kwargs)

        def step_fn(model=model, opt=opt, amp=m in AMP):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                out = model(x, edge_index)
            loss = F.cross_entropy(out[mask].float(), y[mask])
            loss.backward()
            return loss

        runs.append({"method": m, "model": model, "opt": opt, "ctl": ctl, "fn": step_fn,
                     "compress": kwargs, "times": [], "peaks": [], "step_peaks": []})  # fmt: skip
    del base

    def one_step(run) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            run["rest"] = torch.cuda.memory_allocated(device)
        switches.ROWS_IN_EVERY_STEP = run["method"] not in DENSE_READS
        sync(device)
        t0 = time.perf_counter()
        run["fn"]()
        run["opt"].step()
        if run["ctl"] is not None:
            run["ctl"].iterate(run["fn"])
        sync(device)
        run["last"] = time.perf_counter() - t0
        if device.type == "cuda":
            run["last_peak"] = torch.cuda.max_memory_allocated(device)

    errors: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # adaptive advice, L2-on-CPU notes
        for r in range(args.warmup + args.steps):
            if r >= args.warmup + 1 and deadline is not None and time.perf_counter() > deadline:
                break  # at least one timed round
            for run in runs:
                if run["method"] in errors:
                    continue
                try:
                    one_step(run)
                except Exception as exc:  # reported in the table, the others go on
                    errors[run["method"]] = f"{type(exc).__name__}: {exc}"
                    continue
                if "last_peak" in run:  # every step: re-planning steps are often warm-ups
                    run["peaks"].append(run["last_peak"])
                    run["step_peaks"].append(run["last_peak"] - run["rest"])
                if r >= args.warmup:
                    run["times"].append(run["last"])
    rows = []
    stock = next((r for r in runs if r["method"] == "stock" and r["times"]), None)
    stock_t = statistics.median(stock["times"]) if stock else None
    for run in runs:
        t = statistics.median(run["times"]) if run["times"] else None
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
            "error": errors.get(run["method"]),
        })  # fmt: skip
        if run["ctl"] is not None:
            run["ctl"].remove()
    runs.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    device = start_run(args.device, args.threads)
    on_cuda = device.type == "cuda"
    scale = args.scale if args.scale is not None else (1.0 if on_cuda else 0.02)
    data = load_dataset(args.dataset, scale=scale, seed=args.seed).to(device)
    method_names = names(args.methods)
    for m in method_names:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(METHODS)}")
    notes = []
    if any(METHODS[m] and METHODS[m].get("adaptive") for m in method_names):
        ok, why = adaptive_works()
        if not ok:
            method_names = [m for m in method_names if not (METHODS[m] or {}).get("adaptive")]
            notes.append(f"adaptive dropped: compress_gnn(adaptive=True) fails ({why[:160]})")
    models = names(args.models, lower=True)
    env = run_env(device)
    header = {
        "benchmark": "step_time",
        "command": command_line(argv),
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
        rows = time_model(name, data, method_names, device, args, deadline)
        results.extend(rows)
        for r in rows:
            t = "-" if r["median_step_s"] is None else f"{1e3 * r['median_step_s']:.1f} ms"
            ratio = "" if r["ratio_to_stock"] is None else f" x{r['ratio_to_stock']:.2f}"
            err = f" ERROR {r['error'][:100]}" if r["error"] else ""
            print(f"  {name:6s} {r['method']:18s} {t}{ratio}{err}", flush=True)
        write_results(out_path, header, results)
    print()
    print(table(results))
    print(f"\nwrote {out_path} ({time.perf_counter() - t_start:.0f}s)")
    return {**header, "results": results}


def table(results: list[dict]) -> str:
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


if __name__ == "__main__":
    main()
