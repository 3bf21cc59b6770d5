"""The OGB-style ``adj_t`` recipe of docs/integrations.md, run on a ``SparseTensor`` (the real
torch_sparse where it is installed, else tests/fake_torch_sparse.py, as in CI) and on the
``torch.sparse`` CSR matrix that ``T.ToSparseTensor()`` gives without torch_sparse."""

import pytest
import torch
import torch_geometric.typing as pyg_typing

EPOCHS = 100  # the doc's 200, shortened for CI


@pytest.mark.parametrize("adj_type", ["SparseTensor", "torch-csr"])
def test_doc_example_trains_on_adj_t(
    adj_type, cora_root, doc_example, request, monkeypatch, capsys
):
    if adj_type == "SparseTensor":
        is_adj_type = request.getfixturevalue("torch_sparse").SparseTensor
    else:
        monkeypatch.setattr(pyg_typing, "WITH_TORCH_SPARSE", False)  # what ToSparseTensor reads
        is_adj_type = torch.Tensor
    ns = doc_example.run(
        "adj_t", [('root = "data"', f"root = {str(cora_root)!r}"),
                  ("epochs = 200", f"epochs = {EPOCHS}")],
    )  # fmt: skip
    assert isinstance(ns["data"].adj_t, is_adj_type)
    out = capsys.readouterr().out
    paths = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
    assert paths["convs.0"] == paths["convs.1"] == "sparse-spmm", out
    acc, stats = ns["acc"], ns["stats"]
    with capsys.disabled():
        print(f"adj_t recipe on Cora ({adj_type}): 2-bit {acc:.3f}, stats {stats}")
    assert acc > 0.75
    assert stats["ratio"] > 2.0
    assert getattr(ns["model"], "_gact_graph_controller", None) is None  # removed
