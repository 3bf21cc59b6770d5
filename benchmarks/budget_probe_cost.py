"""What the adaptive allocator's sensitivity probe adds to a step, counted, against the budget
planner's bound for it (`gact_graph.budget.probe_cost`) and the bound from shapes alone (six
fp32 copies of the largest saved tensor plus the parameters).

Measured: ``compress_gnn(model, bits=2)`` with the probe held back for three steps, then armed
for the fourth; the probe's cost is the fourth step's counted peak (`PeakBytes`) less the
third's (the same plan). Bound: the planner's, after its profile step on the same model and
graph (``memory_budget="4GiB"``). CPU only (the bound from the profile step's counted reads).

With ``--replays``: per model, the profile step's records of the nodes that read a compressed
tensor in backward (`BackwardReads`: MiB live at the first read, the rise after it and the
node's own part of it, the bounds its Function states of its lean backward in a replay and in
the walk where it states them, the reads a replay dequantizes; then the bound's terms over
the profile step's peak at the node's read and in the walk from it, `probe_terms`: which one
sets the bound) and, in the probed step, what was live when each replay began and how far
the live bytes rose during it (`LiveBytes` around the step): where the bound's slack lies.

Usage::

    python benchmarks/budget_probe_cost.py gcn:3000 gat:3000 gcnii:600 gatv2:2000
    python benchmarks/budget_probe_cost.py sage_elu:3000 sage_gelu:3000 sage_silu:3000
    python benchmarks/budget_probe_cost.py --replays gat:3000 gatv2:2000
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
    if name == "sage" or name.startswith("sage_"):  # PyG's own model; sage_gelu: its act
        from torch_geometric.nn.models import GraphSAGE

        act = name.partition("_")[2] or "relu"
        return GraphSAGE(16, 64, 3, 4, act=act)
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


def profile_records(name: str, n: int) -> tuple[int, list, tuple]:
    """The profile step's peak, its `BackwardReads` node records (``memory_budget``) and
    `probe_terms` of them (the forward's term, per node its read's and its walk's)."""
    from gact_graph.budget.probe_cost import probe_terms

    model, g = make(name), graph(n)
    ctl = compress_gnn(model, bits=2, memory_budget="4GiB")
    planner = ctl.budget
    _step(model, ctl, g, torch.optim.Adam(model.parameters(), 1e-3), {})
    peak, nodes = planner._reads_peak, list(planner._reads.nodes)
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    terms = probe_terms(planner._reads, step_peak=peak, param_bytes=params)
    ctl.remove()
    return peak, nodes, terms


def replay_rises(name: str, n: int) -> list[tuple[str, int, int]]:
    """In the probed step of `measured`'s schedule: per replay, the node's name, the bytes
    live when it began and how far they rose during it (its differences included)."""
    from gact_graph.budget.profile import LiveBytes
    from gact_graph.policy.sensitivity import SensitivityProbe

    model, (x, ei, y) = make(name), graph(n)
    ctl = compress_gnn(model, bits=2)
    adapter = ctl.adapter
    adapter.next_estimate = sys.maxsize
    adapter.detach()
    opt, out, live = torch.optim.Adam(model.parameters(), 1e-3), [], None
    probe = SensitivityProbe._probe

    def spy(self, node, *args, **kw):
        live._sweep()
        start = live.mark()
        try:
            return probe(self, node, *args, **kw)
        finally:
            out.append((type(node).__name__, start, live.since_mark() - start))

    SensitivityProbe._probe = spy
    try:
        for s in range(4):
            if s == 3:
                adapter.next_estimate = ctl.step
                adapter.attach(ctl)
                adapter.next_estimate = ctl.step + 1
            out.clear()
            with LiveBytes() as live:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, ei), y).backward()
                opt.step()
                ctl.iterate()
    finally:
        SensitivityProbe._probe = probe
        ctl.remove()
    return out


def replays(specs: list[str]) -> None:
    warnings.simplefilter("ignore")
    for spec in specs:
        name, n = spec.split(":")
        peak, nodes, (forward, terms) = profile_records(name, int(n))
        print(f"{name} {n}: profile step peak {peak / MiB:.3f} MiB (1 bit); nodes reading "
              "a compressed tensor in backward, MiB; then the bound's terms over the peak "
              "(probe_terms: at the node's read, in the walk from it):")  # fmt: skip

        def mib(v):
            return "-" if v is None else f"{v / MiB:.3f}"

        for rec, (read, walk) in zip(nodes, terms):
            reads = ", ".join(f"{r / MiB:.3f}" for r in rec.replayed) or "-"
            print(f"  live {rec.live / MiB:7.3f}  rise {rec.rise / MiB:7.3f} (own {mib(rec.own)})"
                  f"  stated lean {mib(rec.lean)}, in the walk {mib(rec.walk)}"
                  f"  replays {reads}  | terms {mib(read)}, {mib(walk)}")  # fmt: skip
        print(f"  the forward's term (work at a pack) {mib(forward)}")
        print("  probed step (2 bits), per replay: live when it began, rise during it, MiB:")
        for node, start, rise in replay_rises(name, int(n)):
            print(f"  {node:32s} {start / MiB:7.3f} {rise / MiB:7.3f}", flush=True)


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
    if sys.argv[1:2] == ["--replays"]:
        replays(sys.argv[2:] or ["gat:3000", "gatv2:2000"])
        sys.exit()
    main(sys.argv[1:] or ["gcn:3000", "gcn_bn:3000", "sage:3000", "gcnii:600", "gcnii:1500",
                          "gat:1500", "gat:3000", "gatv2:2000"])  # fmt: skip
