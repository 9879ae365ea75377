"""numbafa.jax: custom VJP over host callbacks, under jit, grad and vmap.

References: ``jax.nn.dot_product_attention`` computed in float64 (full,
causal, GQA, local windows) and numbafa's float64 golden (sinks, packing).
Both are float64 references of the same inputs, so float32 results are held
to the project's FLOAT32 rule and bf16 results to BF16_MIXED
(tests/_tolerances.py).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install '.[jax]')")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import numbafa  # noqa: E402
import numbafa.jax as nj  # noqa: E402
from numbafa import golden, layout as nl  # noqa: E402

from _tolerances import BF16_MIXED, FLOAT32, assert_close  # noqa: E402

B, H, HKV, S, D = 2, 4, 2, 160, 32


def x64():
    """Float64 enabled for a block (``jax.enable_x64`` or, in older JAX, its experimental twin)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64
    return enable_x64()


def make(layout="bshd", dtype=np.float32, hkv=HKV, seed=0, dv=D):
    """q, k, v, do (NumPy, ``dtype``) in ``layout``; v and do with head dim ``dv``."""
    rng = np.random.default_rng(seed)

    def a(heads, dim=D):
        shape = (B, S, heads, dim) if layout == "bshd" else (B, heads, S, dim)
        return rng.standard_normal(shape).astype(dtype)

    return a(H), a(hkv), a(hkv, dv), a(H, dv)


def vjp(f, *args):
    """f(*args) and its gradient with respect to every argument, for the cotangent ``do``."""
    *args, do = args
    o, pullback = jax.vjp(f, *args)
    return o, pullback(jnp.asarray(do))


def golden_of(q, k, v, do, layout, sinks=None, **kw):
    args = [nl.to_neuron(np.asarray(x), layout) for x in (q, k, v)]
    s = None if sinks is None else np.asarray(sinks)
    if s is not None and s.ndim == 1:
        s = np.broadcast_to(s, (B, s.shape[0]))
    o, _ = golden.attention_fwd(*args, sinks=s, **kw)
    g = golden.attention_bwd(*args, None, nl.to_neuron(np.asarray(do), layout), None, sinks_ref=s, **kw)
    return o, g


def neuron(x, layout):
    return nl.to_neuron(np.asarray(x), layout)


# ---------------------------------------------------------------------------
# Against jax.nn.dot_product_attention in float64
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 33)],
                         ids=["full", "causal", "window33"])
