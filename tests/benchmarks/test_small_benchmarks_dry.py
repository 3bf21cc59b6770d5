"""`benchmarks/speed.py`'s GPU measurements (the quantizer, the small-graph epoch, the host's
work, the step time) run in their CPU dry modes (the lead runs them on a GPU; a broken flag or
import must fail here first)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> None:
    cmd = [sys.executable, "benchmarks/speed.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_bench_quantize_dry(tmp_path):
    out = tmp_path / "q.json"
    _run("quantize", "--dry", "--bits", "1", "2", "--json", str(out))
    res = json.loads(out.read_text())
    assert {(r["dtype"], r["bits"]) for r in res["rows"]} == {
        (d, b) for d in ("float32", "bfloat16") for b in (1, 2)
    }
    for r in res["rows"]:
        assert r["quantize_pct_copy_bw"] > 0 and r["dequantize_pct_copy_bw"] > 0


def test_small_graph_epoch_dry(tmp_path):
    out = tmp_path / "e.json"
    _run("epoch", "--dry", "--models", "gcn", "--json", str(out))
    res = json.loads(out.read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == {"stock", "default", "default-min_bytes0"}
    assert all(r["error"] is None and len(r["epoch_times_s"]) == 3 for r in rows.values())
    assert rows["stock"]["ratio_to_stock"] == 1.0


def test_bench_quantize_sass_counts_instructions_without_a_gpu():
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton (its bundled ptxas and nvdisasm)")
    cmd = [sys.executable, "benchmarks/speed.py", "quantize", "--sass", "--bits", "2"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| quantize") or
            ln.startswith("| dequantize")]  # fmt: skip
    assert len(rows) == 4
    for ln in rows:
        per_element = float(ln.split("|")[4])
        assert 0 < per_element < 60, ln  # the one-pass kernels; the old quantizer took 128
        assert "v4" in ln, ln  # vectorized 16-byte accesses on the unpacked side


def test_host_overhead_counts_a_step(tmp_path):
    out = tmp_path / "h.json"
    _run("host", "--nodes", "60", "--edges", "200", "--hidden", "8", "--features",
         "8", "--warmup", "2", "--steps", "2", "--methods", "stock,fixed-2bit",
         "--graph-check", "version", "--json", str(out))  # fmt: skip
    res = json.loads(out.read_text())
    stock, ours = res["methods"]["stock"], res["methods"]["fixed-2bit"]
    assert res["extra"] == {"graph_check": "version"}
    # the compressed step dispatches at least stock's ops (the same model and optimizer)
    assert 0 < stock["ops_per_step"] <= ours["ops_per_step"]
    assert stock["median_step_us"] > 0 and ours["median_step_us"] > 0
    # no graph check: no `equal` of two digests in the step
    assert not any(name == "aten.equal" for name, _, _ in ours["possible_syncs"])


def test_step_time_passes_graph_check(tmp_path):
    out = tmp_path / "s.json"
    _run("step", "--device", "cpu", "--scale", "0.002", "--models", "gcn", "--methods",
         "stock,L1-2bit", "--warmup", "0", "--steps", "1", "--graph-check", "version",
         "--json", str(out))  # fmt: skip
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["L1-2bit"]["compress"]["graph_check"] == "version"
    assert rows["stock"]["compress"] is None
