"""The flash-attention forward kernel: online softmax producing ``o`` and ``lse``.

It produces exactly the statistic the backward consumes: ``lse = max +
log(sum)`` per query row (sinks included in the sum), in float32.

Loop nest: the launcher's ``prange`` over ``bs * nheads_kv`` work units (an odd number of
units, fewer than 9, is split into two items each owning alternate Q groups:
:func:`numbafa.kernels.schedule.q_chunks`; :mod:`.loops`); per unit K and V
(K ``[d, seq]``: the Neuron layout's as given, read transposed by the GEMM, another layout's
transposed into a copy; V ``[seq, d]``: transposed into a copy once, another layout's rows
copied; :mod:`numbafa.kernels.heads`) serve every q-head of the GQA group; per q-head, Q groups
of 4 x 128 rows (fewer in a split short unit, :func:`numbafa.kernels.schedule.q_group_rows`),
scaled at load; per group, K tiles of 512 keys with the online softmax
(FlashAttention-2)::

    m_new = max(m, rowmax(S))            # S = Q_scaled^T K, masked to -inf
    P     = exp(S - m_new)               # written in kernel_dtype
    alpha = exp(m - m_new)
    l     = l * alpha + rowsum(P)        # mixed_dtype; P as written (bf16 for bf16 inputs)
    P~    = P * Z / (1 - p)              # dropout only (kernel_dtype); l keeps the undropped P
    O     = O * alpha + P~ V             # mixed_dtype, one rounding per K tile
    ...
    o     = O * (1 / l)                  # kernel_dtype;  lse = m + log(l)

Sinks start the statistics: ``m = max(sinks)``, ``l = sum(exp(sinks - m))``.
A row that attends to nothing (no key, no sink) gets ``o = 0`` and
``lse = +inf``. The mask (each query's visible key range) and the causal /
window tile skipping are the backward's (:mod:`numbafa.kernels.mask`); a tile
the diagonal cuts through runs per Q tile on the keys that Q tile may see.
Only the K tile order matters for the per-row numerics; the Q group size is a
CPU blocking choice. The dropout keep mask Z is a function of each element's
coordinates (:mod:`numbafa.kernels.dropout`), drawn for the block's visible keys. Every product
goes through the matmul seam (:func:`numbafa.kernels.matmul.gemm`).

Compile units: everything here is compiled once for every input dtype, option
and GEMM path (:mod:`numbafa.kernels.bundles`; float64 inputs, float64
arithmetic, apart): the inputs arrive as :data:`~numbafa.kernels.stored.Stored`
records, one type for float32 values and bf16 bits, and :func:`fwd_work_item`
branches on the storage once per unit and Q group (the bf16 side of its loads
a plugin, :mod:`numbafa.kernels.stored`).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import types

from ..conventions.dtypes import ROUND_BF16, round_inplace, rounded
from ..compiler.arrays import bitcast, empty, ones
from ..compiler.jit import jit, overload
from ..compiler.linking import unpack
from ..compiler.scalars import max_, min_
from .common import store_transposed
from .dropout import drop_tile
from .fastexp import exp_of, log_of
from .heads import NEURON, gather_head, head_rows, head_slice, store_rows
from .loops import bits_of_row, columns, decode_item, group_rows, n_q_groups, owns_group, row_slice, tile_operand, width
from .mask import cut_by_mask, required_q_rows, seen_keys, tile_pos, visible_keys
from .matmul import any_layout, bits_operand, gemm, row_sums
from .stored import gather_bits, gather_input, input_operand, load_q, stored_dims
from .scores import modify_scores
from .table import call_plugin

__all__ = ["fwd_work_item", "fwd_q_group"]

_NEG_INF = np.float32(-np.inf)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)

#: Running statistics of a block of query rows: max, sum, alpha = exp(m_old - m_new), O accumulator.
RowStats = namedtuple("RowStats", ["row_max", "row_sum", "alpha", "acc"])
#: One q-head: batch, q-head and the statistics its sinks open every row with.
FwdHead = namedtuple("FwdHead", ["batch", "q_head", "sink_max", "sink_sum"])
#: Per-item scratch, sized for the largest tiles (``ones``: the row-sum vector; ``no_values`` /
#: ``no_bits``: the empty members of operands, numbafa.kernels.matmul).
FwdScratch = namedtuple("FwdScratch", ["q_s", "o_acc", "row_max", "row_sum", "alpha", "s", "pv",
                                       "tile_sum", "ones", "q_bits", "p_bits", "no_values", "no_bits"])

# Key of -inf under the order-preserving map of float32 bits to int32 used by _row_max_f32.
_NEG_INF_KEY = np.int32(-2139095041)


def _row_max(x):  # pragma: no cover - replaced by the overload inside njit code
    """Max of a contiguous 1-D float32 or float64 array (-inf if empty)."""
    raise NotImplementedError("_row_max is only callable from @njit code")


@overload(_row_max, inline="always")
def _row_max_overload(x):
    if x.dtype == types.float32:
        return lambda x: _row_max_f32(x)
    if x.dtype == types.float64:
        return lambda x: _row_max_f64(x)
    return None


@jit(inline=True)
def _row_max_f64(x):
    """Max of a contiguous 1-D float64 array (-inf if empty); NaN-free (validated inputs)."""
    m = -np.inf
    for j in range(x.size):
        m = x[j] if x[j] > m else m
    return m


@jit(inline=True)
def _row_max_f32(x):
    """Max of a contiguous 1-D float32 array (-inf if empty), by an integer reduction.

    A float max reduction does not vectorise here (its NaN semantics keep
    LLVM from reordering it), an int32 one does (3x faster). The bits ``b``
    of a float map to ``b ^ ((b >> 31) & 0x7FFFFFFF)``, which orders ints as
    their floats for every non-NaN value, -0.0 just below +0.0; the map is
    its own inverse. Inputs are validated finite, so scores hold no NaN.
    """
    u = bitcast(x, np.int32)
    m = _NEG_INF_KEY
    for j in range(u.size):
        b = u[j]
        key = np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))  # np.int32: keep the compare 32-bit wide
        m = key if key > m else m
    return bitcast(np.int32(m ^ ((m >> 31) & 0x7FFFFFFF)), np.float32)


@jit()
def _exp_shifted(x, shift):
    """``x <- exp(x - shift)`` in place (a reduction-free loop, so it vectorises)."""
    for j in range(x.size):
        x[j] = exp_of(x[j] - shift)


@jit()
def _exp_shifted_bf16(x, shift):
    """:func:`_exp_shifted` rounded to bf16 in the same loop (P written in kernel_dtype): a pass
    over the row less than a rounding of its own."""
    for j in range(x.size):
        x[j] = rounded(exp_of(x[j] - shift), ROUND_BF16)


@jit(apart=True, refcount=False)
def online_softmax_update(s, at, stats, plan, bits_out):
    """Masked exp of one K tile of the online softmax, in place on ``[queries, keys]`` (queries
    from ``at.q0``, keys from ``at.k0``: a :data:`~numbafa.kernels.mask.TilePos`).

    On exit ``s`` holds P (kernel_dtype; 0 on masked keys), ``stats.row_max``
    the new running max and ``stats.alpha = exp(m_old - m_new)``, the factor
    by which the row's sum and output accumulator must be scaled. The row
    sums of P are taken afterwards by one matrix-vector product (a sum inside
    this loop would stop it from vectorising). A ``bits_out`` of ``s``'s shape (uint16; the
    bf16 path without dropout) also receives P's bf16 bits, each row while it is in cache:
    the operand of ``P V`` (:func:`~numbafa.kernels.loops.tile_operand`'s bits, written here
    instead of in a pass of their own over the tile); an empty one, nothing.
    """
    n_q, n_k = s.shape
    fused = bits_out.shape[0] != 0
    for i in range(n_q):
        row = s[i]
        lo, hi = visible_keys(plan.mask, at.q0 + i, at.k0, n_k)
        row[:lo] = _ZERO
        row[hi:] = _ZERO
        seen = row[lo:hi]
        m_old = stats.row_max[i]
        m_new = max_(m_old, _row_max(seen))
        if m_new == _NEG_INF:  # nothing visible yet
            stats.alpha[i] = _ONE
            seen[:] = _ZERO
        else:
            stats.alpha[i] = exp_of(m_old - m_new)
            if plan.precision.round_kernel == ROUND_BF16:
                _exp_shifted_bf16(seen, m_new)
            else:
                _exp_shifted(seen, m_new)
                round_inplace(seen, plan.precision.round_kernel)
            stats.row_max[i] = m_new
        if fused:
            bits_of_row(row, bits_out[i])


@jit(apart=True, refcount=False)
def rescale_accumulate(stats, pv, tile_sum, round_acc):
    """``acc = acc * alpha + pv`` and ``l = l * alpha + rowsum(P)``, per row, in mixed_dtype."""
    n_q, d = stats.acc.shape
    for i in range(n_q):
        a = stats.alpha[i]
        stats.row_sum[i] = rounded(stats.row_sum[i] * a + tile_sum[i], round_acc)
        row = stats.acc[i]
        p_row = pv[i]
        for x in range(d):
            row[x] = row[x] * a + p_row[x]
        round_inplace(row, round_acc)


@jit(apart=True, refcount=False)
def online_softmax_block(plan, head, q_op, k_op, v_op, blk, stats, scratch):
    """One online-softmax update of the queries ``q_op`` by the keys ``k_op`` / ``v_op`` (operands
    ``[d, rows]`` / ``[d, keys]``, the Neuron layout, read transposed by the GEMM for ``S``;
    ``v_op`` ``[keys, d_v]``, transposed once per work item). ``blk`` = ``(q_abs0, k_abs0)``,
    the block's first query and key.

    ``S = Q_s^T K``, the score variants (:func:`numbafa.kernels.scores.modify_scores`), the
    masked exp of :func:`online_softmax_update`, ``rowsum(P)`` as written (a matrix-vector
    product), with dropout ``P~ = P * Z * scale`` (written in kernel_dtype; the row sum, the
    softmax normaliser, keeps every P), ``P V`` and :func:`rescale_accumulate` into ``stats``
    (rows ``[rows, d]``).
    """
    q_abs0, k_abs0 = blk
    at = tile_pos(head, q0=q_abs0, k0=k_abs0)
    n_q = width(q_op, plan.gemm.bits)
    n_k = width(k_op, plan.gemm.bits)
    d_v = stats.acc.shape[1]
    s = scratch.s[:n_q * n_k].reshape(n_q, n_k)
    gemm(q_op, k_op, s, trans_a=True, trans_b=False, alpha=_ONE, beta=_ZERO, path=plan.gemm)
    if plan.scores.active:
        args = (s, at, plan.scores)
        call_plugin(modify_scores, args)
    fused = plan.gemm.bits and not plan.dropout.active   # P's bits written by the softmax step
    p_bits = scratch.p_bits[:n_q * n_k].reshape(n_q, n_k) if fused else scratch.no_bits
    online_softmax_update(s, at, stats, plan, p_bits)
    tile_sum = scratch.tile_sum[:n_q]
    row_sums(s, scratch.ones[:n_k], tile_sum)   # rowsum(P)
    if plan.dropout.active:
        args = (s, at, plan.dropout, plan.precision.round_kernel)
        call_plugin(drop_tile, args)
    pv = scratch.pv[:n_q * d_v].reshape(n_q, d_v)
    # P as written (bf16 values for bf16 inputs): its bits are the operand on the bf16 path.
    if fused:
        p_op = bits_operand(p_bits, scratch.no_values)
    else:
        p_op = tile_operand(any_layout(s), scratch.p_bits, scratch.no_values, scratch.no_bits, plan.gemm.bits)
    gemm(p_op, v_op, pv, trans_a=False, trans_b=False, alpha=_ONE, beta=_ZERO, path=plan.gemm)
    rescale_accumulate(stats, pv, tile_sum, plan.precision.round_acc)


@jit(apart=True, refcount=False)
def fwd_k_tile(plan, head, q_op, k_op, v_op, q_grp0, k0, scratch):
    """One K tile's update of a Q group's statistics (``scratch`` rows; ``q_op``: its Q_scaled
    ``[d, rows]`` as a GEMM operand).

    Q tiles the static mask rules out are skipped. A tile the causal diagonal
    (or a window edge) cuts through runs per Q tile, each on the keys its rows
    may see (its last row's static ``hi``, its first row's static ``lo``;
    packing ranges lie inside those). The keys left out are masked for every
    row of the Q tile (P = 0), and rows are independent, so only work is
    saved: the K tile stays the unit of the online-softmax update.
    """
    tiling = plan.tiling
    mask = plan.mask
    seqlen_k = width(k_op, plan.gemm.bits)
    rows = width(q_op, plan.gemm.bits)
    n_k = min_(tiling.k_tile, seqlen_k - k0)
    r0, r1 = required_q_rows(mask, q_grp0, rows, tiling.q_tile, k0, k0 + n_k - 1)
    if r0 >= r1:
        return
    cut = cut_by_mask(mask, q_first=q_grp0 + r0, k_last=k0 + n_k - 1)
    step = tiling.q_tile if cut else r1 - r0
    for b0 in range(r0, r1, step):
        b1 = min_(b0 + step, r1)
        kv0 = k0
        n_kv = n_k
        if cut:
            kv0, n_kv = seen_keys(mask, np.int64(0), q_grp0 + b0, q_grp0 + b1 - 1, k0, n_k)
            if n_kv <= 0:
                continue
        kv1 = kv0 + n_kv
        stats = RowStats(scratch.row_max[b0:b1], scratch.row_sum[b0:b1], scratch.alpha[b0:b1],
                         scratch.o_acc[b0:b1])
        online_softmax_block(plan, head, columns(q_op, b0, b1), columns(k_op, kv0, kv1), row_slice(v_op, kv0, kv1),
                             (q_grp0 + b0, kv0), stats, scratch)


@jit(apart=True, refcount=False)
def finalize_rows(o_acc, row_max, row_sum, rows, lse_out):
    """``o = O / l`` and ``lse = m + log(l)`` for ``rows`` rows; an empty row: ``o = 0``, ``lse = +inf``."""
    d_head = o_acc.shape[1]
    for i in range(rows):
        l = row_sum[i]
        if l > _ZERO:
            inv = _ONE / l
            for x in range(d_head):
                o_acc[i, x] = o_acc[i, x] * inv
            lse_out[i] = row_max[i] + log_of(l)
        else:
            o_acc[i, :] = _ZERO
            lse_out[i] = np.float32(np.inf)


@jit(apart=True, refcount=False)
def fwd_q_group(plan, head, q_op, k_op, v_op, q_grp0, outs, scratch):
    """One Q group of one q-head over all keys, from its loaded Q_scaled (``q_op``, ``[d,
    rows]``): the statistics opened by the sinks, the K tiles, the finalisation, the stores of
    ``o`` (kernel_dtype) and ``lse``. Compiled once for every input dtype (module docstring)."""
    rows = width(q_op, plan.gemm.bits)
    seqlen_k = width(k_op, plan.gemm.bits)
    scratch.row_max[:rows] = head.sink_max
    scratch.row_sum[:rows] = rounded(head.sink_sum, plan.precision.round_acc)
    scratch.o_acc[:rows] = _ZERO
    for k0 in range(0, seqlen_k, plan.tiling.k_tile):
        fwd_k_tile(plan, head, q_op, k_op, v_op, q_grp0, k0, scratch)
    finalize_rows(scratch.o_acc, scratch.row_max, scratch.row_sum, rows,
                  outs.lse[head.batch, head.q_head, q_grp0:q_grp0 + rows])
    if plan.layout == NEURON:
        store_transposed(scratch.o_acc, rows, outs.o[head.batch, head.q_head], q_grp0, plan.precision.round_kernel)
    else:
        store_rows(scratch.o_acc, rows, head_rows(outs.o, plan.layout, head.batch, head.q_head), q_grp0,
                   plan.precision.round_kernel)


@jit(apart=True, refcount=False)
def sink_statistics(sinks_h):
    """``(max, sum(exp(sink - max)))`` of one q-head's sinks (``-inf, 0`` without sinks)."""
    sink_max = _NEG_INF
    for i_sink in range(sinks_h.size):
        sink_max = max_(sink_max, sinks_h[i_sink])
    sink_sum = _ZERO
    for i_sink in range(sinks_h.size):
        sink_sum += exp_of(sinks_h[i_sink] - sink_max)
    return sink_max, sink_sum


