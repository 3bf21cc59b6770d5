"""Host-side cost of one training step: dispatched aten ops, possible host syncs, Python time.

On a GPU a step of a mid-sized graph is a few tens of milliseconds, so per-step host work (one
more kernel launch per saved tensor, a ``.item()`` that waits for the device, Python in the
pack/unpack hooks) shows in the step time although a CPU run hardly sees it. This script counts
that work on the CPU, where it is deterministic:

* **ops/step**: aten ops dispatched in one steady-state step (forward, loss, backward, optimizer
  step, ``ctl.iterate``), counted by a ``TorchDispatchMode``, with the most frequent kinds;
* **possible syncs/step**: ops that read a device value to the host or whose output shape
  depends on the data (``_local_scalar_dense`` from ``.item()``/``bool()``, ``nonzero``,
  ``unique``, ``equal``, ``masked_select``, ...), and calls of ``Tensor.item/tolist/cpu/numpy``
  and ``bool()``, each with the line of ``gact_graph`` that made it;
* **allocations/step**: tensors the dispatched ops return, and their bytes;
* **Python calls/step**: function calls cProfile counts in one steady-state step (Python
  functions and the builtins they call), and how many of them are the pointwise mode's
  ``__torch_function__`` (``gact_graph/ops/mode.py``);
* **step time on a tiny graph**, where the arithmetic is negligible and the time is the host's
  (on CPU the median CPU time of the process, one thread: less sensitive than wall time to
  other processes on a shared machine; on CUDA wall time).

``--tree DIR`` imports ``gact_graph`` from another checkout (e.g. a ``git worktree add`` of an
older commit), so two trees are compared with the same script.

Examples::

    python benchmarks/host_overhead.py --model gcn
    python benchmarks/host_overhead.py --model gcn --tree /tmp/old_tree --methods default
    python benchmarks/host_overhead.py --model gcn --graph-check version
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that on CUDA read a value back to the host or size their output from the data
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "equal",
    "masked_select",
    "is_nonzero",
    "repeat_interleave",
    "bincount",
    "histc",
    "argwhere",
}
#: Tensor methods that copy to the host (on CUDA: a sync)
HOST_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda: syncs counted by CUDA)")
    p.add_argument("--tree", default=None, help="checkout to import gact_graph from")
    p.add_argument("--model", default="gcn", help="gcn, gat, gatv2 or gcnii (arxiv presets)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--hidden", type=int, default=None, help="override the preset's width")
    p.add_argument("--nodes", type=int, default=400, help="tiny graph: host time dominates")
    p.add_argument("--edges", type=int, default=2000)
    p.add_argument("--features", type=int, default=32)
    p.add_argument(
        "--methods", default="stock,fixed-2bit,default", help="stock, fixed-2bit, default"
    )
    p.add_argument("--graph-check", default=None, help="forward or version (passed when not None)")
    p.add_argument("--min-bytes", type=int, default=None, help="passed when not None")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before counting")
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--top", type=int, default=12, help="op kinds listed")
    p.add_argument("--cprofile", type=int, default=0, help="list the N functions of most own time")
    p.add_argument("--callers", default=None, help="with --cprofile: callers of these (regex)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


class Counter(TorchDispatchMode):
    """Counts dispatched aten ops, their outputs and bytes, and data-dependent ones by caller."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.allocs = 0
        self.alloc_bytes = 0
        self.bytes_by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in SYNC_OPS:
            self.syncs[(name, _caller())] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # a sparse tensor built from existing parts reports its dense size: not counted
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not _aliases(func):
                self.allocs += 1
                self.alloc_bytes += t.numel() * t.element_size()
                self.bytes_by_op[(name, _caller())] += t.numel() * t.element_size()
        return out


def _aliases(func) -> bool:
    """Whether ``func`` returns a view or one of its inputs (no new storage)."""
    return any(r.alias_info is not None for r in func._schema.returns)


def _caller() -> str:
    """The innermost gact_graph frame of the current stack (else the innermost non-torch one)."""
    frames = traceback.extract_stack()[:-2]
    for f in reversed(frames):
        if "gact_graph" in f.filename:
            return f"{f.filename.split('gact_graph')[-1].lstrip('/')}:{f.lineno} {f.name}"
    for f in reversed(frames):
        if "/torch/" not in f.filename and "host_overhead" not in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return "?"


