"""Every input contract raises a clear TypeError/ValueError before any kernel runs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numbafa

BS, H, HKV, D, S = 1, 4, 2, 16, 256


def good_inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BS, H, D, S)).astype(dtype)
    k = rng.standard_normal((BS, HKV, D, S)).astype(dtype)
    return dict(q_ref=q, k_ref=k, v_ref=k.copy(), o_ref=q.copy(), dy_ref=q.copy(),
                lse_ref=np.zeros((BS, H, 128, S // 128), np.float32))


def with_nan(x, value=np.nan):
    x = x.copy()
    x.flat[min(5, x.size - 1)] = value
    return x


def test_good_inputs_pass():
    assert len(numbafa.attention_bwd(**good_inputs())) == 3


F = good_inputs()
BAD = [
    # (changes, exception, message fragment)
    ({"q_ref": F["q_ref"].tolist()}, TypeError, "q_ref must be a numpy.ndarray, got list"),
    ({"v_ref": None}, TypeError, "v_ref must be a numpy.ndarray, got NoneType"),
    ({"lse_ref": 0.0}, TypeError, "lse_ref must be a numpy.ndarray, got float"),
    ({"use_causal_mask": 1}, TypeError, "use_causal_mask must be a bool, got int"),
    ({"mixed_precision": "yes"}, TypeError, "mixed_precision must be a bool, got str"),
    ({"q_ref": F["q_ref"][0]}, ValueError, "q_ref must be 4-D [bs, nheads, d_head, seqlen_q], got shape (4, 16, 256)"),
    ({"k_ref": F["k_ref"][0]}, ValueError, "k_ref must be 4-D [bs, nheads_kv, d_head, seqlen_k]"),
    ({k: F[k].astype(np.int32) for k in ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref")},
     TypeError, "q_ref must be float32, float64, float16 or bfloat16 (ml_dtypes.bfloat16), got int32"),
    ({k: F[k].astype(np.float64) for k in ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref")},
     TypeError, "lse_ref must be float64 for float64 inputs, got float32"),
    ({"q_ref": F["q_ref"].astype(np.float64)}, TypeError, "k_ref must have the dtype of q_ref (float64), got float32"),
    ({"dy_ref": F["dy_ref"].astype(ml_dtypes.bfloat16)}, TypeError,
     "dy_ref must have the dtype of q_ref (float32), got bfloat16"),
    ({"q_ref": np.zeros((1, 4, 0, 256), np.float32)}, ValueError, "d_head (q_ref.shape[2]) must be >= 1, got 0"),
    ({"k_ref": np.zeros((1, 2, 8, 256), np.float32)}, ValueError,
     "k_ref must have shape (1, nheads_kv, 16, seqlen_k) to match q_ref, got (1, 2, 8, 256)"),
    ({"k_ref": np.zeros((1, 3, 16, 256), np.float32), "v_ref": np.zeros((1, 3, 16, 256), np.float32)},
     ValueError, "nheads (4) must be a multiple of nheads_kv (k_ref.shape[1]), got nheads_kv=3"),
    ({"v_ref": np.zeros((1, 2, 16, 255), np.float32)}, ValueError,
     "v_ref must have shape (1, 2, d_head_v, 256) to match k_ref, got (1, 2, 16, 255)"),
    ({"v_ref": np.zeros((1, 1, 16, 256), np.float32)}, ValueError,
     "v_ref must have shape (1, 2, d_head_v, 256) to match k_ref, got (1, 1, 16, 256)"),
    ({"v_ref": np.zeros((1, 2, 0, 256), np.float32)}, ValueError, "d_head_v (v_ref.shape[2]) must be >= 1, got 0"),
    # v may have a head dim of its own; o and dy must carry it
    ({"o_ref": np.zeros((1, 4, 8, 256), np.float32)}, ValueError,
     "o_ref must have shape (1, 4, 16, 256) (q_ref's with the head dim of v_ref, d_head_v=16), got (1, 4, 8, 256)"),
    ({"v_ref": np.zeros((1, 2, 24, 256), np.float32)}, ValueError,
     "o_ref must have shape (1, 4, 24, 256) (q_ref's with the head dim of v_ref, d_head_v=24), got (1, 4, 16, 256)"),
    ({"v_ref": np.zeros((1, 2, 24, 256), np.float32), "o_ref": np.zeros((1, 4, 24, 256), np.float32)}, ValueError,
     "dy_ref must have shape (1, 4, 24, 256) (q_ref's with the head dim of v_ref, d_head_v=24), got (1, 4, 16, 256)"),
    ({"o_ref": np.zeros((1, 4, 16, 128), np.float32)}, ValueError, "o_ref must have shape (1, 4, 16, 256)"),
    ({"dy_ref": np.zeros((1, 2, 16, 256), np.float32)}, ValueError, "dy_ref must have shape (1, 4, 16, 256)"),
    ({"k_ref": np.zeros((1, 2, 16, 128), np.float32), "v_ref": np.zeros((1, 2, 16, 128), np.float32),
      "use_causal_mask": True}, ValueError,
     "use_causal_mask=True requires seqlen_q == seqlen_k, got seqlen_q=256, seqlen_k=128"),
    ({"sliding_window": 64}, ValueError,
     "sliding_window=64 requires use_causal_mask=True (None or a value < 1: no window), got use_causal_mask=False"),
    ({"sliding_window": 64.0, "use_causal_mask": True}, TypeError,
     "sliding_window must be an int or None, got float 64.0 (None or a value < 1: no window)"),
    ({"sliding_window": -1.0}, TypeError, "sliding_window must be an int or None"),
    ({"sliding_window": True, "use_causal_mask": True}, TypeError,
     "sliding_window must be an int or None, got bool True (None or a value < 1: no window)"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite in float32 (|softmax_scale| <= "
                                                  "3.4028235e+38), got nan"),
    ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be finite in float32"),
    # Finite in float64, inf in float32: the kernels' scale.
    ({"softmax_scale": 1e39}, ValueError, "softmax_scale must be finite in float32 (|softmax_scale| <= "
                                          "3.4028235e+38), got 1e+39"),
    ({"softmax_scale": -1e39}, ValueError, "got -1e+39"),
    ({"softmax_scale": np.float64(3.5e38)}, ValueError, "softmax_scale must be finite in float32"),
    ({"softmax_scale": 10 ** 400}, ValueError, "softmax_scale must be finite in float32"),
    ({"softmax_scale": True}, TypeError, "softmax_scale must be a real number or None, got bool"),
    ({"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a real number or None, got str"),
    ({"lse_ref": np.zeros((1, 4, 128, 2), np.float64)}, TypeError,
     "lse_ref must be float32 (float64 only for float64 inputs), got float64"),
    ({"lse_ref": np.zeros((1, 4, 2, 128), np.float32)}, ValueError,
     "lse_ref must have shape (1, 4, 128, 2) (Neuron layout [bs, nheads, 128, seqlen_q // 128]), got (1, 4, 2, 128)"),
    ({"lse_ref": np.zeros((1, 4, 255), np.float32)}, ValueError,
     "lse_ref must have shape (1, 4, 256) (natural layout [bs, nheads, seqlen_q]), got (1, 4, 255)"),
    ({"lse_ref": np.zeros((4, 256), np.float32)}, ValueError, "lse_ref must be 4-D"),
    ({"lse_ref": with_nan(F["lse_ref"])}, ValueError, "lse_ref must not contain NaN or -inf, got 1 such element(s)"),
    ({"lse_ref": with_nan(F["lse_ref"], -np.inf)}, ValueError, "lse_ref must not contain NaN or -inf"),
    ({"bound_min": np.zeros(256, np.float32)}, ValueError,
     "bound_min and bound_max must be given together, got only bound_min"),
    ({"bound_max": np.zeros(256, np.float32)}, ValueError, "got only bound_max"),
    ({"bound_min": np.zeros(256, np.float64), "bound_max": np.zeros(256, np.float32)}, TypeError,
     "bound_min must be float32, got float64"),
    ({"bound_min": np.zeros(256, np.float32), "bound_max": np.zeros(255, np.float32)}, ValueError,
     "bound_max must have shape (256,) (one bound per query row: [seqlen_q]), got (255,)"),
    ({"bound_min": np.zeros(256, np.float32), "bound_max": with_nan(np.zeros(256, np.float32))}, ValueError,
     "bound_max must not contain NaN"),
    ({"bound_min": [0] * 256, "bound_max": np.zeros(256, np.float32)}, TypeError,
     "bound_min must be a numpy.ndarray, got list"),
    ({"sinks_ref": np.zeros((1, 3), np.float32)}, ValueError,
     "sinks_ref must have shape (4,) [nheads], (1, 4) [bs, nheads] or (1, 4, num_sinks >= 1) [bs, nheads, num_sinks], got (1, 3)"),
    ({"sinks_ref": np.zeros((1, 4, 0), np.float32)}, ValueError, "got (1, 4, 0)"),
    ({"sinks_ref": np.zeros((5,), np.float32)}, ValueError, "sinks_ref must have shape (4,) [nheads], (1, 4)"),
    ({"sinks_ref": np.zeros((1, 4), np.int32)}, TypeError,
     "sinks_ref must be float32 or bfloat16 (float64 or float16 only for inputs of that dtype), got int32"),
    ({"sinks_ref": with_nan(np.zeros((1, 4), np.float32), np.inf)}, ValueError,
     "sinks_ref must be finite, got 1 NaN/inf element(s) of 4"),
    ({"q_ref": with_nan(F["q_ref"])}, ValueError, "q_ref must be finite, got 1 NaN/inf element(s)"),
    ({"k_ref": with_nan(F["k_ref"], np.inf)}, ValueError, "k_ref must be finite"),
    ({"v_ref": with_nan(F["v_ref"], -np.inf)}, ValueError, "v_ref must be finite"),
    ({"o_ref": with_nan(F["o_ref"])}, ValueError, "o_ref must be finite"),
    ({"dy_ref": with_nan(F["dy_ref"])}, ValueError, "dy_ref must be finite"),
]


@pytest.mark.parametrize("changes,exc,message", BAD, ids=[b[2][:60] for b in BAD])
def test_bad_input_raises(changes, exc, message):
    inputs = {**good_inputs(), **changes}
    with pytest.raises(exc) as info:
        numbafa.attention_bwd(**inputs)
    assert message in str(info.value)


def test_neuron_lse_layout_needs_divisible_seqlen():
    inputs = good_inputs()
    q = inputs["q_ref"][..., :200]
    inputs.update(q_ref=q, o_ref=q, dy_ref=q, lse_ref=np.zeros((1, 4, 128, 1), np.float32))
    with pytest.raises(ValueError, match=r"needs seqlen_q divisible by 128, got seqlen_q=200; pass lse as "
                                         r"\[bs, nheads, seqlen_q\] instead"):
        numbafa.attention_bwd(**inputs)


def test_bf16_nonfinite_is_detected():
    inputs = good_inputs(ml_dtypes.bfloat16)
    inputs["k_ref"] = with_nan(inputs["k_ref"], np.inf)
    with pytest.raises(ValueError, match="k_ref must be finite, got 1 NaN/inf"):
        numbafa.attention_bwd(**inputs)


def test_window_zero_means_no_window():
    inputs = good_inputs()
    a = numbafa.attention_bwd(**inputs, use_causal_mask=True)
    b = numbafa.attention_bwd(**inputs, use_causal_mask=True, sliding_window=0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_numpy_bool_flags_accepted():
    inputs = good_inputs()
    a = numbafa.attention_bwd(**inputs, use_causal_mask=np.bool_(True))
    assert a[0].shape == inputs["q_ref"].shape


@pytest.mark.parametrize("window", [-1, -7, 0, np.int64(-1), np.int32(0)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_below_one_means_no_window(window, causal):
    """Upstream NKI passes sliding_window=-1 for 'no window', with or without causal."""
    inputs = good_inputs()
    a = numbafa.attention_bwd(**inputs, use_causal_mask=causal)
    b = numbafa.attention_bwd(**inputs, use_causal_mask=causal, sliding_window=window)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], use_causal_mask=causal,
                                   sliding_window=window)
    o0, lse0 = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], use_causal_mask=causal)
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(lse, lse0)


@pytest.mark.parametrize("zero", [0.0, -0.0, 0, np.float32(0.0)])
def test_zero_scale_means_default_scale(zero):
    """Upstream NKI computes ``softmax_scale or 1 / sqrt(d_head)``: 0.0 selects the default."""
    inputs = good_inputs()
    a = numbafa.attention_bwd(**inputs, softmax_scale=None)
    b = numbafa.attention_bwd(**inputs, softmax_scale=zero)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    q, k, v = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]
    np.testing.assert_array_equal(numbafa.attention_fwd(q, k, v, softmax_scale=zero)[0],
                                  numbafa.attention_fwd(q, k, v)[0])


def test_negative_scale_is_allowed_and_correct():
    from numbafa import golden
    from _tolerances import FLOAT32, assert_close

    inputs = good_inputs()
    q, k, v, dy = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], inputs["dy_ref"]
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, softmax_scale=-0.3, lse_layout="natural")
    o_exp, lse_exp = golden.attention_fwd(q, k, v, use_causal_mask=True, softmax_scale=-0.3)
    assert_close(o, o_exp, FLOAT32, "o")
    grads = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, softmax_scale=-0.3)
    expected = golden.attention_bwd(q, k, v, None, dy, None, use_causal_mask=True, softmax_scale=-0.3)
    for got, exp, name in zip(grads, expected, ("dq", "dk", "dv")):
        assert_close(got, exp, FLOAT32, name)


def test_validation_documents_the_scale_and_window_conventions():
    from numbafa.checks import validation

    doc = " ".join(validation.__doc__.split())
    assert "softmax_scale or 1 / sqrt(d_head)" in doc and "negative" in doc and "float32" in doc
    assert "sliding_window" in doc and "< 1" in doc


@pytest.mark.parametrize("with_sinks", [False, True])
def test_empty_batch_gives_empty_outputs(with_sinks):
    """bs = 0 is an empty problem (like seqlen 0): empty outputs of the right shapes."""
    inputs = {name: x[:0] for name, x in good_inputs().items()}
    sinks = np.zeros((0, H, 2), np.float32) if with_sinks else None
    q, k, v = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]
    o, lse = numbafa.attention_fwd(q, k, v, sinks_ref=sinks, use_causal_mask=True)
    assert o.shape == (0, H, D, S) and lse.shape == (0, H, 128, S // 128)
    grads = numbafa.attention_bwd(q, k, v, o, inputs["dy_ref"], lse, sinks_ref=sinks, use_causal_mask=True)
    assert [g.shape for g in grads] == [(0, H, D, S), (0, HKV, D, S), (0, HKV, D, S)] + \
        ([(0, H, 2)] if with_sinks else [])


def test_zero_heads_and_head_dim_stay_errors():
    with pytest.raises(ValueError, match="nheads \\(q_ref.shape\\[1\\]\\) must be >= 1, got 0"):
        numbafa.attention_fwd(np.zeros((1, 0, 4, 8), np.float32), np.zeros((1, 1, 4, 8), np.float32),
                              np.zeros((1, 1, 4, 8), np.float32))


def test_display_names_and_layout_in_messages():
    """What numbafa.attention relies on: messages in the caller's names and layout."""
    from numbafa import layout
    from numbafa.checks.options import AttentionOptions, Caller
    from numbafa.checks.validation import validate_fwd_inputs

    q = np.zeros((1, 256, 4, 16), np.float32)           # bshd
    k = np.zeros((1, 256, 2, 8), np.float32)
    caller = Caller({"q_ref": "q", "k_ref": "k", "v_ref": "v", "sinks_ref": "sinks"}, "bshd")
    qn, kn = layout.to_neuron(q, "bshd"), layout.to_neuron(k, "bshd")
    with pytest.raises(ValueError) as info:
        validate_fwd_inputs(qn, kn, kn, AttentionOptions(), caller)
    assert str(info.value) == "k must have shape (1, seqlen_k, nheads_kv, 16) to match q, got (1, 256, 2, 8)"
    with pytest.raises(ValueError, match=r"^d_head \(q.shape\[3\]\) must be >= 1, got 0$"):
        validate_fwd_inputs(qn[:, :, :0], kn[:, :, :0], kn[:, :, :0], AttentionOptions(), caller)
    with pytest.raises(TypeError, match=r"^v must have the dtype of q \(float32\), got float64$"):
        validate_fwd_inputs(qn, qn, qn.astype(np.float64), AttentionOptions(), caller)


