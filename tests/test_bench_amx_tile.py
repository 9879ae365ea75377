"""bench/amx_tile.py: the AMX micro-kernel it times computes the product it claims."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
if str(_BENCH) not in sys.path:  # its sibling bench/peak.py, as when run as a script
    sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("amx_tile", _BENCH / "amx_tile.py")
amx_tile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(amx_tile)


def test_vnni_interleaves_pairs_of_rows():
    b = np.arange(4 * 3, dtype=np.uint16).reshape(4, 3)
    np.testing.assert_array_equal(amx_tile.vnni(b), [[0, 3, 1, 4, 2, 5], [6, 9, 7, 10, 8, 11]])


def test_the_script_says_why_it_cannot_run_or_measures(capsys):
    """Where AMX (and oneDNN) are missing it names what; elsewhere it prints a JSON line a shape."""
    why = amx_tile.unavailable()
    amx_tile.SHAPES, shapes = amx_tile.SHAPES[:1], amx_tile.SHAPES
    try:
        assert amx_tile.main(["--repeats", "1"]) == 0
    finally:
        amx_tile.SHAPES = shapes
    out = capsys.readouterr().out
    if why:
        assert out.strip() == f"amx_tile: not measured: {why}"
    else:
        assert out.count("\n") == 1 and '"amx_gflops"' in out


@pytest.mark.parametrize("m, n, k", [(32, 32, 32), (64, 96, 160)])
def test_the_micro_kernel_computes_the_product(m, n, k):
    """``A @ B`` of random bf16 within ``k`` float32 roundings of ``|A| |B|`` of the exact product;
    a B packed as plain rows instead (the layout the kernel must not take) is far off."""
    why = amx_tile.unavailable()
    if why:
        pytest.skip(why)
    import ml_dtypes

    rng = np.random.default_rng(m + n + k)
    a, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16).view(np.uint16) for s in ((m, k), (k, n)))
    wide = [x.view(ml_dtypes.bfloat16).astype(np.float64) for x in (a, b)]
    exact, bound = wide[0] @ wide[1], k * 2.0 ** -24 * (np.abs(wide[0]) @ np.abs(wide[1]))
    got = amx_tile.amx_product(a, amx_tile.vnni(b), n)
    assert (np.abs(got - exact) <= bound).all()
    wrong = amx_tile.amx_product(a, np.ascontiguousarray(b.reshape(k // 2, 2 * n)), n)
    assert not (np.abs(wrong - exact) <= bound).all()


def test_a_cpu_without_amx_is_named(monkeypatch):
    """The seam the other CPUs take: LLVM's host features without AMX-BF16."""
    monkeypatch.setattr(amx_tile.peak, "_engine", lambda: (None, {"avx512f": True}))
    assert amx_tile.unavailable() == "this CPU has no AMX-BF16"


def test_the_micro_kernel_refuses_to_run_without_amx(monkeypatch):
    monkeypatch.setattr(amx_tile.peak, "_engine", lambda: (None, {"avx512f": True}))
    amx_tile.micro_kernel.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no AMX-BF16"):
            amx_tile.micro_kernel()
    finally:
        amx_tile.micro_kernel.cache_clear()
