"""`benchmarks/speed.py`'s GPU measurements (the quantizer, the small-graph epoch, the host's
work, the step time) run in their CPU dry modes (the lead runs them on a GPU; a broken flag or
import must fail here first). Every subcommand runs as ``python benchmarks/speed.py ...`` would
run it, all of them in turn in one fresh process (each new process imports torch and PyG
again)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: runs each ``[script, *args]`` of ``argv[1]`` (JSON) in turn as ``python script *args``
#: would (``__main__``, its ``sys.argv`` and ``sys.path[0]``); writes, per run, its exit
#: status, its output and the tail of its errors to ``argv[2]``
DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
runs, out_path = json.loads(sys.argv[1]), sys.argv[2]
results, path = [], list(sys.path)
for script, *args in runs:
    sys.argv, sys.path[:] = [script, *args], [os.path.dirname(os.path.abspath(script)), *path]
    out, err, rc = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (e.code is not None)
        err.write(f"SystemExit: {e.code}")
    except BaseException:
        rc = 1
        err.write(traceback.format_exc())
    results.append(dict(rc=int(rc), stdout=out.getvalue(), stderr=err.getvalue()[-4000:]))
with open(out_path, "w") as f:
    json.dump(results, f)
"""

#: each test's ``speed.py`` command line (without ``--json``), by name
COMMANDS = {
    "quantize": ("quantize", "--dry", "--bits", "1", "2"),
    "epoch": ("epoch", "--dry", "--models", "gcn"),
    "host": ("host", "--nodes", "60", "--edges", "200", "--hidden", "8", "--features", "8",
             "--warmup", "2", "--steps", "2", "--methods", "stock,fixed-2bit",
             "--graph-check", "version"),
    "step": ("step", "--device", "cpu", "--scale", "0.002", "--models", "gcn", "--methods",
             "stock,L1-2bit", "--warmup", "0", "--steps", "1", "--graph-check", "version"),
}  # fmt: skip
if importlib.util.find_spec("triton") is not None:  # its bundled ptxas and nvdisasm
    COMMANDS["sass"] = ("quantize", "--sass", "--bits", "2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each test's run, by name: ``(its JSON file, the run)``; one process, one torch thread."""
    tmp = tmp_path_factory.mktemp("dry")
    argv = [["benchmarks/speed.py", *args] + (["--json", str(tmp / f"{name}.json")]
            if name != "sass" else [])
            for name, args in COMMANDS.items()]  # fmt: skip
    out = tmp / "runs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argv), str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    done = json.loads(out.read_text())
    return {name: (tmp / f"{name}.json", run) for name, run in zip(COMMANDS, done)}


def _run(runs: dict, name: str):
    """The JSON file and the stdout of the run of ``name``, which exited 0."""
    path, run = runs[name]
    assert run["rc"] == 0, run["stdout"][-2000:] + run["stderr"]
    return path, run["stdout"]


def test_bench_quantize_dry(runs):
    out, _ = _run(runs, "quantize")
    res = json.loads(out.read_text())
    assert {(r["dtype"], r["bits"]) for r in res["rows"]} == {
        (d, b) for d in ("float32", "bfloat16") for b in (1, 2)
    }
    for r in res["rows"]:
        assert r["quantize_pct_copy_bw"] > 0 and r["dequantize_pct_copy_bw"] > 0


def test_small_graph_epoch_dry(runs):
    out, _ = _run(runs, "epoch")
    res = json.loads(out.read_text())
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == {"stock", "default", "default-min_bytes0"}
    assert all(r["error"] is None and len(r["epoch_times_s"]) == 3 for r in rows.values())
    assert rows["stock"]["ratio_to_stock"] == 1.0


def test_bench_quantize_sass_counts_instructions_without_a_gpu(runs):
    if "sass" not in runs:
        pytest.skip("needs triton (its bundled ptxas and nvdisasm)")
    _, stdout = _run(runs, "sass")
    rows = [ln for ln in stdout.splitlines() if ln.startswith("| quantize") or
            ln.startswith("| dequantize")]  # fmt: skip
    assert len(rows) == 4
    for ln in rows:
        per_element = float(ln.split("|")[4])
        assert 0 < per_element < 60, ln  # the one-pass kernels; the old quantizer took 128
        assert "v4" in ln, ln  # vectorized 16-byte accesses on the unpacked side


def test_host_overhead_counts_a_step(runs):
    out, _ = _run(runs, "host")
    res = json.loads(out.read_text())
    stock, ours = res["methods"]["stock"], res["methods"]["fixed-2bit"]
    assert res["extra"] == {"graph_check": "version"}
    # the compressed step dispatches at least stock's ops (the same model and optimizer)
    assert 0 < stock["ops_per_step"] <= ours["ops_per_step"]
    assert stock["median_step_us"] > 0 and ours["median_step_us"] > 0
    # no graph check: no `equal` of two digests in the step
    assert not any(name == "aten.equal" for name, _, _ in ours["possible_syncs"])


def test_step_time_passes_graph_check(runs):
    out, _ = _run(runs, "step")
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["L1-2bit"]["compress"]["graph_check"] == "version"
    assert rows["stock"]["compress"] is None
