"""What a re-planning step issues beyond a plain step, counted rather than timed: operations
dispatched (each a kernel launch or more on a GPU, where a small-graph step is launch-bound),
host scalar reads (``.item()``, ``float()``: each a host sync on a GPU) in the forward, the
backward and ``ctl.iterate()``, and the probe's partial backwards (``torch.autograd.grad``
calls). Counts do not depend on how busy the machine is, so two trees compare on a shared one.

    python tests/policy/replan_counts.py [--models gat,gcn] [--scale 0.02]

The step of `tests/policy/replan_time.py` (ogbn-arxiv presets, synthetic arxiv-like graph, one
CPU thread, default mode); it prints one JSON line per model with a plain step (6) and a
re-planning one (7; where the adapter spreads a re-estimation over several steps, the first of
them, which probes its first share of the tensors only). The package is the one on
``PYTHONPATH`` if any, else this checkout's."""

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

try:
    import gact_graph  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gact_graph import compress_gnn
from gact_graph.datasets import load_dataset
from gact_graph.models import build_model, preset


class _Count(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, phase: list[str]) -> None:
        super().__init__()
        self.counts, self.phase = counts, phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts["ops_" + self.phase[0]] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["reads_" + self.phase[0]] += 1
        return func(*args, **(kwargs or {}))


def counts(name: str, data) -> dict:
    cfg = preset(name, "synthetic-ogbn-arxiv")
    torch.manual_seed(0)
    model = build_model(name, data.num_features, int(data.num_classes), **cfg["model"])
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    ctl = compress_gnn(model, bits=2)
    calls = [0]
    real_grad = torch.autograd.grad

    def grad(*args, **kwargs):
        calls[0] += 1
        return real_grad(*args, **kwargs)

    out: dict = {}
    tally: collections.Counter = collections.Counter()
    phase = ["forward"]
    torch.autograd.grad = grad
    try:
        for i in range(8):  # steps 0, 1, 3, 7 re-plan
            tally.clear()
            calls[0] = 0
            with _Count(tally, phase):
                phase[0] = "forward"
                opt.zero_grad(set_to_none=True)
                logits = model(data.x, data.edge_index)
                loss = F.cross_entropy(logits[data.train_mask], data.y[data.train_mask])
                phase[0] = "backward"
                loss.backward()
                phase[0] = "iterate"
                opt.step()
                ctl.iterate()
            if i in (6, 7):
                out["replanning" if i == 7 else "plain"] = dict(tally, grad_calls=calls[0])
    finally:
        torch.autograd.grad = real_grad
        ctl.remove()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gat,gcn")
    p.add_argument("--scale", type=float, default=0.02)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    data = load_dataset("synthetic-ogbn-arxiv", scale=args.scale, seed=0)
    for name in args.models.split(","):
        print(json.dumps({"model": name, **counts(name, data)}), flush=True)


if __name__ == "__main__":
    main()
