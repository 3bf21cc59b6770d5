"""What the adaptive allocator's sensitivity probe adds to a step's peak, bounded from what the
profile step saw (CPU), so that the probe runs in a planned step only where it fits the budget.

The probe (`gact_graph.policy.sensitivity`) holds, beyond what the same step holds without it:

- **kept until its estimate**: per compressed 2-D tensor, the per-row non-zero counts the
  closed form needs (`nonzero_counts`: at most a 4-byte count per row and group) and two
  factors per tensor (`rounding_variance_factors`);
- **in the forward, at each pack**: the temporaries of `rounding_variance_factors` on a sample
  of at most `SAMPLES` elements (`SAMPLE_BYTES` per sampled element at most), added to what
  the forward holds at that moment, at most its peak;
- **in the backward, at a node that reads a compressed tensor**: nothing beyond a few row
  vectors where the node is a matmul whose ``mat2`` is a parameter (the closed form,
  `matmul_kind` exact); where ``mat2`` is computed from parameters (GAT's attention vector),
  one ``mat2``-sized draw and a partial backward over parameter-sized tensors; elsewhere a
  replay: the node's dequantized reads kept past the node (the noise is added in place, or to
  a copy for a tensor kept in fp32: `READ_COPIES` per read), the replay's outputs (gradients
  of the node's inputs, bounded by the largest read), and the per-parameter float64
  accumulators (`ACC_COPIES` fp32 copies of the parameters). All of it on top of what the
  user's backward holds while that node runs, and of the replay's own run of the node's
  backward (under `lean_backward`): the node's rise in the profile step, or, where its
  Function states a bound of that lean backward from its shapes and the layouts of the
  compressed tensors the node read (``lean_backward_bytes``, e.g.
  `gact_graph.sparse.gat.GatAttentionFunction`, `GatV2AttentionFunction`, the inverted
  activations of `gact_graph.ops.inverted`) and the bound is less, the bound, plus the
  unpacking of the packed masks the node read (`mask_unpack_bytes`: ELU's branch
  indicator), which the replay unpacks inside the node;
- **the walk** that carries a replay's differences to the parameters, later in the backward:
  the differences (one gradient the size of the largest read) and the accumulators, on top of
  what a later node's backward holds while it runs (the walk runs a node's backward again,
  no more than the user's backward of that node holds: its profiled rise, or, where its
  Function states a bound of its lean backward with every compressed read handed as the walk
  hands it (``walk=True``; GAT's and GATv2's read them in parts) and the bound is less than
  the node's own part of its rise, the bound beside the rest of the node's window).

`BackwardReads` records, in the profile step (every tensor at 1 bit, so every candidate is
compressed), per autograd node that reads compressed tensors: the bytes live when it first
reads one, how far the live bytes rose until the next node's first read (the node's own
backward, split where it returns: a post-hook), and what it read. `probe_need` turns those
into the bound against the profile step's own peak: a node's probe work counts only by how
far it exceeds that peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gact_graph.core.quantize import PackedMask, QTensor
from gact_graph.policy.probe_estimates import matmul_kind
from gact_graph.policy.rounding import CHUNK_ELEMS, MAX_CHUNKS, chunk_elems

__all__ = [
    "BackwardReads",
    "NodeReads",
    "forward_work",
    "mask_unpack_bytes",
    "probe_need",
    "probe_terms",
    "SAMPLES",
    "SAMPLE_BYTES",
]

#: elements `rounding_variance_factors` samples per tensor (its default)
SAMPLES = 16384
#: bytes of temporaries per sampled element it holds at once at most (int64 indices, row,
#: column and group ids, fp32 gathers and their products)
SAMPLE_BYTES = 96
#: fp32 copies of a read the replay may hold: the dequantized copy kept past the node, and for
#: a tensor a plan keeps in fp32, the noisy clone and its 8-bit quantization
READ_COPIES = 1.5
#: fp32 copies of the parameters the probe's float64 accumulators hold at once (a sum and
#: the addition's result)
ACC_COPIES = 4
#: `noise_work`: bytes per element of a noise chunk (int8 sign 1, its fp32 copy 4, fp32
#: scale 4, non-zero mask 1, a dtype copy of the noise 4), per row of it (int64 row index,
#: its group index, the gathered fp32 step and its copy), per group (fp32 range and step,
#: their finiteness masks, the masked copies, the scaled step), and per element of a block of
#: the reference quantizer (its temporaries, about 13 bytes an element, with room)
NOISE_BYTES, NOISE_ROW_BYTES, NOISE_GROUP_BYTES, QUANTIZE_BYTES = 14, 24, 48, 16
#: elements of the reference quantizer's block (`gact_graph.kernels.quantize.CHUNK_ELEMS`)
QUANTIZE_BLOCK = 1 << 18


@dataclass
class NodeReads:
    """One autograd node's reads of compressed tensors in the profile step's backward."""

    live: int  # bytes live when it first read one
    rise: int = 0  # how far the live bytes rose above ``live`` until the next node's read
    replayed: list[int] = field(default_factory=list)  # bytes (fp32) of reads it replays
    closed: int = 0  # bytes the closed forms hold (row vectors, mat2-sized draws)
    partial: bool = False  # a closed form that carries a draw to parameters (not exact)
    lean: int | None = None  # what its Function states its lean backward holds at most
    noise: int = 0  # what making a replay's noisy copy holds at most (`noise_work`)
    layouts: list = field(default_factory=list)  # group layouts of its compressed reads
    own: int | None = None  # how far they rose until its backward returned (None: not seen)
    tail: int = 0  # how far they rose (above ``live``) from then until the next node's read
    walk: int | None = None  # what its Function states its backward holds in the walk

    def replay_rise(self) -> int:
        """What the replay rises by at most besides its copies and outputs: the profiled
        rise, or, for a node whose Function states a bound of its backward under
        `lean_backward` for the compressed reads it made (the replay hands the replayed one
        as its own copy, the others as they are read there: `_stated_lean_bytes`), that
        bound or the noisy copy's making (before the backward runs) where either is more,
        if that is less."""
        if self.lean is None:
            return self.rise
        return min(self.rise, max(self.lean, self.noise))

    def walk_rise(self) -> int:
        """What the probe's walk rises by at most when it runs this node again (its
        compressed reads handed as the walk hands them, under `lean_backward`) or the nodes
        after it until the next node's read: the profiled rise, or, where the node's own
        part of it was seen (`BackwardReads` ends it at the node's post-hook) and its
        Function states a bound of its backward in the walk, that bound where less than its
        own part, beside the rest of the window."""
        if self.own is None or self.walk is None:
            return self.rise
        return max(min(self.own, self.walk), self.tail)


class BackwardReads:
    """Per node, what the profile step's backward read (see the module docstring); ``live``
    is the profile step's `LiveBytes`. `read` is called from the controller's unpack."""

    def __init__(self, params: list[torch.Tensor], live) -> None:
        self._param_ids = {id(p) for p in params if p.requires_grad}
        self._live = live
        self.nodes: list[NodeReads] = []
        self._node: object | None = None
        self._ends = None  # the current node's post-hook (`_ended_hook`)
        #: nodes that read a stored tensor whose unpack allocates besides their compressed
        #: reads: a replay of theirs does that inside the node, so no stated bound is used
        self._unpacking: set[int] = set()
        #: per node, what unpacking the packed masks it read makes (`mask_unpack_bytes`): a
        #: replay unpacks them inside the node, on top of what its Function states
        self._masks: dict[int, int] = {}
        #: the forward's packs: the most bytes live after a compressed tensor's pack plus
        #: what the probe's work on it holds then (`forward_work`)
        self.forward = 0

    def packed(self, stored) -> None:
        payload = getattr(stored, "payload", None)
        if getattr(stored, "kind", None) == "activation" and isinstance(payload, QTensor):
            numel = math.prod(payload.shape)
            self.forward = max(self.forward, self._live.bytes + forward_work(numel))

    def read(self, stored) -> None:
        node = torch._C._current_autograd_node()
        payload = getattr(stored, "payload", None)
        what = getattr(stored, "kind", None)
        if node is None:
            return
        if what != "activation" or not isinstance(payload, QTensor):
            if isinstance(payload, PackedMask):  # e.g. ELU's indicator: a known unpack
                self._masks[id(node)] = self._masks.get(id(node), 0) + mask_unpack_bytes(
                    payload.numel()
                )
            elif not isinstance(payload, torch.Tensor):  # its unpack makes a tensor (a swap)
                self._unpacking.add(id(node))
            return
        live = self._live
        if node is not self._node:
            self.close()
            # only this node's masks can still be read with its compressed reads
            self._masks = {id(node): self._masks.get(id(node), 0)}
            self._node = node
            self.nodes.append(NodeReads(live.bytes))
            live.mark()
            try:  # a node that takes no hook keeps its whole window (``own`` stays None)
                self._ends = node.register_hook(self._ended_hook(id(node), self.nodes[-1]))
            except (AttributeError, RuntimeError, TypeError):
                self._ends = None
        rec = self.nodes[-1]
        # a matrix's layout (what a Function reading it in parts reads); None for another
        # shape, which no Function reads in parts
        rec.layouts.append(payload.layout if len(payload.shape) == 2 else None)
        shape = tuple(payload.shape)
        full = math.prod(shape) * 4
        kind = _closed_form(node, shape, self._param_ids)
        if kind is None:
            rec.replayed.append(full)
            rec.noise = max(rec.noise, noise_work(payload))
        elif kind[1]:  # exact: squared row norms and row variances, float32 and float64
            rec.closed += 32 * shape[0] * max(1, payload.layout.groups_per_row)
        else:  # a mat2-sized draw, row chunks of noise, carried to the parameters
            rec.closed += 2 * _mat2_bytes(node, kind) + 8 * shape[-1] * 64
            rec.partial = True

    def _ended_hook(self, node_id: int, rec: NodeReads):
        """The post-hook that splits the window of the node ``node_id`` where its backward
        returns: its own rise (``rec.own``), then the rest (``rec.tail``). Not where another
        node's read already ended the window (a nested backward inside the node). It holds
        the node's id, not the node (no reference cycle through the node's hooks)."""

        def hook(grad_inputs, grad_outputs):
            if id(self._node) == node_id and self.nodes and self.nodes[-1] is rec:
                rec.own = max(0, self._live.since_mark() - rec.live)
                self._live.mark()

        return hook

    def close(self) -> None:
        """End the current node's window (the next node reads, or the step ends), and ask
        its Function for its stated bounds, now that its reads are known (none for a node
        that also read a stored tensor whose unpack allocates: a replay of it does that
        inside the node)."""
        if self._node is not None and self.nodes:
            rec = self.nodes[-1]
            after = max(0, self._live.since_mark() - rec.live)
            if rec.own is None:
                rec.rise = after
            else:
                rec.tail = after
                rec.rise = max(rec.own, after)
            if id(self._node) not in self._unpacking:
                masks = self._masks.get(id(self._node), 0)
                rec.lean = _plus(_stated_lean_bytes(self._node, rec.layouts), masks)
                rec.walk = _plus(_stated_lean_bytes(self._node, rec.layouts, walk=True), masks)
        if self._ends is not None:
            self._ends.remove()
            self._ends = None
        self._node = None


def mask_unpack_bytes(numel: int) -> int:
    """What unpacking a mask of ``numel`` elements packed at 1 bit makes at most
    (`gact_graph.kernels.bitpack.PackedMask.unpack`): the packed bytes widened to int32 for
    the table look-up beside the looked-up bytes (eight a packed byte), of which the mask is
    a view, and the look-up table's making (two int32 256 x 8 tables and the uint8 one kept;
    at the first unpack, then cached)."""
    return 12 * -(-numel // 8) + 256 * 8 * 9


def _plus(stated: int | None, extra: int) -> int | None:
    return None if stated is None else stated + extra


def _stated_lean_bytes(node, layouts: list, walk: bool = False) -> int | None:
    """The bound a custom autograd Function's node states of its backward under
    `lean_backward` in the probe's replay of one of its compressed reads, or with ``walk``
    in the probe's walk through it (every compressed read handed as the walk hands it): a
    ``lean_backward_bytes(ctx, layouts, walk=False)`` static method, ``layouts`` the group
    layouts of the compressed tensors the node read, in order (e.g.
    `gact_graph.sparse.gat.GatAttentionFunction`, `GatV2AttentionFunction`); or None: the
    Function states none, or none for those reads (a run that would dequantize a read
    whole inside the node)."""
    stated = getattr(getattr(node, "_forward_cls", None), "lean_backward_bytes", None)
    if stated is None:
        return None
    bound = stated(node, list(layouts), walk=walk)
    return None if bound is None else int(bound)


def _closed_form(node, shape: tuple[int, ...], param_ids: set[int]) -> tuple[int, bool] | None:
    """What the probe's closed form makes of ``node`` reading a tensor of ``shape``
    (`matmul_kind`, and the tensor is ``mat1``, unambiguously), or None: it is replayed."""
    kind = matmul_kind(node, param_ids)
    if kind is None or len(shape) != 2:
        return None
    try:
        if kind[0] == 1:
            mat1, mat2 = node._saved_self_sym_sizes, node._saved_mat2_sym_sizes
        else:
            mat1, mat2 = node._saved_mat1_sym_sizes, node._saved_mat2_sym_sizes
    except AttributeError:
        return None
    mat1, mat2 = tuple(int(v) for v in mat1), tuple(int(v) for v in mat2)
    if mat1 == mat2 or mat1 != shape:
        return None
    if not kind[1] and math.prod(mat2) > math.prod(mat1):
        return None  # the probe replays it instead
    return kind


def _mat2_bytes(node, kind: tuple[int, bool]) -> int:
    sizes = node._saved_mat2_sym_sizes
    return 4 * math.prod(int(v) for v in sizes)


def noise_work(q: QTensor) -> int:
    """What the replay's noisy copy of a read quantized as ``q`` holds at once while it is
    made, before the node's backward runs: `add_rounding_noise_` per row chunk (`row_ranges`
    of `chunk_elems`) an int8 sign, its fp32 copy, the fp32 per-element scale, the non-zero
    mask and a dtype copy (`NOISE_BYTES` an element), the chunk's row indices and their
    gathered steps (`NOISE_ROW_BYTES` a row) and per group its range, finiteness masks and
    step (`NOISE_GROUP_BYTES`); for a tensor the plan keeps in fp32, its 8-bit quantization
    (`QUANTIZE_BYTES` per element of a reference block, `gact_graph.kernels.quantize`) and
    the variance factor's sample (`SAMPLE_BYTES` per sampled element), one after another."""
    lay = q.layout
    numel = math.prod(q.shape)
    cols = max(1, lay.cols)
    chunk = min(numel, max(chunk_elems(numel), lay.rows_per_group * cols))
    noise = NOISE_BYTES * chunk + NOISE_ROW_BYTES * (chunk // cols + 1)
    noise += NOISE_GROUP_BYTES * lay.num_groups
    eight = QUANTIZE_BYTES * min(numel, QUANTIZE_BLOCK)
    return max(noise, eight, SAMPLE_BYTES * min(SAMPLES, numel))


def forward_work(numel: int) -> int:
    """What the probe's work at the pack of a compressed tensor of ``numel`` elements holds at
    once: the sample's temporaries, or the non-zero counts' row chunk (a mask, its padding)."""
    sampled = SAMPLE_BYTES * min(SAMPLES, numel)
    chunk = 2 * min(numel, max(CHUNK_ELEMS, -(-numel // MAX_CHUNKS)))
    return max(sampled, chunk)


def probe_terms(
    reads: BackwardReads, *, step_peak: int, param_bytes: int
) -> tuple[float, list[tuple[float, float | None]]]:
    """The terms of `probe_need`, each against the profile step's peak ``step_peak``: the
    forward's (its work at a pack), and per node its work at its read (a replay, or a closed
    form's) and the walk's from it (None where the node is not replayed)."""
    acc = ACC_COPIES * param_bytes
    nodes = reads.nodes
    # from each node on (the walk runs at a later node's pre-hook, the nodes below again):
    # the most bytes live at a node's first read, and the most a node's backward rose
    live_on, rise_on = [0] * (len(nodes) + 1), [0] * (len(nodes) + 1)
    for i in range(len(nodes) - 1, -1, -1):
        live_on[i] = max(live_on[i + 1], nodes[i].live)
        rise_on[i] = max(rise_on[i + 1], nodes[i].walk_rise())
    terms: list[tuple[float, float | None]] = []
    for i, n in enumerate(nodes):
        work = n.closed + (acc if n.partial else 0)
        walk = None
        if n.replayed:
            work += READ_COPIES * sum(n.replayed) + max(n.replayed) + acc
            walk = live_on[i] + rise_on[i] + max(n.replayed) + acc - step_peak
        replay = n.live + n.replay_rise() + work - step_peak
        terms.append((replay, walk))
    return reads.forward - step_peak, terms


def probe_need(reads: BackwardReads, *, step_peak: int, kept: int, param_bytes: int) -> int:
    """The probe's bound over the profile step's peak ``step_peak`` (see the module
    docstring): ``kept`` (what it keeps until its estimate) plus the most by which its work
    at a pack, at a read or in the walk exceeds ``step_peak`` (`probe_terms`)."""
    forward, terms = probe_terms(reads, step_peak=step_peak, param_bytes=param_bytes)
    over = max([forward, *(t for pair in terms for t in pair if t is not None)])
    return int(kept + max(0, over))
