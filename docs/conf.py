"""Sphinx configuration of the numbafa documentation site.

Build (warnings are errors, as in CI via tests/test_docs.py)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's numbafa, installed or not

import numbafa  # noqa: E402
import numbafa.golden  # noqa: E402
import numbafa.layout  # noqa: E402

project = "numbafa"
author = "the numbafa developers"
copyright = "the numbafa developers"
release = version = numbafa.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Every cross-reference must resolve (with -W a broken one fails the build).
nitpicky = True
# Types that docstrings and annotations name but that this site does not
# document (no intersphinx: the build must work offline).
nitpick_ignore = [
    ("py:class", "np.ndarray"),
    ("py:class", "numpy.ndarray"),
    ("py:class", "ndarray"),
    # Internal modules the public docstrings point to: real, but not part of
    # the public API reference (listed one by one so that any other
    # unresolved reference still fails the build).
    ("py:mod", "numbafa.kernels"),
    ("py:mod", "numbafa.kernels.matmul"),
    ("py:mod", "numbafa.kernels.launch"),
    ("py:func", "numbafa.platform.onednn.gemm_path"),
    ("py:func", "numbafa.compiler.jit.cache_info"),
]

# numbafa.torch and numbafa.jax import their framework; a docs-only install
# (pip install ".[docs]") documents them with the framework mocked.
autodoc_mock_imports = [name for name in ("torch", "jax") if importlib.util.find_spec(name) is None]

# autodoc / autosummary: API pages are written by hand in api.rst (no
# generated stub files in the source tree).
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc sections give every type

# numpydoc
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# MyST: the Markdown pages of docs/ (also linked from README.md).
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "pydata_sphinx_theme"
html_title = f"numbafa {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 4,
    "show_toc_level": 2,
}
html_static_path: list[str] = []
# One flat toctree: no left "Section Navigation" column (it would be empty).
html_sidebars = {"**": []}


# --- every public name must be in the API reference --------------------------------
def public_names() -> list[str]:
    """Fully qualified names the API reference must document."""
    names = [f"numbafa.{name}" for name in numbafa.__all__]
    names += [f"numbafa.layout.{name}" for name in numbafa.layout.__all__]
    names += [f"numbafa.golden.{name}" for name in numbafa.golden.__all__]
    return names


def _check_public_names(app, env) -> None:
    """Warn (an error under -W) for a public name the site does not document."""
    from sphinx.util import logging

    documented = set(env.get_domain("py").objects)
    missing = [name for name in public_names() if name not in documented]
    for name in missing:
        logging.getLogger(__name__).warning(
            "public name %s is not documented in the API reference (docs/api.rst)", name)


def setup(app):
    app.connect("env-check-consistency", _check_public_names)
