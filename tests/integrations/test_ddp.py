"""`DistributedDataParallel` over compressed models: 2 processes, gloo, CPU.

Each rank compresses the model it trains (``compress_gnn`` on the module, then ``DDP`` around
it) and feeds it its own mini-batches (RandomNodeLoader parts, rank ``r`` takes parts
``r, r + 2, ...``). What the test checks, in one spawn (the processes run every setting in
turn, so torch and PyG are imported once per rank):

- each rank compresses its own activations: its controller saw its own batch (the bytes stock
  PyTorch would save for that batch, which differ between the ranks) and stored fewer;
- DDP's gradient all-reduce is untouched: a registered comm hook (PyTorch's own allreduce
  hook, counted) runs as often per step as without compression, and the ranks end with
  bitwise identical parameters;
- lossless compression (``bits=None``) trains exactly as uncompressed DDP (float tolerance);
- at 2 bits the loss curve stays within the compression's own noise of the uncompressed one:
  no further from it than three times the gap between two 2-bit runs with other rounding
  seeds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.loader import RandomNodeLoader

from gact_graph import compress_gnn
from gact_graph.datasets.synthetic import make_synthetic_graph
from gact_graph.memory import count_saved_bytes
from gact_graph.models import GCN

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 16
#: (label, compress_gnn bits or "off", rounding seed)
RUNS = [("stock", "off", 0), ("lossless", None, 0), ("2bit", 2, 0), ("2bit-seed1", 2, 1)]

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # the OS picks a free port: parallel runs never collide
        return s.getsockname()[1]


def _train(rank: int, bits, seed: int, parts) -> dict:
    torch.manual_seed(0)  # the same initial model everywhere (DDP broadcasts rank 0's anyway)
    model = _model()
    ctl = None if bits == "off" else compress_gnn(model, bits=bits, seed=seed)
    ddp = DDP(model)
    hook_calls = [0]

    def counting_allreduce(state, bucket):
        hook_calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
    losses, stats = [], []
    mine = parts[rank::WORLD]
    for step in range(STEPS):
        batch = mine[step % len(mine)]
        opt.zero_grad()
        out = ddp(batch.x, batch.edge_index)
        loss = F.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])
        loss.backward()
        opt.step()
        if ctl is not None:
            stats.append(ctl.stats()["total"])
            ctl.iterate()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(gathered, params)
    if ctl is not None:
        ctl.remove()
    return {
        "losses": losses,
        "hook_calls": hook_calls[0],
        "params_equal": all(torch.equal(g, gathered[0]) for g in gathered),
        "stats": stats,
    }


def _model() -> GCN:
    return GCN(32, 64, 4, num_layers=2, dropout=0.5, batch_norm=False)


def _saved_bytes(batch) -> dict[str, int]:
    """What a forward on ``batch`` alone (no DDP) saves for backward: stock PyTorch's bytes, and
    the bytes of the tensors the graph-aware paths leave to compress (``orig_bytes`` of a
    lossless controller), which a 2-bit controller's ``orig_bytes`` must equal. The RNG is
    restored, so the training runs draw the same dropout masks."""
    with torch.random.fork_rng():
        model = _model()
        stock = count_saved_bytes(lambda: model(batch.x, batch.edge_index), model)
        with compress_gnn(model, bits=None) as ctl:
            out = model(batch.x, batch.edge_index)
            paths = ctl.stats()["total"]["orig_bytes"]
            del out
    return {"stock": stock, "paths": paths}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        data = make_synthetic_graph(2400, 24_000, 32, 4, seed=0)
        parts = list(RandomNodeLoader(data, num_parts=2 * WORLD, shuffle=False))
        result = {label: _train(rank, bits, seed, parts) for label, bits, seed in RUNS}
        result["saved_bytes"] = [_saved_bytes(b) for b in parts[rank::WORLD]]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_each_rank_compresses_its_own_activations(ddp_runs):
    for rank, runs in enumerate(ddp_runs):
        own = runs["saved_bytes"]  # per batch of this rank, measured without DDP
        for label in ("2bit", "2bit-seed1"):
            stats = runs[label]["stats"]
            assert len(stats) == STEPS
            for step, s in enumerate(stats):  # the rank's batches cycle
                assert s["orig_bytes"] == own[step % len(own)]["paths"], (rank, label, step)
                assert s["stored_bytes"] < own[step % len(own)]["stock"] / 4, (rank, label, step)
    # the two ranks trained on different batches, and their controllers saw them
    first = [runs["2bit"]["stats"][0]["orig_bytes"] for runs in ddp_runs]
    assert first[0] != first[1]


def test_allreduce_and_comm_hooks_untouched(ddp_runs):
    for runs in ddp_runs:
        runs = {label: runs[label] for label, _, _ in RUNS}
        calls = {label: r["hook_calls"] for label, r in runs.items()}
        assert calls["stock"] >= STEPS  # at least one bucket per step
        assert set(calls.values()) == {calls["stock"]}, calls
        for label, r in runs.items():
            assert r["params_equal"], f"{label}: ranks ended with different parameters"


def test_lossless_trains_as_uncompressed_ddp(ddp_runs):
    runs = ddp_runs[0]  # the losses are all-reduced means: equal on every rank
    assert runs["lossless"]["losses"] == pytest.approx(runs["stock"]["losses"], rel=1e-4)


def test_two_bit_loss_curve_within_compression_noise(ddp_runs):
    runs = ddp_runs[0]
    stock = torch.tensor(runs["stock"]["losses"])
    two, other = torch.tensor(runs["2bit"]["losses"]), torch.tensor(runs["2bit-seed1"]["losses"])
    noise = (two - other).abs().max().item()
    gap = (two - stock).abs().max().item()
    assert 0 < noise, "two rounding seeds gave the same curve: nothing was quantized"
    assert gap <= 3 * noise, f"2-bit vs stock {gap:.4f}, 2-bit vs 2-bit {noise:.4f}"
    assert two[-4:].mean() < 0.8 * two[:4].mean()  # and it trains


def test_doc_example_under_torchrun(cora_root, doc_example, tmp_path):
    """The DDP recipe of docs/integrations.md, run as documented: torchrun, 2 gloo processes."""
    code = doc_example("ddp")
    for old, new in [('root = "data"', f"root = {str(cora_root)!r}"),
                     ("epochs = 100", "epochs = 30")]:  # fmt: skip
        assert old in code
        code = code.replace(old, new)
    script = tmp_path / "train.py"
    script.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = re.findall(r"rank (\d): last batch saved (\d+) -> (\d+) bytes", proc.stdout)
    assert sorted(r[0] for r in ranks) == ["0", "1"], proc.stdout
    for _, orig, stored in ranks:
        assert 0 < int(stored) < int(orig) / 3
    acc = float(re.search(r"test accuracy ([\d.]+)", proc.stdout).group(1))
    assert acc > 0.6, proc.stdout