@pytest.mark.parametrize("hkv", [H, HKV], ids=["mha", "gqa"])
def test_matches_dot_product_attention(layout, causal, window, hkv):
    q, k, v, do = make(layout, hkv=hkv)
    f = jax.jit(lambda q, k, v: nj.attention(q, k, v, causal=causal, window=window, layout=layout))
    o, got = vjp(f, q, k, v, do)

    def bshd(x):
        return x if layout == "bshd" else jnp.swapaxes(x, 1, 2)

    local = None if window is None else (window - 1, 0)
    with x64():
        def ref(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local,
                                                implementation="xla")
        args64 = [bshd(jnp.asarray(x, jnp.float64)) for x in (q, k, v, do)]
        o_ref, expected = vjp(ref, *args64)
        o_ref, expected = np.asarray(o_ref), [np.asarray(e) for e in expected]
    assert o.shape == q.shape and o.dtype == q.dtype
    assert_close(bshd(o), o_ref, FLOAT32, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(bshd(g), e, FLOAT32, name)


def test_the_default_layout_is_jaxs_own_with_a_bias():
    """A JAX user's first call, as with ``jax.nn.dot_product_attention``: ``[batch, seq, heads,
    head_dim]`` arrays and a ``[batch, heads, seq_q, seq_k]`` bias, no ``layout`` given."""
    q, k, v, do = make("bshd", hkv=H)
    bias = np.random.default_rng(3).standard_normal((B, H, S, S)).astype(np.float32)
    o, got = vjp(jax.jit(lambda q, k, v: nj.attention(q, k, v, bias=bias)), q, k, v, do)
    with x64():
        o_ref, expected = vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=jnp.asarray(
            bias, jnp.float64), implementation="xla"), *(jnp.asarray(x, jnp.float64) for x in (q, k, v, do)))
        o_ref, expected = np.asarray(o_ref), [np.asarray(e) for e in expected]
    assert o.shape == q.shape
    assert_close(np.asarray(o), o_ref, FLOAT32, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(np.asarray(g), e, FLOAT32, name)


# ---------------------------------------------------------------------------
# Against the float64 golden: sinks, packing
# ---------------------------------------------------------------------------

CASES = {
    "sinks-heads-causal": dict(sinks=(H,), causal=True),
    "sinks2-window": dict(sinks=(B, H, 2), causal=True, window=40),
    "packing-causal-window": dict(cu_seqlens=(0, 50, 61, 160), causal=True, window=30),
    "packing-sinks-scale": dict(cu_seqlens=(0, 100, 160), sinks=(B, H), softmax_scale=0.3),
}


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_golden(case, layout):
    spec = CASES[case]
    q, k, v, do = make(layout, seed=1)
    kw = dict(causal=spec.get("causal", False), window=spec.get("window"), softmax_scale=spec.get("softmax_scale"),
              layout=layout)
    gkw = dict(use_causal_mask=kw["causal"], sliding_window=kw["window"], softmax_scale=kw["softmax_scale"])
    sinks = None
    if "sinks" in spec:
        sinks = np.random.default_rng(2).standard_normal(spec["sinks"]).astype(np.float32)
    if "cu_seqlens" in spec:
        kw["bound_min"], kw["bound_max"] = nj.cu_seqlens_to_bounds(np.array(spec["cu_seqlens"]))
        gkw["bound_min"], gkw["bound_max"] = np.asarray(kw["bound_min"]), np.asarray(kw["bound_max"])
    if sinks is None:
        o, got = vjp(jax.jit(lambda q, k, v: nj.attention(q, k, v, **kw)), q, k, v, do)
    else:
        o, got = vjp(jax.jit(lambda q, k, v, s: nj.attention(q, k, v, sinks=s, **kw)), q, k, v, sinks, do)
    o_exp, expected = golden_of(q, k, v, do, layout, sinks=sinks, **gkw)
    assert_close(neuron(o, layout), o_exp, FLOAT32, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(neuron(g, layout), e, FLOAT32, name)
    if sinks is not None:
        e = expected[3].sum(axis=0) if sinks.ndim == 1 else expected[3]
        assert got[3].shape == sinks.shape and got[3].dtype == sinks.dtype
        assert_close(got[3], e, FLOAT32, "dsinks")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_value_head_dim_of_its_own_matches_the_golden(layout):
    """v and do with head_dim_v = 24 != head_dim = 32: o's shape (traced), values and gradients."""
    q, k, v, do = make(layout, seed=5, dv=24)
    sinks = np.random.default_rng(6).standard_normal((B, H)).astype(np.float32)
    f = jax.jit(lambda q, k, v, s: nj.attention(q, k, v, sinks=s, causal=True, layout=layout))
    assert jax.eval_shape(f, q, k, v, sinks).shape == do.shape
    o, got = vjp(f, q, k, v, sinks, do)
    o_exp, expected = golden_of(q, k, v, do, layout, sinks=sinks, use_causal_mask=True)
    assert_close(neuron(o, layout), o_exp, FLOAT32, "o")
    for name, g, e, x in zip(("dq", "dk", "dv", "dsinks"), got, expected, (q, k, v, sinks)):
        assert g.shape == x.shape
        assert_close(neuron(g, layout) if g.ndim == 4 else g, e, FLOAT32, name)


def test_float64_passes_check_grads():
    """Under jax_enable_x64, float64 arrays run the float64 kernels: check_grads' finite
    differences agree (reverse mode), with sinks, GQA, causal, a window and two head dims."""
    from jax.test_util import check_grads
    rng = np.random.default_rng(9)
    with x64():
        q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((1, 12, 2, 4), (1, 12, 1, 4), (1, 12, 1, 3)))
        sinks = jnp.asarray(rng.standard_normal(2))

        def f(q, k, v, s):
            return nj.attention(q, k, v, sinks=s, causal=True, window=5, layout="bshd")

        assert f(q, k, v, sinks).dtype == jnp.float64
        check_grads(f, (q, k, v, sinks), order=1, modes=("rev",))


def test_grad_of_a_loss_gives_the_sinks_gradient():
    q, k, v, do = make(seed=3)
    sinks = np.zeros(H, np.float32)

    def loss(sinks):
        return jnp.sum(nj.attention(q, k, v, causal=True, window=48, sinks=sinks, layout="bshd") * do)

    got = jax.jit(jax.grad(loss))(sinks)
    _, expected = golden_of(q, k, v, do, "bshd", sinks=sinks, use_causal_mask=True, sliding_window=48)
    assert_close(got, expected[3].sum(axis=0), FLOAT32, "dsinks")


# ---------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------

def test_vmap_folds_the_mapped_axis_into_the_batch():
    q, k, v, do = make(seed=4)
    qs = np.stack([q, 0.5 * q, -q])
    sinks = np.random.default_rng(5).standard_normal((3, H)).astype(np.float32)

    def loss(q, sinks):
        return jnp.sum(nj.attention(q, k, v, causal=True, sinks=sinks, layout="bshd") * do)

    values, grads = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1))))(qs, sinks)
    for i in range(3):
        value, grad = jax.value_and_grad(loss, argnums=(0, 1))(qs[i], sinks[i])
        np.testing.assert_array_equal(values[i], value)
        np.testing.assert_array_equal(grads[0][i], grad[0])
        np.testing.assert_array_equal(grads[1][i], grad[1])


