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
  that attends to nothing has ``o = 0``, ``lse = +inf`` and zero gradient;
* attention dropout materialises its keep mask (:func:`keep_mask`) with a
  Philox-4x32-10 of its own, in NumPy, and differentiates the dropped
  forward ``O = (P * Z / (1 - p)) V`` as written.

It shares no code with :mod:`numbafa.kernels`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["attention_fwd", "attention_bwd", "attention_bwd_rounded", "allowed_mask", "keep_mask",
           "ROUNDING_POINTS"]


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
    # Upstream convention: None or any value < 1 (e.g. -1) means no window.
    window = min(int(sliding_window), seqlen_k) if sliding_window is not None and sliding_window >= 1 else 0
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


def philox(counter, key, rounds=10):
    """Philox-4x32 (Salmon et al., SC 2011) on NumPy arrays.

    ``counter``: four uint64 arrays (32-bit words, broadcastable), ``key``:
    two; returns four uint64 arrays. Each round bumps the key first (from the
    second round on), then multiplies words 0 and 2 by the Philox constants
    and mixes the high halves with the other words and the key.
    """
    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) for x in counter]
    k = [np.uint64(key[0]), np.uint64(key[1])]
    for r in range(rounds):
        if r:
            k = [(k[0] + np.uint64(0x9E3779B9)) & mask, (k[1] + np.uint64(0xBB67AE85)) & mask]
        hi_lo_0 = c[0] * np.uint64(0xD2511F53)
        hi_lo_1 = c[2] * np.uint64(0xCD9E8D57)
        c = [(hi_lo_1 >> np.uint64(32)) ^ c[1] ^ k[0], hi_lo_1 & mask,
             (hi_lo_0 >> np.uint64(32)) ^ c[3] ^ k[1], hi_lo_0 & mask]
    return c


