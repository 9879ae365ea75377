"""The golden itself: forward against plain loops, backward against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numbafa import golden

from _problems import bounds_from_lengths


def loop_forward(q, k, v, sinks, allowed, scale):
    """Per-row softmax with Python loops: the most literal attention there is."""
    bs, nh, d, sq = q.shape
    n_rep = nh // k.shape[1]
    o = np.zeros(q.shape)
    lse = np.zeros((bs, nh, sq))
    for b in range(bs):
        for h in range(nh):
            for i in range(sq):
                logits = [sum(q[b, h, x, i] * scale * k[b, h // n_rep, x, j] for x in range(d))
                          for j in range(k.shape[3]) if allowed[i, j]]
                keys = [j for j in range(k.shape[3]) if allowed[i, j]]
                extra = [] if sinks is None else list(np.atleast_1d(sinks[b, h]))
                every = logits + extra
                if not every:
                    lse[b, h, i] = math.inf
                    continue
                m = max(every)
                z = sum(math.exp(x - m) for x in every)
                lse[b, h, i] = m + math.log(z)
                for x in range(d):
                    o[b, h, x, i] = sum(math.exp(s - lse[b, h, i]) * v[b, h // n_rep, x, j]
                                        for s, j in zip(logits, keys))
    return o, lse


SMALL = [
    ("plain", dict()),
    ("causal-window", dict(use_causal_mask=True, sliding_window=3)),
    ("packing-causal", dict(use_causal_mask=True, packing=(3, 4))),
    ("packing-empty-row", dict(bounds=([0, 0, 5, 0, 0, 0, 0], [7, 7, 2, 7, 7, 7, 7]))),
    ("sinks2", dict(num_sinks=2, use_causal_mask=True)),
    ("sinks1-packing", dict(num_sinks=1, packing=(2, 5))),
]


def small_problem(opts, seed=0):
    rng = np.random.default_rng(seed)
    bs, nh, nkv, d, s = 1, 4, 2, 3, 7
    q = rng.standard_normal((bs, nh, d, s))
    k = rng.standard_normal((bs, nkv, d, s))
    v = rng.standard_normal((bs, nkv, d, s))
    dy = rng.standard_normal((bs, nh, d, s))
    kw = dict(use_causal_mask=opts.get("use_causal_mask", False),
              sliding_window=opts.get("sliding_window"), softmax_scale=0.8)
    if "packing" in opts:
        kw["bound_min"], kw["bound_max"] = bounds_from_lengths(opts["packing"])
    if "bounds" in opts:
        kw["bound_min"], kw["bound_max"] = (np.array(b, np.float32) for b in opts["bounds"])
    sinks = None
    if opts.get("num_sinks"):
        sinks = rng.standard_normal((bs, nh, opts["num_sinks"])) if opts["num_sinks"] > 1 \
            else rng.standard_normal((bs, nh))
    return q, k, v, dy, sinks, kw


@pytest.mark.parametrize("opts", [s[1] for s in SMALL], ids=[s[0] for s in SMALL])
def test_forward_matches_python_loops(opts):
    q, k, v, dy, sinks, kw = small_problem(opts)
    allowed = golden.allowed_mask(7, 7, kw["use_causal_mask"], kw["sliding_window"],
                                  kw.get("bound_min"), kw.get("bound_max"))
    o, lse = golden.attention_fwd(q, k, v, sinks=sinks, **kw)
    o_loop, lse_loop = loop_forward(q, k, v, sinks, allowed, 0.8)
    np.testing.assert_allclose(o, o_loop, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_loop, rtol=1e-12)


@pytest.mark.parametrize("opts", [s[1] for s in SMALL], ids=[s[0] for s in SMALL])
def test_backward_matches_finite_differences(opts):
    """Every gradient element against a central difference of L = sum(o * dy), in float64."""
    q, k, v, dy, sinks, kw = small_problem(opts)

    def loss(q_, k_, v_, sinks_):
        o, _ = golden.attention_fwd(q_, k_, v_, sinks=sinks_, **kw)
        return float((o * dy).sum())

    grads = golden.attention_bwd(q, k, v, None, dy, None, sinks_ref=sinks, **kw)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    eps = 1e-6
    for idx, (x, g) in enumerate(zip(inputs, grads)):
        numeric = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [a.copy() for a in inputs] + ([None] if sinks is None else [])
            args[idx][pos] += eps
            up = loss(*args)
            args[idx][pos] -= 2 * eps
            numeric[pos] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8, err_msg=f"input {idx}")


def test_allowed_mask_examples():
    m = golden.allowed_mask(4, 4, use_causal_mask=True, sliding_window=2)
    np.testing.assert_array_equal(m.astype(int), [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
    bmin, bmax = bounds_from_lengths((1, 3))
    m = golden.allowed_mask(4, 4, use_causal_mask=True, bound_min=bmin, bound_max=bmax)
    np.testing.assert_array_equal(m.astype(int), [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]])


def test_lse_layouts():
    q, k, v, _, _, _ = small_problem({})
    q = np.repeat(q, 40, axis=3)[..., :256]
    k = np.repeat(k, 40, axis=3)[..., :256]
    v = np.repeat(v, 40, axis=3)[..., :256]
    _, natural = golden.attention_fwd(q, k, v)
    _, neuron = golden.attention_fwd(q, k, v, lse_layout="neuron")
    assert neuron.shape == (1, 4, 128, 2)
    assert neuron[0, 3, 7, 1] == natural[0, 3, 128 + 7]
    with pytest.raises(ValueError, match="lse_layout"):
        golden.attention_fwd(q, k, v, lse_layout="nki")


def _valid(seqlen=8):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 3, seqlen))
    k = rng.standard_normal((2, 2, 3, seqlen))
    v = rng.standard_normal((2, 2, 5, seqlen))
    dy = rng.standard_normal((2, 4, 5, seqlen))
    return q, k, v, dy


# (keyword changes of a valid call, exception, the argument its message must name)
BAD_INPUTS = [
    (dict(q=np.ones((2, 4, 3, 8), np.int32)), TypeError, "q"),
    (dict(q=np.ones((4, 3, 8))), ValueError, "q"),
    (dict(k=np.ones((2, 2, 4, 8))), ValueError, "k"),
    (dict(k=np.ones((2, 3, 3, 8))), ValueError, "nheads_kv"),
    (dict(v=np.ones((2, 2, 5, 9))), ValueError, "v"),
    (dict(v=np.ones((2, 2, 5, 8), complex)), TypeError, "v"),
    (dict(sinks=np.ones((2, 3))), ValueError, "sinks"),
    (dict(bound_min=np.zeros(8, np.float32)), ValueError, "bound_max"),
    (dict(bound_min=np.zeros(7, np.float32), bound_max=np.ones(7, np.float32)), ValueError, "bound_min"),
    (dict(sliding_window=2.5), TypeError, "sliding_window"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(dropout_p=1.0, seed=0), ValueError, "dropout_p"),
    (dict(dropout_p=0.1), TypeError, "seed"),
    (dict(bias=np.ones((2, 4, 8, 7))), ValueError, "bias"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
]

_BWD_NAMES = {"q": "q_ref", "k": "k_ref", "v": "v_ref", "sinks": "sinks_ref"}


@pytest.mark.parametrize("change, error, name", BAD_INPUTS, ids=[f"{e.__name__}-{n}" for _, e, n in BAD_INPUTS])
@pytest.mark.parametrize("which", ["attention_fwd", "attention_bwd", "attention_bwd_rounded"])
def test_bad_inputs_name_the_argument(which, change, error, name):
    """The golden checks its inputs as the kernels' API does: the error names the argument as the
    caller spelled it (``q`` for the forward, ``q_ref`` for the backwards)."""
    q, k, v, dy = _valid()
    if which == "attention_fwd":
        kw = {**dict(q=q, k=k, v=v), **change}
    else:
        o = np.zeros_like(dy)
        lse = np.zeros((2, 4, 8))
        kw = dict(q_ref=q, k_ref=k, v_ref=v, o_ref=o, dy_ref=dy, lse_ref=lse)
        kw.update({_BWD_NAMES.get(key, key): value for key, value in change.items()})
        name = _BWD_NAMES.get(name, name)
    with pytest.raises(error, match=rf"\b{name}\b"):
        getattr(golden, which)(**kw)


def test_backward_checks_its_own_arrays():
    q, k, v, dy = _valid()
    lse = np.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="dy_ref"):
        golden.attention_bwd(q, k, v, None, dy[:, :, :4], None)
    with pytest.raises(ValueError, match="o_ref"):
        golden.attention_bwd_rounded(q, k, v, dy[:, :, :4], dy, lse)
    with pytest.raises(ValueError, match="lse_ref"):
        golden.attention_bwd_rounded(q, k, v, dy, dy, lse[..., :7])
    with pytest.raises(ValueError, match="lse_layout"):
        golden.attention_fwd(q, k, v, lse_layout="neuron")   # seqlen_q = 8: no Neuron lse layout
    with pytest.raises(ValueError, match="keep"):
        golden.attention_fwd(q, k, v, dropout_p=0.5, keep=np.ones((2, 4, 8, 8 + 1), bool))


@pytest.mark.parametrize("which", ["attention_bwd", "attention_bwd_rounded"])
def test_sinks_shared_by_the_batch(which):
    """``[nheads]`` sinks (as the kernels take them) are ``[bs, nheads]`` sinks equal across the batch,
    and their gradient is the batch's sum."""
    q, k, v, dy = _valid()
    sinks = np.array([0.5, -1.0, 0.25, 2.0])
    wide = np.broadcast_to(sinks, (2, 4)).copy()
    o, lse = golden.attention_fwd(q, k, v, sinks=sinks)
    o_wide, lse_wide = golden.attention_fwd(q, k, v, sinks=wide)
    np.testing.assert_array_equal(o, o_wide)
    np.testing.assert_array_equal(lse, lse_wide)
    args = (q, k, v, o, dy, lse) if which == "attention_bwd" else \
        tuple(x.astype(np.float32) for x in (q, k, v, o, dy, lse))
    shared = getattr(golden, which)(*args, sinks_ref=sinks)
    apart = getattr(golden, which)(*args, sinks_ref=wide)
    assert shared[3].shape == (4,)
    np.testing.assert_array_equal(shared[3], apart[3].sum(axis=0, dtype=apart[3].dtype))
    for g, g_wide in zip(shared[:3], apart[:3]):
        np.testing.assert_array_equal(g, g_wide)


