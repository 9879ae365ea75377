"""Layout helpers: round trips, lse packing, cu_seqlens and the CTE checkpoint."""

from __future__ import annotations

import re

import numpy as np
import pytest

import numbafa
from numbafa import golden, layout

from _problems import bounds_from_lengths


@pytest.mark.parametrize("name,shape", [("bshd", (2, 5, 3, 4)), ("bhsd", (2, 3, 5, 4)), ("neuron", (2, 3, 4, 5))])
def test_to_and_from_neuron_round_trip(name, shape):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    n = layout.to_neuron(x, name)
    assert n.shape == (2, 3, 4, 5)                 # [b, h, d, s]
    assert np.shares_memory(n, x)                   # a view, not a copy
    np.testing.assert_array_equal(layout.from_neuron(n, name), x)


def test_bshd_element_mapping():
    x = np.random.default_rng(0).standard_normal((2, 7, 3, 5))   # [b, s, h, d]
    n = layout.to_neuron(x, "bshd")
    assert n[1, 2, 4, 6] == x[1, 6, 2, 4]


def test_bad_layout_and_shapes():
    with pytest.raises(ValueError, match="layout must be one of \\('neuron', 'bshd', 'bhsd'\\), got 'sbhd'"):
        layout.to_neuron(np.zeros((1, 1, 1, 1)), "sbhd")
    with pytest.raises(ValueError, match="x must be 4-D \\[batch, heads, head_dim, seq\\], got shape \\(1, 1, 1\\)"):
        layout.from_neuron(np.zeros((1, 1, 1)), "bshd")
    with pytest.raises(ValueError, match="^q must be 4-D \\[batch, heads, seq, head_dim\\] for layout='bhsd', got "
                                         "shape \\(1, 1, 1\\)$"):
        layout.to_neuron(np.zeros((1, 1, 1)), "bhsd", name="q")
    with pytest.raises(TypeError, match="x must be a numpy.ndarray, got list"):
        layout.to_neuron([1, 2], "bshd")


def test_lse_layout_round_trip():
    natural = np.random.default_rng(1).standard_normal((2, 3, 384)).astype(np.float32)
    neuron = layout.lse_to_neuron(natural)
    assert neuron.shape == (2, 3, 128, 3)
    assert neuron[1, 2, 5, 2] == natural[1, 2, 2 * 128 + 5]
    np.testing.assert_array_equal(layout.lse_to_natural(neuron), natural)
    with pytest.raises(ValueError, match="needs seq divisible by 128, got seq=100"):
        layout.lse_to_neuron(natural[..., :100])
    with pytest.raises(ValueError, match="lse must be \\[bs, heads, 128, seq // 128\\]"):
        layout.lse_to_natural(natural)


def test_cu_seqlens_to_bounds():
    bmin, bmax = layout.cu_seqlens_to_bounds(np.array([0, 127, 256, 511, 1024]))
    emin, emax = bounds_from_lengths((127, 129, 255, 513))
    np.testing.assert_array_equal(bmin, emin)
    np.testing.assert_array_equal(bmax, emax)
    assert bmin.dtype == bmax.dtype == np.float32
    # Padding rows after the last sequence attend to nothing.
    bmin, bmax = layout.cu_seqlens_to_bounds(np.array([0, 3]), seqlen=5)
    np.testing.assert_array_equal(bmin, [0, 0, 0, 0, 0])
    np.testing.assert_array_equal(bmax, [3, 3, 3, 0, 0])


@pytest.mark.parametrize("cu,kw,message", [
    (np.array([1, 3]), {}, "must start at 0 and be non-decreasing"),
    (np.array([0, 5, 3]), {}, "must start at 0 and be non-decreasing"),
    (np.array([0.0, 3.0]), {}, "must be a 1-D integer array"),
    (np.array([0, 3]), {"seqlen": 2}, "seqlen must be >= cu_seqlens\\[-1\\] = 3, got 2"),
    # Unsigned arrays: np.diff wraps around, the order check must not rely on it.
    (np.array([0, 5, 3], np.uint32), {}, "must start at 0 and be non-decreasing, got \\[0, 5, 3\\]"),
    (np.array([0, 5, 3], np.uint64), {}, "must start at 0 and be non-decreasing"),
    (np.array([0, 2 ** 63 + 5], np.uint64), {}, "cu_seqlens\\[-1\\] must be <= 2\\*\\*24 = 16777216"),
    (np.array([0, 3]), {"seqlen": 2 ** 24 + 1}, "seqlen must be <= 2\\*\\*24 = 16777216 \\(float32 bounds"),
])
def test_cu_seqlens_errors(cu, kw, message):
    with pytest.raises(ValueError, match=message):
        layout.cu_seqlens_to_bounds(cu, **kw)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int32, np.int64])
