"""numbafa.kernels.common and the forward's row max: loads, stores, widening, against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from numbafa.conventions.dtypes import ROUND_BF16, ROUND_FP16, ROUND_NONE
from numbafa.compiler.jit import callable_from_python, jit
from numbafa.kernels import common
from numbafa.kernels.forward import _row_max as _kernel_row_max
from numbafa.kernels.heads import gather_head, load_scaled_rows, store_head_rows
from numbafa.kernels.stored import bits_plugins, input_operand
from numbafa.kernels.table import ensure_plugins

# The kernels' own helpers, compiled with a Python wrapper (kernel code calls them without one).
load_scaled = callable_from_python(common.load_scaled)
store = callable_from_python(common.store)
store_transposed = callable_from_python(common.store_transposed)

SCALE = np.float32(0.0883883)  # 1/sqrt(128), not a power of two: scaling rounds


def _bf16_round(x):
    """float32 -> nearest bf16 (ties to even), as float32; NumPy only."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _source(rng, dtype, shape):
    """A [d, seq] source: float32 values, or the bf16 bits of bf16-exact values."""
    x = _bf16_round(rng.standard_normal(shape).astype(np.float32))
    if dtype == "bf16":
        return x, (x.view(np.uint32) >> 16).astype(np.uint16)
    return x, x


def _rounded(x, code):
    """``x`` rounded to the format ``code`` names, NumPy only."""
    if code == ROUND_BF16:
        return _bf16_round(x)
    if code == ROUND_FP16:
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    return x


def _expected(values, scale, round_kernel):
    if scale == 1.0:
        return values                       # an exact copy, never rounded
    y = (values * scale).astype(np.float32)  # one float32 product, as in the kernel
    return _rounded(y, round_kernel)


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
@pytest.mark.parametrize("scale, round_kernel", [(np.float32(1.0), ROUND_BF16), (SCALE, ROUND_NONE),
                                                 (SCALE, ROUND_BF16), (SCALE, ROUND_FP16)])
@pytest.mark.parametrize("d_head, start, count", [(128, 0, 2048), (64, 37, 201), (5, 3, 17), (128, 5, 0)])
def test_load_scaled_matches_numpy(dtype, scale, round_kernel, d_head, start, count):
    rng = np.random.default_rng(d_head + count)
    values, src = _source(rng, dtype, (d_head, start + count + 7))
    want = _expected(values[:, start:start + count], scale, round_kernel)

    out_s = np.full((d_head, count + 3), np.nan, np.float32)
    load_scaled(src, start, count, out_s, scale, round_kernel)
    np.testing.assert_array_equal(out_s[:, :count], want)
    assert np.isnan(out_s[:, count:]).all()


@pytest.mark.parametrize("round_out", [ROUND_NONE, ROUND_BF16, ROUND_FP16])
@pytest.mark.parametrize("d_head, start, count", [(128, 0, 512), (64, 19, 33), (3, 1, 1)])
def test_store_transposed_matches_numpy(round_out, d_head, start, count):
    rng = np.random.default_rng(count)
    src = rng.standard_normal((count + 2, d_head)).astype(np.float32)
    dst = np.full((d_head, start + count + 4), np.nan, np.float32)
    store_transposed(src, count, dst, start, round_out)
    want = _rounded(src[:count].T, round_out)
    np.testing.assert_array_equal(dst[:, start:start + count], want)
    assert np.isnan(dst[:, :start]).all() and np.isnan(dst[:, start + count:]).all()


@pytest.mark.parametrize("round_out", [ROUND_NONE, ROUND_BF16, ROUND_FP16])
@pytest.mark.parametrize("d_head, start, count", [(128, 0, 512), (64, 19, 33), (3, 1, 1), (4, 2, 0)])
def test_store_matches_numpy(round_out, d_head, start, count):
    """dQ's store: ``[d, rows]`` (a column slice of a wider tile) into ``[d, seq]``, same layout."""
    rng = np.random.default_rng(count + 1)
    wide = rng.standard_normal((d_head, count + 5)).astype(np.float32)
    src = wide[:, :count + 2]
    dst = np.full((d_head, start + count + 4), np.nan, np.float32)
    store(src, count, dst, start, round_out)
    want = _rounded(src[:, :count], round_out)
    np.testing.assert_array_equal(dst[:, start:start + count], want)
    assert np.isnan(dst[:, :start]).all() and np.isnan(dst[:, start + count:]).all()


@jit(entry=True)
def _operand_of(values, bits, is_bits, plan):
    op = input_operand(values, bits, is_bits, plan, np.empty((0, 0), np.float32), np.empty((0, 0), np.uint16))
    x = bits.ctypes.data if is_bits else values.ctypes.data
    return op.f.copy(), op.bits.copy(), op.f.ctypes.data == x or op.bits.ctypes.data == x


def _operand_of_input(x, plan):
    """:func:`numbafa.kernels.stored.input_operand` of a float32 array or of bf16 bits (the other
    member empty, as in a :data:`~numbafa.kernels.stored.Stored` record)."""
    if x.dtype == np.uint16:
        return _operand_of(np.empty((0, 0), np.float32), x, True, plan)
    return _operand_of(x, np.empty((0, 0), np.uint16), False, plan)


