"""numbafa.attention / ctx.backward, and the NumPy training example."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re

import numpy as np
import pytest

import numbafa
from numbafa import functional, golden, layout

from _tolerances import FLOAT32, FLOAT64, assert_close

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_numpy.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_numpy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("d_v", [32, 20], ids=["one-head-dim", "head-dim-v"])
@pytest.mark.parametrize("name", ["bshd", "bhsd", "neuron"])
def test_attention_and_backward_match_golden(name, d_v):
    rng = np.random.default_rng(0)
    b, h, hkv, s, d = 2, 4, 2, 200, 32
    qn = rng.standard_normal((b, h, d, s)).astype(np.float32)
    kn, vn = (rng.standard_normal((b, hkv, dim, s)).astype(np.float32) for dim in (d, d_v))
    don = rng.standard_normal((b, h, d_v, s)).astype(np.float32)
    sinks = rng.standard_normal((b, h)).astype(np.float32)
    q, k, v, do = (np.ascontiguousarray(layout.from_neuron(x, name)) for x in (qn, kn, vn, don))
    o, ctx = numbafa.attention(q, k, v, sinks=sinks, use_causal_mask=True, layout=name)
    o_exp, _ = golden.attention_fwd(qn, kn, vn, sinks=sinks, use_causal_mask=True)
    assert_close(layout.to_neuron(o, name), o_exp, FLOAT32, "o")
    dq, dk, dv, dsinks = ctx.backward(do)
    expected = golden.attention_bwd(qn, kn, vn, None, don, None, sinks_ref=sinks, use_causal_mask=True)
    assert o.shape == do.shape
    for got, exp, x, nm in zip((dq, dk, dv), expected, (q, k, v), ("dq", "dk", "dv")):
        assert got.shape == x.shape
        assert_close(layout.to_neuron(got, name), exp, FLOAT32, nm)
    assert_close(dsinks, expected[3], FLOAT32, "dsinks")


def test_float64_through_the_context():
    rng = np.random.default_rng(1)
    qn, kn, vn, don = (rng.standard_normal(shape) for shape in ((1, 4, 16, 130), (1, 2, 16, 130), (1, 2, 12, 130),
                                                                 (1, 4, 12, 130)))
    sinks = rng.standard_normal(4)
    q, k, v, do = (np.ascontiguousarray(layout.from_neuron(x, "bhsd")) for x in (qn, kn, vn, don))
    o, ctx = numbafa.attention(q, k, v, sinks=sinks, use_causal_mask=True, sliding_window=50, layout="bhsd")
    o_exp, _ = golden.attention_fwd(qn, kn, vn, sinks=np.broadcast_to(sinks, (1, 4)), use_causal_mask=True,
                                    sliding_window=50)
    assert o.dtype == np.float64
    assert_close(layout.to_neuron(o, "bhsd"), o_exp, FLOAT64, "o")
    grads = ctx.backward(do)
    expected = golden.attention_bwd(qn, kn, vn, None, don, None, sinks_ref=np.broadcast_to(sinks, (1, 4)),
                                    use_causal_mask=True, sliding_window=50)
    for got, exp, name in zip(grads[:3], expected, ("dq", "dk", "dv")):
        assert got.dtype == np.float64
        assert_close(layout.to_neuron(got, "bhsd"), exp, FLOAT64, name)
    assert grads[3].dtype == np.float64 and grads[3].shape == (4,)
    assert_close(grads[3], expected[3].sum(axis=0), FLOAT64, "dsinks")


def test_context_holds_nothing_quadratic():
    s = 512
    q = np.ones((1, s, 1, 8), np.float32)
    _, ctx = numbafa.attention(q, q, q)
    for f in dataclasses.fields(ctx):
        value = getattr(ctx, f.name)
        if isinstance(value, np.ndarray):
            assert value.size <= 8 * s, f.name


def test_backward_checks_do():
    q = np.ones((1, 16, 2, 8), np.float32)
    _, ctx = numbafa.attention(q, q, q)
    with pytest.raises(ValueError, match="do must have the shape of o \\(1, 16, 2, 8\\), got \\(1, 2, 16, 8\\)"):
        ctx.backward(np.ones((1, 2, 16, 8), np.float32))
    with pytest.raises(TypeError, match="do must be a numpy.ndarray"):
        ctx.backward(None)
    with pytest.raises(ValueError, match="layout must be one of"):
        numbafa.attention(q, q, q, layout="sbhd")


def test_training_loss_decreases():
    example = load_example()
    losses = example.train(steps=40, seq=64, bsz=4, log_every=0)
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses


def test_training_gradients_match_finite_differences():
    """The hand-chained gradients (attention's included) against central differences."""
    example = load_example()
    vocab = len(set(example.TEXT))
    params = example.init_params(vocab, channels=8, heads=2, kv_heads=1, head_dim=4, seed=1)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, vocab, (2, 12))
    targets = rng.integers(0, vocab, (2, 12))
    _, grads = example.loss_and_grads(params, tokens, targets)
    eps = 1e-2
    for key in ("Wq", "Wk", "Wv", "Wo", "Wout", "E"):
        g = grads[key]
        flat = np.argsort(np.abs(g).ravel())[-6:]          # the largest entries: well above noise
        for idx in flat:
            pos = np.unravel_index(idx, g.shape)
            saved = params[key][pos]
            params[key][pos] = saved + eps
            up, _ = example.loss_and_grads(params, tokens, targets)
            params[key][pos] = saved - eps
            down, _ = example.loss_and_grads(params, tokens, targets)
            params[key][pos] = saved
            numeric = (up - down) / (2 * eps)
            # measured: <= 0.3 % (float32 loss, eps 1e-2); a 5 % error in any weight fails
            assert abs(numeric - g[pos]) <= 1e-2 * abs(g[pos]), (key, pos, numeric, g[pos])