# --- checks remembered between calls (numbafa.checks.validation._metadata) ---------------------------

def test_a_remembered_shape_still_has_its_values_checked():
    """A second call with the shapes and options of a valid one skips only the shape/option
    checks: NaN inputs, NaN bounds and non-finite sinks are still caught."""
    f = good_inputs()
    bounds = dict(bound_min=np.zeros(S, np.float32), bound_max=np.full(S, S, np.float32))
    sinks = np.zeros((BS, H), np.float32)
    numbafa.attention_bwd(**f, **bounds, sinks_ref=sinks)
    with pytest.raises(ValueError, match="q_ref must be finite, got 1 NaN/inf"):
        numbafa.attention_bwd(**dict(f, q_ref=with_nan(f["q_ref"])), **bounds, sinks_ref=sinks)
    with pytest.raises(ValueError, match="bound_max must not contain NaN"):
        numbafa.attention_bwd(**f, **dict(bounds, bound_max=with_nan(bounds["bound_max"])), sinks_ref=sinks)
    with pytest.raises(ValueError, match="sinks_ref must be finite"):
        numbafa.attention_bwd(**f, **bounds, sinks_ref=with_nan(sinks, np.inf))
    with pytest.raises(ValueError, match="lse_ref must not contain NaN or -inf"):
        numbafa.attention_bwd(**dict(f, lse_ref=with_nan(f["lse_ref"])), **bounds, sinks_ref=sinks)


