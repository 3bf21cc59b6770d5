"""Throughput of `quantize` / `QTensor.dequantize` against a plain device copy.

On CUDA this measures the Triton kernels, on CPU the PyTorch reference path. For each bit
width it reports the median time, GB/s counted on the fp32 tensor (bytes read by quantize,
bytes written by dequantize) and the time relative to ``x.clone()`` of the same tensor measured
in the same run (1.0 = as fast as a copy).

Usage::

    python benchmarks/bench_quantize.py --device cuda               # (169343, 256) fp32
    python benchmarks/bench_quantize.py --device cpu --threads 1 --json out.json  # (16384, 256)
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


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    rows = args.numel // args.cols if args.numel else args.rows
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, args.cols, generator=gen).to(device)
    gbytes = x.numel() * 4 / 1e9
    t_copy = median_seconds(x.clone, device, args.repeats, args.warmup)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    result = {
        "device": name,
        "path": "triton" if _use_triton(x) else "reference",
        "shape": [rows, args.cols],
        "dtype": "float32",
        "group_size": args.group_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": args.repeats,
        "copy_ms": t_copy * 1e3,
        "copy_gbps": 2 * gbytes / t_copy,  # a copy reads and writes
        "rows": [],
    }
    for bits in args.bits:
        q = quantize(x, bits, args.group_size, seed=0)
        t_q = median_seconds(
            lambda b=bits: quantize(x, b, args.group_size, seed=0),
            device,
            args.repeats,
            args.warmup,
        )
        t_d = median_seconds(q.dequantize, device, args.repeats, args.warmup)
        result["rows"].append(
            {
                "bits": bits,
                "quantize_ms": t_q * 1e3,
                "quantize_gbps": gbytes / t_q,
                "quantize_x_copy": t_q / t_copy,
                "dequantize_ms": t_d * 1e3,
                "dequantize_gbps": gbytes / t_d,
                "dequantize_x_copy": t_d / t_copy,
                "nbytes": q.nbytes,
                "compression": x.numel() * 4 / q.nbytes,
            }
        )
    return result


def format_table(res: dict) -> str:
    head = (
        f"device={res['device']} path={res['path']} shape={tuple(res['shape'])} fp32 "
        f"G={res['group_size']} threads={res['threads']} torch={res['torch']}\n"
        f"x.clone(): {res['copy_ms']:.3g} ms ({res['copy_gbps']:.3g} GB/s read+write)\n\n"
    )
    lines = [
        "| bits | quantize ms | GB/s | x copy | dequantize ms | GB/s | x copy | compression |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['bits']} | {r['quantize_ms']:.3g} | {r['quantize_gbps']:.3g} "
            f"| {r['quantize_x_copy']:.3g} | {r['dequantize_ms']:.3g} "
            f"| {r['dequantize_gbps']:.3g} | {r['dequantize_x_copy']:.3g} "
            f"| {r['compression']:.3g}x |"
        )
    return head + "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=None, help="default 169343 (cuda) / 16384 (cpu)")
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--numel", type=int, default=None, help="overrides --rows: numel // cols rows")
    p.add_argument("--bits", type=int, nargs="+", default=list(SUPPORTED_BITS))
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=None, help="default 50 (cuda) / 7 (cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if args.rows is None:
        args.rows = 169343 if cuda else 16384
    if args.repeats is None:
        args.repeats = 50 if cuda else 7
    res = run(args)
    print(format_table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
