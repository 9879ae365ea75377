"""The flash-attention forward kernel: online softmax producing ``o`` and ``lse``.

It produces exactly the statistic the backward consumes: ``lse = max +
log(sum)`` per query row (sinks included in the sum), in float32.

Loop nest: ``prange`` over ``bs * nheads_kv`` work units (an odd number of
units, fewer than 9, is split into two items each owning alternate Q groups:
:func:`numbafa.schedule.q_chunks`); per unit K and V
(``[d, seq]``, as given: no transposed copies, BLAS reads them transposed)
serve every q-head of the GQA group; per q-head, Q groups of 4 x 128 rows,
scaled at load; per group, K tiles of 512 keys with the online softmax
(FlashAttention-2)::

    m_new = max(m, rowmax(S))            # S = Q_scaled^T K, masked to -inf
    P     = exp(S - m_new)               # written in kernel_dtype
    alpha = exp(m - m_new)
    l     = l * alpha + rowsum(P)        # mixed_dtype; P as written (bf16 for bf16 inputs)
    O     = O * alpha + P V              # mixed_dtype, one rounding per K tile
    ...
    o     = O * (1 / l)                  # kernel_dtype;  lse = m + log(l)

Sinks start the statistics: ``m = max(sinks)``, ``l = sum(exp(sinks - m))``.
A row that attends to nothing (no key, no sink) gets ``o = 0`` and
``lse = +inf``. Causal / window tile skipping and the masks are those of the
backward (:mod:`numbafa.kernels.common`); a tile the diagonal cuts through
runs per Q tile on the keys that Q tile may see. Only the K tile order
matters for the per-row numerics; the Q group size is a CPU blocking choice.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ..jit import jit
from ..dtypes import round_to_bf16_inplace, widened
from .common import cut_by_mask, load_scaled, required_q_rows, round_if, store_transposed
from .fastexp import expf
from .gemm import gemm

__all__ = ["flash_attn_fwd"]

_NEG_INF = np.float32(-np.inf)


@jit()
def _visible_keys(q_abs, k_abs0, n_k, use_packing, bound_min, bound_max, use_causal_mask, window):
    """Range ``[lo, hi)`` of the tile's keys visible to query ``q_abs``.

    Every mask of the kernel keeps a contiguous key range per query row:
    packing ``bound_min[q] <= k < bound_max[q]`` (bounds already clamped),
    causal ``k <= q``, window ``k >= q - w + 1``.
    """
    if use_packing:
        lo = int(math.ceil(bound_min[q_abs])) - k_abs0
        hi = int(math.ceil(bound_max[q_abs])) - k_abs0
    elif use_causal_mask:
        hi = q_abs + 1 - k_abs0
        lo = q_abs - window + 1 - k_abs0 if window > 0 else 0
    else:
        return 0, n_k
    hi = min(max(hi, 0), n_k)
    lo = min(max(lo, 0), hi)
    return lo, hi


# Key of -inf under the order-preserving map of float32 bits to int32 used by _row_max.
_NEG_INF_KEY = np.int32(-2139095041)


@jit()
def _row_max(x):
    """Max of a contiguous 1-D float32 array (-inf if empty), by an integer reduction.

    A float max reduction does not vectorise here (its NaN semantics keep
    LLVM from reordering it), an int32 one does (3x faster). The bits ``b``
    of a float map to ``b ^ ((b >> 31) & 0x7FFFFFFF)``, which orders ints as
    their floats for every non-NaN value, -0.0 just below +0.0; the map is
    its own inverse. Inputs are validated finite, so scores hold no NaN.
    """
    u = x.view(np.int32)
    m = _NEG_INF_KEY
    for j in range(u.size):
        b = u[j]
        key = np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))  # np.int32: keep the compare 32-bit wide
        m = key if key > m else m
    return np.int32(m ^ ((m >> 31) & 0x7FFFFFFF)).view(np.float32)


@jit()
def _exp_shifted(x, shift):
    """``x <- exp(x - shift)`` in place (a reduction-free loop, so it vectorises)."""
    for j in range(x.size):
        x[j] = expf(x[j] - shift)


@jit()
def online_softmax_update(s, q_abs0, k_abs0, row_max, alpha, use_packing, bound_min, bound_max,
                          use_causal_mask, window, round_kernel):
    """Masked exp of one K tile of the online softmax, in place on ``[queries, keys]``.

    On exit ``s`` holds P (kernel_dtype; 0 on masked keys), ``row_max`` the new
    running max and ``alpha = exp(m_old - m_new)``, the factor by which the
    row's sum and output accumulator must be scaled. The row sums of P are
    taken afterwards by one matrix-vector product (a sum inside this loop
    would stop it from vectorising).
    """
    n_q, n_k = s.shape
    zero = np.float32(0.0)
    for i in range(n_q):
        row = s[i]
        lo, hi = _visible_keys(q_abs0 + i, k_abs0, n_k, use_packing, bound_min, bound_max,
                               use_causal_mask, window)
        row[:lo] = zero
        row[hi:] = zero
        seen = row[lo:hi]
        m_old = row_max[i]
        m_new = max(m_old, _row_max(seen))
        if m_new == _NEG_INF:  # nothing visible yet
            alpha[i] = np.float32(1.0)
            seen[:] = zero
            continue
        alpha[i] = expf(m_old - m_new)
        _exp_shifted(seen, m_new)
        if round_kernel:
            round_to_bf16_inplace(seen)
        row_max[i] = m_new


@jit()
def rescale_accumulate(acc, pv, row_sum, tile_sum, alpha, round_mixed):
    """``acc = acc * alpha + pv`` and ``l = l * alpha + rowsum(P)``, per row, in mixed_dtype."""
    n_q, d = acc.shape
    for i in range(n_q):
        a = alpha[i]
        row_sum[i] = round_if(row_sum[i] * a + tile_sum[i], round_mixed)
        for x in range(d):
            acc[i, x] = round_if(acc[i, x] * a + pv[i, x], round_mixed)


@jit()
def online_softmax_block(q_cols, k_cols, v_cols, q_abs0, k_abs0, row_max, row_sum, alpha, acc,
                         s_flat, pv_flat, tile_sum, ones, use_packing, bound_min, bound_max,
                         use_causal_mask, window, round_kernel, round_mixed):
    """One online-softmax update of the queries ``q_cols`` by the keys ``k_cols`` / ``v_cols``.

    All three are in the Neuron layout, ``[d, rows]`` / ``[d, keys]`` (views
    with unit inner stride); BLAS reads them transposed where needed, so no
    transposed copy is made. ``S = Q_s^T K`` (one BLAS call), the masked exp
    of :func:`online_softmax_update`, ``rowsum(P)`` as written (a
    matrix-vector product), ``P V`` (one BLAS call) and
    :func:`rescale_accumulate` into the row statistics and ``acc``
    (``[rows, d]``). ``s_flat`` / ``pv_flat`` / ``tile_sum`` are scratch of
    at least ``rows * keys``, ``rows * d`` and ``rows`` elements.
    """
    d_head, n_q = q_cols.shape
    n_k = k_cols.shape[1]
    s = s_flat[:n_q * n_k].reshape(n_q, n_k)
    gemm(q_cols, k_cols, s, True, False, np.float32(1.0), np.float32(0.0))
    online_softmax_update(s, q_abs0, k_abs0, row_max, alpha, use_packing, bound_min, bound_max,
                          use_causal_mask, window, round_kernel)
    np.dot(s, ones[:n_k], tile_sum[:n_q])            # rowsum(P) as written
    pv = pv_flat[:n_q * d_head].reshape(n_q, d_head)
    gemm(s, v_cols, pv, False, True, np.float32(1.0), np.float32(0.0))
    rescale_accumulate(acc, pv, row_sum, tile_sum[:n_q], alpha, round_mixed)


@jit(parallel=True)
def flash_attn_fwd(q, k, v, sinks, bound_min, bound_max, use_packing, use_causal_mask, window,
                   softmax_scale, round_kernel, round_mixed, q_tile, k_tile, q_tile_group,
                   q_chunks, out_o, out_lse):
    """Flash-attention forward over all ``bs * nheads_kv`` work units.

    Parameters
    ----------
    q : float32 or uint16 (bf16 bits) ``[bs, nheads, d_head, seqlen_q]``
    k, v : same dtype ``[bs, nheads_kv, d_head, seqlen_k]``
    sinks : float32 ``[bs, nheads, num_sinks]`` (``num_sinks`` may be 0)
    bound_min, bound_max : float32 ``[seqlen_q]``, clamped; read when ``use_packing``
    use_causal_mask : bool
    window : int, ``min(window, seqlen_k)`` or 0
    softmax_scale : float32
    round_kernel, round_mixed : bool
        Round kernel_dtype / mixed_dtype tiles to bf16.
    q_tile, k_tile, q_tile_group : int
    q_chunks : int
        Split each work unit's Q groups (zigzag) into this many parallel items,
        for problems with fewer work units than cores. Rows are independent,
        so the split changes no result (:func:`numbafa.schedule.q_chunks`).
    out_o : float32 ``[bs, nheads, d_head, seqlen_q]`` (values of the output dtype)
    out_lse : float32 ``[bs, nheads, seqlen_q]``
    """
    bs, nheads, d_head, seqlen_q = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    n_rep = nheads // nheads_kv
    num_sinks = sinks.shape[2]
    q_grp_rows = q_tile * q_tile_group
    one = np.float32(1.0)

    n_groups = (seqlen_q + q_grp_rows - 1) // q_grp_rows
    for item in prange(bs * nheads_kv * q_chunks):
        unit = item // q_chunks
        chunk = item % q_chunks
        b = unit // nheads_kv
        h_kv = unit % nheads_kv
        # K and V stay [d, seq]: float32 inputs are used in place, bf16 ones widened once.
        k_n = widened(k[b, h_kv])
        v_n = widened(v[b, h_kv])
        q_s = np.empty((d_head, q_grp_rows), dtype=np.float32)
        o_acc = np.empty((q_grp_rows, d_head), dtype=np.float32)
        row_max = np.empty(q_grp_rows, dtype=np.float32)
        row_sum = np.empty(q_grp_rows, dtype=np.float32)
        alpha = np.empty(q_grp_rows, dtype=np.float32)
        s_flat = np.empty(q_grp_rows * max(k_tile, 1), dtype=np.float32)
        pv_flat = np.empty(q_grp_rows * d_head, dtype=np.float32)
        tile_sum = np.empty(q_grp_rows, dtype=np.float32)
        ones = np.ones(max(k_tile, 1), dtype=np.float32)

        for r in range(n_rep):
            h = h_kv * n_rep + r
            # Sinks open the statistics of every row.
            sink_max = _NEG_INF
            for i_sink in range(num_sinks):
                sink_max = max(sink_max, sinks[b, h, i_sink])
            sink_sum = np.float32(0.0)
            for i_sink in range(num_sinks):
                sink_sum += expf(sinks[b, h, i_sink] - sink_max)
            for i_group in range(n_groups):
                # Zigzag ownership (groups g and n-1-g go together) balances causal work.
                if min(i_group, n_groups - 1 - i_group) % q_chunks != chunk:
                    continue
                q_grp0 = i_group * q_grp_rows
                rows = min(q_grp_rows, seqlen_q - q_grp0)
                load_scaled(q[b, h], q_grp0, rows, q_s, softmax_scale, round_kernel)
                row_max[:rows] = sink_max
                row_sum[:rows] = round_if(sink_sum, round_mixed)
                o_acc[:rows] = np.float32(0.0)
                for k0 in range(0, seqlen_k, k_tile):
                    n_k = min(k_tile, seqlen_k - k0)
                    r0, r1 = required_q_rows(q_grp0, rows, q_tile, k0, k0 + n_k - 1,
                                             use_causal_mask, window)
                    if r0 >= r1:
                        continue
                    # A tile the causal diagonal (or a window edge) cuts through runs per Q
                    # tile, each on the keys it may see (k <= q, k >= q - w + 1; packing
                    # bounds are clamped to both). The keys left out are masked for every
                    # row of the Q tile (P = 0), and rows are independent, so only work
                    # is saved: the K tile stays the unit of the online-softmax update.
                    cut = cut_by_mask(k0 + n_k - 1, q_grp0 + r0, use_causal_mask, window)
                    step = q_tile if cut else r1 - r0
                    for b0 in range(r0, r1, step):
                        b1 = min(b0 + step, r1)
                        kv0 = k0
                        kv1 = k0 + n_k
                        if cut:
                            kv1 = min(kv1, q_grp0 + b1)
                            if window > 0:
                                kv0 = max(kv0, q_grp0 + b0 - window + 1)
                            if kv1 <= kv0:
                                continue
                        online_softmax_block(q_s[:, b0:b1], k_n[:, kv0:kv1], v_n[:, kv0:kv1], q_grp0 + b0,
                                             kv0, row_max[b0:b1], row_sum[b0:b1], alpha[b0:b1],
                                             o_acc[b0:b1], s_flat, pv_flat, tile_sum, ones,
                                             use_packing, bound_min, bound_max, use_causal_mask,
                                             window, round_kernel, round_mixed)
                # o = O / l; lse = m + log(l); empty rows: o = 0, lse = +inf.
                for i in range(rows):
                    l = row_sum[i]
                    if l > np.float32(0.0):
                        inv = one / l
                        for x in range(d_head):
                            o_acc[i, x] = o_acc[i, x] * inv
                        out_lse[b, h, q_grp0 + i] = row_max[i] + np.float32(math.log(l))
                    else:
                        o_acc[i, :] = np.float32(0.0)
                        out_lse[b, h, q_grp0 + i] = np.float32(np.inf)
                store_transposed(o_acc, rows, out_o[b, h], q_grp0, round_kernel)
