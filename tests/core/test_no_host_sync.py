"""A steady-state compressed training step never waits for the device (CUDA only).

``torch.cuda.set_sync_debug_mode("error")`` turns every host-device synchronization (``.item()``,
``.tolist()``, ``bool(tensor)``, a blocking copy between host and device, ``nonzero`` and other
data-dependent shapes) into an error. A steady-state step is one that re-plans nothing: the
default (adaptive) mode re-plans at steps 0, 1, 3, 7, 15, ..., so step 5 is one; with fixed bits
every step after the first is (the first compiles and tunes the kernels). Each case checks the
forward, the backward, the optimizer step and ``ctl.iterate()``.

The cases run with ``graph_check="version"``: by default a cached graph's content is checked
once per training forward, which reads one 16-byte digest back (choosing which adjacency serves
the forward is the host's decision); `test_default_graph_check_is_the_only_sync` counts that
one read.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.datasets.synthetic import make_synthetic_graph
from gact_graph.models import build_model, preset
from gact_graph.policy.watch import GradientWatch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: large enough that every activation is quantized (well above ``min_numel`` and the CUDA
#: small-tensor threshold), small enough for a few seconds per case
NODES, EDGES, FEATURES, CLASSES = 6000, 60000, 64, 8

CASES = [
    ("gcn", {}),
    ("gcn", {"bits": 2, "adaptive": False}),
    ("gat", {}),
    ("gat", {"bits": 2, "adaptive": False}),
    ("gcnii", {}),
    ("gcnii", {"bits": 4, "adaptive": False}),
]


def _setup(name: str, kwargs: dict):
    data = make_synthetic_graph(NODES, EDGES, FEATURES, CLASSES, seed=0).to("cuda")
    torch.manual_seed(0)
    model = build_model(name, FEATURES, CLASSES, **preset(name, "synthetic")["model"]).cuda()
    ctl = compress_gnn(model, **{"graph_check": "version", **kwargs})
    opt = torch.optim.Adam(model.parameters(), lr=0.005)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(data.x, data.edge_index), data.y)
        loss.backward()
        return loss

    def step():
        closure()
        opt.step()
        ctl.iterate(closure)

    return ctl, step


def _without_sync(fn) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name,kwargs", CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_steady_state_step_does_not_sync(name, kwargs):
    ctl, step = _setup(name, kwargs)
    try:
        for _ in range(5):  # default mode: steps 0-4 hold the re-planning steps 0, 1 and 3
            step()
        assert ctl.step == 5
        _without_sync(step)
        quantized = [r for r in ctl.stats()["tensors"] if r["bits"] is not None]
        assert quantized, "the checked step quantized nothing: the test would prove nothing"
    finally:
        ctl.remove()


def test_gradient_watch_reads_its_norms_without_waiting():
    """The watch reads the recorded gradient norms every 10 steps: an asynchronous copy to
    pinned memory, looked at once it has landed; 25 fixed-bit steps cross two reads."""
    ctl, step = _setup("gcn", {"bits": 2, "adaptive": False})
    try:
        step()  # compiles and tunes the kernels
        _without_sync(lambda: [step() for _ in range(25)])
        (watch,) = [
            h.__self__ for h in ctl._step_hooks if isinstance(getattr(h, "__self__", None),
                                                             GradientWatch)
        ]  # fmt: skip
        assert watch.history, "no norm was read back"
    finally:
        ctl.remove()


def test_default_graph_check_is_the_only_sync():
    """With the default ``graph_check="forward"`` a steady-state step reads the graph's content
    digest back once, and makes no other sync."""
    ctl, step = _setup("gcn", {"bits": 2, "adaptive": False, "graph_check": "forward"})
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(syncs) == 1, [str(w.message) for w in syncs]
    finally:
        ctl.remove()
