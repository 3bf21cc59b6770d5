"""examples/train_full_batch.py end to end on tiny graphs: once as a user runs it (subprocess,
compressed, JSON summary), and in-process for the FP32 baseline and a Planetoid preset; and
examples/quickstart.py, in-process, as the README sends a newcomer to it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_full_batch.py"
QUICKSTART = REPO / "examples" / "quickstart.py"
SUMMARY_KEYS = {
    "test_metric_mean", "test_metric_std", "val_metric_mean", "peak_memory_bytes",
    "activation_bytes_fp32", "activation_bytes_stored", "epoch_time_s", "per_seed", "args",
}  # fmt: skip
SEED_KEYS = {
    "seed", "best_epoch", "epochs_run", "train_metric", "val_metric", "test_metric",
    "peak_memory_bytes", "activation_bytes_fp32", "activation_bytes_stored", "epoch_time_s",
}  # fmt: skip


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load(EXAMPLE)


def _check_summary(summary: dict, seeds: list[int]) -> None:
    assert SUMMARY_KEYS <= set(summary)
    assert [r["seed"] for r in summary["per_seed"]] == seeds
    for record in summary["per_seed"]:
        assert SEED_KEYS <= set(record)
        assert 0.0 <= record["test_metric"] <= 1.0
        assert record["peak_memory_bytes"] > 0 and record["epoch_time_s"] > 0
    assert 0.0 <= summary["test_metric_mean"] <= 1.0 and summary["test_metric_std"] >= 0.0
    assert summary["activation_bytes_fp32"] > 0 and summary["activation_bytes_stored"] > 0


def test_cli_compressed_run_writes_json(tmp_path):
    out = tmp_path / "run" / "summary.json"
    cmd = [
        sys.executable, str(EXAMPLE), "--num-nodes", "400", "--epochs", "3", "--seeds", "2",
        "--hidden", "16", "--no-progress", "--json", str(out),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test acc:" in proc.stdout and "activations saved for backward" in proc.stdout
    summary = json.loads(out.read_text())
    _check_summary(summary, [0, 1])
    assert summary["args"]["bits"] == 2 and summary["args"]["fixed_bits"] is False
    # Two-bit storage holds well under the FP32 bytes.
    assert summary["activation_bytes_stored"] < summary["activation_bytes_fp32"] / 2
    assert summary["config"]["model"]["hidden_channels"] == 16


def test_fp32_baseline_and_early_stopping(example, tmp_path):
    path = tmp_path / "fp32.json"
    summary = example.main([
        "--bits", "fp32", "--num-nodes", "300", "--epochs", "30", "--patience", "2",
        "--lr", "0.5", "--seeds", "3", "5", "--model", "gat", "--heads", "2", "--hidden", "4",
        "--no-progress", "--json", str(path),
    ])  # fmt: skip
    _check_summary(summary, [3, 5])
    assert summary["activation_bytes_stored"] == summary["activation_bytes_fp32"]
    assert json.loads(path.read_text())["test_metric_mean"] == summary["test_metric_mean"]
    for record in summary["per_seed"]:  # stopped 2 epochs after the best validation epoch
        assert record["epochs_run"] == record["best_epoch"] + 3 or record["epochs_run"] == 30


def test_cora_gcnii_preset_with_parameter_groups(example, cora_root):
    summary = example.main([
        "--dataset", "cora", "--root", str(cora_root), "--model", "gcnii", "--layers", "2",
        "--epochs", "2", "--bits", "fp32", "--no-progress", "--adj-t",
    ])  # fmt: skip
    assert summary["config"]["weight_decay_conv"] == 0.01
    assert summary["config"]["model"]["normalize"] is False
    assert summary["num_nodes"] == 2708 and summary["metric"] == "acc"


def test_bits_parsing(example):
    assert example.parse_bits("fp32") is None and example.parse_bits("4") == 4
    assert example.parse_bits("2.5") == 2.5
    with pytest.raises(argparse.ArgumentTypeError):
        example.parse_bits("lots")
    assert example._seeds([3]) == [0, 1, 2] and example._seeds([4, 9]) == [4, 9]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--epochs", "0"], "argument --epochs: must be at least 1, got '0'"),
        (["--dataset", "nosuch"], "argument --dataset: unknown dataset 'nosuch'; choose from"),
        (["--dataset", "synthetic-nosuch"], "argument --dataset: unknown dataset 'synthetic-"),
        (["--seeds", "0"], "argument --seeds: one number counts the seeds, at least 1, got 0"),
        (["--memory-budget", "lots"], "argument --memory-budget: memory_budget 'lots' is not"),
        (["--memory-budget", "0"], "argument --memory-budget: memory_budget must be positive"),
        (["--policy", "acgc"], "argument --policy acgc needs --loss-bound E"),
        (["--loss-bound", "0.01"], "argument --loss-bound applies to --policy acgc only"),
        (["--bits", "fp32", "--memory-budget", "1GiB"], "--memory-budget and --policy acgc"),
    ],
)
def test_bad_arguments_are_usage_errors(example, capsys, args, message):
    """Rejected before anything is loaded: argparse's ``error:`` line, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        example.main(args + ["--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_missing_dataset_files_exit_with_the_loader_message(example, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        example.main(["--dataset", "citeseer", "--root", str(tmp_path), "--no-progress"])
    assert str(exit_.value.code).startswith("error: citeseer: missing ")
    assert os.path.join(str(tmp_path), "CiteSeer", "raw", "ind.citeseer.graph") in exit_.value.code