@jit()
def make_fwd_scratch(d_head, d_v, seqlen_q, plan):
    """Per-item scratch buffers (:data:`FwdScratch`), for Q groups of at most ``seqlen_q`` rows, head
    dims ``d_head`` (Q) and ``d_v`` (V, O); the bf16 operand copies only on the bf16 path."""
    tiling = plan.tiling
    q_rows = max_(1, min_(tiling.group_rows, seqlen_q))
    k_cap = max_(tiling.k_tile, 1)
    bits = 1 if plan.gemm.bits else 0
    acc = plan.acc.dtype
    return FwdScratch(q_s=empty((d_head, q_rows), acc),
                      o_acc=empty((q_rows, d_v), acc),
                      row_max=empty(q_rows, acc),
                      row_sum=empty(q_rows, acc),
                      alpha=empty(q_rows, acc),
                      s=empty(q_rows * k_cap, acc),
                      pv=empty(q_rows * d_v, acc),
                      tile_sum=empty(q_rows, acc),
                      ones=ones(k_cap, acc),
                      q_bits=empty(bits * d_head * q_rows, np.uint16),
                      p_bits=empty(bits * q_rows * k_cap, np.uint16),
                      no_values=empty((0, 0), acc),
                      no_bits=empty((0, 0), np.uint16))


