"""The one configuration object of `compress_gnn`, validated when it is made."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from difflib import get_close_matches as close
from typing import Any

__all__ = [
    "CompressionConfig",
    "DOUBLE_BACKWARD_HELP",
    "EXTRA_OPTIONS",
    "FIXED_BITS",
    "GRAPH_CHECKS",
    "ON_DIVERGENCE",
    "OPT_LEVELS",
    "PLAN_BITS",
    "format_bytes",
    "parse_bytes",
    "POLICIES",
]

#: The one answer every path gives to a ``create_graph=True`` backward it cannot differentiate
#: again: which settings do support higher-order gradients.
DOUBLE_BACKWARD_HELP = (
    "higher-order gradients (create_graph=True) need every saved tensor exact and every "
    "backward differentiable: compress_gnn(model, bits=None, pointwise=False, sparse=False)"
)

#: Bit widths that the quantizer packs densely (see `gact_graph.core.quantize`).
FIXED_BITS = (1, 2, 4, 8)
#: Bits a plan may give one tensor: the packed widths and 32 (kept as it is).
PLAN_BITS = (*FIXED_BITS, 32)
#: Advanced options, passed as ``compress_gnn(model, **extra)``, and the layer that reads each.
#: Any other keyword is a mistake (a misspelled argument) and raises.
EXTRA_OPTIONS = {
    "max_graphs": "sparse: graphs whose adjacency stays cached (default 4)",
    "min_bytes": "float tensors under this many bytes are kept as they are (default: 1 MiB on "
    "CUDA, 0 elsewhere; not applied under memory_budget, whose planner decides every tensor)",
    "chunk_bytes": "sparse: workspace of chunked SpMM and attention",
    "swap_min_bytes": "L2: smallest payload that is swapped to host memory",
    "swap_simulate": "L2: run the swap bookkeeping with plain copies (CPU)",
    "checkpoint_segments": "CB1: the module paths that become checkpoint segments",
    "ladder": "adaptive: the bit widths a plan may use",
    "ema": "adaptive: weight of the old sensitivity estimate",
    "max_interval": "adaptive: longest interval between re-estimations",
    "estimator": "adaptive: 'probe' or 'two_seed' (GACT's Algorithm 1)",
    "alert_share": "adaptive: compression share of the gradient variance that warns",
    "hysteresis": "adaptive: how much better a new plan must be to replace the old",
    "max_shares": "adaptive: most steps one re-estimation is spread over (default 8; 1 keeps "
    "every re-estimation in one step, a schedule that does not follow the clock; also 1 under "
    "torch.use_deterministic_algorithms(True))",
    "budget_margin": "memory_budget: share of the budget kept free for what the prediction "
    "misses (default 0.1)",
    "budget_rectify": "memory_budget: re-plan when a planned step's measured peak exceeds the "
    "budget ('auto', the default: on CUDA, and on CPU when MALLOC_MMAP_THRESHOLD_ is set; "
    "True; False)",
    "on_divergence": "watch: what a compressed run the gradient watch sees diverging gets: "
    "'rescue' (the default: its bits are raised, with a warning), 'warn' (a warning only) or "
    "'raise' (gact_graph.policy.watch.DivergenceError from ctl.iterate())",
    "graph_check": "sparse: when a cached graph's content is checked against the tensors "
    "passed: 'forward' (the default: once per training forward, one O(E) hash pass, and on "
    "CUDA one 16-byte read to the host) or 'version' (storage identity and version counter "
    "only: no pass, no read; a write that bypasses the version counter, through .data or into "
    "a NumPy buffer behind torch.from_numpy, is then not seen)",
    "budget_recompute": "memory_budget: when to measure recomputing segments ('auto', the "
    "default: in a second profile step, only when no plan without it fits; True: in the first; "
    "False: never)",
}
#: The numeric options of ``EXTRA_OPTIONS``: (int only, whether a value is in range, what is
#: allowed, in words). NaN is in no range.
_NUMERIC_OPTIONS: dict[str, tuple[bool, Callable[[float], bool], str]] = {
    "max_graphs": (True, lambda v: v >= 0, "an int >= 0 (graphs)"),
    "min_bytes": (True, lambda v: v >= 0, "an int >= 0 (bytes)"),
    "chunk_bytes": (True, lambda v: v >= 1, "a positive int (bytes)"),
    "swap_min_bytes": (True, lambda v: v >= 0, "an int >= 0 (bytes)"),
    "max_interval": (True, lambda v: v >= 1, "a positive int (steps)"),
    "max_shares": (True, lambda v: v >= 1, "a positive int (steps)"),
    "ema": (False, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "alert_share": (False, lambda v: 0 < v <= 1, "a number in (0, 1] (1: never warns)"),
    "hysteresis": (False, lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    "budget_margin": (False, lambda v: 0 <= v < 1, "a number in [0, 1)"),
}
#: The options of ``EXTRA_OPTIONS`` that take one of a few values.
_CHOICE_OPTIONS: dict[str, tuple] = {
    "estimator": ("probe", "two_seed"),
    "budget_rectify": ("auto", True, False),
    "budget_recompute": ("auto", True, False),
    "swap_simulate": (True, False),
}


def _option_error(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for the advanced option ``name`` (None: nothing)."""
    if name in _NUMERIC_OPTIONS:
        integer, in_range, allowed = _NUMERIC_OPTIONS[name]
        kind = numbers.Integral if integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind) or not in_range(value):
            return f"{name} must be {allowed}, got {value!r}"
    elif name in _CHOICE_OPTIONS:
        choices = _CHOICE_OPTIONS[name]
        if not any(value is c or (isinstance(c, str) and value == c) for c in choices):
            return f"{name} must be one of {choices}, got {value!r}"
    elif name == "ladder":
        bits = list(value) if isinstance(value, (list, tuple)) else None
        if not bits or any(isinstance(b, bool) or b not in PLAN_BITS for b in bits):
            return f"ladder must be a non-empty list of bit widths from {PLAN_BITS}, got {value!r}"
    return None


