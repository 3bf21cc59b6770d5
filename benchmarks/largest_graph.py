"""The largest graph one machine trains: each trial a fresh process, its whole pipeline counted.

A trial builds a graph with ogbn-products' statistics at N nodes (``load_dataset(
"synthetic-ogbn-products", num_nodes=N)``: 25.26 undirected edges a node, stored both ways,
100 features, 47 classes), the model, Adam, and runs ``--steps`` full-batch training steps
(forward, cross-entropy on the training nodes, backward, optimizer step). Its peak is the
process's peak resident set above its start (``VmHWM``; on CUDA ``max_memory_allocated``),
graph building included. A trial fits when it completes with the whole process's peak resident
set (imports included; on CUDA the allocator's peak) under the ceiling; the parent samples the
child's resident set and stops a trial that passes it.

Forms of the graph input (``--forms``):

- ``stock-ei``: stock PyG on ``edge_index`` (int64);
- ``stock-csr``: stock PyG on ``T.ToSparseTensor()``'s ``adj_t`` (a torch CSR tensor when
  torch_sparse is absent, as on these machines);
- ``stock-compact``: stock PyG on `gact_graph.datasets.compact_adj_t`;
- ``ours-ei``: ``compress_gnn(model)`` at defaults on ``edge_index``;
- ``ours``: ``compress_gnn(model)`` at defaults on ``load_dataset(..., compact=True)``.

Models: ``gcn``, OGB's GCN (3 x 256, BatchNorm, dropout 0.5, ``cached=True``); ``gat``, a GAT
of 3 layers with 3 heads x 64 (the ogbn preset otherwise: BatchNorm, residual, ELU).

Per model and form: two trials at ``--slope-nodes`` give bytes a node (the slope) and the fixed
part; the search then starts at the node count the line predicts for the ceiling and narrows
the largest one that fits to ``--rel-tol``. The node count a 141 GB GPU would hold is computed
from the slope and labelled so (not measured).

    python benchmarks/largest_graph.py search --models gcn --forms stock-csr,ours --ceiling-gib 20
    python benchmarks/largest_graph.py trial --model gcn --form ours --nodes 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import command_line, dispatch, run_env, subcommand  # noqa: E402

FORMS = ("stock-ei", "stock-csr", "stock-compact", "ours-ei", "ours")
MODELS = ("gcn", "gat")
#: a 141 GB GPU (H200), for the node count the CPU slope implies
GPU_BYTES = 141e9


def _status(field: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` field in bytes (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _model(name: str):
    from gact_graph.datasets import dataset_info
    from gact_graph.models import GCN, build_model, preset

    info = dataset_info("ogbn-products")
    if name == "gcn":  # OGB's products / arxiv GCN
        return GCN(info.num_features, 256, info.num_classes, num_layers=3, dropout=0.5,
                   batch_norm=True, cached=True)  # fmt: skip
    kw = preset("gat", "ogbn-products")["model"]
    kw.update(hidden_channels=64, heads=3, num_layers=3)
    return build_model("gat", info.num_features, info.num_classes, **kw)


def trial(model: str, form: str, nodes: int, steps: int, seed: int, device: str) -> dict:
    """One trial in this process: what it held at its peak, and each step's seconds."""
    from gact_graph import compress_gnn
    from gact_graph.datasets import compact_adj_t, load_dataset

    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    base = _status("VmRSS")
    t0 = time.perf_counter()
    data = load_dataset("synthetic-ogbn-products", num_nodes=nodes, seed=seed,
                        compact=form == "ours")  # fmt: skip
    if form in ("stock-csr", "stock-compact"):
        if form == "stock-csr":
            import torch_geometric.transforms as T

            data = T.ToSparseTensor()(data)
        else:
            data.adj_t = compact_adj_t(data.edge_index, data.num_nodes)
            del data.edge_index
    data = data.to(dev)
    graph = data.adj_t if "adj_t" in data else data.edge_index
    edges = graph.size(1) if graph.layout == torch.strided else graph._nnz()
    torch.manual_seed(seed)
    net = _model(model).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    ctl = compress_gnn(net) if form.startswith("ours") else None
    build_seconds = time.perf_counter() - t0
    build_peak = _status("VmHWM") - base
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    mask = data.train_mask
    seconds = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(data.x, graph)[mask], data.y[mask]).backward()
        opt.step()
        if ctl is not None:
            ctl.iterate()
        if on_cuda:
            torch.cuda.synchronize(dev)
        seconds.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(dev) if on_cuda else _status("VmHWM") - base
    return {
        "model": model, "form": form, "nodes": nodes, "edges": int(edges), "steps": steps,
        "peak_bytes": int(peak), "build_peak_bytes": int(build_peak),
        "process_peak_bytes": int(peak if on_cuda else _status("VmHWM")),
        "build_seconds": build_seconds, "step_seconds": seconds,
    }  # fmt: skip


