"""The gradient watch: a diverging compressed run is rescued (its bits raised, with one warning),
only warned about, or stopped, as ``on_divergence`` says; healthy training, a single spike that
recovers and AMP's occasional skipped step get nothing."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.policy.watch import DivergenceError

# Gradient norms of two real runs of PyG's gcn2_cora.py model (64 GCN2Conv layers, Cora,
# `python benchmarks/accuracy.py divergence --model gcn2`, seed 0), rounded to 2 digits:
# default mode (adaptive 2 bits), steps 270-329, healthy (test accuracy 0.84, above stock):
# the old watch warned "grew 17x" at the single spike of step 316.
HEALTHY_GCN2 = [
    0.66, 0.55, 0.65, 0.53, 0.59, 0.43, 0.41, 0.47, 0.55, 0.45, 0.42, 0.54, 0.45, 0.61, 0.51,
    0.48, 0.87, 0.84, 0.52, 0.54, 0.51, 0.69, 0.52, 0.75, 0.56, 0.52, 0.59, 2.03, 0.5, 0.67,
    1.08, 0.48, 0.51, 0.75, 1.36, 0.49, 0.47, 0.69, 1.0, 0.73, 0.52, 2.33, 0.59, 0.48, 0.53,
    0.54, 9.1, 1.54, 0.58, 0.93, 0.54, 0.48, 0.45, 0.65, 0.54, 1.12, 1.57, 0.62, 0.49, 0.46,
]  # fmt: skip
# fixed 2 bits, steps 30-96: diverges (NaN loss from step 97, test accuracy 0.78 -> 0.13)
DIVERGING_GCN2 = [
    0.21, 0.21, 0.58, 0.34, 0.19, 0.23, 0.23, 0.34, 0.19, 0.33, 0.3, 0.6, 0.31, 0.6, 0.3, 0.8,
    0.96, 0.22, 0.29, 0.54, 0.35, 1.15, 0.37, 0.32, 0.31, 0.35, 0.52, 0.78, 1.07, 0.41, 0.36,
    0.41, 0.8, 0.54, 0.56, 1.84, 0.42, 1.81, 1.12, 1.43, 1.85, 1.29, 1.38, 2.33, 1.23, 4.55,
    2.08, 6.93, 3.51, 4.06, 4.99, 14.27, 9.0, 7.46, 11.58, 10.98, 21.18, 15.5, 19.58, 43.13,
    26.08, 44.09, 38.64, 92.44, 207.2, 2572.64, math.nan,
]  # fmt: skip
DIVERGING_START = 30  # the step of DIVERGING_GCN2[0]
NAN_STEP = DIVERGING_START + len(DIVERGING_GCN2) - 1


def _feed(ctl, norms):
    """Run ``ctl.iterate()`` with the (single) parameter's gradient norm set to each value."""
    (p,) = ctl.model.parameters()
    for v in norms:
        p.grad = torch.full_like(p, v / math.sqrt(p.numel()))
        ctl.iterate()


def _ctl(**kw):
    kw.setdefault("adaptive", False)
    return compress_gnn(nn.Linear(4, 4, bias=False), bits=2, **kw)


def _ours(rec):
    return [w for w in rec if "gact_graph" in str(w.message)]


def test_sustained_growth_warns_once_with_advice():
    ctl = _ctl(on_divergence="warn")
    with pytest.warns(RuntimeWarning, match=r"grew 2\dx .*fixed 2-bit.*adaptive bits") as rec:
        _feed(ctl, [1.0 + 0.01 * i for i in range(40)] + [25.0] * 30)
    assert len(_ours(rec)) == 1
    assert ctl.bits_floor is None  # only warned


@pytest.mark.parametrize("spike", [[50.0], [50.0, 1.0, 1.0, 40.0]])
def test_a_spike_that_recovers_is_no_divergence(spike):
    ctl = _ctl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, [1.0] * 40 + spike + [1.0] * 20)
    assert ctl.watch.events == []


def test_the_healthy_gcn2_cora_trace_stays_quiet():
    ctl = _ctl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, HEALTHY_GCN2)
    assert ctl.watch.events == []


def test_the_diverging_gcn2_cora_trace_is_caught_in_time():
    ctl = _ctl(on_divergence="warn")
    ctl.step = DIVERGING_START
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _feed(ctl, DIVERGING_GCN2)
    (event,) = ctl.watch.events
    assert len(_ours(rec)) == 1
    # caught as the loss starts to rise (step 69), 27 steps before it is lost
    assert event["step"] <= NAN_STEP - 25, event


def test_a_converged_run_whose_tiny_gradients_grow_in_a_loss_bump_stays_quiet():
    # OGB's arxiv GCN on Cora, default mode: the norm falls from ~5 to ~1e-3 as the loss reaches
    # 2e-4, then a bump to 7e-4 grows it ~50x for a while; still far below the first steps
    decay = [5.0 * 0.8**i for i in range(40)]
    ctl = _ctl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, decay + [1e-3] * 60 + [5e-2] * 15 + [1e-3] * 20)
    assert ctl.watch.events == []