@pytest.mark.parametrize("dtype, below, fine", [(np.float32, 100.0, 50.0), (ml_dtypes.bfloat16, 100.0, 50.0),
                                                 (np.float64, 800.0, 100.0)], ids=["float32", "bf16", "float64"])
def test_an_lse_far_below_the_scores_is_named_instead_of_nan_gradients(dtype, below, fine):
    """``exp(s - lse)`` overflows the arithmetic where the lse lies ~89 (float64: ~710) below a
    row's score, and the gradients would come out NaN/inf: the error names lse_ref and the first
    such gradient. An lse merely too small for its scores, within the range, gives finite ones."""
    f = good_inputs(dtype)
    qkv = (f["q_ref"], f["k_ref"], f["v_ref"])
    o, lse = numbafa.attention_fwd(*qkv)
    arith = "float64" if dtype == np.float64 else "float32"
    bound = 710 if dtype == np.float64 else 89
    with pytest.raises(ValueError, match=rf"^lse_ref must be the log-sum-exp of these inputs' scores: the gradient "
                                         rf"dq came out with \d+ NaN/inf element\(s\), as exp\(scores - lse_ref\) "
                                         rf"overflows {arith} where a score exceeds its row's lse_ref by about "
                                         rf"{bound} or more"):
        numbafa.attention_bwd(*qkv, o, f["dy_ref"], lse - lse.dtype.type(below))
    grads = numbafa.attention_bwd(*qkv, o, f["dy_ref"], lse - lse.dtype.type(fine))
    assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in grads)


