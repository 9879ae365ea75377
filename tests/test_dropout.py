"""Attention dropout: the generator, the mask, the exact gradient, the kernels against the goldens."""

from __future__ import annotations

import math

import ml_dtypes
import numba
import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.compiler.jit import callable_from_python
from numbafa.kernels import dropout as _dropout
from numbafa.kernels.dropout import drop_rows, make_dropout, with_origin
from numbafa.kernels.mask import TilePos

fill_multipliers = callable_from_python(_dropout.fill_multipliers)
philox_words = callable_from_python(_dropout.philox_words)

from _budget import rounded_with_budget
from _problems import Case, forward_options, make_inputs
from _tolerances import BF16_MIXED, FLOAT32, MIN_IDENTICAL, assert_close
from test_bf16 import faithfulness

BF16 = ml_dtypes.bfloat16

#: Random123's known-answer vectors (kat_vectors): counter (4 words), key (2), output (4).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_both_generators_give_the_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox_words(*counter, *key)) == expected
    assert tuple(int(w) for w in golden.philox(counter, key)) == expected


@pytest.mark.parametrize("seed, offset", [(0, 0), (12345, 7), (2 ** 64 - 1, 2 ** 64 - 1)])
def test_kernel_mask_equals_the_golden_mask(seed, offset):
    got = numbafa.dropout_mask(2, 3, 130, 70, 0.3, seed, offset)
    np.testing.assert_array_equal(got, golden.keep_mask(2, 3, 130, 70, 0.3, seed, offset))


@pytest.mark.parametrize("keys_major", [True, False], ids=["bwd-tiles", "fwd-tiles"])
def test_any_sub_tile_draws_the_same_elements(keys_major):
    """The kernels draw per block at arbitrary (key, query) origins; each block is a slice of the mask."""
    mask = numbafa.dropout_mask(2, 2, 300, 300, 0.25, 99, 3)
    dropout = make_dropout(0.25, 99, 3)
    rng = np.random.default_rng(0)
    for _ in range(40):
        k0, q0 = (int(x) for x in rng.integers(0, 290, 2))
        n_k, n_q = int(rng.integers(0, 300 - k0)), int(rng.integers(1, 300 - q0))
        b, h = (int(x) for x in rng.integers(0, 2, 2))
        if keys_major:
            out = np.full((n_k, n_q), np.nan, np.float32)
            fill_multipliers(out, TilePos(batch=b, q_head=h, q0=q0, k0=k0), dropout)
        else:
            out = np.ones((n_q, n_k), np.float32)
            drop_rows(out, TilePos(batch=b, q_head=h, q0=q0, k0=k0), dropout, False)
        kept = (out.T if keys_major else out) != 0
        assert not np.isnan(out).any()
        np.testing.assert_array_equal(kept, mask[b, h, q0:q0 + n_q, k0:k0 + n_k], err_msg=str((k0, n_k, q0, n_q)))
        assert set(np.unique(out)) <= {0.0, np.float32(1 / 0.75)}


@pytest.mark.parametrize("keys_major", [True, False], ids=["bwd-tiles", "fwd-tiles"])
def test_arrays_of_a_slice_draw_the_whole_mask_at_their_origin(keys_major):
    """Batch ``b`` / head ``h`` of arrays starting at batch0 / head0 (a share in
    numbafa.pipeline.shards) draw the mask of the absolute batch0 + b / head0 + h; the default origin
    is (0, 0) and another origin draws another mask."""
    mask = numbafa.dropout_mask(3, 5, 70, 130, 0.25, 99, 3)
    dropout = make_dropout(0.25, 99, 3)
    assert (dropout.batch0, dropout.head0) == (0, 0)
    assert not with_origin(make_dropout(0.0, 99, 3), 1, 2).active   # no dropout stays none

    def draw(d, b, h):
        if keys_major:
            out = np.empty((130, 70), np.float32)
            fill_multipliers(out, TilePos(batch=b, q_head=h, q0=0, k0=0), d)
            return out.T != 0
        out = np.ones((70, 130), np.float32)
        drop_rows(out, TilePos(batch=b, q_head=h, q0=0, k0=0), d, False)
        return out != 0
    for (b0, h0), (b, h) in [((2, 3), (0, 0)), ((1, 2), (1, 1)), ((0, 4), (2, 0))]:
        np.testing.assert_array_equal(draw(with_origin(dropout, b0, h0), b, h), mask[b0 + b, h0 + h])
    assert (draw(dropout, 0, 0) != mask[2, 3]).any()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_within_binomial_bounds(p):
    """n = 4.2M Bernoulli(1 - p) draws: the kept fraction is within 6 standard deviations
    (a false alarm once in 5e8 runs); so is the fraction of elements two offsets agree on."""
    n_shape = (2, 4, 512, 1024)
    n = math.prod(n_shape)
    z = numbafa.dropout_mask(*n_shape, p, 2024, 0)
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(z.mean() - (1 - p)) <= 6 * sd, z.mean()
    z2 = numbafa.dropout_mask(*n_shape, p, 2024, 1)
    agree = (1 - p) ** 2 + p ** 2
    assert abs((z == z2).mean() - agree) <= 6 * math.sqrt(agree * (1 - agree) / n)
    # Neighbouring keys (the 4 words of one Philox call) and rows are not correlated.
    for a, b in ((z[..., :-1], z[..., 1:]), (z[:, :, :-1], z[:, :, 1:])):
        both = (a & b).mean()
        m = a.size
        assert abs(both - (1 - p) ** 2) <= 6 * math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / m)


