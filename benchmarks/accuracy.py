"""Accuracy: does training under ``compress_gnn`` reach stock PyG FP32's test accuracy, and
does it stay stable? One subcommand per measurement:

    python benchmarks/accuracy.py table        # GACT Table 3's layout: settings x models
    python benchmarks/accuracy.py policies     # acgc against adaptive bits at the same bytes
    python benchmarks/accuracy.py divergence   # the gradient watch on the scripts that diverged
    python benchmarks/accuracy.py minibatch    # mini-batch runs, 2 bits against FP32

``python benchmarks/accuracy.py SUBCOMMAND --help`` says what each measures and its flags.
Figures: docs/results/adaptive.md, policies.md, divergence.md, minibatch.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCN2Conv, GCNConv, SAGEConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import subcommand  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.datasets import load_dataset  # noqa: E402
from gact_graph.models import build_model, preset  # noqa: E402

# ------------------------------------------------------------------------------ table
EXAMPLE = ROOT / "examples" / "train_full_batch.py"


def setting_flags(setting: str) -> list[str]:
    if setting == "fp32":
        return ["--bits", "fp32"]
    if setting.endswith("f"):
        return ["--bits", setting[:-1], "--fixed-bits"]
    return ["--bits", setting]


def setting_label(setting: str) -> str:
    if setting == "fp32":
        return "FP32"
    if setting.endswith("f"):
        return f"fixed {setting[:-1]}-bit"
    return f"adaptive {setting}-bit"


def parse_pairs(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=ARGS, got {item!r}")
        out[name] = shlex.split(args)
    return out


def table(args) -> dict:
    """Accuracy vs activation compression, laid out like GACT's Table 3.

    One row per setting (FP32, fixed bits, adaptive bits), one column per dataset x model,
    each cell the test metric mean ± std over seeds and the activation compression ratio
    (stock PyG's saved bytes over what gact_graph stored).

    Every cell is one run of ``examples/train_full_batch.py --json``; runs go to a cache
    folder (``--out``) and are skipped when their JSON exists, so an interrupted table resumes
    where it stopped.

    Settings: ``fp32``; ``<b>`` adaptive at an average of b bits (the default behaviour);
    ``<b>f`` fixed b bits for every tensor (``--fixed-bits``). ``--dataset-args NAME=ARGS``
    and ``--model-args NAME=ARGS`` pass extra flags to the example for one dataset or model
    (e.g. ``--dataset-args "synthetic-ogbn-arxiv=--scale 0.05 --epochs 100"``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d_args, m_args = parse_pairs(args.dataset_args), parse_pairs(args.model_args)
    datasets, models = args.datasets.split(","), args.models.split(",")
    settings = args.settings.split(",")
    cells = [(d, m, s) for d in datasets for m in models for s in settings]

    def run(cell):
        d, m, s = cell
        path = out / f"{d}_{m}_{s}.json"
        if path.exists():
            return cell, json.loads(path.read_text()), 0.0
        cmd = [sys.executable, str(EXAMPLE), "--dataset", d, "--model", m, "--seeds",
               str(args.seeds), "--no-progress", "--json", str(path), *setting_flags(s),
               *d_args.get(d, []), *m_args.get(m, [])]  # fmt: skip
        if args.root:
            cmd += ["--root", args.root]
        if args.device:
            cmd += ["--device", args.device]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (out / f"{d}_{m}_{s}.log").write_text(shlex.join(cmd) + "\n" + res.stdout + res.stderr)
        if res.returncode != 0:
            print(f"FAILED {d} {m} {s}: see {out / f'{d}_{m}_{s}.log'}", flush=True)
            return cell, None, time.perf_counter() - t0
        took = time.perf_counter() - t0
        print(f"done {d} {m} {s} in {took:.0f}s", flush=True)
        return cell, json.loads(path.read_text()), took

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = {cell: res for cell, res, _ in pool.map(run, cells)}

    table = []
    for s in settings:
        row = {"setting": s, "label": setting_label(s), "cells": {}}
        for d in datasets:
            for m in models:
                r = results.get((d, m, s))
                if r is None:
                    continue
                row["cells"][f"{d}/{m}"] = {
                    "mean": r["test_metric_mean"],
                    "std": r["test_metric_std"],
                    "ratio": r["compression_ratio"],
                    "adapt_overhead": r.get("adapt_overhead"),
                    "epoch_time_s": r["epoch_time_s"],
                    "seeds": len(r["per_seed"]),
                }
        table.append(row)

    cols = [f"{d}/{m}" for d in datasets for m in models]
    lines = [
        "| setting | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for row in table:
        cells = []
        for c in cols:
            v = row["cells"].get(c)
            cells.append(
                "-"
                if v is None
                else f"{100 * v['mean']:.2f} ± {100 * v['std']:.2f} ({v['ratio']:.1f}x)"
            )
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    overhead = [
        (c, v["adapt_overhead"])
        for row in table
        for c, v in row["cells"].items()
        if v.get("adapt_overhead") is not None
    ]
    if overhead:
        print("\nadaptation overhead (share of training time):")
        for row in table:
            for c, v in row["cells"].items():
                if v.get("adapt_overhead") is not None:
                    print(f"  {row['label']:>16} {c}: {100 * v['adapt_overhead']:.1f}%")
    summary = {"settings": settings, "columns": cols, "rows": table, "seeds": args.seeds}
    Path(args.json or out / "table.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------ policies
MASK_SEED = 1234  # dropout masks of the measured-ratio passes: the same for every pass


def _optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if "weight_decay_conv" in cfg and hasattr(model, "parameter_groups"):
        groups = model.parameter_groups(cfg["weight_decay_conv"], cfg["weight_decay"])
        return torch.optim.Adam(groups, lr=cfg["lr"])
    return torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])


def _accuracy(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
    return float((out[mask].argmax(-1) == y[mask]).float().mean())


def _flat_grad(model: torch.nn.Module, loss_fn) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(MASK_SEED)
    loss_fn().backward()
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
            for p in model.parameters()
        ]
    )


def _policy_run(data, model_name: str, cfg: dict, seed: int, setting: dict, draws: int) -> dict:
    """One training run; ``setting`` is ``{}`` (FP32) or ``compress_gnn`` keywords."""
    torch.manual_seed(seed)
    model = build_model(model_name, data.num_features, data.num_classes, **cfg["model"])
    opt = _optimizer(model, cfg)
    x, ei, y = data.x, data.edge_index, data.y

    def loss_fn():
        out = model(x, ei)
        return F.cross_entropy(out[data.train_mask], y[data.train_mask])

    ctl = compress_gnn(model, seed=seed, **setting) if setting else None
    best, avg_bits, t0 = {"val": -math.inf}, [], time.perf_counter()
    for epoch in range(cfg["epochs"]):
        model.train()
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        if ctl is not None:
            ctl.iterate()
            if hasattr(ctl.adapter, "average_bits"):
                avg_bits.append(ctl.adapter.average_bits())
        model.eval()
        with torch.no_grad():
            out = model(x, ei)
        val = _accuracy(out, y, data.val_mask)
        if val > best["val"]:
            best = {"val": val, "test": _accuracy(out, y, data.test_mask), "epoch": epoch}
    res: dict[str, Any] = {"seed": seed, **best, "seconds": time.perf_counter() - t0}
    if ctl is None:
        return res
    model.train()
    ad = ctl.adapter
    res["ratio_predicted"] = _predicted_ratio(ad)
    res["compression"] = ctl.stats()["total"]["ratio"]
    if avg_bits:
        res["average_bits"] = statistics.fmean(avg_bits)
        res["average_bits_last"] = avg_bits[-1]
    ad.next_estimate = 1 << 60  # the measured draws below run the plan in force
    errs = []
    grads = []
    for _ in range(draws):
        grads.append(_flat_grad(model, loss_fn))
        ctl.iterate()
    ctl.remove()
    exact = _flat_grad(model, loss_fn)
    errs = [float((g - exact).square().sum()) for g in grads]
    res["ratio_measured"] = statistics.fmean(errs) / float(exact.square().sum())
    res["plan"] = dict(ctl.plan)
    return res


def _predicted_ratio(ad) -> float | None:
    """Added variance of the plan over the uncompressed gradient's squared norm."""
    if hasattr(ad, "ratio"):  # acgc
        return ad.ratio
    share = ad.last_share  # adaptive: v_q / (rest + v_q)
    return None if share is None or share >= 1 else share / (1 - share)


def _mean_std(rows: list[dict], key: str) -> tuple[float, float] | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def policies(args) -> dict:
    """Bit policies side by side: ``policy="acgc"`` (error-bounded bits) against the adaptive
    allocator at the same average bits, and FP32, on the same seeds.

    For each dataset x model x seed: an acgc run at ``--loss-bound`` records the average bits
    of the plan in force at every step (the ``bits`` an adaptive plan needs for the same
    bytes, `AcgcAdapter.average_bits`), then an adaptive run gets ``bits`` = the mean of that
    over the run (so both hold the same bytes on average) and FP32 runs as the reference. Each
    run reports test accuracy at the best validation epoch, the compression ratio of the last
    step, the predicted variance ratio of its last plan (acgc: ``sum c_l S(b_l) / V^2``;
    adaptive: ``v_q`` over the rest of the measured mean square, the same quantity) and the
    *measured* ratio at the trained parameters: ``mean ||g_hat - g||^2 / ||g||^2`` over
    ``--draws`` rounding draws of the compressed backward against the exact backward (dropout
    masks replayed from one seed)."""
    torch.set_num_threads(args.threads)

    bounds = [float(v) for v in args.loss_bounds.split(",")]
    results = []
    for ds in args.datasets.split(","):
        data = load_dataset(ds, args.root)
        for m in args.models.split(","):
            cfg = preset(m, ds)
            if args.epochs:
                cfg["epochs"] = args.epochs
            rows: dict[str, list[dict]] = {"fp32": []}
            for seed in range(args.seeds):
                rows["fp32"].append(_policy_run(data, m, cfg, seed, {}, 0))
                for e2 in bounds:
                    acgc = {"bits": args.start_bits, "policy": "acgc", "loss_bound": e2}
                    a = _policy_run(data, m, cfg, seed, acgc, args.draws)
                    rows.setdefault(f"acgc {e2:g}", []).append(a)
                    same = {"bits": min(8.0, max(1.0, a["average_bits"]))}
                    b = _policy_run(data, m, cfg, seed, same, args.draws)
                    rows.setdefault(f"adaptive {e2:g}", []).append({**b, **same})
                accs = ", ".join(f"{k} {100 * v[-1]['test']:.1f}" for k, v in rows.items())
                print(f"{ds} {m} seed {seed}: {accs}", flush=True)
            results.append({"dataset": ds, "model": m, "epochs": cfg["epochs"], "rows": rows})

    lines = [
        f"{args.seeds} seeds; adaptive runs at the acgc run's average bits (same seed)",
        "| dataset | model | setting | test acc. % | average bits | compression | "
        "ratio predicted | ratio measured |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        for name, rows in r["rows"].items():
            label = "FP32" if name == "fp32" else name.replace("acgc ", "acgc e2=")
            label = label.replace("adaptive ", "adaptive, bits of acgc e2=")
            acc = _mean_std(rows, "test")
            bits = _mean_std(rows, "bits" if name.startswith("adaptive") else "average_bits")
            comp = _mean_std(rows, "compression")
            pred = _mean_std(rows, "ratio_predicted")
            meas = _mean_std(rows, "ratio_measured")

            def fmt(v, spec, scale=1.0):
                return "-" if v is None else f"{scale * v[0]:{spec}} ± {scale * v[1]:{spec}}"

            lines.append(
                f"| {r['dataset']} | {r['model']} | {label} | {fmt(acc, '.2f', 100)} | "
                f"{fmt(bits, '.2f')} | {fmt(comp, '.1f')}x | {fmt(pred, '.2e')} | "
                f"{fmt(meas, '.2e')} |"
            )
    print("\n".join(lines))
    out = {"args": vars(args), "results": results, "table": lines}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return out


# ------------------------------------------------------------------------------ divergence
class GCN2Net(nn.Module):
    """PyG's ``gcn2_cora.py`` ``Net`` (edge weights from ``gcn_norm`` instead of its
    ``SparseTensor``, so that torch-sparse is not needed)."""

    def __init__(self, in_channels, hidden, out_channels, num_layers=64, alpha=0.1, theta=0.5,
                 shared_weights=True, dropout=0.6):  # fmt: skip
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(in_channels, hidden), nn.Linear(hidden, out_channels)])
        self.convs = nn.ModuleList(
            GCN2Conv(hidden, alpha, theta, layer + 1, shared_weights, normalize=False)
            for layer in range(num_layers)
        )
        self.dropout = dropout

    def forward(self, x, edge_index, edge_weight):
        x = F.dropout(x, self.dropout, training=self.training)
        x = x_0 = self.lins[0](x).relu()
        for conv in self.convs:
            x = F.dropout(x, self.dropout, training=self.training)
            x = conv(x, x_0, edge_index, edge_weight)
            x = x.relu()
        x = F.dropout(x, self.dropout, training=self.training)
        return self.lins[1](x).log_softmax(dim=-1)


