"""Planetoid citation graphs (Cora, CiteSeer, PubMed) through PyG's ``Planetoid`` with the public
split (20 labelled nodes per class, 500 validation, 1000 test), offline.

On-disk layout (the original Planetoid files, as ``Planetoid(root, "Cora")`` expects)::

    <root>/Cora/raw/ind.cora.{x,tx,allx,y,ty,ally,graph,test.index}
    <root>/CiteSeer/raw/ind.citeseer.{...}
    <root>/PubMed/raw/ind.pubmed.{...}

The processed graph is cached in ``<root>/<Name>/processed_gact_graph/``, not in PyG's usual
``<root>/<Name>/processed/``: CogDL's ``CoraDataset(data_path=root)`` (and its CiteSeer and
PubMed siblings) keeps its own, incompatible ``processed/data.pt`` there and cannot be pointed
elsewhere, so one root serves both.
"""

from __future__ import annotations

import os.path as osp
import pickle

from torch_geometric.data import Data
from torch_geometric.datasets import Planetoid
from torch_geometric.io.planetoid import read_file

from gact_graph.datasets.info import dataset_info
from gact_graph.datasets.lock import dataset_lock
from gact_graph.datasets.preprocess import (
    ProcessedDataError,
    RawDataError,
    finalize,
    require_files,
)

__all__ = ["load_planetoid", "PLANETOID_NAMES", "PROCESSED_FOLDER", "planetoid_raw_files"]

# PyG's spelling: the folder under root and the name passed to ``Planetoid``.
PLANETOID_NAMES = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
#: where, under ``<root>/<Name>/``, this loader caches the processed graph
PROCESSED_FOLDER = "processed_gact_graph"
_PARTS = ["x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"]
_SOURCE = "https://github.com/kimiyoung/planetoid/raw/master/data"
# What reading a processed file that PyG did not write raises: another object than PyG's
# tuple (AssertionError), not a torch file (UnpicklingError, EOFError, RuntimeError), a pickle
# of a class from a package that is not installed (ImportError).
_FOREIGN_FILE_ERRORS = (
    AssertionError, EOFError, ImportError, RuntimeError, pickle.UnpicklingError,
)  # fmt: skip


class _Planetoid(Planetoid):
    """PyG's ``Planetoid`` with its processed files in ``<root>/<Name>/processed_gact_graph``,
    and clear errors instead of PyG's bare ones when that folder holds a file PyG did not
    write (``AssertionError``) or a raw file cannot be read (``UnpicklingError`` of a
    truncated download, naming no file)."""

    def process(self) -> None:
        try:
            super().process()
        except Exception as err:
            for part in _PARTS:  # which file: PyG's error does not say
                name = f"ind.{self.name.lower()}.{part}"
                try:
                    read_file(self.raw_dir, self.name, part)
                except Exception as bad:
                    raise RawDataError(
                        f"{self.name}: the raw file {osp.join(self.raw_dir, name)!r} cannot be "
                        f"read ({type(bad).__name__}: {bad}): a truncated or corrupt copy. "
                        f"Replace it with a fresh one from {_SOURCE}/{name}"
                    ) from err
            raise

    @property
    def processed_dir(self) -> str:
        return osp.join(self.root, self.name, PROCESSED_FOLDER)

    def load(self, path: str, data_cls: type = Data) -> None:
        try:
            super().load(path, data_cls)
        except _FOREIGN_FILE_ERRORS as err:
            raise ProcessedDataError(
                f"{self.name}: {path} is not a processed dataset of PyG's Planetoid (reading "
                f"it raised {type(err).__name__}); another tool or version wrote it. Delete the "
                f"folder {self.processed_dir!r}: it is rebuilt from {self.raw_dir!r}."
            ) from err


def planetoid_raw_files(name: str) -> list[str]:
    """Raw file names of a Planetoid dataset, e.g. ``ind.cora.x``."""
    return [f"ind.{name.lower()}.{part}" for part in _PARTS]


def load_planetoid(name: str, root: str, normalize_features: bool = True) -> Data:
    """Load ``cora``, ``citeseer`` or ``pubmed`` (public split) from ``root``.

    ``normalize_features`` row-normalizes the bag-of-words features to sum to one, as
    ``torch_geometric.transforms.NormalizeFeatures`` does and as the GCN, GAT and GCNII papers
    (and PyG's examples) train on them.

    Raises:
        DatasetNotFoundError: a required file is missing (nothing is downloaded).
        ProcessedDataError: the cached processed file was not written by PyG's ``Planetoid``.
        RawDataError: a raw file cannot be read (truncated or corrupt); the message names it.
    """
    info = dataset_info(name)
    pyg_name = PLANETOID_NAMES[info.name]
    base = osp.join(root, pyg_name)
    require_files(
        info.name,
        base,
        [f"raw/{f}" for f in planetoid_raw_files(info.name)],
        f"Get them from {_SOURCE}.",
    )
    with dataset_lock(base):
        data = _Planetoid(root, pyg_name, split="public")[0]
    if normalize_features:
        x = data.x - data.x.min()
        data.x = x / x.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return finalize(
        data, name=info.name, num_classes=info.num_classes, multilabel=False, metric=info.metric
    )
