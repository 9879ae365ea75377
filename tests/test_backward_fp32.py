"""attention_bwd on float32 inputs against the float64 golden."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.conventions.tiling import setup_config

from _problems import CASES, Case, make_inputs
from _tolerances import FLOAT32, assert_close


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case_and_results(request):
    _, case = request.param
    inputs = make_inputs(case)
    got = numbafa.attention_bwd(**inputs)
    expected = golden.attention_bwd(**inputs)
    return case, inputs, got, expected


def test_matches_golden(case_and_results):
    case, inputs, got, expected = case_and_results
    names = ("dq", "dk", "dv", "dsinks")
    assert len(got) == len(expected) == (4 if case.num_sinks else 3)
    for name, g, e in zip(names, got, expected):
        assert g.dtype == np.float32, name
        assert_close(g, e, FLOAT32, name)


def test_output_shapes(case_and_results):
    case, inputs, got, _ = case_and_results
    assert got[0].shape == inputs["q_ref"].shape
    assert got[1].shape == inputs["k_ref"].shape
    assert got[2].shape == inputs["v_ref"].shape
    if case.num_sinks:
        assert got[3].shape == inputs["sinks_ref"].shape


def test_odd_work_unit_counts_are_split_in_two_q_chunks():
    """The cases that exercise the split: an odd number (< 9) of (batch, KV head) units
    and more than 64 rows (causal), more than two Q tiles (no mask)."""
    from numbafa.kernels.schedule import q_chunks
    for causal in (False, True):
        assert q_chunks(1, 1025, False, causal) == 2 and q_chunks(1, 257, False, causal) == 2
        assert q_chunks(3, 4096, False, causal) == 2 and q_chunks(7, 4096, False, causal) == 2
        assert q_chunks(2, 4096, False, causal) == 1 and q_chunks(9, 4096, False, causal) == 1
        assert q_chunks(1, 4096, True, causal) == 1 and q_chunks(3, 4096, True, causal) == 1
    assert q_chunks(1, 256, False, True) == 2 and q_chunks(1, 65, False, True) == 2
    assert q_chunks(1, 64, False, True) == 1 and q_chunks(1, 256, False, False) == 1
    split = [name for name, c in CASES if q_chunks(c.bs * c.nheads_kv, c.seqlen_q, False, c.causal) == 2]
    assert {"window64", "window128-gqa", "ragged1025", "2-sections-causal", "mqa-causal"} <= set(split)


def test_a_split_short_backward_matches_the_golden():
    """B1 H1 S128 D64 causal (the smallest training shape): one Q tile split into four 32-row Q
    groups, two items, each group's diagonal blocks run on the keys its rows may see."""
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs
    from numbafa.kernels.bundles import make_plan

    case = Case(nheads=1, nheads_kv=1, d_head=64, seqlen_q=128, seqlen_k=128, causal=True)
    inputs = make_inputs(case)
    q = inputs["q_ref"]
    tiling = make_plan(validate_fwd_inputs(q, q, q, AttentionOptions(use_causal_mask=True)), backward=True).tiling
    assert (tiling.q_chunks, tiling.group_rows) == (2, 32)
    for name, g, e in zip(("dq", "dk", "dv"), numbafa.attention_bwd(**inputs), golden.attention_bwd(**inputs)):
        assert_close(g, e, FLOAT32, name)


def test_a_short_groups_blocks_run_on_the_keys_its_rows_see():
    """``seen_keys``: a block's keys cut to those of the first row's ``lo`` to the last row's
    ``hi`` (causal, then a 16-key window), relative to the section's first key."""
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs
    from numbafa.compiler.jit import callable_from_python
    from numbafa.kernels.mask import seen_keys
    from numbafa.kernels.bundles import make_plan

    seen = callable_from_python(seen_keys)
    q = np.zeros((1, 1, 16, 256), np.float32)
    for window, rows, sec0, block, expected in ((None, (32, 63), 0, (0, 128), (0, 64)),
                                                (None, (0, 31), 0, (0, 128), (0, 32)),
                                                (None, (160, 191), 128, (0, 128), (0, 64)),
                                                (16, (32, 63), 0, (0, 128), (17, 47)),
                                                (16, (32, 63), 0, (64, 64), (64, 0))):
        mask = make_plan(validate_fwd_inputs(q, q, q, AttentionOptions(use_causal_mask=True, sliding_window=window)),
                         backward=True).mask
        assert tuple(seen(mask, sec0, *rows, *block)) == expected, (window, rows, sec0, block)


def test_two_sections_case_really_has_two_sections():
    cfg = setup_config(5120, 5120, 256)
    assert (math.ceil(256 / cfg.d_tile), cfg.section_len, math.ceil(5120 / cfg.section_len)) == (2, 4096, 2)


