"""A budget just above fixed 1 bit's worst step, with fixed 1 bit measured by the planner's
own resident-set meter (`StepMeter`: the anonymous resident set above the process before
training) rather than counted: GCNII-24 x 32 on 1,500 nodes (`tests/budget/test_rerun.py`'s
`_counted_steps` model), one fresh process. Run it with ``MALLOC_MMAP_THRESHOLD_`` set (the
planner's meter is then the resident set); prints fixed 1 bit's steps and, at each factor
over its worst step, the planner's steps or its refusal.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/budget_rss_baseline.py 1.005 1.03 1.06
"""

from __future__ import annotations

import gc
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's package
    sys.path.insert(0, str(ROOT))

MIB = 2**20


def _run(steps: int, **kw):
    import torch
    import torch.nn.functional as F

    from benchmarks.budget_gcnii64 import StockGCNII
    from gact_graph import compress_gnn
    from gact_graph.budget.profile import StepMeter

    torch.manual_seed(0)
    model = StockGCNII(16, 4, 24, 32)
    g = torch.Generator().manual_seed(0)
    n = 1500
    x, ei = torch.randn(n, 16, generator=g), torch.randint(0, n, (2, 6 * n), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    ei = torch.cat([ei, ei.flip(0)], 1)
    static = sum(p.untyped_storage().nbytes() for p in model.parameters())
    static += sum(t.untyped_storage().nbytes() for t in (x, ei))
    ctl = compress_gnn(model, **kw)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    meter, base, out = StepMeter(torch.device("cpu")), None, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            meter.begin()
            if base is None:  # as the planner: what the process held before training
                base = meter.start - static
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x, ei), y).backward()
            opt.step()
            ctl.iterate()
            out.append(meter.peak() - base)
    planner = getattr(ctl, "budget", None)
    ctl.remove()
    return out, planner


def main() -> None:
    import torch

    from gact_graph.budget import BudgetError

    torch.set_num_threads(1)
    factors = [float(a) for a in sys.argv[1:]] or [1.005]
    _run(1, bits=1, adaptive=False)  # warm-up: what a process's first step sets up once
    fixed1, _ = _run(4, bits=1, adaptive=False)
    print("fixed 1 bit, MiB:", " ".join(f"{v / MIB:.3f}" for v in fixed1))
    for f in factors:
        budget = int(max(fixed1) * f)
        planner = None  # the previous run's model and planner: freed before this one starts
        gc.collect()
        try:
            _, planner = _run(5, memory_budget=budget)
        except BudgetError as e:
            print(f"x{f} ({budget / MIB:.3f} MiB): refused, naming {e.least_budget / MIB:.2f} MiB")
            continue
        steps = " ".join(f"{h['phase'][:2]}:{h['measured'] / MIB:.3f}" for h in planner.history)
        print(f"x{f} ({budget / MIB:.3f} MiB): {steps} ({planner.meter})")


if __name__ == "__main__":
    main()
