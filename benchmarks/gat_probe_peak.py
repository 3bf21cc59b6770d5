"""Per-step peak of a GAT / GATv2 under fixed 2-bit and the default (adaptive) mode, split
into where it lies: the user's own forward and backward, or the sensitivity probe's work
(its replays of an autograd node, `SensitivityProbe._probe`, and the partial backwards that
carry their noise to the parameters, `SensitivityProbe._propagate`); and which edge stage each
attention layer ran (the fused Triton Function or the chunked one).

A re-planning step of the default mode probes every compressed tensor; the default mode's
worst step is such a step when the probe's work peaks above the user's backward. The figures
are in units of one N x H x C fp32 tensor of a hidden layer (the size of one projected
feature tensor), so CPU and GPU runs at different sizes compare.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` above the bytes allocated at the step's
start; on CPU the live bytes of tensors created during the step
(`gact_graph.budget.profile.PeakBytes`, the budget planner's meter; no allocator involved).

Usage::

    python benchmarks/gat_probe_peak.py --device cuda                  # arxiv size, both models
    python benchmarks/gat_probe_peak.py --device cpu --nodes 10000 --hidden 32
    python benchmarks/gat_probe_peak.py --models gatv2 --steps 4 --json out.json
    python benchmarks/gat_probe_peak.py --device cpu --nodes 10000 --hidden 32 --trace

``--edge-kernel triton`` runs the fused Triton kernels wherever they apply (on CPU only under
``TRITON_INTERPRET=1``: slow, use a few hundred nodes); ``--kernel-reads dequantized`` has the
fused Functions handed their compressed features dequantized whole inside the probe, as they
were before they read the packed codes (`gact_graph.sparse.gat_fused._kernel_features`)::

    TRITON_INTERPRET=1 python benchmarks/gat_probe_peak.py --device cpu --edge-kernel triton \
        --nodes 600 --hidden 16 --models gatv2 --skip-dataless

``--edge-stage`` measures one fused edge stage's backward alone (`edge_stage_peak`), its
compressed features handed to it as the probe hands them (read by rows: the kernels read the
packed codes) or dequantized whole, with the planner's meter (CPU; RowChunked not counted)::

    TRITON_INTERPRET=1 python benchmarks/gat_probe_peak.py --device cpu --edge-stage \
        --nodes 200 --hidden 16 --heads 3

``--skip-dataless`` (CPU): the planner's meter counts a tensor subclass without data of its
own (the probe's `RowChunked`) at its full size; this leaves it out.
``--trace`` (CPU): at each step's peak, print the tensors alive of at least a fifth of a unit,
each with its op, shape and the frames that made it (slow; for finding what holds a peak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import build_model  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.policy import sensitivity  # noqa: E402
from gact_graph.sparse import gat as sgat  # noqa: E402
from gact_graph.sparse import gat_fused as sfused  # noqa: E402
from gact_graph.sparse import gatv2 as sgatv2  # noqa: E402


def _dataless(t) -> bool:
    """A tensor subclass that holds no data of its own (a `RowChunked`, whose codes belong to
    its compressed tensor): its storage reports its full size but has no memory."""
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return True
    return False


def _cpu_meter(skip_dataless: bool):
    """`PeakBytes`, or (``skip_dataless``) one that does not count `_dataless` outputs, which
    it counts at their full size."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from gact_graph.budget.profile import PeakBytes

    if not skip_dataless:
        return PeakBytes

    class WithoutDataless(PeakBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            peak = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            dataless = [t for t in torch.utils._pytree.tree_leaves(out) if _dataless(t)]
            for t in dataless:
                known = self.table.pop(StorageWeakRef(t.untyped_storage()).cdata, None)
                if known is not None:
                    self.bytes -= known[1]
            if dataless:
                self.peak = max(peak, self.bytes)
            return out

    return WithoutDataless


def _tracing_meter(base, min_bytes: int, snapshots: list):
    """`PeakBytes` that also keeps, for every new storage of at least ``min_bytes``, the op,
    shape and frames that made it, and appends to ``snapshots`` the live ones at each new
    peak (``(peak bytes, where, [(bytes, op, shape, frames)])``, the last one the step's)."""

    def frames(skip: int) -> str:
        keep = ("gact_graph", "benchmarks", "autograd")
        stack = [f for f in traceback.extract_stack()[:-skip] if any(k in f.filename for k in keep)]
        return " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in stack[::-1][:4])

    class Tracing(base):
        def __init__(self):
            self.sites = {}
            super().__init__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = set(self.table)
            peak = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for k in set(self.table) - before:
                if self.table[k][1] >= min_bytes:
                    shape = next((tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out)
                                  if isinstance(t, torch.Tensor)), ())  # fmt: skip
                    self.sites[k] = (str(func), shape, frames(3))
            if self.peak > peak:
                live = [(n, *self.sites.get(k, ("?", (), "")))
                        for k, (ref, n) in self.table.items()
                        if n >= min_bytes and not ref.expired()]  # fmt: skip
                snapshots.append((self.peak, frames(3), sorted(live, key=lambda t: -t[0])))
            return out

    return Tracing()


