"""Score variants: an additive bias, ALiBi and a soft cap, on the kernels' score tiles.

Not in the Neuron kernel. One definition (docs/numerics.md, "Score variants"), the same in
both kernels and both goldens::

    s = softmax_scale * q^T k                    # the scale folded into Q at load, as always
    t = tanh(s * (1 / softcap))                  # softcap > 0 only
    s = softcap * t
    s = s + bias[b, h, i, j]                     # broadcast over the bias's size-1 dims
    s = s - slope[b, h] * |i + seqlen_k - seqlen_q - j|      # ALiBi, flash-attn's convention
    masks (causal, window, packing), then the softmax with sinks

and in the backward, from the kernel's ``dS' = P * (dP - D)`` (the gradient of the
modified scores, rounded where the Neuron kernel rounds dS)::

    dbias += dS'                                 # summed to the bias's shape
    dS     = dS' * (1 - t * t)                   # written in kernel_dtype (a GEMM operand)

Everything here works on the float32 (float64 for float64 inputs) score tiles: bf16 and
fp16 calls round nothing new but ``dS`` after the soft-cap factor (the GEMM operand must be
a kernel_dtype value). The ALiBi product and the soft-cap factor are compiled without
contraction (``slope * d`` and ``t * t`` rounded, then the difference: the goldens' order).

The forward's tiles are ``[queries, keys]``: each row gets the three steps in turn (the
row stays in L1). The backward's are ``[keys, queries]``: the bias is read transposed in
16 x 16 blocks (:func:`_add_bias_t`), and ``dbias`` written the same way
(:func:`_add_dbias_t`), each of a block's bias rows one cache line used up at once.

``dbias`` is the sum of the ``dS'`` of every (batch, q-head, query) the bias is shared by.
Items own disjoint rows of it unless the bias is shared across work units (a bias with a
batch dim of 1 and ``bs > 1``, or a head dim of 1 and ``nheads_kv > 1``): then one work
item runs every unit sharing a slab, one after the other (``serial_batch`` /
``serial_heads``, :func:`item_units`), so the sum has one fixed order and needs no memory
beyond ``dbias`` itself, at the cost of that parallelism. A call without variants has the
bundle with ``active`` False (empty arrays): one type either way, so the kernels compile the
variants' code once (apart, :func:`numbafa.compiler.jit.jit`) and call it only for an active bundle.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from numba import types

from ..conventions.dtypes import round_inplace
from ..compiler.jit import jit, overload
from ..compiler.linking import unpack
from .mask import TilePos
from .fastexp import tanh_of

__all__ = ["ScoreMods", "make_scores", "serial_flags", "modify_scores", "modify_scores_t", "score_gradients",
           "item_units", "n_backward_items", "score_plugins"]

#: The score variants of one call: ``active`` (bool: any variant), ``softcap``/``inv_softcap``
#: (accumulator dtype; 0 and 0: none),
#: ``bias`` (``[bs or 1, nheads or 1, seqlen_q or 1, seqlen_k]``, accumulator dtype; size 0: none),
#: ``alibi`` (slopes ``[bs or 1, nheads]``; size 0: none), ``offset`` (``seqlen_k - seqlen_q``),
#: ``dbias`` (the bias's gradient, zeroed, its shape; size 0: not asked), ``serial_batch`` /
#: ``serial_heads`` (bools: a work item runs every batch / KV head, module docstring).
ScoreMods = namedtuple("ScoreMods", ["active", "softcap", "inv_softcap", "bias", "alibi", "offset", "dbias",
                                     "serial_batch", "serial_heads"])


def make_scores(prob, acc):
    """The :data:`ScoreMods` of a validated problem (:class:`numbafa.checks.validation.Problem`; None, or
    one without variants: an inactive bundle); ``acc`` is the accumulator dtype. ``dbias`` is
    allocated (zeroed) when the problem asks for it."""
    acc = np.dtype(acc)
    if prob is None or not prob.has_score_mods:
        empty4 = np.zeros((0, 0, 0, 0), dtype=acc)
        return ScoreMods(active=False, softcap=acc.type(0.0), inv_softcap=acc.type(0.0), bias=empty4,
                         alibi=np.zeros((0, 0), dtype=acc), offset=0, dbias=empty4, serial_batch=False,
                         serial_heads=False)
    dims = prob.dims
    bs, seqlen_q, nheads_kv, seqlen_k = dims.bs, dims.seqlen_q, dims.nheads_kv, dims.seqlen_k
    bias = prob.bias if prob.bias is not None else np.zeros((0, 0, 0, 0), dtype=acc)
    alibi = prob.alibi if prob.alibi is not None else np.zeros((0, 0), dtype=acc)
    dbias = np.zeros(bias.shape if prob.return_dbias else (0, 0, 0, 0), dtype=acc)
    cap = float(prob.softcap)
    serial_batch, serial_heads = serial_flags(dbias, bs, nheads_kv)
    return ScoreMods(active=True, softcap=acc.type(cap), inv_softcap=acc.type(1.0 / cap if cap else 0.0), bias=bias,
                     alibi=alibi, offset=int(seqlen_k - seqlen_q), dbias=dbias, serial_batch=serial_batch,
                     serial_heads=serial_heads)


def serial_flags(dbias, bs: int, nheads_kv: int) -> tuple:
    """``(serial_batch, serial_heads)`` of a :data:`ScoreMods` whose ``dbias`` (size 0: not asked
    for) is shared by the ``bs`` batches (its batch dim 1) or the ``nheads_kv`` KV heads (its
    head dim 1) of the arrays it is run with (module docstring)."""
    wanted = dbias.size > 0
    return bool(wanted and dbias.shape[0] == 1 and bs > 1), bool(wanted and dbias.shape[1] == 1 and nheads_kv > 1)


def n_backward_items(bs: int, nheads_kv: int, q_chunks: int, scores) -> int:
    """The backward's work items: ``bs * nheads_kv * q_chunks``, or the groups of units sharing a
    bias slab when its gradient makes them serial (:func:`item_units`)."""
    if not (scores.serial_batch or scores.serial_heads):
        return bs * nheads_kv * q_chunks
    return (1 if scores.serial_batch else bs) * (1 if scores.serial_heads else nheads_kv)


@jit()
def item_units(item, q_chunks, bs, nheads_kv, scores):
    """``(b0, b1, h0, h1, chunk)``: the batches ``b0:b1`` and KV heads ``h0:h1`` whose units work
    item ``item`` runs (one unit, ``item = unit * q_chunks + chunk``, unless a shared bias's
    gradient makes them serial: then ``item`` numbers the groups of units sharing a slab)."""
    serial_batch = scores.serial_batch
    serial_heads = scores.serial_heads
    unit = item // q_chunks
    chunk = item - unit * q_chunks
    if not (serial_batch or serial_heads):
        batch = unit // nheads_kv
        kv_head = unit - batch * nheads_kv
        return batch, batch + 1, kv_head, kv_head + 1, chunk
    n_h = 1 if serial_heads else nheads_kv
    gb = item // n_h
    gh = item - gb * n_h
    b0, b1 = (0, bs) if serial_batch else (gb, gb + 1)
    h0, h1 = (0, nheads_kv) if serial_heads else (gh, gh + 1)
    return b0, b1, h0, h1, 0


def like(x, ref):  # pragma: no cover - replaced by the overload inside njit code
    """``x`` (a number) as a float of ``ref``'s type (float32 or float64)."""
    raise NotImplementedError("like is only callable from @njit code")


