"""numbafa.nb: the kernels from a user's own @njit code, bit for bit the Python API's, for every feature
and dtype (a user's compile, caches, errors and processes: tests/test_nb_users.py)."""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import numbafa
import numbafa.nb as nb

from _nb_cases import api_results, bits, nb_inputs, nb_results
from _problems import Case, make_inputs

# (name, bs, nheads, nheads_kv, d_head, seqlen, options): each a feature of the kernels.
CASES = [
    ("gqa-causal-sinks", 1, 4, 2, 32, 256, dict(use_causal_mask=True, with_sinks=True)),
    ("mqa-split-window", 1, 2, 1, 16, 640, dict(use_causal_mask=True, sliding_window=100)),
    ("packing-scale", 2, 2, 2, 24, 128,
     dict(bound_min=np.repeat(np.float32([0, 64]), 64), bound_max=np.repeat(np.float32([64, 128]), 64),
          softmax_scale=0.3)),
    ("dropout", 1, 2, 1, 16, 256, dict(use_causal_mask=True, dropout_p=0.2, seed=7, seed_offset=3)),
    # d_head (40) for q and k, d_head_v (24) for v, o, dy: one unit, split in two Q chunks
    ("head-dims-split-sinks", 1, 3, 1, (40, 24), 640, dict(use_causal_mask=True, with_sinks=True)),
]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name,bs,nheads,nheads_kv,d_head,seqlen,options", CASES, ids=[c[0] for c in CASES])
def test_the_bits_of_the_python_api(name, bs, nheads, nheads_kv, d_head, seqlen, options, dtype):
    q, k, v, dy, sinks = nb_inputs(bs, nheads, nheads_kv, d_head, seqlen, dtype)
    plan = nb.plan(q, k, v, **options)
    with nb.single_threaded_blas():
        got = nb_results(plan, q, k, v, dy, sinks)
    expected = api_results(q, k, v, dy, sinks, options)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, bits(e))


@numba.njit
def _user_fwd(plan, q, k, v, o, lse):
    numbafa.nb.attention_fwd(plan, q, k, v, o, lse)


@numba.njit
def _user_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv):
    numbafa.nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)


def test_called_from_a_users_njit_function():
    q, k, v, dy, sinks = nb_inputs(1, 4, 2, 32, 256, np.float32)
    plan = nb.plan(q, k, v, use_causal_mask=True)
    got = nb_results(plan, q, k, v, dy, sinks, _user_fwd, _user_bwd)   # no wrap: each pass pins BLAS itself
    for a, e in zip(got, api_results(q, k, v, dy, sinks, dict(use_causal_mask=True))):
        np.testing.assert_array_equal(a, e)


def test_each_pass_runs_inside_the_blas_pin_and_leaves_it(monkeypatch):
    """The passes pin BLAS to one thread around the entry, as the Python API does (a threaded
    OpenBLAS inside the kernels changes the bits: OpenBLAS 0.3.30 Haswell kernels, 42 % of o):
    the pin's two C functions run once each per pass, in order, also when the pass raises. Counted
    by the native pin where it serves (SciPy's OpenBLAS), else by its Python callbacks (also in
    tests/test_blas.py's threadpoolctl path)."""
    import numbafa.compiler.runtime as runtime
    from numbafa.platform import blas
    native = blas._PIN.native()
    seen = []
    monkeypatch.setattr(runtime, "pin", lambda: (seen.append("pin"), blas.pin()))
    monkeypatch.setattr(runtime, "unpin", lambda: (seen.append("unpin"), blas.unpin()))

    def pins_and_unpins():
        if native is not None:
            return native.words[blas._PINS], native.words[blas._UNPINS]
        return seen.count("pin"), seen.count("unpin")

    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    start = pins_and_unpins()
    nb_results(plan, q, k, v, dy, sinks, _user_fwd, _user_bwd)
    assert np.subtract(pins_and_unpins(), start).tolist() == [2, 2] and blas._PIN.active == 0
    assert native is not None or seen == ["pin", "unpin"] * 2
    bad = q.copy()
    bad[0, 0, 0, 0] = np.nan
    start = pins_and_unpins()
    with pytest.raises(ValueError, match="q must be finite"):
        _user_fwd(plan, bad, k, v, np.empty_like(q), np.empty((1, 2, 128, 1), np.float32))
    assert np.subtract(pins_and_unpins(), start).tolist() == [1, 1] and blas._PIN.active == 0


