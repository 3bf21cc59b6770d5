"""Where a step's peak is: the tensors alive at the worst moment of one training step, grouped
by the source lines that allocated them, for the fixed-bit and the default (adaptive) mode.

On CUDA it records the caching allocator's history (`torch.cuda.memory._record_memory_history`,
Python stacks) over one step (``--step``; the default mode probes steps 0, 1, 3, 7, ...),
replays the trace to the moment the most bytes were live, and prints the largest groups.
``--profile`` adds a kernel table of one fixed-bit step and one stock step (`torch.profiler`),
with the host syncs counted. The model is an ogbn-arxiv preset of `gact_graph.models.preset`
on a synthetic graph of that dataset's statistics, as in ``benchmarks/step_time.py``.

    python benchmarks/peak_trace.py --device cuda --model gat            # full arxiv size
    python benchmarks/peak_trace.py --device cpu --scale 0.01 --profile  # profile only

A diagnostic, not a benchmark: it writes no JSON; the figures it explains come from
``benchmarks/step_time.py`` (worst step above rest, per mode).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gact_graph import compress_gnn  # noqa: E402
from gact_graph.datasets import load_dataset  # noqa: E402
from gact_graph.models import build_model, preset  # noqa: E402

MODES = {"fixed": {"bits": 2, "adaptive": False}, "default": {"bits": 2}}


def _stepper(base, data, cfg, setting):
    model = copy.deepcopy(base).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    ctl = None if setting is None else compress_gnn(model, **setting)
    mask = data.train_mask

    def fn():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(data.x, data.edge_index)[mask], data.y[mask])
        loss.backward()
        return loss

    def step():
        fn()
        opt.step()
        if ctl is not None:
            ctl.iterate(fn)

    return step, ctl


def live_at_peak(snapshot: dict, top: int) -> list[str]:
    """Replay the allocator trace of ``snapshot``; the largest groups of blocks alive at the
    moment the most bytes were (grouped by their innermost frames in this project or PyG)."""
    live, cur, best, at_best = {}, 0, 0, {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    groups: collections.Counter = collections.Counter()
    for e in at_best.values():
        frames = [f for f in e.get("frames", []) if "gact_graph" in f["filename"]
                  or "torch_geometric" in f["filename"]][:4]  # fmt: skip
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
        groups[where] += e["size"]
    lines = [f"trace peak {best / 2**20:.0f} MiB above the step's start"]
    lines += [f"  {b / 2**20:8.1f} MiB  {k or '(outside)'}" for k, b in groups.most_common(top)]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="gat", choices=["gcn", "gat", "gcnii"])
    p.add_argument("--dataset", default="synthetic-ogbn-arxiv")
    p.add_argument("--scale", type=float, default=None, help="default: 1.0 CUDA, 0.01 CPU")
    p.add_argument("--step", type=int, default=3, help="the step traced (0-based)")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--profile", action="store_true", help="kernel tables of fixed and stock")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    scale = args.scale if args.scale is not None else (1.0 if cuda else 0.01)
    data = load_dataset(args.dataset, scale=scale, seed=0).to(dev)
    cfg = preset(args.model, args.dataset)
    torch.manual_seed(0)
    base = build_model(args.model, data.num_features, int(data.num_classes), **cfg["model"])
    base = base.to(dev)
    print(f"# {args.model} on {args.dataset} x{scale:g} ({data.num_nodes} nodes), {dev}")
    if cuda:
        for name, setting in MODES.items():
            step, ctl = _stepper(base, data, cfg, setting)
            for s in range(args.step + 1):
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                rest = torch.cuda.memory_allocated(dev)
                if s == args.step:
                    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
                step()
                torch.cuda.synchronize(dev)
                if s == args.step:
                    with tempfile.TemporaryDirectory() as tmp:
                        path = os.path.join(tmp, "snapshot.pickle")
                        torch.cuda.memory._dump_snapshot(path)
                        with open(path, "rb") as f:
                            snapshot = pickle.load(f)
                    torch.cuda.memory._record_memory_history(enabled=None)
                peak = torch.cuda.max_memory_allocated(dev) - rest
                print(f"{name} step {s}: peak above rest {peak / 2**20:.0f} MiB", flush=True)
            print(f"## {name}, step {args.step}: " + "\n".join(live_at_peak(snapshot, args.top)))
            ctl.remove()
            del step, ctl
            torch.cuda.empty_cache()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        for name, setting in [("stock", None), ("fixed", MODES["fixed"])]:
            step, ctl = _stepper(base, data, cfg, setting)
            for _ in range(3):
                step()
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with profile(activities=acts) as prof:
                step()
                if cuda:
                    torch.cuda.synchronize(dev)
            print(f"\n## profile {name}: {1e3 * (time.perf_counter() - t0):.1f} ms (profiled)")
            events = prof.key_averages()
            print(events.table(sort_by=key, row_limit=28, max_name_column_width=60))
            syncs = ("Synchronize", "cudaMemcpy", "_local_scalar_dense", "nonzero")
            for e in events:
                if any(s in e.key for s in syncs):
                    print(f"  host sync {e.key}: {e.count}")
            if ctl is not None:
                ctl.remove()
            del step, ctl


if __name__ == "__main__":
    main()
