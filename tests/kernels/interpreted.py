"""What the Triton kernel tests share: where a kernel runs (CUDA, or the CPU under Triton's
interpreter, which ``TRITON_INTERPRET=1`` switches on only if set before Triton is imported:
the conftest's imports (PyG) import Triton first), the mark that skips a kernel test
elsewhere, and the run of test files again in one fresh interpreter with that variable set,
started when the session's tests are collected (where it is set, the interpreter's repeated
patching of ``triton.language`` is skipped)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
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


def _patch_interpreter_once_per_launch() -> None:
    """Under ``TRITON_INTERPRET=1``, Triton's interpreter re-patches ``triton.language`` (an
    ``inspect.getmembers`` walk over its modules) at every call of a ``@triton.jit`` helper
    inside a kernel, though the launch around it has patched the same modules already (most
    of what a helper call costs there). This skips the repeat while a launch's patch is in
    effect and the helper sees no language module patched for none of its callers (what the
    interpreter runs is unchanged); a Triton without these internals is left as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope_type is None:
        return
    import inspect

    langs_of = {}
    state = {"launching": False, "patched": None}

    def langs(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs_of:
            mods = (interpreter.tl, interpreter.tl.core)
            langs_of[key] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in mods
            )
        return langs_of[key]

    def once(fn):
        if state["launching"]:  # the launch's own patch
            state["launching"] = False
            state["patched"] = langs(fn)
            return patch_lang(fn)
        if state["patched"] is None:
            return patch_lang(fn)
        if langs(fn) <= state["patched"]:
            return scope_type()  # in effect already: nothing to patch or restore
        # a helper's call never restores its patch, so it stays for the rest of the launch
        scope = patch_lang(fn)
        state["patched"] = state["patched"] | langs(fn)
        return scope

    launch = executor.__call__

    def call(self, *args, **kwargs):
        outer = state["patched"]
        state["launching"] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["launching"], state["patched"] = False, outer

    interpreter._patch_lang = once
    executor.__call__ = call


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_once_per_launch()


def kernel_test(f):
    """`needs_kernels`, and the ``cuda`` mark: the GPU suite's ``pytest -m cuda`` runs the
    test compiled on the device."""
    return pytest.mark.cuda(needs_kernels(f))


def subprocess_env(**extra: str) -> dict:
    """This process's environment with ``extra`` and the checkout first on ``PYTHONPATH``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


#: what the shared fresh process runs: for each case (a test file, its ``-k`` selection and the
#: environment variables set while it runs), a ``pytest.main`` run in that one process (each
#: new process imports torch, PyG and Triton again), and the outcomes it counted, as JSON
DRIVER = r"""
import contextlib, io, json, os, sys
import pytest
import torch

class Outcomes:
    def __init__(self):
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.counts[report.outcome] += 1

cases, out_path = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for case in cases:
    saved, threads = dict(os.environ), torch.get_num_threads()
    os.environ.update(case["env"])
    if "OMP_NUM_THREADS" in case["env"]:
        torch.set_num_threads(int(case["env"]["OMP_NUM_THREADS"]))
    outcomes, text = Outcomes(), io.StringIO()
    args = ["-q", "-x", "-p", "no:cacheprovider", case["file"], "-k", case["select"],
            "-W", "ignore::RuntimeWarning"]
    try:
        with contextlib.redirect_stdout(text):
            rc = int(pytest.main(args, plugins=[outcomes]))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
    results[case["file"]] = dict(rc=rc, **outcomes.counts, output=text.getvalue()[-4000:])
    with open(out_path, "w") as f:
        json.dump(results, f)
"""


def interpreter_test(select: str = "not subprocess", **env: str):
    """The test that runs its file's tests that ``-k select`` picks under Triton's
    interpreter (``env`` set meanwhile), and asserts that all of them passed and none was
    skipped. Every such test of a pytest session shares one fresh process (`InterpretedRuns`),
    running from the session's start on; define it in a test file as
    ``test_interpreter_in_subprocess``."""

    @pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="already interpreted / no Triton")
    @pytest.mark.interpreted_run(select=select, env=env)
    def test_interpreter_in_subprocess(interpreted_runs, request):
        interpreted_runs.check(request.node)

    return test_interpreter_in_subprocess


class InterpretedRuns:
    """The session's interpreted runs: every selected test marked ``interpreted_run`` has its
    file run in one fresh process with ``TRITON_INTERPRET=1``. `start` launches it when the
    session's tests are collected, so it runs on another core beside the tests before the
    first `check`, which waits for it."""

    #: how long the whole run may take (seconds)
    TIMEOUT = 1500

    def __init__(self, session: pytest.Session, tmp: Path):
        self.session, self.tmp, self.out = session, tmp, tmp / "interpreted.json"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.results: dict | None = None
        self.failure = ""

    def _cases(self) -> list[dict]:
        cases = []
        for item in self.session.items:
            mark = item.get_closest_marker("interpreted_run")
            if mark is not None:
                cases.append(dict(file=str(item.path), **mark.kwargs))
        return cases

    def start(self) -> None:
        """Launch the run, once, where the session holds a case and this process can run it."""
        cases = self._cases()
        if self.proc is not None or not cases or INTERPRETED or not HAS_TRITON:
            return
        cmd = [sys.executable, "-c", DRIVER, json.dumps(cases), str(self.out)]
        # files, not pipes: a pipe nobody reads while the tests run would fill and stall it;
        # one torch thread, as the tests' own process (conftest.py): the two share the cores
        env = subprocess_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        with open(self.tmp / "stdout", "w") as out, open(self.tmp / "stderr", "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=err, text=True)
        self.started = time.monotonic()

    def stop(self) -> None:
        """End a run still going (the session ended before a `check` waited for it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _wait(self) -> None:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            rc = f"killed after {self.TIMEOUT} s"
        self.results = json.loads(self.out.read_text()) if self.out.exists() else {}
        if rc != 0:
            tails = ((self.tmp / name).read_text()[-4000:] for name in ("stdout", "stderr"))
            self.failure = f"exit {rc}: " + "".join(tails)

    def check(self, item: pytest.Item) -> None:
        if self.results is None:
            assert str(item.path) in {c["file"] for c in self._cases()}, item.nodeid
            self.start()
            self._wait()
        got = self.results.get(str(item.path))
        assert got is not None, f"{item.path} did not run: {self.failure}"
        assert got["rc"] == 0 and got["failed"] == 0, got["output"]
        assert got["passed"] > 0 and got["skipped"] == 0, got["output"]
