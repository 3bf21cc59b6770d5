"""Mini-batch training, compressed against uncompressed, side by side: accuracy and memory per
batch (docs/results/minibatch.md).

For each model, runs ``examples/train_minibatch.py`` once per bit setting (``fp32`` and
``--bits``, default 2), each in a fresh process (so each peak RSS is its own), with the same
seeds, loader and flags; prints a table and writes every run's JSON summary into one file.

    python benchmarks/minibatch.py --dataset cora --root data --models sage gat \\
        --json cora.json -- --loader random --num-parts 4 --epochs 50 --seeds 3

Everything after ``--`` goes to the example unchanged.

``--loader neighbor-emulated`` runs no example: NeighborLoader's batches (k-hop sampled
subgraphs, seeds first, node and edge counts varying per batch, the loss on the seeds),
*emulated* in pure PyTorch by ``tests/integrations/neighbor_sampler.py`` since PyG's own
NeighborLoader needs pyg-lib or torch-sparse, on a synthetic graph, in this process;
``--loader neighbor`` takes PyG's own ``NeighborLoader`` instead (where one of them imports).
Per model it trains under ``memory_budget=`` (``--budget-factor`` times the least budget the planner
names for the first batch) and in the default mode (2 adaptive bits), and reports per run the
profile steps, the steps at their plan's bits, the plans kept and the worst step against the
budget by the planner's meter (docs/results/minibatch.md):

    python benchmarks/minibatch.py --loader neighbor-emulated --models gcn sage gat \
        --nodes 20000 --edges 200000 --batch-size 256 --epochs 2 --json neighbor.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_minibatch.py"


def run(dataset: str, root: str | None, model: str, bits: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(EXAMPLE), "--dataset", dataset, "--model", model,
               "--bits", bits, "--no-progress", "--json", str(out), *extra]  # fmt: skip
        if root is not None:
            cmd += ["--root", root]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        print("$", " ".join(cmd[1:]), flush=True)
        proc = subprocess.run(cmd, env=env, text=True, capture_output=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def table(rows: list[dict]) -> str:
    head = (
        "| model | bits | test metric (mean ± std) | saved per batch, stock | stored per batch | "
        "ratio | largest batch stored | peak of a step | above step start | "
        "epoch time |"
    )
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        s = r["summary"]
        mib = 2**20
        lines.append(
            f"| {r['model']} | {r['bits']} | {100 * s['test_metric_mean']:.2f} ± "
            f"{100 * s['test_metric_std']:.2f} | {s['activation_bytes_fp32'] / mib:.2f} MiB | "
            f"{s['activation_bytes_stored'] / mib:.2f} MiB | "
            f"{s['compression_ratio']:.1f}x | {s['activation_bytes_stored_max'] / mib:.2f} MiB | "
            f"{s['peak_memory_bytes'] / mib:,.0f} MiB | "
            f"{max(x['peak_above_start_bytes'] for x in s['per_seed']) / mib:,.0f} MiB | "
            f"{s['epoch_time_s']:.2f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic-flickr")
    p.add_argument("--root", default=None)
    p.add_argument("--models", nargs="+", default=["sage", "gat"])
    p.add_argument("--bits", default="2", help="the compressed setting (against fp32)")
    p.add_argument("--json", help="write every run's summary here")
    p.add_argument(
        "--loader", choices=["example", "neighbor-emulated", "neighbor"], default="example",
        help="example: run examples/train_minibatch.py (its own --loader after --); "
        "neighbor-emulated: NeighborLoader's batches emulated in pure PyTorch, budget checks; "
        "neighbor: the same checks on PyG's NeighborLoader (needs pyg-lib or torch-sparse)",
    )  # fmt: skip
    emu = p.add_argument_group("--loader neighbor-emulated / neighbor")
    emu.add_argument("--nodes", type=int, default=20_000)
    emu.add_argument("--edges", type=int, default=200_000)
    emu.add_argument("--features", type=int, default=64)
    emu.add_argument("--classes", type=int, default=8)
    emu.add_argument("--hidden", type=int, default=64)
    emu.add_argument("--batch-size", type=int, default=256)
    emu.add_argument("--fanout", type=int, nargs="+", default=[10, 5])
    emu.add_argument("--epochs", type=int, default=2)
    emu.add_argument("--budget-factor", type=float, default=1.1)
    emu.add_argument("--threads", type=int, default=1)
    args = p.parse_args(own)
    if args.loader in ("neighbor-emulated", "neighbor"):
        if extra:
            p.error(f"--loader {args.loader} runs no example: nothing goes after --")
        return neighbor_emulated(args)
    rows = []
    for model in args.models:
        for bits in ("fp32", args.bits):
            summary = run(args.dataset, args.root, model, bits, extra)
            rows.append({"model": model, "bits": bits, "summary": summary})
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


# ------------------------------------------------------------ --loader neighbor-emulated
def _neighbor_model(name: str, features: int, hidden: int, classes: int):
    from torch_geometric.nn import GraphSAGE

    from gact_graph.models import GAT, GCN

    models = {
        "gcn": lambda: GCN(features, hidden, classes, num_layers=2, dropout=0.0, batch_norm=False),
        "sage": lambda: GraphSAGE(features, hidden, 2, classes),
        "gat": lambda: GAT(
            features, hidden // 4, classes, num_layers=2, heads=4, dropout=0.0, batch_norm=False
        ),  # fmt: skip
    }
    if name not in models:
        raise SystemExit(f"--loader neighbor-emulated: model {name!r} is none of {sorted(models)}")
    import torch

    torch.manual_seed(0)
    return models[name]()


def _seed_loss(model, batch):
    import torch.nn.functional as F

    out = model(batch.x, batch.edge_index)[: batch.batch_size]
    return F.cross_entropy(out, batch.y[: batch.batch_size])


def _least_budget(model, batch) -> int:
    """What the planner names for a profile step on ``batch`` (a run at 1 KiB is refused)."""
    from gact_graph import compress_gnn
    from gact_graph.budget import BudgetError

    ctl = compress_gnn(model, memory_budget="1KiB")
    try:
        _seed_loss(model, batch).backward()
        ctl.iterate()
    except BudgetError as err:
        return int(err.least_budget)
    finally:
        ctl.remove()
    raise RuntimeError("a 1 KiB budget was admitted")


def _train(model, ctl, batches: list) -> list[dict]:
    """Per step: the planner's phase (None without a budget), sizes, and whether every saved
    activation the controller quantizes at all was stored at the plan in force's bits (what
    a graph-aware path keeps lossless whatever the bits, None in the first step, excepted)."""
    import math

    import torch

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    planner = getattr(ctl, "budget", None)
    lossless: set[str] | None = None
    steps = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        _seed_loss(model, batch).backward()
        opt.step()
        records = [
            r for r in ctl.stats()["tensors"]
            if r["kind"] == "activation" and math.prod(r["shape"]) >= ctl.config.min_numel
        ]  # fmt: skip
        if lossless is None:
            lossless = {r["name"] for r in records if r["bits"] is None}
        phase = planner._phase if planner is not None else None
        choice = planner.plan_state.plan.choice if planner and planner.plan_state else {}
        at_plan = phase != "profile"
        for r in records:
            name = r["name"]
            if name in lossless:
                at_plan = at_plan and r["bits"] is None
            elif planner is not None:
                at_plan = at_plan and planner._unit_of(name) in choice
                at_plan = at_plan and r["bits"] == planner.bits_for(name)
            else:
                at_plan = at_plan and r["bits"] == ctl.bits_for(name)
        ctl.iterate()
        steps.append({
            "phase": phase, "nodes": batch.num_nodes, "edges": batch.edge_index.size(1),
            "at_plan": at_plan,
        })  # fmt: skip
    return steps


def _run_summary(model_name: str, mode: str, steps: list[dict], ctl, budget) -> dict:
    planner = getattr(ctl, "budget", None)
    nodes = [s["nodes"] for s in steps]
    edges = [s["edges"] for s in steps]
    ratio = [e / n for n, e in zip(nodes, edges)]
    out = {
        "model": model_name, "mode": mode, "steps": len(steps),
        "distinct_sizes": len(set(zip(nodes, edges))),
        "nodes": [min(nodes), max(nodes)], "edges": [min(edges), max(edges)],
        "edges_per_node": [min(ratio), max(ratio)],
        "profile_steps": sum(s["phase"] == "profile" for s in steps),
        "profile_at": [
            [i, s["nodes"], s["edges"]] for i, s in enumerate(steps) if s["phase"] == "profile"
        ],
        "steps_at_plan_after_first": sum(s["at_plan"] for s in steps[1:]),
        "stats_ratio": ctl.stats()["total"]["ratio"],
    }  # fmt: skip
    if planner is not None:
        history = planner.history
        worst = max(h["measured"] for h in history)
        out.update(
            budget=budget, least_budget=planner.plan_state.least_budget, meter=planner.meter,
            plans_kept=sum(len(c) for c in planner.classes.values()),
            plans_bound=planner.MAX_CLASSES, worst_step=worst,
            worst_planned=max((h["measured"] for h in history if h["phase"] == "planned"),
                              default=None),
            probe_steps=sum(bool(h["probe"]) for h in history),
            rectified=sum(bool(h["rectified"]) for h in history),
            over_budget=sum(h["measured"] > budget for h in history),
            plan=sorted({o.label for o in planner.plan_state.plan.choice.values()}),
        )  # fmt: skip
    else:
        out.update(plans_kept=len(ctl.plan), estimates=ctl.adapter.n_estimates)
    return out


def neighbor_table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| model | mode | steps | batch nodes | batch edges | E/N | profile steps | "
        "steps at planned bits (after the first) | plans kept | worst step / budget |",
        "|" + " --- |" * 10,
    ]
    for r in rows:
        if r["mode"] == "budget":
            plans = f"{r['plans_kept']} (at most {r['plans_bound']})"
            worst = (f"{r['worst_step'] / mib:.2f} / {r['budget'] / mib:.2f} MiB "
                     f"({r['meter']})")  # fmt: skip
        else:
            plans = f"{r['plans_kept']} tensor roles"
            worst = "no budget"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['steps']} | {r['nodes'][0]:,}-{r['nodes'][1]:,} | "
            f"{r['edges'][0]:,}-{r['edges'][1]:,} | "
            f"{r['edges_per_node'][0]:.2f}-{r['edges_per_node'][1]:.2f} | "
            f"{r['profile_steps']} | {r['steps_at_plan_after_first']} of {r['steps'] - 1} | "
            f"{plans} | {worst} |"
        )
    return "\n".join(lines)


def neighbor_emulated(args) -> list[dict]:
    """Budget and default-mode runs on NeighborLoader's batches, emulated or PyG's own
    (``--loader neighbor``; module docstring)."""
    import warnings

    import torch

    sys.path.insert(0, str(REPO))
    from gact_graph import compress_gnn
    from gact_graph.datasets.synthetic import make_synthetic_graph
    from tests.integrations.neighbor_sampler import EmulatedNeighborLoader

    torch.set_num_threads(args.threads)
    data = make_synthetic_graph(args.nodes, args.edges, args.features, args.classes, seed=0)
    if args.loader == "neighbor":
        from torch_geometric.loader import NeighborLoader as Loader

        what = "PyG's NeighborLoader"
    else:
        Loader, what = EmulatedNeighborLoader, "NeighborLoader emulated (tests/integrations)"
    loader = Loader(
        data, args.fanout, batch_size=args.batch_size, input_nodes=data.train_mask,
        shuffle=True, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    batches = [b for _ in range(args.epochs) for b in loader]
    print(
        f"{what}: {args.nodes:,} nodes, "
        f"{args.edges:,} edges, fan-out {args.fanout}, {args.batch_size} seeds per batch, "
        f"{len(batches)} steps",
        flush=True,
    )
    rows = []
    for name in args.models:
        least = _least_budget(_neighbor_model(name, args.features, args.hidden, args.classes),
                              batches[0])  # fmt: skip
        budget = int(args.budget_factor * least)
        for mode in ("budget", "default"):
            model = _neighbor_model(name, args.features, args.hidden, args.classes)
            kw = {"memory_budget": budget} if mode == "budget" else {}
            ctl = compress_gnn(model, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps = _train(model, ctl, batches)
            rows.append(_run_summary(name, mode, steps, ctl, budget if kw else None))
            ctl.remove()
            print(rows[-1], flush=True)
    print(neighbor_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