def test_seed_offset_in_njit_code_is_another_plans_mask():
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, dropout_p=0.3, seed=11, seed_offset=0)
    moved = nb.with_seed_offset(plan, 5)
    with nb.single_threaded_blas():
        got = nb_results(moved, q, k, v, dy, sinks)
    for a, e in zip(got, api_results(q, k, v, dy, sinks, dict(dropout_p=0.3, seed=11, seed_offset=5))):
        np.testing.assert_array_equal(a, e)
    assert not nb.with_seed_offset(nb.plan(q, k, v), 5).fwd.dropout.active
    # from Python, the plan's own type: a function compiled for the plan runs the moved one as it is
    assert numba.typeof(moved) == numba.typeof(plan)
    assert moved._replace(fwd=plan.fwd, bwd=plan.bwd) == plan and moved.fwd.dropout.key0 != plan.fwd.dropout.key0


@numba.njit
def _moved(plan, seed_offset):
    return nb.with_seed_offset(plan, seed_offset)


def test_seed_offset_is_checked_as_the_python_apis():
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v, dropout_p=0.3, seed=11)
    for bad, error, message in ((-1, ValueError, "seed_offset must be in \\[0, 2\\*\\*64\\) .*got -1"),
                                (2 ** 64, ValueError, "got 18446744073709551616"),
                                (1.5, TypeError, "seed_offset must be an int .*got float 1.5"),
                                (True, TypeError, "got bool True")):
        with pytest.raises(error, match=message):
            nb.with_seed_offset(plan, bad)
    with pytest.raises(TypeError, match="plan must be a numbafa.nb.plan\\(...\\), got tuple"):
        nb.with_seed_offset(tuple(plan), 1)
    # in njit code: the same checks, as the compiled calls raise them
    largest = 2 ** 64 - 1
    assert _moved(plan, np.uint64(largest)).fwd.dropout.key0 == nb.with_seed_offset(plan, largest).fwd.dropout.key0
    with pytest.raises(ValueError, match="seed_offset must be in \\[0, 2\\*\\*64\\) .*got -1"):
        _moved(plan, -1)
    with pytest.raises(TypeError, match="seed_offset must be an int .*got float64"):
        _moved(plan, 1.5)


def test_strided_and_read_only_arrays_are_taken_too():
    q, k, v, dy, sinks = nb_inputs(1, 2, 2, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    wide = np.zeros((1, 2, 16, 256), np.float32)
    wide[..., ::2] = q
    frozen = k.copy()
    frozen.flags.writeable = False
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 1), np.float32)
    with nb.single_threaded_blas():
        nb.attention_fwd(plan, wide[..., ::2], frozen, v, o, lse)
    o_ref, lse_ref = numbafa.attention_fwd(q, k, v)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)
    # the backward too: inputs of other types than their gradients (read-only, strided, Fortran order)
    expected = numbafa.attention_bwd(q, k, v, o_ref, dy, lse_ref)
    for q_in, k_in in ((wide[..., ::2], frozen), (np.asfortranarray(q), k)):
        grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
        nb.attention_bwd(plan, q_in, k_in, v, o, dy, lse, *grads)
        for a, e in zip(grads, expected):
            np.testing.assert_array_equal(a, e)