def test_masks_depend_on_seed_and_offset_only():
    z = numbafa.dropout_mask(1, 2, 64, 64, 0.5, 1, 0)
    np.testing.assert_array_equal(z, numbafa.dropout_mask(1, 2, 64, 64, 0.5, 1, 0))
    assert (z != numbafa.dropout_mask(1, 2, 64, 64, 0.5, 2, 0)).mean() > 0.3
    assert (z != numbafa.dropout_mask(1, 2, 64, 64, 0.5, 1, 1)).mean() > 0.3
    # A larger problem holds the smaller one's mask: independent of the shape.
    np.testing.assert_array_equal(z, numbafa.dropout_mask(2, 3, 100, 90, 0.5, 1, 0)[:1, :2, :64, :64])
    assert numbafa.dropout_mask(1, 1, 8, 8, 0.0, 5).all()


# --------------------------------------------------------------------------
# The gradient: finite differences of the float64 golden with the mask fixed
# --------------------------------------------------------------------------

def _twin_bwd(q, k, v, dy, keep, p_drop, scale):
    """The reference twin's backward (one head, no sinks): ``dS = P~ * (dP~ - D)``."""
    s = (q * scale).T @ k
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p_t = p * keep / (1 - p_drop)
    o = v @ p_t.T
    d = (o * dy).sum(axis=0)[:, None]
    ds = p_t * (dy.T @ v - d)
    return (ds @ k.T).T * scale


def _loss(q, k, v, sinks, dy, keep, p_drop, opts):
    o, _ = golden.attention_fwd(q, k, v, sinks=sinks, dropout_p=p_drop, keep=keep, **opts)
    return float((o * dy).sum())


def _finite_differences(x, f, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        up = f()
        x[idx] = old - h
        g[idx] = (up - f()) / (2 * h)
        x[idx] = old
    return g


def test_golden_gradient_matches_finite_differences_and_the_twins_does_not():
    rng = np.random.default_rng(3)
    q, dy = (rng.standard_normal((1, 2, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 4, 8)) for _ in range(2))
    sinks = rng.standard_normal((1, 2))
    p_drop, opts = 0.3, dict(use_causal_mask=True)
    keep = golden.keep_mask(1, 2, 8, 8, p_drop, 11)
    assert 0 < keep.mean() < 1
    grads = golden.attention_bwd(q, k, v, None, dy, None, sinks_ref=sinks, dropout_p=p_drop, keep=keep, **opts)
    f = lambda: _loss(q, k, v, sinks, dy, keep, p_drop, opts)  # noqa: E731
    for name, x, g in zip(("dq", "dk", "dv", "dsinks"), (q, k, v, sinks), grads):
        fd = _finite_differences(x, f)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=name)
    # The twin's fused formula on the dropped P is not the gradient of its forward.
    q1, k1, v1, dy1 = q[0, :1], k[0, :1], v[0, :1], dy[0, :1]
    keep1 = keep[:, :1]
    fd = _finite_differences(q1, lambda: _loss(q1[None], k1[None], v1[None], None, dy1[None], keep1, p_drop, {}))
    twin = _twin_bwd(q1[0], k1[0], v1[0], dy1[0], keep1[0, 0], p_drop, 0.5)
    ours = golden.attention_bwd(q1[None], k1[None], v1[None], None, dy1[None], None, dropout_p=p_drop,
                                keep=keep1)[0][0]
    np.testing.assert_allclose(ours, fd, rtol=1e-6, atol=1e-8)
    assert np.abs(twin - fd).max() > 1e-2 * np.abs(fd).max()


# --------------------------------------------------------------------------
# The kernels against the goldens
# --------------------------------------------------------------------------

