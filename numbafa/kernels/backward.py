"""The flash-attention backward kernel: a CPU twin of Neuron's ``attention_bwd``.

Pseudocode of the Neuron kernel (seed, ``attention_bwd.py:113-139``), which
the helpers below cite by step number::

    D      = rowsum(dO * O)                  # Step 1
    S      = Q_scaled^T K                    # Step 2.1-2.2 (scale folded into Q)
    S      = mask(S)                         # Step 2.3
    P      = exp(S - LSE)                    # Step 2.4
    dV    += P^T dO                          # Step 3.1
    dP     = dO^T V                          # Step 3.2
    dS     = (dP - D) * P                    # Step 4
    dQ    += (dS K) * softmax_scale          # Step 5.1
    dK    += Q_scaled^T dS                   # Step 5.2

Loop nest (seed, ``flash_attn_bwd``): ``prange`` over ``bs * nheads_kv`` work
units; per unit, KV sections outer (dK/dV section accumulators summed over
every q-head of the GQA group), q-heads, Q-tile groups of 4 x 128 rows (dQ
zeroed on the first section, reloaded from the output on later ones, D
computed on the first section only), then the K tiles of the section. With an
odd number of work units (fewer than 9) each unit is split into two items
that own alternate (zigzag) Q groups, each with a private float32 dK/dV
partial summed in a fixed order afterwards (:func:`numbafa.schedule.q_chunks`).

CPU layout. The Neuron tensors are ``[d_head, seq]`` and stay so: K, V and
dO are used in place (float32 inputs; bf16 bits are widened once per section
or Q group), Q_scaled is written ``[d_head, rows]`` at load, and BLAS reads
whichever operand it needs transposed. The accumulators are ``[seq, d_head]``
(dQ^T, dK^T, dV^T), stored transposed into the outputs. The score-shaped
tiles of one (Q group, K tile) pair are kept as ``[keys, queries]`` (S^T, P^T,
dP^T, dS^T), so every matmul is one BLAS call and no tile is ever transposed
by copying:

* ``S^T  = K^T Q_scaled``          ``dP^T = V^T dO``
* ``dV^T += P^T dO^T``             ``dK^T += dS^T Q_scaled^T``
* ``dQ^T += (dS^T)^T K^T * scale`` (the Neuron kernel's sum over transposed
  128-key sub-tiles, accumulated in one fp32 PSUM, is one fp32 BLAS contraction).

BLAS calls go through :func:`numbafa.kernels.gemm.gemm`, which reads a
transposed operand in place and, for float32 accumulators, adds the product
into the accumulator itself (``beta = 1``).

Numerics (``shared/NUMERICS.md``). All arithmetic is float32. Two flags say
where a written tile is rounded to bf16: ``round_kernel`` (inputs are bf16:
tiles written in ``kernel_dtype``) and ``round_mixed`` (bf16 inputs and
``mixed_precision=False``: tiles written in ``mixed_dtype``). Matmul
products of bf16-valued float32 operands are exact, so BLAS sgemm is "bf16
in, fp32 accumulate". The kernel writes float32 outputs whose values are
already rounded to the output dtype; the API converts them.

The kernel never validates; :mod:`numbafa.validation` does, before it runs.
"""

from __future__ import annotations


import numpy as np
from numba import prange

from ..jit import jit
from ..tiling import FLOAT32_MIN
from ..dtypes import round_to_bf16_inplace, widen, widened
from .common import cut_by_mask, load_scaled, load_transposed, required_q_rows, round_if, store_transposed
from .fastexp import expf
from .gemm import gemm

__all__ = ["flash_attn_bwd"]

_F32_MIN = np.float32(FLOAT32_MIN)


@jit()
def compute_rowsum(o_h, dy_h, start, count, d_tile, d_sum, round_kernel, round_mixed):
    """Step 1: ``D = rowsum(O * dO)`` for rows ``start:start+count`` of one q-head.

    Each product is rounded to kernel_dtype, each head-dim tile's partial sum
    to mixed_dtype, and so is their total (seed ``compute_rowsum_single_tile``
    and ``flash_attn_bwd:1264-1270``). Writes ``d_sum[start:start+count]``.
    """
    d_head = o_h.shape[0]
    total = np.zeros(count, dtype=np.float32)
    partial = np.empty(count, dtype=np.float32)
    for d0 in range(0, d_head, d_tile):
        partial[:] = np.float32(0.0)
        for i_d in range(d0, min(d0 + d_tile, d_head)):
            o_row = o_h[i_d]
            dy_row = dy_h[i_d]
            for i in range(count):
                prod = round_if(widen(o_row[start + i]) * widen(dy_row[start + i]), round_kernel)
                partial[i] += prod
        for i in range(count):
            total[i] += round_if(partial[i], round_mixed)
    for i in range(count):
        d_sum[start + i] = round_if(total[i], round_mixed)


