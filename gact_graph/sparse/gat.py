"""GAT / GATv2 attention that saves only node-level tensors for backward.

Stock PyG `GATConv` gathers ``x_j = x'[src]`` (E x H x C) and multiplies it by the attention
coefficients; autograd keeps that gather, the coefficients and the softmax intermediates alive
until backward. On an ogbn-arxiv-sized graph this edge-level state is most of what a 3-layer GAT
saves. Here the whole edge stage (logits, leaky-ReLU, segment softmax, attention dropout and
the weighted aggregation) is one `torch.autograd.Function` that saves

- the projected features ``x'`` (N x H x C; the controller compresses it like any activation),
- the per-node logits ``a_src = <x'_i, att_src>``, ``a_dst = <x'_i, att_dst>`` (N x H, small;
  the patcher asks the controller to keep them lossless, since a softmax of quantized logits
  would be far off),
- the destination-sorted CSR adjacency (shared by every layer, stored once),
- for attention dropout: the state of the default generator before the draw (a few KiB),
  from which backward regenerates the mask.

Backward recomputes the edge logits, the softmax and the dropout mask, and runs the
gather-multiply-scatter in chunks of edges, so no E x H x C tensor ever exists. GAT makes its
edge-level (E x H) quantities a chunk at a time too, from the softmax's per-destination max and
sum, so it holds no E x H tensor but the dropout's bool keep-mask and, in backward, the
coefficients' gradient. GATv2, whose logits each cost a gather, keeps its E x H logits whole
and makes the rest a chunk at a time. Each
chunk's temporaries (at most three chunk x H x C tensors alive at once) total at most
``chunk_bytes`` (64 MiB by default) and at most a quarter of one N x H x C tensor (not below
4 MiB).

**Attention dropout is stock's.** PyG draws ``F.dropout(alpha, p, training)`` on the E x H
coefficients in its own edge order (the input edges, self-loops removed, then one self-loop
per node appended). The Functions draw the very same way on the default generator of the
device (CPU: ``empty_like(alpha).bernoulli_(1 - p).div_(1 - p)``, as ATen's ``_dropout_impl``;
CUDA: ``native_dropout``, the fused kernel ATen picks there) into a fresh E x H tensor of
alpha's dtype in that order, and reorder it to CSR order with the adjacency's ``perm``. So the
mask, the output and the generator's state afterwards equal stock's under the same seed.
Backward replays the draw from the saved state (CPU: on a private generator; CUDA: on the
default one, the caller's state restored after), so the caller's RNG stream is never touched.
While a CUDA graph is being captured the state cannot be replayed, so the bool mask itself is
saved (1 bit per element once the controller packs it).

**Why the logits come from the layer's input.** Stock computes ``a_src = <W h_i, att_src>``
from the projected features ``x' = W h``. Here that would multiply two uses of the one
quantized ``x'`` in the gradient of ``att_src`` (``sum_i grad_a_src[i] * x'_i``, where
``grad_a_src`` itself is linear in the quantized ``x'`` through the aggregation): its
expectation gains the rounding variance of ``x'`` and the gradient is biased (the statistic
of tests/benchmarks/test_scale_deep.py; figures in docs/design.md). The patcher computes the
same logits as ``h @ (W^T att)``: ``h`` is the projection's own saved input, rounded
independently of ``x'`` (or exact), so every gradient is a product of independent unbiased
factors. Same values up to float rounding, no extra saved tensor but the H x F_in matrix
``W^T att``. A `GATConv` whose projection is not a bias-free ``Linear`` (replaced by the
user) takes PyG's path.

GAT's backward is linear in the saved ``x'`` (the softmax comes from the lossless logits), so
with stochastic rounding its gradient stays unbiased. GATv2 (``a(W x_i + W x_j)``) has no
node-level logit decomposition; its logits are computed in the same edge chunks in forward and
recomputed in chunks in backward, so it too saves only ``x_l``, ``x_r`` (N x H x C) and the
adjacency, but its backward is nonlinear in them: quantizing them biases its gradient (give
them more bits). Both backwards are differentiable once: a ``create_graph=True`` backward
raises at once, naming the settings that support it (`differentiable_once`).

**Two implementations of each edge stage.** `GatAttentionFunction` and
`GatV2AttentionFunction` are plain PyTorch, edge chunk by edge chunk: the CPU path and the
reference. `GatFusedFunction` and `GatV2FusedFunction` run the fused Triton kernels of
`gact_graph.kernels.gat_edge` (one pass over the CSR rows forward with an online softmax;
backward one pass over the rows and one over the transpose's rows, no atomics, no edge-level
tensor at all) and save the softmax's per-(node, head) max and sum, kept lossless, instead of
recomputing them. The patched `GATConv` and `GATv2Conv` take the kernels on CUDA tensors
(`fused_kernel_applies`, `EDGE_KERNEL`), the chunked stages elsewhere. The kernels draw
attention dropout themselves (Philox, from a seed tensor drawn on the device's generator, so
no host sync), which cannot equal stock's bits: in lossless mode (``bits=None``) a layer with
attention dropout in training keeps the chunked stage and stock's draw; compressed modes use
the kernels' draw. Its gradient is as unbiased as the chunked stage's (backward is linear in
``x'``; tests/sparse/test_sparse_gat.py runs the statistic on CUDA).

Under autocast the Functions behave like PyG's edge stage, which holds no op that autocast
lowers: the projections arrive in bf16/fp16 from autocast's ``Linear``, the logits and the
softmax are computed in fp32 and the output promotes like PyG's ``alpha * x_j`` (fp32). A
``backward()`` called inside the autocast region runs in the same dtypes (`gact_graph.sparse.amp`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parameter import is_lazy
from torch_geometric.nn import GATConv, GATv2Conv
from torch_geometric.nn.dense.linear import Linear as PygLinear

from gact_graph.kernels import force_triton, triton_available
from gact_graph.sparse.adjacency import get_adjacency
from gact_graph.sparse.amp import add_into, autocast_off
from gact_graph.sparse.differentiable_once import differentiable_once
from gact_graph.sparse.patching import install_forward, message_passing_reason, register_patcher
from gact_graph.switches import is_lean, package_work, reading_rows

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "EDGE_KERNEL",
    "GatAttentionFunction",
    "GatFusedFunction",
    "GatV2FusedFunction",
    "GatV2AttentionFunction",
    "gat_attention",
    "gat_attention_fused",
    "fused_kernel_applies",
    "gatv2_attention",
    "gatv2_attention_fused",
    "gat_attention_reference",
    "gatv2_attention_reference",
    "csr_destinations",
    "edge_chunk_size",
]

#: Bytes of the edge-chunk temporaries (chunk x H x C tensors) alive at once in the chunked
#: gather-scatter; ``compress_gnn(..., chunk_bytes=...)`` changes it (shared with `spmm`).
DEFAULT_CHUNK_BYTES = 64 * 2**20
#: Chunk x H x C tensors alive at once: two in GAT's backward, three in GATv2's.
_LIVE_CHUNK_TENSORS = 3
#: Chunks are never made smaller than this for the node-relative cap of `edge_chunk_size`
#: (a few large kernels per layer, not hundreds of small ones, on small graphs).
_MIN_CHUNK_BYTES = 4 * 2**20


# ---------------------------------------------------------------------------- helpers
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate half-precision inputs in fp32 (index_add_ over many edges loses bits)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def edge_chunk_size(
    num_edges: int,
    heads: int,
    channels: int,
    dtype: torch.dtype,
    chunk_bytes: int,
    num_nodes: int | None = None,
) -> int:
    """Edges per chunk so that the chunk temporaries alive at once (at most
    `_LIVE_CHUNK_TENSORS` tensors of chunk x heads x channels) total at most ``chunk_bytes``,
    and, given ``num_nodes``, at most a quarter of one N x H x C tensor (but not below
    `_MIN_CHUNK_BYTES`): on a small graph a fixed 64 MiB of chunks would be several times the
    layer's own features, the largest transient of its backward."""
    item = torch.finfo(_acc_dtype(dtype)).bits // 8
    per_edge = _LIVE_CHUNK_TENSORS * heads * channels * item
    budget = int(chunk_bytes)
    if num_nodes is not None:
        budget = min(budget, max(_MIN_CHUNK_BYTES, num_nodes * heads * channels * item // 4))
    return max(1, min(max(num_edges, 1), budget // max(per_edge, 1)))


def csr_destinations(rowptr: Tensor, num_edges: int) -> Tensor:
    """Destination of every edge of a destination-sorted CSR (int64, E): recomputed, never
    saved, because it costs one cheap pass and 8 bytes per edge to keep.

    Edge k lies in row i = #{rows that end at or before k}: a cumulative sum of row-end marks
    (faster than `repeat_interleave`, which has a large fixed cost on CPU)."""
    num_dst = rowptr.numel() - 1
    marks = torch.zeros(num_edges + 1, dtype=torch.int64, device=rowptr.device)
    marks.index_add_(0, rowptr[1:], torch.ones(num_dst, dtype=torch.int64, device=rowptr.device))
    return marks[:num_edges].cumsum_(0)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return torch.default_generator


def _dropout_mask(
    p: float,
    shape: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    saved: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Stock ``F.dropout(alpha, p, True)``'s draw for an alpha of ``shape`` and ``dtype`` on the
    default generator (``0 < p < 1``, nonempty), as a bool keep-mask in that alpha's order:
    ``(mask, what regenerates it)``. ``saved``: replay that draw; the caller's generator state
    is left as it was. Only the mask outlives the call (E x H bytes): the draw's dtype-sized
    input and output are freed at once."""
    gen = _default_generator(device)
    if saved is not None and saved.dtype == torch.bool:  # the mask itself (CUDA graph capture)
        return saved, saved
    if device.type == "cuda":  # native_dropout takes no generator: swap the state in and out
        capturing = saved is None and torch.cuda.is_current_stream_capturing()
        caller = None if capturing else gen.get_state()
        if saved is not None:
            gen.set_state(saved)
        try:
            _, mask = torch.native_dropout(torch.empty(shape, dtype=dtype, device=device), p, True)
        finally:
            if saved is not None:
                gen.set_state(caller)
        return mask, (mask if capturing else (saved if saved is not None else caller))
    if saved is None:
        state, draw_gen = gen.get_state(), None
    else:
        state, draw_gen = saved, torch.Generator(device=device)
        draw_gen.set_state(saved)
    noise = torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p, generator=draw_gen)
    mask = noise != 0
    del noise
    return mask, state


def _multiplier(mask: Tensor, p: float, dtype: torch.dtype) -> Tensor:
    """Stock dropout's multiplier from its keep-mask, bit for bit: ATen's CPU path divides the
    0/1 noise by ``1 - p``, CUDA's fused kernel multiplies by ``1 / (1 - p)``."""
    kept = mask.to(dtype)
    return kept.div_(1 - p) if mask.device.type == "cpu" else kept.mul_(1.0 / (1.0 - p))


def _attention_dropout(
    p: float,
    num_edges: int,
    heads: int,
    dtype: torch.dtype,
    device: torch.device,
    perm: Tensor | None,
    saved: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(keep-mask in CSR order or None, what to save)`` for attention dropout ``p`` as stock
    draws it: on an E x H alpha of ``dtype`` in stock's edge order (``perm``: CSR position ->
    stock position; None: the same order). ``saved``: replay in backward. ``p == 1`` draws
    nothing (ATen multiplies by a zero scalar) and gives a 0-dim stand-in, which
    `_chunk_multiplier` turns into that zero; otherwise `_multiplier` of a row range of the
    mask is what alpha's edges are multiplied by."""
    if p == 0.0 or num_edges * heads == 0:  # ATen returns alpha itself: nothing drawn
        return None, None
    shape = (num_edges, heads)
    if p == 1.0:  # ATen multiplies by a zero scalar: nothing drawn either
        return torch.zeros((), dtype=torch.bool, device=device), None
    mask, saved = _dropout_mask(p, shape, dtype, device, saved)
    if perm is not None:
        mask = mask.index_select(0, perm)
    return mask, saved


def _chunk_multiplier(mask: Tensor | None, p: float, dtype: torch.dtype, s: int, e: int):
    """The dropout multiplier of CSR edges ``s:e`` (None: no dropout)."""
    if mask is None:
        return None
    if p == 1.0:
        return torch.zeros((), dtype=dtype, device=mask.device)
    return _multiplier(mask[s:e], p, dtype)


def _leaky_relu_backward_(grad: Tensor, pre: Tensor, negative_slope: float) -> Tensor:
    """In place: grad * (pre > 0 ? 1 : slope), exactly as ATen's leaky_relu_backward."""
    return grad.mul_(_leaky_relu_slope(pre, negative_slope, grad.dtype))


def _leaky_relu_slope(pre: Tensor, negative_slope: float, dtype: torch.dtype) -> Tensor:
    """d leaky_relu(pre) / d pre: 1 where pre > 0, else the slope (exact in ``dtype``)."""
    return torch.full(pre.shape, negative_slope, dtype=dtype, device=pre.device).masked_fill_(
        pre > 0, 1.0
    )


def _check_common(x: Tensor, rowptr: Tensor, col: Tensor, p: float, perm: Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"projected features must be N x H x C, got shape {tuple(x.shape)}")
    if rowptr.dim() != 1 or col.dim() != 1:
        raise ValueError("rowptr and col must be 1-D (destination-sorted CSR)")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout must be in [0, 1], got {p}")
    if perm is not None and perm.shape != col.shape:
        raise ValueError("perm must hold one position per edge")
    if 0.0 < p < 1.0 and x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention dropout runs on CPU and CUDA only, not {x.device.type}")


# ---------------------------------------------------------------------------- GAT
def _gat_logits(
    a_src: Tensor, a_dst: Tensor | None, col: Tensor, dst: Tensor, acc: torch.dtype
) -> Tensor:
    logit = a_src.index_select(0, col).to(acc)
    if a_dst is not None:
        logit = logit.add_(a_dst.index_select(0, dst).to(acc))
    return logit


class _EdgeChunks:
    """Row ranges of a destination-sorted CSR cut into chunks of at most ``chunk`` edges, with
    each chunk's sources and destinations. The destinations are made per chunk (an int64 per
    edge of the chunk) rather than for every edge at once: on a graph of ogbn-products' size an
    E-long int64 vector is 0.9 GiB. One host sync per instance (the chunks' first rows)."""

    def __init__(self, rowptr: Tensor, col: Tensor, chunk: int) -> None:
        self.rowptr, self.col = rowptr, col
        self.num_edges = col.numel()
        self.chunk = max(1, chunk)
        self.starts = list(range(0, self.num_edges, self.chunk))
        ends = [min(s + self.chunk, self.num_edges) - 1 for s in self.starts]
        ends = torch.tensor(self.starts + ends, dtype=rowptr.dtype, device=rowptr.device)
        rows = (torch.searchsorted(rowptr, ends, right=True) - 1).tolist()
        self.rows = list(zip(rows[: len(self.starts)], rows[len(self.starts) :]))

    def __iter__(self):
        for s, (r0, r1) in zip(self.starts, self.rows):
            e = min(s + self.chunk, self.num_edges)
            yield s, e, self.col[s:e], self._destinations(s, e, r0, r1)

    def _destinations(self, s: int, e: int, r0: int, r1: int) -> Tensor:
        # as `csr_destinations` on edges s:e (rows r0..r1): a cumulative sum of the row starts
        # inside the chunk (an empty row repeats its start and is skipped)
        marks = torch.zeros(e - s, dtype=torch.int64, device=self.rowptr.device)
        inside = self.rowptr[r0 + 1 : r1 + 1] - s
        marks.index_add_(0, inside, torch.ones_like(inside))
        return marks.cumsum_(0).add_(r0)


def _chunks(
    x: Tensor, rowptr: Tensor, col: Tensor, chunk_bytes: int, lean: bool = False
) -> tuple[int, _EdgeChunks]:
    """``(chunk, wide)`` of an edge stage over features ``x`` (N x H x C): ``chunk`` edges per
    chunk x H x C gather (`edge_chunk_size`) and the wide chunks, C times longer, on which
    the edge-level (chunk x H) work runs and which the gathers slice: few small kernels per
    gather chunk. ``lean`` (the probe's backwards, `is_lean`): the gathers alive at once
    total at most a quarter of one N x H x C tensor, with no floor, so that the chunk
    temporaries (and the wide chunks' E x H ones, C times fewer elements per edge) stay small
    next to the N x H x C tensors the probe holds; more and smaller kernels on small graphs."""
    heads, channels = x.shape[1:]
    if lean:
        item = torch.finfo(_acc_dtype(x.dtype)).bits // 8
        quarter = x.shape[0] * heads * channels * item // 4
        chunk = edge_chunk_size(col.numel(), heads, channels, x.dtype, min(chunk_bytes, quarter))
        return chunk, _EdgeChunks(rowptr, col, chunk * channels)
    chunk = edge_chunk_size(col.numel(), heads, channels, x.dtype, chunk_bytes, x.shape[0])
    return chunk, _EdgeChunks(rowptr, col, chunk * channels)


def _segment_stats(scores, chunks: _EdgeChunks, num_dst: int, heads: int, acc, device):
    """Per destination and head, the max of the edge scores and the sum of their shifted
    exponentials (PyG's `softmax`: max shift, +1e-16), edge chunk by edge chunk: no E x H
    tensor. ``scores(s, e, col, dst)``: a fresh tensor of chunk ``s:e``'s scores. Same values
    as PyG's one pass over all edges (the max is exact; the sums run in the same edge
    order)."""
    m = torch.full((num_dst, heads), float("-inf"), dtype=acc, device=device)
    for s, e, col, dst in chunks:
        pre = scores(s, e, col, dst)
        m.scatter_reduce_(0, dst.unsqueeze(-1).expand_as(pre), pre, reduce="amax")
    total = torch.zeros(num_dst, heads, dtype=acc, device=device)
    for s, e, col, dst in chunks:
        total.index_add_(0, dst, scores(s, e, col, dst).sub_(m.index_select(0, dst)).exp_())
    return m, total.add_(1e-16)


def _softmax_stats(a_src, a_dst, chunks: _EdgeChunks, num_dst: int, slope: float, acc):
    """`_segment_stats` of GAT's leaky-ReLU'd logits, made from the node logits per chunk."""
    return _segment_stats(
        lambda s, e, col, dst: F.leaky_relu(_gat_logits(a_src, a_dst, col, dst, acc), slope),
        chunks, num_dst, a_src.shape[1], acc, a_src.device,
    )  # fmt: skip


def _chunk_alpha(a_src, a_dst, col, dst, m, total, slope: float, acc, keep_pre: bool = False):
    """Softmax coefficients of one edge chunk from `_softmax_stats` (and the logits before
    the shift, for the leaky ReLU's slope, when ``keep_pre``)."""
    logit = _gat_logits(a_src, a_dst, col, dst, acc)
    pre = F.leaky_relu(logit, slope)
    alpha = pre.sub_(m.index_select(0, dst)).exp_().div_(total.index_select(0, dst))
    return (alpha, logit) if keep_pre else alpha


def _aggregate(x_src, coefficients, mask, p: float, out_dtype, wide: _EdgeChunks, chunk: int,
               num_dst: int) -> Tensor:  # fmt: skip
    """out[d] = sum over edges e into d of alpha[e] * dropout multiplier[e] * x_src[src_e]
    (accumulated in fp32 for half inputs): ``coefficients(s, e, col, dst)`` gives a fresh
    alpha of each wide chunk, whose gathers run ``chunk`` edges at a time."""
    _, heads, channels = x_src.shape
    acc = _acc_dtype(x_src.dtype)
    out = torch.zeros(num_dst, heads, channels, dtype=acc, device=x_src.device)
    for s, e, col_w, dst_w in wide:
        beta = coefficients(s, e, col_w, dst_w)
        noise = _chunk_multiplier(mask, p, out_dtype, s, e)
        if noise is not None:
            beta = beta.mul_(noise)
        del noise
        for a in range(0, e - s, chunk):
            b = min(a + chunk, e - s)
            msg = x_src.index_select(0, col_w[a:b]).to(acc)
            out.index_add_(0, dst_w[a:b], msg.mul_(beta[a:b].unsqueeze(-1)))
            del msg
        del beta
    return out


def _aggregate_backward(features: list, grad_out, coefficients, mask, p: float, out_dtype, acc,
                        wide: _EdgeChunks, chunk: int, num_dst: int, need_alpha: bool,
                        need_x: bool, split: bool = False):  # fmt: skip
    """Backward of `_aggregate`: ``(grad x_src, grad alpha, dot)``. grad x_src[src] += beta *
    grad_out[dst] (when ``need_x``); grad alpha = <grad_out[dst], x_src[src]> * the dropout
    multiplier (E x H, the one edge-level tensor kept) and dot[d] = sum over edges into d of
    alpha * grad alpha, which the softmax's backward needs (when ``need_alpha``). ``features``
    is ``[x_src]``, a list the caller keeps no other reference to, so that ``split`` (the
    probe's partial backwards, `gact_graph.switches`) can release the (dequantized) features after
    a first pass for grad alpha, before grad x_src exists in a second."""
    x_src = features.pop()
    x_shape, heads = x_src.shape, x_src.shape[1]
    device = grad_out.device
    grad_alpha = dot = grad_x = None
    if need_alpha:
        grad_alpha = torch.empty(wide.num_edges, heads, dtype=acc, device=device)
        dot = torch.zeros(num_dst, heads, dtype=acc, device=device)
    split = split and need_alpha and need_x
    for alpha_now, x_now in [(True, False), (False, True)] if split else [(need_alpha, need_x)]:
        if x_now:
            grad_x = torch.zeros(x_shape, dtype=acc, device=device)
        for s, e, col_w, dst_w in wide:
            alpha = coefficients(s, e, col_w, dst_w)
            noise = _chunk_multiplier(mask, p, out_dtype, s, e)
            beta = (alpha if noise is None else alpha * noise) if x_now else None
            for a in range(0, e - s, chunk):
                b = min(a + chunk, e - s)
                g = grad_out.index_select(0, dst_w[a:b]).to(acc)
                if alpha_now:
                    xs = x_src.index_select(0, col_w[a:b]).to(acc)
                    torch.sum(xs.mul_(g), dim=-1, out=grad_alpha[s + a : s + b])
                    del xs
                if x_now:
                    grad_x.index_add_(0, col_w[a:b], g.mul_(beta[a:b].unsqueeze(-1)))
                del g
            if alpha_now:
                ga = grad_alpha[s:e]
                if noise is not None:
                    ga.mul_(noise)
                dot.index_add_(0, dst_w, alpha * ga)
                del ga
            del alpha, noise, beta
        if split and alpha_now:
            x_src = None
    return grad_x, grad_alpha, dot


def _item(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor: it runs inside a counted backward


def _lean_gat_backward_bytes(
    num_src: int,
    num_dst: int,
    num_edges: int,
    heads: int,
    channels: int,
    x_dtype: torch.dtype,
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype | None,
    p: float,
    permuted: bool,
    chunk_bytes: int,
    need_x: bool,
    need_src: bool,
    need_dst: bool,
    features=None,
) -> int:
    """Upper bound of the bytes `GatAttentionFunction.backward` under `lean_backward` creates
    and holds at once (tensors it allocates, its outputs included; not its inputs), read off
    its code: the most over its phases of what each phase can hold, every tensor a loop
    iteration allocates counted as alive together. ``features``: the layout of a compressed
    ``x_src`` read in parts (`_SourceRows` through `_Codes`, as the probe's walk hands it), or
    None for a dense one (the replay's noisy copy). Per wide chunk of ``w`` edges (the lean
    chunks of `_chunks`; ``H`` heads, ``a`` bytes per accumulated element, ``o`` per output
    element):

    - reading ``x_src`` in parts (`_gatv2_reader_bytes`, as GATv2's source): making the
      reader first, then its codes and per-row ``lo`` / ``scale`` kept until the coefficients'
      pass ends (the features' pass too where the logits need no gradient: the reader is
      released when the passes return), and a gather's decoding in place of the dense gather;
    - always: ``m`` and ``total`` (N_dst x H), the destinations of the chunk and of the one
      before it while the next is made (two int64 ``w``-vectors), the marks of its rows (two
      int64 vectors of at most N_dst + 1), the chunk starts' tensors (three of two int64 per
      wide chunk); the coefficients of a chunk (`_chunk_alpha`: the gathered node logits,
      their accumulator copies where the dtype differs, the leaky ReLU's output, the gathered
      max and sum: ``T``);
    - the dropout draw (before the passes): its ``o``-sized noise, the bool mask, the permuted
      mask; later the bool mask alone;
    - the coefficients' pass (when the logits need a gradient; under `lean_backward` apart
      from the features' pass): ``grad alpha`` (E x H) and ``dot``; per chunk alpha, the
      dropout multiplier, ``alpha * grad alpha``, and the two chunk x H x C gathers (incoming
      gradient and features) with their accumulator copies;
    - the features' pass (when ``x_src`` needs one): ``grad x_src`` (N_src x H x C), and per
      chunk alpha, the multiplier, their product, and the incoming gradient's gather;
    - the logits' pass: both logit gradients, and per chunk alpha, the logits, ``dot``
      gathered, the logits' gradient, the leaky ReLU's slope and its bool mask;
    - at the end the outputs' copies in their input dtypes where they differ from ``a``.

    Zero-dimensional tensors (the multiplier of ``p == 1``) are covered by a fixed 1 KiB."""
    out_dtype = torch.promote_types(x_dtype, src_dtype)
    acc = _acc_dtype(out_dtype)
    a, o, xi, si = _item(acc), _item(out_dtype), _item(x_dtype), _item(src_dtype)
    di = 0 if dst_dtype is None else _item(dst_dtype)
    need_logits = need_src or need_dst
    # `_chunks` under `lean_backward`: the gathers capped at a quarter of x_src, no floor
    quarter = num_src * heads * channels * (torch.finfo(_acc_dtype(x_dtype)).bits // 8) // 4
    chunk = edge_chunk_size(num_edges, heads, channels, x_dtype, min(chunk_bytes, quarter))
    wide = max(1, chunk * channels)
    w = min(wide, num_edges)
    c = min(chunk, w)
    n_wide = -(-num_edges // wide)
    h, hc = heads, heads * channels

    def copy(dtype: torch.dtype | None) -> int:  # an accumulator copy's bytes, if one is made
        return a if dtype is not None and dtype != acc else 0

    stats = 2 * num_dst * h * a
    index = 16 * w + 16 * (num_dst + 1) + 48 * n_wide
    alpha_t = w * h * (si + copy(src_dtype) + di + copy(dst_dtype) + 3 * a)
    drawn = 0.0 < p < 1.0 and num_edges * h > 0
    mask = num_edges * h if drawn else 0
    # the features' reader: (kept, made, a gather's peak, its result)
    kept, made, gather, result = 0, 0, c * hc * xi, c * hc * xi
    if features is not None:
        kept, made, gather, result = _gatv2_reader_bytes("source", features, c, h, channels, xi,
                                                         0)  # fmt: skip
    features_gather = max(gather, result + copy(x_dtype))
    phases = [made + 48 * n_wide, kept + stats + index + alpha_t]
    if drawn:
        phases.append(kept + stats + num_edges * h * (o + 1 + int(permuted)))
    g_alpha = (num_edges * h + num_dst * h) * a if need_logits else 0
    g_x = num_src * hc * a if need_x else 0
    g_logits = (num_src * h if need_src else 0) * a + (num_dst * h if need_dst else 0) * a
    grad_gather = c * hc * (o + copy(out_dtype))
    if need_logits:
        it = w * h * (2 * a + o) + grad_gather + features_gather
        phases.append(kept + stats + mask + g_alpha + index + max(alpha_t, it))
        it = 4 * w * h * a + w * h
        phases.append(stats + mask + g_alpha + g_x + g_logits + index + max(alpha_t, it))
    if need_x:
        it = w * h * (a + o + max(a, o)) + grad_gather
        held = 0 if need_logits else kept  # split from the coefficients' pass, or not
        phases.append(held + stats + mask + g_alpha + g_x + index + max(alpha_t, it))
    ends = (
        (num_src * hc * xi if need_x and x_dtype != acc else 0)
        + (num_src * h * si if need_src and src_dtype != acc else 0)
        + (num_dst * h * di if need_dst and dst_dtype != acc else 0)
    )
    phases.append(stats + g_alpha + g_x + g_logits + ends)
    return max(phases) + 1024


class GatAttentionFunction(torch.autograd.Function):
    """The edge stage of `GATConv` on a destination-sorted CSR.

    ``forward(x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes)``:
    ``x_src`` N_src x H x C projected source features, ``a_src`` N_src x H and ``a_dst``
    N_dst x H (or None) node logits, ``rowptr`` (N_dst + 1) and ``col`` (E, source of each edge)
    the CSR, ``dropout`` the attention-dropout probability (0 outside training), drawn as
    stock's ``F.dropout`` on the default generator in the edge order that ``perm`` (CSR position
    -> stock position, or None for CSR order) gives. Returns N_dst x H x C: ``out[i] = sum_j
    dropout(softmax_j(leaky_relu(a_src[j] + a_dst[i]))) * x_src[j]``. Saves ``x_src``,
    ``a_src``, ``a_dst``, ``rowptr``, ``col``, ``perm`` and the generator state of the draw.

    Every edge-level quantity is made one edge chunk at a time from node-level ones (the
    softmax's per-destination max and sum, then each chunk's coefficients), so the only
    E x H tensors are the dropout's keep-mask (bool) and, in backward, the coefficients'
    gradient (between the two passes the softmax's backward needs): at ogbn-products' size
    every E x H fp32 tensor is over a GiB (docs/design.md).

    ``x_src`` is saved as its (N * H) x C view where it is one (the same quantization groups
    as N x H x C), so that inside the sensitivity probe's work (`reads_row_chunks`) a
    compressed one arrives as a matrix it reads in parts: gathered from its unpacked codes
    (`_SourceRows`, a quarter of an fp32 copy) and released after the coefficients' pass
    under `lean_backward`. That backward, which the probe runs on top of the user's, then
    holds no dequantized copy of it. A plain step's backward is handed a dense copy
    (``reads_rows_every_step`` off), as GATv2's is: reading in parts costs CPU time that one
    input's copy does not repay there.
    """

    reads_row_chunks = True
    reads_rows_every_step = False

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes):
        _check_common(x_src, rowptr, col, dropout, perm)
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads = x_src.shape[1]
        # PyG's alpha and message alpha * x_j promote (bf16 features, fp32 logits: fp32).
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        acc = _acc_dtype(out_dtype)
        slope = float(negative_slope)
        chunk, wide = _chunks(x_src, rowptr, col, chunk_bytes)
        m, total = _softmax_stats(a_src, a_dst, wide, num_dst, slope, acc)
        mask, state = _attention_dropout(dropout, num_edges, heads, out_dtype, x_src.device, perm)
        out = _aggregate(
            x_src, lambda s, e, col_w, dst_w: _chunk_alpha(
                a_src, a_dst, col_w, dst_w, m, total, slope, acc
            ), mask, dropout, out_dtype, wide, chunk, num_dst,
        )  # fmt: skip
        del mask

        # the (N * H) x C view where it is one (see the class docstring)
        ctx.save_for_backward(_as_rows(x_src), a_src, a_dst, rowptr, col, perm, state)
        ctx.negative_slope = slope
        ctx.dropout = float(dropout)
        ctx.chunk_bytes = int(chunk_bytes)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked)
        ctx.shapes = (
            x_src.shape[0], num_dst, num_edges, heads, x_src.shape[2], x_src.dtype,
            a_src.dtype, None if a_dst is None else a_dst.dtype, perm is not None,
        )  # fmt: skip
        return out.to(out_dtype)

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its outputs included, its saved inputs and ``grad_out`` not), from the shapes
        the forward recorded, in the sensitivity probe's work (`gact_graph.budget.probe_cost`),
        ``layouts`` the group layouts of the compressed inputs the node read: in a replay
        (``walk`` false) the replayed input is handed as the replay's dense copy; in the
        probe's walk through the node (``walk``) a compressed ``x_src`` is handed as a matrix
        read in parts (`reads_row_chunks`, `_SourceRows`). None where ``layouts`` holds more
        than one (the replay of one would dequantize another whole inside the node), and in
        the walk where the one is not ``x_src``'s (N * H) x C matrix in a layout `_Codes`
        reads (the backward would dequantize it whole). `_lean_gat_backward_bytes` derives
        it from the code of `backward`."""
        layouts = list(layouts)
        if len(layouts) > 1:
            return None
        num_src, num_dst, num_edges, heads, channels, x_dtype, src_dtype, dst_dtype, permuted = (
            ctx.shapes
        )
        features = layouts[0] if walk and layouts else None  # read in parts
        if walk and layouts and not _codes_readable(features):
            return None
        if features is not None and (features.rows, features.cols) != (num_src * heads, channels):
            return None
        need_x, need_src, need_dst = ctx.needs_input_grad[:3]
        return _lean_gat_backward_bytes(
            num_src, num_dst, num_edges, heads, channels, x_dtype, src_dtype, dst_dtype,
            ctx.dropout, permuted, ctx.chunk_bytes, need_x, need_src, need_dst, features,
        )  # fmt: skip

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_src, a_src, a_dst, rowptr, col, perm, state = ctx.saved_tensors
        need_x, need_src, need_dst = ctx.needs_input_grad[:3]
        need_logits = need_src or need_dst
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads, channels = ctx.shapes[3:5]
        # a compressed x_src stays so: gathered from its unpacked codes (`_SourceRows`)
        x_src = _SourceRows(x_src, heads, channels)
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        acc = _acc_dtype(out_dtype)
        slope, p = ctx.negative_slope, ctx.dropout
        # as in forward, or smaller under `lean_backward` (the probe's work)
        chunk, wide = _chunks(x_src, rowptr, col, ctx.chunk_bytes, lean=is_lean())
        m, total = _softmax_stats(a_src, a_dst, wide, num_dst, slope, acc)
        mask, _ = _attention_dropout(p, num_edges, heads, out_dtype, x_src.device, perm, state)
        x_dtype = x_src.dtype

        # Pass 1 over the edges (chunk x H x C): the features' gradient and the coefficients'.
        features = [x_src]  # the reader's only reference: ``split`` releases it
        del x_src
        grad_x, grad_alpha, dot = _aggregate_backward(
            features, grad_out,
            lambda s, e, col_w, dst_w: _chunk_alpha(
                a_src, a_dst, col_w, dst_w, m, total, slope, acc
            ),
            mask, p, out_dtype, acc, wide, chunk, num_dst, need_logits, need_x, split=is_lean(),
        )  # fmt: skip
        del mask

        # Pass 2 (chunk x H): grad logit = (grad alpha - dot[dst]) * alpha * leaky_relu'.
        grad_a_src = grad_a_dst = None
        if need_logits:
            if need_src:
                grad_a_src = torch.zeros(a_src.shape, dtype=acc, device=a_src.device)
            if need_dst:
                grad_a_dst = torch.zeros(a_dst.shape, dtype=acc, device=a_dst.device)
            for s, e, col_c, dst_c in wide:
                alpha, logit = _chunk_alpha(
                    a_src, a_dst, col_c, dst_c, m, total, slope, acc, keep_pre=True
                )
                gl = (grad_alpha[s:e] - dot.index_select(0, dst_c)).mul_(alpha)
                _leaky_relu_backward_(gl, logit, slope)
                del alpha, logit
                if grad_a_src is not None:
                    grad_a_src.index_add_(0, col_c, gl)
                if grad_a_dst is not None:
                    grad_a_dst.index_add_(0, dst_c, gl)
                del gl
            del grad_alpha, dot
            if grad_a_src is not None:
                grad_a_src = grad_a_src.to(a_src.dtype)
            if grad_a_dst is not None:
                grad_a_dst = grad_a_dst.to(a_dst.dtype)
        if grad_x is not None:
            grad_x = grad_x.to(x_dtype)
        return grad_x, grad_a_src, grad_a_dst, None, None, None, None, None, None


def gat_attention(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tensor:
    """`GatAttentionFunction.apply` with keyword defaults."""
    return GatAttentionFunction.apply(
        x_src, a_src, a_dst, rowptr, col, negative_slope, dropout, perm, chunk_bytes
    )


def gat_attention_reference(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
) -> Tensor:
    """Stock-autograd oracle of `gat_attention` (materializes E x H x C; tests only)."""
    dst = csr_destinations(rowptr, col.numel())
    logit = a_src[col] if a_dst is None else a_src[col] + a_dst[dst]
    logit = F.leaky_relu(logit, negative_slope)
    return _attend_reference(logit, x_src, col, dst, rowptr.numel() - 1, dropout, perm)


def _attend_reference(logit, x_src, col, dst, num_dst, dropout, perm) -> Tensor:
    """Stock-autograd softmax (PyG's formula), ``F.dropout`` in stock's edge order, and
    aggregation."""
    from gact_graph.kernels.gat_edge import aggregate_reference, edge_softmax_reference

    alpha = edge_softmax_reference(logit, dst, num_dst)
    if perm is None:
        alpha = F.dropout(alpha, dropout)
    else:  # CSR edge k is stock's edge perm[k]
        alpha = F.dropout(alpha[torch.argsort(perm)], dropout)[perm]
    return aggregate_reference(alpha, x_src, col, dst, num_dst)


# ---------------------------------------------------------------------------- fused kernels
#: Which edge stage the patched `GATConv` / `GATv2Conv` run: ``"auto"``, the fused Triton kernels
#: (`gact_graph.kernels.gat_edge`) on CUDA tensors where they apply, else the chunked PyTorch
#: stage; ``"triton"``, the kernels wherever they apply, CPU tensors included (which works only
#: under ``TRITON_INTERPRET=1``: the tests); ``"chunked"``, never the kernels.
#: ``GACT_GRAPH_FORCE_TRITON=1`` acts as ``"triton"`` (`gact_graph.kernels.force_triton`).
EDGE_KERNEL = "auto"
_EDGE_KERNELS = ("auto", "triton", "chunked")


@package_work  # checks of devices and dtypes: nothing the forward's pointwise mode rewrites
def fused_kernel_applies(x: Tensor, logits: Tensor, dropout: float, lossless: bool) -> bool:
    """Whether the fused kernels run an edge stage of features ``x`` and node logits ``logits``
    under `EDGE_KERNEL`: Triton installed, a CUDA tensor (or the kernels forced), fp32 / bf16 /
    fp16 inputs (float64 stays exact on the chunked stage), and no attention dropout in
    lossless mode, whose draw stays stock's (the kernels draw their own; see the module
    docstring)."""
    if EDGE_KERNEL not in _EDGE_KERNELS:
        raise ValueError(f"EDGE_KERNEL must be one of {_EDGE_KERNELS}, got {EDGE_KERNEL!r}")
    if EDGE_KERNEL == "chunked" or not triton_available():
        return False
    forced = EDGE_KERNEL == "triton" or force_triton()
    if x.device.type != "cuda" and not forced:
        return False
    kernel_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if x.dtype not in kernel_dtypes or logits.dtype not in kernel_dtypes:
        return False
    return not (dropout > 0 and lossless)


class GatFusedFunction(torch.autograd.Function):
    """`GatAttentionFunction`'s edge stage as the fused Triton kernels of
    `gact_graph.kernels.gat_edge`: one pass over the CSR rows forward, one over the rows and
    one over the transpose's rows backward, no edge-level tensor anywhere.

    ``forward(x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
    dropout, keep_lossless)``: as `GatAttentionFunction`, plus the transpose (``t_rowptr``,
    ``t_col``; ``t_pos``, each transposed edge's CSR position, needed with dropout only and
    None when the orders agree) and ``keep_lossless``, called on the softmax statistics before
    they are saved (the controller must not quantize them), or None. Attention dropout is the
    kernels' own Philox draw from a seed drawn here on the device's default generator (an
    int64 tensor: no host sync); backward regenerates it. Saves ``x_src`` (as its (N * H) x C
    view, the same quantization groups), ``a_src``, ``a_dst``, the CSR and its transpose, the
    statistics (2 x N_dst x H fp32) and the seed.

    A compressed ``x_src`` arrives as a matrix read by rows (`_row_matrix`; in every step,
    ``reads_rows_every_step``, and in the sensitivity probe's work, ``reads_row_chunks``), and
    the backward kernels read its packed codes directly (`_kernel_features`): no dequantized
    N x H x C copy, the same values.
    """

    reads_row_chunks = True
    reads_rows_every_step = True

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
                dropout, keep_lossless):  # fmt: skip
        from gact_graph.kernels import gat_edge

        _check_common(x_src, rowptr, col, dropout, None)
        p, slope = float(dropout), float(negative_slope)
        seed = gat_edge.draw_seed(x_src.device) if p > 0 else None
        out_dtype = torch.promote_types(x_src.dtype, a_src.dtype)
        out, m, s = gat_edge.gat_edge_forward(
            x_src, a_src, a_dst, rowptr, col, slope, p, seed, out_dtype=out_dtype
        )
        if keep_lossless is not None:
            keep_lossless(m)
            keep_lossless(s)
        ctx.x_shape = x_src.shape
        ctx.save_for_backward(_as_rows(x_src), a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos,
                              m, s, seed)  # fmt: skip
        ctx.negative_slope, ctx.dropout = slope, p
        return out

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        from gact_graph.kernels import gat_edge

        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            saved = ctx.saved_tensors
        x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s, seed = saved
        x_src = _kernel_features(x_src, ctx.x_shape)
        # (kept lossless: dense already)
        a_src, a_dst, m, s = _dense(a_src), _dense(a_dst), _dense(m), _dense(s)
        needs = tuple(ctx.needs_input_grad[:3])
        grad_x, grad_src, grad_dst = gat_edge.gat_edge_backward(
            grad_out, x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, m, s,
            ctx.negative_slope, ctx.dropout, seed, needs=needs,
        )  # fmt: skip
        return grad_x, grad_src, grad_dst, None, None, None, None, None, None, None, None


def gat_attention_fused(
    x_src: Tensor,
    a_src: Tensor,
    a_dst: Tensor | None,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    transpose: tuple[Tensor, Tensor, Tensor | None] | None = None,
    keep_lossless=None,
) -> Tensor:
    """`GatFusedFunction.apply` with keyword defaults; ``transpose`` = ``(t_rowptr, t_col,
    t_pos)`` (made here, per call, when None: callers with a cached adjacency pass its own)."""
    t_rowptr, t_col, t_pos = _transpose(transpose, rowptr, col, x_src.shape[0])
    return GatFusedFunction.apply(
        x_src, a_src, a_dst, rowptr, col, t_rowptr, t_col, t_pos, negative_slope, dropout,
        keep_lossless,
    )  # fmt: skip


class GatV2FusedFunction(torch.autograd.Function):
    """`GatV2AttentionFunction`'s edge stage on the fused Triton kernels (`GatFusedFunction`'s
    counterpart): ``forward(x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos,
    negative_slope, dropout, recompute_stats)``. Saves ``x_l``, ``x_r``, ``att``, the CSR and
    its transpose and the dropout seed; no E x H tensor (the chunked stage keeps its E x H
    logits). The softmax statistics are saved only where ``x_l`` and ``x_r`` come back
    bit-exact; with ``recompute_stats`` (a compressing controller, which hands back
    dequantized features whose logits differ from the forward's) backward recomputes them
    from what it is handed (one pass over the rows, no aggregation):
    coefficients from the forward's statistics and the dequantized logits would not sum to
    one, and in half precision their exponentials overflow.

    ``x_l`` and ``x_r`` are saved as their (N * H) x C views; the kernels read a compressed
    one's packed codes directly (``reads_rows_every_step``, ``reads_row_chunks``: in every
    step and in the sensitivity probe's work), as `GatFusedFunction` reads ``x_src``: neither
    is dequantized whole."""

    reads_row_chunks = True
    reads_rows_every_step = True

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, negative_slope,
                dropout, recompute_stats):  # fmt: skip
        from gact_graph.kernels import gat_edge

        _check_common(x_l, rowptr, col, dropout, None)
        p, slope = float(dropout), float(negative_slope)
        seed = gat_edge.draw_seed(x_l.device) if p > 0 else None
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)
        out, m, s = gat_edge.gatv2_edge_forward(
            x_l, x_r, att, rowptr, col, slope, p, seed, out_dtype=out_dtype
        )
        if recompute_stats:
            m = s = None
        ctx.shapes = (x_l.shape, x_r.shape)
        rows_l = _as_rows(x_l)
        rows_r = rows_l if x_r is x_l else _as_rows(x_r)  # one tensor, saved once
        ctx.save_for_backward(rows_l, rows_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s,
                              seed)  # fmt: skip
        ctx.negative_slope, ctx.dropout = slope, p
        return out

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        from gact_graph.kernels import gat_edge

        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s, seed = ctx.saved_tensors
        m, s = _dense(m), _dense(s)  # (kept lossless: dense already)
        same = x_r is x_l
        x_l = _kernel_features(x_l, ctx.shapes[0])
        x_r = x_l if same else _kernel_features(x_r, ctx.shapes[1])
        if m is None:
            _, m, s = gat_edge.gatv2_edge_forward(
                x_l, x_r, att, rowptr, col, ctx.negative_slope, stats_only=True
            )
        grads = gat_edge.gatv2_edge_backward(
            grad_out, x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, m, s,
            ctx.negative_slope, ctx.dropout, seed, needs=tuple(ctx.needs_input_grad[:3]),
        )  # fmt: skip
        return (*grads, None, None, None, None, None, None, None, None)


def gatv2_attention_fused(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    transpose: tuple[Tensor, Tensor, Tensor | None] | None = None,
    recompute_stats: bool = False,
) -> Tensor:
    """`GatV2FusedFunction.apply` with keyword defaults (``transpose`` as in
    `gat_attention_fused`)."""
    t_rowptr, t_col, t_pos = _transpose(transpose, rowptr, col, x_l.shape[0])
    return GatV2FusedFunction.apply(
        x_l, x_r, att, rowptr, col, t_rowptr, t_col, t_pos, negative_slope, dropout,
        recompute_stats,
    )  # fmt: skip


def _as_rows(x: Tensor) -> Tensor:
    """Features N x H x C as their (N * H) x C view (the same quantization groups), which a
    probe hands back as a matrix read by rows (`_row_matrix`); ``x`` itself where no such
    view exists."""
    if x.dim() == 3 and x.is_contiguous() and x.numel() > 0:
        return x.view(-1, x.shape[-1])
    return x


def _dense(x: Tensor | None) -> Tensor | None:
    """``x``, dequantized whole if it is a compressed matrix read by rows (`_row_matrix`)."""
    return x.dense() if x is not None and _row_matrix(x) is not None else x


def _kernel_features(x: Tensor, shape: torch.Size):
    """What the fused kernels read of features saved by `_as_rows` (N x H x C = ``shape``):
    the packed codes (`gat_edge.CodedFeatures`) of a compressed matrix read by rows whose
    codes they decode (a `QTensor` of 1 / 2 / 4 / 8 bits, any group layout), else a dense
    N x H x C tensor: the one handed back, or (another compressed kind) its dequantization."""
    from gact_graph.kernels import gat_edge

    q = _row_matrix(x)
    if q is None:
        return x.reshape(shape)
    lay = getattr(q, "layout", None)
    readable = (
        not getattr(x, "transposed", False)
        and all(hasattr(q, a) for a in ("packed", "meta", "bits", "dtype"))
        and getattr(q, "bits", None) in (1, 2, 4, 8)
        and q.dtype in gat_edge.KERNEL_DTYPES
        and lay is not None and lay.num_groups > 0
        and (lay.rows, lay.cols) == (shape[0] * shape[1], shape[2])
    )  # fmt: skip
    if not readable:
        return x.dense().reshape(shape)
    return gat_edge.coded_features(q.packed, q.meta, q.bits, lay, q.dtype, shape[1])


def _transpose(transpose, rowptr: Tensor, col: Tensor, num_src: int):
    """``transpose`` (``(t_rowptr, t_col, t_pos)``), or the CSR's made now when it is None."""
    if transpose is not None:
        return transpose
    from gact_graph.kernels import gat_edge

    return gat_edge.csr_transpose(rowptr, col, num_src)


def _adjacency_transpose(adj, dropout: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(t_rowptr, t_col, t_pos)`` of a cached adjacency (`CompactAdjacency.walk_transpose`,
    built on a graph's first step; ``t_pos`` passed only when dropout needs it)."""
    t_rowptr, t_col, t_pos = adj.walk_transpose()
    return t_rowptr, t_col, t_pos if dropout > 0 else None


# ---------------------------------------------------------------------------- GATv2
def _row_matrix(x: Tensor):
    """The compressed matrix behind ``x`` when ``x`` reads a row range at a time (a tensor
    with ``q``, whose ``q.rows(r0, r1).dequantize()`` gives rows ``r0:r1``: the sensitivity
    probe's `RowChunked`), else None."""
    q = getattr(x, "q", None)
    return q if q is not None and callable(getattr(q, "rows", None)) else None


class _Codes:
    """Decoding of a compressed (N * H) x C matrix ``q`` whose groups hold whole rows without
    padding, read as N x H x C: codes one byte per element (`unpack_bits`) and, per (node,
    head) row, its group's fp32 ``lo`` and ``scale`` (made once, 2 / C of an fp32 copy), so
    that any rows dequantize as ``code * scale + lo`` in fp32, the operations and values of
    ``q.dequantize()`` (`dequantize_reference`; its product is exact, so the Triton
    dequantizer's fused multiply-add gives the same), without decoding the metadata again
    for each part. `_Codes.of` is None for other layouts."""

    def __init__(self, q, heads: int, channels: int) -> None:
        from gact_graph.kernels.quantize import decode_meta

        lay = q.layout
        self.q, self.heads, self.channels, self.k = q, heads, channels, lay.rows_per_group
        self.bytes_per_group = lay.packed_nbytes(q.bits) // lay.num_groups
        lo, scale, _ = decode_meta(q.meta)
        self.lo = lo.repeat_interleave(self.k)[: lay.rows].view(-1, heads)
        self.scale = scale.repeat_interleave(self.k)[: lay.rows].view(-1, heads)

    @classmethod
    def of(cls, q, heads: int, channels: int):
        lay = getattr(q, "layout", None)
        whole_rows = (
            lay is not None and lay.groups_per_row == 1 and lay.num_groups > 0
            and lay.group_size == lay.rows_per_group * lay.cols
        )  # fmt: skip
        return cls(q, heads, channels) if whole_rows else None

    def codes(self, r0: int, r1: int) -> Tensor:
        """uint8 codes of node rows ``r0:r1`` (``r0 * heads`` a multiple of the rows per
        group) as (r1 - r0) x H x C."""
        from gact_graph.kernels.bitpack import unpack_bits

        first, last = r0 * self.heads // self.k, -(-r1 * self.heads // self.k)
        b = self.bytes_per_group
        g = self.q.layout.group_size
        codes = unpack_bits(self.q.packed[first * b : last * b], self.q.bits, (last - first) * g)
        return codes.view(-1, self.channels)[: (r1 - r0) * self.heads].view(
            r1 - r0, self.heads, self.channels
        )

    def decode(self, codes: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Values of ``codes`` (m x H x C) of the node rows ``rows`` (m), in ``dtype``."""
        from gact_graph.kernels.quantize import decode_codes_

        scale = self.scale.index_select(0, rows).unsqueeze(-1)
        lo = self.lo.index_select(0, rows).unsqueeze(-1)
        return decode_codes_(codes.to(torch.float32), scale, lo, dtype).to(dtype)


class _DestinationRows:
    """GATv2's destination features ``x_r`` (N x H x C) as its edge stage reads them: gathered
    by each edge's destination, which in a destination-sorted CSR is a contiguous row range
    per edge chunk.

    ``x`` is dense (N x H x C, or its (N * H) x C view) or a compressed matrix that reads a
    row range at a time (`_row_matrix`: the sensitivity probe's `RowChunked`, handed to
    Functions that set ``reads_row_chunks``). A compressed one is dequantized one gather
    chunk's rows at a time (`_Codes` where its layout allows, else ``q.rows``), never whole:
    the probe runs this backward on top of the user's, where one more N x H x C copy adds to
    the step's peak. ``bounds(chunk)`` finds the rows each gather chunk of ``chunk`` edges
    reads (one host sync); a dense one needs none and is gathered as before."""

    def __init__(self, x: Tensor, rowptr: Tensor, heads: int, channels: int) -> None:
        q = _row_matrix(x)
        self.compressed = q is not None
        self.heads, self.channels, self.rowptr = heads, channels, rowptr
        self.shape = (x.numel() // (heads * channels), heads, channels)
        self.dtype, self.device = x.dtype, x.device
        self.x = self.q = self.codes = None
        if self.compressed:
            self.q, self.codes = q, _Codes.of(q, heads, channels)
            # a node row range starts on a group when its first (N * H)-row does
            step = max(1, int(q.row_step()))
            self.align = step // math.gcd(step, heads)
        else:
            self.x = x.view(self.shape)
        self._bounds: dict[int, tuple[int, int]] = {}

    def bounds(self, chunk: int) -> None:
        """Finds the first and last destination row of every gather chunk (edges ``s:s +
        chunk`` for ``s`` a multiple of ``chunk``, the gathers of `_EdgeChunks`, whose wide
        chunks are multiples of ``chunk``)."""
        if not self.compressed:
            return
        num_edges = int(self.rowptr[-1]) if self.rowptr.numel() else 0
        starts = list(range(0, num_edges, chunk))
        ends = [min(s + chunk, num_edges) - 1 for s in starts]
        pos = torch.tensor(starts + ends, dtype=self.rowptr.dtype, device=self.rowptr.device)
        rows = (torch.searchsorted(self.rowptr, pos, right=True) - 1).tolist()
        self._bounds = dict(zip(starts, zip(rows[: len(starts)], rows[len(starts) :])))

    def gather(self, start: int, dst: Tensor) -> Tensor:
        """``x_r[dst]`` (dtype of ``x_r``) for the gather chunk starting at edge ``start``."""
        if not self.compressed:
            return self.x.index_select(0, dst)
        d0, d1 = self._bounds[start]
        base = d0 - d0 % self.align
        if self.codes is not None:
            codes = self.codes.codes(base, d1 + 1).index_select(0, dst - base)
            return self.codes.decode(codes, dst, self.dtype)
        h = self.heads
        rows = self.q.rows(base * h, (d1 + 1) * h).dequantize()
        return rows.view(-1, h, self.channels).index_select(0, dst - base)


class _SourceRows:
    """Source features (GATv2's ``x_l``, GAT's ``x_src``; N x H x C) as an edge stage reads
    them: gathered by each edge's source (any rows, in any order), through
    ``index_select(0, idx)``.

    ``x`` is dense (N x H x C, or its (N * H) x C view) or a compressed matrix
    (`_row_matrix`). A compressed one whose layout `_Codes` reads keeps its codes unpacked
    (one byte per element, a quarter of an fp32 copy) and dequantizes each gather, never the
    whole tensor; another layout is dequantized whole (the same values)."""

    def __init__(self, x: Tensor, heads: int, channels: int) -> None:
        # N x H x C, or its (N * H) x C view
        self.shape = (x.shape[0] if x.dim() == 3 else x.shape[0] // heads, heads, channels)
        self.dtype, self.device = x.dtype, x.device
        q = _row_matrix(x)
        self.decoder = None if q is None else _Codes.of(q, heads, channels)
        if self.decoder is None:
            self.x = (x.dense() if q is not None else x).view(self.shape)
            return
        self.x = None
        self.codes = self.decoder.codes(0, self.shape[0])

    def index_select(self, dim: int, idx: Tensor) -> Tensor:
        if self.x is not None:
            return self.x.index_select(dim, idx)
        return self.decoder.decode(self.codes.index_select(0, idx), idx, self.dtype)


def _gatv2_logits(
    x_l: Tensor | _SourceRows,
    x_r: _DestinationRows,
    att: Tensor,
    chunks: _EdgeChunks,
    negative_slope: float,
    chunk: int,
) -> Tensor:
    """logit[e] = <att, leaky_relu(x_l[src_e] + x_r[dst_e])> per head (E x H), gathered in
    chunks of ``chunk`` edges inside each of ``chunks``."""
    acc = _acc_dtype(x_l.dtype)
    heads, channels = x_l.shape[1:]
    att = att.reshape(1, heads, channels).to(acc)
    logit = torch.empty(chunks.num_edges, heads, dtype=acc, device=x_l.device)
    for s, e, col_w, dst_w in chunks:
        for a in range(0, e - s, chunk):
            b = min(a + chunk, e - s)
            z = x_r.gather(s + a, dst_w[a:b]).to(acc)
            z.add_(x_l.index_select(0, col_w[a:b]))
            F.leaky_relu(z, negative_slope, inplace=True)
            torch.sum(z.mul_(att), dim=-1, out=logit[s + a : s + b])
            del z
    return logit


#: bytes per quantization group that decoding a compressed input's metadata holds at once at
#: most (`decode_meta`: its int64 copy of the metadata and the int64 / fp32 / bool temporaries
#: of each bit pattern it forms, with room), and per (node, head) row while `_Codes` expands
#: the per-group ``lo`` and ``scale`` to rows (an int64 index and the fp32 result)
_META_GROUP_BYTES, _META_ROW_BYTES = 160, 24
#: bytes per code that unpacking held at once at most, over the code widths a plan may choose
#: (`unpack_bits`: at 4 bits the int32 copy of the packed bytes, two bytes a code, and the
#: uint8 codes)
_UNPACK_BYTES = 3


def _codes_readable(lay) -> bool:
    """Whether `_Codes` reads a compressed input of layout ``lay`` (`_Codes.of`); None (not
    a matrix, which the probe hands whole) it does not."""
    return lay is not None and (
        lay.groups_per_row == 1 and lay.num_groups > 0
        and lay.group_size == lay.rows_per_group * lay.cols
    )  # fmt: skip


def _gatv2_span_codes(rowptr: Tensor, num_edges: int, chunk: int, heads: int, lay) -> int:
    """The most codes `_DestinationRows.gather` unpacks at once from a compressed ``x_r`` of
    layout ``lay`` (`_Codes.codes` of a gather chunk's destination rows, from the group its
    first row lies in): exact, from the CSR's rows of each gather chunk's first and last
    edge (one host sync)."""
    if num_edges == 0:
        return 0
    k = lay.rows_per_group
    align = k // math.gcd(k, heads)
    starts = torch.arange(0, num_edges, chunk, dtype=torch.int64, device=rowptr.device)
    ends = (starts + chunk).clamp_(max=num_edges).sub_(1)
    d0 = torch.searchsorted(rowptr, starts.to(rowptr.dtype), right=True).sub_(1).to(torch.int64)
    d1 = torch.searchsorted(rowptr, ends.to(rowptr.dtype), right=True).sub_(1).to(torch.int64)
    base = d0 - d0 % align
    first = base * heads // k
    last = ((d1 + 1) * heads + k - 1) // k
    return int((last - first).max()) * lay.group_size


def _gatv2_reader_bytes(role: str, lay, c: int, heads: int, channels: int, item: int,
                        span_codes: int) -> tuple[int, int, int, int]:  # fmt: skip
    """What reading a compressed GATv2 input of layout ``lay`` in parts (``role`` "source":
    `_SourceRows`, "destination": `_DestinationRows`, both through `_Codes`) holds:
    ``(kept, made, peak, result)``: bytes kept from the reader's making to the end of the
    backward, at most held while it is made, at most held by one gather of ``c`` edges, and
    the gather's result (``item`` bytes an element)."""
    rows, groups = lay.rows, lay.num_groups
    lo_scale = 8 * groups * lay.rows_per_group  # fp32 lo and scale per (node, head) row
    meta = _META_GROUP_BYTES * groups + _META_ROW_BYTES * groups * lay.rows_per_group
    hc = heads * channels
    # a gather's decoding: the uint8 codes gathered, their fp32 values, the gathered lo and
    # scale, and the values in the input's dtype where it is not fp32
    decode = c * hc * (1 + 4 + (item if item != 4 else 0)) + 8 * c * heads
    result = c * hc * item
    if role == "source":  # every code unpacked once (one byte each), then gathered
        codes = groups * lay.group_size
        return lo_scale + codes, max(meta, lo_scale + _UNPACK_BYTES * codes), decode, result
    # a gather chunk's destination rows unpacked, then gathered by destination
    del rows
    unpack = max(_UNPACK_BYTES * span_codes, span_codes + 8 * c + c * hc)
    return lo_scale, meta, max(unpack, decode), result


def _lean_gatv2_backward_bytes(
    num_src: int,
    num_dst: int,
    num_edges: int,
    heads: int,
    channels: int,
    l_dtype: torch.dtype,
    r_dtype: torch.dtype,
    att_dtype: torch.dtype,
    p: float,
    permuted: bool,
    chunk_bytes: int,
    need_l: bool,
    need_r: bool,
    need_att: bool,
    readers: tuple = (),
) -> int:
    """Upper bound of the bytes `GatV2AttentionFunction.backward` under `lean_backward`
    creates and holds at once (tensors it allocates, its outputs included; not its inputs),
    read off its code as `_lean_gat_backward_bytes` is: the most over its phases, every
    tensor an edge-chunk iteration allocates counted as alive together. ``readers``: per
    input handed compressed and read in parts, ``(role, layout, span_codes)``
    (`_gatv2_reader_bytes`); the others are dense (the replay's noisy copy, or a tensor kept
    as it is). Per gather chunk of ``c`` edges and wide chunk of
    ``w = c * C`` (``H`` heads, ``a`` bytes per accumulated element, ``o`` per output
    element):

    - always: the readers' kept bytes (codes, per-row lo and scale), the destinations of a
      wide chunk and of the one before it, the marks of its rows, the chunk starts' tensors;
    - making the readers: the metadata's decoding, the source codes' unpacking, the gather
      chunks' bounds;
    - the logits (E x H, kept until the second pass): per gather the destination rows'
      gather, its accumulator copy (``z``), the source rows' gather added into it;
    - the softmax statistics (N_dst x H twice): per wide chunk the scores' copy and the
      gathered max, and the first loop's last copy;
    - the dropout draw: its ``o``-sized noise, the bool mask, the permuted mask;
    - the first pass: ``grad alpha`` (E x H), ``dot``, ``grad x_l`` (N_src x H x C); per
      wide chunk alpha (two w x H while made), the multiplier, ``beta``, and per gather the
      incoming gradient's gather with its accumulator copy and the source rows' gather with
      its copy, or ``alpha * grad alpha``;
    - the second pass: per wide chunk alpha and ``dot`` gathered;
    - the third pass: ``grad x_r`` (N_dst x H x C), ``grad att``; per gather ``z`` and either
      gather, or the leaky ReLU of ``z`` with the einsum's operand copies and result, or
      the slope and its bool mask;
    - at the end the outputs' copies in their input dtypes where they differ from ``a``,
      with the logits' gradient (the third pass's last view of it holds it).

    Zero-dimensional tensors (the multiplier of ``p == 1``) are covered by a fixed 1 KiB."""
    acc = _acc_dtype(l_dtype)
    out_dtype = torch.promote_types(l_dtype, att_dtype)
    a, o = _item(acc), _item(out_dtype)
    li, ri, ti = _item(l_dtype), _item(r_dtype), _item(att_dtype)
    h, hc = heads, heads * channels
    item = torch.finfo(acc).bits // 8
    quarter = num_src * hc * item // 4
    c = edge_chunk_size(num_edges, heads, channels, l_dtype, min(chunk_bytes, quarter))
    wide = max(1, c * channels)
    w = min(wide, num_edges)
    c = min(c, max(w, 1))
    n_wide = -(-num_edges // wide)
    n_gather = -(-num_edges // max(c, 1))

    # the two inputs' gathers: (kept, made, peak, result) per role
    src = (0, 0, c * hc * li, c * hc * li)
    dst = (0, 0, c * hc * ri, c * hc * ri)
    bounds = 0
    for role, lay, span in readers:
        if role == "source":
            src = _gatv2_reader_bytes(role, lay, c, h, channels, li, span)
        else:
            dst = _gatv2_reader_bytes(role, lay, c, h, channels, ri, span)
            bounds = 32 * n_gather  # the gather chunks' first and last edges and their rows
    kept = src[0] + dst[0]
    z = c * hc * a

    def to_acc(peak: int, result: int, size: int) -> int:  # a gather and its copy to ``a``
        return max(peak, result + z if size != a else 0)

    src_acc, dst_acc = to_acc(src[2], src[3], li), to_acc(dst[2], dst[3], ri)
    drawn = 0.0 < p < 1.0 and num_edges * h > 0
    mask = num_edges * h if drawn else 0
    logit = num_edges * h * a
    stats = 2 * num_dst * h * a
    index = 16 * w + 16 * (num_dst + 1) + 48 * n_wide
    att_acc = hc * a if ti != a else 0
    g_l = num_src * hc * a if need_l else 0
    g_r = num_dst * hc * a if need_r else 0
    g_att = hc * a if need_att else 0
    wh = w * h

    phases = [kept + max(dst[1], dst[0] + src[1]) + bounds + 48 * n_wide]
    phases.append(kept + logit + att_acc + index + max(dst_acc, z + src[2]))
    # the first loop's last scores stay bound through the second loop's copy and gather
    phases.append(kept + logit + stats + index + 3 * wh * a)
    if drawn:
        phases.append(kept + logit + stats + num_edges * h * (o + 1 + int(permuted)))
    g_out = c * hc * (o + (a if o != a else 0))
    inner = max(g_out, z + src_acc, wh * a)
    it = max(2 * wh * a, wh * a + (wh * o if drawn else 0) + (wh * a if drawn and need_l else 0)
             + inner)  # fmt: skip
    g_alpha = logit + num_dst * h * a  # grad alpha (E x H) and dot
    phases.append(kept + logit + stats + mask + g_alpha + g_l + index + it)
    phases.append(kept + logit + stats + g_alpha + g_l + index + 2 * wh * a)
    att_work = 2 * z + c * h * a + hc * a if need_att else 0
    it = max(dst_acc, z + src[2], z + att_work, z + z + c * hc)
    phases.append(kept + logit + g_l + g_r + g_att + att_acc + index + it)
    ends = (
        (num_src * hc * li if need_l and l_dtype != acc else 0)
        + (num_dst * hc * ri if need_r and r_dtype != acc else 0)
        + (hc * ti if need_att and att_dtype != acc else 0)
    )
    # the third pass's last view of the logits' gradient keeps it (E x H) to the end
    phases.append(kept + logit + g_l + g_r + g_att + index + ends)
    return max(phases) + 1024


class GatV2AttentionFunction(torch.autograd.Function):
    """The edge stage of `GATv2Conv` on a destination-sorted CSR.

    ``forward(x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes)``:
    ``x_l`` N_src x H x C (source, also the message), ``x_r`` N_dst x H x C, ``att`` 1 x H x C;
    ``dropout`` and ``perm`` as in `GatAttentionFunction`. Returns ``out[i] = sum_j
    dropout(softmax_j(<att, leaky_relu(x_l[j] + x_r[i])>)) * x_l[j]``. Saves ``x_l``, ``x_r``,
    ``att``, ``rowptr``, ``col``, ``perm`` and the generator state of the draw.

    The logits cost a chunk x H x C gather each, so they are made once per pass and kept
    whole (E x H); the softmax's per-destination max and sum, the coefficients and (in
    backward) the logits' gradient are made a chunk at a time as in `GatAttentionFunction`.
    What it holds at once: the logits, the dropout's bool keep-mask and, in backward, one more
    E x H tensor (the coefficients' gradient, then the logits' in its place).

    ``x_l`` and ``x_r`` are saved as their (N * H) x C views (the same quantization groups
    as N x H x C), so that inside the sensitivity probe's work (`reads_row_chunks`) a
    compressed one arrives as a matrix it reads in parts: ``x_r`` a gather chunk's rows at a
    time (`_DestinationRows`), ``x_l`` from its unpacked codes (`_SourceRows`, a quarter of an
    fp32 copy). That backward, which the probe runs on top of the user's, then holds no
    dequantized copy of either; its edge chunks are smaller there too (`_chunks`). A plain
    step's backward is handed dense copies (``reads_rows_every_step`` off): reading in parts
    costs CPU time that the copy's memory, one input's, does not repay there.
    """

    reads_row_chunks = True
    reads_rows_every_step = False

    @staticmethod
    @package_work  # grad is off in here: the forward's pointwise mode would rewrite nothing
    def forward(ctx, x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes):
        _check_common(x_l, rowptr, col, dropout, perm)
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads = x_l.shape[1]
        acc = _acc_dtype(x_l.dtype)
        if x_r.dim() != 3 or x_r.shape[1:] != x_l.shape[1:] or x_r.shape[0] != num_dst:
            raise ValueError(
                f"x_r must be N_dst x H x C = {(num_dst, *x_l.shape[1:])}, got {tuple(x_r.shape)}"
            )
        chunk, wide = _chunks(x_l, rowptr, col, chunk_bytes)
        rows_r = _DestinationRows(x_r, rowptr, *x_l.shape[1:])
        logit = _gatv2_logits(x_l, rows_r, att, wide, negative_slope, chunk)
        del rows_r
        m, total = _segment_stats(_kept(logit), wide, num_dst, heads, acc, x_l.device)
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)  # PyG's alpha and message
        mask, state = _attention_dropout(dropout, num_edges, heads, out_dtype, x_l.device, perm)
        out = _aggregate(
            x_l, _kept_softmax(logit, m, total), mask, dropout, out_dtype, wide, chunk, num_dst,
        )  # fmt: skip
        del mask

        # (N * H) x C views where they are views (see the class docstring); one tensor when
        # x_l is x_r (shared weights), saved once
        same = x_r is x_l
        num_src, l_dtype, r_dtype = x_l.shape[0], x_l.dtype, x_r.dtype
        if x_l.is_contiguous():
            x_l = x_l.view(-1, x_l.shape[-1])
        if same:
            x_r = x_l
        elif x_r.is_contiguous():
            x_r = x_r.view(-1, x_r.shape[-1])
        ctx.save_for_backward(x_l, x_r, att, rowptr, col, perm, state)
        ctx.negative_slope = float(negative_slope)
        ctx.dropout = float(dropout)
        ctx.chunk_bytes = int(chunk_bytes)
        # what `lean_backward_bytes` reads (the saved tensors themselves would be unpacked);
        # the CSR's row starts (the adjacency's own tensor, no copy) give the destination
        # rows a gather chunk spans
        ctx.shapes = (
            num_src, num_dst, num_edges, heads, x_l.shape[-1], l_dtype, r_dtype, att.dtype,
            perm is not None,
        )  # fmt: skip
        ctx.rowptr = rowptr
        return out.to(out_dtype)

    @staticmethod
    def lean_backward_bytes(ctx, layouts=(), walk: bool = False) -> int | None:
        """An upper bound of the bytes `backward` run under `lean_backward` creates and holds
        at once (its outputs included, its saved inputs and ``grad_out`` not) in the sensitivity
        probe's work (`gact_graph.budget.probe_cost`), ``layouts`` the group layouts of the
        compressed inputs the node read (`gact_graph.core.quantize.QTensor.layout`), in the
        order it read them: in a replay of one of them (``walk`` false) that one is handed as
        the replay's dense copy and the other, if compressed, handed compressed and read in
        parts (`reads_row_chunks`); in the probe's walk through the node (``walk``) every
        compressed one is. At any code width; the most over which input is replayed and
        which role (source or destination) a compressed one may have (its rows tell, where
        the node counts differ). None where a layout read in parts is not one `_Codes` reads
        (the backward would dequantize it whole) or more than two are compressed.
        `_lean_gatv2_backward_bytes` derives it from the code of `backward`."""
        num_src, num_dst, num_edges, heads, channels, l_dtype, r_dtype, att_dtype, permuted = (
            ctx.shapes
        )
        layouts = list(layouts)
        parts = layouts if walk or len(layouts) == 2 else []  # those read in parts
        if len(layouts) > 2 or not all(map(_codes_readable, parts)):
            return None
        acc = _acc_dtype(l_dtype)
        quarter = num_src * heads * channels * (torch.finfo(acc).bits // 8) // 4
        chunk = edge_chunk_size(num_edges, heads, channels, l_dtype,
                                min(ctx.chunk_bytes, quarter))  # fmt: skip

        def roles(lay) -> list:  # what reading ``lay`` in parts can be
            out = []
            if lay.rows == num_src * heads:
                out.append(("source", lay, 0))
            if lay.rows == num_dst * heads:
                span = _gatv2_span_codes(ctx.rowptr, num_edges, chunk, heads, lay)
                out.append(("destination", lay, span))
            return out

        if any(not roles(lay) for lay in parts):
            return None
        if walk:  # every compressed input read in parts, in any assignment of the roles
            options = [()] if not layouts else [(r,) for r in roles(layouts[0])]
            if len(layouts) == 2:
                options = [
                    (a, b) for a in roles(layouts[0]) for b in roles(layouts[1]) if a[0] != b[0]
                ]
        else:  # one replayed (dense), the other (either) read in parts
            options = [()] + [(r,) for lay in parts for r in roles(lay)]
        if not options:  # two compressed reads that cannot be one source, one destination
            return None
        need = tuple(ctx.needs_input_grad[:3])
        args = (num_src, num_dst, num_edges, heads, channels, l_dtype, r_dtype, att_dtype,
                ctx.dropout, permuted, ctx.chunk_bytes, *need)  # fmt: skip
        return max(_lean_gatv2_backward_bytes(*args, readers=r) for r in options)

    @staticmethod
    @differentiable_once("the fused graph attention (sparse=True)")
    def backward(ctx, grad_out):
        with reading_rows(ctx._forward_cls.reads_rows_every_step):
            x_l, x_r, att, rowptr, col, perm, state = ctx.saved_tensors
        need_l, need_r, need_att = ctx.needs_input_grad[:3]
        num_edges, num_dst = col.numel(), rowptr.numel() - 1
        heads, channels = att.shape[-2:]
        acc = _acc_dtype(x_l.dtype)
        slope, p = ctx.negative_slope, ctx.dropout
        # compressed ones stay so: read a gather chunk at a time
        rows_r = _DestinationRows(x_r, rowptr, heads, channels)
        x_l = _SourceRows(x_l, heads, channels)
        del x_r
        chunk, wide = _chunks(x_l, rowptr, col, ctx.chunk_bytes, lean=is_lean())
        rows_r.bounds(chunk)
        logit = _gatv2_logits(x_l, rows_r, att, wide, slope, chunk)
        m, total = _segment_stats(_kept(logit), wide, num_dst, heads, acc, x_l.device)
        out_dtype = torch.promote_types(x_l.dtype, att.dtype)
        mask, _ = _attention_dropout(p, num_edges, heads, out_dtype, x_l.device, perm, state)

        # Pass 1 (chunk x H x C): x_l's gradient through the message, the coefficients'.
        grad_l, grad_s, dot = _aggregate_backward(
            [x_l], grad_out, _kept_softmax(logit, m, total), mask, p, out_dtype, acc, wide,
            chunk, num_dst, True, need_l,
        )  # fmt: skip
        del mask
        # Pass 2 (chunk x H): grad logit = (grad alpha - dot[dst]) * alpha, in grad_s's place.
        for s, e, _, dst_w in wide:
            alpha = _chunk_softmax(logit, s, e, dst_w, m, total)
            grad_s[s:e].sub_(dot.index_select(0, dst_w)).mul_(alpha)
            del alpha
        del logit, dot, m, total
        grad_logit = grad_s

        # Pass 3 (chunk x H x C): through <att, leaky_relu(x_l[src] + x_r[dst])>.
        grad_r = grad_att = None
        att_acc = att.reshape(1, heads, channels).to(acc)
        if need_r:
            grad_r = torch.zeros(rows_r.shape, dtype=acc, device=rows_r.device)
        if need_att:
            grad_att = torch.zeros(heads, channels, dtype=acc, device=att.device)
        if need_l or need_r or need_att:
            for s, e, col_w, dst_w in wide:
                for a in range(0, e - s, chunk):
                    b = min(a + chunk, e - s)
                    z = rows_r.gather(s + a, dst_w[a:b]).to(acc)
                    z.add_(x_l.index_select(0, col_w[a:b]))
                    gl = grad_logit[s + a : s + b]
                    if need_att:
                        # grad att[h, c] += sum_e grad_logit[e, h] * leaky_relu(z)[e, h, c]; a
                        # backward() inside autocast would run this bmm in bf16/fp16 (amp.py)
                        with autocast_off(z.device):
                            grad_att += torch.einsum("eh,ehc->hc", gl, F.leaky_relu(z, slope))
                    # grad z = grad_logit * att * leaky_relu'(z), reusing z's buffer.
                    slope_of_z = _leaky_relu_slope(z, slope, acc)
                    torch.mul(gl.unsqueeze(-1), att_acc, out=z)
                    z.mul_(slope_of_z)
                    del slope_of_z
                    if grad_l is not None:
                        grad_l.index_add_(0, col_w[a:b], z)
                    if grad_r is not None:
                        grad_r.index_add_(0, dst_w[a:b], z)
                    del z
        del grad_logit, grad_s
        if grad_l is not None:
            grad_l = grad_l.to(x_l.dtype).view(x_l.shape)
        if grad_r is not None:
            grad_r = grad_r.to(rows_r.dtype)
        if grad_att is not None:
            grad_att = grad_att.reshape(att.shape).to(att.dtype)
        return grad_l, grad_r, grad_att, None, None, None, None, None, None


def _kept(scores: Tensor):
    """`_segment_stats`'s ``scores`` for scores kept whole: a copy of each chunk's rows."""
    return lambda s, e, col, dst: scores[s:e].clone()


def _kept_softmax(scores: Tensor, m: Tensor, total: Tensor):
    """`_aggregate`'s ``coefficients`` from scores kept whole and `_segment_stats`."""
    return lambda s, e, col, dst: _chunk_softmax(scores, s, e, dst, m, total)


def _chunk_softmax(scores: Tensor, s: int, e: int, dst: Tensor, m: Tensor, total: Tensor):
    """Softmax coefficients of edges ``s:e`` from their kept scores and `_segment_stats`."""
    return (scores[s:e] - m.index_select(0, dst)).exp_().div_(total.index_select(0, dst))


def gatv2_attention(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    perm: Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Tensor:
    """`GatV2AttentionFunction.apply` with keyword defaults."""
    return GatV2AttentionFunction.apply(
        x_l, x_r, att, rowptr, col, negative_slope, dropout, perm, chunk_bytes
    )


def gatv2_attention_reference(
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    rowptr: Tensor,
    col: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    seed: int | None = None,
) -> Tensor:
    """Stock-autograd oracle of `gatv2_attention` (materializes E x H x C; tests only)."""
    dst = csr_destinations(rowptr, col.numel())
    z = F.leaky_relu(x_l[col] + x_r[dst], negative_slope)
    logit = (z * att.reshape(1, *x_l.shape[1:])).sum(-1)
    return _attend_reference(logit, x_l, col, dst, rowptr.numel() - 1, dropout, seed)


# ---------------------------------------------------------------------------- PyG patching
def _chunk_bytes(ctl) -> int:
    return int(ctl.config.extra.get("chunk_bytes", DEFAULT_CHUNK_BYTES))


def _message_passing_reason(module, edge_index) -> str | None:
    """Why a MessagePassing call must take PyG's own path (None: the fused path is exact)."""
    if not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided:
        return "sparse adj"
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        return "edge_index shape"
    if getattr(module, "aggr", "add") not in ("add", "sum"):
        return f"aggr={module.aggr}"
    return message_passing_reason(module)


def _square_nodes(x) -> tuple[int | None, str | None]:
    """(number of nodes, None) when source and destination node sets are one and the same
    size; (None, reason) otherwise."""
    if isinstance(x, Tensor):
        return (x.size(0), None) if x.dim() == 2 else (None, "x shape")
    if isinstance(x, (tuple, list)) and len(x) == 2:
        x_s, x_d = x
        if not isinstance(x_s, Tensor) or not isinstance(x_d, Tensor) or x_s.dim() != 2:
            return None, "bipartite"
        if x_s.size(0) != x_d.size(0):
            return None, "bipartite"
        return x_s.size(0), None
    return None, "x type"


def _projections(module) -> tuple:
    """(source, destination) projection modules of a `GATConv`."""
    if module.lin is not None:
        return module.lin, module.lin
    return module.lin_src, module.lin_dst


def _foldable(lin) -> bool:
    """A projection whose output is ``h @ W^T`` and nothing else (the logits fold into it)."""
    return type(lin) in (PygLinear, torch.nn.Linear) and lin.bias is None


def _attention_reason(module, edge_index, edge_attr, return_attention_weights) -> str | None:
    """Why a `GATConv` / `GATv2Conv` call must take PyG's path, as far as the two share it."""
    if return_attention_weights:
        return "return_attention_weights"
    if edge_attr is not None and module.lin_edge is not None:
        return "edge_attr"
    return _message_passing_reason(module, edge_index)


@package_work  # checks of types and shapes: nothing the forward's pointwise mode rewrites
def _gat_reason(module, x, edge_index, edge_attr, size, return_attention_weights) -> str | None:
    reason = _attention_reason(module, edge_index, edge_attr, return_attention_weights)
    if reason is not None:
        return reason
    num_nodes, reason = _square_nodes(x)
    if reason is not None:
        return reason
    if size is not None and tuple(size) != (num_nodes, num_nodes):
        return "size"
    if not all(_foldable(lin) for lin in _projections(module)):
        return "projection is not a bias-free Linear"
    return _dropout_reason(module, x)


def _dropout_reason(module, x) -> str | None:
    x_s = x if isinstance(x, Tensor) else x[0]
    if module.training and module.dropout > 0 and x_s.device.type not in ("cpu", "cuda"):
        return f"attention dropout on {x_s.device.type}"
    return None


@package_work  # products, sums and a matmul: nothing the forward's pointwise mode rewrites
def _node_logits(ctl, h: Tensor, pairs, dtype: torch.dtype) -> list[Tensor]:
    """``<lin(h)_i, att>`` per head (N x H, in ``dtype``) for each ``(lin, att)`` of ``pairs``,
    computed as ``h @ (W^T att)``: from the projection's input, never from its (quantized)
    output; see the module docstring. One matmul for all of them: backward then reads ``h``
    (dequantized, N x F_in) once and forms one N x F_in gradient, rather than one
    dequantization, matmul and gradient per pair, summed."""
    blocks = []
    for lin, _ in pairs:
        if is_lazy(lin.weight):  # stock's call of this projection would initialize it
            with torch.no_grad():
                lin(h)
    with autocast_off(h.device):  # stock's logits are an elementwise product: no autocast
        compute = torch.promote_types(h.dtype, dtype)
        for lin, att in pairs:
            heads, channels = att.shape[-2:]
            blocks.append(
                (lin.weight.view(heads, channels, -1) * att.view(heads, channels, 1)).sum(1)
            )
        w_att = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).to(compute)
        if torch.is_grad_enabled():  # (sum of H) x F_in, small; rounding it would only add noise
            ctl.keep_lossless(w_att, "activation")
        logits = F.linear(h.to(compute), w_att).to(dtype)
    if len(blocks) == 1:
        return [logits]
    # separate tensors, as when computed apart (small: N x H each)
    return [part.contiguous() for part in logits.split([b.shape[0] for b in blocks], dim=1)]


@package_work  # sums, a mean and a view: nothing the forward's pointwise mode rewrites
def _finish(module, out: Tensor, res: Tensor | None) -> Tensor:
    """Stock's end of a GAT layer: heads concatenated (or averaged), plus the residual, plus
    the bias, summed into the edge stage's output (`add_into`) while it is still N x H x C,
    not a view: no N x H x C sum beside its terms."""
    heads, channels = out.shape[1:]
    if module.concat:
        terms = [None if res is None else res.reshape(-1, heads, channels),
                 None if module.bias is None else module.bias.view(heads, channels)]  # fmt: skip
    else:
        out = out.mean(dim=1)
        terms = [res, module.bias]
    for t in terms:
        if t is not None:
            out = add_into(out, t)
    return out.view(-1, heads * channels) if module.concat else out


def _gat_fused_forward(ctl, module, x, edge_index) -> Tensor:
    """`GATConv.forward` (PyG 2.8.1) with the edge stage replaced by `GatAttentionFunction`
    and the node logits computed by `_node_logits`."""
    heads, channels = module.heads, module.out_channels
    x_s, x_d = (x, x) if isinstance(x, Tensor) else x
    res = module.res(x_d) if module.res is not None else None
    lin_src, lin_dst = _projections(module)
    x_src = lin_src(x_s).view(-1, heads, channels)
    # Stock's destination projection feeds only its logits: not computed here.
    dtype = torch.promote_types(x_src.dtype, module.att_src.dtype)  # stock's logits' dtype
    if x_s is x_d:
        a_src, a_dst = _node_logits(
            ctl, x_s, [(lin_src, module.att_src), (lin_dst, module.att_dst)], dtype
        )
    else:
        (a_src,) = _node_logits(ctl, x_s, [(lin_src, module.att_src)], dtype)
        (a_dst,) = _node_logits(ctl, x_d, [(lin_dst, module.att_dst)], dtype)
    # The softmax of quantized logits would be far off and they are small (N x H): lossless.
    if torch.is_grad_enabled():  # (nothing is saved otherwise)
        ctl.keep_lossless(a_src, "activation")
        ctl.keep_lossless(a_dst, "activation")

    p = float(module.dropout) if module.training else 0.0
    adj = _get_adjacency(
        ctl, edge_index, x_src.size(0), module.add_self_loops,
        _stock_draw(ctl, module, x_src, a_src),
    )  # fmt: skip
    if fused_kernel_applies(x_src, a_src, p, lossless=ctl.config.lossless):
        keep = (lambda t: ctl.keep_lossless(t, "activation")) if torch.is_grad_enabled() else None
        out = gat_attention_fused(
            x_src, a_src, a_dst, adj.rowptr, adj.col, module.negative_slope, p,
            transpose=_adjacency_transpose(adj, p), keep_lossless=keep,
        )  # fmt: skip
    else:
        out = gat_attention(
            x_src, a_src, a_dst, adj.rowptr, adj.col, module.negative_slope, p, adj.perm,
            chunk_bytes=_chunk_bytes(ctl),
        )  # fmt: skip
    # The projection is saved (compressed) by now: its fp32 copy goes before the sums below.
    # The residual's projection stays before the edge stage, as in stock: made after it, it
    # would hold one tensor less in forward but run first in backward, where the default
    # mode's probed steps then peak higher (docs/design.md).
    del x_src, a_src, a_dst
    return _finish(module, out, res)


@package_work  # checks of types and shapes: nothing the forward's pointwise mode rewrites
def _gatv2_reason(module, x, edge_index, edge_attr, return_attention_weights) -> str | None:
    reason = _attention_reason(module, edge_index, edge_attr, return_attention_weights)
    if reason is not None:
        return reason
    _, reason = _square_nodes(x)
    return reason or _dropout_reason(module, x)


def _gatv2_fused_forward(ctl, module, x, edge_index) -> Tensor:
    """`GATv2Conv.forward` (PyG 2.8.1) with the edge stage replaced by
    `GatV2AttentionFunction`."""
    heads, channels = module.heads, module.out_channels
    x_s, x_d = (x, x) if isinstance(x, Tensor) else x
    res = module.res(x_d) if module.res is not None else None
    x_l = module.lin_l(x_s).view(-1, heads, channels)
    if x_s is x_d and module.share_weights:
        x_r = x_l
    else:
        x_r = module.lin_r(x_d).view(-1, heads, channels)

    same_dtype = x_r.dtype == x_l.dtype
    adj = _get_adjacency(
        ctl, edge_index, x_l.size(0), module.add_self_loops,
        module.dropout > 0 and (not same_dtype or _stock_draw(ctl, module, x_l, module.att)),
    )  # fmt: skip
    p = float(module.dropout) if module.training else 0.0
    lossless = ctl.config.lossless
    if same_dtype and fused_kernel_applies(x_l, module.att, p, lossless):
        out = gatv2_attention_fused(
            x_l, x_r, module.att, adj.rowptr, adj.col, module.negative_slope, p,
            transpose=_adjacency_transpose(adj, p),
            recompute_stats=torch.is_grad_enabled() and not lossless,
        )  # fmt: skip
    else:
        out = gatv2_attention(
            x_l, x_r, module.att, adj.rowptr, adj.col, module.negative_slope, p, adj.perm,
            chunk_bytes=_chunk_bytes(ctl),
        )  # fmt: skip
    del x_l, x_r  # saved by now (see GATConv's)
    return _finish(module, out, res)


@register_patcher(GATConv)
def patch_gat_conv(ctl, path: str, module) -> None:
    """Run ``module`` (a `GATConv`) through `GatAttentionFunction` whenever that is exact;
    other calls (edge features, attention weights requested, sparse adjacency types, bipartite
    graphs of two sizes, explain mode, message hooks) take PyG's own forward, and
    ``ctl.module_paths[path]`` says which ran last."""
    original = module.forward

    def forward(x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
        args = (x, edge_index, edge_attr, size, return_attention_weights)
        return _route(ctl, path, _gat_reason(module, *args), lambda: original(*args),
                      lambda: _gat_fused_forward(ctl, module, x, edge_index))  # fmt: skip

    install_forward(ctl, path, module, forward)


@register_patcher(GATv2Conv)
def patch_gatv2_conv(ctl, path: str, module) -> None:
    """`patch_gat_conv` for `GATv2Conv` (`GatV2AttentionFunction`)."""
    original = module.forward

    def forward(x, edge_index, edge_attr=None, return_attention_weights=None):
        args = (x, edge_index, edge_attr, return_attention_weights)
        return _route(ctl, path, _gatv2_reason(module, *args), lambda: original(*args),
                      lambda: _gatv2_fused_forward(ctl, module, x, edge_index))  # fmt: skip

    install_forward(ctl, path, module, forward)


def _route(ctl, path: str, reason: str | None, stock, fused):
    """Run ``fused()`` (and record ``"sparse-fused"`` as the path of ``path``), or, given a
    ``reason``, ``stock()`` (recorded as generic, with the reason)."""
    if reason is not None:
        ctl.module_paths[path] = f"generic ({reason})"
        return stock()
    ctl.module_paths[path] = "sparse-fused"
    return fused()


def _get_adjacency(ctl, edge_index, num_nodes: int, add_self_loops: bool, stock_draw: bool):
    # GATConv / GATv2Conv: remove_self_loops, then add_self_loops (every node one loop). Where
    # the chunked stage draws attention dropout stock's way (``stock_draw``), ``perm`` puts the
    # mask in PyG's edge order; asked for in eval mode too, so that train and eval share one
    # cached adjacency. The fused kernels draw in CSR order and need no ``perm`` (4 bytes per
    # edge).
    return get_adjacency(
        ctl, edge_index, num_nodes, add_self_loops=add_self_loops, normalize=False,
        loop_mode="replace", keep_perm=stock_draw,
    )  # fmt: skip


def _stock_draw(ctl, module, x: Tensor, logits: Tensor) -> bool:
    """Whether ``module``'s attention dropout, in training, is drawn stock's way (on the
    chunked stage: `fused_kernel_applies` says no)."""
    p = float(module.dropout)
    return p > 0 and not fused_kernel_applies(x, logits, p, lossless=ctl.config.lossless)
