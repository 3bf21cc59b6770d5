"""Full-batch node classification with compressed activations.

Trains GCN, GAT or GCNII on one graph for several seeds and reports the test metric at the
epoch of best validation, peak memory, the bytes autograd saved for backward (stock FP32 vs
what ``gact_graph`` stored) and the time per epoch.

    python examples/train_full_batch.py                      # GCN, small synthetic graph, 2 bits
    python examples/train_full_batch.py --bits fp32          # the uncompressed baseline
    python examples/train_full_batch.py --dataset ogbn-arxiv --root data --model gcnii
    python examples/train_full_batch.py --dataset cora --root data --model gat --seeds 10

Hyperparameters default to the published setup of the model for the dataset
(``gact_graph.models.preset``); every flag below overrides one of them. On a CPU, torch uses
as many threads as this process may run on (affinity mask and cgroup CPU quota; ``--threads``
overrides).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gact_graph import compress_gnn
from gact_graph.config import parse_bytes
from gact_graph.cpus import usable_cpus
from gact_graph.datasets import (
    DATASETS,
    DatasetNotFoundError,
    ProcessedDataError,
    dataset_info,
    evaluate,
    load_dataset,
)
from gact_graph.memory import count_saved_bytes, peak_memory
from gact_graph.models import build_model, preset


def parse_bits(text: str) -> float | None:
    """``fp32`` (or ``32``/``none``) -> ``None`` (no compression); otherwise a bit width."""
    if text.lower() in {"fp32", "32", "none", "off"}:
        return None
    try:
        bits = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bits must be 'fp32' or a number, got {text!r}"
        ) from None
    if not 0 < bits <= 16:
        raise argparse.ArgumentTypeError(f"--bits must be in (0, 16], got {text!r}")
    return int(bits) if bits.is_integer() else bits


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def dataset_name(text: str) -> str:
    """A name ``load_dataset`` knows (checked before anything is loaded or trained)."""
    key = text.lower()
    if key != "synthetic":
        try:
            dataset_info(key.removeprefix("synthetic-"))  # real names and their aliases
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"unknown dataset {text!r}; choose from {', '.join(DATASETS)}, synthetic or "
                "synthetic-<one of those>"
            ) from None
    return text


def base_parser(
    doc: str, models: list[str], dataset_help: str, adj_t_help: str
) -> argparse.ArgumentParser:
    """The flags this example and the mini-batch one share (same names and meaning), with the
    first paragraph of ``doc`` as the description; the first of ``models`` is the default."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--dataset", type=dataset_name, default="synthetic", help=dataset_help)
    p.add_argument("--model", choices=models, default=models[0])
    p.add_argument("--layers", type=positive_int, help="number of layers (preset)")
    p.add_argument("--hidden", type=positive_int, help="hidden width, per head for GAT (preset)")
    p.add_argument("--heads", type=positive_int, help="GAT heads per hidden layer (preset)")
    # At least one: the summary is the test metric at the best validation epoch, the train
    # step's time and the bytes saved in training, none of which exists without an epoch.
    p.add_argument("--epochs", type=positive_int, help="maximum epochs (preset)")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[1],
        help="one number: that many seeds 0..N-1; several: those seeds",
    )
    p.add_argument(
        "--bits",
        type=parse_bits,
        default=2,
        help="'fp32' (no compression) or the bit width (default 2)",
    )
    p.add_argument(
        "--fixed-bits",
        action="store_true",
        help="same bits for every tensor (default: adaptive allocation)",
    )
    p.add_argument(
        "--memory-budget",
        type=memory_budget_arg,
        default=None,
        help="keep every training step under this many bytes (an int, or e.g. '16GiB',\n"
        "'512MB'): compress_gnn(memory_budget=...) plans per saved tensor; the JSON's\n"
        "'memory_budget' says what it chose and measured",
    )
    p.add_argument(
        "--policy",
        choices=["adaptive", "acgc"],
        default="adaptive",
        help="'adaptive' (default: --bits is an average) or 'acgc' (bits from --loss-bound)",
    )
    p.add_argument(
        "--loss-bound",
        type=positive_float,
        default=None,
        help="--policy acgc: the bound on the gradient's added variance (relative)",
    )
    p.add_argument("--root", default=None, help="dataset folder (default $GACT_GRAPH_DATA or data)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--threads",
        type=positive_int,
        help=f"torch CPU threads (default: the CPUs this process may use, here {usable_cpus()})",
    )
    p.add_argument("--lr", type=float, help="learning rate (preset)")
    p.add_argument("--weight-decay", type=float, help="weight decay (preset)")
    p.add_argument(
        "--weight-decay-conv", type=float, help="GCNII: weight decay of the convolutions (preset)"
    )
    p.add_argument("--dropout", type=float, help="dropout (preset)")
    p.add_argument(
        "--patience",
        type=non_negative_int,
        help="stop after this many epochs without a better validation metric (preset; 0 = never)",
    )
    p.add_argument(
        "--scale", type=positive_float, help="synthetic graphs: size relative to the real one"
    )
    p.add_argument("--num-nodes", type=positive_int, help="synthetic graphs: number of nodes")
    p.add_argument("--adj-t", action="store_true", help=adj_t_help)
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` once the checks argparse cannot make alone pass (else ``p.error``)."""
    if len(args.seeds) == 1 and args.seeds[0] < 1:
        p.error(f"argument --seeds: one number counts the seeds, at least 1, got {args.seeds[0]}")
    if args.policy == "acgc" and args.loss_bound is None:
        p.error("argument --policy acgc needs --loss-bound E (e.g. 0.01)")
    if args.loss_bound is not None and args.policy != "acgc":
        p.error("argument --loss-bound applies to --policy acgc only")
    if args.bits is None and (args.memory_budget is not None or args.policy == "acgc"):
        p.error("--memory-budget and --policy acgc compress: not with --bits fp32")
    return args


def memory_budget_arg(text: str) -> int:
    """``--memory-budget``: bytes, as ``compress_gnn(memory_budget=...)`` reads them."""
    try:
        n = parse_bytes(int(text) if text.strip().isdigit() else text)
    except (ValueError, TypeError, OverflowError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return n


def compress_options(args: argparse.Namespace) -> dict[str, Any]:
    """`compress_gnn`'s keywords for the flags (``--bits``, ``--fixed-bits``, ``--policy``,
    ``--loss-bound``, ``--memory-budget``)."""
    kw: dict[str, Any] = {"bits": args.bits, "adaptive": not args.fixed_bits}
    if args.policy != "adaptive":
        kw.update(policy=args.policy, loss_bound=args.loss_bound)
    if args.memory_budget is not None:
        kw["memory_budget"] = args.memory_budget
    return kw


def budget_record(ctl) -> dict[str, Any] | None:
    """What the memory-budget planner chose and measured (None without a budget): the budget,
    the meter that judged, the plan per unit, its prediction, the smallest feasible budget,
    and every step's phase, predicted and measured bytes."""
    planner = getattr(ctl, "budget", None)
    if planner is None:
        return None
    state = planner.plan_state
    steps = [
        {k: h.get(k) for k in ("step", "phase", "predicted", "measured", "resident", "rectified")}
        for h in planner.history
    ]
    planned = [h["measured"] for h in steps if h["phase"] == "planned" and h["measured"]]
    return {
        "budget_bytes": planner.budget,
        "meter": planner.meter,
        "plan": None if state is None else {n: o.label for n, o in state.plan.choice.items()},
        "predicted_bytes": None if state is None else int(state.predicted),
        "least_budget_bytes": None if state is None else int(state.least_budget),
        "relaxed": None if state is None else state.relaxed,
        "profiles": planner.profiles,
        "worst_planned_bytes": max(planned) if planned else None,
        "worst_step_bytes": max((h["measured"] or 0) for h in steps) if steps else None,
        "steps": steps,
    }


def split_metrics(data, out: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The dataset's metric of ``out`` on the train, val and test nodes."""
    return {
        split: evaluate(data, out, y, getattr(data, f"{split}_mask"))
        for split in ("train", "val", "test")
    }


class BestEpoch:
    """The epoch of best validation metric (``best``: its metrics and ``"epoch"``), and early
    stopping after ``patience`` epochs without a better one (``None``: never)."""

    def __init__(self, patience: int | None):
        self.patience = patience
        self.best: dict[str, Any] = {"val": -math.inf, "epoch": -1}
        self.bad_epochs = 0

    def update(self, metrics: dict[str, float], epoch: int) -> bool:
        """Record an epoch's metrics; True when training stops here."""
        if metrics["val"] > self.best["val"]:
            self.best = {**metrics, "epoch": epoch}
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
        return self.patience is not None and self.bad_epochs >= self.patience


def release(ctl) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(adaptation, memory_budget)`` of the JSON, read from ``ctl`` over the whole run, then
    its hooks removed; ``(None, None)`` without a controller."""
    if ctl is None:
        return None, None
    budget = budget_record(ctl)
    adapt = None
    if ctl.adapter is not None:  # what adaptation cost, over the whole run
        adapt = {
            "overhead": ctl.adapter.overhead(),
            "estimates": ctl.adapter.n_estimates,
            "plan": dict(ctl.plan),
        }
    ctl.remove()
    return adapt, budget


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(
        __doc__,
        ["gcn", "gat", "gcnii"],
        dataset_help="ogbn-arxiv, ogbn-products, flickr, reddit, yelp, cora, citeseer, "
        "pubmed,\nsynthetic (default) or synthetic-<name>",
        adj_t_help="GCN/GCNII: propagate with the cached normalized sparse adjacency\n"
        "data.adj_t (torch.sparse_csr) instead of edge_index",
    )
    return checked(p, p.parse_args(argv))


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model's preset for the dataset with the command-line overrides applied."""
    cfg = preset(args.model, args.dataset)
    model = cfg["model"]
    for flag, key in [("layers", "num_layers"), ("hidden", "hidden_channels"),
                      ("dropout", "dropout")]:  # fmt: skip
        if getattr(args, flag) is not None:
            model[key] = getattr(args, flag)
    if args.heads is not None:
        if args.model != "gat":
            raise SystemExit("--heads applies to --model gat only")
        model["heads"] = args.heads
    for flag in ["lr", "weight_decay", "weight_decay_conv", "epochs", "patience"]:
        if getattr(args, flag) is not None:
            cfg[flag] = getattr(args, flag)
    if args.adj_t:
        if args.model == "gat":
            raise SystemExit("--adj-t applies to GCN and GCNII (GAT needs the graph structure)")
        model["normalize"] = False  # data.adj_t is normalized once, up front
    if cfg.get("patience") == 0:
        cfg["patience"] = None
    return cfg


def make_optimizer(model: torch.nn.Module, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if "weight_decay_conv" in cfg and hasattr(model, "parameter_groups"):
        groups = model.parameter_groups(cfg["weight_decay_conv"], cfg["weight_decay"])
        return torch.optim.Adam(groups, lr=cfg["lr"])
    return torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])


def run_seed(seed: int, data, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(seed)
    model = build_model(args.model, data.num_features, data.num_classes, **cfg["model"])
    model = model.to(device)
    optimizer = make_optimizer(model, cfg)
    loss_fn = F.binary_cross_entropy_with_logits if data.multilabel else F.cross_entropy
    x, y = data.x, data.y
    edge_index = data.adj_t if args.adj_t else data.edge_index
    train_mask = data.train_mask

    def forward_loss() -> torch.Tensor:
        out = model(x, edge_index)
        return loss_fn(out[train_mask], y[train_mask])

    def train_step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = forward_loss()
        loss.backward()
        return loss

    bits = args.bits
    ctl = None if bits is None else compress_gnn(model, **compress_options(args))

    tracker = BestEpoch(cfg["patience"])
    stats = None
    step_times = []
    bar = tqdm(range(cfg["epochs"]), desc=f"seed {seed}", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    with peak_memory(device) as peak:
        for epoch in bar:
            model.train()
            _sync(device)
            start = time.perf_counter()
            loss = train_step()
            optimizer.step()
            if ctl is not None:
                ctl.iterate(train_step)
                stats = ctl.stats()
            _sync(device)
            step_times.append(time.perf_counter() - start)

            model.eval()
            with torch.no_grad():
                out = model(x, edge_index)
            metrics = split_metrics(data, out, y)
            stop = tracker.update(metrics, epoch)
            bar.set_postfix(loss=f"{loss.item():.4f}", train=f"{metrics['train']:.4f}",
                            val=f"{metrics['val']:.4f}", test=f"{metrics['test']:.4f}")  # fmt: skip
            if stop:
                break
    bar.close()

    if ctl is not None:
        act_stored = stats["total"]["stored_bytes"]
    adapt, budget = release(ctl)
    # What stock PyTorch would save for one training forward of the final model (after
    # training, so it changes neither the RNG stream nor the measured peak).
    model.train()
    act_fp32 = count_saved_bytes(forward_loss, model)
    if ctl is None:
        act_stored = act_fp32

    # Warm-up epochs (allocator, first compression plan) are not representative of speed.
    timed = step_times[min(3, len(step_times) - 1) :] if len(step_times) > 4 else step_times
    best = tracker.best
    return {
        "seed": seed,
        "best_epoch": best["epoch"],
        "epochs_run": len(step_times),
        "train_metric": best["train"],
        "val_metric": best["val"],
        "test_metric": best["test"],
        "peak_memory_bytes": int(peak.peak_bytes),
        "activation_bytes_fp32": int(act_fp32),
        "activation_bytes_stored": int(act_stored),
        "epoch_time_s": statistics.fmean(timed),
        "adaptation": adapt,
        "memory_budget": budget,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seeds(values: list[int]) -> list[int]:
    return list(range(values[0])) if len(values) == 1 else values


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    def mean_std(key: str) -> tuple[float, float]:
        vals = [r[key] for r in per_seed]
        return statistics.fmean(vals), statistics.pstdev(vals)

    test_mean, test_std = mean_std("test_metric")
    val_mean, val_std = mean_std("val_metric")
    fp32 = statistics.fmean(r["activation_bytes_fp32"] for r in per_seed)
    stored = statistics.fmean(r["activation_bytes_stored"] for r in per_seed)
    return {
        "test_metric_mean": test_mean,
        "test_metric_std": test_std,
        "val_metric_mean": val_mean,
        "val_metric_std": val_std,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in per_seed),
        "activation_bytes_fp32": int(fp32),
        "activation_bytes_stored": int(stored),
        "compression_ratio": fp32 / stored if stored else None,
        "epoch_time_s": statistics.fmean(r["epoch_time_s"] for r in per_seed),
        "adapt_overhead": (
            statistics.fmean(r["adaptation"]["overhead"] for r in per_seed)
            if all(r["adaptation"] for r in per_seed)
            else None
        ),
        "per_seed": per_seed,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def load_data(args: argparse.Namespace, **kwargs):
    """The dataset ``args`` names, on ``args.device``, with its load time in seconds; sets the
    CPU threads. Shared by the mini-batch example. A dataset that is not on disk ends the
    program with the loader's message (it says what to do) and, for a real dataset, the
    synthetic stand-in of the same size."""
    synthetic = {}
    if args.scale is not None:
        synthetic["scale"] = args.scale
    if args.num_nodes is not None:
        synthetic["num_nodes"] = args.num_nodes
    if synthetic and not args.dataset.lower().startswith("synthetic"):
        raise SystemExit("--scale/--num-nodes apply to synthetic datasets only")

    torch.set_num_threads(args.threads or usable_cpus())
    start = time.perf_counter()
    try:
        data = load_dataset(args.dataset, root=args.root, **kwargs, **synthetic)
    except (DatasetNotFoundError, ProcessedDataError) as err:
        hint = ""
        if not args.dataset.lower().startswith("synthetic"):
            hint = f"\n(offline stand-in of the same size: --dataset synthetic-{args.dataset})"
        raise SystemExit(f"error: {err}{hint}") from None
    load_s = time.perf_counter() - start
    return data.to(args.device), load_s


def write_json(path: str, summary: dict[str, Any]) -> None:
    """``summary`` as indented JSON at ``path``, its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


def bits_label(args: argparse.Namespace) -> str:
    """``fp32`` or e.g. ``2 bits adaptive``: what the run compresses to, for the header."""
    if args.bits is None:
        return "fp32"
    label = f"{args.bits} bits" + (" fixed" if args.fixed_bits else " adaptive")
    if args.policy == "acgc":
        label = f"acgc, loss bound {args.loss_bound}"
    if args.memory_budget is not None:
        label += f", memory budget {_mib(args.memory_budget)}"
    return label


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = resolve_config(args)
    data, load_s = load_data(args, adj_t=args.adj_t)
    metric = data.metric
    bits = bits_label(args)
    print(
        f"{data.name}: {data.num_nodes:,} nodes, {data.num_edges:,} edges, "
        f"{data.num_features} features, {data.num_classes} classes (loaded in {load_s:.1f}s)\n"
        f"{args.model.upper()} {cfg['model']}, lr {cfg['lr']}, wd {cfg['weight_decay']}, "
        f"{cfg['epochs']} epochs, patience {cfg['patience']}, {bits}, device {args.device} "
        f"({torch.get_num_threads()} CPU threads)"
    )

    per_seed = [run_seed(seed, data, args, cfg) for seed in _seeds(args.seeds)]
    summary = summarize(per_seed)
    ratio = summary["compression_ratio"]
    print(
        f"test {metric}: {100 * summary['test_metric_mean']:.2f} ± "
        f"{100 * summary['test_metric_std']:.2f} (val {100 * summary['val_metric_mean']:.2f}, "
        f"{len(per_seed)} seed(s), at the epoch of best validation)\n"
        f"peak memory: {_mib(summary['peak_memory_bytes'])} "
        f"({'CUDA max allocated' if args.device.startswith('cuda') else 'process peak RSS'})\n"
        f"activations saved for backward: {_mib(summary['activation_bytes_fp32'])} fp32 -> "
        f"{_mib(summary['activation_bytes_stored'])} stored"
        + (f" ({ratio:.1f}x)" if ratio else "")
        + f"\nepoch time: {1000 * summary['epoch_time_s']:.1f} ms (train step)"
        + (
            f"\nadaptation: {100 * summary['adapt_overhead']:.1f}% of training time"
            if summary["adapt_overhead"] is not None
            else ""
        )
    )
    summary = {
        **summary,
        "dataset": data.name,
        "metric": metric,
        "num_nodes": data.num_nodes,
        "num_edges": data.num_edges,
        "config": cfg,
        "args": {k: v for k, v in vars(args).items()},
    }
    if args.json:
        write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
