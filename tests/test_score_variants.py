"""Score variants (bias with its gradient, ALiBi, soft cap): goldens, kernels, errors, determinism."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import numbafa
from numbafa import golden

from _budget import assert_faithful, fp16_ulp
from _problems import Case, forward_options, make_inputs
from _tolerances import FLOAT32, FLOAT64, FP16_MIXED, MIN_IDENTICAL, MIN_IDENTICAL_FP16, assert_close
from test_dropout import _finite_differences

BF16 = ml_dtypes.bfloat16


def variant_kwargs(case: Case, spec: dict, dtype=np.float32) -> dict:
    """The score-variant arguments of ``spec`` for ``case``: ``bias`` (a shape; with ``pad``, the
    last quarter of each batch's keys masked by ``-inf``), ``alibi`` (the slopes' shape),
    ``softcap``; ``dbias`` asks for the bias's gradient."""
    rng = np.random.default_rng(case.seed + 100)
    kw = {}
    if "bias" in spec:
        bias = rng.standard_normal(spec["bias"])
        if spec.get("pad"):
            bias[..., -case.seqlen_k // 4:] = -np.inf
        kw["bias"] = bias.astype(spec.get("bias_dtype", dtype))
    if "alibi" in spec:
        kw["alibi_slopes"] = rng.uniform(0.01, 0.25, spec["alibi"]).astype(np.float64 if dtype == np.float64
                                                                           else np.float32)
    if "softcap" in spec:
        kw["softcap"] = spec["softcap"]
    if "dropout" in spec:
        kw.update(dropout_p=spec["dropout"], seed=1234)
    return kw


def variant_inputs(case: Case, spec: dict, dtype=np.float32) -> dict:
    """``attention_bwd``'s keyword arguments: ``make_inputs``' arrays, o and lse from the float64
    golden forward with the variants (o rounded to ``dtype``), the variants, ``return_dbias``."""
    inputs = make_inputs(case, dtype)
    kw = variant_kwargs(case, spec, dtype)
    fwd = forward_options(inputs)
    fwd["sinks"] = fwd.pop("sinks_ref", None)
    o, lse = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], **fwd, **kw)
    wide = np.dtype(dtype) == np.float64
    inputs.update(o_ref=o.astype(dtype), lse_ref=lse.astype(np.float64 if wide else np.float32), **kw)
    if spec.get("dbias"):
        inputs["return_dbias"] = True
    return inputs


def forward_kwargs(inputs: dict) -> dict:
    keys = ("bias", "alibi_slopes", "softcap", "dropout_p", "seed")
    return {**forward_options(inputs), **{k: inputs[k] for k in keys if k in inputs}}


#: (id, Case, variants): each variant with the features it must combine with.
VARIANT_CASES = [
    ("softcap-causal-gqa", Case(nheads=4, nheads_kv=2, causal=True, seqlen_q=384, seqlen_k=384),
     dict(softcap=5.0)),
    ("bias-full-rect", Case(bs=2, seqlen_q=200, seqlen_k=300), dict(bias=(2, 2, 200, 300), dbias=True)),
    ("bias-per-head-shared-batch", Case(bs=2, nheads=4, nheads_kv=2, causal=True),
     dict(bias=(4, 256, 256), dbias=True)),
    ("bias-keypad-inf-mqa-sinks", Case(bs=2, nheads=4, nheads_kv=1, num_sinks=1),
     dict(bias=(2, 1, 1, 256), pad=True, dbias=True)),
    ("bias-shared-window", Case(nheads=4, nheads_kv=2, causal=True, window=100, seqlen_q=640, seqlen_k=640),
     dict(bias=(1, 1, 640, 640), dbias=True)),
    ("alibi-rect", Case(bs=2, nheads=4, nheads_kv=4, seqlen_q=130, seqlen_k=700), dict(alibi=(2, 4))),
    ("alibi-causal-packing", Case(nheads=4, nheads_kv=1, causal=True, packing=(127, 129, 255, 513),
                                  seqlen_q=1024, seqlen_k=1024), dict(alibi=(4,))),
    ("all-sinks-dv", Case(nheads=4, nheads_kv=2, d_head=96, d_head_v=64, causal=True, num_sinks=2),
     dict(softcap=3.0, bias=(256,), alibi=(4,), dbias=True)),
    ("all-dropout", Case(bs=2, nheads=2, nheads_kv=1, seqlen_q=384, seqlen_k=384, causal=True),
     dict(softcap=8.0, bias=(2, 2, 384, 384), alibi=(2,), dbias=True, dropout=0.2)),
    ("bias-2-sections-softcap", Case(nheads=1, nheads_kv=1, d_head=64, d_head_v=256, seqlen_q=200, seqlen_k=5120),
     dict(bias=(1, 1, 1, 5120), dbias=True, softcap=6.0)),
]
IDS = [i for i, _, _ in VARIANT_CASES]
BY_ID = {i: (c, s) for i, c, s in VARIANT_CASES}


