"""One re-estimation spread over several steps (`gact_graph.policy.spread` and the adapter's
use of it): the number of shares, the partition, each tensor probed once, the plan made after
the last share, the estimates the complete probe gives, the state round trip, the schedule."""

import copy

import pytest
import torch
from torch import nn

from gact_graph import compress_gnn
from gact_graph.core import controller as controller_module
from gact_graph.models import GAT, GCN
from gact_graph.policy.adaptive import Adapter
from gact_graph.policy.sensitivity import SensitivityProbe, spearman
from gact_graph.policy.spread import choose_shares, groups_of, partition_shares


# ------------------------------------------------------------------ the pure functions
def test_partition_puts_each_tensor_in_one_share_and_groups_together():
    work = {"a": 8.0, "b": 1.0, "c": 4.0, "d": 4.0, "e": 2.0, "f": 1.0}
    parts = partition_shares(work, 3, together=[("b", "f")])
    names = [n for p in parts for n in p]
    assert sorted(names) == sorted(work) and len(names) == len(set(names))
    assert any({"b", "f"} <= set(p) for p in parts)
    loads = sorted(sum(work[n] for n in p) for p in parts)
    assert loads == [6.0, 6.0, 8.0]  # "a" alone is the largest possible share
    assert partition_shares(work, 3, [("b", "f")]) == parts  # deterministic
    # never more shares than groups; one share holds everything
    assert len(partition_shares({"x": 1.0, "y": 1.0}, 5, [("x", "y")])) == 1
    assert partition_shares(work, 1) == [sorted(work)]
    with pytest.raises(ValueError, match="shares must be >= 1"):
        partition_shares(work, 0)


def test_groups_follow_chains_of_tensors_read_together():
    assert groups_of("abcde", [("a", "c"), ("c", "e"), ("z", "b")]) == [
        ["a", "c", "e"],
        ["b"],
        ["d"],
    ]


def test_number_of_shares_from_a_fake_cost():
    work = {n: 1.0 for n in "abcd"}
    # extra time of a complete estimate in plain steps: the fewest shares whose largest part fits 2
    assert choose_shares(1.5, 1.0, work) == 1  # cheap (GCN): one step
    assert choose_shares(2.0, 1.0, work) == 1
    assert choose_shares(3.0, 1.0, work) == 2
    assert choose_shares(5.0, 1.0, work) == 4  # 3 shares of 4 equal tensors: the largest is half
    assert choose_shares(50.0, 1.0, work) == 4  # no more shares than tensors
    many = {f"t{i}": 1.0 for i in range(40)}
    assert choose_shares(50.0, 1.0, many) == 8  # the bound
    assert choose_shares(50.0, 1.0, many, max_shares=3) == 3
    # one tensor holds most of the work: splitting the rest does not help beyond two shares
    skew = {"big": 10.0, "s1": 1.0, "s2": 1.0}
    assert choose_shares(24.0, 1.0, skew) == 2
    # cheap in seconds, however dear against a plain step: one step
    assert choose_shares(0.2, 0.01, work) == 1
    assert choose_shares(0.2, 0.01, work, min_seconds=0.1) == 4
    # nothing known: one step
    assert choose_shares(5.0, None, work) == 1
    assert choose_shares(float("nan"), 1.0, work) == 1
    assert choose_shares(5.0, 1.0, {}) == 1
    with pytest.raises(ValueError, match="max_shares"):
        choose_shares(5.0, 1.0, work, max_shares=0)


