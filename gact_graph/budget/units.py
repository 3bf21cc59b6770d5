"""The profile model: what a profile step measured, turned into the planner's units and
their options (keep, compress at b bits, swap, recompute), with each option's resident
bytes, recompute rise, (de)compression seconds and added gradient variance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gact_graph.budget.planner import Option, Unit
from gact_graph.budget.profile import TensorInfo, compressed_bytes
from gact_graph.config import FIXED_BITS
from gact_graph.policy.sensitivity import S

__all__ = ["SWAP_MIN_BYTES", "build_units", "ladder"]

#: Payloads below this many bytes are never swapped (copies cost more than they free).
SWAP_MIN_BYTES = 1 << 16


def ladder(known: bool, lossless: bool, default_bits: int) -> list[int]:
    """The widths a unit may take: down to 1 bit where its sensitivity is known (or the
    accuracy bound is relaxed), else down to the default width; 32 is fp32."""
    if lossless:
        return [32]
    floor = min(FIXED_BITS) if known else default_bits
    return [b for b in FIXED_BITS if b >= floor] + [32]


def build_units(
    tensors: list[TensorInfo],
    relaxed: bool,
    *,
    c: dict[str, float],
    timer: Any,
    swap: Any,
    segments: list[str],
    segment_of: Callable[[str], str | None],
    in_segment: Callable[[TensorInfo], bool],
    inner_of: dict[str, list[TensorInfo]],
    referenced: dict[str, set[str]],
    recompute_seconds: dict[str, float],
    recompute_rise: dict[str, int],
    shared: dict[int, int],
    lossless: bool,
    default_bits: int,
    group_size: int,
) -> tuple[list[Unit], int]:
    """The units and the bytes no option changes. ``tensors``: the profile step's saved
    tensors; ``relaxed``: every unit may go down to 1 bit (what the accuracy bound forbids
    for tensors without an estimate); ``c``: sensitivities per tensor name; ``timer``: the
    `CodecTimer`; ``swap``: the `SwapManager` or None (no swap options); ``segments`` and
    ``segment_of``/``in_segment``: the CB1 segments and which tensors one segment alone
    saves; ``inner_of``, ``referenced``, ``recompute_seconds``, ``recompute_rise``: what a
    recompute profile measured per segment (what it saves inside, which inputs it saves again,
    its recompute time and live-byte rise); ``shared``: storages segments keep by reference,
    counted once."""

    def held_bytes(t: TensorInfo, bits: int) -> int:
        return t.orig_bytes if bits >= 32 else compressed_bytes(t.shape, bits, group_size)

    def widths(known: bool) -> list[int]:
        return ladder(known, lossless, default_bits)

    fixed = 0
    units: list[Unit] = []
    seg_inputs: dict[str, list[TensorInfo]] = {s: [] for s in segments}
    fixed += sum(shared.values())
    for t in tensors:
        if in_segment(t):  # saved by (for) this segment alone
            seg_inputs[segment_of(t.name.rsplit("#", 1)[0])].append(t)
            continue
        if not t.quantizable:
            fixed += t.fixed_bytes
            continue
        options = []
        for b in widths(relaxed or t.name in c):
            mode = "keep" if b >= 32 else "compress"
            sec = timer.seconds(t.shape, b)
            var = c.get(t.name, 0.0) * S(b)
            options.append(Option(mode, b, held_bytes(t, b), 0, sec, var))
            held = held_bytes(t, b)
            if swap is not None and b < 32 and held >= SWAP_MIN_BYTES:
                options.append(Option("swap", b, 0, held, sec, var))
        units.append(Unit(t.name, "tensor", options, t.orig_bytes))
    for seg in segments:
        ins, inner = seg_inputs[seg], inner_of.get(seg, [])
        if not ins and not inner:
            continue
        q_in = [t for t in ins if t.quantizable]
        q_inner = [t for t in inner if t.quantizable]
        fixed_in = sum(t.fixed_bytes for t in ins)
        fixed_inner = sum(t.fixed_bytes for t in inner)
        again = referenced.get(seg, set())
        low = 32 if lossless else min(FIXED_BITS)  # the profile step's width
        known = bool(q_in) and not q_inner and all(t.name in c for t in q_in)
        options = []
        for b in widths(relaxed or known):
            held_in = sum(held_bytes(t, b) for t in q_in) + fixed_in
            held_inner = sum(held_bytes(t, b) for t in q_inner) + fixed_inner
            held_again = sum(held_bytes(t, b) for t in ins if t.name in again)
            sec = sum(timer.seconds(t.shape, b) for t in q_in + q_inner)
            var = sum(c.get(t.name, 0.0) * S(b) for t in q_in)
            mode = "keep" if b >= 32 else "compress"
            if seg not in recompute_seconds:  # not recomputed: what it saved is all
                held_inner, held_again = 0, held_in
            options.append(Option(mode, b, held_inner + held_again, 0, sec, var))
            if seg in recompute_seconds:
                redo = recompute_seconds[seg]
                rise = held_inner
                if seg in recompute_rise:  # measured: inputs restored, fp32 inside
                    profiled = sum(held_bytes(t, low) for t in q_inner) + fixed_inner
                    rise = max(held_inner, recompute_rise[seg] - profiled + held_inner)
                options.append(Option("recompute", b, held_in, rise, sec + redo, var))
        orig = sum(t.orig_bytes for t in ins + inner)
        units.append(Unit(seg, "segment", options, orig))
    return units, fixed