def _outputs(inputs, got_names=("dq", "dk", "dv")):
    names = list(got_names)
    if inputs.get("sinks_ref") is not None:
        names.append("dsinks")
    if inputs.get("return_dbias"):
        names.append("dbias")
    return names


@pytest.mark.parametrize("name", IDS)
def test_float32_forward_and_backward_match_the_golden(name):
    case, spec = BY_ID[name]
    inputs = variant_inputs(case, spec)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural",
                                   **forward_kwargs(inputs))
    assert_close(o, inputs["o_ref"], FLOAT32, "o")
    finite = np.isfinite(inputs["lse_ref"])
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert_close(lse[finite], inputs["lse_ref"][finite], FLOAT32, "lse")
    got = numbafa.attention_bwd(**inputs)
    expected = golden.attention_bwd(**inputs)
    names = _outputs(inputs)
    assert len(got) == len(names) == len(expected)
    for n, g, e in zip(names, got, expected):
        assert g.shape == np.shape(e) and g.dtype == (inputs["bias"].dtype if n == "dbias" else np.float32), n
        assert_close(g, e, FLOAT32, n)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "not-mixed"])
@pytest.mark.parametrize("name", ["softcap-causal-gqa", "bias-per-head-shared-batch", "bias-keypad-inf-mqa-sinks",
                                  "alibi-causal-packing", "all-sinks-dv"])
def test_bf16_is_faithful_to_the_numerics_golden(name, mixed):
    """The rounding points of the bf16 kernels are unchanged; the variants work on the float32
    score tile and dS is rounded again after the soft cap's factor (docs/numerics.md)."""
    case, spec = BY_ID[name]
    inputs = variant_inputs(case, spec, BF16)
    fwd = {**forward_kwargs(inputs), "mixed_precision": mixed}
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural", **fwd)
    inputs.update(o_ref=o, lse_ref=lse)
    got = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
    assert_faithful(inputs, got, mixed, MIN_IDENTICAL)


def test_float64_matches_the_golden():
    case, spec = BY_ID["all-sinks-dv"]
    inputs = variant_inputs(case, spec, np.float64)
    got = numbafa.attention_bwd(**inputs)
    for n, g, e in zip(_outputs(inputs), got, golden.attention_bwd(**inputs)):
        assert g.dtype == np.float64, n
        assert_close(g, e, FLOAT64, n)


def test_float16_is_faithful_and_accurate():
    case, spec = BY_ID["all-sinks-dv"]
    inputs = variant_inputs(case, dict(spec, bias_dtype=np.float16), np.float16)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural",
                                   mixed_precision=True, **forward_kwargs(inputs))
    inputs.update(o_ref=o, lse_ref=lse)
    got = numbafa.attention_bwd(**inputs, mixed_precision=True)
    assert got[-1].dtype == np.float16
    assert_faithful(inputs, got, True, MIN_IDENTICAL_FP16, ulp=fp16_ulp)
    for n, g, e in zip(_outputs(inputs), got, golden.attention_bwd(**inputs)):
        assert_close(g, e, FP16_MIXED, n)


def _loss(q, k, v, dy, **kw):
    o, _ = golden.attention_fwd(q, k, v, **kw)
    return float((o * dy).sum())


