"""The one mask definition (numbafa.kernels.mask) against the golden's boolean mask,
and forward + backward on packing bounds of any magnitude (+-inf, beyond 2^63)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.compiler.jit import jit
from numbafa.kernels.bundles import Mask
from numbafa.kernels.mask import fill_key_ranges, queries_seeing_key, required_q_rows

from _problems import Case, make_inputs
from _tolerances import BF16_MIXED, FLOAT32, LSE_FLOAT32, assert_close

BF16 = ml_dtypes.bfloat16

def _bound_sets(n, rng):
    ragged = np.sort(rng.integers(0, n, n)).astype(np.float32)
    return {
        "none": None,
        "lengths": (np.repeat([0, 37, 100], [37, 63, n - 100]).astype(np.float32),
                    np.repeat([37, 100, n], [37, 63, n - 100]).astype(np.float32)),
        "fractional": (ragged - 0.5, ragged + np.float32(17.25)),
        "max-inf": (np.zeros(n, np.float32), np.full(n, np.inf, np.float32)),
        "max-1e19": (np.zeros(n, np.float32), np.full(n, 1e19, np.float32)),
        "min-neg-inf": (np.full(n, -np.inf, np.float32), np.full(n, 3e38, np.float32)),
        "both-huge": (np.full(n, -1e30, np.float32), np.full(n, 1e30, np.float32)),
        "empty-rows": (np.full(n, 50, np.float32), np.full(n, 50, np.float32)),
        "inverted": (np.full(n, np.inf, np.float32), np.full(n, -np.inf, np.float32)),
    }


BOUND_NAMES = ["none", "lengths", "fractional", "max-inf", "max-1e19", "min-neg-inf", "both-huge",
               "empty-rows", "inverted"]


def _key_ranges(n_q, n_k, causal, window, bounds):
    lo = np.empty(n_q, np.int32)
    hi = np.empty(n_q, np.int32)
    bmin, bmax = bounds if bounds is not None else (np.zeros(0, np.float32),) * 2
    fill_key_ranges(causal, window, bounds is not None, bmin, bmax, n_k, lo, hi)
    return lo, hi


@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 7), (True, 500)])
@pytest.mark.parametrize("name", BOUND_NAMES)
def test_key_ranges_are_the_golden_mask(causal, window, name):
    n = 300
    bounds = _bound_sets(n, np.random.default_rng(1))[name]
    lo, hi = _key_ranges(n, n, causal, min(window, n), bounds)
    assert (lo <= hi).all() and (lo >= 0).all() and (hi <= n).all()
    keys = np.arange(n)
    ours = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
    expected = golden.allowed_mask(n, n, causal, window or None, *(bounds or (None, None)))
    np.testing.assert_array_equal(ours, expected)


@jit(entry=True)
def _queries_seeing(mask, k, q0, n_q):
    return queries_seeing_key(mask, q0, n_q, k)


@jit(entry=True)
def _required(mask, q_grp0, rows, q_tile, k_min, k_max):
    return required_q_rows(mask, q_grp0, rows, q_tile, k_min, k_max)


@pytest.mark.parametrize("causal, window", [(False, 0), (True, 0), (True, 1), (True, 64), (True, 200)])
def test_queries_of_a_key_and_tile_skipping_agree_with_the_key_ranges(causal, window):
    n = 700
    lo, hi = _key_ranges(n, n, causal, window, None)
    mask = Mask(causal, window, False, lo, hi)
    seen = (np.arange(n)[None, :] >= lo[:, None]) & (np.arange(n)[None, :] < hi[:, None])  # [q, k]
    for q0, n_q in ((0, 512), (128, 384), (512, 188)):
        for k in range(0, n, 7):
            a, b = _queries_seeing(mask, k, q0, n_q)
            rows = np.flatnonzero(seen[q0:q0 + n_q, k])
            assert (a, b) == ((rows[0], rows[-1] + 1) if rows.size else (a, a)), (q0, k)
        for k_min in range(0, n, 64):
            k_max = min(k_min + 127, n - 1)
            r0, r1 = _required(mask, q0, n_q, 128, k_min, k_max)
            needed = np.flatnonzero(seen[q0:q0 + n_q, k_min:k_max + 1].any(axis=1))
            if needed.size == 0:
                assert r0 >= r1 or not causal
            else:  # every row that sees a key lies in the required whole Q tiles
                assert r0 <= needed[0] and needed[-1] < r1 and r0 % 128 == 0


EDGE = [
    # (id, seqlen, causal, window, bound_min, bound_max): bounds beyond the int64 range and
    # +-inf, which the forward turned into garbage before (int(ceil(bound)) overflowed).
    ("max-inf-128", 128, False, None, 0.0, np.inf),
    ("max-inf-1024", 1024, False, None, 0.0, np.inf),
    ("max-1e19", 1024, False, None, 0.0, 1e19),
    ("min-neg-inf", 1024, False, None, -np.inf, 1e30),
    ("min-neg-inf-causal", 1024, True, None, -np.inf, np.inf),
    ("window-inf", 640, True, 100, -np.inf, np.inf),
]


@pytest.mark.parametrize("dtype, tol, lse_tol", [(np.float32, FLOAT32, LSE_FLOAT32), (BF16, BF16_MIXED, BF16_MIXED)],
                         ids=["float32", "bf16"])
@pytest.mark.parametrize("name, n, causal, window, lo, hi", EDGE, ids=[e[0] for e in EDGE])
def test_forward_and_backward_on_huge_and_infinite_bounds(name, n, causal, window, lo, hi, dtype, tol,
                                                         lse_tol):
    inputs = make_inputs(Case(seqlen_q=n, seqlen_k=n, causal=causal, window=window), dtype)
    inputs["bound_min"] = np.full(n, lo, np.float32)
    inputs["bound_max"] = np.full(n, hi, np.float32)
    opts = {key: inputs[key] for key in ("bound_min", "bound_max", "use_causal_mask", "sliding_window")}
    qkv = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]
    o, lse = numbafa.attention_fwd(*qkv, mixed_precision=True, lse_layout="natural", **opts)
    o_exp, lse_exp = golden.attention_fwd(*qkv, sinks=None, bound_min=opts["bound_min"],
                                          bound_max=opts["bound_max"], use_causal_mask=causal,
                                          sliding_window=window)
    assert_close(o.astype(np.float32), o_exp, tol, "o")
    assert_close(lse, lse_exp, lse_tol, "lse")
    # The forward's lse feeds the backward: attention() then ctx.backward must be right too.
    grads = numbafa.attention_bwd(*qkv, o, inputs["dy_ref"], lse, mixed_precision=True, **opts)
    expected = golden.attention_bwd(*qkv, o.astype(np.float32), inputs["dy_ref"], lse, **opts)
    for g_name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(g.astype(np.float32), e, tol, g_name)


def test_all_rows_empty():
    n = 256
    inputs = make_inputs(Case(seqlen_q=n, seqlen_k=n))
    inputs["bound_min"] = np.full(n, 10, np.float32)
    inputs["bound_max"] = np.full(n, 10, np.float32)
    qkv = inputs["q_ref"], inputs["k_ref"], inputs["v_ref"]
    o, lse = numbafa.attention_fwd(*qkv, bound_min=inputs["bound_min"], bound_max=inputs["bound_max"],
                                   lse_layout="natural")
    assert (o == 0).all() and np.isposinf(lse).all()
    grads = numbafa.attention_bwd(*qkv, o, inputs["dy_ref"], lse, bound_min=inputs["bound_min"],
                                  bound_max=inputs["bound_max"])
    assert all((g == 0).all() for g in grads)
