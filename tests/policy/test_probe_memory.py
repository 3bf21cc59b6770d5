"""Issue 13's bound on CPU: every step of the default (adaptive) mode, probed steps included,
peaks at most 1.10x the fixed-bit step at the same average bits. Measured as resident memory
in a fresh process (`rss_steps.py`); on an H100 the same models give the same picture
(`docs/results/gpu.md`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gact_graph.cpus import usable_cpus

SCRIPT = Path(__file__).with_name("rss_steps.py")

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS"
)


def _peaks(model: str, steps: int = 4, runs: int = 1) -> dict:
    """Per-step peaks of the fixed and the default mode, each in a fresh process. The default
    4 steps hold steps 0, 1 and 3: the first step and two re-planning steps (7 adds CI time
    only). ``runs`` > 1: each mode in that many processes, per step the least peak of them:
    the resident set of identical runs differs by about a MiB (GCNII-64, 10,000 nodes: the
    default mode's worst step 51.3-52.6 MiB, the fixed one's 47.7-49.0 MiB over four runs
    each), which is the whole margin of a 1.07-1.08x ratio under a 1.10 bound. The processes
    run side by side, as many at once as there are usable CPUs (each is one-threaded and
    measures its own resident set)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    jobs = [mode for _ in range(runs) for mode in ("fixed", "adaptive")]
    width = max(1, usable_cpus())
    out = {}
    for i in range(0, len(jobs), width):
        cmds = {n: [sys.executable, str(SCRIPT), model, mode, str(steps)]
                for n, mode in enumerate(jobs[i : i + width], start=i)}  # fmt: skip
        procs = {n: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                 for n, cmd in cmds.items()}  # fmt: skip
        try:
            for n, proc in procs.items():
                stdout, stderr = proc.communicate(timeout=600)
                assert proc.returncode == 0, stderr[-3000:]
                peaks = json.loads(stdout.strip().splitlines()[-1])
                mode = jobs[n]
                out[mode] = [min(a, b) for a, b in zip(out.get(mode, peaks), peaks)]
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()
    return out


def test_linear_inputs_probe_within_the_fixed_bit_envelope():
    """GCNII: every compressed tensor is a linear layer's input, estimated in closed form."""
    p = _peaks("gcnii")
    assert max(p["adaptive"]) <= 1.10 * max(p["fixed"]), p


def test_deep_linear_inputs_probe_within_the_fixed_bit_envelope():
    """A 64-layer GCNII (issue 13 names it): 64 layers' tensors probed in one step."""
    # steps 0 and 1: the first step and a re-planning step; two runs a mode (see _peaks)
    p = _peaks("gcnii64", steps=2, runs=2)
    assert max(p["adaptive"]) <= 1.10 * max(p["fixed"]), p


def test_batchnorm_model_probe_within_the_fixed_bit_envelope():
    """GCN + BatchNorm: the BatchNorm inputs are replayed; their noise is carried to the
    parameters after the replayed node's gradients are released (``_defer``)."""
    p = _peaks("gcn")
    assert max(p["adaptive"]) <= 1.10 * max(p["fixed"]), p


def test_attention_model_probe_within_the_fixed_bit_envelope():
    """GAT + BatchNorm: each replayed tensor's noise runs a partial backward through the
    attention layers below on top of the user's backward; it stays in the envelope because
    there its matmuls read their compressed inputs in row chunks and the attention backward
    releases its features before their gradient exists (`gact_graph.switches`)."""
    p = _peaks("gat", steps=2)  # steps 0 and 1: the first step and a re-planning step
    assert max(p["adaptive"]) <= 1.10 * max(p["fixed"]), p