def test_an_lse_far_below_the_scores_is_an_error_not_nan_gradients():
    q, k, v, dy, sinks = nb_inputs(1, 2, 2, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    o, lse = numbafa.attention_fwd(q, k, v)
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    with pytest.raises(ValueError, match="^numbafa.nb: lse must be the log-sum-exp of these inputs' scores: the "
                                         "gradient dq came out with 4096 NaN/inf element"):
        nb.attention_bwd(plan, q, k, v, o, dy, lse - np.float32(200), *grads)


def _filled(shape, dtype=np.float32):
    return np.full(shape, 7, dtype)


@pytest.mark.parametrize("bad", ["dq-shape", "k-shape", "lse-shape", "dtype", "no-sinks", "stray-sinks",
                                 "dv-head-dim", "dy-head-dim"])
def test_arrays_that_do_not_match_the_plan_raise_before_writing(bad):
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, (16, 8), 128, np.float32)
    plan = nb.plan(q, k, v, with_sinks=bad == "stray-sinks")
    o, lse = _filled(dy.shape), _filled((1, 2, 128, 1))
    dq, dk, dv = _filled(q.shape), _filled(k.shape), _filled(v.shape)
    args = [plan, q, k, v, o, dy, lse, dq, dk, dv]
    if bad == "dq-shape":
        args[7] = dq = _filled((1, 2, 16, 256))
    elif bad == "k-shape":
        args[2] = np.zeros((1, 2, 16, 128), np.float32)
    elif bad == "lse-shape":
        args[6] = np.zeros((1, 2, 128), np.float32).reshape(1, 2, 1, 128)
    elif bad == "dtype":   # bf16 bits for a float32 plan
        args[1:6] = [x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in (q, k, v, o, dy)]
        args[7:] = [x.astype(np.uint16) for x in (dq, dk, dv)]
    elif bad == "no-sinks":
        plan = args[0] = nb.plan(q, k, v, with_sinks=True)
    elif bad == "dv-head-dim":   # k's shape: the value head dim differs
        args[9] = dv = _filled(k.shape)
    elif bad == "dy-head-dim":
        args[5] = _filled(q.shape)
    with pytest.raises(TypeError if bad == "dtype" else ValueError, match="^numbafa.nb: "):
        nb.attention_bwd(*args)
    for x in args[7:]:
        assert (x == 7).all()


def test_plan_validates_as_the_python_api():
    q, k, v, _, _ = nb_inputs(1, 2, 2, 16, 128, np.float32)
    with pytest.raises(ValueError, match="k must have shape"):
        nb.plan(q, k[:, :, :8], v)
    with pytest.raises(TypeError, match="q must be float32, float64, float16 or bfloat16"):
        nb.plan(q.astype(np.int32), k, v)
    with pytest.raises(ValueError, match="lse_layout='neuron' needs seqlen_q divisible by 128"):
        nb.plan(q[..., :100], k[..., :100], v[..., :100])
    assert nb.plan(q[..., :100], k[..., :100], v[..., :100], lse_layout="natural").lse_natural
    with pytest.raises(TypeError, match="bias must be float32 or the inputs' dtype \\(float32\\), got bfloat16"):
        nb.plan(q, k, v, bias=np.zeros((128, 128), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="sliding_window=8 requires use_causal_mask=True"):
        nb.plan(q, k, v, sliding_window=8)
    with pytest.raises(TypeError, match="with_sinks must be a bool"):
        nb.plan(q, k, v, with_sinks=1)
    bits = nb.plan(q.astype(ml_dtypes.bfloat16).view(np.uint16), k.astype(ml_dtypes.bfloat16),
                   v.astype(ml_dtypes.bfloat16))
    assert bits.kind == nb.BF16
    assert nb.plan(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)).kind == nb.FP16


# ---------------------------------------------------------------------------
# Every feature and dtype of the Python API, bit for bit
# ---------------------------------------------------------------------------

def _api_all(inputs, fwd_kw, bwd_kw):
    """The Python API's ``(o, lse, grads...)`` of a ``make_inputs`` dict (lse natural)."""
    q, k, v, dy = (inputs[key] for key in ("q_ref", "k_ref", "v_ref", "dy_ref"))
    o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural", **fwd_kw)
    return (o, lse) + tuple(numbafa.attention_bwd(q, k, v, o, dy, lse, **bwd_kw))


def _storage(x):
    """The bits of 16-bit floats (nb's arrays for them), other arrays as they are."""
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


