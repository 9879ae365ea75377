"""The documentation site (docs/) builds with warnings as errors and documents every public name;
every page that cites upstream lines names the upstream version they are lines of.

Runs ``python -m sphinx -W --keep-going -b html docs <tmp>`` in a subprocess:
a broken cross-reference, a docstring numpydoc cannot parse, a Markdown page
that does not build or a public name missing from the API reference (checked
by ``docs/conf.py``, and again below on the HTML) fails it. Takes a few
seconds (it imports numbafa, it runs no kernel).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import numbafa
import numbafa.golden
import numbafa.layout

ROOT = pathlib.Path(__file__).resolve().parents[1]

needs_sphinx = pytest.mark.skipif(
    importlib.util.find_spec("sphinx") is None,
    reason="Sphinx is not importable: install the docs toolchain with pip install '.[docs]' "
           "(the test extra includes it)")

#: The upstream release that line citations such as ``attention_bwd.py:1361-1372`` refer to:
#: ``nkilib/core/attention/attention_bwd.py`` in this neuronx_cc wheel.
UPSTREAM_VERSION = "2.24.5133.0+58f8de22"
#: An upstream line citation: ``attention_bwd.py:<line>``, or "upstream <line>" / "upstream lines <line>".
UPSTREAM_CITATION = re.compile(r"attention_bwd\.py:\d+|\bupstream (?:lines? )?\d{2,}")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*.rst"))]

PUBLIC = ([f"numbafa.{name}" for name in numbafa.__all__]
          + [f"numbafa.layout.{name}" for name in numbafa.layout.__all__]
          + [f"numbafa.golden.{name}" for name in numbafa.golden.__all__])


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Build the site once into a temporary directory; return (completed process, html dir)."""
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
           "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, out / "html"


@needs_sphinx
def test_the_site_builds_with_warnings_as_errors(site):
    proc, html = site
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"sphinx -W failed (exit {proc.returncode}):\n{log[-4000:]}"
    assert "WARNING" not in log, log[-4000:]
    for page in ("index", "api", "porting", "tutorial", "layouts", "numerics", "architecture",
                 "performance"):
        assert (html / f"{page}.html").is_file(), page


@needs_sphinx
@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_in_the_api_reference(site, name):
    _, html = site
    api = (html / "api.html").read_text(encoding="utf-8")
    assert f'id="{name}"' in api or f'id="module-{name}"' in api, (
        f"{name} is public (in an __all__) but not documented in docs/api.rst")


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_upstream_line_citations_name_the_upstream_version(page):
    """A page that cites upstream lines says which upstream release they are lines of."""
    text = page.read_text(encoding="utf-8")
    cited = UPSTREAM_CITATION.findall(text)
    assert not cited or UPSTREAM_VERSION in text, (
        f"{page.name} cites upstream lines ({', '.join(sorted(set(cited)))}) but does not say they "
        f"refer to nkilib/core/attention/attention_bwd.py in the neuronx_cc {UPSTREAM_VERSION} wheel")


@pytest.mark.parametrize("page", ["docs/architecture.md", "README.md"])
def test_the_module_maps_name_every_module(page):
    """docs/architecture.md and README's module table map the package: every module of numbafa/
    is in them (by its path, or by its file name beside a path of its folder), and every
    numbafa/ module they name exists."""
    text = (ROOT / page).read_text()
    package = ROOT / "numbafa"
    missing = [str(p.relative_to(ROOT)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" or p.parent == package
               if not (f"numbafa/{p.relative_to(package)}" in text or f"`{p.name}`" in text)]
    assert not missing, f"modules missing from {page}: {missing}"
    named = set(re.findall(r"numbafa/([\w/]+\.py)", text))
    assert not [n for n in named if not (package / n).exists()], named
