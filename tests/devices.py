"""Devices and autocast dtypes the tests parametrize over: the same test body runs on the CPU
in CI and on CUDA wherever a GPU is present (``-m cuda`` selects the CUDA cases)."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
    ),
]
#: the dtypes torch.autocast lowers to, and their unit roundoff
AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def train_under_autocast(model, inputs: tuple, y, device, dtype, bits, steps=10, lr=0.05):
    """Losses of ``steps`` Adam steps of ``model(*inputs)`` under autocast (``bits=None``:
    uncompressed stock), then the controller's stats of the last step and its module paths
    (``None, None`` for stock). fp16 uses a GradScaler, as fp16 training does."""
    from gact_graph import compress_gnn

    # min_bytes=0: these tensors are small, and CUDA would keep them as they are by default
    ctl = None if bits is None else compress_gnn(model, bits=bits, adaptive=False, min_bytes=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    losses = []
    try:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(device, dtype=dtype):
                out = model(*inputs)
            loss = torch.nn.functional.cross_entropy(out.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if ctl is not None:
                ctl.iterate()
            losses.append(loss.item())
        if ctl is None:
            return losses, None, None
        return losses, ctl.stats(), dict(ctl.module_paths)
    finally:
        if ctl is not None:
            ctl.remove()
