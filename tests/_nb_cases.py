"""Inputs and the two ways of computing them shared by tests/test_nb.py and tests/test_nb_users.py:
the Python API's results, and numbafa.nb's from Python (nb's passes compiled with a wrapper) or
from a user's njit functions."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import numbafa
import numbafa.nb as nb

#: Options of nb.plan that the Python API takes as arrays instead.
API_ONLY = ("with_sinks",)


def nb_inputs(bs, nheads, nheads_kv, d_head, seqlen, dtype, seed=0):
    """q, k, v, dy, sinks; ``d_head`` an int, or ``(d_head, d_head_v)``."""
    rng = np.random.default_rng(seed)
    d_head, d_v = (d_head, d_head) if isinstance(d_head, int) else d_head
    q, dy = (rng.standard_normal((bs, nheads, d, seqlen)).astype(dtype) for d in (d_head, d_v))
    k, v = (rng.standard_normal((bs, nheads_kv, d, seqlen)).astype(dtype) for d in (d_head, d_v))
    sinks = rng.standard_normal((bs, nheads)).astype(np.float32)
    return q, k, v, dy, sinks


def bits(x):
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


def api_results(q, k, v, dy, sinks, options):
    kw = {key: val for key, val in options.items() if key not in API_ONLY}
    s = sinks if options.get("with_sinks") else None
    o, lse = numbafa.attention_fwd(q, k, v, s, **kw)
    return (o, lse) + tuple(numbafa.attention_bwd(q, k, v, o, dy, lse, s, **kw))


def nb_results(plan, q, k, v, dy, sinks, call_fwd=nb.attention_fwd, call_bwd=nb.attention_bwd):
    q, k, v, dy = (bits(x) for x in (q, k, v, dy))
    bs, nheads, _, seqlen = q.shape
    o, lse = np.empty_like(dy), np.empty((bs, nheads, 128, seqlen // 128), np.float32)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    if plan.sinks_shape[0]:
        dsinks = np.empty_like(sinks)
        call_fwd(plan, q, k, v, o, lse, sinks)
        call_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks)
        return o, lse, dq, dk, dv, dsinks
    call_fwd(plan, q, k, v, o, lse)
    call_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)
    return o, lse, dq, dk, dv
