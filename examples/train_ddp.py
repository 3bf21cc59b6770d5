"""Data-parallel mini-batch training of a compressed GNN: `torch.distributed` + DDP.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py               # gloo, CPU
    torchrun --standalone --nproc_per_node=4 examples/train_ddp.py --dataset flickr --root data

One process per GPU (NCCL) or per CPU worker (gloo, ``--device cpu`` or no GPU). Every
process compresses its own model (``compress_gnn(model)``, then
``DistributedDataParallel(model)``: the controller's hooks live inside the forward, DDP's
gradient all-reduce runs in backward on the parameters' gradients, untouched) and trains on
its own mini-batches: NeighborLoader over its shard of the training nodes, or every
``WORLD_SIZE``-th part of one RandomNodeLoader permutation that all ranks draw alike. The
flags and the JSON are those of ``train_minibatch.py`` (``--seeds`` runs the seeds one after
another); rank 0 evaluates full-graph, prints and writes the JSON, with every rank's bytes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import NeighborLoader, RandomNodeLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_full_batch as full  # noqa: E402
import train_minibatch as mini  # noqa: E402  (flags, presets, models)

from gact_graph import compress_gnn  # noqa: E402
from gact_graph.cpus import usable_cpus  # noqa: E402
from gact_graph.datasets import (  # noqa: E402
    DatasetNotFoundError,
    ProcessedDataError,
    evaluate,
    load_dataset,
)
from gact_graph.memory import count_saved_bytes, peak_memory  # noqa: E402


def rank_batches(args, data, cfg, seed: int, rank: int, world: int):
    """This rank's batches of one epoch (a generator), how many every rank takes (equal on all
    ranks: DDP needs every rank in every all-reduce), and the loss rows of a batch."""
    gen = torch.Generator().manual_seed(seed)
    if args.loader == "neighbor":
        train = data.train_mask.nonzero().view(-1)
        shard = train[torch.randperm(train.numel(), generator=gen)][rank::world]
        layers = cfg["model"]["num_layers"]
        loader = NeighborLoader(
            data, num_neighbors=args.num_neighbors or [10] * layers, batch_size=args.batch_size,
            input_nodes=shard, shuffle=True, generator=gen,
        )  # fmt: skip
        steps = train.numel() // world // args.batch_size or 1
        return loader, steps, lambda b: slice(0, b.batch_size)
    loader = RandomNodeLoader(data, num_parts=args.num_parts, shuffle=True, generator=gen)
    mine = (b for i, b in enumerate(loader) if i % world == rank)
    return mine, max(1, args.num_parts // world), lambda b: b.train_mask


def run_seed(seed, data, args, cfg, rank: int, world: int, device) -> dict[str, Any]:
    torch.manual_seed(seed)  # the same initial model on every rank (DDP broadcasts rank 0's)
    model = mini.make_model(args, data, cfg).to(device)
    ctl = None
    if args.bits is not None:
        ctl = compress_gnn(model, bits=args.bits, adaptive=not args.fixed_bits)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = full.make_optimizer(ddp.module, cfg)
    loss_fn = F.binary_cross_entropy_with_logits if data.multilabel else F.cross_entropy
    torch.manual_seed(seed * 1000 + rank)  # each rank its own dropout masks
    best = {"val": -math.inf, "epoch": -1}
    measured, epoch_times = [], []  # (batch, rows, stored bytes) of the last epoch's first
    peak_bytes = 0
    for epoch in range(cfg["epochs"]):
        ddp.train()
        measured = []
        start = time.perf_counter()
        batches, steps, seeds_of = rank_batches(args, data, cfg, seed + epoch, rank, world)
        with peak_memory(device) as peak:  # training only, as train_minibatch.py measures
            for _, batch in zip(range(steps), batches):
                batch = batch.to(device)
                rows = seeds_of(batch)

                def train_step(batch=batch, rows=rows) -> torch.Tensor:
                    optimizer.zero_grad()
                    out = ddp(batch.x, batch.edge_index)
                    # a part without training nodes still joins the all-reduce, with zeros
                    loss = (
                        loss_fn(out[rows], batch.y[rows])
                        if batch.y[rows].numel()
                        else 0 * out.sum()
                    )
                    loss.backward()
                    return loss

                train_step()
                optimizer.step()
                if len(measured) < args.measure_batches:
                    nbytes = None if ctl is None else ctl.stats()["total"]["stored_bytes"]
                    measured.append((batch, rows, nbytes))
                if ctl is not None:
                    # the adaptive probe rides on the next step's backward; no step_fn, whose
                    # extra backward would be one more all-reduce than the other ranks run
                    ctl.iterate()
        peak_bytes = max(peak_bytes, peak.peak_bytes)
        epoch_times.append(time.perf_counter() - start)
        if rank == 0:
            ddp.eval()
            with torch.no_grad():
                out = ddp.module(data.x, data.edge_index)
            metrics = {
                s: evaluate(data, out, data.y, getattr(data, f"{s}_mask"))
                for s in ("train", "val", "test")
            }
            if metrics["val"] > best["val"]:
                best = {**metrics, "epoch": epoch}
            print(f"seed {seed} epoch {epoch}: val {metrics['val']:.4f}", flush=True)
    if ctl is not None:
        ctl.remove()
    # stock PyTorch's saved bytes on the same batches, on the bare module (no DDP, no
    # all-reduce) with the RNG restored
    model.train()
    fp32, stored = [], []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for batch, rows, nbytes in measured:
            fwd = lambda b=batch, r=rows: model(b.x, b.edge_index)[r]  # noqa: E731
            fp32.append(count_saved_bytes(fwd, model))
            stored.append(fp32[-1] if nbytes is None else nbytes)
    mine = {"rank": rank, "peak_memory_bytes": int(peak_bytes),
            "activation_bytes_fp32": int(statistics.fmean(fp32)),
            "activation_bytes_stored": int(statistics.fmean(stored))}  # fmt: skip
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    timed = epoch_times[1:] if len(epoch_times) > 1 else epoch_times
    return {
        "seed": seed,
        "best_epoch": best["epoch"],
        "epochs_run": len(epoch_times),
        "train_metric": best.get("train"),
        "val_metric": best["val"],
        "test_metric": best.get("test"),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        # per batch: stock PyTorch's bytes and the controller's, on each rank's own batches
        "activation_bytes_fp32": int(statistics.fmean(r["activation_bytes_fp32"] for r in ranks)),
        "activation_bytes_stored": int(
            statistics.fmean(r["activation_bytes_stored"] for r in ranks)
        ),
        "epoch_time_s": statistics.fmean(timed),
        "ranks": ranks,
        "ranks_identical": all(torch.equal(g, gathered[0]) for g in gathered),
        "adaptation": None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = mini.parse_args(argv)
    cfg = mini.resolve_config(args)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():  # torchrun's env:// rendezvous (MASTER_ADDR/PORT set)
        dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(args.threads or max(1, usable_cpus() // world))
    try:
        synthetic = {k: getattr(args, k) for k in ("scale", "num_nodes") if getattr(args, k)}
        try:
            data = load_dataset(args.dataset, root=args.root, **synthetic).to(device)
        except (DatasetNotFoundError, ProcessedDataError) as err:
            raise SystemExit(f"error: {err}") from None
        if rank == 0:
            print(
                f"{data.name}: {data.num_nodes:,} nodes, {world} processes ({backend}), "
                f"{args.model.upper()} {cfg['model']}, {cfg['epochs']} epochs, "
                f"{'fp32' if args.bits is None else f'{args.bits} bits'}, loader {args.loader}",
                flush=True,
            )
        per_seed = [
            run_seed(s, data, args, cfg, rank, world, device) for s in full._seeds(args.seeds)
        ]
        if rank != 0:
            return None
        summary = full.summarize(per_seed)
        summary.update(
            dataset=data.name, metric=data.metric, num_nodes=data.num_nodes,
            num_edges=data.num_edges, config=cfg, args=dict(vars(args)), world_size=world,
            backend=backend,
        )  # fmt: skip
        print(
            f"test {data.metric}: {100 * summary['test_metric_mean']:.2f} "
            f"(val {100 * summary['val_metric_mean']:.2f}); per batch and rank "
            f"{full._mib(summary['activation_bytes_fp32'])} -> "
            f"{full._mib(summary['activation_bytes_stored'])} saved for backward; "
            f"ranks identical: {all(r['ranks_identical'] for r in per_seed)}"
        )
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return summary
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
