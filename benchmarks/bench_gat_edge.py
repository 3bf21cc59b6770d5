"""GAT's (or GATv2's) edge stage, forward + backward: the fused Triton kernels against the
chunked PyTorch stage and stock PyG's message passing.

The edge stage is everything between the node-level logits and the aggregated output: per
edge ``a_src[src] + a_dst[dst]``, leaky ReLU, the softmax over each destination's edges,
attention dropout, ``alpha * x'[src]`` summed into the destination. Stock is what `GATConv`
runs (PyG's `softmax`, `F.dropout`, the gathered messages and `scatter`); "chunked" is
`GatAttentionFunction`; "triton" is `GatFusedFunction` (`gact_graph.kernels.gat_edge`). Each
row times one forward and one backward (into x', a_src, a_dst) of the same inputs; on CUDA with
`triton.testing.do_bench` (median) and the peak memory above the inputs, on CPU with a wall
clock; the forward alone (under no_grad) is timed too.

The graph has ogbn-arxiv's size by default: 169,343 nodes, 1,166,243 random edges made
undirected (both directions), self-loops added as GAT adds them; H = 3 heads of C = 128.

Usage::

    python benchmarks/bench_gat_edge.py --json out.json          # CUDA, arxiv size
    python benchmarks/bench_gat_edge.py --op gatv2 --dropout 0.1  # GATv2, with dropout
    python benchmarks/bench_gat_edge.py --dataset synthetic-ogbn-arxiv  # heavy-tailed degrees
    python benchmarks/bench_gat_edge.py --dry-run                  # CPU, a tiny graph
    TRITON_INTERPRET=1 python benchmarks/bench_gat_edge.py --dry-run   # + the kernels, interpreted
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_geometric.utils import scatter, softmax  # noqa: E402

from gact_graph.kernels import gat_rows, triton_available  # noqa: E402
from gact_graph.sparse import gat as sgat  # noqa: E402
from gact_graph.sparse import gat_fused as sfused  # noqa: E402
from gact_graph.sparse import gatv2 as sgatv2  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_graph(num_nodes: int, num_edges: int, device: torch.device, seed: int = 0,
               dataset: str | None = None):  # fmt: skip
    """Random edges in both directions (or ``dataset``'s edges, e.g. ``synthetic-ogbn-arxiv``:
    heavy-tailed degrees), plus one self-loop per node: ``(edge_index, rowptr, col, num_nodes)``
    (the edge list in PyG's order, the destination-sorted CSR)."""
    if dataset is not None:  # (its edge list holds both directions already)
        from gact_graph.datasets import load_dataset

        data = load_dataset(dataset)
        ei, num_nodes = data.edge_index, data.num_nodes
        ei = ei[:, ei[0] != ei[1]]
    else:
        g = torch.Generator().manual_seed(seed)
        ei = torch.randint(0, num_nodes, (2, num_edges), generator=g)
        ei = ei[:, ei[0] != ei[1]]
        ei = torch.cat([ei, ei.flip(0)], 1)
    loops = torch.arange(num_nodes).expand(2, -1)
    ei = torch.cat([ei, loops], 1)
    dst, order = ei[1].sort(stable=True)
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(dst, minlength=num_nodes).cumsum(0)
    col = ei[0, order].to(torch.int32)
    return ei.to(device), rowptr.to(device), col.to(device), num_nodes


def stock_edge_stage(x, a_src, a_dst, edge_index, slope: float, p: float):
    """`GATConv`'s edge stage as PyG 2.8 runs it (edge_update, message, aggregate)."""
    src, dst = edge_index
    alpha = torch.nn.functional.leaky_relu(a_src[src] + a_dst[dst], slope)
    alpha = softmax(alpha, dst, num_nodes=x.size(0))
    alpha = torch.nn.functional.dropout(alpha, p, training=p > 0)
    return scatter(alpha.unsqueeze(-1) * x[src], dst, 0, x.size(0), reduce="sum")


def stock_gatv2_edge_stage(x_l, x_r, att, edge_index, slope: float, p: float):
    """`GATv2Conv`'s edge stage as PyG 2.8 runs it (message, aggregate)."""
    src, dst = edge_index
    x_j = x_l[src]
    z = torch.nn.functional.leaky_relu(x_j + x_r[dst], slope)
    alpha = softmax((z * att).sum(-1), dst, num_nodes=x_l.size(0))
    alpha = torch.nn.functional.dropout(alpha, p, training=p > 0)
    return scatter(alpha.unsqueeze(-1) * x_j, dst, 0, x_l.size(0), reduce="sum")


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, int | None]:
    """(median ms, peak bytes above the start or None) of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return triton.testing.do_bench(fn, warmup=10, rep=max(50, repeats)), peak
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), None


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    ei, rowptr, col, n = make_graph(args.nodes, args.edges, device, dataset=args.dataset)
    h, c = args.heads, args.channels
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, c, generator=g).to(device, dtype).requires_grad_()
    a_src = torch.randn(n, h, generator=g).to(device).requires_grad_()
    a_dst = torch.randn(n, h, generator=g).to(device).requires_grad_()
    grad_out = torch.randn(n, h, c, generator=g).to(device, torch.promote_types(dtype, a_src.dtype))
    leaves = [x, a_src, a_dst]
    transpose = gat_rows.csr_transpose(rowptr, col, n)
    slope, p = 0.2, args.dropout

    def step(forward):
        def fn():
            for t in leaves:
                t.grad = None
            forward().backward(grad_out)

        fn.forward = forward
        return fn

    kernels_run = triton_available() and (
        device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if args.op == "gat":
        variants = {
            "stock PyG": step(lambda: stock_edge_stage(x, a_src, a_dst, ei, slope, p)),
            "chunked": step(lambda: sgat.gat_attention(x, a_src, a_dst, rowptr, col, slope, p)),
        }
        if kernels_run:
            variants["triton"] = step(
                lambda: sfused.gat_attention_fused(
                    x, a_src, a_dst, rowptr, col, slope, p, transpose
                )
            )
    else:  # GATv2: x_l = x, x_r and att in place of the node logits
        x_r = torch.randn(n, h, c, generator=g).to(device, dtype).requires_grad_()
        att = torch.randn(1, h, c, generator=g).to(device).requires_grad_()
        leaves[:] = [x, x_r, att]
        variants = {
            "stock PyG": step(lambda: stock_gatv2_edge_stage(x, x_r, att, ei, slope, p)),
            "chunked": step(lambda: sgatv2.gatv2_attention(x, x_r, att, rowptr, col, slope, p)),
        }
        if kernels_run:
            variants["triton"] = step(
                lambda: sfused.gatv2_attention_fused(x, x_r, att, rowptr, col, slope, p, transpose)
            )
    rows = []
    for name, fn in variants.items():
        ms, peak = _timed(fn, device, args.repeats)
        with torch.no_grad():
            fwd_ms, _ = _timed(fn.forward, device, args.repeats)
        rows.append({"variant": name, "ms": ms, "forward_ms": fwd_ms, "peak_bytes": peak})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_stock"] = r["ms"] / base
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    max_degree = int((rowptr[1:] - rowptr[:-1]).max()) if n else 0
    return {
        "op": args.op,
        "graph": args.dataset or "random",
        "max_in_degree": max_degree,
        "device": device_name,
        "nodes": n,
        "edges_with_loops": int(col.numel()),
        "heads": h,
        "channels": c,
        "dtype": args.dtype,
        "dropout": p,
        "triton": "ran" if kernels_run else "skipped (needs CUDA or TRITON_INTERPRET=1)",
        "rows": rows,
    }


def format_table(res: dict) -> str:
    lines = [
        f"{res['op'].upper()} edge stage fwd+bwd on {res['device']}: {res['graph']} graph, "
        f"{res['nodes']:,} nodes, {res['edges_with_loops']:,} edges (max in-degree "
        f"{res['max_in_degree']:,}), H={res['heads']}, C={res['channels']}, "
        f"{res['dtype']}, dropout {res['dropout']}; triton {res['triton']}",
        f"{'variant':<12} {'fwd+bwd ms':>10} {'vs stock':>9} {'fwd ms':>9} {'peak MiB':>9}",
    ]
    for r in res["rows"]:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['variant']:<12} {r['ms']:>10.3f} {r['vs_stock']:>9.2f} {r['forward_ms']:>9.3f} "
            f"{peak:>9}"
        )
    return "\n".join(lines)


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--op", choices=["gat", "gatv2"], default="gat")
    ap.add_argument("--nodes", type=int, default=169_343)
    ap.add_argument("--edges", type=int, default=1_166_243, help="before both directions")
    ap.add_argument(
        "--dataset", default=None,
        help="take this dataset's edges instead of random ones, e.g. synthetic-ogbn-arxiv",
    )  # fmt: skip
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=None, help="default 100 (cuda) / 3 (cpu)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny graph, to check it runs")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run:
        args.nodes, args.edges, args.channels = (48, 160, 8) if interpreted else (200, 800, 12)
    if args.repeats is None:
        args.repeats = 100 if args.device.startswith("cuda") else 1 if interpreted else 3
    res = run(args)
    print(format_table(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