DROP = dict(dropout_p=0.2, seed=20261203, seed_offset=5)

DROPOUT_CASES = [
    ("mha", Case(seqlen_q=256, seqlen_k=256)),
    ("gqa-causal-sinks", Case(nheads=4, nheads_kv=2, causal=True, num_sinks=1, seqlen_q=384, seqlen_k=384)),
    ("mqa-split", Case(nheads=3, nheads_kv=1, seqlen_q=640, seqlen_k=640, causal=True)),  # q_chunks 2
    ("window-packing", Case(packing=(127, 129, 255, 113), seqlen_q=624, seqlen_k=624, causal=True,
                            window=100)),
    ("ragged", Case(seqlen_q=97, seqlen_k=203, d_head=40)),
    ("2-sections", Case(nheads=1, nheads_kv=1, d_head=256, seqlen_q=130, seqlen_k=4200)),
    ("mqa-split-dv", Case(nheads=3, nheads_kv=1, d_head=48, d_head_v=80, seqlen_q=640, seqlen_k=640, causal=True)),
]


def dropout_inputs(case, dtype, drop=DROP):
    """``make_inputs`` with o (and lse) from the float64 golden forward *with* dropout."""
    inputs = make_inputs(case, dtype)
    kw = {key: inputs.get(key) for key in ("bound_min", "bound_max")}
    o, lse = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], sinks=inputs.get("sinks_ref"),
                                  use_causal_mask=case.causal, softmax_scale=case.softmax_scale,
                                  sliding_window=case.window, **kw, **drop)
    inputs.update(o_ref=o.astype(dtype), lse_ref=lse.astype(np.float32))
    return inputs, o, lse


def _fwd_args(inputs):
    return dict(q_ref=inputs["q_ref"], k_ref=inputs["k_ref"], v_ref=inputs["v_ref"], **forward_options(inputs))


@pytest.mark.parametrize("case", [c for _, c in DROPOUT_CASES], ids=[i for i, _ in DROPOUT_CASES])
def test_float32_forward_and_backward_match_the_golden(case):
    inputs, o_exp, lse_exp = dropout_inputs(case, np.float32)
    o, lse = numbafa.attention_fwd(**_fwd_args(inputs), lse_layout="natural", **DROP)
    assert_close(o, o_exp, FLOAT32, "o")
    assert_close(lse, lse_exp, FLOAT32, "lse")
    got = numbafa.attention_bwd(**inputs, **DROP)
    expected = golden.attention_bwd(**inputs, **DROP)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert_close(g, e, FLOAT32, name)
    # The same call without dropout gives other gradients: the mask was applied.
    assert np.abs(numbafa.attention_bwd(**inputs)[2] - got[2]).max() > 1e-2 * np.abs(got[2]).max()


def test_forward_output_uses_the_published_mask():
    case = Case(nheads=2, nheads_kv=1, seqlen_q=200, seqlen_k=300)
    inputs, _, _ = dropout_inputs(case, np.float32)
    keep = numbafa.dropout_mask(1, 2, 200, 300, DROP["dropout_p"], DROP["seed"], DROP["seed_offset"])
    o_exp, _ = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                    dropout_p=DROP["dropout_p"], keep=keep)
    o, _ = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural",
                                 **DROP)
    assert_close(o, o_exp, FLOAT32, "o")


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
def test_zero_dropout_is_bit_identical_to_no_dropout(dtype):
    inputs = make_inputs(Case(nheads=4, nheads_kv=2, causal=True, num_sinks=1, seqlen_q=384, seqlen_k=384), dtype)
    for mixed in (True, False):
        base = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
        zero = numbafa.attention_bwd(**inputs, mixed_precision=mixed, dropout_p=0.0, seed=123, seed_offset=9)
        for a, b in zip(base, zero):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        fwd = [numbafa.attention_fwd(**_fwd_args(inputs), mixed_precision=mixed, lse_layout="natural",
                                     **extra) for extra in ({}, dict(dropout_p=0.0, seed=1))]
        for a, b in zip(*fwd):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "not-mixed"])
def test_bf16_is_faithful_to_the_numerics_golden(mixed):
    case = Case(nheads=4, nheads_kv=2, causal=True, num_sinks=1, seqlen_q=640, seqlen_k=640, d_head=128)
    inputs, _, _ = dropout_inputs(case, BF16)
    got = numbafa.attention_bwd(**inputs, mixed_precision=mixed, **DROP)
    *emulated, budgets = rounded_with_budget(**inputs, mixed_precision=mixed, **DROP)
    for name, g, e, budget in zip(("dq", "dk", "dv"), got, emulated, budgets):
        identical, excess = faithfulness(g.astype(np.float32), e, budget)
        assert identical >= MIN_IDENTICAL, f"{name}: only {identical:.4%} bit-identical"
        assert excess <= 1.0, f"{name}: {excess:.2f}x the flip bound on a large element"
    if mixed:
        expected = golden.attention_bwd(**inputs, **DROP)
        for name, g, e in zip(("dq", "dk", "dv"), got, expected):
            assert_close(g.astype(np.float32), e, BF16_MIXED, name)