def test_a_remembered_call_does_not_let_other_types_through():
    # True passed; 1 has the same hash and value but is not a bool.
    f = good_inputs()
    numbafa.attention_bwd(**f, use_causal_mask=True, softmax_scale=0.5)
    with pytest.raises(TypeError, match="use_causal_mask must be a bool, got int"):
        numbafa.attention_bwd(**f, use_causal_mask=1, softmax_scale=0.5)
    numbafa.attention_bwd(**f, sliding_window=8, use_causal_mask=True)
    with pytest.raises(TypeError, match="sliding_window must be an int or None, got float"):
        numbafa.attention_bwd(**f, sliding_window=8.0, use_causal_mask=True)


def test_a_remembered_dropout_call_takes_each_calls_seed_and_offset():
    f = good_inputs()
    kw = dict(dropout_p=0.25, seed=7)
    o1, _ = numbafa.attention_fwd(f["q_ref"], f["k_ref"], f["v_ref"], **kw, seed_offset=0)
    o2, _ = numbafa.attention_fwd(f["q_ref"], f["k_ref"], f["v_ref"], **kw, seed_offset=1)
    o3, _ = numbafa.attention_fwd(f["q_ref"], f["k_ref"], f["v_ref"], dropout_p=0.25, seed=8)
    o1b, _ = numbafa.attention_fwd(f["q_ref"], f["k_ref"], f["v_ref"], **kw, seed_offset=0)
    assert not np.array_equal(o1, o2) and not np.array_equal(o1, o3)
    np.testing.assert_array_equal(o1, o1b)
    with pytest.raises(ValueError, match="seed_offset must be in"):
        numbafa.attention_fwd(f["q_ref"], f["k_ref"], f["v_ref"], **kw, seed_offset=2 ** 64)


