"""Full-batch GAT (Velickovic et al., ICLR 2018) and GATv2 (Brody et al., ICLR 2022), with the
BatchNorm and residual options of the OGB ogbn-arxiv GAT baselines."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GATConv, GATv2Conv

__all__ = ["GAT", "GATv2"]

_ACTIVATIONS = {"elu": F.elu, "relu": F.relu}


class GAT(nn.Module):
    r"""Stack of :class:`~torch_geometric.nn.GATConv` layers. Hidden layers concatenate
    ``heads`` heads of ``hidden_channels`` each; the last layer averages ``out_heads`` heads
    into logits.

    .. math::
        x_i' = \big\Vert_{k=1}^{H} \sum_{j \in \mathcal{N}(i) \cup \{i\}}
               \alpha_{ij}^{k} W^{k} x_j,\quad
        \alpha_{ij}^{k} = \mathrm{softmax}_j\big(\mathrm{LeakyReLU}(a^{k\top}
               [W^{k} x_i \Vert W^{k} x_j])\big)

    Args:
        in_channels: input feature width.
        hidden_channels: width of each head in hidden layers.
        out_channels: number of classes.
        num_layers: number of GAT layers (>= 1).
        heads: heads per hidden layer (concatenated).
        out_heads: heads of the last layer (averaged).
        dropout: dropout on the input of every layer after the first.
        input_dropout: dropout on the input features.
        attn_dropout: dropout on the attention coefficients.
        batch_norm: :class:`~torch.nn.BatchNorm1d` after each hidden layer.
        residual: learnable skip connection in each :class:`GATConv` (``residual=True``).
        activation: ``"elu"`` (the paper) or ``"relu"``.
        negative_slope: LeakyReLU slope of the attention.
        add_self_loops: add self-loops to the graph.

    Shapes:
        - input: ``x`` ``[N, in_channels]``; ``edge_index`` ``[2, E]`` or a sparse adjacency
          (passed to the convolutions as is).
        - output: ``[N, out_channels]`` logits.
    """

    conv_class: type[nn.Module] = GATConv

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int = 3,
        heads: int = 3,
        out_heads: int = 1,
        dropout: float = 0.5,
        input_dropout: float = 0.0,
        attn_dropout: float = 0.0,
        batch_norm: bool = False,
        residual: bool = False,
        activation: str = "elu",
        negative_slope: float = 0.2,
        add_self_loops: bool = True,
    ) -> None:
        super().__init__()
        conv = self.conv_class
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}")
        self.dropout = dropout
        self.input_dropout = input_dropout
        self.activation = activation
        common = dict(
            dropout=attn_dropout,
            negative_slope=negative_slope,
            add_self_loops=add_self_loops,
            residual=residual,
        )
        self.convs = nn.ModuleList()
        width = in_channels
        for _ in range(num_layers - 1):
            self.convs.append(conv(width, hidden_channels, heads=heads, **common))
            width = hidden_channels * heads
        self.convs.append(conv(width, out_channels, heads=out_heads, concat=False, **common))
        self.bns = nn.ModuleList(
            nn.BatchNorm1d(hidden_channels * heads)
            for _ in range(num_layers - 1 if batch_norm else 0)
        )

    def reset_parameters(self) -> None:
        for module in [*self.convs, *self.bns]:
            module.reset_parameters()

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        if edge_weight is not None:
            raise ValueError("GAT computes its own edge weights; edge_weight must be None")
        act = _ACTIVATIONS[self.activation]
        x = F.dropout(x, p=self.input_dropout, training=self.training)
        for i, conv in enumerate(self.convs[:-1]):
            x = conv(x, edge_index)
            if self.bns:
                x = self.bns[i](x)
            x = act(x)
            x = F.dropout(x, p=self.dropout, training=self.training)
        return self.convs[-1](x, edge_index)

    def extra_repr(self) -> str:
        return f"num_layers={len(self.convs)}, dropout={self.dropout}, activation={self.activation}"


class GATv2(GAT):
    r"""The same stack with :class:`~torch_geometric.nn.GATv2Conv` layers (dynamic attention:
    :math:`\alpha_{ij} = \mathrm{softmax}_j(a^\top \mathrm{LeakyReLU}(W_s x_j + W_t x_i))`);
    the arguments are :class:`GAT`'s."""

    conv_class = GATv2Conv
