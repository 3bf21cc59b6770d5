"""Bias and bytes of what ELU, GELU and SiLU keep for backward (`gact_graph.ops.inverted`).

Bias: GCNConv -> BatchNorm -> activation -> GCNConv on a 64-node random graph, fixed bits
(``compress_gnn(model, bits, adaptive=False, min_numel=0)``), the gradient of every parameter
averaged over ``--seeds`` rounding seeds. Printed: the error of that mean against stock's
gradient over the noise floor (the spread of one seed's gradient over sqrt(seeds)); about 1
where the rounding is unbiased, growing like sqrt(seeds) where it is not. With the pointwise
ops (``pointwise=True``) and on the generic path (``pointwise=False``: the input quantized).

Bytes: what the activation adds to ``ctl.stats()``'s stored bytes per element of its input
(a 4096 x 256 Linear -> activation -> Linear, against the same model with ``t * 1`` in its
place), where the next layer keeps the output itself and where dropout sits between.

Run: OMP_NUM_THREADS=1 python benchmarks/activation_bias.py [--seeds 128] [--bits 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCNConv

from gact_graph import compress_gnn

ACTS = {"elu": F.elu, "gelu": F.gelu, "silu": F.silu}


def bias_ratio(act, pointwise: bool, seeds: int, bits: int, n: int = 64, hidden: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn = GCNConv(16, hidden), nn.BatchNorm1d(hidden)
            self.conv2 = GCNConv(hidden, 4)

        def forward(self, x, ei):
            return self.conv2(act(self.bn(self.conv1(x, ei))), ei)

    torch.manual_seed(0)
    model = Net()

    def grads():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ei), y).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, runs = grads(), []
    for seed in range(seeds):
        kw = dict(adaptive=False, min_numel=0, seed=seed, pointwise=pointwise)
        with compress_gnn(model, bits=bits, **kw):
            runs.append(grads())
    runs = torch.stack(runs)
    mean = runs.mean(0)
    floor = ((runs - mean).square().sum(1).mean() / (seeds - 1)).sqrt()
    return float((mean - ref).norm() / floor)


class _LinActLin(nn.Module):
    def __init__(self, act, dropout: bool):
        super().__init__()
        self.a, self.c, self.act, self.dropout = nn.Linear(64, 256), nn.Linear(256, 8), act, dropout

    def forward(self, x):
        h = self.act(self.a(x))
        return self.c(F.dropout(h, 0.5) if self.dropout else h)


def bytes_per_element(act, dropout: bool, bits: int | None) -> float:
    x = torch.randn(4096, 64)

    def stored(fn) -> int:
        torch.manual_seed(0)
        model = _LinActLin(fn, dropout)
        with compress_gnn(model, bits=bits, adaptive=False, min_numel=0, sparse=False) as ctl:
            out = model(x)
            nbytes = ctl.stats()["total"]["stored_bytes"]
            out.sum().backward()
        return nbytes

    return (stored(act) - stored(lambda t: t * 1)) / (4096 * 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    print(f"error of the mean over the noise floor, {args.bits} bits, {args.seeds} seeds")
    for name, act in ACTS.items():
        ours, generic = (bias_ratio(act, pw, args.seeds, args.bits) for pw in (True, False))
        print(f"  {name:5s} pointwise {ours:5.2f}   generic {generic:5.2f}", flush=True)
    print("bytes per element the activation adds (pointwise), next layer keeps y / dropout between")
    for name, act in ACTS.items():
        row = [
            f"bits={bits}: {bytes_per_element(act, False, bits):.3f} / "
            f"{bytes_per_element(act, True, bits):.3f}"
            for bits in (None, 4, 2)
        ]
        print(f"  {name:5s}", "   ".join(row), flush=True)


if __name__ == "__main__":
    main()