def test_input_operands_are_views_but_bf16_bits_widened_for_float32_gemms():
    """float32 inputs are their own operand; bf16 bits are too on the bf16 path (``plan.gemm.bits``),
    and are widened into a float32 copy on the others (the plugin ``widen_bits``)."""
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs
    from numbafa.kernels.bundles import make_plan
    x = np.ones((1, 1, 8, 128), np.float32)
    ensure_plugins(bits_plugins(make_plan(validate_fwd_inputs(x, x, x, AttentionOptions()), backward=False)))
    from collections import namedtuple
    Gemm, Plan = namedtuple("Gemm", ["onednn", "bits"]), namedtuple("P", ["gemm"])
    rng = np.random.default_rng(3)
    values, bits = _source(rng, "bf16", (6, 9))
    f, b, same = _operand_of_input(values, Plan(Gemm(False, False)))
    assert same and b.size == 0
    np.testing.assert_array_equal(f, values)
    f, b, same = _operand_of_input(bits, Plan(Gemm(True, True)))
    assert same and f.size == 0
    np.testing.assert_array_equal(b, bits)
    f, b, same = _operand_of_input(bits, Plan(Gemm(False, False)))
    assert not same and b.size == 0 and f.dtype == np.float32
    np.testing.assert_array_equal(f, values)


@jit(entry=True)
def _row_max(x):
    return _kernel_row_max(x)


@jit(entry=True)
def _row_max_of_slice(x, lo, hi):
    return _kernel_row_max(x[lo:hi])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("values", [
    [3.0, -1.0, 2.5], [-0.5, -3.0], [-np.inf, -3.0], [-np.inf], [-3.4e38, -np.inf],
    [1e-45, -1e-45], [-1e-45, -2e-45], [np.inf, 1.0], [0.0], [-7.0] * 33,
])
def test_row_max_matches_numpy(values, dtype):
    x = np.asarray(values, dtype)
    assert _row_max(x) == np.max(x)
    assert _row_max_of_slice(np.concatenate([[9.0], x, [9.0]]).astype(dtype), 1, x.size + 1) == np.max(x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_max_of_random_rows_and_empty(dtype):
    rng = np.random.default_rng(4)
    for n in (1, 7, 8, 9, 512, 1000):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30)).astype(dtype)
        assert _row_max(x) == np.max(x)
        assert _row_max(-np.abs(x)) == np.max(-np.abs(x))
    assert _row_max(np.empty(0, dtype)) == -np.inf


# --- the s-major layouts' transposes (numbafa.kernels.heads): 8 x 8 vector blocks and the rest ---

@jit()
def _gather(rows, col0, d, start, count, out, by_band):
    gather_head((rows, col0, d), start, count, out, by_band)


@jit()
def _load_scaled_rows(rows, col0, d, start, count, out, scale):
    load_scaled_rows((rows, col0, d), start, count, out, scale, ROUND_NONE)


@jit()
def _store_head_rows(src, count, rows, col0, d, start):
    store_head_rows(src, count, (rows, col0, d), start, ROUND_NONE)


@pytest.mark.parametrize("dtype", ["float32", "float64", "uint16"])
@pytest.mark.parametrize("d, count", [(32, 256), (20, 37), (8, 8), (7, 5), (48, 129)])
def test_head_transposes_are_exact_in_every_dtype_and_size(dtype, d, count):
    """Rows ``start:start + count`` of a bshd-like head (three heads per row, the middle one)
    transposed to ``[d, count]`` and back, whole 8 x 8 blocks and the remainders alike; bf16
    bits (uint16) kept as bits by the gather and widened to float32 by the scaled load."""
    rng = np.random.default_rng(d * 1000 + count)
    start, heads = 3, 3
    rows = (rng.standard_normal((start + count + 2, heads * d)) * 100).astype(np.float32)
    if dtype == "uint16":
        rows = rows.view(np.uint16)[:, ::2].copy()       # the float32 values' upper halves: bf16 bits
    else:
        rows = rows.astype(dtype)
    head = rows[start:start + count, d:2 * d]
    for by_band in (False, True):   # the loads' order and the stores' (bands of the [d, seq] side)
        out = np.zeros((d, count + 3), dtype=rows.dtype)
        callable_from_python(_gather)(rows, d, d, start, count, out, by_band)
        np.testing.assert_array_equal(out[:, :count], head.T)
        assert not out[:, count:].any()
    if dtype != "float64":
        values = np.zeros((d, count), np.float32)
        callable_from_python(_load_scaled_rows)(rows, d, d, start, count, values, np.float32(1.0))
        widened = ((head.astype(np.uint32) << 16).view(np.float32) if dtype == "uint16" else head)
        np.testing.assert_array_equal(values, widened.T)
    if dtype != "uint16":
        back = np.zeros_like(rows)
        callable_from_python(_store_head_rows)(np.ascontiguousarray(head.T), count, back, d, d, start)
        np.testing.assert_array_equal(back[start:start + count, d:2 * d], head)
        back[start:start + count, d:2 * d] = 0
        assert not back.any()
