"""The model and optimizer of docs/integrations.md's examples, trained in a plain PyG loop
without compression: the accuracy each integration's example is compared with."""

import torch
import torch.nn.functional as F

from gact_graph.models import GCN

EPOCHS = 100  # the docs' 200, shortened for CI


def doc_model(data) -> GCN:
    """The examples' 2-layer GCN, seeded."""
    torch.manual_seed(0)
    return GCN(data.num_features, 16, data.num_classes, num_layers=2, dropout=0.5, batch_norm=False)


def held_out_accuracy(model, data) -> float:
    """Accuracy of ``model`` on the test nodes, in eval mode."""
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index).argmax(-1)
    return (pred[data.test_mask] == data.y[data.test_mask]).float().mean().item()


def train_stock(data, epochs: int = EPOCHS) -> float:
    """Test accuracy of `doc_model` after ``epochs`` stock epochs (Adam, lr 0.01, weight decay
    5e-4, as the examples)."""
    model = doc_model(data)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        out = model(data.x, data.edge_index)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
        opt.step()
    return held_out_accuracy(model, data)