def test_rescue_raises_every_compressed_tensor_to_8_bits_and_says_so():
    ctl = _ctl()
    assert ctl.bits_for("x#0") == 2
    with pytest.warns(RuntimeWarning, match=r"rescued: every compressed tensor 2 -> 8 bits"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert ctl.bits_floor == 8 and ctl.bits_for("x#0") == 8
    ctl.plan["y#0"] = 1  # a loaded plan is raised too
    assert ctl.bits_for("y#0") == 8
    # the norm goes on growing after the rescue: exact, then a plain warning
    with pytest.warns(RuntimeWarning, match=r"went on growing.*8 -> kept exact"):
        _feed(ctl, [20.0] * 3 + [50.0] * 3)
    assert ctl.bits_for("x#0") is None
    with pytest.warns(RuntimeWarning, match="diverges without compression"):
        _feed(ctl, [120.0] * 3)
    assert [e["action"] for e in ctl.watch.events] == ["rescue"] * 2 + ["warn"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, [1e4] * 20)  # said once: nothing more


def test_a_fixed_4_bit_run_is_rescued_to_8():
    ctl = compress_gnn(nn.Linear(4, 4, bias=False), bits=4, adaptive=False)
    with pytest.warns(RuntimeWarning, match=r"4 -> 8 bits"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)


def test_a_rescue_that_holds_is_not_repeated():
    ctl = _ctl()
    with pytest.warns(RuntimeWarning, match="rescued"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, [15.0, 8.0, 4.0] + [1.0] * 100 + [2.0] * 10)
    assert ctl.bits_floor == 8 and len(ctl.watch.events) == 1


def test_rescue_of_an_adaptive_run_raises_its_average():
    ctl = _ctl(adaptive=True)
    ctl.adapter.tensors = {"t#0": ((64, 64), 4096, 64)}
    with pytest.warns(RuntimeWarning, match=r"average bits 2 -> 4"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert ctl.adapter.avg_bits == 4 and ctl.adapter.default_bits == 4
    assert ctl.plan == {"t#0": 4} and ctl.bits_floor is None


def test_an_adaptive_ladder_with_nothing_wider_is_not_rescued():
    ctl = _ctl(adaptive=True, ladder=(1, 2))
    with pytest.warns(RuntimeWarning, match="ladder has no wider width"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert ctl.adapter.avg_bits == 2


def test_rescue_of_an_acgc_run_tightens_its_bound():
    ctl = _ctl(adaptive=True, policy="acgc", loss_bound=0.1)
    with pytest.warns(RuntimeWarning, match=r"loss_bound 0.1 -> 0.00625"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert ctl.adapter.loss_bound == pytest.approx(0.1 / 16)


def test_under_a_memory_budget_the_rescue_only_warns():
    ctl = _ctl()
    ctl.bits_policy = lambda name: 2  # what the budget planner installs
    with pytest.warns(RuntimeWarning, match="memory budget decides"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert ctl.bits_floor is None and ctl.bits_for("x#0") == 2


def test_raise_stops_the_run_with_a_divergence_error():
    ctl = _ctl(on_divergence="raise")
    with pytest.raises(DivergenceError, match="on_divergence='raise'"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    assert isinstance(DivergenceError("x"), RuntimeError)


@pytest.mark.parametrize("bad", ["Rescue", "ignore", None, 1])
def test_on_divergence_is_validated(bad):
    with pytest.raises(ValueError, match="on_divergence must be one of"):
        _ctl(on_divergence=bad)


def test_a_rescue_survives_a_state_dict_round_trip():
    ctl = _ctl()
    with pytest.warns(RuntimeWarning, match="rescued"):
        _feed(ctl, [1.0] * 30 + [20.0] * 3)
    state = ctl.state_dict()
    ctl.remove()
    ctl2 = _ctl()
    ctl2.load_state_dict(state)
    assert ctl2.bits_floor == 8 and ctl2.bits_for("x#0") == 8
    assert ctl2.watch.events == ctl.watch.events
    state["watch"]["bits_floor"] = 3
    with pytest.raises(ValueError, match="bits_floor"):
        _ctl().load_state_dict(state)


def test_repeated_non_finite_gradients_are_caught_but_one_skipped_amp_step_is_not():
    ctl = _ctl(on_divergence="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a single inf (GradScaler's skipped step) is fine
        _feed(ctl, [1.0] * 15 + [math.inf] + [1.0] * 14)
    with pytest.warns(RuntimeWarning, match="non-finite in 3 of the last 10"):
        _feed(ctl, [math.inf, 1.0, math.nan, math.inf] + [1.0] * 6)


def test_adaptive_advice_is_to_raise_bits():
    ctl = _ctl(adaptive=True, on_divergence="warn")
    with pytest.warns(RuntimeWarning, match=r"adaptive 2-bit compression.*raise bits"):
        _feed(ctl, [1.0] * 40 + [50.0] * 10)


def test_lossless_mode_has_no_watch():
    ctl = compress_gnn(nn.Linear(4, 4, bias=False), bits=None)
    assert ctl.watch is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _feed(ctl, [1.0] * 40 + [1e6] * 10)


def _train(lr_growth, steps):
    """A two-layer linear regression by SGD whose learning rate grows ``lr_growth`` times per
    step: it converges, then crosses the stability limit and blows up geometrically (the slow
    run-up of a real divergence, made deterministic). The step of the watch's warning and the
    losses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 1))
    x = torch.randn(512, 16)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, lr_growth)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0, on_divergence="warn")
    losses, warned_at = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for step in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            ctl.iterate()
            losses.append(loss.item())
            ours = _ours(caught)
            if ours and warned_at is None:
                warned_at = step
                assert "may be diverging" in str(ours[0].message)
    return losses, warned_at


def test_healthy_training_stays_quiet():
    losses, warned_at = _train(lr_growth=1.0, steps=150)
    assert warned_at is None and losses[-1] < 1e-3 * losses[0]


def test_a_diverging_run_is_warned_about_before_its_loss_is_lost():
    losses, warned_at = _train(lr_growth=1.03, steps=120)
    lost = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    assert lost is not None  # this run does blow up (step 59)
    assert warned_at is not None and warned_at < lost
