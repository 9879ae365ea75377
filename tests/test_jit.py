"""JIT flags live in one place (numbafa.jit); its cache is keyed by the package sources.

The cache itself (location, recovery, fallbacks) is tested end to end in test_cache.py.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from numbafa import jit as jit_policy

PACKAGE = pathlib.Path(jit_policy.__file__).parent


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_no_hard_coded_jit_flags():
    """Every jitted function is made by numbafa.jit.jit(); nobody else calls njit/jit with flags."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "jit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            keywords = {k.arg for k in node.keywords}
            if name in ("njit", "vectorize", "guvectorize") or (name == "jit" and not keywords <= {"parallel", "inline", "contract", "entry", "apart"}):
                offenders.append(f"{path.name}:{node.lineno}: {name}({', '.join(map(str, keywords))})")
            if keywords & {"fastmath", "cache", "nogil", "error_model"}:
                offenders.append(f"{path.name}:{node.lineno}: flags {keywords}")
    assert not offenders, offenders


def test_fastmath_only_contracts():
    assert set(jit_policy.JIT_FLAGS["fastmath"]) == {"contract"}


def test_source_hash_changes_when_any_source_changes(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "kernels" / "b.py").write_text("y = 2\n")
    first = jit_policy.source_hash(pkg)
    assert len(first) == 64 and jit_policy.source_hash(pkg) == first
    (pkg / "kernels" / "b.nbi").write_text("not a source")       # cache files do not count
    assert jit_policy.source_hash(pkg) == first
    (pkg / "a.py").write_text("x = 2\n")                         # another module's source changed
    second = jit_policy.source_hash(pkg)
    assert second != first
    (pkg / "a.py").rename(pkg / "c.py")                           # a rename too
    assert jit_policy.source_hash(pkg) not in (first, second)
    with pytest.raises(FileNotFoundError):                       # no sources: nothing to key by
        jit_policy.source_hash(tmp_path / "empty")


def test_the_package_uses_its_own_cache_directory():
    info = jit_policy.cache_info()
    assert jit_policy.JIT_FLAGS["cache"] is info["enabled"]
    if info["enabled"]:
        name = pathlib.Path(info["dir"]).name
        assert name.startswith(jit_policy.source_hash()[:16] + "-numba")
        from numbafa.kernels.backward import bwd_work_item
        assert bwd_work_item.stats.cache_path.startswith(info["dir"])


def test_kernel_functions_stay_small():
    """Kernels take bundles, not dozens of loose arguments, and no function grows past a screen
    (docs/architecture.md): at most 10 parameters and 80 lines, docstring included."""
    offenders = []
    for path in (PACKAGE / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                n_args = len(node.args.args)
                n_lines = node.end_lineno - node.lineno + 1
                if n_args > 10 or n_lines > 80:
                    offenders.append(f"{path.name}:{node.name}: {n_args} parameters, {n_lines} lines")
    assert not offenders, offenders
