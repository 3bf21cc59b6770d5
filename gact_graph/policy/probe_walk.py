"""How the probe carries a replay's noise from the activation gradients it enters to the
parameters (one job of :class:`~gact_graph.policy.sensitivity.SensitivityProbe`).

A replay (`gact_graph.policy.probe_estimates`) leaves its noise in the gradients the replayed
node emits: :class:`Seeds`. They are not carried at once but from the pre-hook of the first
node they enter (`ProbeWalk._defer`), when the user's backward has released the replayed
node's gradients, and then walked by hand a node at a time (`ProbeWalk._walk`) so that each
gradient is released once its node has run and gradients that meet go on as one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

__all__ = [
    "ProbeWalk",
    "Seeds",
    "linear_in_parameters",
    "parameters_only",
    "passes_through",
    "ready",
    "shares_storage",
]


def shares_storage(t: Tensor, others: Iterable[Tensor]) -> bool:
    """Whether ``t`` shares memory with any of ``others`` (so writing into it is not safe)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def _bounded_search(start: Iterable, limit: int, expand) -> bool:
    """Depth first over the autograd nodes reached from ``start``, each once, as ``expand``
    leads (``expand(f)``: the nodes to go on to from ``f``, or None where the answer is found
    to be no): False at a None or past ``limit`` nodes visited, True where nothing is left."""
    seen: set[int] = set()
    stack = list(start)
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if len(seen) > limit:
            return False
        following = expand(f)
        if following is None:
            return False
        stack.extend(following)
    return True


def parameters_only(fn, param_ids: set[int], limit: int = 32) -> bool:
    """Whether the graph below ``fn`` is a small computation on parameters alone: at most
    ``limit`` nodes, every path ending in a parameter's ``AccumulateGrad`` (an input that needs
    no gradient, or any activation, makes it ``False``), so a partial backward from ``fn``
    touches parameter-sized tensors only."""

    def expand(f):
        var = getattr(f, "variable", None)
        if var is not None:
            return () if id(var) in param_ids else None
        following = [nxt for nxt, _ in f.next_functions]
        return None if any(nxt is None for nxt in following) else following

    return _bounded_search([fn], limit, expand)


#: autograd nodes whose backward moves a gradient without computing on it (a view, a copy, a
#: sum's pass-through, a split's concatenation): a walk runs them inside the call of the node
#: that feeds them rather than in a call of their own. Not ``TBackward0``: it mostly leads a
#: matmul's gradient to a weight, which the walk keeps for the partial backward that ends it
#: (`parameters_only`); passed through, that gradient reached the accumulated sums during the
#: walk instead, a parameter-sized float64 tensor more at the walk's peak
_PASS_THROUGH = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "CloneBackward0",
     "TransposeBackward0", "PermuteBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
     "SqueezeBackward1", "AddBackward0", "SplitWithSizesBackward0", "SplitBackward0"}
)  # fmt: skip


def passes_through(fn) -> bool:
    """Whether the walk runs ``fn`` (a C++ node named in `_PASS_THROUGH` with somewhere to send
    its gradients) inside the call of the node that feeds it. The walk's sum stays the same:
    a node run in two calls on two parts of its gradient gives the sum of its two results
    (backward is linear in the incoming gradient)."""
    if not callable(fn) or getattr(fn, "variable", None) is not None:
        return False
    try:
        name = fn.name()
    except Exception:  # Python nodes without a name
        return False
    return name in _PASS_THROUGH and any(nxt is not None for nxt, _ in fn.next_functions)


#: matmul nodes whose second operand may be a parameter (a linear layer's weight): the nodes the
#: walk runs ahead of the engine's order once nothing pending can still reach them
_MATMULS = {"MmBackward0": 1, "AddmmBackward0": 2}

#: how many nodes `ready` looks through before it takes a node for not ready (the engine's
#: order then holds): bounds the check's cost on deep graphs
READY_LIMIT = 64


def linear_in_parameters(fn, param_ids: set[int]) -> bool:
    """Whether ``fn`` is an ``mm`` / ``addmm`` node whose second operand is a parameter or a
    small computation on parameters alone (`parameters_only`): a linear layer's matmul, whose
    backward needs only its incoming gradient and that operand."""
    try:
        k = _MATMULS.get(fn.name())
    except Exception:  # Python nodes without a name
        return False
    if k is None or len(fn.next_functions) <= k:
        return False
    mat2 = fn.next_functions[k][0]
    return mat2 is not None and parameters_only(mat2, param_ids)