class _Meter:
    """Peak bytes above a step's start, overall and inside the probe's work."""

    def __init__(self, device: torch.device, trace_bytes: int | None = None,
                 skip_dataless: bool = False) -> None:  # fmt: skip
        self.device = device
        self.cpu = None
        self.trace_bytes, self.snapshots = trace_bytes, []
        self.skip_dataless = skip_dataless
        self.start = 0
        self.peak = 0
        self.probe_peak = 0

    def _now_peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return self.cpu.peak - self.start

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu._sweep()
            self.cpu.peak = self.cpu.bytes

    @contextlib.contextmanager
    def step(self):
        self.peak = self.probe_peak = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
        else:
            self.snapshots.clear()
            base = _cpu_meter(self.skip_dataless)
            meter = base() if self.trace_bytes is None else _tracing_meter(
                base, self.trace_bytes, self.snapshots
            )  # fmt: skip
            with meter as self.cpu:
                self.start = self.cpu.start
                yield
        self.peak = max(self.peak, self._now_peak())

    @contextlib.contextmanager
    def probe_work(self):
        """Count what runs inside as the probe's (the peaks before it are kept)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.peak = max(self.peak, self._now_peak())
        self._reset()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            inside = self._now_peak()
            self.probe_peak = max(self.probe_peak, inside)
            self.peak = max(self.peak, inside)
            self._reset()


def _instrument(meter: _Meter, paths: dict[str, int]):
    """Wrap the probe's replays and partial backwards in ``meter.probe_work`` and count the
    edge-stage Functions' forwards in ``paths``; returns the undo."""
    undo = []
    for name in ("_probe", "_propagate"):
        orig = getattr(sensitivity.SensitivityProbe, name)

        def wrapped(self, *args, _orig=orig, **kwargs):
            if meter.cpu is None and meter.device.type != "cuda":
                return _orig(self, *args, **kwargs)
            with meter.probe_work():
                return _orig(self, *args, **kwargs)

        setattr(sensitivity.SensitivityProbe, name, wrapped)
        undo.append((sensitivity.SensitivityProbe, name, orig))
    for cls in (sfused.GatFusedFunction, sfused.GatV2FusedFunction, sgat.GatAttentionFunction,
                sgatv2.GatV2AttentionFunction):  # fmt: skip
        orig = cls.forward

        def forward(ctx, *args, _orig=orig, _name=cls.__name__):
            paths[_name] = paths.get(_name, 0) + 1
            return _orig(ctx, *args)

        cls.forward = staticmethod(forward)
        undo.append((cls, "forward", staticmethod(orig)))
    return lambda: [setattr(obj, name, f) for obj, name, f in undo]


