"""The plain PyG loop callback, and the copy-paste example of docs/integrations.md."""

import torch
import torch.nn.functional as F

from gact_graph.integrations.pyg import GactCallback
from tests.integrations.stock_loop import EPOCHS, doc_model, train_stock


def _closure(model, opt, data):
    """One training step's forward and backward on ``data``'s training nodes."""

    def closure():
        opt.zero_grad()
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        return loss

    return closure


def test_doc_example_trains_like_stock(cora_root, cora, doc_example, capsys):
    ns = doc_example.run(
        "pyg", [('root = "data"', f"root = {str(cora_root)!r}"),
                ("epochs = 200", f"epochs = {EPOCHS}")],
    )  # fmt: skip
    acc, stats = ns["acc"], ns["stats"]
    stock = train_stock(cora)
    with capsys.disabled():
        print(f"pyg loop on Cora: stock {stock:.3f}, 2-bit {acc:.3f}, stats {stats}")
    assert stock > 0.75 and acc > 0.75
    assert abs(acc - stock) < 0.04
    assert stats["ratio"] > 2.0 and stats["stored_bytes"] > 0
    assert "test accuracy" in capsys.readouterr().out
    assert getattr(ns["model"], "_gact_graph_controller", None) is None  # removed


def test_callback_lifecycle_and_state(cora):
    model = doc_model(cora)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    closure = _closure(model, opt, cora)

    with GactCallback(model, bits=4, adaptive=False) as gact:
        ctl = gact.ctl
        for _ in range(3):
            loss = gact.step(closure, opt)
        assert torch.isfinite(loss)
        assert ctl.step == 3
        # evaluation under no_grad installs nothing (and leaves the training stats alone)
        fid, total = ctl._forward_id, gact.stats()["total"]
        with torch.no_grad():
            model.eval()(cora.x, cora.edge_index)
        model.train()
        assert ctl._forward_id == fid and gact.stats()["total"] == total
        assert total["ratio"] > 1.5
        gact.on_train_batch_end()  # for loops that step themselves
        assert ctl.step == 4
    assert getattr(model, "_gact_graph_controller", None) is None
    assert gact.stats() == {}
    state = gact.state_dict()
    assert state["step"] == 4

    resumed = GactCallback(model, bits=4, adaptive=False)
    resumed.load_state_dict(state)
    assert resumed.on_train_start().step == 4
    resumed.on_train_end()


def test_adaptive_step_makes_a_plan(cora):
    model = doc_model(cora)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    closure = _closure(model, opt, cora)

    gact = GactCallback(model, bits=3, adaptive=True, min_numel=0)
    gact.on_train_start()
    for _ in range(3):
        gact.step(closure, opt)
    plan = gact.state_dict()["plan"]
    gact.on_train_end()
    assert plan and all(b in (1, 2, 4, 8, 32) for b in plan.values())