#: What ``on_divergence`` may say (`gact_graph.policy.watch`).
ON_DIVERGENCE = ("rescue", "warn", "raise")
#: What ``graph_check`` may say (`gact_graph.sparse.adjacency_cache`).
GRAPH_CHECKS = ("forward", "version")
#: Optimization levels (GACT/ActNN style). L0: off. L1: compression. L2: L1 + swap of compressed
#: tensors to pinned CPU memory. CB1: L1 + activation checkpointing with compressed segments.
OPT_LEVELS = ("L0", "L1", "L2", "CB1")
#: Units ``memory_budget`` strings may use, in bytes (SI and binary prefixes).
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """Bytes of ``value``: an int, or a string such as ``"16GiB"``, ``"512MB"``, ``"1.5 GB"``
    (B, KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024)."""
    if isinstance(value, bool):
        raise TypeError(
            f"memory_budget must be bytes (int) or a string like '16GiB', got {value!r}"
        )
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        text = value.strip().replace(" ", "").lower()
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits) :] or "b"
        try:
            number = float(digits)
        except ValueError:
            number = float("nan")
        if unit not in _BYTE_UNITS or not number == number:
            raise ValueError(
                f"memory_budget {value!r} is not a size: use bytes (int) or a number with one of "
                f"{sorted(_BYTE_UNITS, key=_BYTE_UNITS.get)} (case-insensitive), e.g. '16GiB'"
            )
        if number in (float("inf"), float("-inf")):
            raise ValueError(f"memory_budget {value!r} is not a finite size")
        n = int(number * _BYTE_UNITS[unit])
    else:
        raise TypeError(
            f"memory_budget must be bytes (int) or a string like '16GiB', got {value!r}"
        )
    if n <= 0:
        raise ValueError(f"memory_budget must be positive, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``'1.50 GiB'``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


#: How ``adaptive=True`` chooses bits per tensor: ``"adaptive"`` spends an average budget of
#: ``bits`` (GACT); ``"acgc"`` meets a bound on the added gradient variance (AC-GC).
POLICIES = ("adaptive", "acgc")


@dataclass
class CompressionConfig:
    """What `compress_gnn` does to a model.

    Args:
        bits: bits per activation element. With ``adaptive=False`` every compressed tensor gets
            exactly this many bits (1, 2, 4 or 8). With ``adaptive=True`` it is the *average*
            budget (any number in [1, 8]) that the adaptive allocator spends. ``None`` or ``32``
            stores every saved tensor losslessly (graph-aware paths and deduplication stay on);
            that mode proves the graph-aware paths exact.
        adaptive: choose bits per tensor from measured gradient sensitivity (GACT).
        group_size: elements per quantization group (ActNN's G); groups follow rows.
        min_numel: float tensors smaller than this are kept as they are (group metadata and
            kernel launches would cost more than they save).
        seed: base seed of the stochastic rounding; each saved tensor of each step derives its
            own seed from it, so a run is reproducible.
        sparse: run known PyG convolutions through graph-aware fused paths.
        pointwise: save 1-bit masks / regenerate dropout for pointwise ops.
        opt_level: one of ``OPT_LEVELS``.
        adapt_interval: steps between re-estimations of sensitivity (``None``: the schedule
            decides, backing off as sensitivities settle).
        memory_budget: the most memory a training step may use (bytes, or a string such as
            ``"16GiB"``/``"512MB"``); ``None`` (default) plans nothing. A planner
            (`gact_graph.budget`) then chooses per saved tensor keep / compress at b bits /
            recompute / swap so that the predicted peak fits and the step is fastest.
        policy: one of ``POLICIES``, how ``adaptive=True`` chooses bits. ``"acgc"``
            (`gact_graph.policy.acgc`) gives each tensor the fewest bits such that the gradient
            variance compression adds stays below ``loss_bound`` times the gradient's measured
            squared norm (AC-GC: the loss bound grows by at most ``1 + loss_bound``); ``bits``
            is then only the width of the steps before the first estimate.
        loss_bound: AC-GC's :math:`e^2` (> 0), required by ``policy="acgc"`` and read by
            nothing else.
    """

    bits: float | None = 2
    adaptive: bool = True
    group_size: int = 256
    min_numel: int = 2048
    seed: int = 0
    sparse: bool = True
    pointwise: bool = True
    opt_level: str = "L1"
    adapt_interval: int | None = None
    memory_budget: int | str | None = None
    policy: str = "adaptive"
    loss_bound: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("adaptive", "sparse", "pointwise"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.extra, dict):
            raise TypeError(f"extra must be a dict of options, got {self.extra!r}")
        unknown = sorted(set(self.extra) - set(EXTRA_OPTIONS))
        if unknown:
            words = [f.name for f in fields(self) if f.name != "extra"] + list(EXTRA_OPTIONS)
            said = ", ".join(
                f"{k!r}" + "".join(f" (did you mean {h!r}?)" for h in close(k, words, n=1))
                for k in unknown
            )
            raise TypeError(
                f"compress_gnn() got unexpected keyword argument(s) {said}; the options are "
                f"the named arguments and {sorted(EXTRA_OPTIONS)}"
            )
        for name, value in self.extra.items():
            problem = _option_error(name, value)
            if problem is not None:
                raise ValueError(problem)
        action = self.extra.get("on_divergence", "rescue")
        if not isinstance(action, str) or action not in ON_DIVERGENCE:
            raise ValueError(f"on_divergence must be one of {ON_DIVERGENCE}, got {action!r}")
        check = self.extra.get("graph_check", "forward")
        if not isinstance(check, str) or check not in GRAPH_CHECKS:
            raise ValueError(f"graph_check must be one of {GRAPH_CHECKS}, got {check!r}")
        if self.bits == 32:
            self.bits = None
        if self.bits is not None:
            if isinstance(self.bits, bool) or not isinstance(self.bits, (int, float)):
                raise TypeError(f"bits must be a number or None, got {self.bits!r}")
            if self.adaptive:
                if not 1 <= self.bits <= 8:
                    raise ValueError(
                        f"adaptive bits is an average budget in [1, 8], got {self.bits}"
                    )
            else:
                if self.bits not in FIXED_BITS:
                    raise ValueError(
                        f"fixed bits must be one of {FIXED_BITS} (or None/32 for lossless), "
                        f"got {self.bits}; use adaptive=True for a fractional average"
                    )
                self.bits = int(self.bits)
        if not isinstance(self.group_size, int) or self.group_size < 8 or self.group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8, got {self.group_size}")
        if (
            isinstance(self.min_numel, bool)
            or not isinstance(self.min_numel, int)
            or self.min_numel < 0
        ):
            raise ValueError(f"min_numel must be a non-negative int, got {self.min_numel!r}")
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"opt_level must be one of {OPT_LEVELS}, got {self.opt_level!r}")
        if self.adapt_interval is not None and (
            isinstance(self.adapt_interval, bool)
            or not isinstance(self.adapt_interval, int)
            or self.adapt_interval < 1
        ):
            raise ValueError(
                f"adapt_interval must be a positive int or None, got {self.adapt_interval!r}"
            )
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget)  # raises, naming the problem
        self._check_policy()

    def _check_policy(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy != "acgc":
            if self.loss_bound is not None:
                raise ValueError(
                    f"loss_bound={self.loss_bound!r} is read only by policy='acgc' "
                    f"(policy is {self.policy!r})"
                )
            return
        if self.loss_bound is None:
            raise ValueError(
                "policy='acgc' needs loss_bound=e2 (> 0): the allowed gradient variance added "
                "by compression, as a fraction of the gradient's own (e.g. 0.1)"
            )
        if isinstance(self.loss_bound, bool) or not isinstance(self.loss_bound, (int, float)):
            raise TypeError(f"loss_bound must be a number, got {self.loss_bound!r}")
        if not (self.loss_bound > 0 and self.loss_bound != float("inf")):
            raise ValueError(f"loss_bound must be finite and > 0, got {self.loss_bound}")
        if not self.adaptive:
            raise ValueError(
                "policy='acgc' chooses bits per tensor; adaptive=False (the same bits for "
                "every tensor) contradicts it"
            )
        if self.lossless:
            raise ValueError(
                "policy='acgc' bounds the error of compression, but bits=None/32 or "
                "opt_level='L0' compresses nothing; give bits (the width before the first "
                "estimate, e.g. 8)"
            )

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memory_budget`` in bytes (None: no budget)."""
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)

    @property
    def lossless(self) -> bool:
        """True when nothing is quantized (bits None/32, or opt level L0)."""
        return self.bits is None or self.opt_level == "L0"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
