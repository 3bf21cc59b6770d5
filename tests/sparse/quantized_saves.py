"""Saved-tensor hooks that stand in for a compressing controller in the attention tests: the
matrices they pick are quantized and handed back dequantized whole or read a row range at a
time, as the controller and the sensitivity probe hand them."""

import contextlib

import torch

from gact_graph.core.chunked import RowChunked
from gact_graph.core.quantize import quantize

SEED = 11


@contextlib.contextmanager
def saved_as(mode, bits, picks):
    """Hooks that quantize every saved float tensor for which ``picks(t)`` holds and hand it
    back dequantized whole (``"dense"``) or as a `RowChunked` (``"rows"``); yields the list of
    the shapes quantized."""
    packed = []

    def pack(t):
        if t.is_floating_point() and picks(t):
            packed.append(t.shape)
            return quantize(t.detach(), bits, seed=SEED)
        return t

    def unpack(p):
        if not isinstance(p, torch.Tensor):
            return RowChunked(p) if mode == "rows" else p.dequantize()
        return p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield packed


def dequantized(t, bits):
    """``t`` as `saved_as` hands it back: its (rows x last dimension) matrix quantized with
    the hooks' seed and dequantized."""
    flat = t.detach().reshape(-1, t.shape[-1])
    return quantize(flat, bits, seed=SEED).dequantize().view(t.shape)
