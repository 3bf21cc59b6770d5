"""`CompressionConfig` (and so `compress_gnn`) rejects what would otherwise be ignored or
misread: a misspelled keyword, a truthy string for a flag."""

import pytest
from torch import nn

from gact_graph import CompressionConfig, compress_gnn
from gact_graph.config import EXTRA_OPTIONS
from gact_graph.policy.adaptive import ADAPTER_OPTIONS


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize(
    "kwargs, hint",
    [
        ({"bitz": 4}, "'bits'"),
        ({"adaptve": False}, "'adaptive'"),
        ({"max_graph": 2}, "'max_graphs'"),
    ],
)
def test_misspelled_keyword_raises_and_names_the_right_one(kwargs, hint):
    model = _model()
    with pytest.raises(TypeError, match=f"did you mean {hint}"):
        compress_gnn(model, **kwargs)
    assert not hasattr(model, "_gact_graph_controller")  # nothing was installed


@pytest.mark.parametrize("name", ["adaptive", "sparse", "pointwise"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_flags_must_be_bool(name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        compress_gnn(_model(), **{name: value})


def test_seed_must_be_an_int():
    with pytest.raises(TypeError, match="seed"):
        CompressionConfig(seed=1.5)


def test_every_option_a_layer_reads_is_accepted():
    assert set(ADAPTER_OPTIONS) <= set(EXTRA_OPTIONS)
    ctl = compress_gnn(_model(), bits=2, max_graphs=2, ema=0.5, swap_min_bytes=1)
    assert ctl.config.extra == {"max_graphs": 2, "ema": 0.5, "swap_min_bytes": 1}
    ctl.remove()


@pytest.mark.parametrize("budget", ["1e400", "-1e400GiB", "1e400 MiB"])
def test_a_memory_budget_beyond_any_size_is_a_value_error(budget):
    with pytest.raises(ValueError, match="not a finite size"):
        compress_gnn(_model(), memory_budget=budget)


def test_on_divergence_is_an_option():
    ctl = compress_gnn(_model(), bits=2, on_divergence="warn")
    assert ctl.watch.action == "warn" and "on_divergence" in EXTRA_OPTIONS
    ctl.remove()