@jit()
def fwd_work_item(args, item):
    """One work item: its unit's K and V serve every q-head of the GQA group; owned Q groups.
    ``args`` points to the launcher's ``(ins, outs, plan)`` (:func:`numbafa.compiler.linking.pack`)."""
    ins, outs, plan = unpack(args)
    tiling = plan.tiling
    layout = plan.layout
    _, nheads, d_head, seqlen_q = stored_dims(ins.q, layout)
    _, nheads_kv, d_v, seqlen_k = stored_dims(ins.v, layout)
    n_rep = nheads // nheads_kv
    unit, chunk, batch, kv_head = decode_item(item, tiling.q_chunks, nheads_kv)
    scratch = make_fwd_scratch(d_head, d_v, seqlen_q, plan)
    # K is a [d, seq] operand: in the Neuron layout float32 inputs (and bf16 bits on the bf16
    # path) are used in place, bf16 ones widened once on the float32 paths; an s-major layout's
    # head is transposed into a [d, seq] copy first (numbafa.kernels.heads). V is a [seq, d]
    # operand (P V reads it untransposed: float32 GEMMs run 7-45 % faster so than reading
    # [d, seq] transposed): in the Neuron layout the unit's V transposed once into a copy (the
    # forward's one tiled transpose of an input), in an s-major layout its head's rows as they lie
    # (a view with the input's row stride as the GEMM's ld: the same GEMM and bits).
    k, v = ins.k, ins.v
    is_bits = k.is_bits
    no_f, no_b = scratch.no_values, scratch.no_bits   # (the storage not used: nothing allocated)
    if layout == NEURON:
        k_f, k_bits = k.f[batch, kv_head], k.bits[batch, kv_head]
        if is_bits:
            v_f, v_bits = no_f, empty((seqlen_k, d_v), np.uint16)
            call_plugin(gather_bits, (v.bits[batch, kv_head], np.int64(0), np.int64(seqlen_k), np.int64(0),
                                      np.int64(d_v), v_bits))
        else:
            v_f, v_bits = empty((seqlen_k, d_v), plan.acc.dtype), no_b
            gather_head((v.f[batch, kv_head], 0, seqlen_k), 0, d_v, v_f, False)
        v_op = input_operand(v_f, v_bits, is_bits, plan, no_f, no_b)
    else:
        if is_bits:
            k_f, k_bits = no_f, empty((d_head, seqlen_k), np.uint16)
        else:
            k_f, k_bits = empty((d_head, seqlen_k), plan.acc.dtype), no_b
        gather_input(k, layout, batch, kv_head, 0, seqlen_k, k_f, k_bits)
        v_op = input_operand(head_slice(head_rows(v.f, layout, batch, kv_head), 0, seqlen_k),
                             head_slice(head_rows(v.bits, layout, batch, kv_head), 0, seqlen_k), is_bits, plan,
                             no_f, no_b)
    k_op = input_operand(k_f, k_bits, is_bits, plan, no_f, no_b)
    n_groups = n_q_groups(seqlen_q, tiling)
    for r in range(n_rep):
        h = kv_head * n_rep + r
        sink_max, sink_sum = sink_statistics(ins.sinks[batch, h])
        head = FwdHead(batch, h, sink_max, sink_sum)
        for i_group in range(n_groups):
            if owns_group(i_group, n_groups, chunk, tiling.q_chunks):
                q_grp0, rows = group_rows(i_group, seqlen_q, tiling)
                load_q(ins.q, layout, batch, h, q_grp0, rows, scratch.q_s, plan.softmax_scale,
                       plan.precision.round_kernel)
                q_op = tile_operand(any_layout(scratch.q_s[:, :rows]), scratch.q_bits, scratch.no_values,
                                    scratch.no_bits, plan.gemm.bits)
                fwd_q_group(plan, head, q_op, k_op, v_op, q_grp0, outs, scratch)
