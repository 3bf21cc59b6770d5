"""`benchmarks/run_gpu_suite.sh` is run on a GPU only when one is lent, so its mechanics (every
stage's flags, the JSON each writes, the SUMMARY.md renderer) are proven here on CPU at toy
sizes (``SUITE_DRY_RUN=1``): a renamed flag or a broken import fails CI instead of a lease.
Both the default stages and those of the ``waiting`` preset (the call a lent device makes
first) run, as two suites side by side (each stage is mostly one Python thread); the
``cuda_tests`` stage is left out (on CPU it would only collect and skip what CI runs anyway)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: stage -> the JSON file it writes (None: it writes none)
SUITES = (
    {"quantize": "bench_quantize", "memory": "activation_memory", "step_time": "step_time",
     "scaling": "scaling", "largest": "largest_graph"},
    {"replan": None, "gat_probe": "gat_probe_peak", "small": "small_graph_epoch",
     "products": "budget_products", "host_overhead": None},
)  # fmt: skip


#: the mechanics are under test, not the time: the limits of the stages that do not fit their
#: work to their limit (`--time-budget`) leave room for a loaded CI machine
LIMITS = {f"T_{stage}": "300" for stage in ("QUANTIZE", "MEMORY", "SCALING", "LARGEST", "STEP",
          "GAT_EDGE", "REPLAN", "GAT_PROBE", "SMALL", "PRODUCTS", "HOST")}  # fmt: skip


@pytest.mark.slow
def test_every_stage_of_the_gpu_suite_runs_on_cpu(tmp_path):
    runs = []
    for i, stages in enumerate(SUITES):
        out = tmp_path / str(i)
        out.mkdir()
        env = dict(
            os.environ,
            OUT=str(out),
            SUITE_DRY_RUN="1",
            SUITE_STAGES=" ".join(stages),
            OMP_NUM_THREADS="1",  # one core each: the two suites run side by side
            SUITE_BUDGET="900",
            **LIMITS,
        )
        runs.append((out, stages, subprocess.Popen(
            ["bash", "benchmarks/run_gpu_suite.sh"], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )))  # fmt: skip
    for out, stages, proc in runs:
        assert proc.wait(timeout=1000) == 0, (out / "suite.log").read_text()[-4000:]
        suite = json.loads((out / "suite.json").read_text())
        exits = {s["stage"]: s["exit"] for s in suite["stages"]}
        assert exits == dict.fromkeys(stages, "0"), (out / "suite.log").read_text()[-4000:]
        summary = (out / "SUMMARY.md").read_text()
        assert "could not render" not in summary and "see suite.log" not in summary
        for name in filter(None, stages.values()):
            assert (out / f"{name}.json").is_file(), name
