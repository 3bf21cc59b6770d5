"""Throughput of `quantize` / `QTensor.dequantize` against a plain device copy.

On CUDA this measures the Triton kernels, on CPU the PyTorch reference path. For each input
dtype (fp32 and bf16 by default) and bit width it reports the median time and the bandwidth
each direction reaches, counted on the bytes it really moves (quantize: reads the input, writes
codes and metadata; dequantize: the reverse), as a share of the bandwidth of ``x.clone()`` of
the same tensor measured in the same run (a copy reads and writes it: 100 % = moving bytes as
fast as a copy does). The time relative to the copy is reported too (``x copy``).

The first call of each bit width tunes the kernels' launch configuration (on CUDA); the warmup
calls absorb it.

Usage::

    python benchmarks/bench_quantize.py --device cuda               # (169343, 256), fp32 + bf16
    python benchmarks/bench_quantize.py --device cpu --threads 1 --json out.json  # (16384, 256)
    python benchmarks/bench_quantize.py --dry                       # a few seconds on a CPU
    python benchmarks/bench_quantize.py --sass                      # no GPU needed, see below
    python benchmarks/bench_quantize.py --device cuda --configs     # each tuner configuration

``--sass`` compiles the kernels for sm_90 (H100/H200) with Triton's bundled ``ptxas``, without a
GPU, and prints the SASS instructions each thread executes per element of a dense 256-wide
tensor, with the vector width of the loads and stores: the kernels' arithmetic cost, which
bounds their bandwidth when it exceeds what the memory system needs (``--sass-all``: every
tuner configuration, fp16 too).

On CUDA the table has a second part: the same times from CUDA events around launches queued
back to back (device time, without the host's launch path that the wall-clock median includes).
``--configs`` times each direction under every configuration the tuner chooses from, and prints
the tuner's choices and timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gact_graph.core.quantize import SUPPORTED_BITS, _use_triton, quantize  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_seconds(fn, repeats: int, rounds: int = 3) -> float:
    """Device seconds per call of ``fn`` (CUDA), without the host's launch path that the
    wall-clock figures of :func:`median_seconds` include (see ``launch_ms``)."""
    from gact_graph.kernels.quantize import launch_ms

    fn()
    torch.cuda.synchronize()
    return launch_ms(fn, repeats, rounds) / 1e3


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    rows = args.numel // args.cols if args.numel else args.rows
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, args.cols, generator=gen)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    result = {
        "device": name,
        "path": "triton" if _use_triton(base.to(device)) else "reference",
        "shape": [rows, args.cols],
        "group_size": args.group_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "dtypes": {},
        "rows": [],
    }
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        x = base.to(device, dtype)
        x_bytes = x.numel() * x.element_size()
        t_copy = median_seconds(x.clone, device, args.repeats, args.warmup)
        copy_gbps = 2 * x_bytes / 1e9 / t_copy  # a copy reads and writes
        result["dtypes"][dtype_name] = {"copy_ms": t_copy * 1e3, "copy_gbps": copy_gbps}
        if device.type == "cuda":
            t_copy_dev = device_seconds(x.clone, args.repeats)
            result["dtypes"][dtype_name]["copy_device_ms"] = t_copy_dev * 1e3
        for bits in args.bits:
            q = quantize(x, bits, args.group_size, seed=0)
            t_q = median_seconds(
                lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0),
                device,
                args.repeats,
                args.warmup,
            )
            t_d = median_seconds(q.dequantize, device, args.repeats, args.warmup)
            moved = (x_bytes + q.nbytes) / 1e9  # either direction
            device_cols = {}
            if device.type == "cuda":  # the same three without the host's launch path
                dev_copy_gbps = 2 * x_bytes / 1e9 / t_copy_dev
                for name, fn in (
                    ("quantize", lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0)),
                    ("dequantize", q.dequantize),
                ):
                    t = device_seconds(fn, args.repeats)
                    device_cols[f"{name}_device_ms"] = t * 1e3
                    device_cols[f"{name}_device_pct_copy_bw"] = 100 * moved / t / dev_copy_gbps
            result["rows"].append(
                {
                    **device_cols,
                    "dtype": dtype_name,
                    "bits": bits,
                    "quantize_ms": t_q * 1e3,
                    "quantize_gbps": moved / t_q,
                    "quantize_pct_copy_bw": 100 * moved / t_q / copy_gbps,
                    "quantize_x_copy": t_q / t_copy,
                    "dequantize_ms": t_d * 1e3,
                    "dequantize_gbps": moved / t_d,
                    "dequantize_pct_copy_bw": 100 * moved / t_d / copy_gbps,
                    "dequantize_x_copy": t_d / t_copy,
                    "nbytes": q.nbytes,
                    "compression": x_bytes / q.nbytes,
                }
            )
    return result


def format_table(res: dict) -> str:
    head = (
        f"device={res['device']} path={res['path']} shape={tuple(res['shape'])} "
        f"G={res['group_size']} threads={res['threads']} torch={res['torch']}\n"
    )
    for name, c in res["dtypes"].items():
        head += f"{name} x.clone(): {c['copy_ms']:.3g} ms ({c['copy_gbps']:.4g} GB/s read+write)\n"
    lines = [
        "| dtype | bits | quantize ms | GB/s | % copy bw | dequantize ms | GB/s | % copy bw "
        "| compression |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['bits']} | {r['quantize_ms']:.3g} | {r['quantize_gbps']:.4g} "
            f"| {r['quantize_pct_copy_bw']:.0f} % | {r['dequantize_ms']:.3g} "
            f"| {r['dequantize_gbps']:.4g} | {r['dequantize_pct_copy_bw']:.0f} % "
            f"| {r['compression']:.3g}x |"
        )
    dev = [r for r in res["rows"] if "quantize_device_ms" in r]
    if dev:
        lines += ["", "Device time only (CUDA events, launches back to back):", "",
                  "| dtype | bits | quantize ms | % copy bw | dequantize ms | % copy bw |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in dev:
            lines.append(
                f"| {r['dtype']} | {r['bits']} | {r['quantize_device_ms']:.3g} "
                f"| {r['quantize_device_pct_copy_bw']:.0f} % | {r['dequantize_device_ms']:.3g} "
                f"| {r['dequantize_device_pct_copy_bw']:.0f} % |"
            )
    return head + "\n" + "\n".join(lines)


def _sass_row(kind: str, tname: str, bits: int, cfg, group_size: int) -> str:
    """One row of :func:`sass_report`: compile ``kind`` for sm_90 and count its SASS. The launch
    compiled is the one the launcher makes for a dense ``(64, group_size)`` tensor under
    ``cfg`` (recorded on CPU tensors, nothing runs; ``tests/kernels/compiled.py``), so its
    signature and specialization are the device's."""
    import re
    import subprocess
    import tempfile

    import triton

    from gact_graph.kernels import quantize as kq
    from tests.kernels.compiled import compile_launch, recorded_launches

    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    fn = kq._quantize_pack_kernel if kind == "quantize" else kq._unpack_dequantize_kernel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[tname]
    x = torch.zeros(64, group_size, dtype=dtype)
    with kq.forced_config(cfg), recorded_launches(fn) as launches:
        if kind == "quantize":
            kq.triton_quantize(x, bits, group_size, 0)
        else:
            packed, meta = kq.quantize_reference(x, bits, group_size, 0)
            kq.triton_dequantize(packed, meta, bits, x.shape, dtype, group_size)
    (launch,) = launches
    cx = launch.constexprs()
    groups, h, t, v = cx["GROUPS"], cx["H"], cx["T"], cx["V"]
    k = compile_launch(launch, 90)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        usage = subprocess.run([str(nvdisasm.parent / "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True).stdout  # fmt: skip
    regs = re.search(r"REG:(\d+)", usage)
    n = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln))
    per_thread = groups * h * t * v / (32 * launch.kwargs["num_warps"])
    ptx = k.asm["ptx"]
    ld = sorted(set(re.findall(r"ld\.global(?:\.v\d)?\.b\d+", ptx)))
    st = sorted(set(re.findall(r"st\.global(?:\.v\d)?\.b\d+", ptx)))
    bar = len(re.findall(r"\bbar\.sync\b", ptx))
    return (f"| {kind} | {tname} | {bits} | {n / per_thread:.1f} | {' '.join(ld)} "
            f"| {' '.join(st)} | {bar} | {regs.group(1) if regs else '?'} "
            f"| {tuple(cfg)} |")  # fmt: skip


def sass_report(bits_list, group_size: int = 256, dtypes=("fp32", "bf16"), configs=None) -> str:
    """SASS instructions per element of the quantize / dequantize kernels (sm_90, no GPU), with
    the PTX's global load / store widths, its barriers (a layout change through shared memory)
    and the registers per thread (they bound how many programs an SM holds), for each
    configuration in ``configs`` (default: each direction's untuned one)."""
    from gact_graph.kernels import quantize as kq

    default = configs is None
    lines = [
        "| kernel | dtype | bits | SASS / element | loads | stores | bar.sync | registers "
        "| config |",
        "|---|---|---:|---:|---|---|---:|---:|---|",
    ]
    for kind in ("quantize", "dequantize"):
        for tname in dtypes:
            for bits in bits_list:
                for cfg in [kq.DEFAULTS[kind]] if default else configs:
                    lines.append(_sass_row(kind, tname, bits, cfg, group_size))
    return "\n".join(lines)


def config_report(args: argparse.Namespace) -> dict:
    """Device time of each direction under each of the tuner's configurations, measured as
    CUDA-event time over back-to-back launches (no host wait between them), next to the
    configuration the tuner chooses; ``--dry`` lists what would be timed."""
    from gact_graph.kernels import quantize as kq

    rows = args.numel // args.cols if args.numel else args.rows
    res = {"shape": [rows, args.cols], "configs": [list(c) for c in kq.CONFIGS], "rows": []}
    if args.dry:
        res["rows"] = [{"dtype": d, "bits": b} for d in args.dtypes for b in args.bits]
        return res
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, args.cols, generator=gen)
    for dtype_name in args.dtypes:
        x = base.to(device, getattr(torch, dtype_name))
        x_bytes = x.numel() * x.element_size()
        t_copy = device_seconds(x.clone, args.repeats)
        for bits in args.bits:
            q = quantize(x, bits, args.group_size, seed=0)
            moved = (x_bytes + q.nbytes) / 1e9
            row = {"dtype": dtype_name, "bits": bits, "copy_ms": t_copy * 1e3, "configs": {}}
            for cfg in kq.CONFIGS:
                with kq.forced_config(cfg):
                    t_q = device_seconds(
                        lambda b=bits, x=x: quantize(x, b, args.group_size, seed=0), args.repeats
                    )
                    t_d = device_seconds(q.dequantize, args.repeats)
                row["configs"][str(tuple(cfg))] = {
                    "quantize_ms": t_q * 1e3,
                    "quantize_pct_copy_bw": 100 * moved / t_q / (2 * x_bytes / 1e9 / t_copy),
                    "dequantize_ms": t_d * 1e3,
                    "dequantize_pct_copy_bw": 100 * moved / t_d / (2 * x_bytes / 1e9 / t_copy),
                }
            res["rows"].append(row)
    res["tuned"] = {str(k): [list(c), {str(tuple(a)): ms for a, ms in t.items()}]
                    for k, (c, t) in kq.tuning_log().items()}  # fmt: skip
    return res