def ready(fn, others: Iterable, limit: int = READY_LIMIT) -> bool:
    """Whether none of the nodes ``others`` can send ``fn`` a gradient: no path from one of
    them down to ``fn``. A node's inputs are made before it, so such a path runs through nodes
    of higher sequence numbers than ``fn``'s only, and the search stops at the others. ``False``
    when it would look through more than ``limit`` nodes. Were a node taken for ready that is
    not (sequence numbers of nodes made in other threads), the walk's sum stays the same: the
    node runs again on the rest of its gradient (backward is linear in it)."""
    floor = fn._sequence_nr()

    def expand(f):
        following = []
        for nxt, _ in f.next_functions:
            if nxt is fn:
                return None
            if nxt is not None and getattr(nxt, "variable", None) is None:
                if nxt._sequence_nr() > floor:
                    following.append(nxt)
        return following

    return _bounded_search([o for o in others if o is not fn], limit, expand)


class Seeds:
    """The noise one replay put into the gradients of activations: ``grads[i]`` enters the
    graph at ``edges[i]``; carried to the parameters together (same noise draw)."""

    __slots__ = ("name", "edges", "grads", "done")

    def __init__(self, name: str, edges: list, grads: list[Tensor]) -> None:
        self.name, self.edges, self.grads, self.done = name, edges, grads, False


