"""Integrations with training frameworks. Nothing here is imported by ``import gact_graph``,
and this package imports no optional dependency until a submodule is imported:

- `gact_graph.integrations.pyg`: `GactCallback` for a plain PyTorch Geometric training loop;
- `gact_graph.integrations.lightning`: a ``lightning.pytorch.Callback``
  (``pip install gact_graph[lightning]``);
- `gact_graph.integrations.cogdl`: CogDL models and trainer (``pip install gact_graph[cogdl]``).
"""

# Empty on purpose: ``from gact_graph.integrations import *`` must not import optional packages.
__all__: list[str] = []
