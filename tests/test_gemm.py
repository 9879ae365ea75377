"""numbafa.kernels.gemm: sgemm with alpha, beta and transposes on row-major tiles."""

from __future__ import annotations

import numpy as np
import pytest

from numbafa.kernels.gemm import gemm


def _operand(rng, shape, transposed):
    return rng.standard_normal(shape[::-1] if transposed else shape).astype(np.float32)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (0.375, 1.0), (-2.0, 0.5)])
def test_matches_float64_product(trans_a, trans_b, alpha, beta):
    rng = np.random.default_rng(0)
    m, n, k = 37, 29, 53
    a = _operand(rng, (m, k), trans_a)
    b = _operand(rng, (k, n), trans_b)
    c = rng.standard_normal((m, n)).astype(np.float32)
    if beta == 0.0:
        c[:] = np.nan  # beta = 0 must not read c
    expected = alpha * ((a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b))
    if beta != 0.0:
        expected += beta * c
    gemm(a, b, c, trans_a, trans_b, np.float32(alpha), np.float32(beta))
    # float32 accumulation over k = 53 terms of size ~1: error << 1e-4 of the result's scale.
    np.testing.assert_allclose(c, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_views_with_row_strides_and_offsets_touch_only_their_elements():
    rng = np.random.default_rng(1)
    big_a = rng.standard_normal((40, 70)).astype(np.float32)
    big_b = rng.standard_normal((60, 50)).astype(np.float32)
    big_c = rng.standard_normal((30, 90)).astype(np.float32)
    a = big_a[5:25, 10:42]        # [20, 32], row stride 70
    b = big_b[3:35, 7:31]         # [32, 24], row stride 50
    c = big_c[4:24, 11:35]        # [20, 24], row stride 90
    before = big_c.copy()
    expected = a.astype(np.float64) @ b + c
    gemm(a, b, c, False, False, np.float32(1.0), np.float32(1.0))
    np.testing.assert_allclose(c, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    outside = np.ones(big_c.shape, bool)
    outside[4:24, 11:35] = False
    np.testing.assert_array_equal(big_c[outside], before[outside])


def test_empty_contraction_scales_c_and_empty_output_is_a_no_op():
    c = np.full((3, 4), 2.0, np.float32)
    gemm(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), c, False, False,
         np.float32(1.0), np.float32(0.5))
    np.testing.assert_array_equal(c, 1.0)
    gemm(np.empty((0, 5), np.float32), np.ones((5, 4), np.float32), np.empty((0, 4), np.float32),
         False, False, np.float32(1.0), np.float32(0.0))


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="shapes"):
        gemm(np.ones((3, 5), np.float32), np.ones((4, 2), np.float32), np.ones((3, 2), np.float32),
             False, False, np.float32(1.0), np.float32(0.0))
