"""Mini-batch training, compressed against uncompressed, side by side: accuracy and memory per
batch (docs/results/minibatch.md).

For each model, runs ``examples/train_minibatch.py`` once per bit setting (``fp32`` and
``--bits``, default 2), each in a fresh process (so each peak RSS is its own), with the same
seeds, loader and flags; prints a table and writes every run's JSON summary into one file.

    python benchmarks/minibatch.py --dataset cora --root data --models sage gat \\
        --json cora.json -- --loader random --num-parts 4 --epochs 50 --seeds 3

Everything after ``--`` goes to the example unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_minibatch.py"


def run(dataset: str, root: str | None, model: str, bits: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(EXAMPLE), "--dataset", dataset, "--model", model,
               "--bits", bits, "--no-progress", "--json", str(out), *extra]  # fmt: skip
        if root is not None:
            cmd += ["--root", root]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    head = (
        "| model | bits | test metric (mean ± std) | saved per batch, stock | stored per batch | "
        "ratio | largest batch stored | peak of a step | above step start | "
        "epoch time |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        s = r["summary"]
        mib = 2**20
        lines.append(
            f"| {r['model']} | {r['bits']} | {100 * s['test_metric_mean']:.2f} ± "
            f"{100 * s['test_metric_std']:.2f} | {s['activation_bytes_fp32'] / mib:.2f} MiB | "
            f"{s['activation_bytes_stored'] / mib:.2f} MiB | "
            f"{s['compression_ratio']:.1f}x | {s['activation_bytes_stored_max'] / mib:.2f} MiB | "
            f"{s['peak_memory_bytes'] / mib:,.0f} MiB | "
            f"{max(x['peak_above_start_bytes'] for x in s['per_seed']) / mib:,.0f} MiB | "
            f"{s['epoch_time_s']:.2f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic-flickr")
    p.add_argument("--root", default=None)
    p.add_argument("--models", nargs="+", default=["sage", "gat"])
    p.add_argument("--bits", default="2", help="the compressed setting (against fp32)")
    p.add_argument("--json", help="write every run's summary here")
    args = p.parse_args(own)
    rows = []
    for model in args.models:
        for bits in ("fp32", args.bits):
            summary = run(args.dataset, args.root, model, bits, extra)
            rows.append({"model": model, "bits": bits, "summary": summary})
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
