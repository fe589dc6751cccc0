"""The README's front page cannot drift from the code: its Python examples run, its links resolve.

Every ```python block of README.md runs, in order, in one namespace (a later block may use an
earlier one's names), in a temporary directory (they write files), on CPU under the fake
process group the examples set up themselves. A block whose first line starts with
``# (not run by the tests`` says why it cannot run here (a cluster, downloaded weights).
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = "# (not run by the tests"


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(ROOT / "README.md")
    runnable = [block for block in blocks if not block.startswith(SKIP)]
    assert len(runnable) >= 2, "the README's usage and inspecting examples are runnable"
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()
    namespace: dict = {}
    for block in runnable:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    torch._dynamo.reset()
    printed = capsys.readouterr().out
    assert "rewritten" in printed and "all_gather_matmul" in printed, printed
    assert (tmp_path / "ring.dot").exists() and (tmp_path / "steps.json").exists()


@pytest.mark.parametrize("document", ["README.md", "docs/design.md", "docs/coverage.md", "docs/inspecting.md", "docs/testing.md", "benchmarks/README.md"])
def test_links_and_cited_files_exist(document):
    """Relative links resolve, and every ``benchmarks/results`` file a document cites is there."""
    path = ROOT / document
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (path.parent / target).exists(), f"{document} links to {target}, which does not exist"
    results = ROOT / "benchmarks" / "results"
    for cited in re.findall(r"results/([\w.*-]+\.json)", text):
        assert list(results.glob(cited)), f"{document} cites results/{cited}, which does not exist"


def test_every_result_file_is_cited():
    """``benchmarks/results`` keeps only what the benchmark tables cite."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    cited = re.findall(r"results/([\w.*-]+\.json)", text)
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert any(pathlib.PurePath(path.name).match(pattern) for pattern in cited), f"{path.name} is cited by no table"
