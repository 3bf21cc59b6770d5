"""Accuracy vs activation compression, laid out like GACT's Table 3: one row per setting
(FP32, fixed bits, adaptive bits), one column per dataset x model, each cell the test metric
mean ± std over seeds and the activation compression ratio (stock PyG's saved bytes over
what gact_graph stored).

Every cell is one run of ``examples/train_full_batch.py --json``; runs go to a cache folder
and are skipped when their JSON exists, so an interrupted table resumes where it stopped.

    python benchmarks/accuracy_table.py --datasets cora --models gcn,gat \\
        --settings fp32,4f,4,3,2 --seeds 5 --root data --jobs 2 --out results/acc

Settings: ``fp32``; ``<b>`` adaptive at an average of b bits (the default behaviour);
``<b>f`` fixed b bits for every tensor (``--fixed-bits``). ``--dataset-args NAME=ARGS`` and
``--model-args NAME=ARGS`` pass extra flags to the example for one dataset or model (e.g.
``--dataset-args "synthetic-ogbn-arxiv=--scale 0.05 --epochs 100"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_full_batch.py"


def setting_flags(setting: str) -> list[str]:
    if setting == "fp32":
        return ["--bits", "fp32"]
    if setting.endswith("f"):
        return ["--bits", setting[:-1], "--fixed-bits"]
    return ["--bits", setting]


def setting_label(setting: str) -> str:
    if setting == "fp32":
        return "FP32"
    if setting.endswith("f"):
        return f"fixed {setting[:-1]}-bit"
    return f"adaptive {setting}-bit"


def parse_pairs(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, args = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=ARGS, got {item!r}")
        out[name] = shlex.split(args)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="cora")
    p.add_argument("--models", default="gcn,gat,gcnii")
    p.add_argument("--settings", default="fp32,4f,4,3,2")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--root", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (one thread each)")
    p.add_argument("--dataset-args", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--model-args", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--out", default="accuracy_table", help="folder for the runs' JSON")
    p.add_argument("--json", help="write the table as JSON (default OUT/table.json)")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d_args, m_args = parse_pairs(args.dataset_args), parse_pairs(args.model_args)
    datasets, models = args.datasets.split(","), args.models.split(",")
    settings = args.settings.split(",")
    cells = [(d, m, s) for d in datasets for m in models for s in settings]

    def run(cell):
        d, m, s = cell
        path = out / f"{d}_{m}_{s}.json"
        if path.exists():
            return cell, json.loads(path.read_text()), 0.0
        cmd = [sys.executable, str(EXAMPLE), "--dataset", d, "--model", m, "--seeds",
               str(args.seeds), "--no-progress", "--json", str(path), *setting_flags(s),
               *d_args.get(d, []), *m_args.get(m, [])]  # fmt: skip
        if args.root:
            cmd += ["--root", args.root]
        if args.device:
            cmd += ["--device", args.device]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (out / f"{d}_{m}_{s}.log").write_text(shlex.join(cmd) + "\n" + res.stdout + res.stderr)
        if res.returncode != 0:
            print(f"FAILED {d} {m} {s}: see {out / f'{d}_{m}_{s}.log'}", flush=True)
            return cell, None, time.perf_counter() - t0
        took = time.perf_counter() - t0
        print(f"done {d} {m} {s} in {took:.0f}s", flush=True)
        return cell, json.loads(path.read_text()), took

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = {cell: res for cell, res, _ in pool.map(run, cells)}

    table = []
    for s in settings:
        row = {"setting": s, "label": setting_label(s), "cells": {}}
        for d in datasets:
            for m in models:
                r = results.get((d, m, s))
                if r is None:
                    continue
                row["cells"][f"{d}/{m}"] = {
                    "mean": r["test_metric_mean"],
                    "std": r["test_metric_std"],
                    "ratio": r["compression_ratio"],
                    "adapt_overhead": r.get("adapt_overhead"),
                    "epoch_time_s": r["epoch_time_s"],
                    "seeds": len(r["per_seed"]),
                }
        table.append(row)

    cols = [f"{d}/{m}" for d in datasets for m in models]
    lines = [
        "| setting | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for row in table:
        cells = []
        for c in cols:
            v = row["cells"].get(c)
            cells.append(
                "-"
                if v is None
                else f"{100 * v['mean']:.2f} ± {100 * v['std']:.2f} ({v['ratio']:.1f}x)"
            )
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    overhead = [
        (c, v["adapt_overhead"])
        for row in table
        for c, v in row["cells"].items()
        if v.get("adapt_overhead") is not None
    ]
    if overhead:
        print("\nadaptation overhead (share of training time):")
        for row in table:
            for c, v in row["cells"].items():
                if v.get("adapt_overhead") is not None:
                    print(f"  {row['label']:>16} {c}: {100 * v['adapt_overhead']:.1f}%")
    summary = {"settings": settings, "columns": cols, "rows": table, "seeds": args.seeds}
    Path(args.json or out / "table.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
