"""What `Controller.stats()` and `Controller.report()` say: the bytes of the last forward's
saved tensors, by kind and by module, tallied from the records the pack hook keeps.

The tally is made when asked, never per saved tensor: the pack hook only appends a record,
so a step that nobody reports on pays nothing for the figures.
"""

from __future__ import annotations

from typing import Any

from gact_graph.core.saved import KINDS

__all__ = ["saved_report", "saved_stats"]


def saved_stats(ctl) -> dict[str, Any]:
    """`Controller.stats()`: the records written out, summed per kind and in total."""
    tensors = [
        {**r, "shape": tuple(r["shape"]), "dtype": str(r["dtype"]).replace("torch.", "")}
        for r in ctl._records
    ]
    by_kind = {k: {"count": 0, "orig_bytes": 0, "stored_bytes": 0} for k in KINDS}
    for r in tensors:
        agg = by_kind[r["kind"]]
        agg["count"] += 1
        agg["orig_bytes"] += r["orig_bytes"]
        agg["stored_bytes"] += r["stored_bytes"]
    counted = [k for k in KINDS if k not in ("param", "input")]
    orig = sum(by_kind[k]["orig_bytes"] for k in counted)
    stored = sum(by_kind[k]["stored_bytes"] for k in counted)
    live = 0
    for w in ctl._live:
        s = w()
        if s is not None and s.kind not in ("param", "input"):
            live += s.stored_bytes
    out = {
        "step": ctl.step,
        "tensors": tensors,
        "by_kind": by_kind,
        "total": {
            "orig_bytes": orig,
            "stored_bytes": stored,
            "ratio": (orig / stored) if stored else float("inf") if orig else 1.0,
        },
        "live_stored_bytes": live,
    }
    progress = getattr(ctl.adapter, "progress", None)
    if progress is not None:
        out["re_estimation"] = progress()
    return out


def saved_report(ctl) -> str:
    """`Controller.report()`: a row per module, the total, then the adapter's and extras' lines."""
    per_module: dict[str, list[int]] = {}
    for r in ctl._records:
        path = r["name"].rsplit("#", 1)[0]
        agg = per_module.setdefault(path, [0, 0, 0])
        if r["kind"] in ("param", "input"):
            continue
        agg[0] += 1
        agg[1] += r["orig_bytes"]
        agg[2] += r["stored_bytes"]
    rows = [f"{'module':<40} {'path':<14} {'saved':>5} {'orig MB':>10} {'stored MB':>10}"]
    for path, kind in ctl.module_paths.items():
        n, o, s = per_module.get(path, [0, 0, 0])
        rows.append(f"{path:<40} {kind:<14} {n:>5} {o / 2**20:>10.3f} {s / 2**20:>10.3f}")
    tot = ctl.stats()["total"]
    rows.append(
        f"{'total':<40} {'':<14} {'':>5} {tot['orig_bytes'] / 2**20:>10.3f} "
        f"{tot['stored_bytes'] / 2**20:>10.3f}"
    )
    if ctl.adapter is not None:  # bits and sensitivity per tensor
        rows += ["", ctl.adapter.report(ctl.plan)]
    for extra in ctl.report_extra:  # the step's memory, the memory-budget plan
        rows += ["", extra()]
    return "\n".join(rows)