@contextlib.contextmanager
def _edge_stage(args):
    """``args.edge_kernel`` as `sfused.EDGE_KERNEL`, and (``args.kernel_reads == "dequantized"``)
    the fused Functions made to take their compressed features dequantized whole."""
    kernel = getattr(args, "edge_kernel", sfused.EDGE_KERNEL)
    codes = getattr(args, "kernel_reads", "codes") == "codes"
    fused = (sfused.GatFusedFunction, sfused.GatV2FusedFunction)
    before = sfused.EDGE_KERNEL, [cls.reads_row_chunks for cls in fused]
    sfused.EDGE_KERNEL = kernel
    for cls in fused:
        cls.reads_row_chunks = codes
    try:
        yield
    finally:
        sfused.EDGE_KERNEL = before[0]
        for cls, reads in zip(fused, before[1]):
            cls.reads_row_chunks = reads


def run(model_name: str, adaptive: bool, args, device: torch.device) -> dict:
    with _edge_stage(args):
        return _run(model_name, adaptive, args, device)


def _run(model_name: str, adaptive: bool, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    n, f = args.nodes, args.features
    x = torch.randn(n, f, device=device)
    ei = torch.randint(0, n, (2, args.degree * n), device=device)
    y = torch.randint(0, 8, (n,), device=device)
    model = build_model(model_name, f, 8, num_layers=args.layers, hidden_channels=args.hidden)
    model = model.to(device)
    ctl = compress_gnn(model, bits=2, adaptive=adaptive)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    unit = n * args.heads * args.hidden * 4
    trace = getattr(args, "trace", False) and device.type == "cpu"
    skip = getattr(args, "skip_dataless", False)
    meter, paths = _Meter(device, unit // 5 if trace else None, skip), {}
    undo = _instrument(meter, paths)
    steps = []
    try:
        for i in range(args.steps):
            opt.zero_grad(set_to_none=True)
            paths.clear()
            with meter.step():
                F.cross_entropy(model(x, ei), y).backward()
            opt.step()
            ctl.iterate()
            if trace and meter.snapshots:
                peak, where, live = max(meter.snapshots, key=lambda snap: snap[0])
                print(f"{model_name} step {i}: peak {(peak - meter.start) / unit:.2f} at {where}")
                for nbytes, op, shape, made in live:
                    print(f"  {nbytes / unit:5.2f}  {op} {shape}  {made}")
            steps.append({
                "step": i,
                "peak_units": round(meter.peak / unit, 2),
                "probe_peak_units": round(meter.probe_peak / unit, 2),
                "edge_stage": dict(paths),
            })  # fmt: skip
    finally:
        undo()
        ctl.remove()
    return {"model": model_name, "mode": "default" if adaptive else "fixed 2-bit",
            "unit_bytes": unit, "steps": steps}  # fmt: skip


def edge_stage_peak(model_name: str, reads: str, args) -> dict:
    """Peak bytes (CPU, the planner's meter without dataless tensors) of one fused edge
    stage's backward (`GatFusedFunction` / `GatV2FusedFunction`, statistics recomputed as a
    compressing controller has them), its (N * H) x C features saved at 2 bits and handed
    back as a `RowChunked` (``reads="codes"``: what the probe hands a Function that reads row
    chunks; the kernels read the packed codes) or dequantized whole (``"dequantized"``), in
    units of one N x H x C fp32 tensor, with the number of new tensors of at least one unit."""
    from gact_graph.core.chunked import RowChunked
    from gact_graph.core.quantize import quantize
    from gact_graph.kernels import gat_rows

    torch.manual_seed(0)
    n, heads, channels = args.nodes, args.heads, args.hidden
    ei = torch.randint(0, n, (2, args.degree * n))
    ei = torch.cat([ei, torch.arange(n).repeat(2, 1)], 1)
    order = torch.argsort(ei[1], stable=True)
    col = ei[0, order].to(torch.int32)
    rowptr = torch.zeros(n + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(ei[1], minlength=n).cumsum(0)
    transpose = gat_rows.csr_transpose(rowptr, col, n)
    shape = (n * heads, channels)
    x = torch.randn(n, heads, channels, requires_grad=True)
    x_r = torch.randn(n, heads, channels, requires_grad=True)
    a_src, a_dst = (torch.randn(n, heads, requires_grad=True) for _ in range(2))
    att = torch.randn(1, heads, channels, requires_grad=True)

    def pack(t):
        return quantize(t.detach(), 2, seed=1) if tuple(t.shape) == shape else t

    def unpack(p):
        if isinstance(p, torch.Tensor):
            return p
        return RowChunked(p) if reads == "codes" else p.dequantize()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        if model_name == "gat":
            leaves = (x, a_src, a_dst)
            out = sfused.gat_attention_fused(*leaves, rowptr, col, 0.2, transpose=transpose)
        else:
            leaves = (x, x_r, att)
            out = sfused.gatv2_attention_fused(*leaves, rowptr, col, 0.2, transpose=transpose,
                                             recompute_stats=True)  # fmt: skip
    grad = torch.randn(out.shape)
    unit = n * heads * channels * 4
    with _cpu_meter(skip_dataless=True)() as meter:
        grads = torch.autograd.grad(out, leaves, grad)
        big = sum(1 for g in grads if g.numel() * 4 >= unit)
        peak = meter.peak - meter.start
    return {"model": model_name, "reads": reads, "peak_units": round(peak / unit, 2),
            "gradients_of_one_unit": big}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="gat,gatv2")
    ap.add_argument("--nodes", type=int, default=169_343)
    ap.add_argument("--degree", type=int, default=7, help="random edges per node")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128, help="channels per head")
    ap.add_argument("--heads", type=int, default=3, help="the preset's heads (for the unit)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps 0 and 1 are probed")
    ap.add_argument(
        "--edge-kernel",
        default="auto",
        choices=["auto", "triton", "chunked"],
        help="sparse.gat_fused.EDGE_KERNEL (triton on CPU: under TRITON_INTERPRET=1)",
    )
    ap.add_argument(
        "--kernel-reads",
        default="codes",
        choices=["codes", "dequantized"],
        help="what the fused kernels' backward reads of a compressed input inside "
        "the probe: its packed codes, or a dequantized copy",
    )
    ap.add_argument(
        "--edge-stage",
        action="store_true",
        help="CPU: one fused edge stage's backward alone (edge_stage_peak)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--skip-dataless",
        action="store_true",
        help="CPU: do not count tensor subclasses without data (RowChunked), which "
        "the planner's meter counts at their full size",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="CPU: print the tensors alive at each step's peak and what made them",
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    results = []
    if args.edge_stage:
        for name in args.models.split(","):
            for reads in ("dequantized", "codes"):
                res = edge_stage_peak(name, reads, args)
                results.append(res)
                print(f"{name:6s} backward, features read as {reads:11s}: peak "
                      f"{res['peak_units']:5.2f} (N x H x C units; its gradients: "
                      f"{res['gradients_of_one_unit']})", flush=True)  # fmt: skip
        args.models = ""
    for name in filter(None, args.models.split(",")):
        for adaptive in (False, True):
            res = run(name, adaptive, args, device)
            results.append(res)
            for s in res["steps"]:
                print(f"{name:6s} {res['mode']:12s} step {s['step']}: peak {s['peak_units']:6.2f}"
                      f"  probe's work {s['probe_peak_units']:6.2f}  (N x H x C units)"
                      f"  {s['edge_stage']}", flush=True)  # fmt: skip
        fixed, default = results[-2], results[-1]
        worst = max(s["peak_units"] for s in default["steps"])
        print(f"{name}: worst step, default / fixed 2-bit = "
              f"{worst / max(s['peak_units'] for s in fixed['steps']):.2f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device":
                                   str(device), "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