MASK_HELPER_MISUSE = [
    (lambda: golden.allowed_mask(8.0, 8), TypeError, "seqlen_q"),
    (lambda: golden.allowed_mask(8, -1), ValueError, "seqlen_k"),
    (lambda: golden.allowed_mask(8, 8, True, 2.5), TypeError, "sliding_window"),
    (lambda: golden.allowed_mask(8, 8, bound_min=np.zeros(8)), ValueError, "bound_min"),
    (lambda: golden.allowed_mask(8, 8, bound_min=np.zeros(7), bound_max=np.ones(7)), ValueError, "bound_min"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 1.0, 0), ValueError, "dropout_p"),
    (lambda: golden.keep_mask(1, 2, 8, 8, "0.1", 0), TypeError, "dropout_p"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 0.1, -3), ValueError, "seed"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 0.1, 2 ** 64), ValueError, "seed"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 0.1, 1.5), TypeError, "seed"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 0.1, 1, seed_offset=2 ** 64), ValueError, "seed_offset"),
    (lambda: golden.keep_mask(1, 2.0, 8, 8, 0.1, 1), TypeError, "nheads"),
    (lambda: golden.keep_mask(1, 2, 8, 8, 0.1, 1, first_row=-1), ValueError, "first_row"),
]


@pytest.mark.parametrize("call, error, name", MASK_HELPER_MISUSE,
                         ids=[f"{i}-{e.__name__}-{n}" for i, (_, e, n) in enumerate(MASK_HELPER_MISUSE)])
def test_the_mask_helpers_check_their_arguments(call, error, name):
    """allowed_mask and keep_mask (public, used by tests and users to build masks) name a bad
    argument instead of computing with it."""
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()


def test_the_mask_helpers_take_numpy_integers():
    np.testing.assert_array_equal(golden.allowed_mask(np.int64(4), np.int32(4), True), np.tril(np.ones((4, 4), bool)))
    assert golden.keep_mask(np.int64(1), 1, 2, 64, 0.5, np.uint64(7)).shape == (1, 1, 2, 64)