class OgbNet(nn.Module):
    """OGB arxiv ``gnn.py``'s ``GCN`` / ``SAGE``: convolutions with BatchNorm, ReLU, dropout."""

    def __init__(self, kind, in_channels, hidden, out_channels, num_layers=3, dropout=0.5):
        super().__init__()
        conv = (lambda i, o: GCNConv(i, o, cached=True)) if kind == "gcn" else SAGEConv
        dims = [in_channels] + [hidden] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(conv(i, o) for i, o in zip(dims[:-1], dims[1:]))
        self.bns = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(num_layers - 1))
        self.dropout = dropout

    def forward(self, x, edge_index, edge_weight=None):
        for conv, bn in zip(self.convs[:-1], self.bns):
            x = F.dropout(F.relu(bn(conv(x, edge_index))), self.dropout, training=self.training)
        return self.convs[-1](x, edge_index).log_softmax(dim=-1)


def _build(model: str, data, shared_weights: bool):
    """The model, its optimizer and its default number of epochs."""
    c = int(data.y.max()) + 1
    if model == "gcn2":
        net = GCN2Net(data.num_features, 64, c, shared_weights=shared_weights)
        opt = torch.optim.Adam(
            [
                dict(params=net.convs.parameters(), weight_decay=0.01),
                dict(params=net.lins.parameters(), weight_decay=5e-4),
            ],
            lr=0.01,
        )
        return net, opt, 1000
    net = OgbNet(model.split("-")[1], data.num_features, 256, c)
    return net, torch.optim.Adam(net.parameters(), lr=0.01), 500


