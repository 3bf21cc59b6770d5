"""The README's first lines are the two set-up commands; CI runs the second one verbatim. The
README and docs/ send a reader only to files in the repository, and their Cora commands share
one data folder."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_paths_in_docs_exist_in_the_repository(doc):
    """A ``../`` path in backticks, and every relative Markdown link (the README's table of
    options sends a reader to docs/guide/), names a file or folder of the checkout, not one of
    the machine the doc was written on."""
    text = doc.read_text()
    paths = re.findall(r"`(\.\./[^`\s]+)`|\]\((?![a-z]+:)([^)\s#]+)", text)
    for path in [a or b for a, b in paths]:
        target = (doc.parent / path).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), f"{doc.name}: {path}"


def test_cora_commands_and_examples_use_one_data_folder(doc_example):
    """The README's command and the PyG, Lightning and CogDL examples run one after another in
    one folder (each library keeps its processed files apart, tests/datasets)."""
    readme = (ROOT / "README.md").read_text()
    roots = set(re.findall(r"--dataset (?:cora|citeseer|pubmed) --root (\S+)", readme))
    assert roots, "the README's Cora command is gone"
    for name in ("pyg", "lightning", "cogdl"):
        m = re.search(r'^root = "([^"]+)"', doc_example(name), re.M)
        assert m, f"the {name} example sets no root"
        roots.add(m.group(1))
    assert roots == {"data"}, roots  # the loaders' default root (and CogDL's data_path)
