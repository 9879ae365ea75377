"""The flash-attention backward kernel: a CPU twin of Neuron's ``attention_bwd``.

Pseudocode of the Neuron kernel (upstream ``nkilib/core/attention/attention_bwd.py``
lines 113-139), which the helpers below cite by step number (every "upstream NNNN"
here is a line number of that file in neuronx_cc 2.24.5133.0+58f8de22)::

    D      = rowsum(dO * O)                  # Step 1
    S      = Q_scaled^T K                    # Step 2.1-2.2 (scale folded into Q)
    S      = mask(S)                         # Step 2.3
    P      = exp(S - LSE)                    # Step 2.4
    dV    += P^T dO                          # Step 3.1
    dP     = dO^T V                          # Step 3.2
    dS     = (dP - D) * P                    # Step 4
    dQ    += (dS K) * softmax_scale          # Step 5.1
    dK    += Q_scaled^T dS                   # Step 5.2

Shape of the code, as upstream splits ``flash_attn_bwd`` from
``_flash_attn_bwd_core``: the schedule is in one place, the math in another.

* the launcher (:func:`numbafa.kernels.launch.run_items`, upstream's SPMD
  shards): a ``prange`` over the work items, each :func:`bwd_work_item` called
  by address; then per unit :func:`bwd_finish_unit`: the fixed-order sum of
  split units' dK/dV partials and the sink gradients;
* :func:`bwd_work_item` -- the loop nest of upstream ``flash_attn_bwd``: the
  item's units, KV sections (:func:`load_kv_section`; dK/dV section
  accumulators summed over every q-head of the GQA group) -> q-heads -> the
  item's Q groups of 4 x 128 rows, each loaded by :func:`load_q_group` (dQ
  zeroed on the first section and reloaded from the output on later ones:
  the HBM round trip; Q scaled at load; -LSE and D on the first section only)
  and run by :func:`bwd_k_tiles`;
* :func:`bwd_k_tiles` -- every K tile of the section against one Q group, each
  (Q group, K tile) pair by :func:`_flash_attn_bwd_core`: tile skipping, then
  per block :func:`recompute_p_ds` (Steps 2-4) and :func:`update_gradients`
  (Steps 3.1, 5.1, 5.2).

Compile units: everything here is compiled once for every input dtype, option
and GEMM path (:mod:`numbafa.kernels.bundles`; float64 inputs, float64
arithmetic, apart). The inputs arrive as :data:`~numbafa.kernels.stored.Stored`
records, one type for float32 values and bf16 bits: :func:`load_kv_section` and
:func:`load_q_group` branch on the storage once per section or Q group, and the
bf16 side of :func:`compute_rowsum` is a plugin (:func:`rowsum_bits`), compiled
by a call with bf16 inputs only.

CPU layout. The Neuron tensors are ``[d_head, seq]`` and stay so: K, V and
dO are used in place (float32 inputs; bf16 bits are widened once per section
or Q group), Q_scaled is written ``[d_head, rows]`` at load, and BLAS reads
whichever operand it needs transposed. The dK and dV accumulators are
``[seq, d_head]`` (dK^T, dV^T), stored transposed into the outputs; dQ's is
``[d_head, rows]``, the output's layout. The score-shaped tiles of one block
are kept as ``[keys, queries]`` (S^T, P^T, dP^T, dS^T), so every product is
one call of the matmul seam (:func:`numbafa.kernels.matmul.gemm`) and no
tile is transposed by copying:

* ``S^T  = K^T Q_scaled``          ``dP^T = V^T dO``
* ``dV^T += P^T dO^T``             ``dK^T += dS^T Q_scaled^T`` (dO^T and Q_scaled^T transposed
  once per Q group into ``[rows, d]`` copies, :func:`~numbafa.kernels.loops.rows_operand`: the
  GEMM then reads every operand as it lies, 8-23 % faster in float32 on Zen 4)
* ``dQ += K dS^T * scale`` (upstream sums transposed 128-key sub-tiles into
  one fp32 PSUM; that is one fp32 contraction here).

Numerics (docs/numerics.md): all arithmetic is float32; the
:class:`~numbafa.kernels.bundles.Precision` bundle says which written tiles
are rounded, and to what (bf16 or fp16). Products of bf16-valued float32 operands are exact, so
sgemm is "bf16 in, fp32 accumulate". The kernel writes float32 outputs whose
values are already rounded to the output dtype; the API converts them.

The kernel never validates; :mod:`numbafa.checks.validation` does, before it runs.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
from numba import types

from ..conventions.dtypes import ROUND_NONE, round_inplace, rounded, widen
from ..compiler.arrays import empty, zeros
from ..compiler.jit import jit
from ..compiler.linking import unpack
from ..compiler.scalars import max_, min_
from ..conventions.tiling import FLOAT32_MIN
from .common import store, store_transposed
from .dropout import drop_probabilities, drop_scores
from .fastexp import exp_of
from .heads import (NEURON, dims4, gather_head, head_rows, head_slice, reduce_partials_rows, store_head_rows,
                    store_rows)
from .loops import (bits_of_row, columns, group_rows, n_q_groups, owns_group, row_slice, rows_operand, tile_operand)
from .mask import cut_by_mask, queries_seeing_key, required_q_rows, seen_keys, tile_pos
from .matmul import any_layout, bits_operand, gemm, row_of
from .scores import item_units, modify_scores_t, score_gradients
from .stored import gather_input, input_operand, input_rows_operand, load_q, stored_dims
from .table import call_plugin

__all__ = ["bwd_work_item", "bwd_finish_unit", "BwdStats", "FinishArgs", "rowsum_plugins"]

_F32_MIN = np.float32(FLOAT32_MIN)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)

#: One KV section of a work item: its first key and length, whether it is the
#: first section, K and V ``[d, keys]`` (GEMM operands), the dK^T/dV^T accumulators.
KVSection = namedtuple("KVSection", ["start", "length", "first", "k", "v", "dk_acc", "dv_acc"])
#: One q-head of a work unit: batch, q-head, its -LSE bias and D rows ``[seqlen_q]``.
Head = namedtuple("Head", ["batch", "q_head", "neg_lse", "d_sum"])
#: Per-row statistics of every q-head, ``[n_units, n_rep, seqlen_q]`` float32: the -LSE bias
#: and D, written on the first KV section by the item owning the rows.
BwdStats = namedtuple("BwdStats", ["neg_lse", "d_sum"])
#: What the unit finish reads (:func:`bwd_finish_unit`): the outputs, the statistics, the sinks
#: (``[bs, nheads, num_sinks]``, accumulator dtype) and the plan -- no input array, so the finish
#: is compiled once for every input dtype.
FinishArgs = namedtuple("FinishArgs", ["outs", "stats", "sinks", "plan"])
#: One loaded Q group: first row, rows, Q_scaled ``[d, rows]`` and dO ``[d, rows]`` (GEMM
#: operands), their transposes ``q_t``/``dy_t`` ``[rows, d]`` (the B operands of dK and dV on
#: float tiles), the dQ accumulator ``[d, rows]``, the head's -LSE and D rows, batch and q-head.
QGroup = namedtuple("QGroup", ["start", "rows", "q_s", "dy", "q_t", "dy_t", "dq", "neg_lse", "d_sum", "batch",
                               "q_head"])
#: The inputs a Q group's load reads (:data:`~numbafa.kernels.stored.Stored` q, o, dy; the lse).
QInputs = namedtuple("QInputs", ["q", "o", "dy", "lse"])
#: A block of a K tile: keys ``k0:k0+n_k`` (section-relative), Q rows ``r0:r1`` (group-relative).
Block = namedtuple("Block", ["k0", "n_k", "r0", "r1"])
#: Per-item scratch, sized for the largest tiles (``*_bits``: bf16 operand tiles, the bf16 path
#: only; ``mult``: dropout multipliers; ``tanh``: the soft cap's tile; ``no_values`` / ``no_bits``:
#: the empty members of operands).
Scratch = namedtuple("Scratch", ["q_s", "dq", "s_t", "dp_t", "kd_psum", "dq_psum", "dk_acc", "dv_acc",
                                 "q_bits", "p_bits", "ds_bits", "q_t", "dy_t", "mult", "tanh", "no_values",
                                 "no_bits"])


@jit(apart=True)
def compute_rowsum(o_h, dy_h, start, count, d_tile, d_sum, precision):
    """Step 1: ``D = rowsum(O * dO)`` for rows ``start:start+count`` of one q-head.

    Each product is rounded to kernel_dtype, each head-dim tile's partial sum
    to mixed_dtype, and so is their total (upstream
    ``compute_rowsum_single_tile`` and lines 1264-1270). Writes ``d_sum[:count]`` (the rows'
    slice of the head's D).
    """
    d_head = o_h.shape[0]
    round_kernel = precision.round_kernel
    round_acc = precision.round_acc
    total = zeros(count, d_sum.dtype)
    partial = empty(count, d_sum.dtype)
    prod = empty(count, d_sum.dtype)
    for d0 in range(0, d_head, d_tile):
        partial[:] = _ZERO
        for i_d in range(d0, min_(d0 + d_tile, d_head)):
            o_row = o_h[i_d, start:start + count]
            dy_row = dy_h[i_d, start:start + count]
            if round_kernel == ROUND_NONE:   # float32: the product and the sum may fuse (FMA)
                for i in range(count):
                    partial[i] += widen(o_row[i]) * widen(dy_row[i])
                continue
            for i in range(count):
                prod[i] = widen(o_row[i]) * widen(dy_row[i])
            round_inplace(prod, round_kernel)
            for i in range(count):
                partial[i] += prod[i]
        round_inplace(partial, round_acc)
        for i in range(count):
            total[i] += partial[i]
    round_inplace(total, round_acc)
    for i in range(count):
        d_sum[i] = total[i]


@jit()
def rowsum_bits(args, _):
    """:func:`compute_rowsum` of bf16 bits, a plugin (:mod:`numbafa.kernels.stored`): ``(o_h, dy_h,
    start, count, d_tile, d_sum, d0, precision)``, D written to ``d_sum[d0:d0 + count]``."""
    o_h, dy_h, start, count, d_tile, d_sum, d0, precision = unpack(args)
    compute_rowsum(o_h, dy_h, start, count, d_tile, d_sum[d0:d0 + count], precision)


def rowsum_plugins(plan) -> list:
    """:func:`rowsum_bits` and its argument types, for :func:`numbafa.kernels.table.ensure_plugins`."""
    bits2 = types.Array(types.uint16, 2, "C")
    acc1 = types.Array(numba.from_dtype(plan.acc.dtype), 1, "C")
    return [(rowsum_bits, types.Tuple((bits2, bits2, types.int64, types.int64, numba.typeof(plan.tiling.d_tile), acc1,
                                       types.int64, numba.typeof(plan.precision))))]


@jit(apart=True, refcount=False)
def _row_sum(o_f, dy_f, o_bits, dy_bits, is_bits, start, count, plan, d_sum, d0):
    """Step 1 of rows ``start:start + count`` of O and dO heads ``[d, seq]`` (values or bf16 bits:
    :mod:`numbafa.kernels.stored`), D written to ``d_sum[d0:d0 + count]``."""
    if is_bits:
        call_plugin(rowsum_bits, (o_bits, dy_bits, np.int64(start), np.int64(count), plan.tiling.d_tile, d_sum,
                                np.int64(d0), plan.precision))
    else:
        compute_rowsum(o_f, dy_f, start, count, plan.tiling.d_tile, d_sum[d0:d0 + count], plan.precision)


@jit(inline=True)
def _softmax_backward_row(s, dp, neg_lse, d_sum, k_abs, key_lo, key_hi, use_packing, round_kernel):
    """One key row of Steps 2.3-4 over contiguous query slices (vectorised loops).

    With packing, query ``i`` sees the key only if ``key_lo[i] <= k_abs <
    key_hi[i]`` (upstream ``range_select``); a masked score is the float32
    minimum, whose exp is exactly 0.
    """
    for i in range(s.size):
        x = s[i]
        if use_packing:
            x = _F32_MIN if (k_abs < key_lo[i]) | (k_abs >= key_hi[i]) else x
        s[i] = exp_of(x + neg_lse[i])
    round_inplace(s, round_kernel)
    for i in range(s.size):
        dp[i] = (dp[i] - d_sum[i]) * s[i]
    round_inplace(dp, round_kernel)


@jit(apart=True, refcount=False)
def recompute_softmax_backward(s_t, dp_t, at, qg, plan, p_bits, ds_bits):
    """Steps 2.3, 2.4 and 4 on one ``[keys, queries]`` tile, in place.

    On entry ``s_t = S^T`` and ``dp_t = dP^T`` for keys ``at.k0..`` and
    queries ``at.q0..`` (``at`` a :data:`~numbafa.kernels.mask.TilePos`); on exit ``s_t = P^T`` and ``dp_t = dS^T``, both
    rounded to kernel_dtype:

    * mask (:mod:`numbafa.kernels.mask`): without packing the queries that
      see a key are contiguous, and the others (a prefix and a suffix of the
      key row) are written as 0 directly -- the same P and dS as a masked
      exp -- so the exp runs on the visible part only; with packing each
      element is compared with its query's key range;
    * ``P = exp(S + (-LSE))``: one exp, no max subtraction, no division;
    * ``dS = (dP - D) * P``: the fused op, in this operand order, with the
      rounded P.

    ``p_bits`` and ``ds_bits`` of ``s_t``'s shape (uint16; the bf16 path with nothing to change
    P or dS afterwards) also receive the bf16 bits of P^T and dS^T, each row while it is in
    cache: the operands of the next GEMMs (:func:`~numbafa.kernels.loops.tile_operand`'s bits,
    written here instead of in passes of their own over the tile); empty ones, nothing.
    """
    mask = plan.mask
    n_k, n_q = s_t.shape
    fused = p_bits.shape[0] != 0
    k_abs0, q_abs0 = at.k0, at.q0
    for j in range(n_k):
        k_abs = k_abs0 + j
        lo = 0
        hi = n_q
        if not mask.use_packing:
            lo, hi = queries_seeing_key(mask, q0=q_abs0, n_q=n_q, k=k_abs)
        s_row = s_t[j]
        dp_row = dp_t[j]
        s_row[:lo] = _ZERO
        dp_row[:lo] = _ZERO
        s_row[hi:] = _ZERO
        dp_row[hi:] = _ZERO
        q0 = q_abs0 + lo
        q1 = q_abs0 + hi
        _softmax_backward_row(s_row[lo:hi], dp_row[lo:hi], qg.neg_lse[q0:q1], qg.d_sum[q0:q1], k_abs,
                              mask.key_lo[q0:q1], mask.key_hi[q0:q1], mask.use_packing,
                              plan.precision.round_kernel)
        if fused:
            bits_of_row(s_row, p_bits[j])
            bits_of_row(dp_row, ds_bits[j])


@jit(contract=False)
def accumulate(acc, psum, scale, round_acc):
    """``acc = psum * scale + acc`` written in mixed_dtype (rounded to the format ``round_acc`` names).

    Upstream's ``scalar_tensor_tensor`` (lines 1558-1565): the product is an
    fp32 value, then the sum, then the one rounding to mixed_dtype -- two
    fp32 roundings, so this function is compiled without contraction (a fused
    multiply-add would round once and can flip the bf16 rounding).

    Both are 2-D of the same shape, rows with unit inner stride (column
    slices of a wider tile too, as dQ's ``[d, rows]`` slices are).
    """
    for r in range(acc.shape[0]):   # (rows as contiguous views: dQ's slices are typed any layout)
        a = row_of(acc, r)
        p = row_of(psum, r)
        if scale == _ONE:
            for i in range(a.size):
                a[i] = a[i] + p[i]
        else:
            for i in range(a.size):
                a[i] = p[i] * scale + a[i]
        round_inplace(a, round_acc)


@jit(apart=True, refcount=False)
def recompute_p_ds(plan, sec, qg, blk, scratch):
    """Steps 2-4 of one block: returns ``(P^T, dS^T)``, ``[keys, queries]`` GEMM operands.

    Step 2.1 ``S^T = K^T Q_s`` and Step 3.2 ``dP^T = V^T dO`` (fp32 PSUM),
    then :func:`recompute_softmax_backward` turns them into P^T and dS^T.

    With dropout (docs/numerics.md), the forward's keep mask Z is drawn again
    (:mod:`numbafa.kernels.dropout`) as multipliers ``M = Z / (1 - p)``: the
    matmul gave ``dP~ = dO V^T``, the gradient of the *dropped* P, so
    ``dS = P * (dP~ * M - D)`` (fp32 product, then the fused op), and the
    returned P^T is the dropped ``P~ = P * M``, written in kernel_dtype, for
    ``dV += P~^T dO``.

    With score variants (:mod:`numbafa.kernels.scores`) S is modified before the mask, and
    the dS of the modified scores gives ``dbias`` before the soft cap's factor.
    """
    n_q = blk.r1 - blk.r0
    s_t = scratch.s_t[:blk.n_k * n_q].reshape(blk.n_k, n_q)
    dp_t = scratch.dp_t[:blk.n_k * n_q].reshape(blk.n_k, n_q)
    at = tile_pos(qg, q0=qg.start + blk.r0, k0=sec.start + blk.k0)
    k_cols = columns(sec.k, blk.k0, blk.k0 + blk.n_k)
    gemm(k_cols, columns(qg.q_s, blk.r0, blk.r1), s_t, trans_a=True, trans_b=False, alpha=_ONE, beta=_ZERO,
         path=plan.gemm)
    gemm(columns(sec.v, blk.k0, blk.k0 + blk.n_k), columns(qg.dy, blk.r0, blk.r1), dp_t, trans_a=True, trans_b=False,
         alpha=_ONE, beta=_ZERO, path=plan.gemm)
    if plan.dropout.active:
        drop_args = (scratch.mult, dp_t, at, plan.dropout)
        call_plugin(drop_scores, drop_args)
    if plan.scores.active:
        score_args = (s_t, scratch.tanh, at, plan.scores)
        call_plugin(modify_scores_t, score_args)
    # bf16 path, nothing to change P or dS after the softmax step: their bits written by it.
    fused = plan.gemm.bits and not plan.dropout.active and not plan.scores.active
    p_bits = scratch.p_bits[:blk.n_k * n_q].reshape(blk.n_k, n_q) if fused else scratch.no_bits
    ds_bits = scratch.ds_bits[:blk.n_k * n_q].reshape(blk.n_k, n_q) if fused else scratch.no_bits
    recompute_softmax_backward(s_t, dp_t, at, qg, plan, p_bits, ds_bits)
    if plan.scores.active:
        grad_args = (dp_t, scratch.tanh, at, plan.scores, plan.precision.round_kernel)
        call_plugin(score_gradients, grad_args)
    if plan.dropout.active:
        p_args = (scratch.mult, s_t, plan.precision.round_kernel)
        call_plugin(drop_probabilities, p_args)
    # P and dS are bf16-valued here when the inputs are bf16: the bf16 path takes their bits.
    if fused:
        return bits_operand(p_bits, scratch.no_values), bits_operand(ds_bits, scratch.no_values)
    bits = plan.gemm.bits
    return (tile_operand(any_layout(s_t), scratch.p_bits, scratch.no_values, scratch.no_bits, bits),
            tile_operand(any_layout(dp_t), scratch.ds_bits, scratch.no_values, scratch.no_bits, bits))


@jit(apart=True, refcount=False)
def update_gradients(plan, sec, qg, blk, p_t, ds_t, dq_psum, cut, scratch):
    """Steps 5.1, 3.1 and 5.2 of one block.

    Step 5.1, ``dQ += (dS K) * scale``: upstream contracts over transposed
    128-key sub-tiles (``tiling.K_SUB_TILE``) summed in one fp32 PSUM; one
    GEMM over the block's keys is that sum, computed as ``dQ = K dS^T``
    into dQ's ``[d, rows]`` accumulator (both operands as they lie: the
    GEMMs measured fastest in this orientation, docs/performance.md).
    float32 inputs add the scaled product into dQ directly (``beta = 1``);
    bf16 and fp16 inputs (a rounded kernel_dtype) sum the blocks of the K tile into
    ``dq_psum`` (this block's columns of it), which
    :func:`_flash_attn_bwd_core` adds once. Steps 3.1 ``dV += P^T dO`` and
    5.2 ``dK += Q_s^T dS`` go into the section accumulators (GQA-reduced);
    rounded accumulators take their one rounded addition from a PSUM tile.
    """
    prec = plan.precision
    keys = slice(blk.k0, blk.k0 + blk.n_k)
    k_cols = columns(sec.k, blk.k0, blk.k0 + blk.n_k)
    q_rows = row_slice(qg.q_t, blk.r0, blk.r1)
    dy_rows = row_slice(qg.dy_t, blk.r0, blk.r1)
    if prec.round_kernel != ROUND_NONE:  # rounded tiles keep dQ's PSUM apart (dQ is rounded between sections)
        gemm(k_cols, ds_t, dq_psum, trans_a=False, trans_b=False, alpha=_ONE, beta=_ONE if cut else _ZERO,
             path=plan.gemm)
    else:
        gemm(k_cols, ds_t, qg.dq[:, blk.r0:blk.r1], trans_a=False, trans_b=False, alpha=plan.softmax_scale, beta=_ONE,
             path=plan.gemm)
    d_v = sec.dv_acc.shape[1]
    d_head = sec.dk_acc.shape[1]
    if prec.round_acc != ROUND_NONE:
        dv_psum = scratch.kd_psum[:blk.n_k * d_v].reshape(blk.n_k, d_v)
        _kd_gemm(plan, p_t, qg.dy, dy_rows, blk, dv_psum, _ZERO)
        accumulate(any_layout(sec.dv_acc[keys]), dv_psum, _ONE, prec.round_acc)
        dk_psum = scratch.kd_psum[:blk.n_k * d_head].reshape(blk.n_k, d_head)
        _kd_gemm(plan, ds_t, qg.q_s, q_rows, blk, dk_psum, _ZERO)
        accumulate(any_layout(sec.dk_acc[keys]), dk_psum, _ONE, prec.round_acc)
    else:
        _kd_gemm(plan, p_t, qg.dy, dy_rows, blk, sec.dv_acc[keys], _ONE)
        _kd_gemm(plan, ds_t, qg.q_s, q_rows, blk, sec.dk_acc[keys], _ONE)


@jit(inline=True)
def _kd_gemm(plan, a_t, b_cols, b_rows, blk, out, beta):
    """``out = a_t b^T + beta out`` (dV^T or dK^T): ``b`` ``[rows, d]`` as it lies (NN, float
    tiles) or, on the bf16 path, ``[d, rows]`` read transposed
    (:func:`~numbafa.kernels.loops.rows_operand`)."""
    if plan.gemm.bits:
        gemm(a_t, columns(b_cols, blk.r0, blk.r1), out, trans_a=False, trans_b=True, alpha=_ONE, beta=beta,
             path=plan.gemm)
    else:
        gemm(a_t, b_rows, out, trans_a=False, trans_b=False, alpha=_ONE, beta=beta, path=plan.gemm)


@jit(apart=True, refcount=False)
def _flash_attn_bwd_core(plan, sec, qg, k_tile0, scratch):
    """Everything one (Q group, K tile) pair does (upstream ``_flash_attn_bwd_core``).

    Q tiles the static mask rules out are skipped (``get_required_tiles_mask``).
    A tile the causal diagonal (or a window edge) cuts through is computed in
    128-key blocks, each on the Q tiles it needs only. Numerics are
    unchanged: dV/dK rows still take one addition per K tile, and dQ's fp32
    PSUM still sums the whole K tile before its one addition. A Q group of
    less than a Q tile (a split short unit, :func:`numbafa.kernels.schedule.q_group_rows`)
    runs each such block on the keys its rows may see (:func:`~numbafa.kernels.mask.seen_keys`): the
    keys left out have P = dS = 0 for all its rows, exact zeros in the sums.
    """
    tiling = plan.tiling
    mask = plan.mask
    n_k = min_(tiling.k_tile, sec.length - k_tile0)
    k_abs0 = sec.start + k_tile0
    t0, t1 = required_q_rows(mask, qg.start, qg.rows, tiling.q_tile, k_abs0, k_abs0 + n_k - 1)
    if t0 >= t1:
        return
    cut = cut_by_mask(mask, q_first=qg.start + t0, k_last=k_abs0 + n_k - 1)
    sub = min_(tiling.k_sub_tile, n_k) if cut else n_k
    d_head = qg.dq.shape[0]
    dq_psum = scratch.dq_psum[:d_head * (t1 - t0)].reshape(d_head, t1 - t0)
    rounded_tiles = plan.precision.round_kernel != ROUND_NONE
    if rounded_tiles and cut:  # rounded tiles keep dQ's PSUM apart
        dq_psum[:] = _ZERO
    for kb0 in range(k_tile0, k_tile0 + n_k, sub):
        n_kb = min_(sub, k_tile0 + n_k - kb0)
        r0, r1 = t0, t1
        if sub < n_k:
            kb_abs = sec.start + kb0
            r0, r1 = required_q_rows(mask, qg.start, qg.rows, tiling.q_tile, kb_abs, kb_abs + n_kb - 1)
            if r0 >= r1:
                continue
        k0 = kb0
        if cut and tiling.group_rows < tiling.q_tile:
            k0, n_kb = seen_keys(mask, sec.start, qg.start + r0, qg.start + r1 - 1, kb0, n_kb)
            if n_kb <= 0:
                continue
        blk = Block(k0, n_kb, r0, r1)
        p_t, ds_t = recompute_p_ds(plan, sec, qg, blk, scratch)
        update_gradients(plan, sec, qg, blk, p_t, ds_t, dq_psum[:, r0 - t0:r1 - t0], cut, scratch)
    if rounded_tiles:  # dQ += PSUM * scale
        accumulate(qg.dq[:, t0:t1], dq_psum, plan.softmax_scale, plan.precision.round_acc)


@jit(apart=True, refcount=False)
def bwd_k_tiles(plan, sec, qg, scratch):
    """Every K tile of a KV section against one loaded Q group (upstream 1274-1325): each by
    :func:`_flash_attn_bwd_core`. Compiled once for every input dtype (module docstring)."""
    for k_tile0 in range(0, sec.length, plan.tiling.k_tile):
        _flash_attn_bwd_core(plan, sec, qg, k_tile0, scratch)


@jit(apart=True)
def load_q_group(q_ins, outs, plan, sec, head, i_group, scratch, copies):
    """Load one Q group of one q-head for a KV section (upstream 1184-1270): its :data:`QGroup`.

    dQ is zeroed on the first section and reloaded from the output on later
    ones (it round-trips through the output between sections); Q is scaled at
    load; the -LSE bias (in mixed_dtype, upstream 1149-1160) and D (Step 1,
    :func:`compute_rowsum`) are computed on the first section only. ``q_ins``: :data:`QInputs`.
    """
    prec = plan.precision
    layout = plan.layout
    q, o, dy, lse = q_ins
    b, h = head.batch, head.q_head
    q_grp0, rows = group_rows(i_group, stored_dims(q, layout)[3], plan.tiling)
    dq = scratch.dq[:, :rows]
    if sec.first:
        dq[:] = _ZERO
    elif layout == NEURON:   # an exact copy
        dq_h = outs.dq[head.batch, head.q_head]
        for i_d in range(dq.shape[0]):
            dq_row = dq[i_d]
            src = dq_h[i_d, q_grp0:q_grp0 + rows]
            for i in range(rows):
                dq_row[i] = src[i]
    else:
        gather_head(head_rows(outs.dq, layout, head.batch, head.q_head), q_grp0, rows, scratch.dq, False)
    load_q(q, layout, b, h, q_grp0, rows, scratch.q_s, plan.softmax_scale, prec.round_kernel)
    if layout == NEURON:
        dy_op = input_operand(dy.f[b, h][:, q_grp0:q_grp0 + rows], dy.bits[b, h][:, q_grp0:q_grp0 + rows], dy.is_bits,
                              plan, scratch.no_values, scratch.no_bits)
        dy_t = rows_operand(dy_op, scratch.dy_t, scratch.no_values, scratch.no_bits, plan.gemm.bits)
    else:
        gather_input(dy, layout, b, h, q_grp0, rows, copies.dy, copies.dy_bits)
        dy_op = input_operand(copies.dy[:, :rows], copies.dy_bits[:, :rows], dy.is_bits, plan, scratch.no_values,
                              scratch.no_bits)
        dy_t = input_rows_operand(head_slice(head_rows(dy.f, layout, b, h), q_grp0, rows), dy.is_bits, dy_op,
                                  scratch.dy_t, scratch.no_values, scratch.no_bits, plan.gemm.bits)
    q_op = tile_operand(any_layout(scratch.q_s[:, :rows]), scratch.q_bits, scratch.no_values, scratch.no_bits,
                        plan.gemm.bits)
    if sec.first:
        lse_g = lse[b, h, q_grp0:q_grp0 + rows]
        neg_lse = head.neg_lse[q_grp0:q_grp0 + rows]
        for i in range(rows):
            neg_lse[i] = rounded(-lse_g[i], prec.round_acc)
        if layout == NEURON:
            _row_sum(o.f[b, h], dy.f[b, h], o.bits[b, h], dy.bits[b, h], o.is_bits, q_grp0, rows, plan, head.d_sum,
                     q_grp0)
        else:
            gather_input(o, layout, b, h, q_grp0, rows, copies.o, copies.o_bits)
            _row_sum(copies.o, copies.dy, copies.o_bits, copies.dy_bits, o.is_bits, 0, rows, plan, head.d_sum, q_grp0)
    bits = plan.gemm.bits
    q_t = rows_operand(q_op, scratch.q_t, scratch.no_values, scratch.no_bits, bits)
    return QGroup(start=q_grp0, rows=rows, q_s=q_op, dy=dy_op, q_t=q_t, dy_t=dy_t, dq=dq, neg_lse=head.neg_lse,
                  d_sum=head.d_sum, batch=head.batch, q_head=head.q_head)


@jit()
def load_kv_section(k_in, v_in, plan, batch, kv_head, i_section, scratch, copies):
    """K and V of one section ``[d, keys]`` as GEMM operands (float32 inputs and bf16 bits on
    the bf16 path: views; bf16 on a float32 path: widened), accumulators zeroed (upstream
    1162-1178)."""
    seqlen_k = stored_dims(k_in, plan.layout)[3]
    section_len = plan.tiling.section_len
    start = i_section * section_len
    length = max_(0, min_(section_len, seqlen_k - start))
    keys = slice(start, start + length)
    if plan.layout == NEURON:
        k_op = input_operand(k_in.f[batch, kv_head][:, keys], k_in.bits[batch, kv_head][:, keys], k_in.is_bits, plan,
                             scratch.no_values, scratch.no_bits)
        v_op = input_operand(v_in.f[batch, kv_head][:, keys], v_in.bits[batch, kv_head][:, keys], v_in.is_bits, plan,
                             scratch.no_values, scratch.no_bits)
    else:   # an s-major layout's section, transposed into [d, keys] copies
        gather_input(k_in, plan.layout, batch, kv_head, start, length, copies.k, copies.k_bits)
        gather_input(v_in, plan.layout, batch, kv_head, start, length, copies.v, copies.v_bits)
        k_op = input_operand(copies.k[:, :length], copies.k_bits[:, :length], k_in.is_bits, plan, scratch.no_values,
                             scratch.no_bits)
        v_op = input_operand(copies.v[:, :length], copies.v_bits[:, :length], v_in.is_bits, plan, scratch.no_values,
                             scratch.no_bits)
    scratch.dk_acc[:] = _ZERO
    scratch.dv_acc[:] = _ZERO
    return KVSection(start=start, length=length, first=i_section == 0, k=k_op, v=v_op, dk_acc=scratch.dk_acc,
                     dv_acc=scratch.dv_acc)


@jit(apart=True, refcount=False)
def store_kv_section(outs, plan, sec, unit, chunk, batch, kv_head):
    """Write a section's dK/dV (upstream 1340-1353).

    An unsplit unit rounds them to kernel_dtype into the outputs; a split
    unit's chunk 0 keeps its float32 partial in the (float32) outputs, the
    other chunks in ``part_dk``/``part_dv``, summed by :func:`bwd_finish_unit`.
    """
    if plan.tiling.q_chunks > 1 and chunk > 0:
        store_transposed(sec.dk_acc, sec.length, outs.part_dk[unit, chunk - 1], sec.start, ROUND_NONE)
        store_transposed(sec.dv_acc, sec.length, outs.part_dv[unit, chunk - 1], sec.start, ROUND_NONE)
        return
    round_out = plan.precision.round_kernel if plan.tiling.q_chunks == 1 else ROUND_NONE
    if plan.layout == NEURON:
        store_transposed(sec.dk_acc, sec.length, outs.dk[batch, kv_head], sec.start, round_out)
        store_transposed(sec.dv_acc, sec.length, outs.dv[batch, kv_head], sec.start, round_out)
    else:
        store_rows(sec.dk_acc, sec.length, head_rows(outs.dk, plan.layout, batch, kv_head), sec.start, round_out)
        store_rows(sec.dv_acc, sec.length, head_rows(outs.dv, plan.layout, batch, kv_head), sec.start, round_out)


@jit()
def store_dq(qg, outs, plan):
    """Store a Q group's dQ (``[d, rows]``) into the output, rounded to kernel_dtype."""
    if plan.layout == NEURON:
        store(qg.dq, qg.rows, outs.dq[qg.batch, qg.q_head], qg.start, plan.precision.round_kernel)
    else:
        store_head_rows(qg.dq, qg.rows, head_rows(outs.dq, plan.layout, qg.batch, qg.q_head), qg.start,
                        plan.precision.round_kernel)


#: An item's ``[d, seq]`` copies of an s-major layout's K and V sections and of dO and O's
#: Q-group rows: values (``k``, ``v``, ``dy``, ``o``) or bf16 bits (``*_bits``), as the inputs are
#: stored (:mod:`numbafa.kernels.stored`); empty in the Neuron layout (read in place) and on the
#: other storage's side.
InCopies = namedtuple("InCopies", ["k", "v", "dy", "o", "k_bits", "v_bits", "dy_bits", "o_bits"])


@jit()
def make_copies(is_bits, plan, d_head, d_v, scratch):
    """The item's :data:`InCopies` (sized as ``scratch``'s Q group and KV section); the members
    not used are ``scratch``'s empty arrays (nothing allocated for them)."""
    no_f, no_b = scratch.no_values, scratch.no_bits
    if plan.layout == NEURON:
        return InCopies(k=no_f, v=no_f, dy=no_f, o=no_f, k_bits=no_b, v_bits=no_b, dy_bits=no_b, o_bits=no_b)
    sec_cap, q_rows = scratch.dk_acc.shape[0], scratch.q_s.shape[1]
    if is_bits:
        return InCopies(k=no_f, v=no_f, dy=no_f, o=no_f, k_bits=empty((d_head, sec_cap), np.uint16),
                        v_bits=empty((d_v, sec_cap), np.uint16),
                        dy_bits=empty((d_v, q_rows), np.uint16),
                        o_bits=empty((d_v, q_rows), np.uint16))
    acc = plan.acc.dtype
    return InCopies(k=empty((d_head, sec_cap), acc), v=empty((d_v, sec_cap), acc),
                    dy=empty((d_v, q_rows), acc), o=empty((d_v, q_rows), acc), k_bits=no_b,
                    v_bits=no_b, dy_bits=no_b, o_bits=no_b)


@jit()
def make_scratch(d_head, d_v, seqlen_q, seqlen_k, plan):
    """Per-item scratch buffers (:data:`Scratch`), sized for the largest tiles (Q groups of at
    most ``seqlen_q`` rows; head dims ``d_head`` of Q/K and ``d_v`` of V/dO); the bf16 operand
    copies (``q_bits``, ``p_bits``, ``ds_bits``) only on the bf16 path, the dropout multipliers
    (``mult``) only with dropout, the soft cap's tanh tile (``tanh``) only with a soft cap."""
    tiling = plan.tiling
    q_rows = max_(1, min_(tiling.group_rows, seqlen_q))
    sec_cap = min_(tiling.section_len, seqlen_k)
    tile = tiling.k_tile * q_rows
    on_bits = 1 if plan.gemm.bits else 0
    bits = tile * on_bits
    drop = tile if plan.dropout.active else 0
    cap = tile if plan.scores.active and plan.scores.softcap > 0 else 0
    acc = plan.acc.dtype
    q_s = empty((d_head, q_rows), acc)
    dq = empty((d_head, q_rows), acc)
    s_t = empty(tile, acc)
    dp_t = empty(tile, acc)
    kd_psum = empty(tiling.k_tile * max_(d_head, d_v), acc)
    dq_psum = empty(q_rows * d_head, acc)
    dk_acc = empty((sec_cap, d_head), acc)
    dv_acc = empty((sec_cap, d_v), acc)
    q_bits = empty(on_bits * d_head * q_rows, np.uint16)
    p_bits = empty(bits, np.uint16)
    ds_bits = empty(bits, np.uint16)
    q_t = empty((1 - on_bits) * q_rows * d_head, acc)
    dy_t = empty((1 - on_bits) * q_rows * d_v, acc)
    mult = empty(drop, acc)
    tanh = empty(cap, acc)
    no_values = empty((0, 0), acc)
    no_bits = empty((0, 0), np.uint16)
    # (the arrays made first: Numba cannot compile control flow inside a call of this many keywords)
    return Scratch(q_s=q_s, dq=dq, s_t=s_t, dp_t=dp_t, kd_psum=kd_psum, dq_psum=dq_psum, dk_acc=dk_acc,
                   dv_acc=dv_acc, q_bits=q_bits, p_bits=p_bits, ds_bits=ds_bits, q_t=q_t, dy_t=dy_t, mult=mult,
                   tanh=tanh, no_values=no_values, no_bits=no_bits)


@jit()
def bwd_work_item(args, item):
    """The loop nest of one work item (upstream 1143-1353): its units
    (:func:`~numbafa.kernels.scores.item_units`: one, unless a shared bias's gradient makes
    several serial), each: KV sections -> q-heads -> the item's Q groups.

    ``args`` points to the launcher's ``(ins, outs, stats, plan)`` (:func:`numbafa.compiler.linking.pack`);
    ``stats`` (:data:`BwdStats`) is filled in on the first section by whichever item owns the rows.
    """
    ins, outs, stats, plan = unpack(args)
    tiling = plan.tiling
    bs, nheads, d_head, seqlen_q = stored_dims(ins.q, plan.layout)
    _, nheads_kv, d_v, seqlen_k = stored_dims(ins.v, plan.layout)
    n_rep = nheads // nheads_kv
    b0, b1, h0, h1, chunk = item_units(item, tiling.q_chunks, bs, nheads_kv, plan.scores)
    scratch = make_scratch(d_head, d_v, seqlen_q, seqlen_k, plan)
    copies = make_copies(ins.k.is_bits, plan, d_head, d_v, scratch)
    q_ins = QInputs(q=ins.q, o=ins.o, dy=ins.dy, lse=ins.lse)
    n_groups = n_q_groups(seqlen_q, tiling)
    # A zero-length key sequence still runs one (empty) section, so that D,
    # dQ = 0 and dsinks come from the same code path.
    n_sections = max_(1, (seqlen_k + tiling.section_len - 1) // tiling.section_len)
    for batch in range(b0, b1):
        for kv_head in range(h0, h1):
            unit = batch * nheads_kv + kv_head
            for i_section in range(n_sections):
                sec = load_kv_section(ins.k, ins.v, plan, batch, kv_head, i_section, scratch, copies)
                for r in range(n_rep):
                    head = Head(batch, kv_head * n_rep + r, stats.neg_lse[unit, r], stats.d_sum[unit, r])
                    for i_group in range(n_groups):
                        if owns_group(i_group, n_groups, chunk, tiling.q_chunks):
                            qg = load_q_group(q_ins, outs, plan, sec, head, i_group, scratch, copies)
                            bwd_k_tiles(plan, sec, qg, scratch)
                            store_dq(qg, outs, plan)
                store_kv_section(outs, plan, sec, unit, chunk, batch, kv_head)


@jit()
def _reduce_partials(out, parts, round_out):
    """``out[d, k] = round(out[d, k] + parts[0][d, k] + parts[1][d, k] + ...)``, in that order
    (each row's additions a vectorised loop per part, then its rounding)."""
    for x in range(out.shape[0]):
        row = out[x]
        for c in range(parts.shape[0]):
            part = parts[c, x]
            for j in range(row.size):
                row[j] += part[j]
        round_inplace(row, round_out)


@jit()
def _sink_probability(sink, neg_lse, round_acc):
    """``p_sink = exp(sink + (-LSE))`` in mixed_dtype, with the kernel's one ``expf`` (compiled
    with the package's flags, as for P, not inside :func:`compute_dsinks`' exact arithmetic)."""
    return rounded(exp_of(sink + neg_lse), round_acc)


@jit(contract=False, apart=True)
def compute_dsinks(sinks_h, neg_lse, d_sum, q_tile, round_acc):
    """``dsinks = -sum_q p_sink * D`` for one q-head (upstream 1355-1405), in mixed_dtype.

    The sink logits are loaded into a mixed_dtype tile (upstream 1361-1372);
    ``p_sink = exp(sink + (-LSE))`` is written in mixed_dtype; the
    per-partition accumulator (one per row of a Q tile) does ``acc = acc -
    p_sink * D`` (``scalar_tensor_tensor`` with ``reverse1``: the product,
    then the difference, two fp32 roundings, hence no contraction here) in
    mixed_dtype over the Q tiles; the partitions are summed in fp32 into a
    mixed_dtype tile (``tensor_partition_reduce``, upstream 1397-1398).
    """
    seqlen_q = neg_lse.size
    out = zeros(sinks_h.size, neg_lse.dtype)
    acc = empty(q_tile, neg_lse.dtype)
    for i_sink in range(sinks_h.size):
        sink = rounded(sinks_h[i_sink], round_acc)
        acc[:] = _ZERO
        for q0 in range(0, seqlen_q, q_tile):
            for p in range(min_(q_tile, seqlen_q - q0)):
                p_sink = _sink_probability(sink, neg_lse[q0 + p], round_acc)
                acc[p] = rounded(acc[p] - p_sink * d_sum[q0 + p], round_acc)
        total = _ZERO
        for p in range(q_tile):
            total += acc[p]
        out[i_sink] = rounded(total, round_acc)
    return out


@jit()
def bwd_finish_unit(args, unit):
    """After every item: a split unit's dK/dV, then the unit's dsinks (upstream 1355-1405).

    ``args`` points to a :data:`FinishArgs`. A split unit's chunk 0 left its float32 partial in
    the outputs; the other chunks' partials are added in chunk order, then rounded once.
    dsinks needs D and the -LSE bias of every row, so it waits for all items.
    """
    outs, stats, sinks, plan = unpack(args)
    nheads_kv = dims4(outs.dk, plan.layout)[1]
    batch = unit // nheads_kv
    kv_head = unit % nheads_kv
    prec = plan.precision
    if plan.tiling.q_chunks > 1 and plan.layout == NEURON:
        _reduce_partials(outs.dk[batch, kv_head], outs.part_dk[unit], prec.round_kernel)
        _reduce_partials(outs.dv[batch, kv_head], outs.part_dv[unit], prec.round_kernel)
    elif plan.tiling.q_chunks > 1:
        reduce_partials_rows(head_rows(outs.dk, plan.layout, batch, kv_head), outs.part_dk[unit], prec.round_kernel)
        reduce_partials_rows(head_rows(outs.dv, plan.layout, batch, kv_head), outs.part_dv[unit], prec.round_kernel)
    n_rep = stats.neg_lse.shape[1]
    for r in range(n_rep):
        h = kv_head * n_rep + r
        dsinks = compute_dsinks(sinks[batch, h], stats.neg_lse[unit, r], stats.d_sum[unit, r],
                                plan.tiling.q_tile, prec.round_acc)
        # Element by element: an array-to-slice assignment would make Numba
        # compile its shape-formatting error path (~4 s of cold compile).
        for i_sink in range(dsinks.size):
            outs.dsinks[batch, h, i_sink] = dsinks[i_sink]

