"""Shares of one attention call, run in separate processes and merged exactly (private).

:mod:`numbafa.distributed` cuts a call into shares and runs each share as a
task on a Dask worker; this module holds everything a worker runs, with no
Dask in it. A share is a *block* of whole work units (batches x KV heads,
each with the q-heads of its GQA group) and one Q *chunk*: the work items
``unit * q_chunks + chunk`` of the in-process kernels (:mod:`numbafa.kernels.loops`).

Why the results are bitwise those of the single-process call:

* every share runs with the :class:`~numbafa.kernels.bundles.Plan` of the
  *whole* problem (built once by the caller), so its ``q_chunks`` is the
  in-process one: a block of 3 units of a 4-unit problem is not split, a
  1-unit problem is split in two, exactly as in one process;
* a work item computes the same bits wherever it runs: nothing in it
  depends on the other units, and the kernels are deterministic for any
  thread count. The one thing keyed on the unit's position, the dropout
  mask (drawn from each element's absolute batch, q-head, query and key),
  is given the block's *origin*: a block's arrays start at batch 0, head 0,
  so every task takes the absolute batch and q-head of its batch 0, head 0
  (:func:`at_origin`), while its rows and keys are at their absolute
  positions already (a chunk's packed rows are unpacked in place);
* score variants (:mod:`numbafa.kernels.scores`) travel with each share as its block's
  slice of the bias and slopes (:func:`block_scores`); a bias's gradient is computed by
  shares of whole groups of the units that share a slab of it (the kernel's own items, in
  the kernel's order), so each element of ``dbias`` comes from one share;
* the backward's cross-item reduction is the kernel's own
  :func:`~numbafa.kernels.backward.bwd_finish_unit`, run by the launcher: a split
  unit's float32 dK/dV partials summed in chunk order, then rounded once,
  and dsinks from the per-row statistics (-LSE, D) of both chunks, gathered
  first (:func:`bwd_merge`).

A chunk's task reads only the rows of the Q groups it owns (zigzag,
:func:`owned_rows`), so its q, o, dy and lse can travel packed to those
rows (:func:`pack_rows`); the rows it does not own are zeros on the worker
and are never read.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numba
import numpy as np

from .core import (attention_bwd, attention_fwd, lse_out, raise_status, run_bwd, run_fwd, to_dtype, user_dbias,
                   user_dsinks)
from ..conventions.dtypes import accumulator_dtype, bf16_dtype, is_bf16
from ..compiler.jit import source_hash
from ..kernels.backward import BwdStats
from ..kernels.bundles import BwdInputs, BwdOutputs, FwdInputs
from ..kernels.dropout import with_origin
from ..kernels.launch import needs_finish
from ..kernels.loops import group_rows, n_q_groups, owns_group
from ..kernels.scores import make_scores, n_backward_items, serial_flags
from ..platform.onednn import gemm_path
from ..checks.options import KERNEL_CALLER, AttentionOptions
from .ranges import check, unscaled_output
from ..checks.validation import kernel_view, validate_bwd_inputs, validate_fwd_inputs

__all__ = ["BwdShard", "owned_rows", "pack_rows", "place_rows", "with_q_chunks", "at_origin", "block_scores",
           "fwd_chunk", "bwd_chunk", "bwd_merge", "fwd_block", "fwd_block_merge", "bwd_block",
           "bwd_block_merge", "warm", "fingerprint"]

#: The raw result of one chunk of a split backward block: ``dq`` (the chunk's rows, packed as
#: its inputs were, in the output dtype: final), ``dk``/``dv`` float32 partials ``[nb, nkv, d,
#: seqlen_k]``, and the per-row statistics ``neg_lse``/``d_sum`` ``[units, n_rep, rows]``.
BwdShard = namedtuple("BwdShard", ["dq", "dk", "dv", "neg_lse", "d_sum", "scale_exp"], defaults=(0,))


def with_q_chunks(plan, q_chunks: int):
    """``plan`` with its Q-chunk split set to ``q_chunks`` (the forward: any split, same bits)."""
    return plan._replace(tiling=plan.tiling._replace(q_chunks=int(q_chunks)))


def at_origin(plan, origin):
    """``plan`` for a block whose batch 0 / q-head 0 are the absolute ``origin = (batch0,
    head0)`` of the whole problem: the dropout mask's offsets (plain ints, the same compiled
    kernels; nothing else in the plan depends on the block's position)."""
    batch0, head0 = origin
    return plan._replace(dropout=with_origin(plan.dropout, batch0, head0))