def _run_trial(args, model: str, form: str, nodes: int, ceiling: int) -> dict:
    """`trial` in a fresh process, stopped if its resident set passes ``ceiling``."""
    cmd = [sys.executable, __file__, "trial", "--model", model, "--form", form,
           "--nodes", str(nodes), "--steps", str(args.steps), "--seed", str(args.seed),
           "--device", args.device]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    over = []

    def watch() -> None:
        while proc.poll() is None:
            if args.device == "cpu" and _status("VmRSS", proc.pid) > ceiling:
                over.append(True)
                proc.kill()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    row = {"model": model, "form": form, "nodes": nodes}
    if over:
        return {**row, "fits": False, "reason": "passed the ceiling"}
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        return {**row, "fits": False, "reason": f"exit {proc.returncode}: {last[:200]}"}
    res = json.loads(out.strip().splitlines()[-1])
    # the ceiling holds the whole process on CPU (imports included), the allocator on a GPU
    return {**res, "fits": res["process_peak_bytes"] <= ceiling}


def search(args, model: str, form: str, ceiling: int, log) -> dict:
    """Slope from two trials, then the largest node count that fits, within ``rel_tol``."""
    a, b = (_run_trial(args, model, form, n, ceiling) for n in args.slope_nodes)
    log(a)
    log(b)
    if not (a["fits"] and b["fits"]):
        return {
            "model": model,
            "form": form,
            "error": "a slope trial did not fit",
            "trials": [a, b],
        }
    slope = (b["peak_bytes"] - a["peak_bytes"]) / (b["nodes"] - a["nodes"])
    fixed = a["process_peak_bytes"] - slope * a["nodes"]
    trials = [a, b]
    lo, hi = b["nodes"], None  # largest that fits, smallest that does not
    guess = int((ceiling - fixed) / slope * 0.97)
    while len(trials) < args.max_trials + 2:
        n = guess if hi is None and guess > lo else (lo + hi) // 2 if hi else int(lo * 1.25)
        if n <= lo or (hi is not None and hi / lo - 1 <= args.rel_tol):
            break
        t = _run_trial(args, model, form, n, ceiling)
        log(t)
        trials.append(t)
        if t["fits"]:
            lo = n
        else:
            hi = n
        guess = 0
    best = max((t for t in trials if t["fits"]), key=lambda t: t["nodes"])
    return {
        "model": model, "form": form, "bytes_per_node": slope, "fixed_bytes": fixed,
        "max_nodes": lo, "first_fail": hi, "best": best,
        "gpu_141gb_nodes_computed": int((GPU_BYTES - fixed) / slope), "trials": trials,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = [
        "| model | form | bytes / node | x stock's best | largest N under the ceiling "
        "| edges | step (s) | N on 141 GB (computed) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['form']} | {r['error']} | | | | | |")
            continue
        stock = [s["bytes_per_node"] for s in rows if s["model"] == r["model"]
                 and s["form"].startswith("stock") and "error" not in s]  # fmt: skip
        ratio = f"{min(stock) / r['bytes_per_node']:.2f}" if stock else "-"
        fail = f" (fails at {r['first_fail']:,})" if r["first_fail"] else ""
        step = max(r["best"]["step_seconds"])
        lines.append(
            f"| {r['model']} | {r['form']} | {r['bytes_per_node']:,.0f} | {ratio} | "
            f"{r['max_nodes']:,}{fail} | {r['best']['edges']:,} | {step:.1f} | "
            f"{r['gpu_141gb_nodes_computed']:,} |"
        )
    return "\n".join(lines)


def run_search(args) -> None:
    """Per model and form: bytes a node and the largest node count that fits the ceiling."""
    ceiling = int(args.ceiling_gib * 2**30)
    header = {"benchmark": "largest_graph", "command": command_line(args.argv),
              "env": run_env(torch.device(args.device)), "ceiling_gib": args.ceiling_gib,
              "steps": args.steps, "slope_nodes": args.slope_nodes}  # fmt: skip
    rows = []

    def log(t: dict) -> None:
        peak = t.get("peak_bytes", 0) / 2**30
        print(f"    {t['model']} {t['form']:13s} {t['nodes']:>10,} nodes: "
              f"{'fits' if t['fits'] else 'no  '} {peak:6.2f} GiB "
              f"{t.get('reason', '')} {t.get('step_seconds', '')}", flush=True)  # fmt: skip

    for model in args.models.split(","):
        for form in args.forms.split(","):
            rows.append(search(args, model, form, ceiling, log))
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**header, "results": rows}, indent=1))
    print(table(rows))


def run_trial(args) -> None:
    """One trial in this process; prints its JSON line."""
    print(json.dumps(trial(args.model, args.form, args.nodes, args.steps, args.seed,
                           args.device)))  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(required=True)
    s = subcommand(sub, run_search, "search")
    s.add_argument("--models", default="gcn,gat")
    s.add_argument("--forms", default="stock-csr,ours")
    s.add_argument("--ceiling-gib", type=float, default=20.0)
    s.add_argument("--slope-nodes", type=lambda v: [int(x) for x in v.split(",")],
                   default=[100_000, 200_000])  # fmt: skip
    s.add_argument("--rel-tol", type=float, default=0.05)
    s.add_argument("--max-trials", type=int, default=6)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--json", default="results/largest_graph.json")
    t = subcommand(sub, run_trial, "trial")
    t.add_argument("--model", choices=MODELS, required=True)
    t.add_argument("--form", choices=FORMS, required=True)
    t.add_argument("--nodes", type=int, required=True)
    for q in (s, t):
        q.add_argument("--steps", type=int, default=2)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--device", default="cpu")
    dispatch(p, argv)


if __name__ == "__main__":
    main()
