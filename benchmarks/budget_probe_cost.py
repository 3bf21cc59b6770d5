"""What the adaptive allocator's sensitivity probe adds to a step, counted, against the budget
planner's bound for it (`gact_graph.budget.probe_cost`) and the bound from shapes alone (six
fp32 copies of the largest saved tensor plus the parameters).

Measured: ``compress_gnn(model, bits=2)`` with the probe held back for three steps, then armed
for the fourth; the probe's cost is the fourth step's counted peak (`PeakBytes`) less the
third's (the same plan). Bound: the planner's, after its profile step on the same model and
graph (``memory_budget="4GiB"``). CPU only (the bound from the profile step's counted reads).

Usage::

    python benchmarks/budget_probe_cost.py gcn:3000 gat:3000 gcnii:600 gatv2:2000
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gact_graph import compress_gnn  # noqa: E402
from gact_graph.budget.profile import PeakBytes  # noqa: E402
from gact_graph.models import build_model  # noqa: E402

MiB = 2**20


def graph(n: int, deg: int = 6, feat: int = 16, seed: int = 0):
    """A random graph of ``n`` nodes, ``deg`` edges a node made undirected."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, feat, generator=g)
    ei = torch.randint(0, n, (2, deg * n), generator=g)
    return x, torch.cat([ei, ei.flip(0)], 1), torch.randint(0, 4, (n,), generator=g)


def make(name: str):
    torch.manual_seed(0)
    kw = {"hidden_channels": 64, "num_layers": 3, "dropout": 0.0}
    if name == "sage":  # PyG's own model
        from torch_geometric.nn.models import GraphSAGE

        return GraphSAGE(16, 64, 3, 4)
    if name == "gcn_bn":
        return build_model("gcn", 16, 4, batch_norm=True, **kw)
    if name == "gat":
        return build_model("gat", 16, 4, heads=3, **kw)
    if name == "gatv2":
        return build_model("gatv2", 16, 4, heads=3, **{**kw, "hidden_channels": 32})
    if name == "gcnii":
        return build_model("gcnii", 16, 4, **{**kw, "num_layers": 4})
    return build_model(name, 16, 4, **kw)


def _step(model, ctl, g, opt, table) -> int:
    x, ei, y = g
    with PeakBytes(table) as counter:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        opt.step()
        ctl.iterate()
    return counter.peak


def measured(name: str, n: int) -> int:
    model, g = make(name), graph(n)
    ctl = compress_gnn(model, bits=2)
    adapter = ctl.adapter
    adapter.next_estimate = sys.maxsize
    adapter.detach()
    opt, table, peaks = torch.optim.Adam(model.parameters(), 1e-3), {}, []
    for s in range(4):
        if s == 3:
            adapter.next_estimate = ctl.step
            adapter.attach(ctl)
            adapter.next_estimate = ctl.step + 1
        peaks.append(_step(model, ctl, g, opt, table))
    ctl.remove()
    return peaks[3] - peaks[2]


def bounds(name: str, n: int) -> tuple[int, int]:
    model, g = make(name), graph(n)
    ctl = compress_gnn(model, bits=2, memory_budget="4GiB")
    planner = ctl.budget
    _step(model, ctl, g, torch.optim.Adam(model.parameters(), 1e-3), {})
    need = next(iter(planner._profile_inputs.values())).probe_need
    largest = max(t.orig_bytes for t in planner._records())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ctl.remove()
    return need, planner.PROBE_ACTIVATIONS * largest + params


def main(specs: list[str]) -> None:
    warnings.simplefilter("ignore")
    print("model    nodes | probe adds MiB | bound MiB (x) | from shapes MiB (x)")
    for spec in specs:
        name, n = spec.split(":")
        extra = measured(name, int(n))
        need, shapes = bounds(name, int(n))
        ratio = need / extra if extra > 0 else float("inf")
        print(
            f"{name:8s} {int(n):5d} | {extra / MiB:14.3f} | {need / MiB:7.3f} ({ratio:5.1f}) "
            f"| {shapes / MiB:7.2f} ({shapes / max(extra, 1):5.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["gcn:3000", "gcn_bn:3000", "sage:3000", "gcnii:600", "gcnii:1500",
                          "gat:1500", "gat:3000", "gatv2:2000"])  # fmt: skip