def _slice_of(x: np.ndarray, axis: int, part: slice) -> slice:
    """``part`` of ``x``'s ``axis``, or all of it when that axis is broadcast (size 1)."""
    return slice(None) if x.shape[axis] == 1 else part


def block_scores(scores, batches: slice, heads: slice, nheads_kv: int):
    """The score variants (:data:`~numbafa.kernels.scores.ScoreMods`, or None) of the block of
    ``batches`` and q-``heads`` (with ``nheads_kv`` KV heads): the bias and slopes sliced along
    the dims they have, a new zeroed ``dbias`` of the block's slice when one is asked for."""
    if scores is None:
        return None
    bias, alibi = scores.bias, scores.alibi
    if bias.size:
        bias = np.ascontiguousarray(bias[_slice_of(bias, 0, batches), _slice_of(bias, 1, heads)])
    if alibi.size:
        alibi = np.ascontiguousarray(alibi[_slice_of(alibi, 0, batches), heads])
    dbias = np.zeros(bias.shape if scores.dbias.size else (0, 0, 0, 0), dtype=scores.dbias.dtype)
    nb = len(range(*batches.indices(1 << 62)))
    serial_batch, serial_heads = serial_flags(dbias, nb, nheads_kv)
    return scores._replace(bias=bias, alibi=alibi, dbias=dbias, serial_batch=serial_batch, serial_heads=serial_heads)


def owned_rows(seqlen_q: int, tiling, chunk: int):
    """Query rows (int64, ascending) of the Q groups item ``chunk`` of a unit owns; ``None``
    when the unit is not split (every row). Uses the kernels' own ownership rule."""
    if tiling.q_chunks == 1:
        return None
    n_groups = n_q_groups.py_func(seqlen_q, tiling)
    spans = [group_rows.py_func(g, seqlen_q, tiling) for g in range(n_groups)
             if owns_group.py_func(g, n_groups, chunk, tiling.q_chunks)]
    return np.concatenate([np.arange(start, start + n) for start, n in spans] + [np.empty(0, np.int64)])


def pack_rows(x: np.ndarray, rows):
    """``x[..., rows]`` as a new C-contiguous array (``x`` itself, contiguous, if ``rows`` is None)."""
    return np.ascontiguousarray(x) if rows is None else np.ascontiguousarray(x[..., rows])


def _unpack_rows(x: np.ndarray, rows, seqlen_q: int) -> np.ndarray:
    """The inverse of :func:`pack_rows`; rows not in ``rows`` are 0 (never read by the chunk)."""
    if rows is None:
        return np.ascontiguousarray(x)
    full = np.zeros(x.shape[:-1] + (seqlen_q,), dtype=x.dtype)
    full[..., rows] = x
    return full


def _chunk_items(n_units: int, q_chunks: int, chunk: int) -> np.ndarray:
    return np.arange(n_units, dtype=np.int64) * q_chunks + chunk