def test_vmap_over_packing_bounds_loops():
    """Different bounds per mapped element cannot share one call: each gets its own."""
    q, k, v, do = make(seed=6)
    bounds = [nj.cu_seqlens_to_bounds(np.array(cu)) for cu in ((0, 160), (0, 80, 160))]
    bmin, bmax = (jnp.stack(b) for b in zip(*bounds))

    def f(q, bmin, bmax):
        return nj.attention(q, k, v, causal=True, bound_min=bmin, bound_max=bmax, layout="bshd")

    out = jax.vmap(f, in_axes=(None, 0, 0))(q, bmin, bmax)
    dq = jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a) * do)), in_axes=(None, 0, 0))(q, bmin, bmax)
    for i in range(2):
        np.testing.assert_array_equal(out[i], f(q, bmin[i], bmax[i]))
        np.testing.assert_array_equal(dq[i], jax.grad(lambda q: jnp.sum(f(q, bmin[i], bmax[i]) * do))(q))
    assert not np.array_equal(out[0], out[1])


# ---------------------------------------------------------------------------
# bfloat16
# ---------------------------------------------------------------------------

def test_bf16_is_numbafa_bit_for_bit():
    q, k, v, do = make(dtype=ml_dtypes.bfloat16, seed=7)
    sinks = np.random.default_rng(8).standard_normal((B, H)).astype(np.float32)
    f = jax.jit(lambda q, k, v, s: nj.attention(q, k, v, causal=True, window=64, sinks=s, layout="bshd"))
    o, got = vjp(f, q, k, v, sinks, do)
    assert o.dtype == jnp.bfloat16 and np.asarray(o).dtype == ml_dtypes.bfloat16
    o_np, ctx = numbafa.attention(q, k, v, sinks=sinks, use_causal_mask=True, sliding_window=64,
                                  mixed_precision=True, layout="bshd")
    expected = ctx.backward(do)
    np.testing.assert_array_equal(bits(o), bits(o_np))
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert np.asarray(g).dtype == e.dtype, name
        np.testing.assert_array_equal(bits(g), bits(e), err_msg=name)


def test_the_callbacks_read_only_buffers_compile_no_second_kernel():
    """pure_callback hands the host read-only buffers: the kernels compiled for the NumPy API's
    arrays run them (no second specialization of an entry, the launcher or a work item)."""
    from numbafa.kernels import backward, entry, forward, launch

    q, k, v, do = make(seed=3)
    o_np, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bshd")
    expected = ctx.backward(do)
    kernels = (entry.backward_entry, backward.bwd_work_item, entry.forward_entry, forward.fwd_work_item,
               launch.run_items)
    before = [len(kernel.signatures) for kernel in kernels]
    o, got = vjp(jax.jit(lambda q, k, v: nj.attention(q, k, v, causal=True, layout="bshd")), q, k, v, do)
    assert [len(kernel.signatures) for kernel in kernels] == before
    np.testing.assert_array_equal(bits(o), bits(o_np))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(bits(g), bits(e))


