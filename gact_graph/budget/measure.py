"""Step measuring: the figures a finished profile step yields from its meters
(`profile_figures`), what a recomputed segment saved again (`segment_tensors`), and the
lower bound a profile step's forward checks from its shapes (`forward_lower_bound`).
`BudgetPlanner` owns the meters and the ledger and passes them in."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gact_graph.budget.profile import LiveBytes, PeakBytes, TensorInfo, compressed_bytes
from gact_graph.core.meter import StepMeter

__all__ = [
    "LowerBound",
    "MeasuredProfile",
    "forward_lower_bound",
    "profile_figures",
    "segment_tensors",
]


@dataclass(frozen=True)
class MeasuredProfile:
    """What a profile step's meters say (see `select_plan`'s figures): ``growth``, ``outside``,
    ``profile_peak``, ``correction`` and ``whole``; ``carried`` what a later step starts with
    beyond what existed before this one (CPU: the ledger at its start and what it created
    after its peak)."""

    growth: int | None
    outside: int | None
    profile_peak: int | None
    correction: int
    whole: int | None
    carried: int


def profile_figures(
    live: LiveBytes | None,
    meter: StepMeter,
    peak: int | None,
    measured: int | None,
    *,
    cuda: bool,
    rest: int,
    base: int | None,
    static: int,
    ledger_start: int,
    ledger: dict[int, tuple[Any, int]],
    trusted: bool,
    carried: int,
    dropped: Iterable[int] = (),
) -> MeasuredProfile:
    """The figures of a profile step just ended: ``live`` its counted meter (CPU; None where
    none ran), ``meter`` its device meter with ``peak`` and ``measured`` read from it,
    ``rest`` what existed before it, ``base`` what the process held before training,
    ``static`` the parameters', buffers' and inputs' bytes, ``ledger_start`` the ledger's
    bytes alive at its start, ``ledger`` the counted meter's ledger (what it created and
    still holds is added to it), ``trusted`` whether the device's meter seeds the
    correction, ``carried`` the carried bytes so far (kept where no counted meter ran),
    ``dropped`` the storage addresses alive now that a later step drops before its peak (the
    parameters' gradients, which ``zero_grad()`` sets to None): not carried."""
    growth = outside = None
    once_only = 0  # what once-per-graph work added to the step's counted peak (CPU)
    alive_all = None
    if live is not None:
        growth, outside = live.repeated_peak, live.outside_peak
        once_only = live.peak - live.repeated_peak
        # a later step starts with what earlier steps left alive (the ledger: the optimizer
        # state, PyG's per-layer cached graphs of ``cached=True``) and what this one created
        # after its peak; a later profile step (a new shape, a recompute profile) does not
        # create the former again, yet starts with it
        carried = ledger_start + live.created_after_peak(dropped)
        for key, (ref, nbytes, _, _) in live._live.items():
            if not ref.expired():
                ledger[key] = (ref, nbytes)
        alive_all = PeakBytes(ledger).alive()
    elif peak is not None:
        growth = peak - meter.start
    profile_peak = None
    # the sensitivity probe's own tensors at the step's peak (CPU): later steps do not
    # probe, so what a later step at this setting holds leaves them out
    probe = 0 if outside is None else max(0, growth - outside)
    if cuda:
        profile_peak = peak
    elif growth is not None:
        # what a later step at this setting holds: it starts with the optimizer state this
        # step created after its peak
        profile_peak = rest + growth - probe + carried
    correction = 0
    if measured is not None and profile_peak is not None and trusted:
        # a trusted meter (the rectifier's) saw more than the tensors: what a CPU resident set
        # holds besides them (Python objects, the allocator) is there in every step, so the
        # first plan already counts it, and the profile step's own setting is admitted only
        # by what it really held (less the probe's tensors, which it held too). The resident
        # set's peak is the whole step's, once-per-graph work included: compared with the
        # whole step's count
        correction = max(0, measured - probe - once_only - profile_peak)
        now = meter.current()
        if now is not None and alive_all is not None and base is not None:
            # what the resident set keeps between steps beyond every live tensor (the C
            # allocator's retained chunks): later steps start with it, the first did not
            retained = now - base - static - alive_all
            correction = max(correction, retained)
        profile_peak += correction  # at least the measured peak less probe and build
    # the step's own peak, probe and build included: a rerun's profile step does it all
    if cuda:
        whole = profile_peak  # max_memory_allocated: already the whole step's
    elif live is not None:
        whole = rest + ledger_start + live.peak
    else:
        whole = None if growth is None else rest + growth
    if whole is not None and measured is not None and trusted:
        whole = max(whole, measured)
    return MeasuredProfile(growth, outside, profile_peak, correction, whole, carried)


def segment_tensors(
    segment: Any, store: dict, referenced: set[str], shared: dict[int, int]
) -> tuple[list[TensorInfo], int]:
    """What a segment's recomputation saved again (``store``), as `TensorInfo`, and their
    stored bytes; the segment's own inputs go to ``referenced`` (by name: a stored segment
    holds those itself) and tensors it keeps by reference (the shared adjacency's indices) to
    ``shared`` (storage address to bytes: counted once)."""
    inputs = {id(spec[1]) for spec in [*segment.args, *segment.kwargs.values()]}
    infos, held = [], 0
    for i, stored in store.items():
        if id(stored) in inputs:
            referenced.add(stored.name)
            continue
        if stored.kind in ("param", "input"):
            continue
        if isinstance(stored.payload, torch.Tensor) and stored.kind != "activation":
            storage = stored.payload.untyped_storage()  # kept by reference, e.g. indices
            shared[storage.data_ptr()] = storage.nbytes()
            continue
        shape = tuple(segment.meta[i][0])
        q = stored.kind == "activation" and stored.bits is not None
        infos.append(
            TensorInfo(stored.name, shape, stored.orig_bytes, q, 0 if q else stored.stored_bytes)
        )
        held += stored.stored_bytes
    return infos, held


@dataclass(frozen=True)
class LowerBound:
    """A lower bound on what any plan holds, from the forward's shapes: ``need`` =
    ``rest`` + ``saved`` (fixed bytes and every quantizable tensor at ``bits``) +
    ``backward`` (`forward_lower_bound`)."""

    need: int
    rest: int
    saved: int
    backward: int
    bits: int


def forward_lower_bound(
    tensors: list[TensorInfo],
    every: list[TensorInfo],
    metas: list[tuple],
    *,
    rest: int,
    trainable_bytes: int,
    min_numel: int,
    lossless: bool,
    group_size: int,
) -> LowerBound:
    """What a profile step's forward says any plan holds at least: ``tensors`` (the saved
    tensors a plan stores; of ``every`` saved tensor, the ones no recomputed segment may
    drop) at the least width, plus ``rest``, plus backward's least transient: the largest
    saved tensor (of ``every`` and of what segments save inside, ``metas``: shape, dtype,
    device) dequantized in fp32, and the trainable parameters' gradients
    (``trainable_bytes``; no optimizer is assumed)."""
    inner = []
    for shape, dtype, _device in metas:
        if dtype.is_floating_point and torch.Size(shape).numel() >= min_numel:
            inner.append(TensorInfo("", tuple(shape), torch.Size(shape).numel() * 4, True))
    low_bits = 32 if lossless else 1
    fixed = sum(t.fixed_bytes for t in tensors)
    held = sum(
        compressed_bytes(t.shape, low_bits, group_size) if low_bits < 32 else t.orig_bytes
        for t in tensors
        if t.quantizable
    )
    largest = max((t.orig_bytes for t in every + inner), default=0)
    floor = largest + trainable_bytes
    # no margin: the profile step's own setting is admitted at its measured peak, which this
    # bound may not exceed
    return LowerBound(rest + fixed + held + floor, rest, fixed + held, floor, low_bits)