def fwd_chunk(plan, ins, packed: bool, seqlen_q: int, chunk: int, out_dtype, origin=(0, 0),
              n_threads=None, scores=None, exponent=0):
    """Forward of one share: the items of Q chunk ``chunk`` of every unit of the block ``ins``.

    Parameters
    ----------
    plan : Plan of the whole problem; ``plan.tiling.q_chunks`` may be any split (rows are
        independent, so every split gives the same bits).
    ins : FwdInputs of the block (kernel arrays).
    packed : bool
        ``ins.q`` holds only the chunk's rows (:func:`owned_rows`, :func:`pack_rows`).
    seqlen_q, chunk : int
    out_dtype : the dtype of ``o`` (float32 or bf16).
    origin : ``(batch0, head0)``, the absolute batch and q-head of the block's batch 0, head 0
        (:func:`at_origin`; only the dropout mask depends on it).
    n_threads : threads for the block's items (None: ``numba.get_num_threads()``); any number
        gives the same bits.
    scores : the block's score variants (:func:`block_scores`), or None.
    exponent : the call's rescale ``e`` (:func:`numbafa.pipeline.ranges.check` on the whole
        problem): the compiled entry computes on ``v * 2**-e``; the outputs stay scaled (the
        caller multiplies the merged ones back: :func:`~numbafa.pipeline.ranges.unscaled_output`).

    Returns
    -------
    o : ``[nb, nheads, d_head_v, rows]`` in ``out_dtype``;  lse : float32 ``[nb, nheads, rows]``,
    the chunk's rows (all rows when units are not split).
    """
    plan = at_origin(plan, origin)._replace(scores=make_scores(None, plan.acc.dtype) if scores is None else scores)
    rows = owned_rows(seqlen_q, plan.tiling, chunk)
    q = _unpack_rows(ins.q, rows if packed else None, seqlen_q)
    ins = FwdInputs(kernel_view(q), kernel_view(ins.k), kernel_view(ins.v), kernel_view(ins.sinks))
    items = _chunk_items(q.shape[0] * ins.k.shape[1], plan.tiling.q_chunks, chunk)
    outs, _, status = run_fwd(ins, plan, items, n_threads, exponent=exponent)   # (checked by the caller)
    if status[0]:
        raise_status(status, None, KERNEL_CALLER, plan)
    return to_dtype(pack_rows(outs.o, rows), out_dtype), pack_rows(outs.lse, rows)


def place_rows(parts, tiling, seqlen_q: int) -> np.ndarray:
    """The full ``[..., seqlen_q]`` array of the chunks' packed rows ``parts`` (in chunk order)."""
    out = np.empty(parts[0].shape[:-1] + (seqlen_q,), dtype=parts[0].dtype)
    for chunk, part in enumerate(parts):
        rows = owned_rows(seqlen_q, tiling, chunk)
        out[..., slice(None) if rows is None else rows] = part
    return out


def bwd_chunk(plan, ins, packed: bool, seqlen_q: int, chunk: int, out_dtype, origin=(0, 0),
              n_threads=None, scores=None, exponent=0):
    """Backward of one share: the items of Q chunk ``chunk`` of every unit of the block ``ins``.

    Parameters
    ----------
    plan : Plan of the whole problem (its ``q_chunks`` decides the numerics: never change it).
    ins : BwdInputs of the block (kernel arrays).
    packed : bool
        ``ins.q, o, dy, lse`` hold only the chunk's rows (:func:`owned_rows`, :func:`pack_rows`).
    seqlen_q, chunk : int
    out_dtype : the dtype of dq, dk, dv (float32 or bf16).
    origin, n_threads, scores : as for :func:`fwd_chunk`.
    exponent : as for :func:`fwd_chunk` (the entry computes on ``dy * 2**-e``).

    Returns
    -------
    ``(dq, dk, dv, dsinks, dbias)`` when units are not split (``q_chunks == 1``): final, in
    ``out_dtype`` (dsinks float32 ``[nb, nheads, num_sinks]``; dbias the block's, in the
    accumulator dtype, or None); else a :data:`BwdShard` for :func:`bwd_merge`.
    """
    plan = at_origin(plan, origin)._replace(scores=make_scores(None, plan.acc.dtype) if scores is None else scores)
    rows = owned_rows(seqlen_q, plan.tiling, chunk)

    def full(x):
        return kernel_view(_unpack_rows(x, rows if packed else None, seqlen_q))

    ins = BwdInputs(q=full(ins.q), k=kernel_view(ins.k), v=kernel_view(ins.v), o=full(ins.o),
                    dy=full(ins.dy), lse=full(ins.lse), sinks=kernel_view(ins.sinks))
    q_chunks = plan.tiling.q_chunks
    n_units = ins.q.shape[0] * ins.k.shape[1]
    finish = q_chunks == 1 and needs_finish(ins, plan)
    items = _chunk_items(n_units, q_chunks, chunk)
    if q_chunks == 1:   # (the items of a bias's gradient: groups of units, numbafa.kernels.scores)
        items = np.arange(n_backward_items(ins.q.shape[0], ins.k.shape[1], 1, plan.scores), dtype=np.int64)
    outs, stats, _, status = run_bwd(ins, plan, items, np.arange(n_units if finish else 0, dtype=np.int64), n_threads,
                                     exponent=exponent)   # (checked by the caller)
    if status[0]:
        raise_status(status, None, KERNEL_CALLER, plan)
    if q_chunks == 1:
        dbias = scores.dbias if scores is not None and scores.dbias.size else None
        return (to_dtype(outs.dq, out_dtype), to_dtype(outs.dk, out_dtype),
                to_dtype(outs.dv, out_dtype), outs.dsinks, dbias)
    if chunk == 0:
        dk, dv = outs.dk, outs.dv
    else:
        dk = outs.part_dk[:, chunk - 1].reshape(outs.dk.shape)
        dv = outs.part_dv[:, chunk - 1].reshape(outs.dv.shape)
    return BwdShard(dq=to_dtype(pack_rows(outs.dq, rows), out_dtype), dk=dk, dv=dv,
                    neg_lse=pack_rows(stats.neg_lse, rows), d_sum=pack_rows(stats.d_sum, rows))


