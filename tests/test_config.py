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


@pytest.mark.parametrize(
    "name, value",
    [
        ("chunk_bytes", "1MB"),
        ("chunk_bytes", 0),
        ("max_interval", -3),
        ("max_graphs", -1),
        ("max_graphs", 2.5),
        ("hysteresis", -1),
        ("hysteresis", float("nan")),
        ("alert_share", -1),
        ("alert_share", 0),
        ("ema", 1),
        ("budget_margin", -0.1),
        ("swap_min_bytes", -1),
        ("max_shares", True),
        ("min_bytes", -1),
        ("ladder", [3]),
        ("ladder", []),
        ("estimator", "three_seed"),
        ("budget_rectify", "yes"),
        ("swap_simulate", "yes"),
        ("min_numel", True),
        ("adapt_interval", True),
    ],
)
def test_bad_option_values_raise_where_given_naming_option_and_value(name, value):
    """Each option's value is checked when the config is made, not where a layer first reads
    it (``chunk_bytes="1MB"`` failed at the first forward with a bare ``int()`` error; a
    negative ``max_interval`` or ``hysteresis`` was taken silently)."""
    with pytest.raises(ValueError, match=name) as got:
        CompressionConfig(**({"extra": {name: value}} if name in EXTRA_OPTIONS else {name: value}))
    assert repr(value) in str(got.value)
    model = _model()
    with pytest.raises(ValueError, match=name):
        compress_gnn(model, **{name: value})
    assert not hasattr(model, "_gact_graph_controller")


def test_good_option_values_pass():
    import numpy as np

    CompressionConfig(
        extra={
            "chunk_bytes": np.int64(1 << 20),
            "max_graphs": 0,
            "alert_share": 1,
            "ema": 0.0,
            "hysteresis": 0,
            "ladder": (2, 4, 8, 32),
            "budget_rectify": False,
            "swap_simulate": True,
        }
    )
