"""Per-step peak resident memory of fixed vs default (adaptive) 2-bit training, for
`test_probe_memory.py`: run as a script in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` set
low, so that every large tensor is its own mapping and the resident set follows the live bytes.

    python tests/policy/rss_steps.py MODEL MODE [STEPS]  ->  one JSON line, per-step peaks

MODEL is ``gcn`` / ``gat`` (3 layers), ``gcnii`` (8 layers) or ``gcnii64`` (64 layers);
``gat`` and ``gcnii64`` on 10,000 nodes rather than 30,000 (CI time).

MODE is ``fixed`` or ``adaptive``; each runs in its own process, so neither pays for what the
other allocated first (thread pools, the allocator's first mappings).

Each list: per step, the peak resident set during the step minus the resident set before it
(MiB), steps 0 to STEPS - 1 (default 9; the default mode probes steps 0, 1, 3 and 7)."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.harness import build_model  # noqa: E402
from gact_graph import compress_gnn  # noqa: E402
from gact_graph.memory import _reset_rss_peak, _rss_bytes  # noqa: E402


def step_peaks(name: str, adaptive: bool, f: int = 64, steps: int = 9):
    n = 10_000 if name in ("gat", "gcnii64") else 30_000
    torch.manual_seed(0)
    x, ei = torch.randn(n, f), torch.randint(0, n, (2, 8 * n))
    y = torch.randint(0, 8, (n,))
    layers = {"gcnii": 8, "gcnii64": 64}.get(name, 3)
    model = build_model(name.removesuffix("64"), f, 8, num_layers=layers, hidden_channels=64)
    ctl = compress_gnn(model, bits=2, adaptive=adaptive)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    peaks = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _reset_rss_peak()
        rest = _rss_bytes("VmRSS")
        F.cross_entropy(model(x, ei), y).backward()
        opt.step()
        ctl.iterate()
        peaks.append((_rss_bytes("VmHWM") - rest) / 2**20)
    ctl.remove()
    return peaks


if __name__ == "__main__":
    torch.set_num_threads(1)
    name, mode = sys.argv[1], sys.argv[2]
    if mode not in ("fixed", "adaptive"):
        raise SystemExit(f"MODE must be fixed or adaptive, got {mode!r}")
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    print(json.dumps(step_peaks(name, mode == "adaptive", steps=steps)))
