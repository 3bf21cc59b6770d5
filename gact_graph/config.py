"""The one configuration object of `compress_gnn`, validated when it is made."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CompressionConfig", "FIXED_BITS", "OPT_LEVELS"]

#: Bit widths that the quantizer packs densely (see `gact_graph.core.quantize`).
FIXED_BITS = (1, 2, 4, 8)
#: Optimization levels (GACT/ActNN style). L0: off. L1: compression. L2: L1 + swap of compressed
#: tensors to pinned CPU memory. CB1: L1 + activation checkpointing with compressed segments.
OPT_LEVELS = ("L0", "L1", "L2", "CB1")


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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
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
        if not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {self.min_numel}")
        if self.opt_level not in OPT_LEVELS:
            raise ValueError(f"opt_level must be one of {OPT_LEVELS}, got {self.opt_level!r}")
        if self.adapt_interval is not None and (
            not isinstance(self.adapt_interval, int) or self.adapt_interval < 1
        ):
            raise ValueError(f"adapt_interval must be a positive int, got {self.adapt_interval}")

    @property
    def lossless(self) -> bool:
        """True when nothing is quantized (bits None/32, or opt level L0)."""
        return self.bits is None or self.opt_level == "L0"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
