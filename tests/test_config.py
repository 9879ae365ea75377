"""JIT flags live in one place; the tiling follows the Neuron rules."""

from __future__ import annotations

import ast
import pathlib

import pytest

from numbafa import config

PACKAGE = pathlib.Path(config.__file__).parent


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_no_hard_coded_jit_flags():
    """Every jitted function is made by config.jit(); nobody else calls njit/jit with flags."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            keywords = {k.arg for k in node.keywords}
            if name in ("njit", "vectorize", "guvectorize") or (name == "jit" and not keywords <= {"parallel", "inline"}):
                offenders.append(f"{path.name}:{node.lineno}: {name}({', '.join(map(str, keywords))})")
            if keywords & {"fastmath", "cache", "nogil", "error_model"}:
                offenders.append(f"{path.name}:{node.lineno}: flags {keywords}")
    assert not offenders, offenders


def test_fastmath_only_contracts():
    assert set(config.JIT_FLAGS["fastmath"]) == {"contract"}


@pytest.mark.parametrize("d_head,d_tile,n_tiles,section", [
    (64, 64, 1, 8192), (96, 96, 1, 8192), (128, 128, 1, 8192), (200, 100, 2, 4096),
    (256, 128, 2, 4096), (384, 128, 3, 2048), (512, 128, 4, 2048), (1024, 128, 8, 1024)])
def test_setup_config_head_dim_tiling(d_head, d_tile, n_tiles, section):
    cfg = config.setup_config(4096, 4096, d_head)
    assert (cfg.d_tile, cfg.d_n_tiles, cfg.section_len) == (d_tile, n_tiles, section)


def test_setup_config_small_and_ragged():
    cfg = config.setup_config(97, 300, 64)
    assert cfg.k_tile == 300 and cfg.q_n_tiles == 1 and cfg.n_sections == 1
    assert config.setup_config(1025, 9000, 64).n_sections == 2
    with pytest.raises(ValueError, match="seqlen_k should be >= 1, got 0"):
        config.setup_config(1, 0, 64)


def test_power_of_2():
    assert [config.power_of_2(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_stale_cache_is_cleared_when_any_source_changes(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "kernels" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "kernels" / "b.py").write_text("y = 2\n")
    cached = pkg / "kernels" / "__pycache__" / "b.f-1.py311.nbi"
    cached.write_text("index")
    assert config.invalidate_stale_cache(pkg)            # first time: no fingerprint yet
    cached.write_text("index")
    assert not config.invalidate_stale_cache(pkg)        # nothing changed: cache kept
    assert cached.exists()
    (pkg / "a.py").write_text("x = 2\n")                 # another module's source changed
    assert config.invalidate_stale_cache(pkg)
    assert not cached.exists()
