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
    """``Z / (1 - p)`` as ``dtype``, ``shape = [bs, nheads, seqlen_q, seqlen_k]`` (ones without
    dropout); ``Z`` is ``keep`` if given, else :func:`keep_mask` of the seed and offset."""
    if not dropout_p:
        return np.ones(shape, dtype)
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
            o[b, h] = v64[b, h // n_rep] @ (p * mult[b, h]).T
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
            dp = (dy64[b, h].T @ v64[b, hk]) * mult[b, h]        # [seqlen_q, seqlen_k]
            # Textbook softmax backward over all columns; sink columns have dP = 0.
            row_dot = (p * dp).sum(axis=1, keepdims=True)
            ds = p * (dp - row_dot)
            ds_sink = p_sink * (0.0 - row_dot)
            dq[b, h] = (ds @ k64[b, hk].T).T * scale
            dk[b, hk] += (q64[b, h] * scale) @ ds
            dv[b, hk] += dy64[b, h] @ (p * mult[b, h])
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
        Also return, for dq, dk and dv, the sum over the *intermediate* bf16
        roundings of each element's accumulator (every rounding but the one
        that gives the final value) of one bf16 ulp of the value rounded.
        An implementation with the same rounding points but another float32
        summation order may flip any of those roundings, and a flip early in
        the chain is carried unchanged to the output: this is how far such an
        implementation may stray beyond the final rounding's own ulp
        (``docs/numerics.md``, "How far two faithful implementations differ").

    Returns
    -------
    dq, dk, dv[, dsinks] : float32 arrays holding values of the output dtype
        (bf16 values for bf16 inputs; dsinks in the dtype of ``sinks_ref``).
    budget : tuple of float64 arrays shaped like dq, dk, dv (and dsinks)
        Only with ``ulp_budget=True`` (zeros for float32 inputs). For dsinks
        with bf16 accumulators: one ulp per rounding of its 128 lanes.
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
                p = rk(np.exp(scores + neg_lse[:, None]), "p")
                ds = rk(((dyt @ vt.T) * mult[b, h] - d_sum[:, None]) * p, "ds")
                p = rk(p * mult[b, h], "p") if dropout_p else p   # P~, the operand of dV
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
                budgets[0][b, h] = dq_flips.total.T
                # dK/dV: one rounded addition per Q group of 512 rows (per K tile, which
                # holds different keys, so all keys can be updated at once).
                for g0 in range(0, seqlen_q, 512):
                    g1 = min(g0 + 512, seqlen_q)
                    dv_acc = dv_flips.rounded(rm(dv_acc + p[g0:g1].T @ dyt[g0:g1], "acc"), rounds_mixed)
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
            dk[b, hk] = dk_acc.T
            dv[b, hk] = dv_acc.T
            for flips, acc in ((dk_flips, dk_acc), (dv_flips, dv_acc)):
                flips.rounded(_bf16_round(acc) if is_bf16 else acc, rounds_kernel and not rounds_mixed)
            budgets[1][b, hk] = dk_flips.total.T
            budgets[2][b, hk] = dv_flips.total.T
    if is_bf16:  # outputs are written in the kernel dtype (not a point one can disable)
        dq, dk, dv = _bf16_round(dq), _bf16_round(dk), _bf16_round(dv)
    if sinks_ref is None:
        return (dq, dk, dv) + ((budgets,) if ulp_budget else ())
    extra = ((budgets + (dsinks_budget.reshape(np.shape(sinks_ref)),),) if ulp_budget else ())
    if np.asarray(sinks_ref).dtype == ml_dtypes.bfloat16:
        dsinks = _bf16_round(dsinks)
    return (dq, dk, dv, dsinks.reshape(np.shape(sinks_ref))) + extra
