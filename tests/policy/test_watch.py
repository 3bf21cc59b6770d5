"""The gradient watch warns, once and with advice, when a compressed run starts to diverge,
and stays quiet in healthy training and on AMP's occasional skipped step."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn


def _feed(ctl, norms):
    """Run ``ctl.iterate()`` with the (single) parameter's gradient norm set to each value."""
    (p,) = ctl.model.parameters()
    for v in norms:
        p.grad = torch.full_like(p, v / math.sqrt(p.numel()))
        ctl.iterate()


def _ctl(**kw):
    kw.setdefault("adaptive", False)
    return compress_gnn(nn.Linear(4, 4, bias=False), bits=2, **kw)


def test_growth_over_the_recent_median_warns_once_with_advice():
    ctl = _ctl()
    with pytest.warns(RuntimeWarning, match=r"grew 2\dx .*fixed 2-bit.*adaptive bits") as rec:
        _feed(ctl, [1.0 + 0.01 * i for i in range(40)] + [25.0] * 30)
    assert len([w for w in rec if "gact_graph" in str(w.message)]) == 1


def test_repeated_non_finite_gradients_warn_but_one_skipped_amp_step_does_not():
    ctl = _ctl()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a single inf (GradScaler's skipped step) is fine
        _feed(ctl, [1.0] * 15 + [math.inf] + [1.0] * 14)
    with pytest.warns(RuntimeWarning, match="non-finite in 3 of the last 10"):
        _feed(ctl, [math.inf, 1.0, math.nan, math.inf] + [1.0] * 6)


def test_adaptive_advice_is_to_raise_bits():
    ctl = _ctl(adaptive=True)
    with pytest.warns(RuntimeWarning, match=r"adaptive 2-bit compression.*raise bits"):
        _feed(ctl, [1.0] * 40 + [50.0] * 10)


def test_lossless_mode_has_no_watch():
    ctl = compress_gnn(nn.Linear(4, 4, bias=False), bits=None)
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
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0)
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
            ours = [w for w in caught if "gact_graph" in str(w.message)]
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
