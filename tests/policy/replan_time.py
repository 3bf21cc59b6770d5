"""Wall time of each training step of the default (adaptive) mode, and each probed step's
time over the median of the others: what a re-planning step costs.

    python tests/policy/replan_time.py [--models gat,gcn,gcnii] [--scale 0.02] [--steps 17]
    python tests/policy/replan_time.py --device cuda --scale 1 --models gat   # a GPU
    python tests/policy/replan_time.py --clock process   # CPU time: on a shared machine

One CPU thread, the ogbn-arxiv presets of `gact_graph.models.preset` on the synthetic arxiv-like
graph at ``--scale``; a step is forward, loss, backward, Adam step and ``ctl.iterate()``. The
default mode re-estimates at steps 0, 1, 3, 7, 15, ... (where it spreads a re-estimation over
several steps, each of them probes a share of the tensors and later ones move on); a step is
probed when the adapter has a probe armed for it. Step 0 also pays first-call costs, so the
figures to read are the worst and the mean of the later probed steps over the median of the
steps not probed. Prints one JSON line per model. The package
is the one on ``PYTHONPATH`` if any (to time two trees in one session), else this checkout's.
``--clock process`` times each step by the process's CPU time instead of the wall clock (CPU
only): on a machine shared with other jobs, waiting for a core then does not count, so ratios of
two trees measured at different moments compare."""

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

try:
    import gact_graph  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.datasets import load_dataset
from gact_graph.models import build_model, preset


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a step's wall time includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(
    name: str, data, steps: int, device: torch.device, clock=time.perf_counter
) -> list[float]:
    cfg = preset(name, "synthetic-ogbn-arxiv")
    torch.manual_seed(0)
    model = build_model(name, data.num_features, int(data.num_classes), **cfg["model"])
    model = model.to(device)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    ctl = compress_gnn(model, bits=2)

    def step_fn():
        opt.zero_grad(set_to_none=True)
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        return loss

    times, probed, shares = [], [], []
    for _ in range(steps):
        adapter = ctl.adapter
        probed.append(getattr(adapter, "_probe", None) is not None)
        # the steps its re-estimation is spread over (absent before estimates were spread)
        progress = adapter.progress() if hasattr(adapter, "progress") else {"in_progress": False}
        shares.append(progress["shares"] if progress["in_progress"] else int(probed[-1]))
        sync(device)
        t0 = clock()
        step_fn()
        opt.step()
        ctl.iterate(step_fn)
        sync(device)
        times.append(clock() - t0)
    ctl.remove()
    return times, probed, shares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gat,gcn,gcnii")
    p.add_argument("--scale", type=float, default=0.02)
    p.add_argument("--steps", type=int, default=17)
    p.add_argument("--device", default="cpu")
    p.add_argument("--clock", choices=("wall", "process"), default="wall")
    args = p.parse_args()
    if args.clock == "process" and args.device != "cpu":
        p.error("--clock process times CPU steps only (a GPU's work is not the process's)")
    clock = time.process_time if args.clock == "process" else time.perf_counter
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    data = load_dataset("synthetic-ogbn-arxiv", scale=args.scale, seed=0).to(device)
    for name in args.models.split(","):
        times, probed, shares = step_times(name, data, args.steps, device, clock)
        steps = [i for i, p in enumerate(probed) if p]
        # a tiny graph may re-estimate at every step: then the median is over all of them
        plain = [t for i, t in enumerate(times) if not probed[i]] or times
        median = statistics.median(plain)
        ratios = {i: times[i] / median for i in steps}
        later = [r for i, r in ratios.items() if i > 0]
        print(json.dumps({
            "model": name, "clock": args.clock, "median_s": round(median, 4),
            "probed_over_median": {str(i): round(r, 2) for i, r in ratios.items()},
            "worst_later_probed": round(max(later), 2) if later else None,
            "mean_later_probed": round(statistics.mean(later), 2) if later else None,
            "probed_steps": len(later), "unprobed_steps": len(times) - len(steps),
            "shares": {str(i): shares[i] for i in steps},
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