@jit()
def _softmax_backward_row(s, dp, neg_lse, d_sum, k_f, use_packing, bound_min, bound_max,
                          round_kernel):
    """One key row of Steps 2.3-4 over contiguous query slices (vectorised loops)."""
    for i in range(s.size):
        x = s[i]
        if use_packing:
            x = _F32_MIN if (k_f < bound_min[i]) | (k_f >= bound_max[i]) else x
        s[i] = expf(x + neg_lse[i])
    if round_kernel:
        round_to_bf16_inplace(s)
    for i in range(s.size):
        dp[i] = (dp[i] - d_sum[i]) * s[i]
    if round_kernel:
        round_to_bf16_inplace(dp)


@jit()
def recompute_softmax_backward(s_t, dp_t, k_abs0, q_abs0, neg_lse, d_sum, use_packing,
                               bound_min, bound_max, use_causal_mask, window, round_kernel):
    """Steps 2.3, 2.4 and 4 on one ``[keys, queries]`` tile, in place.

    On entry ``s_t = S^T`` and ``dp_t = dP^T``; on exit ``s_t = P^T`` and
    ``dp_t = dS^T``, both rounded to kernel_dtype:

    * mask: packing keeps ``bound_min[q] <= k < bound_max[q]`` (one
      ``range_select``), else causal keeps ``k <= q`` and a window ``w``
      keeps ``k >= q - w + 1`` (two ``affine_select``). A masked score is
      the float32 minimum, whose exp is exactly 0; for causal/window the
      masked queries of a key row form a prefix and a suffix, written as 0
      directly (the same P and dS) so the exp loop runs on the visible part;
    * ``P = exp(S + (-LSE))``: one exp, no max subtraction, no division;
    * ``dS = (dP - D) * P``: the fused op, in this operand order, with the
      rounded P.
    """
    n_k, n_q = s_t.shape
    zero = np.float32(0.0)
    for j in range(n_k):
        k_abs = k_abs0 + j
        lo = 0
        hi = n_q
        if use_causal_mask and not use_packing:
            lo = min(max(k_abs - q_abs0, 0), n_q)              # queries before the key
            if window > 0:                                     # queries past k + w - 1
                hi = min(max(k_abs + window - q_abs0, lo), n_q)
        s_row = s_t[j]
        dp_row = dp_t[j]
        s_row[:lo] = zero
        dp_row[:lo] = zero
        s_row[hi:] = zero
        dp_row[hi:] = zero
        q0 = q_abs0 + lo
        q1 = q_abs0 + hi
        _softmax_backward_row(s_row[lo:hi], dp_row[lo:hi], neg_lse[q0:q1], d_sum[q0:q1],
                              np.float32(k_abs), use_packing, bound_min[q0:q1],
                              bound_max[q0:q1], round_kernel)


@jit()
def accumulate(acc, psum, scale, round_mixed):
    """``acc = psum * scale + acc`` written in mixed_dtype (one fused op)."""
    a = acc.reshape(-1)
    p = psum.reshape(-1)
    if scale == np.float32(1.0):
        for i in range(a.size):
            a[i] = round_if(a[i] + p[i], round_mixed)
    else:
        for i in range(a.size):
            a[i] = round_if(p[i] * scale + a[i], round_mixed)


@jit()
def compute_dsinks(sinks_h, neg_lse, d_sum, q_tile, round_mixed):
    """``dsinks = -sum_q p_sink * D`` for one q-head (seed ``flash_attn_bwd:1355-1405``).

    ``p_sink = exp(sink + (-LSE))`` in mixed_dtype; the per-partition
    accumulator (one per row of a Q tile) does ``acc = acc - p_sink * D`` in
    mixed_dtype over the Q tiles, then the partitions are summed in float32.
    """
    seqlen_q = neg_lse.size
    out = np.zeros(sinks_h.size, dtype=np.float32)
    acc = np.empty(q_tile, dtype=np.float32)
    for i_sink in range(sinks_h.size):
        acc[:] = np.float32(0.0)
        for q0 in range(0, seqlen_q, q_tile):
            for p in range(min(q_tile, seqlen_q - q0)):
                p_sink = round_if(expf(sinks_h[i_sink] + neg_lse[q0 + p]), round_mixed)
                acc[p] = round_if(acc[p] - p_sink * d_sum[q0 + p], round_mixed)
        total = np.float32(0.0)
        for p in range(q_tile):
            total += acc[p]
        out[i_sink] = total
    return out