def test_golden_gradients_match_finite_differences():
    """The float64 golden's dq, dk, dv and dbias under a soft cap, a batch-shared bias, ALiBi and
    GQA against central differences of its own forward (relative 1e-6); without the soft cap's
    factor the gradients would miss by far more (the check can fail)."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 4, 6)), rng.standard_normal((2, 1, 4, 7)), rng.standard_normal((2, 1, 3, 7))
    dy = rng.standard_normal((2, 2, 3, 6))
    bias = rng.standard_normal((2, 6, 7))
    kw = dict(bias=bias, alibi_slopes=np.array([0.3, 0.1]), softcap=1.5, softmax_scale=1.3)
    o, lse = golden.attention_fwd(q, k, v, **kw)
    grads = golden.attention_bwd(q, k, v, o, dy, lse, return_dbias=True, **kw)
    for x, g in zip((q, k, v, bias), grads):
        fd = _finite_differences(x, lambda: _loss(q, k, v, dy, **kw))
        assert np.abs(g - fd).max() <= 1e-6 * np.abs(fd).max()
    uncapped = golden.attention_bwd(q, k, v, o, dy, lse, **dict(kw, softcap=None))
    fd_q = _finite_differences(q, lambda: _loss(q, k, v, dy, **kw))
    assert np.abs(uncapped[0] - fd_q).max() > 1e-2 * np.abs(fd_q).max()


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
def test_zero_bias_and_zero_slopes_are_bit_identical_to_none(dtype):
    """``s + 0`` and ``s - 0 * d`` are exact: the variant kernels are the plain ones plus those steps."""
    case = Case(bs=2, nheads=4, nheads_kv=2, causal=True, num_sinks=1, seqlen_q=384, seqlen_k=384)
    inputs = make_inputs(case, dtype)
    zeros = dict(bias=np.zeros((1, 4, 384, 384), np.float32), alibi_slopes=np.zeros(4, np.float32))
    plain = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], **forward_options(inputs))
    varied = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], **forward_options(inputs),
                                   **zeros)
    for a, b in zip(plain, varied):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for a, b in zip(numbafa.attention_bwd(**inputs), numbafa.attention_bwd(**inputs, **zeros)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("name", ["bias-per-head-shared-batch", "bias-shared-window", "bias-full-rect"])
def test_dbias_does_not_depend_on_the_thread_count(name):
    """A shared bias's gradient is summed by one work item in one order (numbafa.kernels.scores)."""
    case, spec = BY_ID[name]
    inputs = variant_inputs(case, spec)
    results = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        previous = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            results.append(numbafa.attention_bwd(**inputs))
        finally:
            numba.set_num_threads(previous)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_a_query_with_every_key_masked_by_the_bias_gets_nothing():
    """As under the other masks: o = 0, lse = +inf, zero gradients (and a zero dbias row)."""
    case = Case(nheads=2, nheads_kv=1, seqlen_q=128, seqlen_k=256)
    inputs = make_inputs(case)
    bias = np.random.default_rng(0).standard_normal((2, 128, 256)).astype(np.float32)
    bias[1, 7] = -np.inf
    q, k, v = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]
    o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural", bias=bias, softcap=2.0)
    assert lse[0, 1, 7] == np.inf and not np.isinf(np.delete(lse[0, 1], 7)).any()
    np.testing.assert_array_equal(o[0, 1, :, 7], 0.0)
    dq, dk, dv, dbias = numbafa.attention_bwd(q, k, v, o, inputs["dy_ref"], lse, bias=bias, softcap=2.0,
                                              return_dbias=True)
    np.testing.assert_array_equal(dq[0, 1, :, 7], 0.0)
    np.testing.assert_array_equal(dbias[1, 7], 0.0)
    assert np.isfinite(dk).all() and np.isfinite(dv).all()
    expected = golden.attention_bwd(q, k, v, o, inputs["dy_ref"], lse, bias=bias, softcap=2.0, return_dbias=True)
    for n, g, e in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), expected):
        assert_close(g, e, FLOAT32, n)


