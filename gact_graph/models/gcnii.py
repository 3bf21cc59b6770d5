"""Full-batch GCNII (Chen et al., "Simple and Deep Graph Convolutional Networks", ICML 2020)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GCN2Conv

__all__ = ["GCNII"]


class GCNII(nn.Module):
    r"""Linear input projection, ``num_layers`` :class:`~torch_geometric.nn.GCN2Conv` layers
    with initial residual and identity mapping, linear output layer:

    .. math::
        X^{(0)} = \mathrm{ReLU}(X W_{in}),\quad
        X^{(l)} = \mathrm{ReLU}\Big(\big((1-\alpha)\hat{A}X^{(l-1)} + \alpha X^{(0)}\big)
                  \big((1-\beta_l) I + \beta_l W^{(l)}\big)\Big),\quad
        \beta_l = \log(\theta / l + 1)

    Args:
        in_channels: input feature width.
        hidden_channels: width of every GCNII layer.
        out_channels: number of classes.
        num_layers: number of :class:`GCN2Conv` layers (the paper's depth, e.g. 64 on Cora).
        alpha: strength of the initial residual.
        theta: the paper's lambda; :math:`\beta_l = \log(\theta / l + 1)`.
        dropout: dropout before every layer and before the output projection.
        input_dropout: dropout on the input features (default: ``dropout``).
        shared_weights: one weight for the propagated and the initial term (the paper); with
            ``False`` the two get separate weights (PyG's GCNII*).
        batch_norm: :class:`~torch.nn.BatchNorm1d` after each :class:`GCN2Conv`.
        cached: let the convolutions cache the normalized adjacency (off: stays correct when
            ``edge_index`` changes).
        normalize: normalize the adjacency inside each layer (``False`` for ``data.adj_t``).
        add_self_loops: add self-loops during normalization.

    Shapes:
        - input: ``x`` ``[N, in_channels]``; ``edge_index`` ``[2, E]`` or a sparse adjacency.
        - output: ``[N, out_channels]`` logits.
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int = 64,
        alpha: float = 0.1,
        theta: float = 0.5,
        dropout: float = 0.6,
        input_dropout: float | None = None,
        shared_weights: bool = True,
        batch_norm: bool = False,
        cached: bool = False,
        normalize: bool = True,
        add_self_loops: bool = True,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.dropout = dropout
        self.input_dropout = dropout if input_dropout is None else input_dropout
        self.lins = nn.ModuleList(
            [nn.Linear(in_channels, hidden_channels), nn.Linear(hidden_channels, out_channels)]
        )
        self.convs = nn.ModuleList(
            GCN2Conv(
                hidden_channels,
                alpha,
                theta,
                layer=layer + 1,
                shared_weights=shared_weights,
                cached=cached,
                normalize=normalize,
                add_self_loops=add_self_loops,
            )
            for layer in range(num_layers)
        )
        self.bns = nn.ModuleList(
            nn.BatchNorm1d(hidden_channels) for _ in range(num_layers if batch_norm else 0)
        )

    def reset_parameters(self) -> None:
        for module in [*self.lins, *self.convs, *self.bns]:
            module.reset_parameters()

    def parameter_groups(self, weight_decay_conv: float, weight_decay_dense: float) -> list[dict]:
        """Optimizer groups as in the paper: the convolutions and the two linear layers get
        different weight decay (0.01 and 5e-4 on Cora)."""
        return [
            {"params": list(self.convs.parameters()), "weight_decay": weight_decay_conv},
            {
                "params": list(self.lins.parameters()) + list(self.bns.parameters()),
                "weight_decay": weight_decay_dense,
            },
        ]

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        x = F.dropout(x, p=self.input_dropout, training=self.training)
        x = x_0 = F.relu(self.lins[0](x))
        for i, conv in enumerate(self.convs):
            x = F.dropout(x, p=self.dropout, training=self.training)
            x = conv(x, x_0, edge_index, edge_weight)
            if self.bns:
                x = self.bns[i](x)
            x = F.relu(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.lins[1](x)

    def extra_repr(self) -> str:
        return f"num_layers={len(self.convs)}, dropout={self.dropout}"