@overload(like, inline="always")
def _like_overload(x, ref):
    if ref == types.float32:
        return lambda x, ref: np.float32(x)
    if ref == types.float64:
        return lambda x, ref: np.float64(x)
    return None


@jit()
def _slab(x, at):
    """The ``[seqlen_q or 1, seqlen_k]`` slab of a bias-shaped array for the batch and q-head of
    ``at`` (a :data:`~numbafa.kernels.mask.TilePos`)."""
    return x[at.batch if x.shape[0] > 1 else 0, at.q_head if x.shape[1] > 1 else 0]


@jit()
def _softcap_row(row, cap, inv):
    for j in range(row.size):
        row[j] = cap * tanh_of(row[j] * inv)


@jit(contract=False)
def _alibi_row(row, slope, center, k0):
    """``row[j] -= slope * |center - (k0 + j)|`` (the product rounded, then the difference; the
    distance exact below 2**24 in float32)."""
    for j in range(row.size):
        row[j] = row[j] - slope * like(abs(center - (k0 + j)), slope)


@jit()
def modify_scores(args, _):
    """Forward: the variants on a ``[queries, keys]`` score tile of queries ``at.q0..`` and keys
    ``at.k0..`` of one q-head, in place, before the masks. ``args`` points to ``(s, at,
    scores)``, ``at`` the tile's :data:`~numbafa.kernels.mask.TilePos`. A plugin
    (:mod:`numbafa.kernels.table`)."""
    s, at, scores = unpack(args)
    q_abs0, k_abs0 = at.q0, at.k0
    n_q, n_k = s.shape
    has_bias = scores.bias.shape[3] > 0
    has_alibi = scores.alibi.shape[1] > 0
    for i in range(n_q):
        row = s[i]
        if scores.softcap > 0:
            _softcap_row(row, scores.softcap, scores.inv_softcap)
        if has_bias:
            slab = _slab(scores.bias, at)
            b_row = slab[q_abs0 + i if slab.shape[0] > 1 else 0, k_abs0:k_abs0 + n_k]
            for j in range(n_k):
                row[j] += b_row[j]
        if has_alibi:
            slope = scores.alibi[at.batch if scores.alibi.shape[0] > 1 else 0, at.q_head]
            _alibi_row(row, slope, q_abs0 + i + scores.offset, k_abs0)