def format_configs(res: dict) -> str:
    lines = [f"shape={tuple(res['shape'])}; device ms (CUDA events, back-to-back launches)",
             "| dtype | bits | config | quantize ms | % copy bw | dequantize ms | % copy bw |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["rows"]:
        for cfg, c in r.get("configs", {str(tuple(k)): None for k in res["configs"]}).items():
            if c is None:
                lines.append(f"| {r['dtype']} | {r['bits']} | {cfg} | (dry) | | | |")
                continue
            lines.append(
                f"| {r['dtype']} | {r['bits']} | {cfg} | {c['quantize_ms']:.4g} "
                f"| {c['quantize_pct_copy_bw']:.0f} % | {c['dequantize_ms']:.4g} "
                f"| {c['dequantize_pct_copy_bw']:.0f} % |"
            )
    for key, (cfg, _) in res.get("tuned", {}).items():
        lines.append(f"tuner: {key} -> {tuple(cfg)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=None, help="default 169343 (cuda) / 16384 (cpu)")
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--numel", type=int, default=None, help="overrides --rows: numel // cols rows")
    p.add_argument("--bits", type=int, nargs="+", default=list(SUPPORTED_BITS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--dry", action="store_true", help="tiny CPU run: checks the script works")
    p.add_argument("--sass", action="store_true", help="SASS instructions per element (no GPU)")
    p.add_argument("--sass-all", action="store_true",
                   help="with --sass: every tuner configuration and fp16 too, not the default's")
    p.add_argument("--configs", action="store_true",
                   help="device time under each tuner configuration, and the tuner's choice "
                   "(CUDA; with --dry: list what would be timed)")  # fmt: skip
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=None, help="default 50 (cuda) / 7 (cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sass:
        if args.sass_all:
            from gact_graph.kernels.quantize import CONFIGS

            print(sass_report(args.bits, args.group_size, ("fp32", "bf16", "fp16"), CONFIGS))
        else:
            print(sass_report(args.bits, args.group_size))
        return
    if args.dry:
        args.device, args.rows, args.numel, args.repeats, args.warmup = "cpu", 512, None, 2, 1
    cuda = args.device.startswith("cuda")
    if args.rows is None:
        args.rows = 169343 if cuda else 16384
    if args.repeats is None:
        args.repeats = 50 if cuda else 7
    if args.configs:
        if not cuda and not args.dry:
            p.error("--configs times the Triton kernels: it needs --device cuda (or --dry)")
        res = config_report(args)
        print(format_configs(res))
    else:
        res = run(args)
        print(format_table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