def _divergence_run(args, data, mode: str, on_divergence: str | None) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    net, opt, epochs = _build(args.model, data, args.shared_weights)
    epochs = args.epochs or epochs
    ew = data.edge_weight if args.model == "gcn2" else None
    ctl = None
    if mode != "stock":
        kw = {"adaptive": mode == "default"}
        if on_divergence is not None:
            kw["on_divergence"] = on_divergence
        ctl = compress_gnn(net, bits=2, **kw)
    losses, norms, caught_at = [], [], []
    best_val = test_at_best = final_test = 0.0
    t0 = time.perf_counter()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(epochs):
            net.train()
            opt.zero_grad()
            out = net(data.x, data.edge_index, ew)
            loss = F.nll_loss(out[data.train_mask], data.y[data.train_mask])
            loss.backward()
            norms.append(
                float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.norm() for p in net.parameters() if p.grad is not None])))
            )  # fmt: skip
            opt.step()
            try:
                if ctl is not None:
                    ctl.iterate()
            except RuntimeError as exc:  # on_divergence="raise"
                error = f"step {epoch}: {exc}"
                break
            losses.append(float(loss))
            for w in caught[len(caught_at) :]:
                caught_at.append({"step": epoch, "message": str(w.message)[:400]})
            if epoch % args.eval_every == 0 or epoch == epochs - 1:
                net.eval()
                with torch.no_grad():
                    pred = net(data.x, data.edge_index, ew).argmax(-1)
                acc = [float((pred[m] == data.y[m]).float().mean())
                       for m in (data.val_mask, data.test_mask)]  # fmt: skip
                final_test = acc[1]
                if acc[0] > best_val:
                    best_val, test_at_best = acc[0], acc[1]
    ours = [w for w in caught_at if "gact_graph" in w["message"]]
    first_nan = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    watch = getattr(ctl, "watch", None) if ctl is not None else None
    return {
        "model": args.model,
        "mode": mode,
        "on_divergence": on_divergence,
        "epochs": epochs,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - t0, 1),
        "first_nan_step": first_nan,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min((v for v in losses if math.isfinite(v)), default=None),
        "test_at_best_val": test_at_best,
        "final_test": final_test,
        "warnings": ours,
        "watch_events": list(getattr(watch, "events", [])),
        "error": error,
        "losses": losses,
        "grad_norms": norms,
    }


