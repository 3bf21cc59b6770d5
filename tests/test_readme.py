"""The README's first lines are the two set-up commands; CI runs the second one verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    return lines[0].strip("`"), lines[2].strip("`")


def test_readme_opens_with_the_two_setup_commands():
    main_job, tests = _commands()
    for cmd in (main_job, tests):
        assert cmd.startswith("pip install torch==2.13.0 && pip install -e ")
    assert main_job.endswith("python examples/train_full_batch.py")
    assert '".[test]"' in tests and tests.endswith("python -m pytest -q tests")


def test_ci_runs_the_readme_test_line():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sed -n '3p' README.md" in ci and 'eval "$cmd"' in ci
