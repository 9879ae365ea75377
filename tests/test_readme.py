"""Every Python code block of the README runs as written (and the docs' too)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(path):
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


BLOCKS = [(f"{path.name}-{i}", block) for path in PAGES for i, block in enumerate(_python_blocks(path))]


def test_the_readme_has_python_examples():
    assert sum(name.startswith("README.md") for name, _ in BLOCKS) >= 2


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_code_block_runs(name, block):
    exec(compile(block, name, "exec"), {"__name__": f"docs_{name}"})
