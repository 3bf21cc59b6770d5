"""Mini-batch node classification with compressed activations (PyG's loaders).

The mini-batch twin of ``train_full_batch.py``: the same flags and JSON keys, and a few more
for the loader. Every training step takes a new subgraph: with ``NeighborLoader`` (needs
``pyg-lib`` or ``torch-sparse``) the sampled neighbourhood of ``--batch-size`` training nodes,
loss on those seed nodes; with ``RandomNodeLoader`` (pure PyTorch) one of ``--num-parts``
random node parts and the edges inside it, loss on its training nodes. ``--loader auto``
(default) takes NeighborLoader where a sampler library imports, else RandomNodeLoader, and
says which. Validation and test run full-graph under ``no_grad`` (nothing is saved there).

    python examples/train_minibatch.py                          # GraphSAGE, synthetic graph
    python examples/train_minibatch.py --bits fp32              # the uncompressed baseline
    python examples/train_minibatch.py --dataset flickr --root data --model gat
    python examples/train_minibatch.py --dataset synthetic-flickr --loader random

GraphSAINT's Flickr, Reddit and Yelp and ogbn-products are read from ``--root`` when present
(nothing is downloaded; a missing dataset raises with the files to put where); their
``synthetic-<name>`` stand-ins have the same sizes and build offline.

Memory per batch: ``activation_bytes_stored`` is the mean over the last epoch's first
``--measure-batches`` training batches of what the controller stored (``ctl.stats()``), and
``activation_bytes_fp32`` what stock PyTorch saves for backward on those same batches
(measured after training); ``activation_bytes_stored_max`` the largest batch of them.
``peak_memory_bytes`` is the peak (CUDA max allocated, or process peak RSS) of the training
steps only (forward, backward, optimizer): neither the loader's sampling (on CPU it touches
every edge of the graph) nor full-graph evaluation, which batching does not bound;
``peak_above_start_bytes`` is the largest step's peak above what the process held when that
step began (the graph, the batch, the model, the interpreter). For RSS that follows live
bytes, run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then returns freed buffers at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
import torch_geometric.typing as pyg_typing
from torch_geometric.loader import NeighborLoader, RandomNodeLoader
from torch_geometric.nn import GraphSAGE
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_full_batch as full  # noqa: E402  (its flags, presets and summary, shared)

from gact_graph import compress_gnn  # noqa: E402
from gact_graph.memory import count_saved_bytes, peak_memory  # noqa: E402
from gact_graph.models import build_model  # noqa: E402

#: GraphSAGE as PyG's Reddit / ogbn-products examples train it (2 layers x 256, dropout 0.5).
SAGE_PRESET = {
    "model": {"num_layers": 2, "hidden_channels": 256, "dropout": 0.5},
    "lr": 0.003, "weight_decay": 0.0, "epochs": 20, "patience": None,
}  # fmt: skip


def sampler_available() -> bool:
    """NeighborLoader needs pyg-lib or torch-sparse (PyG 2.8 raises ImportError without)."""
    return bool(pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = full.base_parser(
        __doc__,
        ["sage", "gcn", "gat", "gcnii"],
        dataset_help="flickr, reddit, yelp, ogbn-products, ogbn-arxiv, cora, citeseer, pubmed,\n"
        "synthetic (default) or synthetic-<name>",
        adj_t_help="full-batch only (a cached normalized adjacency of the whole graph); refused "
        "here",
    )
    # --- mini-batch only
    p.add_argument(
        "--loader",
        choices=["auto", "neighbor", "random"],
        default="auto",
        help="NeighborLoader (needs pyg-lib or torch-sparse), RandomNodeLoader, or auto:\n"
        "neighbor where a sampler library imports, else random",
    )
    p.add_argument(
        "--batch-size",
        type=full.positive_int,
        default=1024,
        help="NeighborLoader: seed (training) nodes per batch (default 1024)",
    )
    p.add_argument(
        "--num-neighbors",
        type=int,
        nargs="+",
        help="NeighborLoader: neighbours sampled per layer (default 10 for every layer)",
    )
    p.add_argument(
        "--num-parts",
        type=full.positive_int,
        default=10,
        help="RandomNodeLoader: random node parts per epoch (default 10)",
    )
    p.add_argument(
        "--measure-batches",
        type=full.positive_int,
        default=8,
        help="batches of the last epoch whose saved bytes are reported (default 8)",
    )
    args = full.checked(p, p.parse_args(argv))
    if args.adj_t:
        p.error("--adj-t is full-batch only: every mini-batch is a new graph (use edge_index)")
    if args.loader == "auto":
        args.loader = "neighbor" if sampler_available() else "random"
    elif args.loader == "neighbor" and not sampler_available():
        p.error(
            "--loader neighbor needs pyg-lib or torch-sparse (pip install torch-sparse builds "
            "from source: over 25 minutes on 2 cores); --loader random runs without"
        )
    return args


def resolve_config(args: argparse.Namespace) -> dict[str, Any]:
    """The preset (GraphSAGE: `SAGE_PRESET`; others: ``gact_graph.models.preset``) with the
    command-line overrides applied, as ``train_full_batch.resolve_config`` applies them."""
    if args.model != "sage":
        return full.resolve_config(args)
    cfg = json.loads(json.dumps(SAGE_PRESET))
    if args.dataset.lower().removeprefix("synthetic-") in {"cora", "citeseer", "pubmed"}:
        cfg["model"]["hidden_channels"], cfg["weight_decay"], cfg["lr"] = 16, 5e-4, 0.01
    for flag, key in [("layers", "num_layers"), ("hidden", "hidden_channels"),
                      ("dropout", "dropout")]:  # fmt: skip
        if getattr(args, flag) is not None:
            cfg["model"][key] = getattr(args, flag)
    if args.heads is not None:
        raise SystemExit("--heads applies to --model gat only")
    for flag in ["lr", "weight_decay", "epochs", "patience"]:
        if getattr(args, flag) is not None:
            cfg[flag] = getattr(args, flag)
    if cfg.get("patience") == 0:
        cfg["patience"] = None
    return cfg


def make_model(args: argparse.Namespace, data, cfg: dict[str, Any]) -> torch.nn.Module:
    if args.model == "sage":
        m = cfg["model"]
        return GraphSAGE(
            data.num_features, m["hidden_channels"], m["num_layers"], data.num_classes,
            dropout=m["dropout"],
        )  # fmt: skip
    return build_model(args.model, data.num_features, data.num_classes, **cfg["model"])


def make_loader(args: argparse.Namespace, data, cfg: dict[str, Any], seed: int):
    """The training loader, shuffled by a generator of ``seed``; ``seeds_of(batch)``: the rows
    of the batch the loss is taken on."""
    gen = torch.Generator().manual_seed(seed)
    if args.loader == "neighbor":
        layers = cfg["model"]["num_layers"]
        fanout = args.num_neighbors or [10] * layers
        if len(fanout) != layers:
            raise SystemExit(f"--num-neighbors needs {layers} numbers (one per layer)")
        loader = NeighborLoader(
            data, num_neighbors=fanout, batch_size=args.batch_size, input_nodes=data.train_mask,
            shuffle=True, generator=gen,
        )  # fmt: skip
        return loader, lambda b: slice(0, b.batch_size)
    loader = RandomNodeLoader(data, num_parts=args.num_parts, shuffle=True, generator=gen)
    return loader, lambda b: b.train_mask


def run_seed(seed: int, data, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(seed)
    model = make_model(args, data, cfg).to(device)
    optimizer = full.make_optimizer(model, cfg)
    loss_fn = F.binary_cross_entropy_with_logits if data.multilabel else F.cross_entropy
    loader, seeds_of = make_loader(args, data, cfg, seed)
    ctl = None
    if args.bits is not None:
        ctl = compress_gnn(model, **full.compress_options(args))

    tracker = full.BestEpoch(cfg["patience"])
    step_times, epoch_times = [], []
    measured = []  # (batch, stored bytes) of the last epoch's first batches
    bar = tqdm(range(cfg["epochs"]), desc=f"seed {seed}", disable=args.no_progress,
               dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    peak_bytes = peak_above = 0  # peak of the training steps; and above their start
    for epoch in bar:
        model.train()
        measured = []
        epoch_start = time.perf_counter()
        for batch in loader:
            batch = batch.to(device)
            rows = seeds_of(batch)
            if batch.y[rows].numel() == 0:  # a random part without training nodes
                continue

            def train_step(batch=batch, rows=rows) -> torch.Tensor:
                optimizer.zero_grad()
                out = model(batch.x, batch.edge_index)
                loss = loss_fn(out[rows], batch.y[rows])
                loss.backward()
                return loss

            full._sync(device)
            start = time.perf_counter()
            # the peak of the training step alone: not the loader's sampling (O(edges of the
            # whole graph) on CPU) nor full-graph evaluation, which batching does not bound
            with peak_memory(device) as peak:
                loss = train_step()
                optimizer.step()
                if ctl is not None:
                    if len(measured) < args.measure_batches:
                        measured.append((batch, ctl.stats()["total"]["stored_bytes"]))
                    ctl.iterate(train_step)
                elif len(measured) < args.measure_batches:
                    measured.append((batch, None))
                full._sync(device)
            step_times.append(time.perf_counter() - start)
            peak_bytes = max(peak_bytes, peak.peak_bytes)
            peak_above = max(peak_above, peak.peak_bytes - peak.baseline_bytes)
        epoch_times.append(time.perf_counter() - epoch_start)

        model.eval()
        with torch.no_grad():
            out = model(data.x, data.edge_index)
        metrics = full.split_metrics(data, out, data.y)
        stop = tracker.update(metrics, epoch)
        bar.set_postfix(loss=f"{loss.item():.4f}", val=f"{metrics['val']:.4f}",
                        test=f"{metrics['test']:.4f}")  # fmt: skip
        if stop:
            break
    bar.close()

    adapt, budget = full.release(ctl)
    # Stock PyTorch's saved bytes on the same batches (after training: it changes neither
    # the RNG stream of training nor its measured peak).
    model.train()
    fp32, stored = [], []
    for batch, nbytes in measured:
        rows = seeds_of(batch)

        def forward_loss(batch=batch, rows=rows) -> torch.Tensor:
            return loss_fn(model(batch.x, batch.edge_index)[rows], batch.y[rows])

        fp32.append(count_saved_bytes(forward_loss, model))
        stored.append(fp32[-1] if nbytes is None else nbytes)
    timed = epoch_times[1:] if len(epoch_times) > 1 else epoch_times  # first: warm-up
    best = tracker.best
    return {
        "seed": seed,
        "best_epoch": best["epoch"],
        "epochs_run": len(epoch_times),
        "train_metric": best["train"],
        "val_metric": best["val"],
        "test_metric": best["test"],
        "peak_memory_bytes": int(peak_bytes),
        "peak_above_start_bytes": int(peak_above),
        "activation_bytes_fp32": int(statistics.fmean(fp32)),
        "activation_bytes_stored": int(statistics.fmean(stored)),
        "activation_bytes_stored_max": int(max(stored)),
        "epoch_time_s": statistics.fmean(timed),
        "step_time_s": statistics.fmean(step_times),
        "batches_per_epoch": len(step_times) // max(1, len(epoch_times)),
        "adaptation": adapt,
        "memory_budget": budget,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = resolve_config(args)
    data, load_s = full.load_data(args)
    bits = full.bits_label(args)
    loader = (
        f"NeighborLoader(batch_size={args.batch_size}, "
        f"num_neighbors={args.num_neighbors or [10] * cfg['model']['num_layers']})"
        if args.loader == "neighbor"
        else f"RandomNodeLoader(num_parts={args.num_parts})"
        + ("" if sampler_available() else " (no pyg-lib/torch-sparse: no NeighborLoader)")
    )
    print(
        f"{data.name}: {data.num_nodes:,} nodes, {data.num_edges:,} edges, "
        f"{data.num_features} features, {data.num_classes} classes (loaded in {load_s:.1f}s)\n"
        f"{args.model.upper()} {cfg['model']}, lr {cfg['lr']}, wd {cfg['weight_decay']}, "
        f"{cfg['epochs']} epochs, patience {cfg['patience']}, {bits}, device {args.device} "
        f"({torch.get_num_threads()} CPU threads)\n{loader}"
    )

    per_seed = [run_seed(seed, data, args, cfg) for seed in full._seeds(args.seeds)]
    summary = full.summarize(per_seed)
    ratio = summary["compression_ratio"]
    stored_max = max(r["activation_bytes_stored_max"] for r in per_seed)
    print(
        f"test {data.metric}: {100 * summary['test_metric_mean']:.2f} ± "
        f"{100 * summary['test_metric_std']:.2f} (val {100 * summary['val_metric_mean']:.2f}, "
        f"{len(per_seed)} seed(s), at the epoch of best validation)\n"
        f"peak memory of a training step: {full._mib(summary['peak_memory_bytes'])} "
        f"({'CUDA max allocated' if args.device.startswith('cuda') else 'process peak RSS'}; "
        f"{full._mib(max(r['peak_above_start_bytes'] for r in per_seed))} above the start of "
        "a step)\n"
        f"activations saved for backward per batch: {full._mib(summary['activation_bytes_fp32'])}"
        f" fp32 -> {full._mib(summary['activation_bytes_stored'])} stored"
        + (f" ({ratio:.1f}x)" if ratio else "")
        + f", largest batch {full._mib(stored_max)}"
        + f"\nepoch time: {summary['epoch_time_s']:.2f} s "
        f"({per_seed[0]['batches_per_epoch']} batches)"
        + (
            f"\nadaptation: {100 * summary['adapt_overhead']:.1f}% of training time"
            if summary["adapt_overhead"] is not None
            else ""
        )
    )
    summary = {
        **summary,
        "activation_bytes_stored_max": stored_max,
        "loader": loader,
        "dataset": data.name,
        "metric": data.metric,
        "num_nodes": data.num_nodes,
        "num_edges": data.num_edges,
        "config": cfg,
        "args": dict(vars(args)),
    }
    if args.json:
        full.write_json(args.json, summary)
    return summary


if __name__ == "__main__":
    main()
