r"""The probe's estimate at a node that reads a compressed tensor (one job of
:class:`~gact_graph.policy.sensitivity.SensitivityProbe`): the closed form for a matmul whose
``mat2`` is a parameter or a function of parameters only, else a replay of the node with the
tensor plus rounding-sized noise; and the sums that turn what the noise changes in the
parameter gradients into :math:`c_l`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from gact_graph.core.quantize import QTensor, quantize
from gact_graph.policy.probe_walk import Seeds, parameters_only, shares_storage
from gact_graph.policy.rounding import (
    add_rounding_noise_,
    chunk_elems,
    rounding_variance_factor,
    row_rounding_variance,
    stable_seed,
)
from gact_graph.switches import scratch

__all__ = ["ProbeEstimates", "matmul_kind"]


#: autograd nodes that pass a gradient on unchanged in norm (shape or dtype only)
_NORM_PRESERVING = frozenset(
    {"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
     "TransposeBackward0", "PermuteBackward0", "ToCopyBackward0"}
)  # fmt: skip


def matmul_kind(node, param_ids: set[int]) -> tuple[int, bool] | None:
    """For ``mm`` / ``addmm`` nodes whose ``mat2`` is a parameter or computed from parameters
    only: ``(position of mat2 among the node's inputs, exact)``, ``exact`` when mat2's gradient
    reaches one parameter through norm-preserving nodes only (a linear layer's weight), else
    ``False`` (e.g. GAT's attention vector folded into the weight, ``W^T a``); ``None`` for
    every other node."""
    try:
        name = node.name()
    except Exception:  # Python Function nodes without a name
        return None
    k = {"MmBackward0": 1, "AddmmBackward0": 2}.get(name)
    if k is None or len(node.next_functions) <= k:
        return None
    fn = node.next_functions[k][0]
    var = getattr(_past_norm_preserving(fn), "variable", None)
    if var is not None and id(var) in param_ids:
        return k, True
    return (k, False) if fn is not None and parameters_only(fn, param_ids) else None


def _past_norm_preserving(fn):
    """The first node at or below ``fn`` that is not a single-input norm-preserving node."""
    while fn is not None and fn.name() in _NORM_PRESERVING and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    return fn


class ProbeEstimates:
    """The estimators of :class:`~gact_graph.policy.sensitivity.SensitivityProbe`: a mixin,
    with the probe's state (``_acc``, ``_sq``, ``_bits``, ...) set up by it."""

    def _matmul_closed_form(self, node, stored, shape, grad_outputs) -> bool:
        r"""The estimate of a tensor read as ``mat1`` by ``mm``/``addmm`` whose ``mat2`` is a
        parameter or a function of parameters only (`matmul_kind`): the noise reaches
        ``grad_mat2`` as :math:`\delta = \alpha\, \varepsilon^T G` and nothing else
        (``grad_mat1 = G\, mat2^T`` does not read ``mat1``; ActNN's analysis of linear layers).

        - ``mat2`` a parameter (a linear layer's weight): :math:`E\lVert\delta\rVert^2 =
          \alpha^2 \sum_i \lVert G_i\rVert^2 s_i` exactly, with :math:`s_i` the row's
          rounding variance (`row_rounding_variance`, taken when the tensor was packed);
        - ``mat2`` computed from parameters (GAT's attention vector folded into the weight):
          one draw of :math:`\delta` (``K x M``, the size of ``mat2``), summed over row chunks of
          a noise with each row's variance :math:`s_i` spread evenly over its ``K`` columns,
          then carried to the parameters by a partial backward from ``mat2``'s node, which
          touches parameter-sized tensors only.

        No replay and no temporary larger than a row chunk either way. Readers of one tensor
        estimated this way are counted without their cross-correlations (each draws its own
        noise). ``False`` when the node is not such a matmul: the replay estimates it."""
        counts = self._nonzeros.get(stored)
        # the tensor must be mat1 (unambiguously: equal shapes could be either operand)
        shapes = self._matmul_shapes(node)
        if counts is None or shapes is None or grad_outputs[0] is None:
            return False
        mat1, mat2 = shapes
        if tuple(shape) != mat1:
            return False
        k, exact = self._matmul_k[id(node)]
        factors = self._factors(stored)
        kappa = 1.0 if factors is None else factors[0]
        row_var = row_rounding_variance(stored.payload, counts, kappa)
        g = grad_outputs[0]
        self._count_work(stored.name, [g])
        alpha = float(getattr(node, "_saved_alpha", 1.0))
        if exact:
            g_sq = torch.linalg.vector_norm(g, dim=1, dtype=torch.float32).square_()
            energy = (g_sq.double() * row_var.double()).sum() * alpha**2
            self._sq[stored.name] = self._sq.get(stored.name, 0.0) + energy
        else:
            if math.prod(mat2) > math.prod(mat1):  # not small: the replay is no dearer
                return False
            delta = self._sketch_grad_mat2(stored, row_var, g, alpha)
            fn, nr = node.next_functions[k]
            acc = self._acc.setdefault(stored.name, {})
            self._working = stored.name
            try:
                self._grad_into(acc, [GradientEdge(fn, nr)], [delta])
            finally:
                self._working = None
        self._bits[stored.name] = stored.payload.bits
        self._numel[stored.name] = stored.payload.numel()
        self.ran = True
        self._finish_read(stored.name)
        return True

    def _sketch_grad_mat2(self, stored, row_var: Tensor, g: Tensor, alpha: float) -> Tensor:
        """One draw of ``alpha * eps^T g`` (see `_matmul_closed_form`), in row chunks."""
        rows, cols = g.shape[0], int(stored.payload.shape[-1])
        n = self._reads_done.get(stored.name, 0)
        gen = torch.Generator(device=g.device)
        gen.manual_seed(stable_seed(self.seed, stored.name, "sketch", n))
        delta = torch.zeros(cols, g.shape[1], dtype=torch.float32, device=g.device)
        step = max(1, chunk_elems(rows * cols) // max(cols, 1))
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            z = torch.randint(0, 2, (r1 - r0, cols), generator=gen, device=g.device)
            z = z.float().mul_(2).sub_(1).mul_((row_var[r0:r1] / cols).sqrt_()[:, None])
            delta.addmm_(z.t(), g[r0:r1].float())
        return delta.mul_(alpha).to(g.dtype)

    def _noisy(self, stored, x_hat: Tensor, reusable: bool) -> tuple[Tensor, int]:
        """``x_hat`` plus its probing noise: drawn again at every read from the tensor's own
        seed (the same draw each time, so the nodes reading one tensor see correlated noise),
        never cached (a cache would hold a full-precision copy of every probed tensor until the
        end of backward, on top of what a fixed-bit step holds). Added in
        place when ``reusable`` (a dequantized copy nothing else holds), else to a copy."""
        p = stored.payload
        seed = stable_seed(self.seed, stored.name)
        noisy = x_hat if reusable and x_hat.is_contiguous() else x_hat.contiguous().clone()
        if isinstance(p, QTensor):
            bits = p.bits
            # the replay draws its noise on the non-zeros of the dequantized copy
            factors = self._factors(stored)
            add_rounding_noise_(p, noisy, seed, 1.0 if factors is None else factors[1])
        else:  # kept as is (planned 32 bits): the noise 8-bit rounding would add
            bits = 8
            q8 = quantize(p.detach(), 8, self.ctl.config.group_size, seed=0)
            add_rounding_noise_(q8, noisy, seed, rounding_variance_factor(p, q8, seed=seed))
        self._bits[stored.name] = bits
        self._numel[stored.name] = x_hat.numel()
        return noisy, bits

    def _replay(self, node, grad_outputs):
        if callable(node):  # C++ nodes (one output comes back bare, not in a tuple)
            out = node(*grad_outputs)
            return out if isinstance(out, tuple) else (out,)
        # Python autograd.Function nodes: materialize missing gradients as the engine would
        gos = []
        for g, meta in zip(grad_outputs, node._input_metadata):
            if g is None:
                g = torch.zeros(tuple(meta.shape), dtype=meta.dtype, device=meta.device)
            gos.append(g)
        out = node.apply(*gos)
        return out if isinstance(out, tuple) else (out,)

    def _replay_noisy(self, node, stored, noisy, grad_outputs):
        self._override[id(stored)] = noisy
        try:
            with scratch(noisy):  # the probe's own copy, read no more after the replay
                return self._replay(node, grad_outputs)
        finally:
            self._override.pop(id(stored), None)

    def _replay_undone(self, replay) -> tuple[Any, list[Tensor | None]]:
        """Run ``replay()`` of a node that accumulates into parameters' ``.grad`` itself; put
        every ``.grad`` back as it was and return what the replay added to each."""
        kept = [p.grad for p in self._params]
        for p, g in zip(self._params, kept):
            if g is not None:
                p.grad = g.clone()  # the replay accumulates into this copy, not the real one
        try:
            out = replay()
            added = [
                None if p.grad is None or p.grad is g else p.grad - (0 if g is None else g)
                for p, g in zip(self._params, kept)
            ]
        finally:
            for p, g in zip(self._params, kept):
                p.grad = g
        return out, added

    def _probe(
        self, node, stored, x_hat, grad_inputs, grad_outputs, side_effects: bool = False
    ) -> Seeds | None:
        """Replay ``node`` with ``x_hat`` plus noise; what the noise changes in a parameter's
        gradient is added at once, what it changes in an activation's gradient is carried to
        the parameters by a partial backward from the node it enters (`_defer`). Returns the
        deferred :class:`Seeds` (``None`` when the noise reached parameters only), which the
        caller may carry at once (`ProbeWalk._propagate`)."""
        # the backward's own tensors: nothing here may write into them
        theirs = [t for t in (*grad_inputs, *grad_outputs) if isinstance(t, Tensor)]
        reusable = isinstance(stored.payload, QTensor) and not shares_storage(x_hat, theirs)
        noisy, bits = self._noisy(stored, x_hat, reusable)
        del x_hat
        self._count_work(stored.name, grad_outputs)  # the replay runs the node on them again
        acc = self._acc.setdefault(stored.name, {})
        if side_effects:
            # e.g. torch.utils.checkpoint(use_reentrant=True): the node's parameter gradients
            # never leave it, they are accumulated into .grad inside. Replay it clean and noisy,
            # take the difference of what each added, and leave .grad as the real backward set
            # it (replaying into the real .grad added the gradients twice).
            out, noisy_added = self._replay_undone(
                lambda: self._replay_noisy(node, stored, noisy, grad_outputs)
            )
            _, clean_added = self._replay_undone(lambda: self._replay(node, grad_outputs))
            for p, a, b in zip(self._params, noisy_added, clean_added):
                if a is not None:
                    self._add(acc, p, a - (0 if b is None else b))
        else:
            out = self._replay_noisy(node, stored, noisy, grad_outputs)
        out = list(out)
        # the noisy copy is the probe's own: an output written into it (a lean backward's,
        # `scratch`) may be reused for its difference, unless two outputs share it
        if sum(isinstance(o, Tensor) and shares_storage(o, [noisy]) for o in out) > 1:
            theirs.append(noisy)
        edges, seeds = [], []
        for k, base in enumerate(grad_inputs):
            o = out[k] if k < len(out) else None
            out[k : k + 1] = [None]  # one reference less: `d` may reuse its memory
            if o is None or base is None or not o.is_floating_point():
                continue
            if o.shape != base.shape:  # the engine sums broadcast gradients after the node
                o = o.sum_to_size(base.shape)
            # in place where the replay's output is its own tensor: one tensor less at a time
            d = o.detach().sub_(base) if not shares_storage(o, theirs) else (o - base).detach()
            del o
            if not bool(d.any()):
                continue
            fn, nr = node.next_functions[k]
            if fn is None:
                continue
            var = getattr(fn, "variable", None)
            if var is not None:
                if id(var) in self._param_ids:
                    self._add(acc, var, d)
                continue
            edges.append(GradientEdge(fn, nr))
            seeds.append(d)
        noisy = out = d = None  # released before the deferred partial backward runs
        deferred = None
        if edges:
            deferred = Seeds(stored.name, edges, seeds)
            self._defer(deferred)
            seeds = edges = None
        self._finish_read(stored.name)
        return deferred

    def _finish_read(self, name: str, read: bool = True) -> None:
        """Count one probed read of ``name``; once every read of it is probed and all its
        deferred seeds are carried, reduce its parameter-sized vectors to a squared norm rather
        than hold them until the end of backward."""
        if read:
            self._reads_done[name] = self._reads_done.get(name, 0) + 1
        rec = getattr(self.ctl, "_record_of", {}).get(name)
        if rec is None or self._reads_done.get(name, 0) < rec.get("uses", 1):
            return
        if self._open.get(name, 0) == 0 and name in self._acc:
            acc = self._acc.pop(name)
            self._sq[name] = self._sq.get(name, 0.0) + sum(v.square().sum() for v in acc.values())

    @staticmethod
    def _add(acc: dict[int, Tensor], p: Tensor, d: Tensor) -> None:
        d = d.detach().to(torch.float64).reshape(p.shape)
        prev = acc.get(id(p))
        acc[id(p)] = d if prev is None else prev + d
