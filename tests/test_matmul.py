"""numbafa.kernels.matmul: the one matmul seam (sgemm, dgemm; oneDNN's sgemm and bf16 GEMM; the
row sums' gemv) on row-major tiles."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numba.core.errors import TypingError

from numbafa.platform import onednn
from numbafa.compiler.jit import jit
from numbafa.kernels.bundles import Gemm
from numbafa.kernels.loops import tile_operand
from numbafa.kernels.matmul import any_layout, bits_operand, gemm as seam, row_of, row_sums, values_operand

#: dnnl_sgemm runs on any x86-64 CPU where the library loads (the oneDNN path can be forced there).
needs_onednn = pytest.mark.skipif(not onednn.load_library(), reason="oneDNN is not installed here")
#: dnnl_gemm_bf16bf16f32 needs bf16 units oneDNN may use.
needs_bf16_units = pytest.mark.skipif(not onednn.bf16_units(), reason="no bf16 units oneDNN can use here")


#: Each path's :class:`Gemm` record, as make_plan builds it for float32 inputs.
PATHS = {"blas": Gemm(onednn=False, bits=False, onednn_max_mnk=-1),
         "onednn": Gemm(onednn=True, bits=False, onednn_max_mnk=-1),
         "mixed": Gemm(onednn=False, bits=False, onednn_max_mnk=onednn.SMALL_SGEMM)}


@jit(entry=True)
def gemm_on(a, b, c, trans_a, trans_b, alpha, beta, path):
    """The seam is only callable from njit code; this is the tests' way in (``path``: a
    :data:`PATHS` record; oneDNN's only where :func:`onednn.load_library` loaded it)."""
    none = np.empty((0, 0), np.uint16)
    seam(values_operand(a, none), values_operand(b, none), c, trans_a, trans_b, alpha, beta, path)


def gemm(a, b, c, trans_a, trans_b, alpha, beta):
    """The BLAS path."""
    gemm_on(a, b, c, trans_a, trans_b, alpha, beta, PATHS["blas"])


def gemm_onednn(a, b, c, trans_a, trans_b, alpha, beta):
    """The oneDNN path."""
    gemm_on(a, b, c, trans_a, trans_b, alpha, beta, PATHS["onednn"])


@jit(entry=True)
def gemm_bits(a, b, c, trans_a, trans_b, alpha, beta, bits):
    """bf16 bits as operands: on the bf16 path (``bits``) oneDNN's bf16 GEMM; else the values are
    read, which bits-only operands do not have."""
    none = np.empty((0, 0), np.float32)
    seam(bits_operand(a, none), bits_operand(b, none), c, trans_a, trans_b, alpha, beta,
         Gemm(onednn=True, bits=bits, onednn_max_mnk=-1))


@jit(entry=True)
def sums(a, b, c):
    row_sums(a, b, c)


def _operand(rng, shape, transposed, dtype=np.float32):
    return rng.standard_normal(shape[::-1] if transposed else shape).astype(dtype)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (0.375, 1.0), (-2.0, 0.5)])
@pytest.mark.parametrize("dtype, atol, path", [
    (np.float32, 1e-4, "blas"), (np.float64, 1e-12, "blas"),
    pytest.param(np.float32, 1e-4, "onednn", marks=needs_onednn)])
def test_matches_float64_product(trans_a, trans_b, alpha, beta, dtype, atol, path):
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
    (gemm_onednn if path == "onednn" else gemm)(a, b, c, trans_a, trans_b, dtype(alpha), dtype(beta))
    # Accumulation over k = 53 terms of size ~1: float32 error << 1e-4 of the result's
    # scale (53 * 2^-24 * |terms| ~ 1e-5), float64 << 1e-12.
    np.testing.assert_allclose(c, expected, rtol=0, atol=atol * np.abs(expected).max())


def test_row_sums_are_np_dot():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((31, 45)).astype(np.float32)
    b = rng.standard_normal(45).astype(np.float32)
    c = np.full(31, np.nan, np.float32)
    sums(a, b, c)
    np.testing.assert_array_equal(c, np.dot(a, b))


def test_unsupported_operand_types_do_not_compile():
    x16 = np.ones((2, 2), np.int16)
    x32 = np.ones((2, 2), np.float32)
    for a, b, c in ((x16, x16, x16), (x32, x32, x32.astype(np.float64))):
        with pytest.raises(TypingError):
            gemm(a, b, c, False, False, 1.0, 0.0)


@pytest.mark.parametrize("path", ["blas", pytest.param("onednn", marks=needs_onednn)])
def test_views_with_row_strides_and_offsets_touch_only_their_elements(path):
    rng = np.random.default_rng(1)
    big_a = rng.standard_normal((40, 70)).astype(np.float32)
    big_b = rng.standard_normal((60, 50)).astype(np.float32)
    big_c = rng.standard_normal((30, 90)).astype(np.float32)
    a = big_a[5:25, 10:42]        # [20, 32], row stride 70
    b = big_b[3:35, 7:31]         # [32, 24], row stride 50
    c = big_c[4:24, 11:35]        # [20, 24], row stride 90
    before = big_c.copy()
    expected = a.astype(np.float64) @ b + c
    (gemm_onednn if path == "onednn" else gemm)(a, b, c, False, False, np.float32(1.0), np.float32(1.0))
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