def _bshd(b=1, s=64, h=4, hkv=2, d=8, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, h, d)).astype(dtype)
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v


Q, K, V = _bshd()
NAMED_ERRORS = [
    # (arguments of numbafa.attention, exception, the whole message or its start)
    (dict(q=Q.tolist()), TypeError, "q must be a numpy.ndarray, got list"),
    (dict(k=K[0]), ValueError, "k must be 4-D [batch, seq, heads, head_dim] for layout='bshd', got shape (64, 2, 8)"),
    (dict(q=Q.astype(np.int32)), TypeError, "q must be float32, float64, float16 or bfloat16 (ml_dtypes.bfloat16), "
                                            "got int32"),
    (dict(v=V.astype(np.float64)), TypeError, "v must have the dtype of q (float32), got float64"),
    (dict(k=K[..., :4]), ValueError, "k must have shape (1, seqlen_k, nheads_kv, 8) to match q, got (1, 64, 2, 4)"),
    (dict(v=V[:, :32]), ValueError, "v must have shape (1, 64, 2, d_head_v) to match k, got (1, 32, 2, 8)"),
    (dict(k=np.zeros((1, 64, 3, 8), np.float32), v=np.zeros((1, 64, 3, 8), np.float32)), ValueError,
     "nheads (4) must be a multiple of nheads_kv (k.shape[2]), got nheads_kv=3"),
    (dict(q=Q[..., :0], k=K[..., :0], v=V[..., :0]), ValueError, "d_head (q.shape[3]) must be >= 1, got 0"),
    (dict(k=K[:, :32], v=V[:, :32], use_causal_mask=True), ValueError,
     "use_causal_mask=True requires seqlen_q == seqlen_k, got seqlen_q=64, seqlen_k=32"),
    (dict(q=np.where(np.arange(8) == 3, np.nan, Q).astype(np.float32)), ValueError,
     "q must be finite, got 256 NaN/inf element(s) of 2048"),
    (dict(sinks=np.zeros((1, 3), np.float32)), ValueError,
     "sinks must have shape (4,) [nheads], (1, 4) [bs, nheads] or (1, 4, num_sinks >= 1) [bs, nheads, num_sinks], got (1, 3)"),
    (dict(sinks=np.zeros((1, 4), np.float64)), TypeError,
     "sinks must be float32 or bfloat16 (float64 or float16 only for inputs of that dtype), got float64"),
    (dict(bound_min=np.zeros(64, np.float32)), ValueError,
     "bound_min and bound_max must be given together, got only bound_min"),
]


@pytest.mark.parametrize("changes,exc,message", NAMED_ERRORS, ids=[e[2][:50] for e in NAMED_ERRORS])
def test_errors_name_the_callers_arguments(changes, exc, message):
    args = {**dict(q=Q, k=K, v=V), **changes}
    with pytest.raises(exc) as info:
        numbafa.attention(**args)
    assert str(info.value).startswith(message)
    assert "_ref" not in str(info.value)
    # One clean error: no 'During handling of the above exception' chain.
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_backward_errors_name_do():
    _, ctx = numbafa.attention(Q, Q[:, :, :2], Q[:, :, :2])
    with pytest.raises(TypeError, match=r"^do must have the dtype of q \(float32\), got float64$"):
        ctx.backward(Q.astype(np.float64))
    bad = Q.copy()
    bad[0, 5, 1, 2] = np.inf
    with pytest.raises(ValueError, match=r"^do must be finite, got 1 NaN/inf element\(s\) of 2048$"):
        ctx.backward(bad)


WATCHED = ["q", "k", "v", "o", "sinks", "bound_min", "bound_max"]