def keep_mask(bs, nheads, seqlen_q, seqlen_k, dropout_p, seed, seed_offset=0, first_row=0):
    """The dropout keep mask ``Z``, bool ``[bs, nheads, seqlen_q, seqlen_k]`` (True: kept).

    ``first_row``: the query index of the first row (for a block of rows).

    The spec (docs/numerics.md, "Dropout"): the call key is the first two
    words of Philox(counter = (offset low, offset high, 0, 0), key = (seed
    low, seed high)); element ``(b, h, i, j)`` takes word ``(j % 64) // 16``
    of Philox(counter = ((j // 64) * 16 + j % 16, i, h, b), call key) and is
    kept when that word is at least ``round(dropout_p * 2**32)``.
    """
    lo32 = 0xFFFFFFFF
    words = philox([seed_offset & lo32, seed_offset >> 32, 0, 0], [seed & lo32, seed >> 32])
    call_key = (int(words[0]), int(words[1]))
    threshold = np.uint64(min(int(round(dropout_p * 2.0 ** 32)), 2 ** 32))
    b, h, i, j = np.meshgrid(np.arange(bs), np.arange(nheads), first_row + np.arange(seqlen_q),
                             np.arange(seqlen_k), indexing="ij")
    words = philox([(j // 64) * 16 + j % 16, i, h, b], call_key)
    which = (j % 64) // 16
    word = np.choose(which, words) if words[0].size else words[0]
    return word >= threshold


def _dropout_multipliers(shape, dropout_p, seed, seed_offset, keep, dtype):
    """``Z / (1 - p)`` as ``dtype``, ``shape = [bs, nheads, seqlen_q, seqlen_k]`` (None without
    dropout); ``Z`` is ``keep`` if given, else :func:`keep_mask` of the seed and offset."""
    if not dropout_p:
        return None
    z = keep_mask(*shape, dropout_p, seed, seed_offset) if keep is None else np.asarray(keep, bool)
    return z * dtype(1.0 / (1.0 - dropout_p))


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
    # Upstream convention: softmax_scale or 1/sqrt(d), so None and 0.0 select the default.
    scale = 1.0 / np.sqrt(d_head) if not softmax_scale else float(softmax_scale)
    allowed = allowed_mask(seqlen_q, seqlen_k, use_causal_mask, sliding_window, bound_min, bound_max)
    return q64, k64, scale, allowed, _sinks3(sinks, bs, nheads), nheads // nheads_kv


def attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  softmax_scale=None, sliding_window=None, lse_layout="natural", dropout_p=0.0,
                  seed=None, seed_offset=0, keep=None):
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
    dropout_p, seed, seed_offset
        Attention dropout: ``o = (P * Z / (1 - dropout_p)) V`` with ``Z`` from
        :func:`keep_mask`; lse is that of the undropped softmax.
    keep : bool array ``[bs, nheads, seqlen_q, seqlen_k]``, optional
        ``Z`` given explicitly (with ``dropout_p > 0``) instead of drawn from ``seed``.

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
    mult = _dropout_multipliers((bs, nheads, seqlen_q, k64.shape[3]), dropout_p, seed, seed_offset,
                                keep, np.float64)
    for b in range(bs):
        for h in range(nheads):
            p, _, lse[b, h] = _head_probabilities(q64[b, h], k64[b, h // n_rep], scale, allowed, sink3[b, h])
            o[b, h] = v64[b, h // n_rep] @ (p if mult is None else p * mult[b, h]).T
    if lse_layout == "neuron":
        lse = lse.reshape(bs, nheads, seqlen_q // 128, 128).transpose(0, 1, 3, 2)
    elif lse_layout != "natural":
        raise ValueError(f"lse_layout must be 'natural' or 'neuron', got {lse_layout!r}")
    return o, lse


def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0, keep=None):
    """Textbook attention backward in float64, with the kernel's signature.

    ``o_ref``, ``lse_ref`` and ``mixed_precision`` are accepted for signature
    compatibility and ignored: the forward is recomputed from q/k/v in float64.
    With dropout the forward is ``O = P~ V``, ``P~ = P * M``, ``M = Z / (1 -
    p)``, so by the chain rule ``dV = P~^T dO`` and ``dP = (dO V^T) * M``,
    then the softmax backward of P as without dropout. ``keep``: as in
    :func:`attention_fwd`.

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
    mult = _dropout_multipliers((bs, nheads, seqlen_q, k64.shape[3]), dropout_p, seed, seed_offset,
                                keep, np.float64)
    for b in range(bs):
        for h in range(nheads):
            hk = h // n_rep
            p, p_sink, _ = _head_probabilities(q64[b, h], k64[b, hk], scale, allowed, sink3[b, h])
            dp = dy64[b, h].T @ v64[b, hk]                       # [seqlen_q, seqlen_k]
            p_dv = p
            if mult is not None:  # dropout: dP = (dO V^T) * M, and dV takes P~ = P * M
                dp = dp * mult[b, h]
                p_dv = p * mult[b, h]
            # Textbook softmax backward over all columns; sink columns have dP = 0.
            row_dot = (p * dp).sum(axis=1, keepdims=True)
            ds = p * (dp - row_dot)
            ds_sink = p_sink * (0.0 - row_dot)
            dq[b, h] = (ds @ k64[b, hk].T).T * scale
            dk[b, hk] += (q64[b, h] * scale) @ ds
            dv[b, hk] += dy64[b, h] @ p_dv
            dsinks[b, h] = ds_sink.sum(axis=0)
    if sinks_ref is None:
        return dq, dk, dv
    return dq, dk, dv, dsinks.reshape(np.shape(sinks_ref))


# ---------------------------------------------------------------------------
# The numerics golden: the kernel's rounding points, in plain NumPy.
# ---------------------------------------------------------------------------

#: Rounding points of the numerics golden (``shared/NUMERICS.md``), by name.
ROUNDING_POINTS = (
    "q_load",      # Q * softmax_scale written in kernel_dtype
    "neg_lse",     # -LSE bias written in mixed_dtype
    "d_product",   # each O * dO product in kernel_dtype
    "d_partial",   # per-head-dim-tile partial of D in mixed_dtype
    "d_total",     # D in mixed_dtype
    "p",           # P in kernel_dtype
    "ds",          # dS in kernel_dtype
    "acc",         # dQ/dK/dV accumulators in mixed_dtype after each addition
    "dq_section",  # dQ written in kernel_dtype between KV sections
    "sinks",       # the sink logits, p_sink, the dsinks accumulator and its sum in mixed_dtype
)


def _bf16_round(x):
    """float32 -> nearest bf16 (ties to even) -> float32, by ml_dtypes' own cast."""
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _bf16_ulp(x):
    """One bf16 ulp of each element of ``x`` (float64; subnormal spacing 2^-133 at the bottom)."""
    mag = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(mag, 2.0 ** -133)))
    return 2.0 ** (np.maximum(exponent, -126) - 7)


class _FlipBudget:
    """Sums one bf16 ulp per rounding of an accumulator, except its latest one.

    ``rounded(x)`` is called with each freshly rounded accumulator value; the
    ulp of the previous rounded value joins the budget then, so at the end the
    budget holds every rounding but the last (the output's own).
    """

    def __init__(self, shape):
        self.total = np.zeros(shape)
        self._last = np.zeros(shape)

    def rounded(self, x, rounds):
        if rounds:
            self.total += self._last
            self._last = _bf16_ulp(x)
        return x


def _neuron_tiling(d_head):
    """(d_tile, section_len) of the Neuron kernel: head-dim tiles of <= 128,
    KV sections of ``8192 // power_of_2(#head-dim tiles)`` keys (>= 512)."""
    n_d = -(-d_head // 128)
    d_tile = -(-d_head // n_d)
    pow2 = 1 << (n_d - 1).bit_length()
    return d_tile, max(512, (8192 // pow2) // 512 * 512)


# ---------------------------------------------------------------------------
# The flip budget of the tiles that feed a GEMM (D, P, dS) and of the output
# GEMMs' own float32 sums: how far an implementation with the same rounding
# points but other float32 summation orders (and another float32 exp) may
# stray from this golden. docs/numerics.md, "How far two faithful
# implementations differ", derives each term.
# ---------------------------------------------------------------------------

_U = 2.0 ** -24       # float32 unit roundoff
_TINY = 2.0 ** -126   # smallest normal float32/bf16: oneDNN's bf16 units flush below it (DAZ, FTZ)
#: exp's error on both sides, in float32 ulps of the exact value: the kernel's expf is within
#: 1 ulp of the correctly rounded value (numbafa/kernels/fastexp.py), so 1.5 of the exact one;
#: NumPy's float32 exp (SIMD) was measured at most EXP_ULPS_NUMPY over [-104, 2], all inputs.
_EXP_ULPS_KERNEL = 1.5
_EXP_ULPS_NUMPY = 3.0
_EXP_ULPS = _EXP_ULPS_KERNEL + _EXP_ULPS_NUMPY


def _gamma(n):
    """Higham's ``gamma_n = n u / (1 - n u)``: a float32 evaluation of a sum of exact terms with
    ``n`` roundings on the path to the result (``n - 1`` additions for ``n`` terms, in any order:
    sequential, blocked, pairwise) is within ``gamma_n * sum|term|`` of the exact sum."""
    return n * _U / (1.0 - n * _U)


def _abs_matmul(a, b):
    """An upper bound of ``|a| @ |b|`` in float64 (float32 product of the magnitudes, inflated
    by its own worst-case relative error, so it never under-estimates)."""
    n = a.shape[-1]
    prod = np.abs(a).astype(np.float32) @ np.abs(b).astype(np.float32)
    return prod.astype(np.float64) * (1.0 + 2.0 * _gamma(n + 2))


def _max_abs(*arrays):
    return max(float(np.abs(a).max(initial=0)) for a in arrays)


def _order_spread(abs_sum, n, max_abs_operand=0.0):
    """Largest difference between two float32 evaluations, with ``n`` roundings each, of a sum
    of exact products whose magnitudes sum to ``abs_sum``: each side is within
    ``gamma_n * abs_sum`` of the exact value, and a side that flushes bf16 subnormals (oneDNN's
    bf16 units) loses at most ``2^-126`` per addition and ``2^-126 * max|operand|`` per product
    (``max_abs_operand``; 0 where no such flush happens)."""
    return 2.0 * _gamma(n) * abs_sum + (n + 1) * _TINY * max_abs_operand


def _rounding_spread(x, radius, rounds):
    """Largest ``|round(y) - round(x)|`` over float32 ``y`` with ``|y - x| <= radius`` (float64).

    ``x`` is this golden's float32 value before a rounding point, ``radius`` a bound on how far
    another implementation's value can be from it. Without a rounding (``rounds`` False: the tile
    is float32) the spread is the radius itself. With one, rounding to bf16 is monotone, so the
    extremes are the roundings of the interval's ends (taken outward to float32): the spread is
    zero unless the interval holds a bf16 rounding boundary, and then it is the bf16 step(s)
    crossed -- one ulp of the value for a small radius.
    """
    radius = np.asarray(radius, np.float64)
    if not rounds:
        return radius
    x64 = np.asarray(x, np.float64)
    lo64, hi64 = x64 - radius, x64 + radius
    with np.errstate(over="ignore"):
        lo, hi = lo64.astype(np.float32), hi64.astype(np.float32)
    lo = np.where(lo > lo64, np.nextafter(lo, np.float32(-np.inf)), lo)
    hi = np.where(hi < hi64, np.nextafter(hi, np.float32(np.inf)), hi)
    centre = _bf16_round(x).astype(np.float64)
    spread = np.maximum(_bf16_round(hi) - centre, centre - _bf16_round(lo))
    return np.where(radius > 0, spread, 0.0)


def _rowsum_spread(prod, d_tile, round_partial, round_total):
    """How far another order can move ``D = rowsum(O * dO)`` (rounding points 4, 5), per row.

    The products are rounded elementwise (the same on both sides); each head-dim tile's
    partial is a float32 sum of ``d_tile`` of them, and ``D`` the float32 sum of the partials.
    """
    f32 = np.float32
    parts, part_spreads = [], []
    for i in range(0, prod.shape[1], d_tile):
        chunk = prod[:, i:i + d_tile]
        pre = chunk.sum(axis=1, dtype=f32)
        radius = _order_spread(np.abs(chunk).sum(axis=1, dtype=np.float64), chunk.shape[1] - 1)
        parts.append(_bf16_round(pre) if round_partial else pre)
        part_spreads.append(_rounding_spread(pre, radius, round_partial))
    pre = np.sum(parts, axis=0, dtype=f32)
    part_spread = np.sum(part_spreads, axis=0)      # the other side's parts: within that of ours
    radius = (1.0 + _U) * part_spread + _order_spread(
        np.abs(np.asarray(parts, np.float64)).sum(axis=0) + part_spread, len(parts) - 1)
    return _rounding_spread(pre, radius, round_total)


def _score_tile_spreads(qs, kt, dyt, vt, t, p_pre, p, m, ds_pre, d_spread, allowed, round_p, round_ds,
                        mult=None, dropped_dp=None):
    """How far another implementation's P and dS tiles can be from this golden's, per element.

    ``S = Q_s K^T`` and ``dP = dO V^T`` are float32 sums of ``d_head`` exact products: the two
    sides' values are within :func:`_order_spread` of each other. That moves
    ``t = fl(S + (-LSE))`` (another float32 rounding each side), ``P = exp(t)`` by the factor
    ``e^|dt|`` and by both exps' last-bit errors, and ``dS = fl(fl(dP - D) * P)`` by the spreads
    of dP, D and the (rounded) P. Masked entries are exactly 0 on both sides. With dropout
    (``mult``: the multipliers M; ``dropped_dp``: this golden's ``fl(dP * M)``), dP's spread is
    scaled by M, plus one float32 rounding of the product on each side.
    Returns ``(dev_p, dev_ds)``: float64 bounds on ``|P' - P|`` and ``|dS' - dS|`` after the
    kernel_dtype roundings -- zero except on elements whose value lies within that distance of
    a bf16 rounding boundary.
    """
    u32 = 2.0 ** -23   # float32 ulp relative to the value (at most)
    d = qs.shape[1]
    r_s = _order_spread(_abs_matmul(qs, kt.T), d - 1, 1.0 + _max_abs(qs, kt))
    r_t = np.where(allowed, (1.0 + _U) * r_s + 2.0 * _U * np.abs(t.astype(np.float64)), 0.0)
    p64 = p_pre.astype(np.float64)
    r_p = p64 * (np.expm1(r_t) * (1.0 + _EXP_ULPS_KERNEL * u32) + _EXP_ULPS * u32) \
        / (1.0 - _EXP_ULPS_NUMPY * u32) + _EXP_ULPS * 2.0 ** -149
    dev_p = _rounding_spread(p_pre, np.where(allowed, r_p, 0.0), round_p)
    r_dp = _order_spread(_abs_matmul(dyt, vt.T), d - 1, 1.0 + _max_abs(dyt, vt))
    m64 = m.astype(np.float64)
    if mult is not None:
        r_dp = (1.0 + _U) * r_dp * mult.astype(np.float64) + 2.0 * _U * np.abs(dropped_dp.astype(np.float64))
    r_m = (1.0 + _U) * (r_dp + d_spread[:, None]) + 2.0 * _U * np.abs(m64)
    r_ds = (1.0 + 2.0 * _U) * (r_m * (np.abs(p.astype(np.float64)) + dev_p) + np.abs(m64) * dev_p) \
        + 2.0 * _U * np.abs(ds_pre.astype(np.float64))
    dev_ds = _rounding_spread(ds_pre, np.where(allowed, r_ds, 0.0), round_ds)
    return dev_p, dev_ds


def _output_spreads(dev_p, dev_ds, p, ds, qs, kt, dyt, scale, n_dq, n_dkv):
    """One q-head's share of the dQ^T, dK^T, dV^T budgets ``[rows, d]`` from the score tiles.

    A tile element that another implementation rounds differently (``dev_*`` > 0) moves each
    output it feeds by at most ``dev * |the other operand|``: ``dV += P^T dO``,
    ``dK += dS^T Q_s``, ``dQ += dS K * scale``. On top, the output GEMMs are themselves float32
    sums with ``n`` roundings on any term's path (``n_dq``: seqlen_k - 1 additions, plus the
    ``* scale`` and the addition into dQ of each K tile; ``n_dkv``: q-heads per KV head x
    seqlen_q terms) in an unknown order: ``2 gamma_n sum|term|``, the terms being at most
    ``|x| + dev`` on the other side.
    """
    def spread(dev, x, other, n):
        weight = (1.0 + 2.0 * _gamma(n)) * dev + 2.0 * _gamma(n) * np.abs(x.astype(np.float64))
        return _abs_matmul(weight, other) + (n + 1) * _TINY * (1.0 + _max_abs(other))

    dq = float(scale) * (1.0 + _U) * spread(dev_ds, ds, kt, n_dq)
    dk = spread(dev_ds.T, ds.T, qs, n_dkv)
    dv = spread(dev_p.T, p.T, dyt, n_dkv)
    return dq, dk, dv


def _sink_spread(sink, neg_lse, d_sum, d_spread, lanes, round_p):
    """How far another implementation's dsinks sum can be from this golden's, before the
    roundings of the lanes (counted one ulp each by the caller) and of the result.

    ``p_sink = exp(sink + (-LSE))`` may differ by both exps' last-bit errors and, when it is
    rounded (``round_p``), flip; ``D`` by ``d_spread``; each lane takes ``p_sink * D`` of its
    rows (a product and a difference, float32), and the 128 lanes are summed in float32.
    """
    u32 = 2.0 ** -23
    pre = np.exp(sink + neg_lse)
    p64 = pre.astype(np.float64)
    radius = p64 * _EXP_ULPS * u32 / (1.0 - _EXP_ULPS_NUMPY * u32) + _EXP_ULPS * 2.0 ** -149
    dev = _rounding_spread(pre, radius, round_p)
    p_sink = np.abs((_bf16_round(pre) if round_p else pre).astype(np.float64))
    d_abs = np.abs(d_sum.astype(np.float64))
    per_row = (1.0 + 4.0 * _U) * (dev * (d_abs + d_spread) + p_sink * d_spread)
    return float(per_row.sum() + _order_spread(np.abs(lanes.astype(np.float64)).sum(), lanes.size - 1))

def attention_bwd_rounded(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                          bound_max=None, use_causal_mask=False, mixed_precision=False,
                          softmax_scale=None, sliding_window=None, dropout_p=0.0, seed=None,
                          seed_offset=0, disable=(), ulp_budget=False):
    """The kernel's numerics in materialising NumPy: the numerics golden.

    Unlike :func:`attention_bwd`, this uses ``o_ref`` and ``lse_ref`` (the
    kernel does) and computes in float32, rounding to bf16 exactly where the
    Neuron kernel writes a bf16 tile (``shared/NUMERICS.md``). Tiling
    appears only where it sets the order of rounded additions: dQ is
    accumulated K tile (512 keys) by K tile and rounded to the output dtype at
    the end of each KV section; dK/dV are accumulated Q group (512 rows) by Q
    group, q-head by q-head; the sink accumulator has one lane per row of a
    128-row Q tile. Matmuls are float32 (bf16-valued operands: exact products,
    float32 accumulation). Full score matrices are materialised per head.

    Parameters
    ----------
    q_ref ... seed_offset
        As :func:`numbafa.attention_bwd`; ``lse_ref`` natural or Neuron layout.
        Dropout: ``M = Z * float32(1 / (1 - p))``; ``dS = (dP * M - D) * P``
        (the fp32 product, then the fused op) and ``P~ = P * M`` written in
        kernel_dtype for dV.
    disable : iterable of str
        Names from :data:`ROUNDING_POINTS` to skip (test-only: proves each
        rounding point changes the result).
    ulp_budget : bool
        Also return, per element of dq, dk and dv, how far an implementation
        with the same rounding points but other float32 summation orders (and
        another float32 exp) may stray beyond the final rounding's own ulp
        (``docs/numerics.md``, "How far two faithful implementations differ"):
        one bf16 ulp of the value rounded per *intermediate* rounding of the
        element's accumulator (a flip early in the chain is carried unchanged
        to the output); the flips within reach of the D, P and dS tiles, times
        the operand they multiply; and the output GEMMs' own float32 order.

    Returns
    -------
    dq, dk, dv[, dsinks] : float32 arrays holding values of the output dtype
        (bf16 values for bf16 inputs; dsinks in the dtype of ``sinks_ref``).
    budget : tuple of float64 arrays shaped like dq, dk, dv (and dsinks)
        Only with ``ulp_budget=True`` (float32 inputs: the float32 order terms
        only). For dsinks: one ulp per rounding of its 128 lanes (bf16
        accumulators), the spreads of ``p_sink`` and D, and the lanes' sum.
    """
    import ml_dtypes

    unknown = set(disable) - set(ROUNDING_POINTS)
    if unknown:
        raise ValueError(f"disable must name rounding points from {ROUNDING_POINTS}, got {sorted(unknown)}")
    is_bf16 = np.asarray(q_ref).dtype == ml_dtypes.bfloat16

    def rk(x, point):  # a tile written in kernel_dtype
        return _bf16_round(x) if is_bf16 and point not in disable else np.asarray(x, np.float32)

    def rm(x, point):  # a tile written in mixed_dtype
        return _bf16_round(x) if is_bf16 and not mixed_precision and point not in disable \
            else np.asarray(x, np.float32)

    f32 = np.float32
    q, k, v = (np.asarray(a).astype(f32) for a in (q_ref, k_ref, v_ref))
    o, dy = np.asarray(o_ref).astype(f32), np.asarray(dy_ref).astype(f32)
    bs, nheads, d_head, seqlen_q = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    n_rep = nheads // nheads_kv
    lse = np.asarray(lse_ref, dtype=f32)
    if lse.ndim == 4:
        lse = lse.transpose(0, 1, 3, 2).reshape(bs, nheads, seqlen_q)
    scale = f32(1.0 / np.sqrt(d_head) if not softmax_scale else softmax_scale)
    d_tile, section_len = _neuron_tiling(d_head)
    allowed = allowed_mask(seqlen_q, seqlen_k, use_causal_mask, sliding_window, bound_min, bound_max)
    sink3 = np.zeros((bs, nheads, 0), f32) if sinks_ref is None else \
        np.asarray(sinks_ref).astype(f32).reshape(bs, nheads, -1)

    dq = np.zeros((bs, nheads, d_head, seqlen_q), f32)
    dk = np.zeros((bs, nheads_kv, d_head, seqlen_k), f32)
    dv = np.zeros_like(dk)
    dsinks = np.zeros(sink3.shape, f32)
    budgets = tuple(np.zeros(x.shape) for x in (dq, dk, dv))
    dsinks_budget = np.zeros(sink3.shape)
    mult = _dropout_multipliers((bs, nheads, seqlen_q, seqlen_k), dropout_p, seed, seed_offset, None, f32)
    rounds_kernel = is_bf16
    rounds_mixed = is_bf16 and not mixed_precision

    def rounds(point, dtype_rounds):  # whether this golden rounds at that point
        return dtype_rounds and point not in disable

    for b in range(bs):
        for hk in range(nheads_kv):
            kt, vt = k[b, hk].T, v[b, hk].T                     # [seqlen_k, d]
            dk_acc = np.zeros((seqlen_k, d_head), f32)
            dv_acc = np.zeros((seqlen_k, d_head), f32)
            dk_flips, dv_flips = _FlipBudget(dk_acc.shape), _FlipBudget(dv_acc.shape)
            for h in range(hk * n_rep, (hk + 1) * n_rep):
                qs = rk(q[b, h].T * scale, "q_load")            # [seqlen_q, d]
                dyt = dy[b, h].T
                neg_lse = rm(-lse[b, h], "neg_lse")
                prod = rk(o[b, h].T * dyt, "d_product")
                parts = [rm(prod[:, i:i + d_tile].sum(axis=1, dtype=f32), "d_partial")
                         for i in range(0, d_head, d_tile)]
                d_sum = rm(np.sum(parts, axis=0, dtype=f32), "d_total")
                scores = np.where(allowed, qs @ kt.T, f32(-3.4028234663852886e38))
                t = scores + neg_lse[:, None]
                p_pre = np.exp(t)
                p = rk(p_pre, "p")
                dp = dyt @ vt.T
                if mult is not None:  # dropout: dP * M (an fp32 product), and P~ = P * M for dV
                    dp = dp * mult[b, h]
                m = dp - d_sum[:, None]
                ds_pre = m * p
                ds = rk(ds_pre, "ds")
                p_dv = p if mult is None else rk(p * mult[b, h], "p")
                if ulp_budget:  # the P and dS flips, and the output GEMMs' float32 sums
                    d_spread = _rowsum_spread(prod, d_tile, rounds("d_partial", rounds_mixed),
                                              rounds("d_total", rounds_mixed))
                    head_mult = None if mult is None else mult[b, h]
                    dev_p, dev_ds = _score_tile_spreads(qs, kt, dyt, vt, t, p_pre, p, m, ds_pre, d_spread,
                                                        allowed, rounds("p", rounds_kernel),
                                                        rounds("ds", rounds_kernel), head_mult, dp)
                    if head_mult is not None:  # P~'s own rounding of a P that may differ
                        dev_p = _rounding_spread(p * head_mult, dev_p * head_mult, rounds("p", rounds_kernel))
                    head_q, head_k, head_v = _output_spreads(
                        dev_p, dev_ds, p_dv, ds, qs, kt, dyt, scale,
                        n_dq=seqlen_k + 2 * -(-seqlen_k // 512), n_dkv=n_rep * seqlen_q)
                    budgets[0][b, h] += head_q.T
                    budgets[1][b, hk] += head_k.T
                    budgets[2][b, hk] += head_v.T
                # dQ: K tile by K tile within each section, rounded between sections.
                dq_acc = np.zeros((seqlen_q, d_head), f32)
                dq_flips = _FlipBudget(dq_acc.shape)
                for s0 in range(0, seqlen_k, section_len):
                    if s0 > 0:
                        dq_acc = dq_flips.rounded(rk(dq_acc, "dq_section"), rounds_kernel)
                    for t0 in range(s0, min(s0 + section_len, seqlen_k), 512):
                        t1 = min(t0 + 512, s0 + section_len, seqlen_k)
                        dq_acc = dq_flips.rounded(rm((ds[:, t0:t1] @ kt[t0:t1]) * scale + dq_acc, "acc"),
                                                  rounds_mixed)
                dq[b, h] = dq_acc.T
                # The output's own rounding (a no-op when the accumulator is already bf16).
                dq_flips.rounded(_bf16_round(dq_acc) if is_bf16 else dq_acc, rounds_kernel and not rounds_mixed)
                budgets[0][b, h] += dq_flips.total.T
                # dK/dV: one rounded addition per Q group of 512 rows (per K tile, which
                # holds different keys, so all keys can be updated at once).
                for g0 in range(0, seqlen_q, 512):
                    g1 = min(g0 + 512, seqlen_q)
                    dv_acc = dv_flips.rounded(rm(dv_acc + p_dv[g0:g1].T @ dyt[g0:g1], "acc"), rounds_mixed)
                    dk_acc = dk_flips.rounded(rm(dk_acc + ds[g0:g1].T @ qs[g0:g1], "acc"), rounds_mixed)
                # Sinks: loaded into a mixed_dtype tile, one accumulator lane per row of a
                # 128-row Q tile, the lanes summed into a mixed_dtype tile.
                for i_sink in range(sink3.shape[2]):
                    sink = rm(sink3[b, h, i_sink], "sinks")
                    lanes = np.zeros(128, f32)
                    lane_ulps = np.zeros(128)   # every rounding of a lane precedes the final one
                    for t0 in range(0, seqlen_q, 128):
                        n = min(128, seqlen_q - t0)
                        p_sink = rm(np.exp(sink + neg_lse[t0:t0 + n]), "sinks")
                        lanes[:n] = rm(lanes[:n] - p_sink * d_sum[t0:t0 + n], "sinks")
                        if rounds_mixed:
                            lane_ulps[:n] += _bf16_ulp(lanes[:n])
                    dsinks[b, h, i_sink] = rm(lanes.sum(dtype=f32), "sinks")
                    dsinks_budget[b, h, i_sink] = lane_ulps.sum()
                    if ulp_budget:
                        dsinks_budget[b, h, i_sink] += _sink_spread(
                            sink, neg_lse, d_sum, d_spread, lanes, rounds("sinks", rounds_mixed))
            dk[b, hk] = dk_acc.T
            dv[b, hk] = dv_acc.T
            for flips, acc in ((dk_flips, dk_acc), (dv_flips, dv_acc)):
                flips.rounded(_bf16_round(acc) if is_bf16 else acc, rounds_kernel and not rounds_mixed)
            budgets[1][b, hk] += dk_flips.total.T
            budgets[2][b, hk] += dv_flips.total.T
    if is_bf16:  # outputs are written in the kernel dtype (not a point one can disable)
        dq, dk, dv = _bf16_round(dq), _bf16_round(dk), _bf16_round(dv)
    if sinks_ref is None:
        return (dq, dk, dv) + ((budgets,) if ulp_budget else ())
    extra = ((budgets + (dsinks_budget.reshape(np.shape(sinks_ref)),),) if ulp_budget else ())
    if np.asarray(sinks_ref).dtype == ml_dtypes.bfloat16:
        dsinks = _bf16_round(dsinks)
    return (dq, dk, dv, dsinks.reshape(np.shape(sinks_ref))) + extra
