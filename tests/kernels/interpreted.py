"""What the Triton kernel tests share: where a kernel runs (CUDA, or the CPU under Triton's
interpreter, which ``TRITON_INTERPRET=1`` switches on only if set before Triton is imported:
the conftest's imports (PyG) import Triton first), the mark that skips a kernel test
elsewhere, and the run of a test file again in a fresh interpreter with that variable set."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"

needs_kernels = pytest.mark.skipif(
    not HAS_TRITON or not (INTERPRETED or HAS_CUDA),
    reason="needs Triton and CUDA, or TRITON_INTERPRET=1 (covered by the subprocess test)",
)


def kernel_test(f):
    """`needs_kernels`, and the ``cuda`` mark: the GPU suite's ``pytest -m cuda`` runs the
    test compiled on the device."""
    return pytest.mark.cuda(needs_kernels(f))


def subprocess_env(**extra: str) -> dict:
    """This process's environment with ``extra`` and the checkout first on ``PYTHONPATH``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_interpreted(test_file: str, select: str = "not subprocess", **env: str) -> None:
    """Run ``test_file``'s tests that ``-k select`` picks in a fresh process under Triton's
    interpreter (``env`` added to its environment), and assert that all of them passed and
    none was skipped."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file]
    cmd += ["-k", select, "-W", "ignore::RuntimeWarning"]
    res = subprocess.run(
        cmd, env=subprocess_env(TRITON_INTERPRET="1", **env), cwd=REPO,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert " passed" in res.stdout and " skipped" not in res.stdout, res.stdout[-2000:]