def test_the_functional_context_returns_dbias_when_asked():
    case, spec = BY_ID["bias-per-head-shared-batch"]
    inputs = variant_inputs(case, spec)
    q, k, v = (inputs[n].transpose(0, 3, 1, 2) for n in ("q_ref", "k_ref", "v_ref"))   # bshd
    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, bias=inputs["bias"])
    do = inputs["dy_ref"].transpose(0, 3, 1, 2)
    assert len(ctx.backward(do)) == 3
    dq, dk, dv, dbias = ctx.backward(do, return_dbias=True)
    expected = numbafa.attention_bwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], o.transpose(0, 2, 3, 1),
                                     inputs["dy_ref"], ctx.lse, use_causal_mask=True, bias=inputs["bias"],
                                     return_dbias=True)
    np.testing.assert_array_equal(dbias, expected[3])
    np.testing.assert_array_equal(dq, expected[0].transpose(0, 3, 1, 2))
    inputs["bias"][0] += 1.0      # one head's bias, in place (a large array's fingerprint samples it)
    with pytest.raises(ValueError, match="bias was modified in place"):
        ctx.backward(do)


def _small():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 16, 128)).astype(np.float32)
    k = rng.standard_normal((2, 2, 16, 128)).astype(np.float32)
    return q, k, k.copy()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bias=np.zeros((2, 4, 128, 64), np.float32)), ValueError,
     r"bias must be broadcastable to \[bs, nheads, seqlen_q, seqlen_k\] = \(2, 4, 128, 128\) with a last dim of "
     r"seqlen_k=128 \(any of the first three may be 1\), got \(2, 4, 128, 64\)"),
    (dict(bias=np.zeros((3, 1, 1, 128), np.float32)), ValueError, r"got \(3, 1, 1, 128\)"),
    (dict(bias=np.zeros((1, 2, 4, 128, 128), np.float32)), ValueError, r"got \(1, 2, 4, 128, 128\)"),
    (dict(bias=np.zeros((128,), np.float64)), TypeError, r"bias must be float32 or the inputs' dtype \(float32\), "
                                                          r"got float64"),
    (dict(bias=[0.0] * 128), TypeError, r"bias must be a numpy.ndarray, got list"),
    (dict(bias=np.full(128, np.nan, np.float32)), ValueError, r"bias must not contain NaN or \+inf \(-inf masks a "
                                                               r"score\), got 128 such element\(s\) of 128"),
    (dict(bias=np.full(128, np.inf, np.float32)), ValueError, r"bias must not contain NaN or \+inf"),
    (dict(bias=np.full(128, 3.3e38, np.float32), softmax_scale=1e35), FloatingPointError,
     r"^the attention scores plus bias overflow float32: they reach 3.\d+e\+38 > 3.403e\+38 .*; scale bias down$"),
    (dict(alibi_slopes=np.full(4, 3e36, np.float32)), FloatingPointError,
     r"^the attention scores plus the ALiBi terms \(alibi_slopes times the key distance\) overflow float32: they "
     r"reach 3.\d+e\+38 > 3.403e\+38 .*; scale alibi_slopes down$"),
    (dict(bias=np.full(128, 2e38, np.float32), alibi_slopes=np.full(4, 2e36, np.float32)), FloatingPointError,
     r"^the attention scores plus bias and the ALiBi terms \(alibi_slopes .*; scale bias or alibi_slopes down$"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be in \[1.1754944e-38, 8.5070592e\+37\] .* got nan"),
    (dict(softcap=-1.0), ValueError, r"softcap must be in \[1.1754944e-38, 8.5070592e\+37\] .* got -1.0"),
    # 0 in float32 (silently no cap), a subnormal float32 (1 / softcap = inf: NaN from zero scores),
    # beyond 2**126 (a subnormal reciprocal)
    (dict(softcap=1e-50), ValueError, r"softcap must be in \[1.1754944e-38, .*2\*\*-126 to 2\*\*126.* got 1e-50"),
    (dict(softcap=1e-45), ValueError, r"softcap must be in .* got 1e-45"),
    (dict(softcap=1e38), ValueError, r"softcap must be in .* got 1e\+38"),
    (dict(softcap=10 ** 400), ValueError, r"softcap must be in .* got 1000"),
    (dict(softcap=True), TypeError, r"softcap must be a real number > 0, or None or 0 for none, got bool"),
    (dict(softcap="3"), TypeError, r"got str"),
    (dict(alibi_slopes=np.ones(2, np.float32)), ValueError,
     r"alibi_slopes must have shape \(4,\) \[nheads\] or \(2, 4\) \[bs, nheads\], got \(2,\)"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, r"alibi_slopes must be float32, got float64"),
    (dict(alibi_slopes=np.array([1, np.nan, 1, 1], np.float32)), ValueError, r"alibi_slopes must be finite"),
    (dict(return_dbias=True), ValueError, r"return_dbias=True needs a bias to differentiate, got bias=None"),
    (dict(bias=np.zeros(128, np.float32), return_dbias=1), TypeError, r"return_dbias must be a bool, got int"),
])
def test_bad_variant_arguments_are_clear_errors(kwargs, error, match):
    q, k, v = _small()
    o = np.zeros((2, 4, 16, 128), np.float32)
    lse = np.zeros((2, 4, 128), np.float32)
    with pytest.raises(error, match=match):
        numbafa.attention_bwd(q, k, v, o, o, lse, **kwargs)
    fwd = {key: x for key, x in kwargs.items() if key != "return_dbias"}
    if fwd and "return_dbias" not in kwargs:
        with pytest.raises(error, match=match):
            numbafa.attention_fwd(q, k, v, **fwd)


