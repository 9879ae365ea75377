"""bench/fma_tile.py: the float32 micro-kernel it times computes the product it claims."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

_BENCH = str(pathlib.Path(__file__).resolve().parents[1] / "bench")
if _BENCH not in sys.path:   # the script and its siblings (peak.py, gemm_paths.py), as when run as a script
    sys.path.insert(0, _BENCH)
import fma_tile  # noqa: E402


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


@pytest.mark.parametrize("width, mr", [(8, None), (8, 4), (16, None)])   # (16 lanes run on AVX2 too)
@pytest.mark.parametrize("m, n, k", [(6, 16, 4), (13, 40, 7), (100, 70, 300)])
def test_the_micro_kernel_computes_the_product(width, mr, m, n, k):
    """``A @ B`` within ``k`` float32 roundings of ``|A| |B|`` of the exact product, for shapes
    off every blocking (rows, columns, depth blocks of ``KC``, row blocks of ``MC``); B as plain
    rows instead of panels (the layout the kernel must not take) is far off."""
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    wide = [x.astype(np.float64) for x in (a, b)]
    exact, bound = wide[0] @ wide[1], k * 2.0 ** -24 * (np.abs(wide[0]) @ np.abs(wide[1]))
    got = fma_tile.own_product(a, b, width, mr)
    assert got.shape == (m, n) and (np.abs(got - exact) <= bound).all()
    # B's padded rows as they lie, cut into the panels' shape: the layout the kernel must not take
    mr_, nr = fma_tile.widths(width, mr)
    ap, bp = fma_tile.pack_a(a, mr_), fma_tile.pack_b(b, nr)
    plain = np.zeros((bp.shape[1], bp.shape[0] * nr), np.float32)
    plain[:k, :n] = b
    wrong_bp = fma_tile.aligned(bp.shape)
    wrong_bp[...] = plain.reshape(bp.shape)
    c = np.zeros((ap.shape[0] * mr_, bp.shape[0] * nr), np.float32)
    fma_tile.micro_kernel(width, mr)(c.shape[0], c.shape[1], ap.shape[1], ap.ctypes.data, wrong_bp.ctypes.data,
                                     c.ctypes.data, c.shape[1])
    if n > nr:   # (one panel: the two layouts are the same)
        assert not (np.abs(c[:m, :n] - exact) <= bound).all()


def test_the_script_measures_every_gemm_of_a_block(capsys):
    assert fma_tile.main(["--repeats", "1", "--d-head", "32", "--rows", "64", "--keys", "64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["peak_gflops_one_thread"] > 0 and lines[0]["mr"] in (6, 12)
    rows = lines[1:]
    assert [r["gemm"].split()[0] for r in rows] == ["S^T", "dQ", "dK^T"]
    for r in rows:
        assert r["own_gflops"] > 0 and r["blas_gflops"] > 0 and 0 <= r["error_over_bound"] <= 1
        assert 0 <= r["same_bits_as_blas"] <= 1 and r["pack_a_us"] > 0


def test_a_row_count_that_does_not_divide_the_row_block_is_refused(capsys):
    with pytest.raises(ValueError, match="mr must be a positive divisor of MC = 96, got 7"):
        fma_tile.widths(8, 7)
    with pytest.raises(SystemExit):
        fma_tile.main(["--mr", "7"])
    assert "mr must be a positive divisor" in capsys.readouterr().err