# ------------------------------------------------------------------ the adapter
def _graph(n=300, e=1800, f=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    return torch.randn(n, f, generator=g), ei, torch.randint(0, classes, (n,), generator=g)


def _gcn(seed=0):
    torch.manual_seed(seed)
    return GCN(16, 32, 4, num_layers=4, dropout=0.0, batch_norm=True)


class Run:
    """A model under the default mode, stepped by hand; ``shares`` fixes what the adapter
    chooses (the fake cost), ``update=False`` leaves the parameters as they are so that every
    step is the same computation."""

    def __init__(self, model, shares, data, update=False, **kw):
        self.model, self.data, self.update = model, data, update
        self.ctl = compress_gnn(model, bits=2, min_numel=256, **kw)
        self.adapter = self.ctl.adapter
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.force(shares)
        self.updates: list[dict] = []  # every complete estimate the plan was made from
        self.probed: list[tuple[int, list[str]]] = []  # (step, names a probe estimated)
        real_update, real_result = self.adapter._update, SensitivityProbe.result
        run = self

        def update(ctl, est, *args, **kw):
            run.updates.append({"step": ctl.step, "est": dict(est)})
            return real_update(ctl, est, *args, **kw)

        def result(probe):
            out = real_result(probe)
            if probe.ctl is run.ctl:
                run.probed.append((run.ctl.step, sorted(out)))
            return out

        self.adapter._update = update
        self._result = result

    def force(self, shares):
        self.adapter._choose_shares = lambda extra: setattr(self.adapter, "shares", shares)

    def step(self, monkeypatch):
        x, ei, y = self.data
        with monkeypatch.context() as m:
            m.setattr(SensitivityProbe, "result", self._result)
            torch.manual_seed(1)
            self.opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(self.model(x, ei), y).backward()
            if self.update:
                self.opt.step()
            self.ctl.iterate()


def test_each_tensor_is_probed_once_and_the_plan_changes_after_the_last_share(monkeypatch):
    run = Run(_gcn(), 3, _graph())
    run.step(monkeypatch)  # step 0: the first estimate, complete
    assert [s for s, _ in run.probed] == [0] and run.adapter.shares == 3
    names = set(run.adapter.tensors)
    assert len(names) >= 3 and set(run.probed[0][1]) == names
    plan0, n0 = dict(run.ctl.plan), run.adapter.n_estimates
    # step 1 begins a re-estimation spread over three steps: 1, 2, 3
    for step in (1, 2):
        run.step(monkeypatch)
        prog = run.ctl.stats()["re_estimation"]
        assert prog["in_progress"] and prog["shares"] == 3 and prog["shares_done"] == step
        assert prog["started"] == 1
        assert run.adapter.n_estimates == n0 and run.ctl.plan == plan0 and len(run.updates) == 1
        assert f"{step} of 3 shares probed" in run.ctl.report()
    run.step(monkeypatch)
    assert run.adapter.n_estimates == n0 + 1 and len(run.updates) == 2
    assert run.updates[-1]["step"] == 3
    prog = run.ctl.stats()["re_estimation"]  # the next has begun: its first share is armed
    assert prog["shares_done"] == 0 and prog["started"] == run.adapter.next_estimate == 4
    shares = [set(n) for s, n in run.probed[1:]]
    assert [s for s, _ in run.probed[1:]] == [1, 2, 3]
    assert all(shares) and set.union(*shares) == names
    assert sum(len(s) for s in shares) == len(names)  # exactly once
    assert set(run.updates[-1]["est"]) == names
    # the schedule counts from the step it began (1 + interval), never before the last share
    assert run.adapter.history[-1]["shares"] == 3 and run.adapter.history[-1]["start"] == 1
    assert run.adapter.interval <= 2
    run.ctl.remove()


def _gat(seed=0):
    torch.manual_seed(seed)
    return GAT(16, 16, 4, heads=2, num_layers=3, dropout=0.0)


@pytest.mark.parametrize("make", [_gcn, _gat], ids=["gcn_bn", "gat"])
def test_spread_estimates_agree_with_the_complete_one(monkeypatch, make):
    """Same steps (no parameter update, one input, the quantizer's rounding seeded as at one
    step), same probing seed: every tensor's spread estimate is the complete probe's, within
    float rounding. (Across real steps each share's estimate differs from the complete one
    by what one step's rounding draw changes, as two complete estimates of two steps do.)"""
    real_seed = controller_module.mix_seed
    monkeypatch.setattr(
        controller_module, "mix_seed", lambda base, step, *rest: real_seed(base, 0, *rest)
    )
    data = _graph()
    whole = Run(make(), 1, data)
    spread = Run(make(), 3, data)
    for run in (whole, spread):
        for _ in range(4):
            run.step(monkeypatch)
    a, b = whole.updates[1]["est"], spread.updates[1]["est"]
    assert set(a) == set(b) and len(a) >= 3
    assert len([1 for s, _ in spread.probed if s > 0]) == 3  # steps 1-3 probed one share each
    for name in a:
        assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-12), name
    for run in (whole, spread):
        run.ctl.remove()