@jit()
def _reduce_partials(out, parts, round_out):
    """``out[d, k] = round(out[d, k] + parts[0][d, k] + parts[1][d, k] + ...)``, in that order."""
    d_head, seqlen_k = out.shape
    for x in range(d_head):
        for j in range(seqlen_k):
            acc = out[x, j]
            for c in range(parts.shape[0]):
                acc += parts[c, x, j]
            out[x, j] = round_if(acc, round_out)


@jit(parallel=True)
def flash_attn_bwd(q, k, v, o, dy, lse, sinks, bound_min, bound_max, use_packing,
                   use_causal_mask, window, softmax_scale, round_kernel, round_mixed,
                   q_tile, k_tile, k_sub_tile, q_tile_group, d_tile, section_len, q_chunks,
                   out_dq, out_dk, out_dv, out_dsinks, part_dk, part_dv):
    """Flash-attention backward over all ``bs * nheads_kv`` work units.

    Parameters
    ----------
    q, o, dy : float32 or uint16 (bf16 bits) ``[bs, nheads, d_head, seqlen_q]``
    k, v : same dtype ``[bs, nheads_kv, d_head, seqlen_k]``
    lse : float32 ``[bs, nheads, seqlen_q]`` (natural layout)
    sinks : float32 ``[bs, nheads, num_sinks]`` (``num_sinks`` may be 0)
    bound_min, bound_max : float32 ``[seqlen_q]``, already clamped
        (:func:`clamp_packing_bounds`), read only when ``use_packing``
    use_causal_mask : bool
    window : int
        Sliding window, already ``min(window, seqlen_k)``; 0 for none.
    softmax_scale : float32
    round_kernel, round_mixed : bool
        Round kernel_dtype / mixed_dtype tiles to bf16 (see module docstring).
    q_tile, k_tile, k_sub_tile, q_tile_group, d_tile, section_len : int
        The tiling of :func:`numbafa.config.setup_config`.
    q_chunks : int
        Split each work unit's Q groups into this many parallel items (CPU
        schedule for few work units; see :func:`numbafa.schedule.q_chunks`).
        Each item owns its dQ rows and a private float32 dK/dV partial,
        summed in chunk order afterwards. Must be 1 when ``round_mixed``
        (bf16 accumulators cannot be split without changing their rounding).
    out_dq : float32 ``[bs, nheads, d_head, seqlen_q]``
    out_dk, out_dv : float32 ``[bs, nheads_kv, d_head, seqlen_k]``
    out_dsinks : float32 ``[bs, nheads, num_sinks]``
        Written in full by the kernel.
    part_dk, part_dv : float32 ``[bs * nheads_kv, q_chunks - 1, d_head, seqlen_k]``
        Scratch for the partials of chunks 1.. (chunk 0 keeps its partial in
        the float32 outputs); only used when ``q_chunks > 1``.
    """
    bs, nheads, d_head, seqlen_q = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    n_units = bs * nheads_kv
    n_rep = nheads // nheads_kv
    num_sinks = sinks.shape[2]
    q_grp_rows = q_tile * q_tile_group
    n_groups = (seqlen_q + q_grp_rows - 1) // q_grp_rows
    one = np.float32(1.0)
    zero = np.float32(0.0)
    # bf16 inputs keep dQ's PSUM as a tile of its own, added once per K tile as the
    # hardware does: dQ is rounded to bf16 between sections, where a different fp32
    # summation order would flip roundings. float32 inputs have no such point.
    dq_via_psum = round_kernel
    # A zero-length key sequence still runs one (empty) section, so that D,
    # dQ = 0 and dsinks are produced by the same code path.
    n_sections = max(1, (seqlen_k + section_len - 1) // section_len)

    # -LSE bias, loaded once per (batch, head), written in mixed_dtype; D = rowsum(O dO)
    # is filled in on the first section, by whichever item owns the rows.
    neg_lse = np.empty((n_units, n_rep, seqlen_q), dtype=np.float32)
    d_sum = np.empty((n_units, n_rep, seqlen_q), dtype=np.float32)
    for unit in prange(n_units):
        for r in range(n_rep):
            for i in range(seqlen_q):
                neg_lse[unit, r, i] = round_if(-lse[unit // nheads_kv, (unit % nheads_kv) * n_rep + r, i],
                                               round_mixed)

    for item in prange(n_units * q_chunks):
        unit = item // q_chunks
        chunk = item % q_chunks
        b = unit // nheads_kv
        h_kv = unit % nheads_kv

        # Per-item scratch, sized for the largest tiles.
        sec_cap = min(section_len, seqlen_k)
        dk_acc = np.empty((sec_cap, d_head), dtype=np.float32)
        dv_acc = np.empty((sec_cap, d_head), dtype=np.float32)
        q_s = np.empty((d_head, q_grp_rows), dtype=np.float32)
        dq_t = np.empty((q_grp_rows, d_head), dtype=np.float32)
        st_flat = np.empty(k_tile * q_grp_rows, dtype=np.float32)
        dpt_flat = np.empty(k_tile * q_grp_rows, dtype=np.float32)
        kd_flat = np.empty(k_tile * d_head, dtype=np.float32)
        qd_flat = np.empty(q_grp_rows * d_head, dtype=np.float32)

        for i_section in range(n_sections):
            k_sec0 = i_section * section_len
            sec_len = max(0, min(section_len, seqlen_k - k_sec0))
            # K and V stay [d, seq] (float32: views of the inputs; bf16: widened copies).
            k_n = widened(k[b, h_kv][:, k_sec0:k_sec0 + sec_len])
            v_n = widened(v[b, h_kv][:, k_sec0:k_sec0 + sec_len])
            dk_acc[:] = np.float32(0.0)
            dv_acc[:] = np.float32(0.0)

            for r in range(n_rep):
                h = h_kv * n_rep + r
                for i_group in range(n_groups):
                    # Zigzag ownership (groups g and n-1-g go together) balances causal work.
                    if min(i_group, n_groups - 1 - i_group) % q_chunks != chunk:
                        continue
                    q_grp0 = i_group * q_grp_rows
                    rows = min(q_grp_rows, seqlen_q - q_grp0)
                    if i_section == 0:
                        dq_t[:rows] = np.float32(0.0)
                    else:
                        load_transposed(out_dq[b, h], q_grp0, rows, dq_t, one, False)
                    load_scaled(q[b, h], q_grp0, rows, q_s, softmax_scale, round_kernel)
                    dy_n = widened(dy[b, h][:, q_grp0:q_grp0 + rows])
                    if i_section == 0:
                        compute_rowsum(o[b, h], dy[b, h], q_grp0, rows, d_tile, d_sum[unit, r],
                                       round_kernel, round_mixed)

                    for k_tile0 in range(0, sec_len, k_tile):
                        n_k = min(k_tile, sec_len - k_tile0)
                        k_abs0 = k_sec0 + k_tile0
                        t0, t1 = required_q_rows(q_grp0, rows, q_tile, k_abs0, k_abs0 + n_k - 1,
                                                 use_causal_mask, window)
                        if t0 >= t1:
                            continue
                        # A tile the causal diagonal (or window edge) cuts through is computed
                        # in 128-key sub-blocks, each on the Q tiles it needs only. Numerics
                        # are unchanged: dV/dK rows still take one addition per K tile, and
                        # dQ's fp32 PSUM still sums the whole K tile before its one.
                        cut = cut_by_mask(k_abs0 + n_k - 1, q_grp0 + t0, use_causal_mask, window)
                        sub = min(k_sub_tile, n_k) if cut else n_k
                        dq_psum = qd_flat[:(t1 - t0) * d_head].reshape(t1 - t0, d_head)
                        if dq_via_psum and cut:
                            dq_psum[:] = np.float32(0.0)
                        for kb0 in range(k_tile0, k_tile0 + n_k, sub):
                            n_kb = min(sub, k_tile0 + n_k - kb0)
                            kb_abs = k_sec0 + kb0
                            r0, r1 = t0, t1
                            if sub < n_k:
                                r0, r1 = required_q_rows(q_grp0, rows, q_tile, kb_abs, kb_abs + n_kb - 1,
                                                         use_causal_mask, window)
                                if r0 >= r1:
                                    continue
                            n_q = r1 - r0
                            k_cols = k_n[:, kb0:kb0 + n_kb]
                            q_cols = q_s[:, r0:r1]
                            dy_cols = dy_n[:, r0:r1]

                            # Step 2.1 S^T = K^T Q_s and Step 3.2 dP^T = V^T dO (fp32 PSUM).
                            s_t = st_flat[:n_kb * n_q].reshape(n_kb, n_q)
                            dp_t = dpt_flat[:n_kb * n_q].reshape(n_kb, n_q)
                            gemm(k_cols, q_cols, s_t, True, False, one, zero)
                            gemm(v_n[:, kb0:kb0 + n_kb], dy_cols, dp_t, True, False, one, zero)
                            # Steps 2.3, 2.4, 4: s_t <- P^T, dp_t <- dS^T.
                            recompute_softmax_backward(s_t, dp_t, kb_abs, q_grp0 + r0,
                                                       neg_lse[unit, r], d_sum[unit, r], use_packing,
                                                       bound_min, bound_max, use_causal_mask, window,
                                                       round_kernel)

                            # Step 5.1: dQ += (dS K) * scale. The Neuron kernel contracts over
                            # transposed 128-key sub-tiles (tiling.K_SUB_TILE) summed in one
                            # fp32 PSUM; a BLAS call over dS^T and K^T is that sum (sub-blocks
                            # add theirs with beta = 1). For float32 inputs BLAS adds the
                            # product into dQ directly.
                            if dq_via_psum:
                                gemm(dp_t, k_cols, dq_psum[r0 - t0:r1 - t0], True, True, one,
                                     one if cut else zero)
                            else:
                                gemm(dp_t, k_cols, dq_t[r0:r1], True, True, softmax_scale, one)

                            # Step 3.1: dV += P^T dO and Step 5.2: dK += Q_s^T dS (section
                            # accumulators, GQA-reduced); bf16 accumulators take their one
                            # rounded addition from a PSUM.
                            if round_mixed:
                                kd_psum = kd_flat[:n_kb * d_head].reshape(n_kb, d_head)
                                gemm(s_t, dy_cols, kd_psum, False, True, one, zero)
                                accumulate(dv_acc[kb0:kb0 + n_kb], kd_psum, one, True)
                                gemm(dp_t, q_cols, kd_psum, False, True, one, zero)
                                accumulate(dk_acc[kb0:kb0 + n_kb], kd_psum, one, True)
                            else:
                                gemm(s_t, dy_cols, dv_acc[kb0:kb0 + n_kb], False, True, one, one)
                                gemm(dp_t, q_cols, dk_acc[kb0:kb0 + n_kb], False, True, one, one)

                        if dq_via_psum:  # dQ += PSUM * scale, one (rounded) addition per K tile
                            accumulate(dq_t[t0:t1], dq_psum, softmax_scale, round_mixed)

                    # dQ round-trips through the output between sections.
                    store_transposed(dq_t, rows, out_dq[b, h], q_grp0, round_kernel)

            if q_chunks == 1:
                store_transposed(dk_acc, sec_len, out_dk[b, h_kv], k_sec0, round_kernel)
                store_transposed(dv_acc, sec_len, out_dv[b, h_kv], k_sec0, round_kernel)
            elif chunk == 0:  # chunk 0's float32 partial waits in the (float32) output
                store_transposed(dk_acc, sec_len, out_dk[b, h_kv], k_sec0, False)
                store_transposed(dv_acc, sec_len, out_dv[b, h_kv], k_sec0, False)
            else:
                store_transposed(dk_acc, sec_len, part_dk[unit, chunk - 1], k_sec0, False)
                store_transposed(dv_acc, sec_len, part_dv[unit, chunk - 1], k_sec0, False)

    # Split units: add the other chunks' float32 partials in chunk order, then round once.
    if q_chunks > 1:
        for unit in prange(n_units):
            b = unit // nheads_kv
            h_kv = unit % nheads_kv
            _reduce_partials(out_dk[b, h_kv], part_dk[unit], round_kernel)
            _reduce_partials(out_dv[b, h_kv], part_dv[unit], round_kernel)

    if num_sinks > 0:
        for unit in prange(n_units):
            b = unit // nheads_kv
            for r in range(n_rep):
                h = (unit % nheads_kv) * n_rep + r
                # Element by element: an array-to-slice assignment would make Numba
                # compile its shape-formatting error path (~4 s of cold compile).
                dsinks = compute_dsinks(sinks[b, h], neg_lse[unit, r], d_sum[unit, r], q_tile,
                                        round_mixed)
                for i_sink in range(num_sinks):
                    out_dsinks[b, h, i_sink] = dsinks[i_sink]
