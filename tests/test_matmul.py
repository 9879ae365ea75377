"""numbafa.kernels.matmul: the one matmul seam (sgemm, dgemm, gemv) on row-major tiles."""

from __future__ import annotations

import numpy as np
import pytest

from numba.core.errors import TypingError

from numbafa.jit import jit
from numbafa.kernels.matmul import matmul


@jit()
def gemm(a, b, c, trans_a, trans_b, alpha, beta):
    """The seam is only callable from njit code; this is the tests' way in."""
    matmul(a, b, c, trans_a, trans_b, alpha, beta)


def _operand(rng, shape, transposed, dtype=np.float32):
    return rng.standard_normal(shape[::-1] if transposed else shape).astype(dtype)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (0.375, 1.0), (-2.0, 0.5)])
@pytest.mark.parametrize("dtype, atol", [(np.float32, 1e-4), (np.float64, 1e-12)])
def test_matches_float64_product(trans_a, trans_b, alpha, beta, dtype, atol):
    rng = np.random.default_rng(0)
    m, n, k = 37, 29, 53
    a = _operand(rng, (m, k), trans_a, dtype)
    b = _operand(rng, (k, n), trans_b, dtype)
    c = rng.standard_normal((m, n)).astype(dtype)
    if beta == 0.0:
        c[:] = np.nan  # beta = 0 must not read c
    expected = alpha * ((a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b))
    if beta != 0.0:
        expected += beta * c
    gemm(a, b, c, trans_a, trans_b, dtype(alpha), dtype(beta))
    # Accumulation over k = 53 terms of size ~1: float32 error << 1e-4 of the result's
    # scale (53 * 2^-24 * |terms| ~ 1e-5), float64 << 1e-12.
    np.testing.assert_allclose(c, expected, rtol=0, atol=atol * np.abs(expected).max())


def test_matrix_vector_product_is_np_dot():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((31, 45)).astype(np.float32)
    b = rng.standard_normal(45).astype(np.float32)
    c = np.full(31, np.nan, np.float32)
    gemm(a, b, c, False, False, np.float32(1.0), np.float32(0.0))
    np.testing.assert_array_equal(c, np.dot(a, b))
    with pytest.raises(ValueError, match="matrix-vector"):
        gemm(a, b, c, False, False, np.float32(1.0), np.float32(1.0))


def test_unsupported_operand_types_do_not_compile():
    x16 = np.ones((2, 2), np.float16)
    x32 = np.ones((2, 2), np.float32)
    for a, b, c in ((x16, x16, x16), (x32, x32, x32.astype(np.float64))):
        with pytest.raises(TypingError):
            gemm(a, b, c, False, False, 1.0, 0.0)


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
