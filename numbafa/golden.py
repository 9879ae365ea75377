"""Golden references: textbook attention forward and backward in float64 NumPy.

This module is the yardstick the kernels are tested against, so it is written
to be *obviously* right rather than fast:

* everything is computed in float64 from the raw inputs (bf16 inputs are
  widened exactly);
* the score matrix ``S`` and the probabilities ``P`` are materialised for one
  (batch, head) at a time: memory is O(seqlen_q * seqlen_k) and time is
  O(seqlen_q * seqlen_k * d_head) per head -- use it on test-sized problems;
* the backward recomputes the forward from q/k/v (like the upstream torch
  golden, ``o_ref`` and ``lse_ref`` are accepted only to match the kernel's
  signature) and uses the textbook softmax backward
  ``dS = P * (dP - rowsum(P * dP))``, not the kernel's ``rowsum(O * dO)``;
* masked scores are ``-inf`` (not the kernel's float32 minimum); a query row
  that attends to nothing has ``o = 0``, ``lse = +inf`` and zero gradient.

It shares no code with :mod:`numbafa.kernels`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["attention_fwd", "attention_bwd", "allowed_mask"]


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def allowed_mask(seqlen_q, seqlen_k, use_causal_mask=False, sliding_window=None,
                 bound_min=None, bound_max=None):
    """Boolean ``[seqlen_q, seqlen_k]`` matrix: True where query i may attend key j.

    Causal keeps ``j <= i``; a window ``w`` (causal only, capped at seqlen_k)
    also requires ``j >= i - w + 1``. With packing bounds, the row bounds are
    first clamped by causal (``bound_max[i] <= i + 1``) and window
    (``bound_min[i] >= i - w + 1``), then ``bound_min[i] <= j < bound_max[i]``.
    """
    i = np.arange(seqlen_q, dtype=np.float64)[:, None]
    j = np.arange(seqlen_k, dtype=np.float64)[None, :]
    window = min(int(sliding_window), seqlen_k) if sliding_window else 0
    if bound_min is not None:
        lo = np.asarray(bound_min, dtype=np.float64)[:, None]
        hi = np.asarray(bound_max, dtype=np.float64)[:, None]
        if use_causal_mask:
            hi = np.minimum(hi, i + 1)
            if window:
                lo = np.maximum(lo, i - window + 1)
        return (j >= lo) & (j < hi)
    allowed = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if use_causal_mask:
        allowed &= j <= i
        if window:
            allowed &= j >= i - window + 1
    return allowed


def _sinks3(sinks, bs, nheads):
    """Sinks as float64 ``[bs, nheads, num_sinks]`` (num_sinks may be 0)."""
    if sinks is None:
        return np.zeros((bs, nheads, 0))
    s = _f64(sinks)
    return s[..., None] if s.ndim == 2 else s


def _probabilities(scores, sink_logits):
    """Softmax over the key columns and the sink columns of one head.

    Returns ``(p_keys, p_sinks, lse)``; rows with nothing to attend get zero
    probabilities and ``lse = +inf``.
    """
    full = np.concatenate([scores, np.broadcast_to(sink_logits, (scores.shape[0], sink_logits.size))], axis=1)
    row_max = full.max(axis=1, keepdims=True)
    empty = ~np.isfinite(row_max[:, 0])
    row_max[empty] = 0.0
    e = np.exp(full - row_max)
    denom = e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        p = np.where(empty[:, None], 0.0, e / np.where(empty[:, None], 1.0, denom))
        lse = np.where(empty, np.inf, row_max[:, 0] + np.log(denom[:, 0]))
    nk = scores.shape[1]
    return p[:, :nk], p[:, nk:], lse


def _head_probabilities(qh, kh, scale, allowed, sink_logits):
    """Scores ``(q*scale)^T k`` of one head, masked, then softmax."""
    scores = (qh * scale).T @ kh  # [seqlen_q, seqlen_k]
    scores = np.where(allowed, scores, -np.inf)
    return _probabilities(scores, sink_logits)


def _setup(q, k, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window):
    q64, k64 = _f64(q), _f64(k)
    bs, nheads, d_head, seqlen_q = q64.shape
    nheads_kv, seqlen_k = k64.shape[1], k64.shape[3]
    scale = 1.0 / np.sqrt(d_head) if softmax_scale is None else float(softmax_scale)
    allowed = allowed_mask(seqlen_q, seqlen_k, use_causal_mask, sliding_window, bound_min, bound_max)
    return q64, k64, scale, allowed, _sinks3(sinks, bs, nheads), nheads // nheads_kv


def attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  softmax_scale=None, sliding_window=None, lse_layout="natural"):
    """Textbook attention forward in float64.

    Parameters
    ----------
    q : array ``[bs, nheads, d_head, seqlen_q]``
    k, v : arrays ``[bs, nheads_kv, d_head, seqlen_k]``
    sinks : array ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``, optional
        Sink logits: extra softmax columns with no value.
    bound_min, bound_max : arrays ``[seqlen_q]``, optional
        Packing bounds: query i attends keys ``bound_min[i] <= j < bound_max[i]``.
    lse_layout : {"natural", "neuron"}
        ``natural``: lse ``[bs, nheads, seqlen_q]``; ``neuron``:
        ``[bs, nheads, 128, seqlen_q // 128]`` with ``lse[b, h, p, t]`` the
        LSE of row ``t * 128 + p``.

    Returns
    -------
    o : float64 ``[bs, nheads, d_head, seqlen_q]``
    lse : float64, in ``lse_layout``
    """
    q64, k64, scale, allowed, sink3, n_rep = _setup(
        q, k, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window)
    v64 = _f64(v)
    bs, nheads, d_head, seqlen_q = q64.shape
    o = np.zeros((bs, nheads, d_head, seqlen_q))
    lse = np.zeros((bs, nheads, seqlen_q))
    for b in range(bs):
        for h in range(nheads):
            p, _, lse[b, h] = _head_probabilities(q64[b, h], k64[b, h // n_rep], scale, allowed, sink3[b, h])
            o[b, h] = v64[b, h // n_rep] @ p.T
    if lse_layout == "neuron":
        lse = lse.reshape(bs, nheads, seqlen_q // 128, 128).transpose(0, 1, 3, 2)
    elif lse_layout != "natural":
        raise ValueError(f"lse_layout must be 'natural' or 'neuron', got {lse_layout!r}")
    return o, lse


def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None):
    """Textbook attention backward in float64, with the kernel's signature.

    ``o_ref``, ``lse_ref`` and ``mixed_precision`` are accepted for signature
    compatibility and ignored: the forward is recomputed from q/k/v in float64.

    Returns
    -------
    dq : float64 ``[bs, nheads, d_head, seqlen_q]``
    dk, dv : float64 ``[bs, nheads_kv, d_head, seqlen_k]`` (summed over the
        q-heads sharing each KV head)
    dsinks : float64, shape of ``sinks_ref`` (only when sinks are given)
    """
    del o_ref, lse_ref, mixed_precision
    q64, k64, scale, allowed, sink3, n_rep = _setup(
        q_ref, k_ref, sinks_ref, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window)
    v64, dy64 = _f64(v_ref), _f64(dy_ref)
    bs, nheads, d_head, seqlen_q = q64.shape
    dq = np.zeros_like(q64)
    dk = np.zeros_like(k64)
    dv = np.zeros_like(v64)
    dsinks = np.zeros_like(sink3)
    for b in range(bs):
        for h in range(nheads):
            hk = h // n_rep
            p, p_sink, _ = _head_probabilities(q64[b, h], k64[b, hk], scale, allowed, sink3[b, h])
            dp = dy64[b, h].T @ v64[b, hk]                       # [seqlen_q, seqlen_k]
            # Textbook softmax backward over all columns; sink columns have dP = 0.
            row_dot = (p * dp).sum(axis=1, keepdims=True)
            ds = p * (dp - row_dot)
            ds_sink = p_sink * (0.0 - row_dot)
            dq[b, h] = (ds @ k64[b, hk].T).T * scale
            dk[b, hk] += (q64[b, h] * scale) @ ds
            dv[b, hk] += dy64[b, h] @ p
            dsinks[b, h] = ds_sink.sum(axis=0)
    if sinks_ref is None:
        return dq, dk, dv
    return dq, dk, dv, dsinks.reshape(np.shape(sinks_ref))
