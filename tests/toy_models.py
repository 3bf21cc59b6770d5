"""Small GCN stacks the unbiasedness tests of the controller and of the pointwise masks share."""

import torch
from torch import nn
from torch_geometric.nn import GCNConv


class LinearGCN(nn.Module):
    """GCN without nonlinearity: every saved activation enters backward linearly."""

    def __init__(self, d_in, hidden, d_out, layers=3):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.convs = nn.ModuleList(GCNConv(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x, edge_index):
        for conv in self.convs:
            x = conv(x, edge_index)
        return x


class ReluGCN(LinearGCN):
    """`LinearGCN` with a ReLU after every layer but the last: ReLU's backward reads the sign
    of its saved output."""

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x
