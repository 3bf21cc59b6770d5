"""What the profile step measures: live tensor bytes (with windows measured apart) and the
bytes a compressed tensor holds."""

import torch

from gact_graph import switches as once
from gact_graph.budget.profile import LiveBytes, compressed_bytes
from gact_graph.core.quantize import quantize


def test_live_bytes_counts_peak_and_frees():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 8000 live
        del a, b
        c = torch.zeros(250)  # the sweep at this op frees a and b
    assert live.peak == 8000
    assert live.bytes == 1000 and c.numel() == 250


def test_window_is_measured_apart_from_the_rest():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 outside
        live.open_window()
        b = torch.ones(3000)  # +12000 inside the window
        c = b + 1  # +12000
        del b, c
        rise = live.close_window()
        d = torch.ones(500)  # back outside: 4000 + 2000
    assert rise == 24000
    assert live.peak == 28000
    assert live.outside_peak == 6000
    assert a.numel() + d.numel() == 1500


def test_compressed_bytes_is_what_a_qtensor_holds():
    x = torch.randn(300, 70)
    for bits in (1, 2, 4, 8):
        q = quantize(x, bits, group_size=256)
        held = q.packed.untyped_storage().nbytes() + sum(
            t.untyped_storage().nbytes()
            for t in (q.meta if isinstance(q.meta, tuple) else [q.meta])
        )
        assert compressed_bytes(tuple(x.shape), bits, 256) == held


def test_created_after_peak_is_what_a_later_step_starts_with():
    with LiveBytes() as live:
        a = torch.ones(2000)  # 8000
        b = a * 2  # peak 16000
        del a, b
        state = torch.zeros(500)  # 2000, created after the peak and kept (optimizer state)
        scratch = torch.zeros(100)
        del scratch
        torch.zeros(1)  # an op after the del: the sweep sees it freed
    assert live.outside_peak == 16000
    assert live.created_after_peak() == 2000 and state.numel() == 500


def test_ops_set_aside_never_reach_the_outside_peak():
    """The probe's partial backwards (``aside``) and a recomputation window inside them: both
    count towards ``peak``, neither towards ``outside_peak``."""
    state = {"aside": False}
    with LiveBytes(aside=lambda: state["aside"]) as live:
        a = torch.ones(1000)  # 4000 outside
        state["aside"] = True
        b = torch.ones(2000)  # +8000 aside
        live.open_window()
        c = torch.ones(500)  # +2000 in a window opened aside
        rise = live.close_window()
        del b, c
        state["aside"] = False
        d = torch.ones(250)  # 4000 + 1000 outside
    assert rise == 2000
    assert live.peak == 14000
    assert live.outside_peak == 5000
    assert a.numel() + d.numel() == 1250


def test_excluded_storages_are_never_counted_even_through_views():
    x = torch.ones(1000)  # an input: exists before and is counted apart
    with LiveBytes(exclude=[x]) as live:
        v = x.view(10, 100)  # a view returns x's storage
        y = v * 2  # 4000 new
    assert live.peak == 4000
    assert y.shape == v.shape


def test_once_per_graph_work_counts_towards_peak_only():
    """Building a graph's adjacency (`gact_graph.switches`) is in the step's ``peak`` but not in
    ``repeated_peak`` nor ``outside_peak`` (later steps find it cached); what it leaves alive
    is counted from then on."""
    with LiveBytes(once=once.is_once_per_graph) as live:
        a = torch.ones(1000)  # 4000
        with once.once_per_graph():
            scratch = torch.ones(5000)  # +20000, freed inside
            built = torch.ones(500)  # +2000, kept (the adjacency)
            del scratch
            torch.zeros(1)  # the sweep sees the scratch freed
        b = torch.ones(250)  # 4000 + 2000 + 1000
    assert live.peak == 26000
    assert live.repeated_peak == live.outside_peak == 7000
    assert a.numel() + b.numel() + built.numel() == 1750


def test_created_after_peak_counts_what_came_after_an_earlier_near_peak():
    """A storage created before the outside peak but after an earlier moment almost as high
    (a first step's adjacency, built in the first layer after its input's transients) is
    held at that moment too by a later step, which starts with it."""
    with LiveBytes() as live:
        a = torch.ones(2500)  # 10000: a near-peak early
        del a
        kept = torch.ones(2000)  # 8000 created after it, alive at the end
        b = torch.ones(750)  # 8000 + 3000 = 11000: the outside peak
        del b
        torch.zeros(1)
    assert live.outside_peak == 11000
    # a later step: 10000 at the early moment + 8000 it already holds = 18000
    assert live.created_after_peak() == 18000 - 11000 and kept.numel() == 2000