@pytest.mark.parametrize("make", [_gcn, _gat], ids=["gcn_bn", "gat"])
def test_spread_estimates_agree_across_steps_within_the_statistical_tolerance(monkeypatch, make):
    """Each share's step draws its own rounding (the quantizer's seed follows the step): the
    spread estimates then agree with the complete one within the tolerances of
    `test_sensitivity.py` (ranks 0.8, each value 35 %)."""
    data = _graph()
    whole, spread = Run(make(), 1, data), Run(make(), 3, data)
    for run in (whole, spread):
        for _ in range(4):
            run.step(monkeypatch)
    a, b = whole.updates[1]["est"], spread.updates[1]["est"]
    names = sorted(a)
    assert set(b) == set(a)
    assert spearman([a[n] for n in names], [b[n] for n in names]) > 0.8
    for name in names:
        assert b[name] == pytest.approx(a[name], rel=0.35, abs=1e-12), name
    for run in (whole, spread):
        run.ctl.remove()


def test_state_round_trip_in_the_middle_of_a_re_estimation(monkeypatch):
    data = _graph()
    ref = Run(_gcn(), 3, data)
    for _ in range(4):  # the first estimate, then shares at steps 1, 2, 3
        ref.step(monkeypatch)

    run = Run(_gcn(), 3, data)
    for _ in range(2):  # the first estimate, then the first share
        run.step(monkeypatch)
    state = copy.deepcopy(run.ctl.state_dict())
    assert state["adapter"]["progress"]["done"] == 1
    run.ctl.remove()

    resumed = Run(_gcn(), 3, data)
    resumed.ctl.load_state_dict(state)
    assert resumed.adapter.progress()["in_progress"]
    assert resumed.adapter._probe is not None and resumed.adapter._probe.share is not None
    resumed.step(monkeypatch)
    resumed.step(monkeypatch)
    assert len(resumed.updates) == 1 and resumed.updates[0]["step"] == 3
    assert set(resumed.updates[0]["est"]) == set(ref.updates[1]["est"])
    for name, v in ref.updates[1]["est"].items():
        assert resumed.updates[0]["est"][name] == pytest.approx(v, rel=1e-5, abs=1e-12)
    assert resumed.ctl.plan == ref.ctl.plan
    assert resumed.adapter.c == pytest.approx(ref.adapter.c, rel=1e-5)
    for r in (ref, resumed):
        r.ctl.remove()


def test_old_states_load_and_malformed_progress_is_named(monkeypatch):
    data = _graph()
    run = Run(_gcn(), 3, data)
    for _ in range(2):
        run.step(monkeypatch)
    state = copy.deepcopy(run.ctl.state_dict())
    run.ctl.remove()
    old = copy.deepcopy(state)
    for key in ("shares", "work", "together", "estimate_seconds", "progress"):
        del old["adapter"][key]
    fresh = Run(_gcn(), 3, data)
    fresh.ctl.load_state_dict(old)  # a state saved before estimates were spread
    assert fresh.adapter.shares == 1 and not fresh.adapter.progress()["in_progress"]
    bad = copy.deepcopy(state)
    bad["adapter"]["progress"]["done"] = 7
    with pytest.raises(ValueError, match="progress .*done must be an int in"):
        fresh.ctl.load_state_dict(bad)
    bad = copy.deepcopy(state)
    bad["adapter"]["shares"] = 0
    with pytest.raises(ValueError, match="shares must be an int >= 1"):
        fresh.ctl.load_state_dict(bad)
    fresh.ctl.remove()