def bits(a):
    """The bit patterns of a float32 or bf16 array (bitwise comparison, -0.0 != 0.0)."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype == ml_dtypes.bfloat16 else np.uint32)


def test_bf16_accuracy_against_golden():
    q, k, v, do = make(dtype=ml_dtypes.bfloat16, seed=9)
    o, got = vjp(jax.jit(lambda q, k, v: nj.attention(q, k, v, causal=True, layout="bshd")), q, k, v, do)
    o_exp, expected = golden_of(q, k, v, do, "bshd", use_causal_mask=True)
    assert_close(neuron(o, "bshd").astype(np.float32), o_exp, BF16_MIXED, "o")
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(neuron(g, "bshd").astype(np.float32), e, BF16_MIXED, name)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, error, message", [
    (dict(q=np.zeros((B, S, H, D), np.int32)), TypeError,
     r"^q must be float32, float64, float16 or bfloat16, got int32"),
    (dict(k=np.zeros((B, S, HKV, 16), np.float32)), ValueError,
     r"^k must have shape \(2, seq_k, heads_kv, 32\) to match q, got \(2, 160, 2, 16\)"),
    (dict(causal=True, window=2.5), TypeError, r"^window must be an int or None, got float 2\.5"),
    (dict(window=4), ValueError, r"^window=4 requires causal=True"),
    (dict(sinks=np.zeros((3,), np.float32)), ValueError, r"^sinks must have shape \(4,\) \[heads\]"),
    (dict(bound_max=np.zeros(S, np.float32)), ValueError,
     r"^bound_min and bound_max must be given together, got only bound_max"),
    (dict(q=[[1.0]]), TypeError, r"^q must be a JAX or NumPy array, got list"),
], ids=["q-dtype", "k-shape", "window-type", "window-causal", "sinks-shape", "bounds", "q-list"])
def test_errors_at_trace_time_name_the_argument(change, error, message):
    q, k, v, _ = make()
    args = {**dict(q=q, k=k, v=v), **change}
    fn = jax.jit(lambda q, k, v: nj.attention(q, k, v, layout="bshd", **{n: a for n, a in args.items()
                                                                         if n not in "qkv"}))
    with pytest.raises(error, match=message):
        if isinstance(args["q"], list):
            nj.attention(args["q"], k, v, layout="bshd")
        else:
            fn(args["q"], args["k"], args["v"])


def test_value_errors_on_the_host_name_the_argument():
    q, k, v, do = make()
    q_nan = q.copy()
    q_nan[0, 1, 2, 3] = np.nan
    f = jax.jit(lambda q: nj.attention(q, k, v, layout="bshd"))
    with pytest.raises(Exception, match=r"q must be finite, got 1 NaN/inf element\(s\) of 40960"):
        np.asarray(f(q_nan))
    do_nan = do.copy()
    do_nan[1, 0, 0, 0] = np.inf
    with pytest.raises(Exception, match=r"do must be finite, got 1 NaN/inf element\(s\) of 40960"):
        np.asarray(jax.grad(lambda q: jnp.sum(f(q) * do_nan))(q))


# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------

def test_dropout_is_numbafa_bit_for_bit_with_a_traced_seed_offset():
    """dropout_p and seed static, seed_offset a Python int or a traced step counter: o and the
    gradients are numbafa.attention's with the same seed and offset; another offset, another mask."""
    q, k, v, do = make(seed=9)
    kw = dict(dropout_p=0.25, seed=11)
    f = jax.jit(lambda q, k, v, step: nj.attention(q, k, v, causal=True, seed_offset=step, **kw))
    for step in (5, 6):
        o, got = vjp(lambda q, k, v: f(q, k, v, jnp.int32(step)), q, k, v, do)
        o_int, got_int = vjp(lambda q, k, v: nj.attention(q, k, v, causal=True, seed_offset=step, **kw), q, k, v, do)
        o_np, ctx = numbafa.attention(q, k, v, use_causal_mask=True, mixed_precision=True, seed_offset=step, **kw)
        expected = ctx.backward(do)
        np.testing.assert_array_equal(o, o_np)
        np.testing.assert_array_equal(o_int, o_np)
        for g, g_int, e in zip(got, got_int, expected):
            np.testing.assert_array_equal(g, e)
            np.testing.assert_array_equal(g_int, e)
        if step == 5:
            first = o_np
    assert not np.array_equal(first, o_np)


@pytest.mark.parametrize("kw,error,message", [
    (dict(dropout_p=0.1), ValueError, "seed"),
    (dict(dropout_p=0.1, seed=1, seed_offset=2 ** 63), ValueError, r"^seed_offset must be in \[0, 2\*\*63\)"),
    (dict(dropout_p=0.1, seed=1, seed_offset=jnp.zeros(2, jnp.int32)), TypeError,
     r"^seed_offset must be an int or an integer JAX scalar, got an array of shape \(2,\)"),
    (dict(dropout_p=0.1, seed=1, seed_offset=1.5), TypeError, "^seed_offset must be an int"),
])
def test_bad_dropout_arguments_are_named(kw, error, message):
    q, k, v, _ = make()
    with pytest.raises(error, match=message):
        nj.attention(q, k, v, **kw)


def test_vmapped_seed_offsets_give_each_elements_own_mask():
    """Per-element seed offsets under jax.vmap: one host call per element, each the unmapped call."""
    q, k, v, do = make(seed=10)
    f = jax.jit(lambda q, step: nj.attention(q, k, v, causal=True, dropout_p=0.3, seed=2, seed_offset=step))
    steps = jnp.arange(3, dtype=jnp.int32)
    out = jax.vmap(f, in_axes=(None, 0))(q, steps)
    for i in range(3):
        np.testing.assert_array_equal(out[i], f(q, steps[i]))
    assert not np.array_equal(out[0], out[1])
