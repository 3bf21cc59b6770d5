"""Cost of adaptive bit allocation, measured side by side in one run.

Two copies of the same model train in lockstep on the same graph (their steps alternate, so
machine load hits both alike): one with fixed ``--bits`` (rounded down to a quantizer width),
one adaptive at an average of ``--bits``. Reported:

* step time of each (forward, backward, optimizer step, ``ctl.iterate()``), and the adaptive
  run's extra time as a fraction of its training time;
* time of one sensitivity estimate by the probe (the extra time of a probed step) and by
  GACT's Algorithm 1 (``two_seed_sensitivity``, two passes per tensor), in units of one
  training step.

    python benchmarks/adapt_overhead.py --dataset cora --root data --model gcn
    python benchmarks/adapt_overhead.py --dataset synthetic-ogbn-arxiv --scale 0.02 --model gat
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

from gact_graph import compress_gnn
from gact_graph.datasets import load_dataset
from gact_graph.models import build_model, preset
from gact_graph.policy.sensitivity import two_seed_sensitivity


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="cora")
    p.add_argument("--root", default=None)
    p.add_argument("--scale", type=float, default=None, help="synthetic graphs only")
    p.add_argument("--model", choices=["gcn", "gat", "gcnii"], default="gcn")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--bits", type=float, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--alg1-repeats", type=int, default=1, help="estimates timed per estimator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    kw = {} if args.scale is None else {"scale": args.scale}
    data = load_dataset(args.dataset, root=args.root, **kw)
    cfg = preset(args.model, args.dataset)
    if args.layers is not None:
        cfg["model"]["num_layers"] = args.layers
    torch.manual_seed(args.seed)
    base = build_model(args.model, data.num_features, data.num_classes, **cfg["model"])
    fixed_bits = max(b for b in (1, 2, 4, 8) if b <= args.bits)
    models, ctls, opts = {}, {}, {}
    for kind in ("fixed", "adaptive"):
        m = copy.deepcopy(base)
        models[kind] = m
        opts[kind] = torch.optim.Adam(m.parameters(), lr=cfg["lr"])
        if kind == "fixed":
            ctls[kind] = compress_gnn(m, bits=fixed_bits, adaptive=False)
        else:
            ctls[kind] = compress_gnn(m, bits=args.bits, adaptive=True)
    mask = data.train_mask

    def step_fn(kind):
        def step():
            opts[kind].zero_grad(set_to_none=True)
            out = models[kind](data.x, data.edge_index)
            loss = F.cross_entropy(out[mask], data.y[mask])
            loss.backward()
            return loss

        return step

    times = {"fixed": [], "adaptive": []}
    probed = []
    for _ in range(args.steps):
        for kind in ("fixed", "adaptive"):
            before = ctls[kind].adapter.n_estimates if kind == "adaptive" else 0
            t0 = time.perf_counter()
            step_fn(kind)()
            opts[kind].step()
            ctls[kind].iterate(step_fn(kind))
            times[kind].append(time.perf_counter() - t0)
            if kind == "adaptive":
                probed.append(ctls[kind].adapter.n_estimates > before)

    ad = ctls["adaptive"].adapter
    n_tensors = len(ad.tensors)
    t_fixed = sum(times["fixed"])
    t_adapt = sum(times["adaptive"])
    plain = [t for t, pr in zip(times["adaptive"], probed) if not pr]
    probe_steps = [t for t, pr in zip(times["adaptive"], probed) if pr]
    step_med = statistics.median(times["fixed"])
    # one estimate by each estimator, on the adaptive model, timed back to back
    alg1 = []
    for _ in range(args.alg1_repeats):
        t0 = time.perf_counter()
        two_seed_sensitivity(ctls["adaptive"], step_fn("adaptive"), names=list(ad.tensors))
        alg1.append(time.perf_counter() - t0)
    probe_extra = (
        statistics.median(probe_steps) - statistics.median(plain) if probe_steps and plain else None
    )
    res = {
        "dataset": args.dataset,
        "model": args.model,
        "bits": args.bits,
        "fixed_bits": fixed_bits,
        "steps": args.steps,
        "tensors": n_tensors,
        "estimates": ad.n_estimates,
        "step_s_fixed_median": step_med,
        "step_s_adaptive_median": statistics.median(times["adaptive"]),
        "train_s_fixed": t_fixed,
        "train_s_adaptive": t_adapt,
        "adaptive_extra_fraction": (t_adapt - t_fixed) / t_adapt,
        "probe_s_in_hooks": ad.probe_seconds,
        "probe_fraction_in_hooks": ad.overhead(),
        "probe_estimate_extra_s": probe_extra,
        "probe_estimate_in_steps": None if probe_extra is None else probe_extra / step_med,
        "alg1_estimate_s": statistics.fmean(alg1),
        "alg1_estimate_in_steps": statistics.fmean(alg1) / step_med,
        "final_plan": dict(ctls["adaptive"].plan),
    }
    print(f"{args.model} on {args.dataset}: {n_tensors} compressed tensors, {args.steps} steps")
    print(f"{'':32} {'fixed':>10} {'adaptive':>10}")
    med_ad = res["step_s_adaptive_median"]
    print(f"{'median step (ms)':32} {1e3 * step_med:>10.1f} {1e3 * med_ad:>10.1f}")
    print(f"{'total train time (s)':32} {t_fixed:>10.2f} {t_adapt:>10.2f}")
    print(
        f"adaptive extra time: {100 * res['adaptive_extra_fraction']:.1f}% of its training time "
        f"({ad.n_estimates} estimates; time inside the probe {100 * ad.overhead():.1f}%)"
    )
    if probe_extra is not None:
        print(
            f"one estimate: probe {res['probe_estimate_in_steps']:.2f} steps, "
            f"Algorithm 1 {res['alg1_estimate_in_steps']:.1f} steps"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    for c in ctls.values():
        c.remove()
    return res


if __name__ == "__main__":
    main()