def test_results_do_not_depend_on_the_thread_count():
    cases = [Case(nheads=3, nheads_kv=1, seqlen_q=640, seqlen_k=640, causal=True, num_sinks=1),  # split
             Case(bs=2, nheads=4, nheads_kv=2, seqlen_q=300, seqlen_k=300)]
    results = {}
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            for i, case in enumerate(cases):
                for dtype in (np.float32, BF16):
                    inputs, _, _ = dropout_inputs(case, dtype)
                    fwd = numbafa.attention_fwd(**_fwd_args(inputs), lse_layout="natural", **DROP)
                    results[threads, i, np.dtype(dtype).name] = fwd + numbafa.attention_bwd(**inputs, **DROP)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for (threads, i, dtype), arrays in results.items():
        for a, b in zip(arrays, results[1, i, dtype]):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_attention_context_reuses_the_forward_mask():
    case = Case(nheads=2, nheads_kv=1, seqlen_q=256, seqlen_k=256, causal=True)
    inputs, _, _ = dropout_inputs(case, np.float32)
    to_bshd = lambda x: np.ascontiguousarray(x.transpose(0, 3, 1, 2))  # noqa: E731
    q, k, v, dy = (to_bshd(inputs[n]) for n in ("q_ref", "k_ref", "v_ref", "dy_ref"))
    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, **DROP)
    grads = ctx.backward(dy)
    expected = golden.attention_bwd(**{**inputs, "use_causal_mask": True}, **DROP)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(g, to_bshd(e), FLOAT32, name)


# --------------------------------------------------------------------------
# Bad arguments
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    (dict(dropout_p=-0.1, seed=1), ValueError, r"dropout_p must be in \[0, 1\), got -0.1"),
    (dict(dropout_p=float("nan"), seed=1), ValueError, r"dropout_p must be in \[0, 1\), got nan"),
    (dict(dropout_p=True, seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p="0.1", seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.1), ValueError, "seed is required with dropout_p=0.1"),
    (dict(dropout_p=0.1, seed=1.5), TypeError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, seed=2 ** 64), ValueError, r"seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, seed=1, seed_offset=-3), ValueError, r"seed_offset must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, seed=np.True_), TypeError, "seed must be an int"),
])
def test_bad_dropout_arguments_are_clear_errors(kwargs, error, match):
    inputs = make_inputs(Case(nheads=1, nheads_kv=1, seqlen_q=128, seqlen_k=128))
    with pytest.raises(error, match=match):
        numbafa.attention_bwd(**inputs, **kwargs)
    with pytest.raises(error, match=match):
        numbafa.attention_fwd(**_fwd_args(inputs), **kwargs)
    with pytest.raises(error, match=match):
        numbafa.attention(np.zeros((1, 8, 1, 4), np.float32), *(np.zeros((1, 8, 1, 4), np.float32),) * 2,
                          **kwargs)
    if "dropout_p" in kwargs and "seed" in kwargs:
        with pytest.raises(error, match=match):
            numbafa.dropout_mask(1, 1, 4, 4, kwargs["dropout_p"], kwargs["seed"], kwargs.get("seed_offset", 0))


def test_numpy_integer_seeds_are_accepted():
    a = numbafa.dropout_mask(1, 1, 16, 16, 0.5, np.uint64(2 ** 63 + 5), np.int32(2))
    np.testing.assert_array_equal(a, golden.keep_mask(1, 1, 16, 16, 0.5, 2 ** 63 + 5, 2))


def test_dropout_mask_size_errors():
    with pytest.raises(ValueError, match="seqlen_q must be >= 0, got -1"):
        numbafa.dropout_mask(1, 1, -1, 4, 0.1, 1)
    with pytest.raises(TypeError, match="nheads must be an int"):
        numbafa.dropout_mask(1, 2.0, 4, 4, 0.1, 1)
    with pytest.raises(ValueError, match="at most 1073741824"):
        numbafa.dropout_mask(64, 64, 1024, 1024, 0.1, 1)
    assert numbafa.dropout_mask(0, 1, 4, 4, 0.1, 1).shape == (0, 1, 4, 4)
