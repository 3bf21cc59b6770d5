"""The package layout is the architecture (docs/design.md, "Layers"): each layer imports only
the layers below it, no module imports another module's private names, and no import circle
exists, lazy imports inside functions included. Read from the source (AST), so a circle that
Python happens to tolerate at import time still fails here."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gact_graph"

#: layer -> the layers its modules may import (besides itself). Mirrors the diagram in
#: docs/design.md; the root ``gact_graph/__init__.py`` may import anything it re-exports.
ALLOWED = {
    "kernels": set(),
    "config": set(),
    # switches: package_work, the pack hook's way past the forward's pointwise mode
    "core": {"kernels", "config", "switches"},
    # kernels: the fused attention's Triton kernels (plain tensors in and out)
    "sparse": {"config", "kernels", "switches"},
    # core: RowChunked, which BatchNorm's backward reads in the probe's partial backwards
    "ops": {"core", "config", "switches"},
    "policy": {"core", "kernels", "config", "switches"},
    "api": {"config", "core", "policy", "ops", "sparse", "budget"},
    # the memory-budget planner; switches: its profile step sets the probe's work and a
    # graph's adjacency build aside
    "budget": {"core", "kernels", "config", "policy", "switches"},
    "memory": {"config", "core"},
    "integrations": {"api", "config", "core", "sparse"},
    "models": set(),
    "datasets": set(),
    "cpus": set(),
    # the probe's lean-backward switch and the once-per-graph switch the planner reads
    "switches": set(),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for every gact_graph import in ``path``, at any
    depth (inside functions and ``TYPE_CHECKING`` blocks too). ``from pkg import sub`` of a
    submodule counts as an import of ``pkg.sub``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "gact_graph"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "gact_graph":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, None) if sub in MODULES else (node.module, a.name))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@functools.cache  # read once: every module's test looks it up
def _graph() -> dict[str, set[str]]:
    return {m: {dep for dep, _ in _imports(p) if dep != m} for m, p in MODULES.items()}


def test_every_layer_is_known():
    assert {_layer(m) for m in MODULES} - {""} == set(ALLOWED)


@pytest.mark.parametrize("module", [m for m in MODULES if m != "gact_graph"])
def test_layer_imports_only_layers_below(module):
    own = _layer(module)
    wrong = sorted(
        dep for dep in _graph()[module] if _layer(dep) != own and _layer(dep) not in ALLOWED[own]
    )
    assert not wrong, f"{module} ({own}) imports {wrong}; {own} may import {sorted(ALLOWED[own])}"


def test_no_import_of_private_names_across_modules():
    bad = [
        f"{m} imports {name} from {dep}"
        for m, p in MODULES.items()
        for dep, name in _imports(p)
        if name and name.startswith("_") and dep != m
    ]
    assert not bad, bad


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    cycle = _find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_public_api_unchanged():
    import gact_graph

    assert gact_graph.__all__ == [
        "compress_gnn",
        "CompressionConfig",
        "Controller",
        "QTensor",
        "quantize",
    ]
    assert callable(gact_graph.quantize)  # the function, not a module of that name
    from gact_graph.datasets import evaluate, load_dataset  # noqa: F401
    from gact_graph.integrations.pyg import GactCallback  # noqa: F401
    from gact_graph.models import GAT, GCN, GCNII  # noqa: F401


def test_no_module_lowers_float32_matmul_precision():
    """Lossless mode must be as exact as stock: no module of the package may turn on TF32 or
    reduced-precision reductions for the user (the CUDA lossless tests check the values)."""
    pattern = re.compile(r"allow_tf32|set_float32_matmul_precision|allow_(bf16|fp16)_reduced")
    offenders = [
        str(f.relative_to(PACKAGE))
        for f in PACKAGE.rglob("*.py")
        if pattern.search(f.read_text(encoding="utf-8"))
    ]
    assert not offenders, offenders


def test_no_module_changes_the_users_warning_filters():
    """The package quiets a warning only inside ``warnings.catch_warnings()``: a filter added
    at import, or anywhere else, would change what the user's own code is told."""
    changes = {"warnings.filterwarnings", "warnings.simplefilter", "warnings.resetwarnings"}

    def outside(node: ast.AST, inside: bool) -> list[int]:
        lines = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and ast.unparse(child.func) in changes and not inside:
                lines.append(child.lineno)
            catches = isinstance(child, ast.With) and any(
                ast.unparse(item.context_expr) == "warnings.catch_warnings()"
                for item in child.items
            )
            lines += outside(child, inside or catches)
        return lines

    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in outside(ast.parse(path.read_text(encoding="utf-8")), False)
    ]
    assert not offenders, offenders


#: Most lines a module and a class of the package may hold: a module past them is split (one op
#: per kernel file, one concern per module), so that each reads whole.
MAX_MODULE_LINES, MAX_CLASS_LINES = 700, 400
#: The modules and classes past those limits today, each with the most lines it may keep: the
#: list only shrinks (a listed one may not grow; once within the limit it leaves the list).
OVERSIZED = {
    "budget/apply.py": 878,
    "budget/apply.py::BudgetPlanner": 702,
    "core/controller.py::Controller": 540,
    "kernels/quantize.py": 874,
    "policy/adaptive.py": 1062,
    "policy/adaptive.py::Adapter": 659,
}


def _sizes() -> dict[str, tuple[int, int]]:
    """``{"path" or "path::Class": (lines, limit)}`` for every module and class of the package."""
    sizes = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name, text = path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8")
        sizes[name] = (len(text.splitlines()), MAX_MODULE_LINES)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                sizes[f"{name}::{node.name}"] = (lines, MAX_CLASS_LINES)
    return sizes


def test_no_module_or_class_grows_past_its_limit():
    sizes = _sizes()
    over = [
        f"{name}: {lines} lines > {OVERSIZED.get(name, limit)}"
        for name, (lines, limit) in sizes.items()
        if lines > OVERSIZED.get(name, limit)
    ]
    assert not over, (
        f"split these (limits: {MAX_MODULE_LINES} a module, {MAX_CLASS_LINES} a class): {over}"
    )
    within = [n for n in OVERSIZED if n not in sizes or sizes[n][0] <= sizes[n][1]]
    assert not within, f"within the limit now (or gone): remove them from OVERSIZED: {within}"
