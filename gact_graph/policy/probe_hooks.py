"""What the probe records during the user's own step (one job of
:class:`~gact_graph.policy.sensitivity.SensitivityProbe`): it routes the controller's pack and
unpack through itself for one forward, hooks every autograd node of that forward's graph, and
in the backward hands each node that read a compressed tensor to the estimators
(`gact_graph.policy.probe_estimates`) and each deferred seed to the walk
(`gact_graph.policy.probe_walk`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import Tensor

from gact_graph.core.chunked import RowChunked
from gact_graph.core.quantize import QTensor
from gact_graph.core.saved import tensors_in
from gact_graph.policy.probe_estimates import matmul_kind
from gact_graph.policy.rounding import nonzero_counts, rounding_variance_factors, stable_seed
from gact_graph.switches import lean_backward

__all__ = ["ProbeHooks"]


class ProbeHooks:
    """Arming and the hooks of :class:`~gact_graph.policy.sensitivity.SensitivityProbe`: a
    mixin, with the probe's state (``_tls``, ``_override``, ``_node_handles``, ...) set up by
    it."""

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        ctl = self.ctl
        # the controller enters its saved-tensor hooks with ``self._pack`` / ``self._unpack``
        self._ctl_own = {k: ctl.__dict__[k] for k in ("_pack", "_unpack") if k in ctl.__dict__}
        inner_pack, inner_unpack = ctl._pack, ctl._unpack
        self._ctl_unpack = inner_unpack

        def pack(t):
            return self._pack(t, inner_pack)

        def unpack(stored):
            return self._unpack(stored, inner_unpack)

        ctl._pack = pack
        ctl._unpack = unpack
        self._fwd_handle = ctl.model.register_forward_hook(self._after_forward)
        ctl.add_handle(self._fwd_handle)

    def _restore_unpack(self) -> None:
        ctl = self.ctl
        for k in ("_pack", "_unpack"):
            if k in self._ctl_own:
                setattr(ctl, k, self._ctl_own[k])
            else:
                ctl.__dict__.pop(k, None)

    def _after_forward(self, module, args, output) -> None:
        if self.hooked:
            return
        roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        if not roots:  # a forward without a graph (eval, no_grad): wait for the next one
            return
        self.hooked = True
        self._fwd_handle.remove()
        self._fwd_handle = None
        self._restore_unpack()
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._param_ids = {id(p) for p in self._params}
        seen: set[int] = set()
        keep: list[Any] = []
        stack = list(roots)
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            var = getattr(node, "variable", None)
            if var is not None:  # AccumulateGrad of a leaf
                if id(var) in self._param_ids:
                    self._node_handles.append(node.register_prehook(self._leaf_hook))
                continue
            self._node_handles.append(node.register_prehook(self._pre_hook(node)))
            self._node_handles.append(node.register_hook(self._post_hook(node)))
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in seen:
                    stack.append(nxt)

    # ---------------------------------------------------------------- hooks
    def _busy(self) -> bool:
        return getattr(self._tls, "busy", False)

    @contextlib.contextmanager
    def _inside(self):
        """The probe's own work (replays, partial backwards): its hooks stand aside, and the
        backward kernels it runs take their lower-memory variants (`lean_backward`), since
        all of it adds to what the user's backward holds."""
        self._tls.busy = True
        try:
            with lean_backward():
                yield
        finally:
            self._tls.busy = False

    def _pack(self, t: Tensor, inner):
        if self.started is None:
            self.started = time.perf_counter()
        stored = inner(t)
        p = getattr(stored, "payload", None)
        if isinstance(p, QTensor):
            self.compressed = True
        if isinstance(p, QTensor) and stored not in self._kappa and self._in_share(stored.name):
            t0 = time.perf_counter()
            # the probe's own work (`lean_backward` marks it so): what it keeps here lives
            # until the probe's estimate, which a step without the probe never holds
            with torch.no_grad(), lean_backward():
                seed = stable_seed(self.seed, stored.name, "kappa")
                # on the device, read with every other tensor's when backward first needs one
                # (`_factors`): no host sync in the forward
                self._kappa[stored] = rounding_variance_factors(t, p, seed=seed)
                if self.closed_form and t.dim() == 2:  # what a matmul may read
                    self._nonzeros[stored] = nonzero_counts(t, p)
            self.seconds += time.perf_counter() - t0
        return stored

    def _factors(self, stored) -> tuple[float, float] | None:
        """``(kappa on x, kappa on x_hat)`` of ``stored`` (`rounding_variance_factors`, taken
        when it was packed), or ``None`` when it has none. The first call reads the factors of
        every tensor packed so far in one transfer per device."""
        kappa = self._kappa.get(stored)
        if isinstance(kappa, Tensor):
            waiting = [(k, v) for k, v in self._kappa.items() if isinstance(v, Tensor)]
            for dev in {v.device for _, v in waiting}:
                group = [(k, v) for k, v in waiting if v.device == dev]
                values = torch.stack([v for _, v in group]).tolist()
                for (k, _), pair in zip(group, values):
                    self._kappa[k] = (float(pair[0]), float(pair[1]))
            kappa = self._kappa.get(stored)
        return kappa

    def _unpack(self, stored, inner):
        over = self._override.get(id(stored))
        if over is not None:
            return over
        mat1 = getattr(self._tls, "chunked_mat1", None)
        rows = getattr(self._tls, "chunked_rows", False)
        if (mat1 is not None or rows) and self._busy() and stored.kind == "activation":
            p = stored.payload
            if isinstance(p, QTensor) and not torch.is_grad_enabled():
                if tuple(p.shape) == mat1 or (rows and len(p.shape) == 2):
                    return RowChunked(p)
        t = inner(stored)
        if not self._busy():
            reads = getattr(self._tls, "reads", None)
            if reads is not None:
                keep = getattr(self._tls, "keep_values", True)
                reads.append((stored, t if keep else None, tuple(t.shape)))
        return t

    def _leaf_hook(self, grad_outputs):
        if self._busy():
            return None
        g = grad_outputs[0]
        if g is not None:
            self._grad_sq = self._grad_sq + g.detach().double().square().sum()
        return None

    def _pre_hook(self, node):
        python_node = not callable(node)

        # decided once per node, when the forward's graph is hooked
        kind = matmul_kind(node, self._param_ids) if self.closed_form else None
        if kind is not None:
            self._matmul_k[id(node)] = kind
        matmul = kind is not None

        def hook(grad_outputs):
            # inside a partial backward, a matmul reads its compressed mat1 in row chunks
            shapes = self._matmul_shapes(node) if self._busy() else None
            self._tls.chunked_mat1 = None if shapes is None else shapes[0]
            # ... and a Function of this package that says it reads any compressed matrix so
            # (``reads_row_chunks``, e.g. the BatchNorm saving its normalized input)
            fwd_cls = getattr(node, "_forward_cls", None)
            self._tls.chunked_rows = self._busy() and getattr(fwd_cls, "reads_row_chunks", False)
            if not self._busy():
                for seeds in self._pending.pop(id(node), ()):
                    self._propagate(seeds)
                self._tls.reads = []
                # a matmul's estimate is closed-form: it needs no dequantized copy kept alive
                self._tls.keep_values = not matmul
                # a Python node may accumulate into .grad itself (reentrant checkpoint runs a
                # nested backward): see whether it does, so that its replay can be undone
                self._tls.grad_state = self._grad_state() if python_node else None
            return None

        return hook

    def _matmul_shapes(self, node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(mat1, mat2)`` shapes of an ``mm`` / ``addmm`` node whose ``mat2`` is a parameter
        or a function of parameters (`matmul_kind`), when ``mat1`` cannot be mistaken for
        ``mat2`` (equal shapes); else ``None``. Such a node reads ``mat1`` only for
        ``mat1^T G``, which `RowChunked` computes a row chunk at a time."""
        kind = self._matmul_k.get(id(node))
        if kind is None:
            return None
        if kind[0] == 1:
            mat1, mat2 = node._saved_self_sym_sizes, node._saved_mat2_sym_sizes
        else:
            mat1, mat2 = node._saved_mat1_sym_sizes, node._saved_mat2_sym_sizes
        mat1, mat2 = tuple(int(v) for v in mat1), tuple(int(v) for v in mat2)
        return None if mat1 == mat2 else (mat1, mat2)

    def _grad_state(self) -> list[tuple[int, int]]:
        return [(-1, -1) if p.grad is None else (id(p.grad), p.grad._version) for p in self._params]

    def _post_hook(self, node):
        def hook(grad_inputs, grad_outputs):
            self._tls.chunked_mat1 = None
            self._tls.chunked_rows = False
            if self._busy():
                return None
            reads = getattr(self._tls, "reads", None)
            self._tls.reads = None
            before = getattr(self._tls, "grad_state", None)
            side_effects = before is not None and before != self._grad_state()
            if not reads:
                return None
            self.ran = True
            together = tuple(dict.fromkeys(r[0].name for r in reads if self._compressible(r[0])))
            if len(together) > 1:
                self.read_together.append(together)
            done: set[int] = set()
            for i in range(len(reads)):
                stored, x_hat, shape = reads[i]
                reads[i] = None  # the probe may write its noise into x_hat: hold it once
                if id(stored) in done or not self._is_candidate(stored):
                    continue
                done.add(id(stored))
                # another tensor this node read is still to be replayed (GATv2's x_l and x_r)
                later = any(
                    r is not None and id(r[0]) not in done and self._is_candidate(r[0])
                    for r in reads[i + 1 :]
                )
                if later:
                    # the later reads' dequantized copies are dropped before this replay (which
                    # dequantizes what it reads again) and made again when their turn comes
                    for j in range(i + 1, len(reads)):
                        if reads[j] is not None:
                            reads[j] = (reads[j][0], None, reads[j][2])
                seeds = None
                t0 = time.perf_counter()
                with self._inside():
                    # the replay reads its other compressed matrices in row chunks where the
                    # node's Function says it can (``reads_row_chunks``)
                    fwd_cls = getattr(node, "_forward_cls", None)
                    self._tls.chunked_rows = getattr(fwd_cls, "reads_row_chunks", False)
                    try:
                        if self._matmul_closed_form(node, stored, shape, grad_outputs):
                            continue
                        if x_hat is None:  # a matmul that reads it otherwise: dequantize again
                            x_hat = self._ctl_unpack(stored)
                        seeds = self._probe(
                            node, stored, x_hat, grad_inputs, grad_outputs, side_effects
                        )
                    except Exception as exc:  # a node we cannot replay: say so, never break
                        self.failed.setdefault(stored.name, f"{type(exc).__name__}: {exc}")
                    finally:
                        x_hat = None
                        self._tls.chunked_rows = False
                        self.seconds += time.perf_counter() - t0
                if seeds is not None and later:
                    # carried down now, before the next replay's differences exist (deferred,
                    # both replays' would wait together)
                    self._propagate(seeds)
                seeds = None
            return None

        return hook

    def _in_share(self, name: str) -> bool:
        return self.share is None or self.share(name)

    def _count_work(self, name: str | None, grads) -> None:
        """Add the elements of ``grads`` (fed to a backward node for ``name``'s estimate) to
        ``work``: a count of what the estimate cost, the same on every device."""
        if name is not None:
            n = sum(g.numel() for g in grads if isinstance(g, Tensor))
            work = self.__dict__.setdefault("work", {})  # (tests build bare probes)
            work[name] = work.get(name, 0) + n

    def _is_candidate(self, stored) -> bool:
        """Whether the probe estimates ``stored``: compressible, and of this probe's share."""
        return self._in_share(stored.name) and self._compressible(stored)

    def _compressible(self, stored) -> bool:
        # Compressed tensors, and those the plan keeps at 32 bits; never tensors the graph-aware
        # paths keep lossless on purpose (attention logits, adjacency weights).
        if stored.kind != "activation":
            return False
        p = stored.payload
        if isinstance(p, QTensor):
            return True
        return (
            isinstance(p, Tensor)
            and p.is_floating_point()
            and p.numel() >= max(1, self.min_numel)
            and (self.ctl.plan.get(stored.name) or 0) >= 32
        )