def test_the_remembered_checks_are_bounded():
    from numbafa.checks import validation

    q = np.ones((1, 1, 4, 1), np.float32)
    for n in range(validation._CHECKED.limit + 5):
        numbafa.attention_fwd(q, q, q, softmax_scale=1.0 + n, lse_layout="natural")
        assert len(validation._CHECKED) <= validation._CHECKED.limit


@pytest.mark.parametrize("seqlen", [1, 3])
def test_length_one_axes_with_any_strides_are_taken(seqlen):
    """NumPy calls a transposed seqlen-1 view C-contiguous although its last stride is not the
    item size (the torch adapter's views of [batch, seq, heads, dim] tensors, say); it once
    reached the GEMM as such and failed "operands need a unit inner stride"."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, seqlen, 16)).astype(np.float32)   # [bs, heads, seq, dim]
    view = x.transpose(0, 1, 3, 2)                                   # Neuron layout, a view
    dense = np.ascontiguousarray(view)
    o, lse = numbafa.attention_fwd(view, view, view, lse_layout="natural")
    o2, lse2 = numbafa.attention_fwd(dense, dense, dense, lse_layout="natural")
    np.testing.assert_array_equal(o, o2)
    grads = numbafa.attention_bwd(view, view, view, o, view, lse)
    for a, b in zip(grads, numbafa.attention_bwd(dense, dense, dense, o2, dense, lse2)):
        np.testing.assert_array_equal(a, b)


# --- calls remembered whole (numbafa.pipeline.core._RECIPES) ------------------------------------------

def _boom(*args, **kwargs):
    raise AssertionError("the full path ran")


def test_a_remembered_call_skips_the_python_checks_with_the_same_bits(monkeypatch, no_remembered_calls):
    """A call without option arrays or dropout whose metadata and scalar options a successful
    call had runs the compiled entry straight away (the checks and the plan remembered)."""
    from numbafa.pipeline import core

    f = good_inputs()
    qkv = (f["q_ref"], f["k_ref"], f["v_ref"])
    first = numbafa.attention_fwd(*qkv, use_causal_mask=True)
    grads = numbafa.attention_bwd(*qkv, f["o_ref"], f["dy_ref"], first[1], use_causal_mask=True)
    monkeypatch.setattr(core, "validate_fwd_inputs", _boom)
    monkeypatch.setattr(core, "validate_bwd_inputs", _boom)
    again = numbafa.attention_fwd(*qkv, use_causal_mask=True)
    grads2 = numbafa.attention_bwd(*qkv, f["o_ref"], f["dy_ref"], first[1], use_causal_mask=True)
    for a, b in zip(first + grads, again + grads2):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(AssertionError, match="the full path ran"):   # other options: the full path
        numbafa.attention_fwd(*qkv, use_causal_mask=False)
    with pytest.raises(AssertionError, match="the full path ran"):   # other strides: the full path
        numbafa.attention_fwd(np.asfortranarray(f["q_ref"]), *qkv[1:], use_causal_mask=True)


def test_the_public_functions_find_a_remembered_call_before_building_their_options(monkeypatch,
                                                                                   no_remembered_calls):
    """numbafa.attention_fwd / attention_bwd look a call up from their arguments as given
    (core.remembered_fwd / remembered_bwd): a remembered call builds no AttentionOptions; a call
    with an option array, dropout or other scalars does, and takes the full path."""
    from numbafa import api

    f = good_inputs()
    qkv = (f["q_ref"], f["k_ref"], f["v_ref"])
    first = numbafa.attention_fwd(*qkv, use_causal_mask=True, softmax_scale=0.5)
    grads = numbafa.attention_bwd(*qkv, f["o_ref"], f["dy_ref"], first[1], use_causal_mask=True, softmax_scale=0.5)
    monkeypatch.setattr(api, "AttentionOptions", _boom)
    again = numbafa.attention_fwd(*qkv, use_causal_mask=True, softmax_scale=0.5)
    grads2 = numbafa.attention_bwd(*qkv, f["o_ref"], f["dy_ref"], first[1], use_causal_mask=True, softmax_scale=0.5)
    for a, b in zip(first + grads, again + grads2):
        np.testing.assert_array_equal(a, b)
    sinks = np.zeros(f["q_ref"].shape[1], np.float32)
    for kwargs in (dict(softmax_scale=0.25), dict(softmax_scale=0.5, sinks_ref=sinks),
                   dict(softmax_scale=0.5, dropout_p=0.1, seed=1), dict(softmax_scale=0.5, lse_layout="natural")):
        with pytest.raises(AssertionError, match="the full path ran"):
            numbafa.attention_fwd(*qkv, use_causal_mask=True, **kwargs)
    with pytest.raises(AssertionError, match="the full path ran"):   # 1 is not True
        numbafa.attention_bwd(*qkv, f["o_ref"], f["dy_ref"], first[1], use_causal_mask=1, softmax_scale=0.5)


def test_a_remembered_call_still_checks_values_and_words_errors_as_the_caller_did():
    f = good_inputs()
    qkv = (f["q_ref"], f["k_ref"], f["v_ref"])
    o, lse = numbafa.attention_fwd(*qkv)
    numbafa.attention_bwd(*qkv, o, f["dy_ref"], lse)
    with pytest.raises(ValueError, match=r"^q_ref must be finite, got 1 NaN/inf element\(s\) of 16384$"):
        numbafa.attention_fwd(with_nan(f["q_ref"]), *qkv[1:])
    with pytest.raises(ValueError, match=r"^dy_ref must be finite, got 1 NaN/inf element\(s\) of 16384$"):
        numbafa.attention_bwd(*qkv, o, with_nan(f["dy_ref"], np.inf), lse)
    with pytest.raises(ValueError, match="^lse_ref must not contain NaN or -inf"):
        numbafa.attention_bwd(*qkv, o, f["dy_ref"], with_nan(lse, -np.inf))
    with pytest.raises(FloatingPointError, match="^the attention scores"):
        numbafa.attention_fwd(f["q_ref"] * np.float32(1e30), f["k_ref"] * np.float32(1e30), f["v_ref"])
    with pytest.raises(FloatingPointError, match="^the attention scores"):   # its second call, remembered
        numbafa.attention_fwd(f["q_ref"] * np.float32(1e30), f["k_ref"] * np.float32(1e30), f["v_ref"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_remembered_calls_follow_the_arrays_layout_and_flags(dtype):
    """Arrays of one Neuron shape in other memory orders, read-only or not, each with their own
    remembered call: every result is the full path's on a fresh copy."""
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    f = good_inputs(dt)
    q = f["q_ref"]
    bshd = np.ascontiguousarray(q.transpose(0, 3, 1, 2)).transpose(0, 2, 3, 1)
    readonly = q.copy()
    readonly.flags.writeable = False
    expected = numbafa.attention_fwd(q.copy(), f["k_ref"], f["v_ref"])
    rest = (f["k_ref"], f["v_ref"], expected[0], f["dy_ref"], expected[1])
    expected_grads = numbafa.attention_bwd(q.copy(), *rest)
    for _ in range(2):
        for variant in (q, bshd, readonly):
            o, lse = numbafa.attention_fwd(variant, f["k_ref"], f["v_ref"])
            assert o.dtype == expected[0].dtype and lse.flags.c_contiguous
            np.testing.assert_array_equal(o.astype(np.float32), expected[0].astype(np.float32))
            np.testing.assert_array_equal(lse, expected[1])
            for got, want in zip(numbafa.attention_bwd(variant, *rest), expected_grads):
                assert got.dtype == want.dtype
                np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