def divergence(args) -> None:
    """Divergence and the watch's warnings on the example scripts that exposed them, on real
    Cora.

    Three models, each as its own script trains it, with the three lines of ``compress_gnn``:

    - ``gcn2``: PyG's ``examples/gcn2_cora.py`` (GCNII, 64 ``GCN2Conv`` layers of 64, alpha
      0.1, theta 0.5, dropout 0.6, Adam lr 0.01 with weight decay 0.01 on the convolutions and
      5e-4 on the linear layers, GCN-normalized adjacency, 1000 epochs; ``--shared-weights``
      as there);
    - ``ogb-gcn`` / ``ogb-sage``: OGB's ``examples/nodeproppred/arxiv/gnn.py`` (3 layers of
      256, BatchNorm, dropout 0.5, Adam lr 0.01, 500 epochs) on Cora's public split.

    Each run records the loss and the gradient norm of every step, test accuracy at the best
    validation epoch and at the end, and every warning gact_graph gave (with its step), and
    what the watch did (``ctl.watch.events``). Modes: ``stock`` (no compression), ``default``
    (adaptive 2 bits), ``fixed2`` (``adaptive=False``), with ``--on-divergence``."""
    data = load_dataset("cora", root=args.root)
    if args.model == "gcn2":  # gcn2_cora.py's T.GCNNorm()
        data.edge_index, data.edge_weight = gcn_norm(
            data.edge_index, None, data.num_nodes, add_self_loops=True
        )
    runs = []
    actions = [a or None for a in args.on_divergence.split(",")]
    for mode in args.modes.split(","):
        for action in actions if mode != "stock" else [None]:
            r = _divergence_run(args, data, mode, action)
            runs.append(r)
            print(
                f"{r['model']:<9} {mode:<8} {str(action):<7} test@best {r['test_at_best_val']:.3f} "
                f"final {r['final_test']:.3f} nan@{r['first_nan_step']} "
                f"warned@{[w['step'] for w in r['warnings']]} {r['seconds']}s "
                f"{r['watch_events']} {r['error'] or ''}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


# ------------------------------------------------------------------------------ minibatch
EXAMPLE_MINIBATCH = ROOT / "examples" / "train_minibatch.py"


def _minibatch_run(dataset: str, root: str | None, model: str, bits: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(EXAMPLE_MINIBATCH), "--dataset", dataset, "--model", model,
               "--bits", bits, "--no-progress", "--json", str(out), *extra]  # fmt: skip
        if root is not None:
            cmd += ["--root", root]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def _minibatch_table(rows: list[dict]) -> str:
    head = (
        "| model | bits | test metric (mean ± std) | saved per batch, stock | stored per batch | "
        "ratio | largest batch stored | peak of a step | above step start | "
        "epoch time |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        s = r["summary"]
        mib = 2**20
        lines.append(
            f"| {r['model']} | {r['bits']} | {100 * s['test_metric_mean']:.2f} ± "
            f"{100 * s['test_metric_std']:.2f} | {s['activation_bytes_fp32'] / mib:.2f} MiB | "
            f"{s['activation_bytes_stored'] / mib:.2f} MiB | "
            f"{s['compression_ratio']:.1f}x | {s['activation_bytes_stored_max'] / mib:.2f} MiB | "
            f"{s['peak_memory_bytes'] / mib:,.0f} MiB | "
            f"{max(x['peak_above_start_bytes'] for x in s['per_seed']) / mib:,.0f} MiB | "
            f"{s['epoch_time_s']:.2f} s |"
        )
    return "\n".join(lines)


def minibatch(args) -> list[dict]:
    """Mini-batch training, compressed against uncompressed, side by side: accuracy and memory
    per batch.

    For each model, runs ``examples/train_minibatch.py`` once per bit setting (``fp32`` and
    ``--bits``, default 2), each in a fresh process (so each peak RSS is its own), with the
    same seeds, loader and flags; prints a table and writes every run's JSON summary into one
    file. Everything after ``--`` goes to the example unchanged, e.g. ``-- --loader random
    --num-parts 4 --epochs 50 --seeds 3``.

    ``--loader neighbor-emulated`` runs no example: NeighborLoader's batches (k-hop sampled
    subgraphs, seeds first, node and edge counts varying per batch, the loss on the seeds),
    *emulated* in pure PyTorch by ``tests/integrations/neighbor_sampler.py`` since PyG's own
    NeighborLoader needs pyg-lib or torch-sparse, on a synthetic graph, in this process;
    ``--loader neighbor`` takes PyG's own ``NeighborLoader`` instead (where one of them
    imports). Per model it trains under ``memory_budget=`` (``--budget-factor`` times the
    least budget the planner names for the first batch) and in the default mode (2 adaptive
    bits), and reports per run the profile steps, the steps at their plan's bits, the plans
    kept and the worst step against the budget by the planner's meter."""
    extra = args.extra
    if args.loader in ("neighbor-emulated", "neighbor"):
        if extra:
            raise SystemExit(f"--loader {args.loader} runs no example: nothing goes after --")
        return neighbor_emulated(args)
    rows = []
    for model in args.models:
        for bits in ("fp32", args.bits):
            summary = _minibatch_run(args.dataset, args.root, model, bits, extra)
            rows.append({"model": model, "bits": bits, "summary": summary})
    print(_minibatch_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


def _neighbor_model(name: str, features: int, hidden: int, classes: int):
    from torch_geometric.nn import GraphSAGE

    from gact_graph.models import GAT, GCN

    models = {
        "gcn": lambda: GCN(features, hidden, classes, num_layers=2, dropout=0.0, batch_norm=False),
        "sage": lambda: GraphSAGE(features, hidden, 2, classes),
        "gat": lambda: GAT(
            features, hidden // 4, classes, num_layers=2, heads=4, dropout=0.0, batch_norm=False
        ),  # fmt: skip
    }
    if name not in models:
        raise SystemExit(f"--loader neighbor-emulated: model {name!r} is none of {sorted(models)}")
    torch.manual_seed(0)
    return models[name]()


def _seed_loss(model, batch):
    out = model(batch.x, batch.edge_index)[: batch.batch_size]
    return F.cross_entropy(out, batch.y[: batch.batch_size])


def _least_budget(model, batch) -> int:
    """What the planner names for a profile step on ``batch`` (a run at 1 KiB is refused)."""
    from gact_graph.budget import BudgetError

    ctl = compress_gnn(model, memory_budget="1KiB")
    try:
        _seed_loss(model, batch).backward()
        ctl.iterate()
    except BudgetError as err:
        return int(err.least_budget)
    finally:
        ctl.remove()
    raise RuntimeError("a 1 KiB budget was admitted")


def _train(model, ctl, batches: list) -> list[dict]:
    """Per step: the planner's phase (None without a budget), sizes, and whether every saved
    activation the controller quantizes at all was stored at the plan in force's bits (what
    a graph-aware path keeps lossless whatever the bits, None in the first step, excepted)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    planner = getattr(ctl, "budget", None)
    lossless: set[str] | None = None
    steps = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        _seed_loss(model, batch).backward()
        opt.step()
        records = [
            r for r in ctl.stats()["tensors"]
            if r["kind"] == "activation" and math.prod(r["shape"]) >= ctl.config.min_numel
        ]  # fmt: skip
        if lossless is None:
            lossless = {r["name"] for r in records if r["bits"] is None}
        phase = planner._phase if planner is not None else None
        choice = planner.plan_state.plan.choice if planner and planner.plan_state else {}
        at_plan = phase != "profile"
        for r in records:
            name = r["name"]
            if name in lossless:
                at_plan = at_plan and r["bits"] is None
            elif planner is not None:
                at_plan = at_plan and planner._unit_of(name) in choice
                at_plan = at_plan and r["bits"] == planner.bits_for(name)
            else:
                at_plan = at_plan and r["bits"] == ctl.bits_for(name)
        ctl.iterate()
        steps.append({
            "phase": phase, "nodes": batch.num_nodes, "edges": batch.edge_index.size(1),
            "at_plan": at_plan,
        })  # fmt: skip
    return steps


def _run_summary(model_name: str, mode: str, steps: list[dict], ctl, budget) -> dict:
    planner = getattr(ctl, "budget", None)
    nodes = [s["nodes"] for s in steps]
    edges = [s["edges"] for s in steps]
    ratio = [e / n for n, e in zip(nodes, edges)]
    out = {
        "model": model_name, "mode": mode, "steps": len(steps),
        "distinct_sizes": len(set(zip(nodes, edges))),
        "nodes": [min(nodes), max(nodes)], "edges": [min(edges), max(edges)],
        "edges_per_node": [min(ratio), max(ratio)],
        "profile_steps": sum(s["phase"] == "profile" for s in steps),
        "profile_at": [
            [i, s["nodes"], s["edges"]] for i, s in enumerate(steps) if s["phase"] == "profile"
        ],
        "steps_at_plan_after_first": sum(s["at_plan"] for s in steps[1:]),
        "stats_ratio": ctl.stats()["total"]["ratio"],
    }  # fmt: skip
    if planner is not None:
        history = planner.history
        worst = max(h["measured"] for h in history)
        out.update(
            budget=budget, least_budget=planner.plan_state.least_budget, meter=planner.meter,
            plans_kept=sum(len(c) for c in planner.classes.values()),
            plans_bound=planner.MAX_CLASSES, worst_step=worst,
            worst_planned=max((h["measured"] for h in history if h["phase"] == "planned"),
                              default=None),
            probe_steps=sum(bool(h["probe"]) for h in history),
            rectified=sum(bool(h["rectified"]) for h in history),
            over_budget=sum(h["measured"] > budget for h in history),
            plan=sorted({o.label for o in planner.plan_state.plan.choice.values()}),
        )  # fmt: skip
    else:
        out.update(plans_kept=len(ctl.plan), estimates=ctl.adapter.n_estimates)
    return out


def neighbor_table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| model | mode | steps | batch nodes | batch edges | E/N | profile steps | "
        "steps at planned bits (after the first) | plans kept | worst step / budget |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        if r["mode"] == "budget":
            plans = f"{r['plans_kept']} (at most {r['plans_bound']})"
            worst = (f"{r['worst_step'] / mib:.2f} / {r['budget'] / mib:.2f} MiB "
                     f"({r['meter']})")  # fmt: skip
        else:
            plans = f"{r['plans_kept']} tensor roles"
            worst = "no budget"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['steps']} | {r['nodes'][0]:,}-{r['nodes'][1]:,} | "
            f"{r['edges'][0]:,}-{r['edges'][1]:,} | "
            f"{r['edges_per_node'][0]:.2f}-{r['edges_per_node'][1]:.2f} | "
            f"{r['profile_steps']} | {r['steps_at_plan_after_first']} of {r['steps'] - 1} | "
            f"{plans} | {worst} |"
        )
    return "\n".join(lines)


def neighbor_emulated(args) -> list[dict]:
    """Budget and default-mode runs on NeighborLoader's batches, emulated or PyG's own
    (``--loader neighbor``; see `minibatch`)."""
    from gact_graph.datasets.synthetic import make_synthetic_graph
    from tests.integrations.neighbor_sampler import EmulatedNeighborLoader

    torch.set_num_threads(args.threads)
    data = make_synthetic_graph(args.nodes, args.edges, args.features, args.classes, seed=0)
    if args.loader == "neighbor":
        from torch_geometric.loader import NeighborLoader as Loader

        what = "PyG's NeighborLoader"
    else:
        Loader, what = EmulatedNeighborLoader, "NeighborLoader emulated (tests/integrations)"
    loader = Loader(
        data, args.fanout, batch_size=args.batch_size, input_nodes=data.train_mask,
        shuffle=True, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    batches = [b for _ in range(args.epochs) for b in loader]
    print(
        f"{what}: {args.nodes:,} nodes, "
        f"{args.edges:,} edges, fan-out {args.fanout}, {args.batch_size} seeds per batch, "
        f"{len(batches)} steps",
        flush=True,
    )
    rows = []
    for name in args.models:
        least = _least_budget(_neighbor_model(name, args.features, args.hidden, args.classes),
                              batches[0])  # fmt: skip
        budget = int(args.budget_factor * least)
        for mode in ("budget", "default"):
            model = _neighbor_model(name, args.features, args.hidden, args.classes)
            kw = {"memory_budget": budget} if mode == "budget" else {}
            ctl = compress_gnn(model, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps = _train(model, ctl, batches)
            rows.append(_run_summary(name, mode, steps, ctl, budget if kw else None))
            ctl.remove()
            print(rows[-1], flush=True)
    print(neighbor_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


# ------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = subcommand(sub, table)
    p.add_argument("--datasets", default="cora")
    p.add_argument("--models", default="gcn,gat,gcnii")
    p.add_argument("--settings", default="fp32,4f,4,3,2")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--root", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (one thread each)")
    p.add_argument("--dataset-args", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--model-args", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--out", default="accuracy_table", help="folder for the runs' JSON")
    p.add_argument("--json", help="write the table as JSON (default OUT/table.json)")

    p = subcommand(sub, policies)
    p.add_argument("--datasets", default="cora,synthetic-citeseer")
    p.add_argument("--models", default="gcn")
    p.add_argument("--root", default=None, help="folder with <Name>/raw/ Planetoid files")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--loss-bounds", default="0.1,0.01", help="comma-separated e2 values")
    p.add_argument("--start-bits", type=int, default=8, help="acgc: bits before the 1st plan")
    p.add_argument("--epochs", type=int, help="override the preset's epochs")
    p.add_argument("--draws", type=int, default=8, help="rounding draws of the measured ratio")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="policies.json")

    p = subcommand(sub, divergence)
    p.add_argument("--root", required=True, help="folder with Cora/raw (Planetoid files)")
    p.add_argument("--model", choices=("gcn2", "ogb-gcn", "ogb-sage"), default="gcn2")
    p.add_argument("--modes", default="stock,default,fixed2")
    p.add_argument("--on-divergence", default="", help="comma list; empty: the default")
    p.add_argument("--epochs", type=int, default=0, help="0: the script's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--shared-weights", type=int, default=1)
    p.add_argument("--json", default=None)

    p = subcommand(sub, minibatch)
    p.add_argument("--dataset", default="synthetic-flickr")
    p.add_argument("--root", default=None)
    p.add_argument("--models", nargs="+", default=["sage", "gat"])
    p.add_argument("--bits", default="2", help="the compressed setting (against fp32)")
    p.add_argument("--json", help="write every run's summary here")
    p.add_argument(
        "--loader", choices=["example", "neighbor-emulated", "neighbor"], default="example",
        help="example: run examples/train_minibatch.py (its own --loader after --); "
        "neighbor-emulated: NeighborLoader's batches emulated in pure PyTorch, budget checks; "
        "neighbor: the same checks on PyG's NeighborLoader (needs pyg-lib or torch-sparse)",
    )  # fmt: skip
    emu = p.add_argument_group("--loader neighbor-emulated / neighbor")
    emu.add_argument("--nodes", type=int, default=20_000)
    emu.add_argument("--edges", type=int, default=200_000)
    emu.add_argument("--features", type=int, default=64)
    emu.add_argument("--classes", type=int, default=8)
    emu.add_argument("--hidden", type=int, default=64)
    emu.add_argument("--batch-size", type=int, default=256)
    emu.add_argument("--fanout", type=int, nargs="+", default=[10, 5])
    emu.add_argument("--epochs", type=int, default=2)
    emu.add_argument("--budget-factor", type=float, default=1.1)
    emu.add_argument("--threads", type=int, default=1)

    args = ap.parse_args(own)
    func = vars(args).pop("func")  # not a setting: kept out of the JSON of `vars(args)`
    if func is minibatch:
        args.extra = extra
    elif extra:
        ap.error("only minibatch passes arguments after -- (to the example)")
    return func(args)


if __name__ == "__main__":
    main()
