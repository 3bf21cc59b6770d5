"""Fixtures shared by several test modules: the real Cora files, the copy-paste examples of
docs/integrations.md, one torch thread for tests of tiny sparse ops, and the one process
that runs the kernel test files under Triton's interpreter (started with the session)."""

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tests.kernels.interpreted import InterpretedRuns

# One torch thread for the session: the interpreted kernel runs take another core beside the
# tests, and a machine shared with other jobs (or granted fewer CPUs than it has: affinity,
# cgroup quota) parks threads, where every OpenMP barrier waits for them; the suite's graphs are
# small enough that a second thread gains little even on an idle machine. A test that needs
# another count sets it and puts it back.
torch.set_num_threads(1)

#: the session's `InterpretedRuns`
INTERPRETED_RUNS = pytest.StashKey[InterpretedRuns]()

#: the examples the integration tests run
INTEGRATIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _shared_planetoid() -> Path:
    """Real Planetoid Cora (``Cora/raw/ind.cora.*``), read-only: ``$GACT_GRAPH_PLANETOID``, else
    the project's ``shared/`` folder beside the checkout (``../shared/data/planetoid``)."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "data" / "planetoid"
    return Path(os.environ.get("GACT_GRAPH_PLANETOID") or beside)  # absent: those tests skip


SHARED_PLANETOID = _shared_planetoid()


def read_doc_example(name: str) -> str:
    """The ```python block after ``<!-- example: name -->`` in docs/integrations.md."""
    text = INTEGRATIONS_DOC.read_text()
    m = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"no example {name!r} in {INTEGRATIONS_DOC}"
    return m.group(1)


def run_doc_example(name: str, replacements=()) -> dict:
    """Run example ``name`` with each ``(old, new)`` of ``replacements`` applied (each must be
    in the code: a renamed line fails the test, not silently the substitution); its globals."""
    code = read_doc_example(name)
    for old, new in replacements:
        assert old in code, f"{old!r} is not in example {name!r}"
        code = code.replace(old, new)
    ns: dict = {"__name__": "__doc_example__"}
    exec(compile(code, str(INTEGRATIONS_DOC), "exec"), ns)
    return ns


@pytest.fixture(scope="session")
def doc_example():
    """``doc_example(name)`` -> the example's code; ``doc_example.run(name, replacements)``
    runs it; ``doc_example.path`` names the file."""
    read_doc_example.path = str(INTEGRATIONS_DOC)
    read_doc_example.run = run_doc_example
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


@pytest.fixture(autouse=True)
def no_global_mode_left_behind():
    """Fail a test that leaves a process-wide torch mode or saved-tensor hook installed: the
    tests after it would run under it (a `LiveBytes` dispatch mode left by a failed budget
    profile step once made the rest of the suite 10-30x slower, and a leftover hook would
    compress every later test's autograd graph)."""
    yield
    left = [
        *(f"dispatch mode {type(m).__name__}" for m in _get_current_dispatch_mode_stack()),
        *(f"torch-function mode {type(m).__name__}" for m in _get_current_function_mode_stack()),
    ]
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append("saved-tensor hooks")
    if left:
        pytest.fail(f"left installed after the test: {', '.join(left)}")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny sparse ops pay OpenMP barriers on a loaded shared machine; one thread is faster
    there and changes no result (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_finish(session):
    """The interpreted runs start as soon as the tests are known: one more process, which
    runs beside the tests of this one until the first of them that needs it waits for it."""
    if not session.config.option.collectonly:
        runs = InterpretedRuns(session, Path(tempfile.mkdtemp(prefix="gact-interpreted-")))
        session.config.stash[INTERPRETED_RUNS] = runs
        runs.start()


def pytest_sessionfinish(session):
    runs = session.config.stash.get(INTERPRETED_RUNS, None)
    if runs is not None:
        runs.stop()
        shutil.rmtree(runs.tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def interpreted_runs(request):
    """The test files that re-run under Triton's interpreter, all in one fresh process
    (`tests.kernels.interpreted.interpreter_test`), started with the session."""
    return request.config.stash[INTERPRETED_RUNS]