def test_adapt_interval_is_honoured_and_caps_the_shares(monkeypatch):
    data = _graph()
    run = Run(_gcn(), 3, data, update=True, adapt_interval=4)
    for _ in range(13):
        run.step(monkeypatch)
    starts = [u["step"] for u in run.updates]
    assert starts == [0, 6, 10]  # re-estimations begin at 0, 4, 8 (12 is in progress)
    assert sorted({s for s, _ in run.probed}) == [0, 4, 5, 6, 8, 9, 10, 12]
    assert [h["start"] for h in run.adapter.history] == [0, 4, 8]
    run.ctl.remove()
    # more shares than the interval: capped at the interval
    run = Run(_gcn(), 3, data, adapt_interval=2)
    real = Adapter._choose_shares
    run.adapter._choose_shares = lambda extra: real(run.adapter, extra)
    run.adapter._plain_seconds = lambda: 1.0
    run.adapter._extra = lambda probe, now, seconds: 50.0
    for _ in range(4):
        run.step(monkeypatch)
    assert run.adapter.shares == 2
    assert [u["step"] for u in run.updates] == [0, 3]  # began at 2, its two shares at 2 and 3
    run.ctl.remove()


def test_the_number_of_shares_comes_from_the_measured_cost(monkeypatch):
    data = _graph()
    run = Run(_gcn(), 1, data)
    real = Adapter._choose_shares
    run.adapter._choose_shares = lambda extra: real(run.adapter, extra)
    run.adapter._plain_seconds = lambda: 1.0
    cost = {"extra": 0.5}
    run.adapter._extra = lambda probe, now, seconds: cost["extra"]
    run.step(monkeypatch)
    assert run.adapter.shares == 1 and run.adapter.estimate_seconds == 0.5  # cheap: one step
    assert "re-estimations in one step" in run.ctl.report()
    cost["extra"] = 100.0
    run.step(monkeypatch)  # step 1: a complete estimate, found dear
    n = run.adapter.shares
    assert 2 <= n <= min(8, len(run.adapter.tensors))
    assert f"spread over {n} steps" in run.ctl.report()
    run.ctl.remove()


def test_the_budget_planners_probe_is_complete_and_ends_a_spread_one(monkeypatch):
    """`attach` (the memory-budget planner's hand-off) arms a probe of every tensor for the
    coming step, giving up a re-estimation in progress; `detach` (its pause) ends one too."""
    data = _graph()
    run = Run(_gcn(), 3, data)
    run.step(monkeypatch)
    run.step(monkeypatch)
    adapter, ctl = run.adapter, run.ctl
    assert adapter.progress()["in_progress"] and adapter._probe.share is not None
    adapter.next_estimate = ctl.step
    adapter.attach(ctl)
    assert not adapter.progress()["in_progress"]
    assert adapter._probe is not None and adapter._probe.share is None
    adapter.next_estimate = ctl.step + 1
    run.step(monkeypatch)
    assert run.updates[-1]["step"] == 2 and set(run.updates[-1]["est"]) == set(adapter.tensors)
    for _ in range(4):  # to the next re-estimation, spread again
        if adapter.progress()["in_progress"]:
            break
        run.step(monkeypatch)
    assert adapter.progress()["in_progress"]
    adapter.detach()
    assert not adapter.progress()["in_progress"] and adapter._probe is None
    run.ctl.remove()


@pytest.mark.parametrize("how", ["max_shares", "deterministic"])
def test_a_run_can_keep_every_re_estimation_in_one_step(monkeypatch, how):
    # the count of shares follows a clock: a run that asks for a schedule it can repeat
    # (max_shares=1, or PyTorch's deterministic algorithms) is never spread
    data = _graph()
    kw = {"max_shares": 1} if how == "max_shares" else {}
    run = Run(_gcn(), 1, data, **kw)
    real = Adapter._choose_shares
    run.adapter._choose_shares = lambda extra: real(run.adapter, extra)
    run.adapter._plain_seconds = lambda: 1.0
    run.adapter._extra = lambda probe, now, seconds: 100.0
    before = torch.are_deterministic_algorithms_enabled()
    try:
        if how == "deterministic":
            torch.use_deterministic_algorithms(True, warn_only=True)
        for _ in range(4):
            run.step(monkeypatch)
    finally:
        torch.use_deterministic_algorithms(before)
    assert run.adapter.shares == 1
    assert all(h.get("shares", 1) == 1 for h in run.adapter.history)
    run.ctl.remove()


def test_max_shares_is_checked():
    with pytest.raises(ValueError, match="max_shares"):
        compress_gnn(_gcn(), bits=2, max_shares=0)
