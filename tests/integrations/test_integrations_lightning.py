"""The Lightning callback: training on Cora, free evaluation, checkpoint resume, import guard."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gact_graph.integrations.lightning import CompressionCallback, GactCallback  # noqa: E402
from gact_graph.models import GCN  # noqa: E402
from tests.integrations.stock_loop import EPOCHS, train_stock  # noqa: E402


def _trainer(tmp_path, epochs, callbacks, **kw):
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=CSVLogger(save_dir=str(tmp_path / "logs")),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_doc_example_trains_like_stock(cora_root, cora, doc_example, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the example's CSVLogger writes ./logs
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        ns = doc_example.run(
            "lightning",
            [
                ('root = "data"', f"root = {str(cora_root)!r}"),
                ("epochs = 200", f"epochs = {EPOCHS}"),
            ],
        )
    acc = ns["acc"]
    stock = train_stock(cora)
    metrics = ns["logged"]
    with capsys.disabled():
        print(
            f"lightning on Cora: stock loop {stock:.3f}, 2-bit {acc:.3f}, metrics {dict(metrics)}"
        )
    assert stock > 0.75 and acc > 0.75
    assert abs(acc - stock) < 0.04
    assert metrics["gact/ratio"] > 2.0
    assert 0 < metrics["gact/stored_MB"] < metrics["gact/orig_MB"]
    assert "test accuracy" in capsys.readouterr().out
    logged = (tmp_path / "logs").rglob("metrics.csv")
    assert any("gact/stored_MB" in p.read_text() for p in logged)
    # after fit the model is exactly as before: nothing left on it
    assert getattr(ns["lit"].model, "_gact_graph_controller", None) is None
    assert not any("forward" in m.__dict__ for m in ns["lit"].modules())


class _Lit(pl.LightningModule):
    """Calls ``self(...)``: the callback may compress the LightningModule itself."""

    def __init__(self, data):
        super().__init__()
        torch.manual_seed(0)
        self.model = GCN(data.num_features, 16, data.num_classes, num_layers=2, batch_norm=False)
        self.val_active = []

    def forward(self, x, edge_index):
        return self.model(x, edge_index)

    def training_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

    def validation_step(self, batch, batch_idx):
        out = self(batch.x, batch.edge_index)
        ctl = getattr(self, "_gact_graph_controller", None)
        self.val_active.append(ctl is not None and ctl._active is not None)
        acc = (out.argmax(-1)[batch.val_mask] == batch.y[batch.val_mask]).float().mean()
        self.log("val_acc", acc, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _Probe(Callback):
    """Records the controller as the training run sees it."""

    def __init__(self, gact):
        self.gact = gact
        self.at_start = None
        self.val_forwards = []

    def on_train_start(self, trainer, pl_module):
        self.at_start = self.gact.ctl.state_dict()

    def on_validation_epoch_start(self, trainer, pl_module):
        if self.gact.ctl is not None:
            self.val_forwards.append(self.gact.ctl._forward_id)

    def on_validation_epoch_end(self, trainer, pl_module):
        if self.gact.ctl is not None:
            self.val_forwards.append(self.gact.ctl._forward_id)


def test_checkpoint_resume_keeps_plan_and_validation_is_free(cora, tmp_path):
    loader = DataLoader([cora], batch_size=None)
    gact = GactCallback(bits=3, adaptive=True, adapt_interval=1)
    probe = _Probe(gact)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    lit = _Lit(cora)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        _trainer(tmp_path, 3, [gact, probe, ckpt], num_sanity_val_steps=0).fit(lit, loader, loader)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    state = saved["callbacks"][gact.state_key]["controller"]
    assert state["step"] == 3 and state["plan"]
    # validation ran under no_grad: no hook was entered, no forward was compressed
    assert probe.val_forwards and probe.val_forwards[0::2] == probe.val_forwards[1::2]
    assert lit.val_active and not any(lit.val_active)
    assert getattr(lit, "_gact_graph_controller", None) is None  # removed after fit

    gact2 = CompressionCallback(bits=3, adaptive=True, adapt_interval=1)
    assert gact2.state_key == gact.state_key
    probe2 = _Probe(gact2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        _trainer(tmp_path, 5, [gact2, probe2], num_sanity_val_steps=0).fit(
            _Lit(cora), loader, loader, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
        )
    assert probe2.at_start["step"] == 3
    assert probe2.at_start["plan"] == state["plan"]
    assert probe2.at_start.get("adapter") == state.get("adapter")
    assert gact2.state_dict()["controller"]["step"] == 5


def test_warns_when_target_forward_never_runs(cora, tmp_path):
    class CallsSubmodule(_Lit):
        def training_step(self, batch, batch_idx):
            out = self.model(batch.x, batch.edge_index)  # not self(...)
            return F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

    loader = DataLoader([cora], batch_size=None)
    with pytest.warns(UserWarning, match="module='model'"):
        _trainer(tmp_path, 1, [GactCallback(bits=2)], limit_val_batches=0).fit(
            CallsSubmodule(cora), loader
        )


def test_import_guard():
    """``import gact_graph`` never imports Lightning; without Lightning the module says how
    to install it."""
    code = textwrap.dedent(
        """
        import sys
        import gact_graph, gact_graph.integrations, gact_graph.integrations.pyg
        assert "lightning" not in sys.modules, "gact_graph imported lightning"
        assert "pytorch_lightning" not in sys.modules
        sys.modules["lightning"] = None  # as if it were not installed
        try:
            import gact_graph.integrations.lightning
        except ImportError as e:
            assert "pip install gact_graph[lightning]" in str(e), e
            print("OK")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr
