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