def test_p_comes_from_given_lse():
    """Shifting lse by ln 2 halves P, hence every gradient (D comes from o)."""
    inputs = make_inputs(Case(causal=True, num_sinks=1, seqlen_q=300, seqlen_k=300))
    base = numbafa.attention_bwd(**inputs)
    shifted = numbafa.attention_bwd(**{**inputs, "lse_ref": inputs["lse_ref"] + np.float32(math.log(2))})
    for name, b, s in zip(("dq", "dk", "dv", "dsinks"), base, shifted):
        assert_close(s, b / 2, FLOAT32, name)


def test_d_comes_from_given_o():
    """D = rowsum(o * dy) uses o_ref: changing o changes dQ by exactly -dD * (P K) * scale.

    ``P K^T`` is the attention output with the keys as values, i.e. the golden
    forward with ``v = k``. dV does not involve D and must not change.
    """
    case = Case(causal=True, seqlen_q=300, seqlen_k=300)
    inputs = make_inputs(case)
    o2 = (inputs["o_ref"] * np.float32(1.5) + np.float32(0.1)).astype(np.float32)
    base = numbafa.attention_bwd(**inputs)
    moved = numbafa.attention_bwd(**{**inputs, "o_ref": o2})
    d_shift = ((o2.astype(np.float64) - inputs["o_ref"]) * inputs["dy_ref"]).sum(axis=2)  # [bs, h, sq]
    p_k, _ = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["k_ref"], use_causal_mask=True)
    scale = 1 / math.sqrt(case.d_head)
    expected_dq = base[0] - d_shift[:, :, None, :] * p_k * scale
    assert_close(moved[0], expected_dq, FLOAT32, "dq")
    np.testing.assert_array_equal(moved[2], base[2])
    assert np.abs(moved[1] - base[1]).max() > 1e-2


def test_neuron_and_natural_lse_layouts_agree():
    inputs = make_inputs(Case(seqlen_q=512, seqlen_k=512, causal=True))
    lse = inputs["lse_ref"]
    bs, h, sq = lse.shape
    neuron = np.ascontiguousarray(lse.reshape(bs, h, sq // 128, 128).transpose(0, 1, 3, 2))
    assert neuron[0, 1, 5, 2] == lse[0, 1, 2 * 128 + 5]
    a = numbafa.attention_bwd(**inputs)
    b = numbafa.attention_bwd(**{**inputs, "lse_ref": neuron})
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_rows_attending_nothing_get_zero_gradient():
    """Inconsistent packing bounds (min >= max) leave rows empty: lse = +inf, gradient 0."""
    case = Case(seqlen_q=256, seqlen_k=256, num_sinks=0)
    inputs = make_inputs(case)
    bmin = np.zeros(256, np.float32)
    bmax = np.full(256, 256, np.float32)
    bmin[10:20] = 50
    bmax[10:20] = 40
    o, lse = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], bound_min=bmin,
                                  bound_max=bmax)
    assert np.isinf(lse[:, :, 10:20]).all()
    inputs.update(o_ref=o.astype(np.float32), lse_ref=lse.astype(np.float32), bound_min=bmin,
                  bound_max=bmax)
    got = numbafa.attention_bwd(**inputs)
    expected = golden.attention_bwd(**inputs)
    assert (got[0][:, :, :, 10:20] == 0).all()
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(g, e, FLOAT32, name)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 128), (128, 0), (0, 0)])
def test_zero_length_sequences(seqlen_q, seqlen_k):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 64, seqlen_q)).astype(np.float32)
    k = rng.standard_normal((1, 1, 64, seqlen_k)).astype(np.float32)
    lse = np.zeros((1, 2, seqlen_q), np.float32)
    sinks = np.ones((1, 2), np.float32)
    dq, dk, dv, ds = numbafa.attention_bwd(q, k, k, q, q, lse, sinks_ref=sinks)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and ds.shape == sinks.shape
    assert not dq.any() and not dk.any() and not dv.any()
    if seqlen_q == 0:
        assert not ds.any()


