"""Typed argument bundles of the kernels, and the one place they are built.

Numba compiles named tuples as typed records, so the kernels take a few
bundles instead of dozens of loose, same-typed positional arguments (two
swapped ints cannot compile into a wrong call), and every derived value is
decided once, here, from the validated problem. Records are built by name.

:class:`Tiling`
    The Neuron tile sizes of the call (:func:`numbafa.conventions.tiling.setup_config`)
    and the CPU's Q-chunk split (:func:`numbafa.kernels.schedule.q_chunks`).
:class:`Mask`
    Causal, window, packing, and every query's visible key range
    (:mod:`numbafa.kernels.mask`).
:class:`Precision`
    Which tiles are rounded, and to what (docs/numerics.md).
:class:`Gemm`
    How the tile products are computed (:mod:`numbafa.platform.onednn`).
:class:`Plan`
    The above, ``softmax_scale``, the attention dropout
    (:data:`numbafa.kernels.dropout.Dropout`) and the score variants
    (:data:`numbafa.kernels.scores.ScoreMods`): everything but the arrays. Like
    upstream's ``cfg``, it travels through every helper.

Every option is a *value* of a fixed type: the rounding format, the GEMM path,
dropout and the score variants switch code at run time (a branch per row or
tile), so one compiled kernel serves float32, bf16 and float16 inputs, with
or without dropout or score variants, on either GEMM path; only float64
inputs (float64 arithmetic) are compiled apart. The input storage (float32
values or bf16 bits) is a value too: the entries and the work items take the
4-D inputs as :data:`numbafa.kernels.stored.Stored` records.

``FwdInputs``/``FwdOutputs`` and ``BwdInputs``/``BwdOutputs`` carry the
arrays (the inputs as arrays in Python -- bf16 as their uint16 bit patterns --
and as ``Stored`` records from the entries on; outputs in the accumulator
dtype holding values of the output dtype).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..conventions.dtypes import ROUND_BF16, ROUND_FP16, ROUND_NONE, accumulator_dtype
from ..compiler.memo import Memo
from ..platform.onednn import SMALL_SGEMM, active_gemm_path, bf16_units
from .schedule import fwd_q_chunks, q_chunks, q_group_rows
from ..conventions.tiling import setup_config
from .dropout import make_dropout
from .mask import fill_key_ranges
from .scores import make_scores

__all__ = ["Tiling", "Mask", "Precision", "Gemm", "Plan", "FwdInputs", "FwdOutputs", "BwdInputs",
           "BwdOutputs", "make_plan", "shared_plan"]

Tiling = namedtuple("Tiling", ["q_tile", "k_tile", "k_sub_tile", "q_tile_group", "d_tile",
                               "section_len", "q_chunks", "group_rows"])
Tiling.__doc__ = """Tile sizes (ints): Neuron's Q tile, K tile, transposed K sub-tile, Q tiles per
group, head-dim tile, KV section length; and the CPU's Q chunks per work unit and rows per Q group
(``q_tile * q_tile_group``, fewer in a split short forward: :func:`numbafa.kernels.schedule.q_group_rows`)."""

Mask = namedtuple("Mask", ["causal", "window", "use_packing", "key_lo", "key_hi"])
Mask.__doc__ = """causal (bool), window (int, already <= seqlen_k; 0: none), use_packing (bool),
key_lo/key_hi (int32 [seqlen_q]): query q sees keys key_lo[q] <= k < key_hi[q]."""

Precision = namedtuple("Precision", ["round_kernel", "round_acc"])
Precision.__doc__ = """Rounding codes (ints, numbafa.conventions.dtypes: ROUND_NONE, ROUND_BF16, ROUND_FP16).
round_kernel: the format of the tiles written in kernel_dtype (bf16 or fp16 inputs: Q scaled, P,
dS, the products of D, the outputs; dQ's PSUM is then kept as a tile, added once per K tile).
round_acc: the format of the tiles written in mixed_dtype, which is kernel_dtype with bf16 or fp16
inputs and mixed_precision=False: the accumulators (dQ/dK/dV, each taking one rounded addition
from a PSUM tile; the forward's output and row sum; the dsinks lanes) and the other mixed_dtype
tiles (-LSE, D and its partials, the sink logits and p_sink). ROUND_NONE otherwise."""

Gemm = namedtuple("Gemm", ["onednn", "bits", "onednn_max_mnk"])
Gemm.__doc__ = """The GEMM path of a call: onednn (bool), oneDNN's GEMMs instead of BLAS (float32
tiles by dnnl_sgemm); bits (bool), bf16 inputs multiplied as bf16 on the bf16 units
(dnnl_gemm_bf16bf16f32): the operand tiles are their uint16 bits (numbafa.kernels.matmul);
onednn_max_mnk (int), without onednn the most multiply-adds (m * n * k) of a float32 GEMM
dnnl_sgemm computes (the mixed path: numbafa.platform.onednn.SMALL_SGEMM; -1: none)."""

Plan = namedtuple("Plan", ["tiling", "mask", "precision", "softmax_scale", "gemm", "dropout", "acc", "scores",
                           "layout"])
Plan.__doc__ = """Everything a kernel needs but the arrays; softmax_scale is of the accumulator
dtype (float32, or float64 for float64 inputs). gemm: :class:`Gemm`. dropout:
numbafa.kernels.dropout.Dropout (``active`` False: none). acc: an empty array of the accumulator
dtype, which every scratch tile, statistic and float output of the kernels has: float32, or
float64 for float64 inputs (np.empty(n, dtype=plan.acc.dtype) inside the kernels). scores: the
score variants (numbafa.kernels.scores.ScoreMods: bias, ALiBi, soft cap, and the bias's gradient,
the one output a plan carries; ``active`` False: none). layout: the 4-D arrays' layout code
(numbafa.kernels.heads: NEURON, BHSD, BSHD), a runtime int: one kernel for every layout."""

FwdInputs = namedtuple("FwdInputs", ["q", "k", "v", "sinks"])
FwdOutputs = namedtuple("FwdOutputs", ["o", "lse"])
BwdInputs = namedtuple("BwdInputs", ["q", "k", "v", "o", "dy", "lse", "sinks"])
BwdOutputs = namedtuple("BwdOutputs", ["dq", "dk", "dv", "dsinks", "part_dk", "part_dv"])

_FORMAT = {"bf16": ROUND_BF16, "fp16": ROUND_FP16}


def make_plan(prob, backward: bool, gemm_path: str | None = None) -> Plan:
    """The :class:`Plan` of one validated problem (:class:`numbafa.checks.validation.Problem`).

    ``backward`` selects the backward's Q-chunk rule (bf16 accumulators are
    never split there; the forward's rows are independent). ``gemm_path``: ``"blas"``,
    ``"mixed"`` or ``"onednn"`` (:mod:`numbafa.platform.onednn`); None:
    :func:`~numbafa.platform.onednn.active_gemm_path`.
    """
    if gemm_path is None:
        gemm_path = active_gemm_path()
    dims = prob.dims
    bs, d_head, seqlen_q, nheads_kv, seqlen_k = dims.bs, dims.d_head, dims.seqlen_q, dims.nheads_kv, dims.seqlen_k
    if max(seqlen_q, seqlen_k) >= 2 ** 31:
        raise ValueError(f"sequence lengths must be below 2**31, got seqlen_q={seqlen_q}, "
                         f"seqlen_k={seqlen_k}")
    # Zero-length sequences run the same kernels with empty loops.
    cfg = setup_config(max(seqlen_q, 1), max(seqlen_k, 1), d_head, dims.d_head_v)
    fmt = _FORMAT["fp16"] if prob.is_fp16 else _FORMAT["bf16"] if prob.is_bf16 else ROUND_NONE
    round_acc = ROUND_NONE if prob.mixed_precision else fmt
    acc = accumulator_dtype(prob.dtype)
    # A bias's gradient is summed by whole units, in one order (numbafa.kernels.scores): no split.
    if prob.return_dbias:
        chunks = 1
    elif backward:
        chunks = q_chunks(bs * nheads_kv, seqlen_q, bool(round_acc), bool(prob.use_causal_mask))
    else:
        chunks = fwd_q_chunks(bs * nheads_kv, seqlen_q)
    tiling = Tiling(q_tile=cfg.q_tile, k_tile=cfg.k_tile, k_sub_tile=cfg.k_sub_tile, q_tile_group=cfg.q_tile_group,
                    d_tile=cfg.d_tile, section_len=cfg.section_len, q_chunks=chunks,
                    group_rows=q_group_rows(seqlen_q, chunks, backward))
    key_lo = np.empty(seqlen_q, dtype=np.int32)
    key_hi = np.empty(seqlen_q, dtype=np.int32)
    fill_key_ranges(prob.use_causal_mask, prob.window, prob.use_packing, prob.bound_min,
                    prob.bound_max, seqlen_k, key_lo, key_hi)
    mask = Mask(causal=bool(prob.use_causal_mask), window=int(prob.window), use_packing=bool(prob.use_packing),
                key_lo=key_lo, key_hi=key_hi)
    onednn = gemm_path == "onednn"
    # bf16 tiles on the bf16 units; without them (a forced oneDNN path) bf16 is widened to float32
    gemm = Gemm(onednn=onednn, bits=bool(prob.is_bf16 and onednn and bf16_units()),
                onednn_max_mnk=SMALL_SGEMM if gemm_path == "mixed" else -1)
    return Plan(tiling=tiling, mask=mask, precision=Precision(round_kernel=fmt, round_acc=round_acc),
                softmax_scale=acc.type(prob.softmax_scale), gemm=gemm,
                dropout=make_dropout(prob.dropout_p, prob.seed, prob.seed_offset, acc),
                acc=np.empty(0, dtype=acc), scores=make_scores(prob, acc), layout=int(prob.layout))


_PLANS = Memo()


def shared_plan(prob, backward: bool) -> Plan:
    """:func:`make_plan`, built once for all calls with the same shapes, dtype and options.

    Small models make thousands of calls of one shape; building a plan is most of
    the Python work of a small call. Problems with packing bounds (whose key
    ranges depend on the bounds' values) get a fresh plan; with dropout the
    shared plan gets this call's :data:`~numbafa.kernels.dropout.Dropout`, with score variants
    this call's :data:`~numbafa.kernels.scores.ScoreMods` (its arrays, a new ``dbias``). The GEMM
    path (:func:`~numbafa.platform.onednn.active_gemm_path`) is part of the key.
    The shared plan's arrays (the key ranges) are read by the kernels and never
    written: nobody may write into a plan.
    """
    path = active_gemm_path()
    if prob.use_packing:
        return make_plan(prob, backward, path)
    key = (prob.dims, prob.layout, prob.dtype, prob.mixed_precision, prob.use_causal_mask,
           prob.window, prob.softmax_scale, prob.dropout_p > 0.0, backward, prob.has_score_mods, prob.return_dbias,
           path)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(prob, backward, path)
        # Kept without the call's score arrays (a bias and its gradient may be large).
        _PLANS.put(key, plan._replace(scores=make_scores(None, plan.acc.dtype)) if prob.has_score_mods else plan)
        return plan
    if prob.dropout_p > 0.0:
        plan = plan._replace(dropout=make_dropout(prob.dropout_p, prob.seed, prob.seed_offset, plan.acc.dtype))
    if prob.has_score_mods:
        plan = plan._replace(scores=make_scores(prob, plan.acc.dtype))
    return plan