def bwd_merge(plan, sinks: np.ndarray, shards, seqlen_q: int, out_dtype):
    """The final ``(dq, dk, dv, dsinks)`` of a block from its chunks' :data:`BwdShard` s.

    Exactly the in-process end of the backward: the statistics and dQ rows of
    every chunk are put in place, chunk 0's float32 dK/dV partial takes the
    place of the kernel's output and the others that of its ``part_dk`` /
    ``part_dv`` scratch, then the launcher's finishing pass
    (:func:`~numbafa.kernels.backward.bwd_finish_unit`) sums them in chunk order, rounds once
    and computes dsinks. The shards are not modified (a worker may keep them
    to run this again after a failure).

    Parameters
    ----------
    plan : Plan of the whole problem.
    sinks : ``[nb, nheads, num_sinks]`` of the block (kernel form: float32, float64 for float64 inputs).
    shards : sequence of :data:`BwdShard`, in chunk order.
    seqlen_q : int
    out_dtype : the dtype of dq, dk, dv.
    """
    first = shards[0]
    nb, nheads_kv, d_head, seqlen_k = first.dk.shape
    d_v = first.dv.shape[2]
    n_units, n_rep = first.neg_lse.shape[:2]
    nheads = nheads_kv * n_rep
    stats = BwdStats(place_rows([s.neg_lse for s in shards], plan.tiling, seqlen_q),
                     place_rows([s.d_sum for s in shards], plan.tiling, seqlen_q))
    dq = place_rows([s.dq for s in shards], plan.tiling, seqlen_q)
    parts = [np.stack([s.dk.reshape(n_units, d_head, seqlen_k) for s in shards[1:]], axis=1),
             np.stack([s.dv.reshape(n_units, d_v, seqlen_k) for s in shards[1:]], axis=1)]
    acc = plan.acc.dtype   # float32, or float64 for float64 inputs
    kernel_dtype = np.uint16 if is_bf16(out_dtype) else acc
    dummy_q = np.empty((nb, nheads, 0, 0), dtype=kernel_dtype)
    dummy_kv = np.empty((nb, nheads_kv, 0, 0), dtype=kernel_dtype)
    sinks = kernel_view(sinks)
    ins = BwdInputs(q=dummy_q, k=dummy_kv, v=dummy_kv, o=dummy_q, dy=dummy_q,
                    lse=np.empty((nb, nheads, 0), dtype=acc), sinks=sinks)
    outs = BwdOutputs(dq=np.empty((nb, nheads, 0, 0), dtype=acc), dk=np.array(first.dk, order="C"),
                      dv=np.array(first.dv, order="C"), dsinks=np.empty(sinks.shape, dtype=acc),
                      part_dk=np.ascontiguousarray(parts[0]), part_dv=np.ascontiguousarray(parts[1]))
    *_, status = run_bwd(ins, plan, np.empty(0, dtype=np.int64), np.arange(n_units, dtype=np.int64),
                         state=(outs, stats), exponent=0)
    if status[0]:
        raise_status(status, None, KERNEL_CALLER, plan)
    return dq, to_dtype(outs.dk, out_dtype), to_dtype(outs.dv, out_dtype), outs.dsinks


