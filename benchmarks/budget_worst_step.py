"""The CPU proxy of the GPU row "worst step <= the planned steps + 5 %": under
``memory_budget=``, is any step (the profile step, the step the sensitivity probe runs in, a
re-planning step) heavier than the planned steps? And does the profile step hold no more
than a fixed 1-bit step?

One fresh process (run it with and without ``MALLOC_MMAP_THRESHOLD_``: the planner's meter
is the anonymous resident set with it, counted tensor bytes without). The model is
`benchmarks/budget.py`'s (default its GAT: 3 layers, 3 heads x 64, 3,000 nodes, 8 edges a
node, 16 features). It trains fixed 1 bit (``adaptive=False``) for ``--steps`` steps, then
``memory_budget=`` at each ``--budget-mib`` and at ``--above`` (default 0.5 %) over fixed 1
bit's worst step, each for ``--steps`` steps. Every step is measured by the planner's meter
(its history) and by an independent count of tensor bytes (parameters, inputs and what
earlier steps left alive included: `PeakBytes` around the whole step, ``ctl.iterate()``
included). Prints JSON.

    python benchmarks/budget_worst_step.py --model gat --steps 8 --budget-mib 36.1
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))


def counted_steps(model, ctl, graph, steps: int, lr: float = 1e-3, counted=None) -> list[int]:
    """Train ``model`` (compressed by ``ctl``) ``steps`` Adam steps on ``graph`` = ``(x,
    edge_index, y)``: each step's peak in counted tensor bytes, what the planner's counted
    meter sees (parameters, ``x`` and ``edge_index``, and what earlier steps left alive:
    `PeakBytes` around the whole step, ``ctl.iterate()`` included). Appended to ``counted``
    (a new list by default) as each step ends, so a step that raises leaves the earlier ones."""
    import torch
    import torch.nn.functional as F

    from gact_graph.budget.profile import PeakBytes

    x, ei, y = graph
    static = sum(p.untyped_storage().nbytes() for p in model.parameters())
    static += sum(t.untyped_storage().nbytes() for t in (x, ei))
    opt = torch.optim.Adam(model.parameters(), lr)
    table, counted = {}, [] if counted is None else counted
    for _ in range(steps):
        with PeakBytes(table) as counter:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x, ei), y).backward()
            opt.step()
            ctl.iterate()
        counted.append(static + counter.peak)
    return counted


def _run(model_key: str, steps: int, **kw) -> dict:
    import torch

    from benchmarks.budget import MODELS, _graph, _stats
    from benchmarks.harness import build_model
    from gact_graph import compress_gnn
    from gact_graph.budget import BudgetError

    name, layers, nodes = MODELS[model_key][:3]
    st = _stats(model_key)
    x, ei, y = _graph(nodes, st["features"], classes=st["classes"], degree=st["degree"])
    torch.manual_seed(0)
    model = build_model(name, st["features"], st["classes"], num_layers=layers, hidden_channels=64)
    ctl = compress_gnn(model, **kw)
    counted: list[int] = []
    out: dict = {"setting": {k: v for k, v in kw.items()}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counted_steps(model, ctl, (x, ei, y), steps, counted=counted)
    except BudgetError as e:
        out.update(refused=str(e), least=e.least_budget)
    out["counted"] = counted
    planner = getattr(ctl, "budget", None)
    if planner is not None:
        hist = planner.history
        probe = [h.get("probe", False) for h in hist]  # (older checkouts record none)
        out["steps"] = [[h["phase"], p, h["meter"], h["measured"]] for h, p in zip(hist, probe)]
        at = [i for i, h in enumerate(hist) if h["phase"] == "planned" and not probe[i]]
        every = [h["measured"] for h in hist if h["measured"] is not None]
        if at and every:
            out["worst_over_planned"] = max(every) / max(hist[i]["measured"] for i in at)
            out["worst_over_planned_counted"] = max(counted) / max(counted[i] for i in at)
    ctl.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gat")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget-mib", nargs="*", type=float, default=[])
    ap.add_argument("--above", type=float, default=0.005)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    mib = 2**20
    fixed1 = _run(args.model, args.steps, bits=1, adaptive=False)
    runs = {"fixed1": fixed1}
    budgets = [int(b * mib) for b in args.budget_mib]
    budgets.append(int(max(fixed1["counted"]) * (1 + args.above)))
    for b in budgets:
        runs[f"budget {b / mib:.2f} MiB"] = _run(args.model, args.steps, memory_budget=b)
    for key, r in runs.items():
        line = f"{key}: counted MiB " + " ".join(f"{c / mib:.2f}" for c in r["counted"])
        if r.get("steps"):
            line += "\n    planner " + " ".join(
                f"{p[0][:2]}{'+probe' if p[1] else ''}:{p[3] / mib:.2f}" for p in r["steps"]
            )
            line += f" ({r['steps'][0][2]})"
        if "worst_over_planned" in r:
            line += (
                f"\n    worst step / planned steps: {r['worst_over_planned']:.3f} (planner's "
                f"meter), {r['worst_over_planned_counted']:.3f} (counted)"
            )
        if "refused" in r:
            line += f"\n    refused: {r['refused'][:300]}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