@pytest.fixture
def torch_threads():
    """The example sets torch's thread count for the whole process: put it back."""
    import torch

    n = torch.get_num_threads()
    yield torch
    torch.set_num_threads(n)


@pytest.mark.parametrize(("flag", "expected"), [([], 1), (["--threads", "2"], 2)])
def test_threads_default_to_the_usable_cpus(example, torch_threads, monkeypatch, flag, expected):
    # as if this process were granted one CPU (cgroup quota or affinity mask)
    monkeypatch.setattr(example, "usable_cpus", lambda: 1)
    torch_threads.set_num_threads(3)
    example.main(["--num-nodes", "200", "--epochs", "1", "--hidden", "8", "--no-progress"] + flag)
    assert torch_threads.get_num_threads() == expected


def test_memory_budget_and_acgc_flags_as_the_library_takes_them(example, tmp_path):
    """``--memory-budget`` (bytes or '16GiB') and ``--policy acgc --loss-bound E`` reach
    `compress_gnn` as its own arguments; the JSON records what the planner chose and
    measured, every earlier key kept."""
    assert example.memory_budget_arg("16GiB") == 16 * 2**30
    assert example.memory_budget_arg("123456") == 123456
    path = tmp_path / "budget.json"
    summary = example.main([
        "--num-nodes", "300", "--epochs", "3", "--hidden", "8", "--no-progress",
        "--memory-budget", "1GiB", "--json", str(path),
    ])  # fmt: skip
    _check_summary(summary, [0])
    record = json.loads(path.read_text())["per_seed"][0]["memory_budget"]
    assert record["budget_bytes"] == 2**30 and record["meter"] in ("bytes", "rss", "cuda")
    assert record["plan"] and record["predicted_bytes"] > 0 and record["least_budget_bytes"] > 0
    assert [s["phase"] for s in record["steps"]] == ["profile", "planned", "planned"]
    assert 0 < record["worst_planned_bytes"] <= record["budget_bytes"]
    assert summary["args"]["memory_budget"] == 2**30
    summary = example.main([
        "--num-nodes", "300", "--epochs", "2", "--hidden", "8", "--no-progress",
        "--policy", "acgc", "--loss-bound", "0.05",
    ])  # fmt: skip
    _check_summary(summary, [0])
    assert summary["per_seed"][0]["memory_budget"] is None
    assert summary["args"]["policy"] == "acgc" and summary["args"]["loss_bound"] == 0.05


def test_quickstart_trains_and_prints_the_memory_saved(capsys):
    """The short example learns (above chance on 16 planted classes) and prints the bytes
    autograd would have held against those held, from ``ctl.stats()["total"]``."""
    test_acc, total = _load(QUICKSTART).main(["--num-nodes", "400", "--epochs", "30"])
    out = capsys.readouterr().out
    assert test_acc > 2 / 16, out
    orig, stored = total["orig_bytes"] / 2**20, total["stored_bytes"] / 2**20
    assert 0 < stored < orig / 2
    assert f"Memory saved for backward: {orig:.2f} MiB -> {stored:.2f} MiB (" in out
    assert f"Test accuracy at the best validation epoch: {test_acc:.4f}" in out
