"""Mixed precision: the pointwise ops under `torch.autocast`, bf16 and fp16, CPU and CUDA.

None of the stock ops replaced here (relu, leaky_relu, hardtanh, clamp, dropout, elu, gelu,
silu, batch_norm) is on an autocast list: stock runs each in its input's dtype, fp32 or the
bf16/fp16 an autocast ``Linear`` returns, and so do our Functions. Lossless, the mask ops and
dropout are bit-identical to stock under autocast; BatchNorm, ELU, GELU and SiLU (rebuilt
derivatives) lie within K x stock's own error,

    rel_err(ours, stock) <= K * max(rel_err(stock, fp32 run), u)

per output and gradient (relative L2; ``u`` the unit roundoff of the autocast dtype). Measured
over 8 seeds of the model below: worst ratio 1.64 (GELU-tanh, fp16), GELU 1.56, SiLU 0.78,
ELU 0.55, BatchNorm 0.41; K = 3 leaves margin.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gact_graph import compress_gnn
from gact_graph.ops import install_pointwise_ops
from tests.devices import AUTOCAST_DTYPES, DEVICES, UNIT_ROUNDOFF, train_under_autocast

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

DTYPES = AUTOCAST_DTYPES
U = UNIT_ROUNDOFF
K = 3.0
H = 32

#: name -> (op applied by the model, name the mode counts it under)
OPS = {
    "relu": (lambda bn, x: F.relu(x), "relu"),
    "leaky_relu": (lambda bn, x: F.leaky_relu(x, 0.1), "leaky_relu"),
    "hardtanh": (lambda bn, x: F.hardtanh(x), "hardtanh"),
    "clamp": (lambda bn, x: x.clamp(-0.5, 0.5), "clamp"),
    "dropout": (lambda bn, x: F.dropout(x, 0.3, training=True), "dropout"),
    "elu": (lambda bn, x: F.elu(x), "elu"),
    "gelu": (lambda bn, x: F.gelu(x), "gelu"),
    "gelu_tanh": (lambda bn, x: F.gelu(x, approximate="tanh"), "gelu"),
    "silu": (lambda bn, x: F.silu(x), "silu"),
    "batch_norm": (lambda bn, x: bn(x), "batch_norm"),
}
#: bit-identical to stock (masks and regenerated dropout)
EXACT = {"relu", "leaky_relu", "hardtanh", "clamp", "dropout"}


def _skip_unsupported(device, dtype):
    if device == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")


class Net(nn.Module):
    """op on the fp32 input -> autocast Linear (bf16/fp16 out) -> op on that -> Linear."""

    def __init__(self, op: str):
        super().__init__()
        self.op = OPS[op][0]
        self.bns = nn.ModuleList(nn.BatchNorm1d(H) for _ in range(2))
        self.lin1, self.lin2 = nn.Linear(H, H), nn.Linear(H, 4)

    def forward(self, x):
        h = self.lin1(self.op(self.bns[0], x))
        return self.lin2(self.op(self.bns[1], h))


def _data(device, seed=0):
    """Features and 4 classes read off them (learnable in a few steps)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, H, generator=g)
    y = (x @ torch.randn(H, 4, generator=g)).argmax(-1)
    return x.to(device), y.to(device)


def _run(model, x, y, device, dtype, autocast=True):
    """(output, [grad x, grads of the parameters]) of one step; the same dropout draws each
    call. BatchNorm's running statistics change, which changes no output in training mode."""
    torch.manual_seed(123)
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype, enabled=autocast):
        out = model(x)
    F.cross_entropy(out.float(), y).backward()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_lossless_matches_stock(op, dtype, device):
    _skip_unsupported(device, dtype)
    torch.manual_seed(0)
    model = Net(op).to(device)
    x, y = _data(device)
    ref = _run(model, x, y, device, dtype, autocast=False)
    stock = _run(model, x, y, device, dtype)
    ctl = compress_gnn(model, bits=None, pointwise=False)
    mode = install_pointwise_ops(ctl)
    try:
        ours = _run(model, x, y, device, dtype)
        assert mode.counts == {OPS[op][1]: 2}  # on the fp32 input and on the bf16/fp16 one
    finally:
        ctl.remove()
    assert len(ours) == len(stock)
    for i, (a, s, r) in enumerate(zip(ours, stock, ref)):
        assert a.dtype == s.dtype, i  # output as stock; gradients in the parameters' fp32
        if op in EXACT:
            assert torch.equal(a, s), i
        else:
            tol = K * max(_rel(s, r), U[dtype])
            assert _rel(a, s) <= tol, f"tensor {i}: error {_rel(a, s):.2e} > {tol:.2e}"


def _train(op, x, y, device, dtype, bits, steps=10, lr=0.05):
    """Losses of ``steps`` Adam steps under autocast (``bits=None``: stock) and the
    controller's stats; fp16 with a GradScaler, as fp16 training does."""
    torch.manual_seed(0)
    model = Net(op).to(device)
    losses, stats, _ = train_under_autocast(model, (x,), y, device, dtype, bits, steps, lr)
    return losses, stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_two_bit_trains(op, dtype, device):
    """2-bit training under autocast decreases the loss by at least half as much as stock
    training in the same steps, and bf16/fp16 activations went through the quantizer."""
    _skip_unsupported(device, dtype)
    x, y = _data(device, seed=1)
    stock, _ = _train(op, x, y, device, dtype, bits=None)
    losses, stats = _train(op, x, y, device, dtype, bits=2)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert stock[0] - stock[-1] > 0.02, stock  # the task is learnable in these steps
    assert losses[0] - losses[-1] >= 0.5 * (stock[0] - stock[-1]), (losses, stock)
    low = str(dtype).removeprefix("torch.")
    assert any(r["dtype"] == low and r["bits"] == 2 for r in stats["tensors"]), stats["tensors"]
