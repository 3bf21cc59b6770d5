"""Train a 2-layer GCN with compressed activations: the three lines of ``compress_gnn``.

    python examples/quickstart.py                  # a small synthetic graph, offline
    python examples/quickstart.py --root data      # Cora (Planetoid's raw files in data/Cora/raw)

``compress_gnn(model, bits=2)`` stores what autograd saves for backward at 2 bits on average;
``ctl.iterate()`` after each optimizer step lets it re-plan the bits; ``ctl.remove()`` gives the
model back exactly as it was. ``examples/train_full_batch.py`` is the full trainer (more models,
datasets, seeds, a memory budget, JSON output).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch_geometric.nn import GCNConv

from gact_graph import compress_gnn
from gact_graph.datasets import load_dataset


class GCN(torch.nn.Module):
    def __init__(self, in_channels, hidden_channels, out_channels):
        super().__init__()
        self.conv1 = GCNConv(in_channels, hidden_channels, cached=True)
        self.conv2 = GCNConv(hidden_channels, out_channels, cached=True)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, edge_index).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, edge_index)


def train(model, data, optimizer):
    model.train()
    optimizer.zero_grad()
    out = model(data.x, data.edge_index)
    loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def test(model, data):
    model.eval()
    pred = model(data.x, data.edge_index).argmax(dim=-1)
    accs = []
    for mask in (data.train_mask, data.val_mask, data.test_mask):
        accs.append(int((pred[mask] == data.y[mask]).sum()) / int(mask.sum()))
    return accs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="folder holding Cora/raw; without it a synthetic graph")
    parser.add_argument("--num-nodes", type=int, default=2000, help="synthetic graph's nodes")
    parser.add_argument("--bits", type=float, default=2, help="average bits per saved value")
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    if args.root:
        data = load_dataset("cora", root=args.root)
    else:
        data = load_dataset("synthetic", num_nodes=args.num_nodes)
    model = GCN(data.num_features, 16, data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    ctl = compress_gnn(model, bits=args.bits)  # hooks installed; the model is unchanged otherwise
    best_val = test_acc = 0.0
    for epoch in range(1, args.epochs + 1):
        loss = train(model, data, optimizer)
        ctl.iterate()  # advances the step (and re-plans the bits when due)
        train_acc, val_acc, tmp_test_acc = test(model, data)
        if val_acc > best_val:
            best_val, test_acc = val_acc, tmp_test_acc
        if epoch % 20 == 0:
            print(f"Epoch: {epoch:03d}, Loss: {loss:.4f}, Train: {train_acc:.4f}, "
                  f"Val: {val_acc:.4f}, Test: {tmp_test_acc:.4f}")  # fmt: skip

    total = ctl.stats()["total"]  # bytes autograd would have held vs bytes held
    ctl.remove()  # the model is exactly as before
    print(f"Test accuracy at the best validation epoch: {test_acc:.4f}")
    print(
        f"Memory saved for backward: {total['orig_bytes'] / 2**20:.2f} MiB -> "
        f"{total['stored_bytes'] / 2**20:.2f} MiB "
        f"({total['orig_bytes'] / total['stored_bytes']:.1f}x smaller)"
    )
    return test_acc, total


if __name__ == "__main__":
    main()