@needs_onednn
@pytest.mark.parametrize("trans_a", [False, True])
def test_the_mixed_path_gives_gemms_up_to_its_size_to_onednn_and_larger_ones_to_blas(trans_a):
    """The mixed path's float32 GEMM of ``m * n * k <= SMALL_SGEMM`` multiply-adds has
    dnnl_sgemm's bits, a larger one BLAS's, and an empty one is BLAS's no-op. The contraction
    is long (8192 terms: both libraries split it into blocks of their own) so that the two
    libraries' bits differ; where they still agree the bits cannot tell the libraries apart
    (``test_onednn.py`` checks the routing by oneDNN's own log on every CPU)."""
    rng = np.random.default_rng(4)
    m, n = 16, 16
    boundary = onednn.SMALL_SGEMM // (m * n)
    for k, expected in ((boundary, "onednn"), (boundary + 1, "blas")):
        a = _operand(rng, (m, k), trans_a)
        b = _operand(rng, (k, n), False)
        out = {}
        for path in ("blas", "onednn", "mixed"):
            out[path] = np.full((m, n), np.nan, np.float32)
            gemm_on(a, b, out[path], trans_a, False, np.float32(1.0), np.float32(0.0), PATHS[path])
        if np.array_equal(out["blas"], out["onednn"]):
            pytest.skip(f"OpenBLAS and oneDNN give the same bits here for k = {k}")
        np.testing.assert_array_equal(out["mixed"], out[expected], err_msg=f"k={k}")
    c = np.full((3, 4), 2.0, np.float32)
    gemm_on(np.empty((3, 0), np.float32), np.empty((0, 4), np.float32), c, False, False,
            np.float32(1.0), np.float32(0.5), PATHS["mixed"])
    np.testing.assert_array_equal(c, 1.0)


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="shapes"):
        gemm(np.ones((3, 5), np.float32), np.ones((4, 2), np.float32), np.ones((3, 2), np.float32),
             False, False, np.float32(1.0), np.float32(0.0))


@needs_bf16_units
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_bf16_operands_on_onednn_are_exact_products_summed_in_float32(trans_a, trans_b):
    """bf16 x bf16 products are exact in float32; only the float32 summation order differs from
    a float64 sum of them: |error| <= gamma_k * sum|a||b| (k = 53, gamma_k ~ 53 * 2^-24)."""
    rng = np.random.default_rng(3)
    m, n, k = 37, 29, 53
    a = _operand(rng, (m, k), trans_a).astype(ml_dtypes.bfloat16)
    b = _operand(rng, (k, n), trans_b).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((m, n)).astype(np.float32)
    a64 = (a.T if trans_a else a).astype(np.float64)
    b64 = (b.T if trans_b else b).astype(np.float64)
    expected = 0.5 * (a64 @ b64) + c
    bound = 2 * (k + 1) * 2.0 ** -24 * (0.5 * (np.abs(a64) @ np.abs(b64)) + np.abs(c))
    gemm_bits(a.view(np.uint16), b.view(np.uint16), c, trans_a, trans_b, np.float32(0.5), np.float32(1.0), True)
    assert (np.abs(c - expected) <= bound).all()


def test_bf16_operands_need_the_bf16_path():
    """Bits-only operands on a float32 path: the values are read, and there are none -- an error,
    not a silent reinterpretation of the bits."""
    bits = np.ones((2, 2), np.uint16)
    with pytest.raises(ValueError, match="shapes"):
        gemm_bits(bits, bits, np.zeros((2, 2), np.float32), False, False, np.float32(1.0), np.float32(0.0), False)


@jit(entry=True)
def _bits_of_rows(t, out):
    """loops.tile_operand's bits of a tile typed as any layout (its rows through matmul.row_of)."""
    rows, cols = t.shape
    op = tile_operand(any_layout(t), out, np.empty((0, 0), np.float32), np.empty((0, 0), np.uint16), True)
    return op.bits.copy(), row_of(any_layout(t), rows - 1).copy()


def test_a_tiles_rows_of_any_layout_are_read_as_its_rows():
    """``row_of`` views row ``i`` of a strided tile (unit inner stride) as a contiguous array;
    tile_operand writes each row's bf16 bits through it: a row, or a stride, out of place fails."""
    wide = (np.arange(6 * 40, dtype=np.float32).reshape(6, 40) - 100.0) * np.float32(0.5)   # bf16-exact values
    t = wide[1:5, 3:35]                      # rows 40 apart, 32 wide
    bits, last = _bits_of_rows(t, np.zeros(4 * 32 + 8, np.uint16))
    np.testing.assert_array_equal(bits, t.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(last, t[3])
