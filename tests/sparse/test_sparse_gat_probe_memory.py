"""GATv2 under the default (adaptive) mode: where its worst step's memory goes, measured on
CPU with the budget planner's live-bytes meter (`benchmarks/memory.py probe-peak`).

The default mode's steady steps hold what fixed 2 bits holds (same bits on average, nothing
kept twice); its re-planning steps, where the sensitivity probe replays the attention node
once per compressed input and carries each replay's noise down the network, must stay within
1.10x of the fixed step. A GATv2 node reads two compressed N x H x C inputs (``x_l``,
``x_r``) and emits two N x H x C gradients (GAT: one of each), so what the probe holds there
decides it:

- the user's backward: the node's two gradients, waiting for their projections' nodes;
- the probe carries the first replay's noise down before the second replay runs, and drops
  the second input's dequantized copy before the first replay;
- the replays and the partial backwards read a compressed ``x_l`` and ``x_r`` in parts
  (``reads_row_chunks``: gathers from ``x_l``'s unpacked codes, ``x_r`` a row range at a
  time), never dequantized whole, with edge chunks small next to an N x H x C tensor.
"""

import pytest
import torch

from benchmarks.memory import probe_peak_run
from gact_graph.policy import adaptive as adaptive_module


class _Args:
    nodes, degree, features, hidden, heads, layers, steps = 4000, 8, 32, 16, 3, 3, 3


@pytest.fixture(scope="module")
def gatv2_peaks():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the live bytes do not depend on it; the run time does
    try:
        # each re-estimation in one step, as the tests below name the probed steps: the meter
        # slows the probe's many operations more than a plain step's, so the adapter would
        # spread them over steps by timings of the meter (a share's step holds a part of what
        # the complete probe's holds: `docs/results/adaptive.md`, "Spread re-estimation")
        with pytest.MonkeyPatch.context() as m:
            m.setattr(adaptive_module, "MAX_SHARES", 1)
            return {mode: probe_peak_run("gatv2", adaptive, _Args, torch.device("cpu"))["steps"]
                    for mode, adaptive in (("fixed", False), ("default", True))}  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def test_gatv2_steady_step_holds_what_fixed_bits_hold(gatv2_peaks):
    """Step 2 is not probed: the default mode keeps no GATv2 tensor wider or twice, and takes
    the same edge stage as fixed bits."""
    fixed, default = gatv2_peaks["fixed"][2], gatv2_peaks["default"][2]
    assert default["probe_peak_units"] == 0.0
    assert default["edge_stage"] == fixed["edge_stage"] == {"GatV2AttentionFunction": 3}
    assert default["peak_units"] <= 1.02 * fixed["peak_units"], (default, fixed)


def test_gatv2_probed_steps_run_the_probe_within_the_fixed_step(gatv2_peaks):
    """Steps 0 and 1 are probed (the probe's work has a peak of its own), and that peak stays
    within the bound of the fixed step's."""
    fixed = max(f["peak_units"] for f in gatv2_peaks["fixed"])
    for s in gatv2_peaks["default"][:2]:
        assert 0 < s["probe_peak_units"] <= 1.10 * fixed, s


def test_gatv2_default_mode_worst_step_within_the_fixed_bit_envelope(gatv2_peaks):
    worst = max(s["peak_units"] for s in gatv2_peaks["default"])
    assert worst <= 1.10 * max(s["peak_units"] for s in gatv2_peaks["fixed"])