@pytest.mark.parametrize("softcap", [2.0 ** -126, 2.0 ** 126], ids=["smallest", "largest"])
def test_the_extreme_soft_caps_are_computed_right(softcap):
    """The smallest soft cap makes attention all but uniform (every |score| is capped at 1.2e-38),
    with a zero score row among them (0 * (1 / softcap) = 0, not NaN); the largest changes
    nothing. Both within the float32 tolerance of the float64 golden, finite everywhere."""
    case = Case(nheads=2, nheads_kv=1, d_head=32, seqlen_q=128, seqlen_k=128, causal=True)
    inputs = make_inputs(case)
    inputs["q_ref"][..., :7] = 0.0                  # rows of zero scores
    q, k, v = (inputs[key] for key in ("q_ref", "k_ref", "v_ref"))
    o_exp, lse_exp = golden.attention_fwd(q, k, v, use_causal_mask=True, softcap=softcap)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, softcap=softcap, lse_layout="natural")
    assert_close(o, o_exp, FLOAT32, "o")
    dy = inputs["dy_ref"]
    expected = golden.attention_bwd(q, k, v, o_exp.astype(np.float32), dy, lse_exp.astype(np.float32),
                                    use_causal_mask=True, softcap=softcap)
    got = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, softcap=softcap)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert np.isfinite(g).all(), name
        assert_close(g, e, FLOAT32, name)


def test_bias_of_the_inputs_dtype_and_dbias_in_it():
    """A bf16 bias for bf16 inputs: widened exactly; dbias comes back in bf16."""
    case, spec = BY_ID["bias-per-head-shared-batch"]
    inputs = variant_inputs(case, dict(spec, bias_dtype=BF16), BF16)
    got = numbafa.attention_bwd(**inputs, mixed_precision=True)
    assert got[3].dtype == BF16 and got[3].shape == (4, 256, 256)
    wide = numbafa.attention_bwd(**dict(inputs, bias=inputs["bias"].astype(np.float32)), mixed_precision=True)
    np.testing.assert_array_equal(got[3], wide[3].astype(BF16))


# ---------------------------------------------------------------------------
# Front ends: PyTorch (against SDPA's math backend and FlexAttention) and JAX
# ---------------------------------------------------------------------------