def _nb_all(plan, inputs, call_kw, sinks, bias_out):
    """``numbafa.nb``'s ``(o, lse, grads...)`` of the same problem, lse natural."""
    q, k, v, dy = (_storage(inputs[key]) for key in ("q_ref", "k_ref", "v_ref", "dy_ref"))
    bs, nheads, d_v, seqlen = dy.shape
    acc = np.float64 if q.dtype == np.float64 else np.float32
    o, lse = np.empty_like(dy), np.empty((bs, nheads, seqlen), acc)
    nb.attention_fwd(plan, q, k, v, o, lse, sinks=sinks, **call_kw)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    extra = {}
    if sinks is not None:
        extra.update(sinks=sinks, dsinks=np.empty(sinks.shape, acc))
    if bias_out is not None:
        extra["dbias"] = bias_out
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, **call_kw, **extra)
    grads = (dq, dk, dv) + ((extra["dsinks"],) if sinks is not None else ()) + ((bias_out,) if bias_out is not None
                                                                              else ())
    return (o, lse) + grads


FEATURES = {
    # bias with its gradient, ALiBi and a soft cap together
    "variants": (Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True), np.float32,
                 dict(bias=(4, 256, 256), alibi=True, softcap=20.0)),
    "dropout-sinks": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, num_sinks=1), np.float32,
                      dict(dropout_p=0.2, seed=3, seed_offset=9)),
    "float64-sinks": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, num_sinks=2), np.float64, {}),
    "float16-window": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, window=64), np.float16,
                       dict(mixed_precision=True)),
    "bf16-variants-not-mixed": (Case(nheads=2, nheads_kv=2, d_head=32, causal=True), ml_dtypes.bfloat16,
                                dict(bias=(2, 256, 256), alibi=True)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_and_dtype_gives_the_python_apis_bits(name):
    case, dtype, spec = FEATURES[name]
    inputs = make_inputs(case, dtype)
    rng = np.random.default_rng(5)
    acc = np.float64 if dtype == np.float64 else np.float32
    options = {key: spec[key] for key in ("dropout_p", "seed", "seed_offset", "softcap", "mixed_precision")
               if key in spec}
    options.update(case.kwargs())
    call = {}
    if "bias" in spec:
        call["bias"] = rng.standard_normal(spec["bias"]).astype(acc)
    if spec.get("alibi"):
        call["alibi_slopes"] = (2.0 ** -np.arange(1, case.nheads + 1)).astype(acc)
    sinks = inputs.get("sinks_ref")
    dbias = np.empty(call["bias"].shape, acc) if "bias" in call else None
    plan = nb.plan(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], sinks=sinks, lse_layout="natural",
                   return_dbias=dbias is not None, **options, **call)
    got = _nb_all(plan, inputs, call, sinks, dbias)
    expected = _api_all(inputs, dict(options, sinks_ref=sinks, **call),
                        dict(options, sinks_ref=sinks, return_dbias=dbias is not None, **call))
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, _storage(np.asarray(e)))


@numba.njit
def _narrowed(x):
    return nb.to_bf16_bits(x)


def test_the_bf16_conversions_take_their_dtype_only():
    """``to_bf16_bits`` takes float32 (a float64 array would be rounded twice), ``from_bf16_bits``
    uint16: anything else is a TypeError naming the argument, from Python and from njit code;
    the conversions are ml_dtypes' and exact back."""
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3e38], np.float32)
    bits = nb.to_bf16_bits(x)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(nb.from_bf16_bits(bits), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(_narrowed(x), bits)
    for bad in (np.array([1.0039062500001]), np.array([1], np.int32), [1.0], None, x.astype(ml_dtypes.bfloat16)):
        with pytest.raises(TypeError, match="numbafa.nb.to_bf16_bits takes one float32 array x, got "):
            nb.to_bf16_bits(bad)
    for bad in (x, np.array([-1], np.int16)):
        with pytest.raises(TypeError, match="numbafa.nb.from_bf16_bits takes one uint16 array bits, got "):
            nb.from_bf16_bits(bad)
    with pytest.raises(TypeError, match=r"numbafa.nb.to_bf16_bits: x must be a float32 array, got array\(float64"):
        _narrowed(np.array([1.0]))
