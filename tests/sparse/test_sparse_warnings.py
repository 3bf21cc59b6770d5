"""A user's run prints only the warnings the package means (its own, "gact_graph: ..."): torch's
notices about the package's own sparse tensors ("in beta", "invariant checks are implicitly
disabled") are kept quiet where the package builds them, and the user's warning filters are
left as they were."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GCN

from gact_graph import compress_gnn
from gact_graph.sparse.adjacency import CompactAdjacency


@pytest.mark.parametrize("graph", ["edge_index", "torch.sparse", "SparseTensor"])
def test_compressed_gcn_on_the_csr_path_warns_only_its_own(graph, monkeypatch, request):
    torch.manual_seed(0)
    n = 30
    x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
    edge_index = torch.randint(0, n, (2, 120))
    # the user's own matrices (adj_t: row = target), built before the run
    if graph == "torch.sparse":
        edge_index = torch.sparse_coo_tensor(
            edge_index.flip(0), torch.ones(120), (n, n), check_invariants=False
        ).coalesce()
    elif graph == "SparseTensor":
        torch_sparse = request.getfixturevalue("torch_sparse")
        edge_index = torch_sparse.SparseTensor(
            row=edge_index[1], col=edge_index[0], sparse_sizes=(n, n)
        )
    model = GCN(8, 16, 2, 3)
    csr_views = []
    to_torch_csr = CompactAdjacency.to_torch_csr
    monkeypatch.setattr(
        CompactAdjacency,
        "to_torch_csr",
        lambda *a, **k: csr_views.append(1) or to_torch_csr(*a, **k),
    )
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch's once-a-process notices, said again in this process
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            filters = list(warnings.filters)
            ctl = compress_gnn(model, bits=2, min_numel=0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(model(x, edge_index), y).backward()
                opt.step()
                ctl.iterate()
            ctl.remove()
            assert warnings.filters == filters  # the user's filters, as they were
    finally:
        torch.set_warn_always(warn_always)
    assert csr_views, "the CSR path did not run"
    foreign = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in said
        if not str(w.message).startswith("gact_graph:")
    ]
    assert not foreign, foreign
