"""attention_fwd against the golden forward, and the forward -> backward round trip."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.kernels.bundles import make_plan
from numbafa.kernels.schedule import q_chunks
from numbafa.checks.options import AttentionOptions
from numbafa.checks.validation import validate_fwd_inputs
from numbafa.pipeline.shards import owned_rows

from _problems import CASES, Case, make_inputs
from _tolerances import BF16_MIXED, FLOAT32, LSE_FLOAT32, assert_close

BF16 = ml_dtypes.bfloat16
OPTION_KEYS = ("sinks_ref", "bound_min", "bound_max", "use_causal_mask", "softmax_scale", "sliding_window")
DTYPES = [(np.float32, FLOAT32, LSE_FLOAT32), (BF16, BF16_MIXED, BF16_MIXED)]


def split(inputs):
    return (inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]), \
        {k: inputs[k] for k in OPTION_KEYS if k in inputs}


def golden_fwd(qkv, opts):
    return golden.attention_fwd(*qkv, sinks=opts.get("sinks_ref"), bound_min=opts.get("bound_min"),
                                bound_max=opts.get("bound_max"), use_causal_mask=opts["use_causal_mask"],
                                softmax_scale=opts["softmax_scale"], sliding_window=opts["sliding_window"])


@pytest.mark.parametrize("dtype,tol,lse_tol", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("case", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_forward_matches_golden(case, dtype, tol, lse_tol):
    qkv, opts = split(make_inputs(case, dtype))
    o, lse = numbafa.attention_fwd(*qkv, mixed_precision=True, lse_layout="natural", **opts)
    o_exp, lse_exp = golden_fwd(qkv, opts)
    assert o.dtype == np.dtype(dtype) and lse.dtype == np.float32
    assert_close(o.astype(np.float32), o_exp, tol, "o")
    assert_close(lse, lse_exp, lse_tol, "lse")


ROUND_TRIP = [
    ("gqa-causal-sinks", Case(nheads=4, nheads_kv=2, causal=True, num_sinks=2, seqlen_q=384, seqlen_k=384)),
    ("packing-window", Case(packing=(127, 129, 256), seqlen_q=512, seqlen_k=512, causal=True, window=64)),
    ("ragged-cross", Case(seqlen_q=200, seqlen_k=700, d_head=96)),
]


@pytest.mark.parametrize("dtype,tol,_", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("case", [c[1] for c in ROUND_TRIP], ids=[c[0] for c in ROUND_TRIP])
def test_round_trip_forward_then_backward(case, dtype, tol, _):
    inputs = make_inputs(case, dtype)
    qkv, opts = split(inputs)
    layout = "neuron" if case.seqlen_q % 128 == 0 else "natural"
    o, lse = numbafa.attention_fwd(*qkv, mixed_precision=True, lse_layout=layout, **opts)
    got = numbafa.attention_bwd(*qkv, o, inputs["dy_ref"], lse, mixed_precision=True, **opts)
    expected = golden.attention_bwd(**inputs)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert_close(np.asarray(g, np.float32), e, tol, name)


def test_neuron_lse_layout_is_the_default_and_packed():
    qkv, opts = split(make_inputs(Case(seqlen_q=256, seqlen_k=256)))
    _, lse = numbafa.attention_fwd(*qkv, **opts)
    _, natural = numbafa.attention_fwd(*qkv, lse_layout="natural", **opts)
    assert lse.shape == (1, 2, 128, 2)
    assert lse[0, 1, 3, 1] == natural[0, 1, 128 + 3]


def test_neuron_layout_with_ragged_seqlen_suggests_natural():
    qkv, opts = split(make_inputs(Case(seqlen_q=200, seqlen_k=200)))
    with pytest.raises(ValueError, match="lse_layout='neuron' needs seqlen_q divisible by 128, got "
                                         "seqlen_q=200; use lse_layout='natural'"):
        numbafa.attention_fwd(*qkv, **opts)
    with pytest.raises(ValueError, match="lse_layout must be one of"):
        numbafa.attention_fwd(*qkv, lse_layout="bshd", **opts)


def test_rows_attending_nothing():
    """Empty packing rows: o = 0, lse = +inf; with sinks the row sees only the sinks."""
    qkv, _ = split(make_inputs(Case(seqlen_q=256, seqlen_k=256)))
    bmin = np.zeros(256, np.float32)
    bmax = np.full(256, 256, np.float32)
    bmin[5:9], bmax[5:9] = 100, 100
    o, lse = numbafa.attention_fwd(*qkv, bound_min=bmin, bound_max=bmax, lse_layout="natural")
    assert (o[..., 5:9] == 0).all() and np.isposinf(lse[..., 5:9]).all()
    assert np.isfinite(lse[..., 9:]).all()
    sinks = np.full((1, 2), 0.25, np.float32)
    o, lse = numbafa.attention_fwd(*qkv, sinks_ref=sinks, bound_min=bmin, bound_max=bmax,
                                   lse_layout="natural")
    assert (o[..., 5:9] == 0).all()
    np.testing.assert_allclose(lse[..., 5:9], 0.25, rtol=1e-6)


def test_forward_validation_shares_the_backward_checks():
    qkv, _ = split(make_inputs(Case(seqlen_q=128, seqlen_k=256)))
    with pytest.raises(ValueError, match="requires seqlen_q == seqlen_k"):
        numbafa.attention_fwd(*qkv, use_causal_mask=True)
    with pytest.raises(TypeError, match="v_ref must have the dtype of q_ref"):
        numbafa.attention_fwd(qkv[0], qkv[1], qkv[2].astype(BF16))
    with pytest.raises(ValueError, match="sliding_window=8 requires use_causal_mask=True"):
        numbafa.attention_fwd(*qkv, sliding_window=8)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 128), (128, 0)])
def test_forward_zero_lengths(seqlen_q, seqlen_k):
    q = np.ones((1, 2, 8, seqlen_q), np.float32)
    k = np.ones((1, 1, 8, seqlen_k), np.float32)
    o, lse = numbafa.attention_fwd(q, k, k, lse_layout="natural")
    assert o.shape == q.shape and lse.shape == (1, 2, seqlen_q)
    assert not o.any() and np.isposinf(lse).all()


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
def test_single_unit_split_changes_no_bit(dtype):
    # One work unit (MQA, batch 1) is split into two items owning alternate Q groups; the
    # same unit inside a two-unit batch is not split. Rows are independent, and beyond 1024 rows
    # the split unit's Q groups are the unsplit one's (512 rows): equal bits.
    case = Case(nheads=2, nheads_kv=1, causal=True, num_sinks=1, seqlen_q=1300, seqlen_k=1300)
    qkv, opts = split(make_inputs(case, dtype))
    assert q_chunks(1, case.seqlen_q, False, True) == 2 and q_chunks(2, case.seqlen_q, False, True) == 1
    single = numbafa.attention_fwd(*qkv, mixed_precision=True, lse_layout="natural", **opts)
    pair = tuple(np.concatenate([x, x]) for x in qkv)
    opts2 = dict(opts, sinks_ref=np.concatenate([opts["sinks_ref"]] * 2))
    batched = numbafa.attention_fwd(*pair, mixed_precision=True, lse_layout="natural", **opts2)
    for a, b in zip(single, batched):
        np.testing.assert_array_equal(a.view(np.uint8), b[:1].view(np.uint8))
        np.testing.assert_array_equal(a.view(np.uint8), b[1:].view(np.uint8))


@pytest.mark.parametrize("backward,seqlen_q", [(b, n) for b in (False, True) for n in (96, 128, 200, 256, 640, 1024,
                                                                                         1300)]
                         + [(True, n) for n in (384, 512)])
def test_a_single_unit_gives_both_items_work(backward, seqlen_q):
    """One unit is split into two items (above 64 rows); the Q groups are small enough that the
    zigzag gives both items rows (two 512-row groups would be one zigzag pair, all the first
    item's), and at 128 or 512 rows per chunk the same causal work; beyond two Q tiles the
    backward's groups are whole Q tiles."""
    q = np.zeros((1, 1, 16, seqlen_q), np.float32)
    plan = make_plan(validate_fwd_inputs(q, q, q, AttentionOptions(use_causal_mask=True)), backward=backward)
    assert plan.tiling.q_chunks == 2
    if backward and seqlen_q > 2 * plan.tiling.q_tile:
        assert plan.tiling.group_rows % plan.tiling.q_tile == 0
    owned = [owned_rows(seqlen_q, plan.tiling, chunk) for chunk in (0, 1)]
    assert all(rows.size for rows in owned)
    np.testing.assert_array_equal(np.sort(np.concatenate(owned)), np.arange(seqlen_q))
    if seqlen_q in (128, 1024) or (seqlen_q, backward) == (512, True):
        assert (owned[0] + 1).sum() == (owned[1] + 1).sum()   # causal: row r sees r + 1 keys


def test_a_split_short_forward_matches_the_golden():
    """B1 H1 S128 D64 causal (the smallest training shape), split into 32-row Q groups."""
    for dtype, tol, lse_tol in DTYPES:
        case = Case(nheads=1, nheads_kv=1, d_head=64, seqlen_q=128, seqlen_k=128, causal=True)
        qkv, opts = split(make_inputs(case, dtype))
        o, lse = numbafa.attention_fwd(*qkv, mixed_precision=True, lse_layout="natural", **opts)
        o_exp, lse_exp = golden_fwd(qkv, opts)
        assert_close(o.astype(np.float32), o_exp, tol, "o")
        assert_close(lse, lse_exp, lse_tol, "lse")
