"""Memory budget on stock PyG GCNII-64 over 20,000 nodes: the case where the profile step once
was the heaviest step (a budget 5x above what fixed 2 bits needs was refused).

Stock PyG GCNII: 64 ``GCN2Conv`` layers x 64 (alpha 0.1, theta 0.5, ``cached=True``), a
``Linear`` in and out, dropout 0.1; a random graph of 20,000 nodes and 100,000 edges made
undirected, 64 features, 8 classes, Adam. Every setting runs in a fresh process with
``MALLOC_MMAP_THRESHOLD_=65536`` (the resident set follows live bytes) and ``--threads``
threads. A step's peak is the anonymous resident set's high-water mark (file-backed pages
left out) above the step's start (``/proc/self/clear_refs`` reset before it); a run's figure
is its worst step. Planner runs also print what the planner's own meter judged per step
(resident set above the process before training).

Settings: stock; fixed 2 bits and fixed 1 bit (``adaptive=False``, L1); the default mode
(``compress_gnn(model)``); ``memory_budget`` at ``--fraction`` of stock's worst step, and
where that is refused, a rerun at the named figure (``BudgetError.least_budget``).

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/budget_gcnii64.py [--steps 9] [--threads 2] \
        [--nodes 20000] [--json out.json]

Prints a table and the verdicts: the profile step's peak over fixed 1 bit's (target <= 1.2x),
whether the budget was admitted and met in every step (by the planner's meter and by the
resident set above each step's start).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN2Conv

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))


class StockGCNII(torch.nn.Module):
    """Stock PyG GCNII: ``GCN2Conv`` layers (alpha 0.1, theta 0.5) with ``cached=True`` (each
    layer keeps its own normalized graph from the first step on), a ``Linear`` in and out,
    dropout 0.1 before each."""

    def __init__(self, features: int, classes: int, layers: int, width: int) -> None:
        super().__init__()
        self.lin_in = torch.nn.Linear(features, width)
        self.lin_out = torch.nn.Linear(width, classes)
        self.convs = torch.nn.ModuleList(
            GCN2Conv(width, 0.1, 0.5, i + 1, cached=True) for i in range(layers)
        )

    def forward(self, x, ei):
        x0 = h = self.lin_in(F.dropout(x, 0.1, self.training)).relu()
        for conv in self.convs:
            h = conv(F.dropout(h, 0.1, self.training), x0, ei).relu()
        return self.lin_out(F.dropout(h, 0.1, self.training))


def _anonymous(total: str) -> int:
    """``total`` (VmRSS or VmHWM) less the file-backed and shared pages resident now (as the
    planner's CPU meter reads it: libraries' code paged in is no tensor of the step)."""
    st = dict.fromkeys((total, "RssFile", "RssShmem"), 0)
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in st:
                st[name] = int(line.split()[1]) * 1024
    return st[total] - st["RssFile"] - st["RssShmem"]


def _child(nodes: int, edges: int, steps: int, setting: dict | None) -> dict:
    import warnings

    from torch_geometric.utils import to_undirected

    from gact_graph import compress_gnn
    from gact_graph.budget import BudgetError

    g = torch.Generator().manual_seed(0)
    x = torch.randn(nodes, 64, generator=g)
    ei = to_undirected(torch.randint(0, nodes, (2, edges), generator=g), num_nodes=nodes)
    y = torch.randint(0, 8, (nodes,), generator=g)
    torch.manual_seed(0)
    model = StockGCNII(64, 8, 64, 64)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    out: dict = {"setting": setting, "edges": int(ei.size(1))}
    try:
        ctl = compress_gnn(model, **setting) if setting is not None else None
        peaks, times = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
                start = _anonymous("VmRSS")
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x, ei), y).backward()
                opt.step()
                if ctl is not None:
                    ctl.iterate()
                times.append(time.perf_counter() - t0)
                peaks.append(_anonymous("VmHWM") - start)
    except BudgetError as exc:
        out.update(refused=True, least_budget=exc.least_budget, exact=exc.exact,
                   message=str(exc)[:600])  # fmt: skip
        return out
    out.update(peaks=peaks, times=times)
    planner = getattr(ctl, "budget", None) if ctl is not None else None
    if planner is not None:
        out["history"] = [[h["phase"], h["meter"], h["measured"]] for h in planner.history]
        out["budget"] = planner.budget
        st = planner.plan_state
        out["relaxed"] = st.relaxed
        out["predicted"] = st.predicted
        out["least_budget"] = st.least_budget
    return out


def _run(args, setting: dict | None) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, __file__, "--child", json.dumps(setting), "--nodes", str(args.nodes),
           "--edges", str(args.edges), "--steps", str(args.steps)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    res = json.loads(done.stdout.strip().splitlines()[-1])
    print(_line(res), flush=True)
    return res


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _line(r: dict) -> str:
    name = json.dumps(r["setting"])
    if r.get("refused"):
        return f"{name:<48} refused, naming {_mib(r['least_budget'])} MiB (exact={r['exact']})"
    worst = max(r["peaks"])
    text = f"{name:<48} worst {_mib(worst):>8} MiB; steps " + " ".join(_mib(p) for p in r["peaks"])
    if "history" in r:
        text += "\n    planner's meter: " + " ".join(
            f"{ph[0][:4]} {_mib(m)}" for ph, _, m in [(h, h[1], h[2]) for h in r["history"]]
        )
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=20_000)
    ap.add_argument("--edges", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.30)
    ap.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="the budget in MiB (default: --fraction of stock's worst step)",
    )
    ap.add_argument(
        "--only-budget",
        action="store_true",
        help="run the planner alone (with --budget-mib), no baselines",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.nodes, args.edges, args.steps, json.loads(args.child))))
        return
    runs = {}
    if not args.only_budget:
        runs["stock"] = _run(args, None)
        runs["fixed2"] = _run(args, {"bits": 2, "adaptive": False})
        runs["fixed1"] = _run(args, {"bits": 1, "adaptive": False})
        runs["default"] = _run(args, {})
    if args.budget_mib is not None:
        budget = int(args.budget_mib * 2**20)
    else:
        budget = int(args.fraction * max(runs["stock"]["peaks"]))
    runs["budget"] = _run(args, {"memory_budget": budget})
    if runs["budget"].get("refused"):
        runs["rerun"] = _run(args, {"memory_budget": runs["budget"]["least_budget"]})
    fixed1 = max(runs["fixed1"]["peaks"]) if "fixed1" in runs else None
    print(f"\nbudget {_mib(budget)} MiB")
    for key in ("budget", "rerun"):
        r = runs.get(key)
        if r is None or r.get("refused"):
            continue
        b = r["budget"]
        by_meter = all(m is not None and m <= b for _, _, m in r["history"])
        by_step = max(r["peaks"]) <= b
        print(
            f"{key}: admitted at {_mib(b)} MiB ({r['relaxed'] or 'within the accuracy bound'}); "
            f"profile step {_mib(r['peaks'][0])} MiB"
            + (
                ""
                if fixed1 is None
                else f" = {r['peaks'][0] / fixed1:.2f}x fixed 1 bit's worst ({_mib(fixed1)})"
            )
            + f"; met in every step: planner's meter {by_meter}, "
            f"resident set above each step's start {by_step}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
