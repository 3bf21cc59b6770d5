"""`benchmarks/run_gpu_suite.sh` is run on a GPU only when one is lent, so its mechanics (every
stage's flags, the JSON each writes, the SUMMARY.md renderer) are proven here on CPU at toy
sizes (``SUITE_DRY_RUN=1``): a renamed flag or a broken import fails CI instead of a lease."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_stage_of_the_gpu_suite_runs_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), SUITE_DRY_RUN="1")
    subprocess.run(
        ["bash", "benchmarks/run_gpu_suite.sh"], cwd=REPO, env=env, check=True, timeout=500
    )
    suite = json.loads((tmp_path / "suite.json").read_text())
    stages = {s["stage"]: s["exit"] for s in suite["stages"]}
    assert stages == dict.fromkeys(["quantize", "memory", "step_time", "scaling", "largest"], "0")
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "could not render" not in summary and "see suite.log" not in summary
    for name in ("bench_quantize", "activation_memory", "step_time", "scaling", "largest_graph"):
        assert (tmp_path / f"{name}.json").is_file(), name
