"""Bytes saved for backward by the pointwise ops: per element (each op alone), and on a 3-layer
GCN (256 hidden, BN, ReLU, dropout .5) and a GAT (ELU) on a 20k-node random graph.

Run: OMP_NUM_THREADS=1 python benchmarks/bench_pointwise.py [OUT.json]
(default OUT: bench_pointwise.json)
"""

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.datasets import make_synthetic_graph
from gact_graph.memory import saved_bytes_stats
from gact_graph.models import GAT, GCN

torch.manual_seed(0)
OUT = {}


class Op(nn.Module):
    def __init__(self, op, then_linear=False, width=256):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(width, 8) if then_linear else None

    def forward(self, x):
        y = self.op(x * 1.0)  # x * 1.0: the op's input is an activation, not the model input
        return self.lin(y) if self.lin is not None else y


OPS = {
    "relu": torch.relu,
    "leaky_relu(0.2)": lambda t: F.leaky_relu(t, 0.2),
    "hardtanh": F.hardtanh,
    "relu6": F.relu6,
    "clamp(-1,1)": lambda t: torch.clamp(t, -1, 1),
    "dropout(0.5)": lambda t: F.dropout(t, 0.5),
    "elu": F.elu,
    "gelu": F.gelu,
    "silu": F.silu,
}


def per_element(n=20000, f=256):
    rows = []
    x = torch.randn(n, f, requires_grad=True)
    numel = n * f
    for name, op in OPS.items():
        for then_linear in (False, True):
            m = Op(op, then_linear, f)
            stock = saved_bytes_stats(m, lambda m=m: m(x))["total"]["orig_bytes"]
            row = {"op": name, "then_linear": then_linear, "stock": stock / numel}
            for bits in (None, 2):
                for pw in (False, True):
                    with compress_gnn(
                        m, bits=bits, adaptive=False, pointwise=pw, sparse=False
                    ) as ctl:
                        out = m(x)
                        st = ctl.stats()
                        del out
                    row[f"bits={bits},pointwise={pw}"] = st["total"]["stored_bytes"] / numel
            rows.append(row)
    return rows


def model_bytes(model, data, steps=3):
    model.train()
    x, ei = data.x, data.edge_index

    def fwd():
        return model(x, ei)

    stock = saved_bytes_stats(model, fwd)
    res = {"stock_MB": stock["total"]["orig_bytes"] / 2**20}
    for sparse in (False, True):
        for bits in (None, 2):
            for pw in (False, True):
                with compress_gnn(
                    model, bits=bits, adaptive=False, pointwise=pw, sparse=sparse
                ) as ctl:
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        out = fwd()
                        st = ctl.stats()
                        out.square().mean().backward()
                        times.append(time.perf_counter() - t0)
                        ctl.iterate()
                    key = f"sparse={sparse},bits={bits},pointwise={pw}"
                    res[key + "_MB"] = st["total"]["stored_bytes"] / 2**20
                    res[key + "_by_kind_MB"] = {
                        k: round(v["stored_bytes"] / 2**20, 3)
                        for k, v in st["by_kind"].items()
                        if v["count"]
                    }
                    res[key + "_step_s"] = sorted(times)[len(times) // 2]
    return res


def main():
    OUT["per_element"] = per_element()
    OUT["per_element_bf16_note"] = "float32 inputs, CPU"
    print(
        f"{'op':<16} {'next saves y':<12} {'stock':>7} {'ours':>7} {'stock@2b':>9} {'ours@2b':>8}"
    )
    for r in OUT["per_element"]:
        print(
            f"{r['op']:<16} {str(r['then_linear']):<12} {r['stock']:>7.3f} "
            f"{r['bits=None,pointwise=True']:>7.3f} {r['bits=2,pointwise=False']:>9.3f} "
            f"{r['bits=2,pointwise=True']:>8.3f}"
        )
    data = make_synthetic_graph(20000, 137000, 128, 40, seed=0)
    print("graph:", data.num_nodes, "nodes", data.edge_index.size(1), "directed edges")
    OUT["graph"] = {"nodes": data.num_nodes, "edges": data.edge_index.size(1), "features": 128}
    torch.manual_seed(0)
    gcn = GCN(128, 256, 40, num_layers=3, dropout=0.5, batch_norm=True)
    OUT["gcn"] = model_bytes(gcn, data)
    torch.manual_seed(0)
    gat = GAT(128, 64, 40, num_layers=3, heads=3, dropout=0.5, activation="elu")
    OUT["gat"] = model_bytes(gat, data)
    for k in ("gcn", "gat"):
        print(k, json.dumps(OUT[k], indent=1))
    with open(sys.argv[1] if len(sys.argv) > 1 else "bench_pointwise.json", "w") as fh:
        json.dump(OUT, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
