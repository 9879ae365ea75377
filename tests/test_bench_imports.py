"""The bench scripts name what the package has: every ``numbafa`` name a script imports, and
every attribute it takes from an imported ``numbafa`` module, exists (checked without running
them: a script that outlives a refactoring fails here, not when someone next profiles)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

BENCH = pathlib.Path(__file__).parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def _numbafa_names(tree):
    """``(aliases {name: module}, [(module, attribute, line)])`` of a script's numbafa imports."""
    aliases, wanted = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "numbafa":
            for name in node.names:
                wanted.append((node.module, name.name, node.lineno))
                full = f"{node.module}.{name.name}"
                if importlib.util.find_spec(node.module) is not None:
                    aliases[name.asname or name.name] = full
        elif isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "numbafa" and name.asname:
                    aliases[name.asname] = name.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            wanted.append((aliases[node.value.id], node.attr, node.lineno))
    return wanted


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_numbafa_names_a_script_uses_exist(script):
    missing = []
    for module, attribute, line in _numbafa_names(ast.parse(script.read_text())):
        try:
            owner = importlib.import_module(module)
        except ImportError as error:
            missing.append(f"{script.name}:{line}: {module} ({error})")
            continue
        if not hasattr(owner, attribute):
            try:   # a submodule, imported by name
                importlib.import_module(f"{module}.{attribute}")
            except ImportError:
                missing.append(f"{script.name}:{line}: {module}.{attribute}")
    assert not missing, missing
