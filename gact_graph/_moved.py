"""Old import paths of the modules that moved into layers (``core/``, ``kernels/``,
``policy/``), kept working with a `DeprecationWarning`: ``import gact_graph.controller`` still
gives ``gact_graph.core.controller`` (the same module object, not a copy).

``gact_graph.quantize`` is not aliased: that name is the public function
(``from gact_graph import quantize``), and an aliased module would replace it on the package;
``QTensor`` and ``quantize`` are imported from ``gact_graph`` itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["MOVED", "install"]

#: old module path -> where it lives now
MOVED = {
    "gact_graph.controller": "gact_graph.core.controller",
    "gact_graph.saved": "gact_graph.core.saved",
    "gact_graph.bitpack": "gact_graph.kernels.bitpack",
    "gact_graph.adapt": "gact_graph.policy.adaptive",
    "gact_graph.sensitivity": "gact_graph.policy.sensitivity",
    "gact_graph.levels": "gact_graph.policy.levels",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        # stacklevel 2 skips importlib's own frames and names the user's import line
        warnings.warn(
            f"{spec.name} moved to {new}; the old path will be removed in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the real module has run already
        pass


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``gact_graph/__init__`` calls this)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