@pytest.mark.parametrize("changed", WATCHED)
def test_inputs_changed_in_place_before_backward_are_detected(changed):
    """The context keeps the caller's arrays, not copies: an in-place change would silently change
    the gradients, so the backward compares fingerprints taken by the forward (whole arrays at
    this size: one changed element is always seen)."""
    q, k, v = (x.copy() for x in (Q, K, V))
    arrays = dict(q=q, k=k, v=v, sinks=np.ones((1, 4), np.float32),
                  bound_min=np.zeros(64, np.float32), bound_max=np.full(64, 64, np.float32))
    o, ctx = numbafa.attention(**arrays, use_causal_mask=True)
    do = np.ones_like(o)
    first = ctx.backward(do)
    again = ctx.backward(do)                       # unchanged inputs: fine, and deterministic
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    target = o if changed == "o" else arrays[changed]
    target[(0,) * target.ndim] += 1.0              # one element, in place
    with pytest.raises(ValueError) as info:
        ctx.backward(do)
    message = str(info.value)
    assert message.startswith(f"{changed} was modified in place after numbafa.attention() returned")
    assert re.search(r"\(fingerprint 0x[0-9a-f]{16} at the forward, 0x[0-9a-f]{16} now\)", message), message


@pytest.mark.parametrize("change", ["scale", "new batch", "one run"])
def test_large_inputs_changed_in_place_are_detected(change):
    """Past FINGERPRINT_WHOLE elements the fingerprint samples runs of elements; the changes a
    training loop makes -- ``x *= 2``, a new batch written into the same buffer, any contiguous
    part of at least 2 n / FINGERPRINT_RUNS elements -- are seen whatever the seed."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 256, 2, 32)).astype(np.float32) for _ in range(3))
    assert q.size > 4 * functional.FINGERPRINT_SAMPLES
    for _ in range(5):                             # five contexts, five seeds
        o, ctx = numbafa.attention(q, k, v, use_causal_mask=True)
        if change == "scale":
            k *= 2
        elif change == "new batch":
            k[...] = rng.standard_normal(k.shape)
        else:
            part = 2 * k.size // functional.FINGERPRINT_RUNS
            start = int(rng.integers(0, k.size - part))
            k.reshape(-1)[start:start + part] += 1.0
        with pytest.raises(ValueError, match="^k was modified in place"):
            ctx.backward(np.ones_like(o))


def test_fingerprint_covers_every_element_of_small_arrays_and_the_values_bits():
    x = np.zeros(functional.FINGERPRINT_WHOLE, np.float32)   # a one-tile head's q: B1 H1 S128 D64
    assert x.size == 128 * 64
    base = functional.fingerprint(x, 1)
    assert functional.fingerprint(x, 1) == base                     # deterministic
    for i in range(x.size):                                         # every element counts
        y = x.copy()
        y[i] = -0.0                                                 # a bit pattern, not a value, changes
        assert functional.fingerprint(y, 1) != base, i
    big = np.arange(10 * functional.FINGERPRINT_SAMPLES, dtype=np.float64)
    assert functional.fingerprint(big, 1) != functional.fingerprint(big, 2)   # the seed places the runs
    view = big.reshape(40, -1)[:, ::2]                              # a strided view: its values in C order
    assert functional.fingerprint(view, 3) == functional.fingerprint(np.ascontiguousarray(view), 3)


def test_empty_batch_through_attention():
    q, k, v = (x[:0] for x in (Q, K, V))
    sinks = np.zeros((0, 4, 2), np.float32)
    o, ctx = numbafa.attention(q, k, v, sinks=sinks, use_causal_mask=True)
    assert o.shape == q.shape
    dq, dk, dv, dsinks = ctx.backward(np.zeros_like(o))
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, v.shape, sinks.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_head_sinks_are_the_batch_shared_sinks(dtype):
    """Sinks ``[nheads]`` (as the torch and JAX adapters take them) in numbafa.attention and the
    NumPy API: the o of the same sinks given per batch, and dsinks ``[nheads]`` in the sinks'
    dtype, the float32 sum over the batch of the per-batch dsinks rounded once."""
    import ml_dtypes
    sdt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((2, 128, 4, 16)).astype(np.float32) for _ in range(4))
    sinks = rng.standard_normal(4).astype(sdt)
    per_batch = np.broadcast_to(sinks.astype(np.float32), (2, 4)).copy()
    o, ctx = numbafa.attention(q, k, v, sinks=sinks, use_causal_mask=True)
    o_b, ctx_b = numbafa.attention(q, k, v, sinks=per_batch, use_causal_mask=True)
    np.testing.assert_array_equal(o, o_b)
    grads, grads_b = ctx.backward(do), ctx_b.backward(do)
    for g, e in zip(grads[:3], grads_b[:3]):
        np.testing.assert_array_equal(g, e)
    assert grads[3].shape == (4,) and grads[3].dtype == sdt
    expected = grads_b[3].sum(axis=0, dtype=np.float32).astype(sdt)
    np.testing.assert_array_equal(grads[3].view(np.uint8), expected.view(np.uint8))
