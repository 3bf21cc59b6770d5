"""Divergence and the watch's warnings on the example scripts that exposed them, on real Cora.

Three models, each as its own script trains it, with the three lines of ``compress_gnn``:

- ``gcn2``: PyG's ``examples/gcn2_cora.py`` (GCNII, 64 ``GCN2Conv`` layers of 64, alpha 0.1,
  theta 0.5, dropout 0.6, Adam lr 0.01 with weight decay 0.01 on the convolutions and 5e-4 on
  the linear layers, GCN-normalized adjacency, 1000 epochs; ``--shared-weights`` as there);
- ``ogb-gcn`` / ``ogb-sage``: OGB's ``examples/nodeproppred/arxiv/gnn.py`` (3 layers of 256,
  BatchNorm, dropout 0.5, Adam lr 0.01, 500 epochs) on Cora's public split.

Each run records the loss and the gradient norm of every step, test accuracy at the best
validation epoch and at the end, and every warning gact_graph gave (with its step), and what
the watch did (``ctl.watch.events``). Modes: ``stock`` (no compression), ``default``
(adaptive 2 bits), ``fixed2`` (``adaptive=False``), with ``--on-divergence``.

    python benchmarks/divergence.py --root /tmp/cora_root --model gcn2 --modes fixed2 \\
        --on-divergence warn,rescue --json docs/results/divergence.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import GCN2Conv, GCNConv, SAGEConv
from torch_geometric.nn.conv.gcn_conv import gcn_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gact_graph import compress_gnn  # noqa: E402
from gact_graph.datasets import load_dataset  # noqa: E402


class GCN2Net(nn.Module):
    """PyG's ``gcn2_cora.py`` ``Net`` (edge weights from ``gcn_norm`` instead of its
    ``SparseTensor``, so that torch-sparse is not needed)."""

    def __init__(self, in_channels, hidden, out_channels, num_layers=64, alpha=0.1, theta=0.5,
                 shared_weights=True, dropout=0.6):  # fmt: skip
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(in_channels, hidden), nn.Linear(hidden, out_channels)])
        self.convs = nn.ModuleList(
            GCN2Conv(hidden, alpha, theta, layer + 1, shared_weights, normalize=False)
            for layer in range(num_layers)
        )
        self.dropout = dropout

    def forward(self, x, edge_index, edge_weight):
        x = F.dropout(x, self.dropout, training=self.training)
        x = x_0 = self.lins[0](x).relu()
        for conv in self.convs:
            x = F.dropout(x, self.dropout, training=self.training)
            x = conv(x, x_0, edge_index, edge_weight)
            x = x.relu()
        x = F.dropout(x, self.dropout, training=self.training)
        return self.lins[1](x).log_softmax(dim=-1)


class OgbNet(nn.Module):
    """OGB arxiv ``gnn.py``'s ``GCN`` / ``SAGE``: convolutions with BatchNorm, ReLU, dropout."""

    def __init__(self, kind, in_channels, hidden, out_channels, num_layers=3, dropout=0.5):
        super().__init__()
        conv = (lambda i, o: GCNConv(i, o, cached=True)) if kind == "gcn" else SAGEConv
        dims = [in_channels] + [hidden] * (num_layers - 1) + [out_channels]
        self.convs = nn.ModuleList(conv(i, o) for i, o in zip(dims[:-1], dims[1:]))
        self.bns = nn.ModuleList(nn.BatchNorm1d(hidden) for _ in range(num_layers - 1))
        self.dropout = dropout

    def forward(self, x, edge_index, edge_weight=None):
        for conv, bn in zip(self.convs[:-1], self.bns):
            x = F.dropout(F.relu(bn(conv(x, edge_index))), self.dropout, training=self.training)
        return self.convs[-1](x, edge_index).log_softmax(dim=-1)


