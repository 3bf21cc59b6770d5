"""Resuming and copying a compressed model: `load_state_dict` checks the state before it
changes anything, and a deepcopy or pickle of a compressed model is an uncompressed model."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.models import GAT, GCN


def _graph(n=200, e=1000, f=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, f, generator=g),
        torch.randint(0, n, (2, e), generator=g),
        torch.randint(0, 3, (n,), generator=g),
    )


def _step(model, x, ei, y):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, ei), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _trained_ctl(model, **kw):
    x, ei, y = _graph()
    ctl = compress_gnn(model, bits=2, min_numel=0, **kw)
    for _ in range(2):
        _step(model, x, ei, y)
        ctl.iterate()
    return ctl


def test_state_of_another_model_is_refused():
    torch.manual_seed(0)
    gat_state = _trained_ctl(GAT(16, 8, 3, num_layers=2)).state_dict()
    gcn = GCN(16, 8, 3, num_layers=2)
    ctl = compress_gnn(gcn, bits=2)
    with pytest.raises(ValueError, match="saved for a GAT"):
        ctl.load_state_dict(gat_state)
    # an older state without the model's name: the plan's module paths still tell
    gat_state.pop("model")
    gat_state["plan"] = {"convs.0.att#0": 4}
    with pytest.raises(ValueError, match="does not have"):
        ctl.load_state_dict(gat_state)
    assert ctl.step == 0 and ctl.plan == {}  # nothing changed


@pytest.mark.parametrize("bits", [3, 0, -1, 64, "x", True, 2.5])
def test_plan_values_outside_the_ladder_are_refused(bits):
    torch.manual_seed(0)
    ctl = _trained_ctl(GCN(16, 8, 3, num_layers=2))
    state = ctl.state_dict()
    name = next(iter(state["plan"]))
    state["plan"][name] = bits
    before = dict(ctl.plan)
    with pytest.raises(ValueError, match="bits"):
        ctl.load_state_dict(state)
    assert ctl.plan == before


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_malformed_step_is_refused(step):
    torch.manual_seed(0)
    ctl = _trained_ctl(GCN(16, 8, 3, num_layers=2))
    state = ctl.state_dict()
    state["step"] = step
    with pytest.raises(ValueError, match="step"):
        ctl.load_state_dict(state)
    assert ctl.step == 2


def test_good_state_still_round_trips():
    torch.manual_seed(0)
    ctl = _trained_ctl(GCN(16, 8, 3, num_layers=2))
    state = ctl.state_dict()
    torch.manual_seed(0)
    ctl2 = compress_gnn(GCN(16, 8, 3, num_layers=2), bits=2, min_numel=0)
    ctl2.load_state_dict(state)
    assert ctl2.plan
    assert ctl2.step == ctl.step and ctl2.plan == ctl.plan


def _user_hook(module, args, output):  # module level: picklable, as torch.save needs
    return None


@pytest.mark.parametrize("opt_level", ["L1", "CB1"])
@pytest.mark.parametrize("model_cls", [GCN, GAT])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_compressed_model_is_the_uncompressed_model(model_cls, opt_level, how):
    x, ei, y = _graph()
    torch.manual_seed(0)
    model = model_cls(16, 8, 3, num_layers=2, dropout=0.0)
    stock = copy.deepcopy(model)
    model.register_forward_hook(_user_hook)
    stock.register_forward_hook(_user_hook)
    ctl = compress_gnn(model, bits=2, opt_level=opt_level)
    _step(model, x, ei, y)
    ctl.iterate()
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    # the copy: no controller, no patched forward, only the user's hook; exactly stock's step
    assert not hasattr(clone, "_gact_graph_controller")
    assert all("forward" not in m.__dict__ for m in clone.modules())
    assert list(clone._forward_hooks.values()) == [_user_hook]
    assert not clone._forward_pre_hooks
    loss_c, grads_c = _step(clone, x, ei, y)
    loss_s, grads_s = _step(stock, x, ei, y)
    assert loss_c == loss_s
    assert all(torch.equal(a, b) for a, b in zip(grads_c, grads_s))
    # the original stays compressed, hooks in their order, and the copy can be compressed
    assert model._gact_graph_controller is ctl
    assert next(iter(model._forward_hooks.values())) is _user_hook
    stored_before = ctl.stats()["total"]["stored_bytes"]
    _step(model, x, ei, y)
    assert 0 < ctl.stats()["total"]["stored_bytes"] == stored_before
    ctl2 = compress_gnn(clone, bits=2)
    _step(clone, x, ei, y)
    assert ctl2.stats()["total"]["stored_bytes"] > 0
    ctl.remove()
    assert "__deepcopy__" not in model.__dict__ and "__reduce_ex__" not in model.__dict__


def test_a_state_saved_with_other_settings_is_refused_or_announced():
    torch.manual_seed(0)
    state = _trained_ctl(GCN(16, 8, 3, num_layers=2)).state_dict()  # adaptive 2 bits
    assert state["plan"] and "adapter" in state
    ctl = compress_gnn(GCN(16, 8, 3, num_layers=2), bits=8, adaptive=False, min_numel=0)
    with pytest.raises(ValueError, match=r"bits=2 \(this controller: 8\).*adaptive=True"):
        ctl.load_state_dict(state)
    assert ctl.step == 0 and ctl.plan == {}  # nothing changed
    # strict=False: this controller's settings hold, and the warning says which
    with pytest.warns(UserWarning, match=r"settings hold \(bits=8, adaptive=False\)"):
        ctl.load_state_dict(state, strict=False)
    assert ctl.step == 2 and ctl.plan == {}
    assert all(ctl.bits_for(name) == 8 for name in state["plan"])


def test_an_adaptive_state_with_another_average_keeps_the_estimates_on_request():
    torch.manual_seed(0)
    old = _trained_ctl(GCN(16, 8, 3, num_layers=2))
    state = old.state_dict()
    ctl = compress_gnn(GCN(16, 8, 3, num_layers=2), bits=4, min_numel=0)
    with pytest.raises(ValueError, match=r"bits=2 \(this controller: 4\)"):
        ctl.load_state_dict(state)
    with pytest.warns(UserWarning, match="sensitivity estimates"):
        ctl.load_state_dict(state, strict=False)
    assert ctl.adapter.c == old.adapter.c and ctl.adapter.avg_bits == 4
    assert set(ctl.plan) == set(old.adapter.tensors)
    assert sum(ctl.plan.values()) > sum(old.plan.values())  # planned for 4 bits, not 2


def test_a_state_loads_into_an_l0_controller():
    torch.manual_seed(0)
    state = _trained_ctl(GCN(16, 8, 3, num_layers=2), adaptive=False).state_dict()
    ctl = compress_gnn(GCN(16, 8, 3, num_layers=2), bits=2, adaptive=False, opt_level="L0")
    ctl.load_state_dict(state)
    assert ctl.step == 2 and ctl.plan == state["plan"]


def _adaptive_state():
    torch.manual_seed(0)
    return _trained_ctl(GCN(16, 8, 3, num_layers=2)).state_dict()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda s: s.update(config=None), TypeError, "config must be the dict"),
        (lambda s: s.update(adapter={}), ValueError, r"adapter state lacks \['c', "),
        (lambda s: s.update(adapter=[1, 2]), TypeError, "adapter state must be a dict"),
        (
            lambda s: s["adapter"]["tensors"].update({next(iter(s["adapter"]["tensors"])): [1]}),
            ValueError,
            r"adapter tensor .* is \[1\]",
        ),
        (
            lambda s: s["adapter"]["c"].update({"convs.0#0": float("nan")}),
            ValueError,
            "sensitivity of 'convs.0#0'",
        ),
        (lambda s: s["adapter"].update(interval=0), ValueError, "interval must be an int >= 1"),
        (
            lambda s: s["adapter"]["tensors"].update({"nowhere#0": [[4], 256, 4]}),
            ValueError,
            "module 'nowhere'",
        ),
        (lambda s: s["plan"].update({7: 2}), ValueError, "names a tensor 7"),
    ],
)
def test_malformed_states_name_the_problem(change, error, match):
    state = _adaptive_state()
    change(state)
    torch.manual_seed(0)
    ctl = compress_gnn(GCN(16, 8, 3, num_layers=2), bits=2, min_numel=0)
    with pytest.raises(error, match=match):
        ctl.load_state_dict(state)
    assert ctl.step == 0 and ctl.plan == {} and ctl.adapter.c == {}
