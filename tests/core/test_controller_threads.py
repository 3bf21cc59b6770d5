"""One compressed model seen from several threads: PyTorch's saved-tensor hooks and
torch-function modes are per thread, and so is what the controller installs."""

import threading

import pytest
import torch
from torch import nn

from gact_graph import compress_gnn


class _Gated(nn.Module):
    """An MLP whose forward can be held at a gate (to overlap two threads deterministically)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold = False

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.hold:
            self.entered.set()
            assert self.release.wait(30)
        return self.b(h)


def _installed() -> bool:
    """Whether this thread has saved-tensor hooks or a torch-function mode installed."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None or bool(torch.overrides._get_current_function_mode_stack())


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_eval_in_another_thread_during_a_training_forward():
    torch.manual_seed(0)
    model = _Gated()
    x = torch.randn(256, 32)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0)
    expected = _grads(model, x)
    ctl._step_forwards = 0  # each forward of a step rounds anew: the next as this one

    model.hold = True
    out = {}

    def train():
        out["grads"] = _grads(model, x)
        out["left_installed"] = _installed()

    t = threading.Thread(target=train)
    t.start()
    assert model.entered.wait(30)  # the training forward is inside, its hooks installed
    model.hold = False
    with torch.no_grad():  # an eval forward here must neither use nor close those hooks
        for _ in range(3):
            model(x)
    assert not _installed()
    model.release.set()
    t.join(30)
    assert all(torch.equal(a, b) for a, b in zip(out["grads"], expected))
    assert out["left_installed"] is False and not _installed()  # nothing left in either
    ctl.remove()


def test_two_training_forwards_at_once_raise_a_clear_error():
    torch.manual_seed(0)
    model = _Gated()
    x = torch.randn(64, 32)
    ctl = compress_gnn(model, bits=2, adaptive=False, min_numel=0)
    model.hold = True
    errors = []
    t = threading.Thread(target=lambda: errors.append(_grads(model, x)))
    t.start()
    assert model.entered.wait(30)
    model.hold = False
    with pytest.raises(RuntimeError, match="another thread"):
        model(x)
    model.release.set()
    t.join(30)
    assert len(errors) == 1  # the first thread's step completed
    _grads(model, x)  # and training goes on afterwards
    ctl.remove()