class ProbeWalk:
    """The partial backwards of :class:`~gact_graph.policy.sensitivity.SensitivityProbe`: a
    mixin, with the probe's state (``_params``, ``_pending``, ``_acc``, ...) set up by it."""

    def _defer(self, seeds: Seeds) -> None:
        """Carry a replay's noise in the gradients it emits to the parameters later, in one
        partial backward from the first of the nodes it enters to run (its pre-hook): by then
        the user's backward has released the gradients of the replayed node, so the partial
        backward runs on top of one tensor fewer or two than it would right after the replay,
        and none of the nodes below has run yet. A node that reads several replayed tensors
        has all its replays' seeds but the last carried at once instead, before its next
        replay runs (`ProbeHooks._post_hook`), so that two replays' seeds never wait together."""
        for edge in seeds.edges:
            self._pending.setdefault(id(edge.node), []).append(seeds)
        self._open[seeds.name] = self._open.get(seeds.name, 0) + 1

    def _propagate(self, seeds: Seeds) -> None:
        """The partial backward deferred by `_defer` (once, from whichever node runs first)."""
        if seeds.done:
            return
        seeds.done = True
        t0 = time.perf_counter()
        name = seeds.name
        edges, grads = seeds.edges, seeds.grads
        seeds.edges, seeds.grads = [], []
        with self._inside():
            self._working = name  # what the walk's nodes count their work to
            try:
                self._walk(self._acc.setdefault(name, {}), edges, grads)
            except Exception as exc:  # never break the user's backward
                self.failed.setdefault(name, f"{type(exc).__name__}: {exc}")
            finally:
                edges = grads = None
                self._working = None
        self.seconds += time.perf_counter() - t0
        self._open[name] -= 1
        self._finish_read(name, read=False)

    def _walk(self, acc: dict[int, Tensor], edges: list, grads: list[Tensor]) -> None:
        """Carry the seeds ``grads`` at ``edges`` to the parameters (into ``acc``) by hand, one
        node at a time, latest in forward order first (as the engine orders them: no node left
        feeds the one that runs) but for a linear layer's matmul that nothing pending can still
        reach, which runs first (`_next_node`), with the gradients that reach one node input
        summed into one tensor as soon as both exist. A partial backward holds the gradients
        it starts from to its end; walked so, each is released once its node has run, and
        seeds that meet below (GAT's attention logits and features, both from one linear
        layer's output) go on as one gradient rather than as a full partial backward each
        while the other waits (which holds the waiting one, grown to N x H x C at the linear
        layer). Where a node
        cannot be run alone (`_runnable`), the rest is one partial backward. The sum
        over parameters is linear in the seeds: walking changes only the order of additions.
        Gradients that reach a small computation on parameters alone (`parameters_only`, e.g.
        GAT's attention vector folded into the weight) are not walked node by node: they go
        to the parameters in the one partial backward that ends the walk, since a backward of
        its own for each of those small nodes costs more than the node."""
        pending: dict[tuple[int, int], list] = {}
        self._merge(pending, edges, grads)  # (empties ``grads``)
        edges.clear()
        param_side: list[list] = []  # [edge, gradient] into parameter-only subgraphs
        params_only: dict[int, bool] = {}
        linear: dict[int, bool] = {}
        while pending:
            nodes = list({id(e.node): e.node for e, _ in pending.values()}.values())
            node = self._next_node(nodes, params_only, linear)
            if id(node) not in params_only:
                params_only[id(node)] = parameters_only(node, self._param_ids)
            if params_only[id(node)]:
                param_side += [
                    pending.pop(k) for k in [k for k, (e, _) in pending.items() if e.node is node]
                ]
                continue
            if not self._runnable(node):
                break
            keys = [k for k, (e, _) in pending.items() if e.node is node]
            run_edges, run_grads = [], []
            for k in keys:
                e, g = pending.pop(k)
                run_edges.append(e)
                run_grads.append(g)
            del g
            self._merge(pending, *self._run_alone(acc, node, run_edges, run_grads))
        rest = param_side + list(pending.values())
        pending.clear()
        param_side.clear()
        if rest:
            self._grad_into(acc, [e for e, _ in rest], [g for _, g in rest])

    def _next_node(self, nodes: list, params_only: dict[int, bool], linear: dict[int, bool]):
        """The pending node the walk runs next: the latest in forward order, as the engine
        runs them, unless an earlier one is a linear layer's matmul (`linear_in_parameters`)
        that nothing pending can still reach (`ready`); that one runs first. Its gradient
        would otherwise wait while the branch beside it runs (a GAT layer's residual
        projection while its edge stage and feature projection run, each of their gradients
        N x H x C), where its result, the gradient of its input, joins the one that branch
        sends to the same input. The sum over parameters is the same in either order
        (backward is linear in the incoming gradients); the additions change order."""
        latest = max(nodes, key=lambda n: n._sequence_nr())
        for fn in sorted(nodes, key=lambda n: n._sequence_nr()):
            if fn is latest:
                break
            if id(fn) not in linear:
                linear[id(fn)] = (
                    self._runnable(fn)
                    and linear_in_parameters(fn, self._param_ids)
                    and not params_only.setdefault(id(fn), parameters_only(fn, self._param_ids))
                )
            if linear[id(fn)] and ready(fn, nodes):
                return fn
        return latest

    @staticmethod
    def _merge(pending: dict, edges: list, grads: list[Tensor]) -> None:
        """Add ``grads`` into ``pending`` (node input -> [edge, gradient]); a gradient already
        there takes the new one in place unless its memory is shared (an add node hands one
        tensor to both its inputs)."""
        for e, g in zip(edges, grads):
            key = (id(e.node), e.output_nr)
            if key not in pending:
                pending[key] = [e, g]
                continue
            have = pending[key][1]
            others = [t for k, (_, t) in pending.items() if k != key] + [g]
            pending[key][1] = have.add_(g) if not shares_storage(have, others) else have + g
            del have, others
        grads.clear()

    @staticmethod
    def _runnable(fn) -> bool:
        """Whether the walk may run ``fn`` alone: C++ nodes and this package's own Functions
        (another Python node may accumulate into ``.grad`` itself, e.g. a reentrant
        checkpoint), not a leaf's accumulator, and with somewhere to send its gradients."""
        ours = getattr(getattr(fn, "_forward_cls", None), "__module__", "").startswith("gact_graph")
        if (not callable(fn) and not ours) or getattr(fn, "variable", None) is not None:
            return False
        return any(nxt is not None for nxt, _ in fn.next_functions)

    def _run_alone(self, acc: dict[int, Tensor], fn, edges: list, grads: list[Tensor]):
        """Run ``fn`` on ``grads`` (at its outputs ``edges``; the list is emptied, so that
        the gradients go once ``fn`` has run) in a backward of its own (``torch.autograd.grad``
        stopped at its input edges, as the partial backwards do: a checkpoint segment counts
        its unpacks per backward pass). What reaches a parameter is added to ``acc``; returns
        the edges and gradients it sends further."""
        targets: dict[tuple[int, int], GradientEdge] = {}
        stack = list(fn.next_functions)
        while stack:
            nxt, nnr = stack.pop()
            if nxt is None:
                continue
            if passes_through(nxt):  # run in this call, on the way to the nodes below it
                stack.extend(nxt.next_functions)
                continue
            targets.setdefault((id(nxt), nnr), GradientEdge(nxt, nnr))
        ins = list(targets.values())
        self._count_work(getattr(self, "_working", None), grads)
        held = list(grads)
        grads.clear()
        out = list(torch.autograd.grad(edges, ins, held, retain_graph=True, allow_unused=True))
        held.clear()
        next_edges, next_grads = [], []
        for k, target in enumerate(ins):
            o, out[k] = out[k], None
            # an all-zero gradient goes on as well: testing for one reads the whole tensor (and
            # waits for the device) at every node, which costs more than the rare branch it
            # would spare
            if o is None or not o.is_floating_point():
                continue
            var = getattr(target.node, "variable", None)
            if var is not None:
                if id(var) in self._param_ids:
                    self._add(acc, var, o)
                continue
            next_edges.append(target)
            next_grads.append(o)
        return next_edges, next_grads

    def _grad_into(self, acc: dict[int, Tensor], edges: list, seeds: list[Tensor]) -> None:
        """Add to ``acc`` what ``seeds`` at ``edges`` give each parameter's gradient."""
        if not self._params:
            return
        self._count_work(getattr(self, "_working", None), seeds)
        res = torch.autograd.grad(edges, self._params, seeds, retain_graph=True, allow_unused=True)
        for p, r in zip(self._params, res):
            if r is not None:
                self._add(acc, p, r)
