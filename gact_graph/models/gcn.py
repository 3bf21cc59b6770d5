"""Full-batch GCN (Kipf & Welling, ICLR 2017) in the form of the OGB ogbn-arxiv baseline."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GCNConv

__all__ = ["GCN"]


class GCN(nn.Module):
    r"""Stack of :class:`~torch_geometric.nn.GCNConv` layers,
    :math:`X^{(l+1)} = \mathrm{ReLU}(\mathrm{BN}(\hat{A} X^{(l)} W^{(l)}))`, with
    :math:`\hat{A} = D^{-1/2}(A + I)D^{-1/2}` and a plain last layer returning logits.

    Args:
        in_channels: input feature width.
        hidden_channels: width of every hidden layer.
        out_channels: number of classes.
        num_layers: number of GCN layers (>= 1).
        dropout: dropout after each hidden layer.
        input_dropout: dropout on the input features (Kipf & Welling use the same 0.5).
        batch_norm: :class:`~torch.nn.BatchNorm1d` after each hidden convolution (OGB setup).
        residual: add the layer input to its output where the widths match (ResGCN of
            DeepGCNs, Li et al. 2019), which keeps very deep stacks trainable.
        cached: let :class:`GCNConv` cache the normalized adjacency. Off by default: a cache
            silently goes stale when ``edge_index`` changes between calls.
        normalize: normalize the adjacency inside each layer; pass ``False`` when
            ``edge_index`` is an already normalized sparse adjacency (``data.adj_t``).
        add_self_loops: add self-loops during normalization (default: when ``normalize``).

    Shapes:
        - input: ``x`` ``[N, in_channels]``; ``edge_index`` ``[2, E]`` (or a ``torch.sparse`` /
          ``torch_sparse.SparseTensor`` adjacency, passed to the convolutions as is);
          optional ``edge_weight`` ``[E]``.
        - output: ``[N, out_channels]`` logits.
    """

    def __init__(
        self,
        in_channels: int,
        hidden_channels: int,
        out_channels: int,
        num_layers: int = 3,
        dropout: float = 0.5,
        input_dropout: float = 0.0,
        batch_norm: bool = True,
        residual: bool = False,
        cached: bool = False,
        normalize: bool = True,
        add_self_loops: bool | None = None,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.dropout = dropout
        self.input_dropout = input_dropout
        self.residual = residual
        widths = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
        conv_kwargs = dict(cached=cached, normalize=normalize, add_self_loops=add_self_loops)
        self.convs = nn.ModuleList(
            GCNConv(widths[i], widths[i + 1], **conv_kwargs) for i in range(num_layers)
        )
        self.bns = nn.ModuleList(
            nn.BatchNorm1d(hidden_channels) for _ in range(num_layers - 1 if batch_norm else 0)
        )

    def reset_parameters(self) -> None:
        for module in [*self.convs, *self.bns]:
            module.reset_parameters()

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor | None = None) -> Tensor:
        x = F.dropout(x, p=self.input_dropout, training=self.training)
        for i, conv in enumerate(self.convs[:-1]):
            # Each activation is released as soon as nothing reads it again (what backward
            # needs, autograd saved): a name still bound to it kept one more N x C tensor
            # alive through the next layer, the step's peak once activations are compressed.
            skip = x if self.residual else None
            h = conv(x, edge_index, edge_weight)
            del x
            if self.bns:
                h = self.bns[i](h)
            h = F.relu(h)
            if skip is not None and h.shape == skip.shape:
                h = h + skip
            x = F.dropout(h, p=self.dropout, training=self.training)
            del h, skip
        return self.convs[-1](x, edge_index, edge_weight)

    def extra_repr(self) -> str:
        return f"num_layers={len(self.convs)}, dropout={self.dropout}, residual={self.residual}"
