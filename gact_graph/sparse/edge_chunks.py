"""The chunked edge stage's machinery, shared by GAT's and GATv2's chunked Functions
(`gact_graph.sparse.gat`, `gact_graph.sparse.gatv2`): edge chunks over a destination-sorted
CSR (`EdgeChunks`, `chunking`, `edge_chunk_size`), stock's attention dropout drawn and
replayed (`attention_dropout`), a segment softmax's per-destination statistics
(`segment_stats`) and the weighted aggregation with its backward (`aggregate`,
`aggregate_backward`), and the stock-autograd reference both Functions are tested against
(`attend_reference`).

Each chunk's temporaries (at most three chunk x H x C tensors alive at once) total at most
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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "EdgeChunks",
    "acc_dtype",
    "aggregate",
    "aggregate_backward",
    "attend_reference",
    "attention_dropout",
    "check_edge_stage",
    "chunking",
    "csr_destinations",
    "edge_chunk_size",
    "item_bytes",
    "lean_chunk_size",
    "leaky_relu_backward_",
    "leaky_relu_slope",
    "segment_stats",
]

#: Bytes of the edge-chunk temporaries (chunk x H x C tensors) alive at once in the chunked
#: gather-scatter; ``compress_gnn(..., chunk_bytes=...)`` changes it (shared with `spmm`).
DEFAULT_CHUNK_BYTES = 64 * 2**20


#: Chunk x H x C tensors alive at once: two in GAT's backward, three in GATv2's.
_LIVE_CHUNK_TENSORS = 3


#: Chunks are never made smaller than this for the node-relative cap of `edge_chunk_size`
#: (a few large kernels per layer, not hundreds of small ones, on small graphs).
_MIN_CHUNK_BYTES = 4 * 2**20


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
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
    item = torch.finfo(acc_dtype(dtype)).bits // 8
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


def attention_dropout(
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


def leaky_relu_backward_(grad: Tensor, pre: Tensor, negative_slope: float) -> Tensor:
    """In place: grad * (pre > 0 ? 1 : slope), exactly as ATen's leaky_relu_backward."""
    return grad.mul_(leaky_relu_slope(pre, negative_slope, grad.dtype))


def leaky_relu_slope(pre: Tensor, negative_slope: float, dtype: torch.dtype) -> Tensor:
    """d leaky_relu(pre) / d pre: 1 where pre > 0, else the slope (exact in ``dtype``)."""
    return torch.full(pre.shape, negative_slope, dtype=dtype, device=pre.device).masked_fill_(
        pre > 0, 1.0
    )


def check_edge_stage(x: Tensor, rowptr: Tensor, col: Tensor, p: float, perm: Tensor | None) -> None:
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


class EdgeChunks:
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


def chunking(
    x: Tensor, rowptr: Tensor, col: Tensor, chunk_bytes: int, lean: bool = False
) -> tuple[int, EdgeChunks]:
    """``(chunk, wide)`` of an edge stage over features ``x`` (N x H x C): ``chunk`` edges per
    chunk x H x C gather (`edge_chunk_size`) and the wide chunks, C times longer, on which
    the edge-level (chunk x H) work runs and which the gathers slice: few small kernels per
    gather chunk. ``lean`` (the probe's backwards, `is_lean`): the gathers alive at once
    total at most a quarter of one N x H x C tensor, with no floor, so that the chunk
    temporaries (and the wide chunks' E x H ones, C times fewer elements per edge) stay small
    next to the N x H x C tensors the probe holds; more and smaller kernels on small graphs."""
    heads, channels = x.shape[1:]
    if lean:
        chunk = lean_chunk_size(col.numel(), x.shape[0], heads, channels, x.dtype, chunk_bytes)
    else:
        chunk = edge_chunk_size(col.numel(), heads, channels, x.dtype, chunk_bytes, x.shape[0])
    return chunk, EdgeChunks(rowptr, col, chunk * channels)


def lean_chunk_size(
    num_edges: int, num_src: int, heads: int, channels: int, dtype: torch.dtype, chunk_bytes: int
) -> int:
    """`chunking`'s gather chunk under ``lean``: `edge_chunk_size` with the gathers capped at
    a quarter of one N_src x H x C tensor in the accumulator's dtype, no floor (also what the
    Functions' stated lean bounds count)."""
    quarter = num_src * heads * channels * (torch.finfo(acc_dtype(dtype)).bits // 8) // 4
    return edge_chunk_size(num_edges, heads, channels, dtype, min(chunk_bytes, quarter))


def segment_stats(scores, chunks: EdgeChunks, num_dst: int, heads: int, acc, device):
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


def aggregate(x_src, coefficients, mask, p: float, out_dtype, wide: EdgeChunks, chunk: int,
               num_dst: int) -> Tensor:  # fmt: skip
    """out[d] = sum over edges e into d of alpha[e] * dropout multiplier[e] * x_src[src_e]
    (accumulated in fp32 for half inputs): ``coefficients(s, e, col, dst)`` gives a fresh
    alpha of each wide chunk, whose gathers run ``chunk`` edges at a time."""
    _, heads, channels = x_src.shape
    acc = acc_dtype(x_src.dtype)
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


def aggregate_backward(features: list, grad_out, coefficients, mask, p: float, out_dtype, acc,
                        wide: EdgeChunks, chunk: int, num_dst: int, need_alpha: bool,
                        need_x: bool, split: bool = False):  # fmt: skip
    """Backward of `aggregate`: ``(grad x_src, grad alpha, dot)``. grad x_src[src] += beta *
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


def item_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor: it runs inside a counted backward


def attend_reference(logit, x_src, col, dst, num_dst, dropout, perm) -> Tensor:
    """Stock-autograd softmax (PyG's formula), ``F.dropout`` in stock's edge order, and
    aggregation."""
    from gact_graph.kernels.gat_rows import aggregate_reference, edge_softmax_reference

    alpha = edge_softmax_reference(logit, dst, num_dst)
    if perm is None:
        alpha = F.dropout(alpha, dropout)
    else:  # CSR edge k is stock's edge perm[k]
        alpha = F.dropout(alpha[torch.argsort(perm)], dropout)[perm]
    return aggregate_reference(alpha, x_src, col, dst, num_dst)