def test_zero_keys_with_sinks_gives_sink_gradient():
    """With no keys the softmax runs over the sinks alone: dsinks = -sum_q p_sink * D."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 1, 8, 130)).astype(np.float32)
    k = np.zeros((1, 1, 8, 0), np.float32)
    o = rng.standard_normal(q.shape).astype(np.float32)
    dy = rng.standard_normal(q.shape).astype(np.float32)
    sinks = np.array([[0.5]], np.float32)
    lse = np.full((1, 1, 130), 0.5, np.float32)          # log(exp(sink))
    *_, ds = numbafa.attention_bwd(q, k, k, o, dy, lse, sinks_ref=sinks)
    d = (o.astype(np.float64) * dy).sum(axis=2)
    assert_close(ds, -d.sum(axis=-1), FLOAT32, "dsinks")


def test_inputs_are_not_modified_and_views_work():
    case = Case(nheads=4, nheads_kv=2, causal=True, num_sinks=2, packing=(100, 156))
    inputs = make_inputs(case)
    copies = {k: v.copy() for k, v in inputs.items() if isinstance(v, np.ndarray)}
    contiguous = numbafa.attention_bwd(**inputs)
    for name, arr in copies.items():
        np.testing.assert_array_equal(inputs[name], arr, err_msg=name)
    # Same values through non-contiguous views (Fortran order, strided slices).
    views = {}
    for name, arr in inputs.items():
        if isinstance(arr, np.ndarray) and arr.ndim == 4:
            big = np.zeros(arr.shape[:3] + (2 * arr.shape[3],), arr.dtype)
            big[..., ::2] = arr
            views[name] = big[..., ::2]
            assert not views[name].flags.c_contiguous
        elif isinstance(arr, np.ndarray):
            views[name] = np.asfortranarray(arr) if arr.ndim > 1 else arr[::-1].copy()[::-1]
    strided = numbafa.attention_bwd(**{**inputs, **views})
    for a, b in zip(contiguous, strided):
        np.testing.assert_array_equal(a, b)


def _unaligned(x):
    raw = np.zeros(x.nbytes + 1, np.uint8)[1:].view(np.uint8)
    out = raw.view(x.dtype).reshape(x.shape)
    out[...] = x
    assert not out.flags.aligned
    return out


def test_read_only_and_unaligned_inputs_compile_no_second_kernel():
    """JAX hands read-only buffers to its callbacks: they, and unaligned arrays, take the kernels
    compiled for ordinary arrays (the entries' and the work items' signatures do not grow)."""
    from numbafa.kernels import backward, entry, forward

    case = Case(nheads=2, nheads_kv=1, causal=True, num_sinks=1, packing=(100, 156))
    inputs = make_inputs(case)
    expected = numbafa.attention_bwd(**inputs)
    o_expected = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                       inputs["sinks_ref"], lse_layout="natural", **case.kwargs())
    kernels = (entry.backward_entry, backward.bwd_work_item, entry.forward_entry, forward.fwd_work_item)
    before = [len(k.signatures) for k in kernels]
    frozen = {}
    for name, arr in inputs.items():
        if isinstance(arr, np.ndarray):
            arr = _unaligned(arr) if name in ("q_ref", "k_ref") else arr.copy()
            arr.flags.writeable = False
        frozen[name] = arr
    for a, b in zip(expected, numbafa.attention_bwd(**frozen)):
        np.testing.assert_array_equal(a, b)
    got = numbafa.attention_fwd(frozen["q_ref"], frozen["k_ref"], frozen["v_ref"], frozen["sinks_ref"],
                                lse_layout="natural", **case.kwargs())
    for a, b in zip(o_expected, got):
        np.testing.assert_array_equal(a, b)
    assert [len(k.signatures) for k in kernels] == before


def test_repeated_calls_are_bitwise_identical():
    inputs = make_inputs(Case(nheads=4, nheads_kv=1, causal=True, num_sinks=1))
    first = numbafa.attention_bwd(**inputs)
    for _ in range(2):
        for a, b in zip(first, numbafa.attention_bwd(**inputs)):
            np.testing.assert_array_equal(a, b)


def test_bitwise_identical_across_thread_counts():
    """Each work unit is owned by one thread and reduced in a fixed order: the thread count
    cannot change a bit (forward and backward, float32 and bf16)."""
    import ml_dtypes
    import numba

    results = {}
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            for dtype in (np.float32, ml_dtypes.bfloat16):
                # 4 work units; and 1 work unit, which the backward splits in two Q chunks.
                for units, case in (("4", Case(nheads=4, nheads_kv=2, bs=2, causal=True, num_sinks=1,
                                               seqlen_q=384, seqlen_k=384)),
                                    ("1", Case(nheads=2, nheads_kv=1, causal=True, num_sinks=1,
                                               seqlen_q=1100, seqlen_k=1100)),
                                    # one short unit: split into 96-row Q groups (forward) and
                                    # 128-row ones (backward)
                                    ("1-short", Case(nheads=1, nheads_kv=1, causal=True, num_sinks=1, seqlen_q=384,
                                                     seqlen_k=384)),
                                    # one Q tile: 32-row Q groups in both passes
                                    ("1-tile", Case(nheads=1, nheads_kv=1, causal=True, num_sinks=1, seqlen_q=128,
                                                    seqlen_k=128))):
                    inputs = make_inputs(case, dtype)
                    fwd = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                                sinks_ref=inputs["sinks_ref"], use_causal_mask=True,
                                                lse_layout="natural")
                    results[threads, np.dtype(dtype).name + units] = fwd + numbafa.attention_bwd(
                        **inputs, mixed_precision=True)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for (threads, dtype), arrays in results.items():
        for a, b in zip(arrays, results[1, dtype]):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{threads} threads")