#: The side of the square blocks of the backward's transposed bias reads and dbias writes.
_BLOCK = 16


@jit()
def _add_bias_t(s_t, slab, at):
    """``s_t[j, i] += slab[q_abs0 + i, k_abs0 + j]`` (``q_abs0, k_abs0 = at.q0, at.k0``;
    ``slab[0, ...]`` for a bias shared by the
    queries), in square blocks of :data:`_BLOCK`: each bias row's 16 keys (one cache line) are
    read whole, and a block's 16 rows of the bias (``seqlen_k`` apart: one L1 set when that is a
    multiple of 1024) are each used once, so no line is evicted before it is used up."""
    n_k, n_q = s_t.shape
    q_abs0, k_abs0 = at.q0, at.k0
    if slab.shape[0] == 1:
        b_row = slab[0]
        for j in range(n_k):
            b = b_row[k_abs0 + j]
            row = s_t[j]
            for i in range(n_q):
                row[i] += b
        return
    b = _BLOCK
    full_k = n_k - n_k % b
    for j0 in range(0, full_k, b):
        for i in range(n_q):
            b_row = slab[q_abs0 + i, k_abs0 + j0:k_abs0 + j0 + b]
            for j in range(b):
                s_t[j0 + j, i] += b_row[j]
    for j in range(full_k, n_k):
        row = s_t[j]
        for i in range(n_q):
            row[i] += slab[q_abs0 + i, k_abs0 + j]