def _python_calls(step) -> tuple[int, int]:
    """(function calls, calls of the pointwise mode's ``__torch_function__``) in one ``step()``,
    as cProfile counts them."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof)
    mode = sum(
        v[1]
        for (path, _, name), v in stats.stats.items()
        if name == "__torch_function__" and path.replace("\\", "/").endswith("ops/mode.py")
    )
    return stats.total_calls, mode


class HostCalls:
    """Patches Tensor.item/tolist/cpu/numpy/__bool__ to count calls by caller while active."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.saved: dict = {}

    def __enter__(self):
        for name in HOST_METHODS:
            orig = getattr(torch.Tensor, name)
            self.saved[name] = orig

            def wrapped(t, *a, _orig=orig, _name=name, **k):
                self.calls[(_name, _caller())] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(torch.Tensor, name, orig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gact_graph
    from gact_graph import compress_gnn
    from gact_graph.datasets.synthetic import load_synthetic
    from gact_graph.models import build_model, preset

    torch.set_num_threads(1)
    device = torch.device(args.device)
    data = load_synthetic("synthetic", num_nodes=args.nodes, num_edges=args.edges, seed=0)
    data.x = data.x[:, : args.features].contiguous()
    data = data.to(device)
    x, ei, y = data.x, data.edge_index, data.y
    num_classes = int(y.max()) + 1
    mask = torch.zeros(args.nodes, dtype=torch.bool, device=device)
    mask[: args.nodes // 2] = True
    cfg = preset(args.model, "ogbn-arxiv")
    if args.layers:
        cfg["model"]["num_layers"] = args.layers
    if args.hidden:
        cfg["model"]["hidden_channels"] = args.hidden
    torch.manual_seed(0)
    base = build_model(args.model, x.shape[1], num_classes, **cfg["model"]).to(device)
    extra = {}
    if args.graph_check is not None:
        extra["graph_check"] = args.graph_check
    if args.min_bytes is not None:
        extra["min_bytes"] = args.min_bytes
    kwargs = {
        "stock": None,
        "fixed-2bit": {"bits": 2, "adaptive": False, **extra},
        "default": dict(extra),
    }
    tree = str(Path(gact_graph.__file__).parents[1])
    results = {"tree": tree, "model": args.model, "nodes": args.nodes,
               "edges": int(ei.shape[1]), "extra": extra, "methods": {}}  # fmt: skip
    for m in args.methods.split(","):
        model = copy.deepcopy(base).train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        ctl = None if kwargs[m] is None else compress_gnn(model, **kwargs[m])

        def step_fn(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, ei)[mask], y[mask])
            loss.backward()
            return loss

        def step(opt=opt, ctl=ctl, step_fn=step_fn):
            step_fn()
            opt.step()
            if ctl is not None:
                ctl.iterate(step_fn)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(args.warmup):
                step()
            counter, host = Counter(), HostCalls()
            with counter, host:
                step()
            py_calls, mode_calls = _python_calls(step)
            cuda_syncs = None
            if device.type == "cuda":  # the syncs CUDA reports, as warnings, in one step
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                cuda_syncs = [str(w.message)[:120] for w in seen if "synchroniz" in str(w.message)]
                torch.cuda.synchronize()
            if args.cprofile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    step()
                prof.disable()
                print(f"== cProfile, {m}, {args.steps} steps (tottime: own time)")
                stats = pstats.Stats(prof).sort_stats("tottime")
                stats.print_stats(args.cprofile)
                if args.callers:
                    stats.print_callers(args.callers)
            # CPU: the process's CPU time (other processes on a shared machine disturb it less);
            # CUDA: wall time, the device waited for
            clock = time.perf_counter if device.type == "cuda" else time.process_time
            times = []
            for _ in range(args.steps):
                t0 = clock()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(clock() - t0)
        results["methods"][m] = {
            "ops_per_step": sum(counter.ops.values()),
            "top_ops": counter.ops.most_common(args.top),
            "ops": dict(counter.ops),
            "allocs_per_step": counter.allocs,
            "top_alloc_bytes": [[k[0], k[1], n] for k, n in counter.bytes_by_op.most_common(6)],
            "alloc_bytes_per_step": counter.alloc_bytes,
            "possible_syncs": sorted(
                [[f"aten.{k[0]}", k[1], n] for k, n in counter.syncs.items()], key=lambda r: -r[2]
            ),
            "host_calls": sorted(
                [[k[0], k[1], n] for k, n in host.calls.items()], key=lambda r: -r[2]
            ),
            "py_calls_per_step": py_calls,
            "mode_calls_per_step": mode_calls,
            "median_step_us": 1e6 * statistics.median(times),
            "cuda_syncs": cuda_syncs,
        }
        if ctl is not None:
            ctl.remove()
    stock = results["methods"].get("stock")
    for m, r in results["methods"].items():
        ratio = r["median_step_us"] / stock["median_step_us"] if stock else None
        ratio = "" if ratio is None else f" ({ratio:.2f}x stock)"
        print(f"== {args.model} {m} {extra or ''}: {r['ops_per_step']} ops/step, "
              f"{r['allocs_per_step']} allocs ({r['alloc_bytes_per_step'] / 1e6:.2f} MB), "
              f"{r['py_calls_per_step']} Python calls ({r['mode_calls_per_step']} in the mode), "
              f"{r['median_step_us']:.0f} us/step{ratio}")  # fmt: skip
        print("   top ops: " + ", ".join(f"{k} {n}" for k, n in r["top_ops"]))
        for name, where, n in r["top_alloc_bytes"]:
            print(f"   alloc {n / 1e6:.2f} MB by {name} at {where}")
        for name, where, n in r["possible_syncs"]:
            print(f"   sync? {name} x{n} at {where}")
        for name, where, n in r["host_calls"]:
            print(f"   host {name} x{n} at {where}")
        if r["cuda_syncs"] is not None:
            print(f"   CUDA reported {len(r['cuda_syncs'])} syncs in a step")
            for msg in collections.Counter(r["cuda_syncs"]).most_common(8):
                print(f"     {msg[1]}x {msg[0]}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