def _sdpa_mask64(torch, bias, slopes, s_q, s_k, causal):
    """SDPA's float ``attn_mask`` (float64) of a bias, ALiBi slopes ``[heads]`` and the causal mask."""
    i = torch.arange(s_q, dtype=torch.float64)[:, None]
    j = torch.arange(s_k, dtype=torch.float64)[None, :]
    mask = bias.double() - slopes.double()[:, None, None] * (i + s_k - s_q - j).abs()
    if causal:
        mask = mask + torch.where(j <= i, 0.0, float("-inf"))
    return mask


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_torch_bias_and_alibi_match_sdpa_with_a_float_mask(layout, causal):
    """numbafa.torch in float32 against SDPA's math backend in float64 with the bias and ALiBi as a
    float ``attn_mask`` that requires its gradient (GQA; the bias per head, shared by the batch)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numbafa.torch as nt

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, s, d = 2, 4, 2, 160, 32
    q, k, v, do = (torch.randn(b, n, s, d, generator=gen) for n in (h, hkv, hkv, h))
    bias = torch.randn(h, s, s, generator=gen)
    slopes = torch.rand(h, generator=gen) * 0.2
    to = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    qs, ks, vs = (to(x).clone().requires_grad_() for x in (q, k, v))
    bias_t = bias.clone().requires_grad_()
    o = nt.attention(qs, ks, vs, causal=causal, layout=layout, bias=bias_t, alibi_slopes=slopes)
    o.backward(to(do))
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    mask = _sdpa_mask64(torch, bias, slopes, s, s, causal).requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, enable_gqa=True)
    ref.backward(do.double())
    got = (to(o), to(qs.grad), to(ks.grad), to(vs.grad), bias_t.grad)
    expected = (ref, q64.grad, k64.grad, v64.grad, mask.grad)
    for name, g, e in zip(("o", "dq", "dk", "dv", "dbias"), got, expected):
        assert g.dtype == torch.float32, name
        assert_close(g.detach().numpy(), e.detach().numpy(), FLOAT32, name)


def test_torch_bias_without_grad_computes_no_dbias(monkeypatch):
    torch = pytest.importorskip("torch")
    import numbafa.torch as nt
    from numbafa.pipeline import core

    asked = []
    real = core.attention_bwd
    monkeypatch.setattr(core, "attention_bwd", lambda *a, **kw: asked.append(a[6].return_dbias) or real(*a, **kw))
    q, k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 1, 1, 64)
    nt.attention(q, k, v, bias=bias, softcap=3.0).sum().backward()
    assert asked == [False] and bias.grad is None and q.grad is not None


def test_torch_flex_attention_softcap_forward_matches():
    """FlexAttention's CPU forward (eager) with a soft-cap ``score_mod`` (its backward is not
    supported on the CPU: pytorch#148752) against numbafa's forward."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import numbafa.torch as nt

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 128, 32, generator=gen) * 2 for _ in range(3))
    cap = 4.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    with pytest.warns(UserWarning):   # "flex_attention called without torch.compile()": fine for a check
        ref = flex.flex_attention(q.double(), k.double(), v.double(), score_mod=softcap)
    with torch.no_grad():
        got = nt.attention(q, k, v, softcap=cap)
    assert_close(got.numpy(), ref.numpy(), FLOAT32, "o")


def test_jax_grads_match_the_golden():
    """jax.grad through the custom VJP: dq, dk, dv and dbias (a key-padding bias with -inf); ALiBi
    slopes get a zero cotangent; under jax.vmap one host call per mapped element."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import numbafa.jax as nj

    rng = np.random.default_rng(4)
    b, h, s, d = 2, 4, 128, 16
    q, k, v = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((b, 1, 1, s)).astype(np.float32)
    bias[1, ..., -20:] = -np.inf
    slopes = rng.uniform(0, 0.1, h).astype(np.float32)

    def loss(q, k, v, bias, slopes):
        return (nj.attention(q, k, v, causal=True, bias=bias, alibi_slopes=slopes, softcap=4.0,
                             layout="bhsd") ** 2).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, slopes)
    tr = (lambda x: x.transpose(0, 1, 3, 2))
    kw = dict(use_causal_mask=True, bias=bias, alibi_slopes=slopes, softcap=4.0)
    o, lse = golden.attention_fwd(tr(q), tr(k), tr(v), **kw)
    expected = golden.attention_bwd(tr(q), tr(k), tr(v), o, 2 * o, lse, return_dbias=True, **kw)
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), grads, (tr(expected[0]), tr(expected[1]), tr(expected[2]),
                                                                expected[3])):
        assert_close(np.asarray(g), e, FLOAT32, name)
    np.testing.assert_array_equal(np.asarray(grads[4]), 0.0)
    mapped = jax.vmap(lambda q: nj.attention(q, k, v, bias=bias, softcap=4.0, layout="bhsd"))(jnp.stack([q, 2 * q]))
    np.testing.assert_array_equal(np.asarray(mapped[1]),
                                  np.asarray(nj.attention(2 * q, k, v, bias=bias, softcap=4.0, layout="bhsd")))
