"""examples/train_minibatch.py and examples/train_ddp.py on tiny graphs, run as documented:
the mini-batch example as a user runs it (subprocess, JSON) and in-process, the DDP example
under ``torchrun --standalone --nproc_per_node=2`` (gloo on CPU). Both share the full-batch
example's flags and JSON keys."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist
from test_example import EXAMPLE as FULL_BATCH
from test_example import REPO, SEED_KEYS, SUMMARY_KEYS

MINIBATCH = REPO / "examples" / "train_minibatch.py"
DDP_EXAMPLE = REPO / "examples" / "train_ddp.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load(MINIBATCH)


def _flags(module, capsys) -> set[str]:
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))


def test_same_flags_as_the_full_batch_example(example, capsys):
    full, mini = _flags(_load(FULL_BATCH), capsys), _flags(example, capsys)
    assert full <= mini, sorted(full - mini)
    assert mini - full == {"--loader", "--batch-size", "--num-neighbors", "--num-parts",
                           "--measure-batches"}  # fmt: skip


def _check(summary: dict, seeds: list[int]) -> None:
    assert SUMMARY_KEYS <= set(summary)
    assert [r["seed"] for r in summary["per_seed"]] == seeds
    for record in summary["per_seed"]:
        assert SEED_KEYS <= set(record)
        assert 0.0 <= record["test_metric"] <= 1.0 and record["peak_memory_bytes"] > 0
        assert record["batches_per_epoch"] >= 2
    assert summary["activation_bytes_fp32"] > 0 and summary["activation_bytes_stored"] > 0


def test_cli_compressed_run_writes_json(tmp_path):
    out = tmp_path / "run" / "summary.json"
    cmd = [
        sys.executable, str(MINIBATCH), "--num-nodes", "600", "--epochs", "2", "--hidden", "32",
        "--loader", "random", "--num-parts", "3", "--threads", "1", "--no-progress",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "activations saved for backward per batch" in proc.stdout
    summary = json.loads(out.read_text())
    _check(summary, [0])
    assert summary["args"]["bits"] == 2 and summary["config"]["model"]["hidden_channels"] == 32
    # per batch, 2 bits hold well under what stock PyTorch saves for the same batches
    assert summary["activation_bytes_stored"] < summary["activation_bytes_fp32"] / 3
    assert summary["activation_bytes_stored_max"] >= summary["activation_bytes_stored"]


def test_fp32_gat_random_node_loader(example):
    summary = example.main([
        "--bits", "fp32", "--model", "gat", "--heads", "2", "--hidden", "4", "--layers", "2",
        "--num-nodes", "400", "--epochs", "1", "--loader", "random", "--num-parts", "2",
        "--seeds", "3", "5", "--no-progress",
    ])  # fmt: skip
    _check(summary, [3, 5])
    assert summary["activation_bytes_stored"] == summary["activation_bytes_fp32"]
    assert summary["loader"].startswith("RandomNodeLoader(num_parts=2)")


def test_neighbor_loader_where_a_sampler_imports(example):
    if not example.sampler_available():
        with pytest.raises(SystemExit):
            example.parse_args(["--loader", "neighbor"])
        pytest.skip("no pyg-lib / torch-sparse: --loader neighbor refuses (checked)")
    summary = example.main([
        "--num-nodes", "600", "--epochs", "2", "--hidden", "16", "--loader", "neighbor",
        "--batch-size", "64", "--num-neighbors", "5", "5", "--no-progress",
    ])  # fmt: skip
    _check(summary, [0])
    assert summary["loader"].startswith("NeighborLoader")


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_ddp_example_under_torchrun(tmp_path):
    out = tmp_path / "ddp.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(DDP_EXAMPLE), "--num-nodes", "600", "--epochs", "2", "--hidden", "16",
        "--num-parts", "4", "--device", "cpu", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    (record,) = summary["per_seed"]
    assert record["ranks_identical"]
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    for r in record["ranks"]:  # each rank compressed the activations of its own batches
        assert 0 < r["activation_bytes_stored"] < r["activation_bytes_fp32"] / 3