def test_cu_seqlens_any_integer_dtype(dtype):
    bmin, bmax = layout.cu_seqlens_to_bounds(np.array([0, 3, 3, 7], dtype), seqlen=np.int64(9))
    np.testing.assert_array_equal(bmin, [0, 0, 0, 3, 3, 3, 3, 0, 0])
    np.testing.assert_array_equal(bmax, [3, 3, 3, 7, 7, 7, 7, 0, 0])


@pytest.mark.parametrize("seqlen,message", [
    (5.7, "seqlen must be an int or None, got float 5.7"),
    (5.0, "seqlen must be an int or None, got float 5.0"),
    (True, "seqlen must be an int or None, got bool True"),
    ("5", "seqlen must be an int or None, got str '5'"),
])
def test_cu_seqlens_seqlen_must_be_an_int(seqlen, message):
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        layout.cu_seqlens_to_bounds(np.array([0, 3]), seqlen=seqlen)


def test_packed_attention_equals_separate_attention():
    """cu_seqlens bounds make one packed call equal to per-sequence calls."""
    rng = np.random.default_rng(2)
    lengths = (100, 156)
    q, k, v = (rng.standard_normal((1, 2, 16, 256)).astype(np.float32) for _ in range(3))
    bmin, bmax = layout.cu_seqlens_to_bounds(np.cumsum((0,) + lengths))
    o, lse = numbafa.attention_fwd(q, k, v, bound_min=bmin, bound_max=bmax, use_causal_mask=True)
    o0, _ = numbafa.attention_fwd(q[..., :100], k[..., :100], v[..., :100], use_causal_mask=True,
                                  lse_layout="natural")
    np.testing.assert_allclose(o[..., :100], o0, rtol=1e-5, atol=1e-6)


def test_lse_from_cte():
    rng = np.random.default_rng(3)
    s = rng.standard_normal((2, 40))
    row_max = s.max(axis=1)
    row_sum = np.exp(s - row_max[:, None]).sum(axis=1)
    lse = layout.lse_from_cte(-row_max, 1 / row_sum)
    expected = np.log(np.exp(s).sum(axis=1))
    np.testing.assert_allclose(lse, expected, rtol=1e-6)
    assert lse.dtype == np.float32
    with pytest.raises(ValueError, match="same shape"):
        layout.lse_from_cte(np.zeros(3), np.ones(4))


def test_golden_forward_agrees_with_layout_helper():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 1, 8, 256)) for _ in range(3))
    _, natural = golden.attention_fwd(q, k, v)
    _, neuron = golden.attention_fwd(q, k, v, lse_layout="neuron")
    np.testing.assert_array_equal(layout.lse_to_neuron(natural), neuron)