@jit()
def _add_dbias_t(ds_t, slab, at):
    """``slab[q_abs0 + i, k_abs0 + j] += ds_t[j, i]`` (``q_abs0, k_abs0 = at.q0, at.k0``), in
    blocks as :func:`_add_bias_t`; a slab shared by the queries takes each key row's sum over the
    queries (in query order) in one addition."""
    n_k, n_q = ds_t.shape
    q_abs0, k_abs0 = at.q0, at.k0
    if slab.shape[0] == 1:
        d_row = slab[0]
        for j in range(n_k):
            row = ds_t[j]
            total = like(0.0, d_row[k_abs0 + j])
            for i in range(n_q):
                total += row[i]
            d_row[k_abs0 + j] += total
        return
    b = _BLOCK
    full_k = n_k - n_k % b
    for j0 in range(0, full_k, b):
        for i in range(n_q):
            d_row = slab[q_abs0 + i, k_abs0 + j0:k_abs0 + j0 + b]
            for j in range(b):
                d_row[j] += ds_t[j0 + j, i]
    for j in range(full_k, n_k):
        row = ds_t[j]
        for i in range(n_q):
            slab[q_abs0 + i, k_abs0 + j] += row[i]


@jit()
def modify_scores_t(args, _):
    """Backward: the variants on a ``[keys, queries]`` score tile, in place, before the masks;
    with a soft cap, ``t = tanh(s / softcap)`` is kept in ``t_buf`` (flat scratch) for
    :func:`score_gradients`. ``args`` points to ``(s_t, t_buf, at, scores)``, ``at`` the tile's
    :data:`~numbafa.kernels.mask.TilePos`. A plugin (:mod:`numbafa.kernels.table`)."""
    s_t, t_buf, at, scores = unpack(args)
    n_k, n_q = s_t.shape
    if scores.softcap > 0:
        t_t = t_buf[:n_k * n_q].reshape(n_k, n_q)
        cap = scores.softcap
        inv = scores.inv_softcap
        for j in range(n_k):
            row = s_t[j]
            t_row = t_t[j]
            for i in range(n_q):
                t = tanh_of(row[i] * inv)
                t_row[i] = t
                row[i] = cap * t
    if scores.bias.shape[3] > 0:
        _add_bias_t(s_t, _slab(scores.bias, at), at)
    if scores.alibi.shape[1] > 0:
        slope = scores.alibi[at.batch if scores.alibi.shape[0] > 1 else 0, at.q_head]
        for j in range(n_k):
            # |i + offset - k| over the queries i of key k: the forward's distance, by symmetry
            _alibi_row(s_t[j], slope, at.k0 + j - scores.offset, at.q0)


@jit(contract=False)
def _softcap_factor(ds_t, t_t, round_kernel):
    """``dS = dS' * (1 - t * t)``, written in kernel_dtype."""
    n_k, n_q = ds_t.shape
    for j in range(n_k):
        row = ds_t[j]
        t_row = t_t[j]
        for i in range(n_q):
            t = t_row[i]
            row[i] = row[i] * (like(1.0, t) - t * t)
        round_inplace(row, round_kernel)


@jit()
def score_gradients(args, _):
    """Backward, after Step 4 (``ds_t = dS'^T``): ``dbias += dS'`` when asked, then the soft cap's
    factor. ``args`` points to ``(ds_t, t_buf, at, scores, round_kernel)``, ``at`` the tile's
    :data:`~numbafa.kernels.mask.TilePos`. A plugin (:mod:`numbafa.kernels.table`)."""
    ds_t, t_buf, at, scores, round_kernel = unpack(args)
    if scores.dbias.shape[3] > 0:
        _add_dbias_t(ds_t, _slab(scores.dbias, at), at)
    if scores.softcap > 0:
        n_k, n_q = ds_t.shape
        _softcap_factor(ds_t, t_buf[:n_k * n_q].reshape(n_k, n_q), round_kernel)


def score_plugins(plan) -> list:
    """The score-variant plugins and sample arguments of the types the kernels pass them, for
    :func:`numbafa.kernels.table.ensure_plugins`."""
    acc = plan.acc.dtype
    vector, tile = np.empty(0, acc), np.empty((0, 0), acc)
    scores = plan.scores
    at = TilePos(batch=0, q_head=0, q0=0, k0=0)
    return [(modify_scores, (tile, at, scores)), (modify_scores_t, (tile, vector, at, scores)),
            (score_gradients, (tile, vector, at, scores, plan.precision.round_kernel))]
