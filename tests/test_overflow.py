"""Finite inputs whose pass leaves float32's range: the exact result where it is representable,
a FloatingPointError naming what overflowed where it is not -- never a silent inf, NaN or 0.

The forward's unnormalised accumulator (up to ``seqlen_k * max|v|``) and the backward's
``dP``, ``D``, ``dS`` and gradients (linear in ``dy``) are computed on ``v * 2**-e`` or
``dy * 2**-e`` and scaled back (numbafa/pipeline/ranges.py): the results must be bitwise those of the
unscaled inputs times ``2**e``. Scores beyond float32 make the log-sum-exp unrepresentable: an
error naming q, k and the scale.
"""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import numbafa

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, BF16]


def _inputs(dtype, seed=0, bs=1, h=2, d=16, s=256):
    rng = np.random.default_rng(seed)
    return [np.clip(rng.standard_normal((bs, h, d, s)), -3, 3).astype(np.float32).astype(dtype) for _ in range(4)]


def _times(x, e):
    """``x * 2**e`` in x's dtype (exact for these values)."""
    return np.ldexp(x.astype(np.float32), e).astype(x.dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype == BF16 else np.uint32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_forward_accumulator_beyond_float32_gives_the_scaled_bits(dtype):
    q, k, v, _ = _inputs(dtype)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, lse_layout="natural")
    o_big, lse_big = numbafa.attention_fwd(q, k, _times(v, 125), use_causal_mask=True, lse_layout="natural")
    assert np.isfinite(o_big.astype(np.float32)).all()
    np.testing.assert_array_equal(_bits(o_big), _bits(_times(o, 125)))
    np.testing.assert_array_equal(lse_big, lse)


def test_a_large_constant_value_is_the_output():
    """v = 1e37 everywhere: o is 1e37 (the issue's case: 64 of 2,048 outputs were inf)."""
    q, k, _, _ = _inputs(np.float32, s=128)
    v = np.full(q.shape, 1e37, np.float32)
    o, _ = numbafa.attention_fwd(q, k, v, lse_layout="natural")
    # o = (sum_j p_j v) / (sum_j p_j): two float32 sums of 128 terms in the GEMM's (CPU-dependent)
    # order, each within gamma_128 = 128 u of exact, and one division (u = 2**-24).
    np.testing.assert_allclose(o, 1e37, rtol=2 * 128 * 2.0 ** -24 + 2.0 ** -24)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("case", ["equal-rows", "scale"])
def test_scores_beyond_float32_are_a_floating_point_error(dtype, case):
    if case == "equal-rows":   # q.k / 4 = 4e38: the first example
        q = k = np.full((1, 1, 16, 4), 1e19, np.float32).astype(dtype)
        v, kw = np.arange(64, dtype=np.float32).reshape(1, 1, 16, 4).astype(dtype), {}
    else:                      # 2 * 3e38: its second
        q, k = np.array([[[[2, 2]]]], np.float32).astype(dtype), np.array([[[[1, .5]]]], np.float32).astype(dtype)
        v, kw = np.ones((1, 1, 1, 2), dtype), dict(softmax_scale=3e38)
    # (2 * 3e38 overflows already where Q is scaled at load: _check_scaled_queries)
    with pytest.raises(FloatingPointError, match=r"the attention scores (softmax_scale \* q_ref\^T k_ref )?overflow "
                                                 r"(float32|bfloat16)"):
        numbafa.attention_fwd(q, k, v, lse_layout="natural", **kw)
    lse = np.zeros(q.shape[:2] + q.shape[3:], np.float32)
    with pytest.raises(FloatingPointError, match="overflow (float32|bfloat16)"):
        numbafa.attention_bwd(q, k, v, np.zeros_like(q), np.zeros_like(q), lse, **kw)


