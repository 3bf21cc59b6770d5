"""Fixtures shared by the integration tests: the real Cora files and the copy-paste examples
of docs/integrations.md."""

import re
import shutil
from pathlib import Path

import pytest

#: the examples the integration tests run
INTEGRATIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
#: real Planetoid Cora (``Cora/raw/ind.cora.*``), read-only
SHARED_PLANETOID = Path("/work/shared/data/planetoid")


def read_doc_example(name: str) -> str:
    """The ```python block after ``<!-- example: name -->`` in docs/integrations.md."""
    text = INTEGRATIONS_DOC.read_text()
    m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"no example {name!r} in {INTEGRATIONS_DOC}"
    return m.group(1)


@pytest.fixture(scope="session")
def doc_example():
    """``doc_example(name)`` -> the example's code; ``doc_example.path`` names the file."""
    read_doc_example.path = str(INTEGRATIONS_DOC)
    return read_doc_example


@pytest.fixture(scope="module")
def cora_root(tmp_path_factory):
    """A writable folder holding ``Cora/raw`` (one per test module: loaders write there)."""
    if not (SHARED_PLANETOID / "Cora" / "raw").is_dir():
        pytest.skip("Cora raw files not available")
    root = tmp_path_factory.mktemp("planetoid")
    shutil.copytree(SHARED_PLANETOID / "Cora" / "raw", root / "Cora" / "raw")
    return root


@pytest.fixture(scope="module")
def cora(cora_root):
    from gact_graph.datasets import load_dataset

    return load_dataset("cora", root=str(cora_root))
