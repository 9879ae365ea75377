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
    # As a script: blocks guarded by ``if __name__ == "__main__":`` (spawned worker processes) run.
    exec(compile(block, name, "exec"), {"__name__": "__main__"})


def test_the_dask_example_is_a_block_that_runs():
    """The README's Dask example is Python (run above) on a local cluster of worker processes."""
    blocks = [block for block in _python_blocks(ROOT / "README.md") if "nd.attention_bwd(client" in block]
    assert len(blocks) == 1
    for needed in ("LocalCluster(n_workers=2, threads_per_worker=1, processes=True",
                   "dashboard_address=None", "Client(cluster) as client", 'if __name__ == "__main__":'):
        assert needed in blocks[0], needed


@pytest.mark.parametrize("page", ["README.md", "docs/frameworks.md", "docs/tutorial.md"])
def test_install_lines_name_no_unpublished_package(page):
    """numbafa is not on PyPI: the extras are installed from the clone, ``pip install ".[torch]"``."""
    text = (ROOT / page).read_text()
    assert not re.search(r"""pip install ['"]?numbafa\[""", text)
    if page == "README.md":
        for extra in ("torch", "jax", "dask"):
            assert f'pip install ".[{extra}]"' in text, extra
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