def test_a_large_score_that_fits_is_not_refused():
    """The cheap bound (d * max|q| * max|k|) does not fit, the exact products do: no error, the
    unscaled result (the check looks at each pair's products, not at the largest elements)."""
    q = np.zeros((1, 1, 4, 128), np.float32)
    k = np.zeros((1, 1, 4, 128), np.float32)
    q[0, 0, 0, :] = 1e19     # q's rows live on dimension 0, k's on dimension 1: q.k = 0
    k[0, 0, 1, :] = 1e19
    v = np.ones((1, 1, 4, 128), np.float32)
    o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural")
    np.testing.assert_array_equal(o, 1.0)
    np.testing.assert_allclose(lse, np.log(128), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_backward_beyond_float32_gives_the_scaled_bits(dtype):
    q, k, v, dy = _inputs(dtype, seed=1)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, lse_layout="natural")
    expected = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
    got = numbafa.attention_bwd(q, k, v, o, _times(dy, 124), lse, use_causal_mask=True)
    for g, e in zip(got, expected):
        assert np.isfinite(g.astype(np.float32)).all()
        np.testing.assert_array_equal(_bits(g), _bits(_times(e, 124)))


def test_a_gradient_beyond_float32_is_a_floating_point_error():
    """Equal keys, dy = 2**127 everywhere: dv of key 0 is 2**127 * (1 + 1/2 + ... + 1/128)."""
    q, k, _, _ = _inputs(np.float32, s=128)
    k[:] = 0.0
    v = np.ones_like(q)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, lse_layout="natural")
    dy = np.full(q.shape, 2.0 ** 127, np.float32)
    with pytest.raises(FloatingPointError, match=r"^dv overflows float32"):
        numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_the_functional_front_end(dtype):
    q, k, v, do = (np.moveaxis(x, 2, 3) for x in _inputs(dtype, seed=2))   # bhsd
    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bhsd")
    o_big, _ = numbafa.attention(q, k, _times(v, 125), use_causal_mask=True, layout="bhsd")
    np.testing.assert_array_equal(_bits(o_big), _bits(_times(o, 125)))
    for g, e in zip(ctx.backward(_times(do, 124)), ctx.backward(do)):
        np.testing.assert_array_equal(_bits(g), _bits(_times(e, 124)))
    with pytest.raises(FloatingPointError, match=r"softmax_scale \* q\^T k overflow"):
        numbafa.attention(_times(q, 63), _times(k, 63), v, layout="bhsd")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_front_end(dtype):
    import torch

    import numbafa.torch as nt
    tdt = getattr(torch, dtype)
    q, k, v, do = (torch.from_numpy(np.moveaxis(x, 2, 3).copy()).to(tdt) for x in _inputs(np.float32, seed=3))

    def run(v, do):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = nt.attention(*leaves, causal=True)
        o.backward(do)
        return [o.detach()] + [x.grad for x in leaves]

    expected = run(v, do)
    big_v = run(v * 2.0 ** 125, do)
    torch.testing.assert_close(big_v[0], expected[0] * 2.0 ** 125, rtol=0, atol=0)
    big_do = run(v, do * 2.0 ** 124)
    for g, e in zip(big_do[1:], expected[1:]):
        torch.testing.assert_close(g, e * 2.0 ** 124, rtol=0, atol=0)
    with pytest.raises(FloatingPointError, match=r"softmax_scale \* q\^T k overflow"):
        nt.attention(q * 1e19, k * 1e19, v)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
def test_the_jax_front_end(dtype):
    import jax

    import numbafa.jax as nj
    q, k, v, do = (np.moveaxis(x, 2, 3).copy() for x in _inputs(dtype, seed=4))

    def run(v, do):
        o, vjp = jax.vjp(lambda q, k, v: nj.attention(q, k, v, causal=True), q, k, v)
        return [np.asarray(o)] + [np.asarray(g) for g in vjp(do)]

    expected = run(v, do)
    np.testing.assert_array_equal(_bits(run(_times(v, 125), do)[0]), _bits(_times(expected[0], 125)))
    for g, e in zip(run(v, _times(do, 124))[1:], expected[1:]):
        np.testing.assert_array_equal(_bits(g), _bits(_times(e, 124)))
    with pytest.raises(Exception, match=r"softmax_scale \* q\^T k overflow"):
        np.asarray(nj.attention(_times(q, 63), _times(k, 63), v))