def build(model: str, data, shared_weights: bool):
    """The model, its optimizer and its default number of epochs."""
    c = int(data.y.max()) + 1
    if model == "gcn2":
        net = GCN2Net(data.num_features, 64, c, shared_weights=shared_weights)
        opt = torch.optim.Adam(
            [
                dict(params=net.convs.parameters(), weight_decay=0.01),
                dict(params=net.lins.parameters(), weight_decay=5e-4),
            ],
            lr=0.01,
        )
        return net, opt, 1000
    net = OgbNet(model.split("-")[1], data.num_features, 256, c)
    return net, torch.optim.Adam(net.parameters(), lr=0.01), 500


def run(args, data, mode: str, on_divergence: str | None) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    net, opt, epochs = build(args.model, data, args.shared_weights)
    epochs = args.epochs or epochs
    ew = data.edge_weight if args.model == "gcn2" else None
    ctl = None
    if mode != "stock":
        kw = {"adaptive": mode == "default"}
        if on_divergence is not None:
            kw["on_divergence"] = on_divergence
        ctl = compress_gnn(net, bits=2, **kw)
    losses, norms, caught_at = [], [], []
    best_val = test_at_best = final_test = 0.0
    t0 = time.perf_counter()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(epochs):
            net.train()
            opt.zero_grad()
            out = net(data.x, data.edge_index, ew)
            loss = F.nll_loss(out[data.train_mask], data.y[data.train_mask])
            loss.backward()
            norms.append(
                float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.norm() for p in net.parameters() if p.grad is not None])))
            )  # fmt: skip
            opt.step()
            try:
                if ctl is not None:
                    ctl.iterate()
            except RuntimeError as exc:  # on_divergence="raise"
                error = f"step {epoch}: {exc}"
                break
            losses.append(float(loss))
            for w in caught[len(caught_at) :]:
                caught_at.append({"step": epoch, "message": str(w.message)[:400]})
            if epoch % args.eval_every == 0 or epoch == epochs - 1:
                net.eval()
                with torch.no_grad():
                    pred = net(data.x, data.edge_index, ew).argmax(-1)
                acc = [float((pred[m] == data.y[m]).float().mean())
                       for m in (data.val_mask, data.test_mask)]  # fmt: skip
                final_test = acc[1]
                if acc[0] > best_val:
                    best_val, test_at_best = acc[0], acc[1]
    ours = [w for w in caught_at if "gact_graph" in w["message"]]
    first_nan = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    watch = getattr(ctl, "watch", None) if ctl is not None else None
    return {
        "model": args.model,
        "mode": mode,
        "on_divergence": on_divergence,
        "epochs": epochs,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - t0, 1),
        "first_nan_step": first_nan,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min((v for v in losses if math.isfinite(v)), default=None),
        "test_at_best_val": test_at_best,
        "final_test": final_test,
        "warnings": ours,
        "watch_events": list(getattr(watch, "events", [])),
        "error": error,
        "losses": losses,
        "grad_norms": norms,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="folder with Cora/raw (Planetoid files)")
    p.add_argument("--model", choices=("gcn2", "ogb-gcn", "ogb-sage"), default="gcn2")
    p.add_argument("--modes", default="stock,default,fixed2")
    p.add_argument("--on-divergence", default="", help="comma list; empty: the default")
    p.add_argument("--epochs", type=int, default=0, help="0: the script's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--shared-weights", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    data = load_dataset("cora", root=args.root)
    if args.model == "gcn2":  # gcn2_cora.py's T.GCNNorm()
        data.edge_index, data.edge_weight = gcn_norm(
            data.edge_index, None, data.num_nodes, add_self_loops=True
        )
    runs = []
    actions = [a or None for a in args.on_divergence.split(",")]
    for mode in args.modes.split(","):
        for action in actions if mode != "stock" else [None]:
            r = run(args, data, mode, action)
            runs.append(r)
            print(
                f"{r['model']:<9} {mode:<8} {str(action):<7} test@best {r['test_at_best_val']:.3f} "
                f"final {r['final_test']:.3f} nan@{r['first_nan_step']} "
                f"warned@{[w['step'] for w in r['warnings']]} {r['seconds']}s "
                f"{r['watch_events']} {r['error'] or ''}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
