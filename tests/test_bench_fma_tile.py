"""bench/fma_tile.py: the float32 micro-kernel it times computes the product it claims."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
if str(_BENCH) not in sys.path:  # its siblings bench/peak.py and gemm_paths.py, as when run as a script
    sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("fma_tile", _BENCH / "fma_tile.py")
fma_tile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fma_tile)


def test_packing_lays_out_panels_with_zero_padding():
    a = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    ap = fma_tile.pack_a(a, 2)            # [2 panels, depth 8 (5 padded to UNROLL 4's multiple), 2 rows]
    assert ap.shape == (2, 8, 2) and ap.ctypes.data % 64 == 0
    np.testing.assert_array_equal(ap[0, :5], a[:2].T)
    np.testing.assert_array_equal(ap[1, :5, 0], a[2])
    assert not ap[1, :, 1].any() and not ap[:, 5:].any()
    bp = fma_tile.pack_b(a, 4)            # B [3, 5]: [2 panels, depth 4, 4 columns]
    assert bp.shape == (2, 4, 4)
    np.testing.assert_array_equal(bp[0, :3], a[:, :4])
    np.testing.assert_array_equal(bp[1, :3, 0], a[:, 4])
    assert not bp[1, :, 1:].any() and not bp[:, 3].any()


@pytest.mark.parametrize("width", [8, 16])   # (16 lanes run on AVX2 too: LLVM splits the vectors)
@pytest.mark.parametrize("m, n, k", [(6, 16, 4), (13, 40, 7), (100, 70, 300)])
def test_the_micro_kernel_computes_the_product(width, m, n, k):
    """``A @ B`` within ``k`` float32 roundings of ``|A| |B|`` of the exact product, for shapes
    off every blocking (rows, columns, depth blocks of ``KC``, row blocks of ``MC``); a packing
    of B's transpose instead (the layout the kernel must not take) is far off."""
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    wide = [x.astype(np.float64) for x in (a, b)]
    exact, bound = wide[0] @ wide[1], k * 2.0 ** -24 * (np.abs(wide[0]) @ np.abs(wide[1]))
    got = fma_tile.own_product(a, b, width)
    assert got.shape == (m, n) and (np.abs(got - exact) <= bound).all()
    if m == k:
        wrong = fma_tile.own_product(a, np.ascontiguousarray(b.T), width)
        assert not (np.abs(wrong - exact) <= bound).all()


def test_the_script_measures_every_gemm_of_a_block(capsys):
    assert fma_tile.main(["--repeats", "1", "--d-head", "32", "--rows", "64", "--keys", "64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["peak_gflops_one_thread"] > 0 and lines[0]["mr"] in (6, 12)
    rows = lines[1:]
    assert [r["gemm"].split()[0] for r in rows] == ["S^T", "dQ", "dK^T"]
    for r in rows:
        assert r["own_gflops"] > 0 and r["blas_gflops"] > 0 and 0 <= r["error_over_bound"] <= 1
        assert 0 <= r["same_bits_as_blas"] <= 1 and r["pack_a_us"] > 0