@pytest.mark.parametrize("neg_max,sum_recip,message", [
    ([0.0, 1.0], [0.5, -0.25], "sum_recip must be >= 0 (a reciprocal row sum), got 1 negative element(s), e.g. -0.25"),
    ([np.nan, 1.0], [0.5, 0.5], "neg_max must not contain NaN, got 1 NaN element(s)"),
    ([0.0, 1.0], [np.nan, 0.5], "sum_recip must not contain NaN, got 1 NaN element(s)"),
    # +inf + log(0) = inf - inf: no lse exists for that pair.
    ([np.inf, 1.0], [0.0, 0.5], "neg_max = +inf with sum_recip = 0 has no lse (inf - inf), at 1 element(s)"),
])
def test_lse_from_cte_rejects_what_has_no_lse(neg_max, sum_recip, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layout.lse_from_cte(np.array(neg_max), np.array(sum_recip))


def test_lse_from_cte_keeps_empty_rows():
    """sum_recip = 0 still gives lse = +inf (the backward's "attends to nothing" marker)."""
    lse = layout.lse_from_cte(np.array([3.0, -1.0]), np.array([0.0, 1.0]))
    np.testing.assert_array_equal(lse, [np.inf, 1.0])


# ---------------------------------------------------------------------------
# The kernels run in the caller's layout (numbafa.kernels.heads)
# ---------------------------------------------------------------------------

def _in(name, b, h, s, d):
    return (b, s, h, d) if name == "bshd" else (b, h, s, d)


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


LAYOUT_CASES = [
    # (b, h, h_kv, s_q, s_k, d, d_v, dtypes, options)
    (1, 2, 1, 256, 256, 32, 32, ("float32", "bfloat16", "float16", "float64"), dict(use_causal_mask=True)),
    (2, 4, 2, 200, 300, 16, 24, ("float32", "bfloat16"), dict(dropout_p=0.2, seed=3, softcap=5.0)),
    # one unit on two threads (its query tiles split), two KV sections (4096 keys each at d 256)
    (1, 1, 1, 640, 4608, 256, 256, ("float32",), dict(softmax_scale=0.2)),
    # split units whose keys and head dims are not multiples of 8 (the s-major partial sums'
    # edges): a short causal one in 64-row Q groups, and an unmasked one, whose second item's
    # rows see the last keys too
    (1, 3, 1, 203, 203, 20, 12, ("float32",), dict(use_causal_mask=True)),
    (1, 2, 1, 261, 261, 20, 12, ("float32",), {}),
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=["gqa-causal", "ragged-variants", "split-sections",
                                                    "split-short-causal", "split-ragged"])
@pytest.mark.parametrize("name", ["bshd", "bhsd"])
def test_caller_layouts_give_the_neuron_layouts_bits_without_copies(case, name):
    """numbafa.attention in bshd/bhsd runs the kernels on the caller's arrays (no layout copy): o,
    lse and every gradient are bit for bit the Neuron-layout API's on transposed copies, and o and
    the gradients come back C-contiguous in the caller's layout."""
    import ml_dtypes
    b, h, h_kv, s_q, s_k, d, d_v, dtypes, options = case
    rng = np.random.default_rng(11)
    for dtype in dtypes:
        dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        q, k, v, do = (rng.standard_normal(_in(name, *shape)).astype(dt) for shape in
                       ((b, h, s_q, d), (b, h_kv, s_k, d), (b, h_kv, s_k, d_v), (b, h, s_q, d_v)))
        sinks = rng.standard_normal(h).astype(np.float32)
        o, ctx = numbafa.attention(q, k, v, sinks=sinks, layout=name, **options)
        grads = ctx.backward(do)
        qn, kn, vn, don = (np.ascontiguousarray(layout.to_neuron(x, name)) for x in (q, k, v, do))
        o_ref, lse_ref = numbafa.attention_fwd(qn, kn, vn, sinks, lse_layout="natural", **options)
        refs = numbafa.attention_bwd(qn, kn, vn, o_ref, don, lse_ref, sinks, **options)
        assert o.flags.c_contiguous and all(g.flags.c_contiguous for g in grads[:3]), dtype
        np.testing.assert_array_equal(_bits(o), _bits(layout.from_neuron(o_ref, name)), err_msg=dtype)
        np.testing.assert_array_equal(ctx.lse, lse_ref, err_msg=dtype)
        for what, got, ref in zip(("dq", "dk", "dv"), grads, refs):
            np.testing.assert_array_equal(_bits(got), _bits(layout.from_neuron(ref, name)), err_msg=f"{dtype} {what}")
        np.testing.assert_array_equal(grads[3], refs[3])


def test_the_neuron_api_takes_transposed_views_without_a_copy():
    """A Neuron-layout view of a bshd array goes to the kernels as it is (no copy) and o comes
    back in the same memory order; a view contiguous in no kernel layout is copied and gives the
    same bits."""
    from numbafa.checks.validation import kernel_layout, validate_fwd_inputs
    from numbafa.checks.options import AttentionOptions
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 128, 2, 32)).astype(np.float32) for _ in range(3))
    qn, kn, vn = (layout.to_neuron(x, "bshd") for x in (q, k, v))
    assert kernel_layout(qn) == 2 and kernel_layout(np.ascontiguousarray(qn)) == 0
    prob = validate_fwd_inputs(qn, kn, vn, AttentionOptions(), any_layout=True)
    assert all(np.shares_memory(a, b) for a, b in ((prob.q, q), (prob.k, k), (prob.v, v)))
    o, lse = numbafa.attention_fwd(qn, kn, vn, use_causal_mask=True)
    assert o.shape == qn.shape and layout.from_neuron(o, "bshd").flags.c_contiguous
    strided = []
    for x in (qn, kn, vn):
        wide = np.zeros(x.shape[:3] + (2 * x.shape[3],), np.float32)
        wide[..., ::2] = x
        strided.append(wide[..., ::2])             # every other column: contiguous in no layout
    assert kernel_layout(strided[0]) == 0 and not strided[0].flags.c_contiguous
    o2, lse2 = numbafa.attention_fwd(*strided, use_causal_mask=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)


@pytest.mark.parametrize("call,message", [
    (lambda: layout.lse_from_cte(None, None), "neg_max must be a real (float or int) array, got NoneType"),
    (lambda: layout.lse_from_cte(np.zeros(2), np.ones(2, np.complex64)),
     "sum_recip must be a real (float or int) array, got dtype complex64"),
    (lambda: layout.lse_from_cte(np.array(["a", "b"]), np.ones(2)),
     "neg_max must be a real (float or int) array, got dtype <U1"),
    (lambda: layout.lse_to_neuron(np.zeros((1, 1, 128), np.int32)),
     "lse must be a floating-point array, got dtype int32"),
    (lambda: layout.lse_to_natural(np.zeros((1, 1, 128, 1), bool)),
     "lse must be a floating-point array, got dtype bool"),
])
def test_lse_helpers_take_real_numbers_only(call, message):
    """None (NaN before), complex (imaginary part dropped with a NumPy warning), strings and an
    integer or bool lse are a TypeError naming the argument."""
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        call()