# --- blocks of Dask arrays: raw user arrays, validated on the worker ---------------------------

def _block_options(options: AttentionOptions, extras: tuple) -> AttentionOptions:
    """The call's checked scalar ``options`` with a block's ``extras`` ``(sinks, bound_min,
    bound_max, bias, alibi_slopes)`` (the last two: the block's slices, or None)."""
    sinks, bound_min, bound_max, bias, alibi_slopes = extras
    return dataclasses.replace(options, sinks=sinks, bound_min=bound_min, bound_max=bound_max, bias=bias,
                               alibi_slopes=alibi_slopes)


def _block_scores(prob, plan):
    """The score variants of a validated block (:func:`~numbafa.kernels.scores.make_scores`), or None."""
    return make_scores(prob, plan.acc.dtype) if prob.has_score_mods else None


def fwd_block(plan, share: tuple, options: AttentionOptions, lse_layout: str, tensors: tuple, extras: tuple):
    """Forward of one block of Dask chunks (the user's arrays).

    ``share``: ``(chunk, origin)``, the Q chunk and the block's ``(batch0, head0)``
    (:func:`at_origin`); ``tensors``: the block's ``(q, k, v)``; ``extras``: its
    ``(sinks, bound_min, bound_max, bias, alibi_slopes)`` (None when absent). Validated here, as
    :func:`numbafa.attention_fwd` validates. Returns ``(o, lse)``: final (lse in
    ``lse_layout``) when units are not split, else the chunk's rows for :func:`fwd_block_merge`.
    """
    chunk, origin = share
    prob = validate_fwd_inputs(*tensors, _block_options(options, extras))
    e = check(prob, KERNEL_CALLER, backward=False)
    seqlen_q = prob.q.shape[3]
    o, lse = fwd_chunk(plan, FwdInputs(prob.q, prob.k, prob.v, prob.sinks), False, seqlen_q, chunk,
                       prob.dtype, origin, scores=_block_scores(prob, plan), exponent=e)
    o = unscaled_output(o, e, "o")
    return (o, lse_out(lse, lse_layout)) if plan.tiling.q_chunks == 1 else (o, lse)


def fwd_block_merge(plan, parts, seqlen_q: int, lse_layout: str):
    """``(o, lse)`` of a block from its chunks' rows (:func:`fwd_block`), in chunk order."""
    o = place_rows([p[0] for p in parts], plan.tiling, seqlen_q)
    lse = place_rows([p[1] for p in parts], plan.tiling, seqlen_q)
    return o, lse_out(lse, lse_layout)


def _user_dsinks(dsinks: np.ndarray, sinks):
    """Kernel dsinks ``[nb, nheads, num_sinks]`` float32 -> the shape and dtype of ``sinks``."""
    return None if sinks is None else user_dsinks(dsinks, sinks.shape, sinks.dtype)


