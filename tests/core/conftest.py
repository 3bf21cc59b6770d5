"""The `torch_sparse` fixture (the real package, or tests/fake_torch_sparse.py in its place)."""

from fake_torch_sparse import torch_sparse  # noqa: F401  (a fixture)