def bwd_block(plan, share: tuple, options: AttentionOptions, tensors: tuple, extras: tuple):
    """Backward of one block of Dask chunks (the user's arrays).

    As :func:`fwd_block`, ``tensors`` the block's ``(q, k, v, o, dy, lse)``. Returns ``(dq,
    dk, dv, dsinks, dbias)`` (dsinks None without sinks; dbias the block's 4-D slice in the
    bias's dtype, or None) when units are not split, else the chunk's :data:`BwdShard` for
    :func:`bwd_block_merge` (units with dbias are never split).
    """
    chunk, origin = share
    prob = validate_bwd_inputs(*tensors, _block_options(options, extras))
    e = check(prob, KERNEL_CALLER, backward=True)
    ins = BwdInputs(q=prob.q, k=prob.k, v=prob.v, o=prob.o, dy=prob.dy, lse=prob.lse, sinks=prob.sinks)
    out = bwd_chunk(plan, ins, False, prob.q.shape[3], chunk, prob.dtype, origin, scores=_block_scores(prob, plan),
                    exponent=e)
    if plan.tiling.q_chunks > 1:
        return out._replace(scale_exp=e)
    dq, dk, dv, dsinks = (unscaled_output(x, e, name) for x, name in zip(out, ("dq", "dk", "dv", "dsinks")))
    dbias = None if out[4] is None else user_dbias(prob, unscaled_output(out[4], e, "dbias"))
    return dq, dk, dv, _user_dsinks(dsinks, extras[0]), dbias


def bwd_block_merge(plan, parts, sinks, seqlen_q: int, out_dtype):
    """``(dq, dk, dv, dsinks, None)`` of a block from its chunks' shards (:func:`bwd_block`), by
    :func:`bwd_merge`; ``sinks``: the block of the user's sinks (or None)."""
    nb, nheads_kv = parts[0].dk.shape[:2]
    nheads = nheads_kv * parts[0].neg_lse.shape[1]
    acc = plan.acc.dtype
    kernel_sinks = (np.zeros((nb, nheads, 0), dtype=acc) if sinks is None
                    else np.ascontiguousarray(np.asarray(sinks).astype(acc)).reshape(nb, nheads, -1))
    merged = bwd_merge(plan, kernel_sinks, parts, seqlen_q, out_dtype)
    dq, dk, dv, dsinks = (unscaled_output(x, parts[0].scale_exp, name)
                          for x, name in zip(merged, ("dq", "dk", "dv", "dsinks")))
    return dq, dk, dv, _user_dsinks(dsinks, sinks), None


# --- the worker's set-up ------------------------------------------------------------------

_WARM = set()


def fingerprint() -> tuple:
    """What must match between the client and a worker for bitwise-equal results: numbafa's
    sources (their hash: the release adds nothing to it), Numba, and the GEMM path (float32
    sgemm / bf16 oneDNN)."""
    return (source_hash(), numba.__version__, gemm_path()[0])


def warm(kernel: str, dtype_name: str, dropout: bool = False, variants: bool = False,
         backward_only: bool = False) -> tuple:
    """Load (or compile) ``kernel`` ("forward" or "backward") for ``dtype_name`` in this
    process, once, by a tiny call that runs every jitted function of that pass (sinks
    included; with ``dropout`` or score ``variants``, the kernels with them, which are
    compiled apart); return :func:`fingerprint`. Run on every worker by ``client.run``.
    The backward runs on the forward's outputs, or with ``backward_only`` on stand-ins of their
    types (zeros), so that only the backward is compiled (the CLI's second process, which
    compiles it while the first compiles the forward)."""
    if (kernel, dtype_name, dropout, variants, backward_only) not in _WARM:
        dtype = bf16_dtype() if dtype_name == "bfloat16" else np.dtype(dtype_name)
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 1, 8, 640)).astype(dtype) for _ in range(3))
        sinks = np.zeros((1, 1), dtype=np.float32)
        extra = dict(dropout_p=0.5, seed=0) if dropout else {}
        if variants:
            extra.update(bias=np.zeros((640, 640), np.float32), alibi_slopes=np.ones(1, np.float32), softcap=5.0)
        options = AttentionOptions(sinks=sinks, **extra)   # the Python API's call, without its front door
        if kernel == "backward" and backward_only:
            o, lse = np.zeros_like(q), np.zeros(q.shape[:2] + q.shape[3:], accumulator_dtype(dtype))   # lse natural
        else:
            o, lse = attention_fwd(q, k, v, options, KERNEL_CALLER, "natural")
        if kernel == "backward":
            attention_bwd(q, k, v, o, q, lse, dataclasses.replace(options, return_dbias=variants), KERNEL_CALLER)
        _WARM.add((kernel, dtype_name, dropout, variants, backward_only))
    return fingerprint()
