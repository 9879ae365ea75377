"""Typed argument bundles of the kernels, and the one place they are built.

Numba compiles named tuples as typed records, so the kernels take a few
bundles instead of dozens of loose, same-typed positional arguments (two
swapped ints cannot compile into a wrong call any more), and every derived
value is decided once, here, from the validated problem:

:class:`Tiling`
    The Neuron tile sizes of the call (:func:`numbafa.tiling.setup_config`)
    and the CPU's Q-chunk split (:func:`numbafa.schedule.q_chunks`).
:class:`Mask`
    Causal, window, packing, and every query's visible key range
    (:mod:`numbafa.kernels.mask`).
:class:`Precision`
    Which tiles are rounded to bf16 (docs/numerics.md).
:class:`Plan`
    The three above, ``softmax_scale``, the GEMM path and its operand type
    (:mod:`numbafa.onednn`) and the attention dropout
    (:data:`numbafa.kernels.dropout.Dropout`): everything but the arrays. Like upstream's
    ``cfg``, it travels through every helper.

``FwdInputs``/``FwdOutputs`` and ``BwdInputs``/``BwdOutputs`` carry the
arrays (bf16 inputs as their uint16 bit patterns; outputs float32 holding
values of the output dtype).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..dtypes import accumulator_dtype
from ..memo import Memo
from ..onednn import active_gemm_path, bf16_units
from ..schedule import q_chunks
from ..tiling import setup_config
from .dropout import make_dropout
from .mask import fill_key_ranges
from .matmul import ONEDNN
from .scores import make_scores

__all__ = ["Tiling", "Mask", "Precision", "Plan", "FwdInputs", "FwdOutputs", "BwdInputs",
           "BwdOutputs", "BwdEntries", "make_plan", "shared_plan"]

Tiling = namedtuple("Tiling", ["q_tile", "k_tile", "k_sub_tile", "q_tile_group", "d_tile",
                               "section_len", "q_chunks"])
Tiling.__doc__ = """Tile sizes (ints): Neuron's Q tile, K tile, transposed K sub-tile, Q tiles per
group, head-dim tile, KV section length; and the CPU's Q chunks per work unit."""

Mask = namedtuple("Mask", ["causal", "window", "use_packing", "key_lo", "key_hi"])
Mask.__doc__ = """causal (bool), window (int, already <= seqlen_k; 0: none), use_packing (bool),
key_lo/key_hi (int32 [seqlen_q]): query q sees keys key_lo[q] <= k < key_hi[q]."""

Precision = namedtuple("Precision", ["round_kernel", "bf16_accumulators"])
Precision.__doc__ = """round_kernel: tiles written in kernel_dtype are rounded to it (bf16 or fp16 inputs).
bf16_accumulators: mixed_dtype is kernel_dtype (bf16 or fp16 inputs, mixed_precision=False), so
tiles written in mixed_dtype are rounded too: the accumulators (dQ/dK/dV, each taking one rounded
addition from a PSUM tile; the forward's output and row sum; the dsinks lanes) and the other
mixed_dtype tiles (-LSE, D and its partials, the sink logits and p_sink). The flags' *type* names
the format (numbafa.dtypes.round_to_kernel_dtype): bool for bf16 (and float32/float64 inputs, both
False), numpy.uint8 for fp16 -- so fp16 kernels are a compiled specialisation of their own and the
bf16 ones are unchanged."""

Plan = namedtuple("Plan", ["tiling", "mask", "precision", "softmax_scale", "gemm", "operand",
                           "dropout", "acc", "scores"])
Plan.__doc__ = """Everything a kernel needs but the arrays; softmax_scale is of the accumulator dtype
(float32, or float64 for float64 inputs). gemm: the
GEMM path (numbafa.onednn), None for BLAS or numbafa.kernels.matmul.ONEDNN, a type of its own, so
each path is a compiled specialisation. operand: an empty array whose dtype is that of the GEMM
operand tiles: float32 (float32 inputs; bf16 values widened on the BLAS path), uint16 (bf16
bits, oneDNN on the bf16 units) or float64 (float64 inputs, BLAS dgemm on either path).
dropout: numbafa.kernels.dropout.Dropout, or None for p = 0 (a type of its own: kernels without
dropout compile no dropout code). acc: an empty array of the accumulator dtype, which every
scratch tile, statistic and float output of the kernels has: float32, or float64 for float64
inputs (np.empty(n, dtype=plan.acc.dtype) inside the kernels). scores: the score variants
(numbafa.kernels.scores.ScoreMods: bias, ALiBi, soft cap, and the bias's gradient, the one
output a plan carries), or None without them (a type of its own, as dropout's)."""

#: Addresses of the backward's work item and unit finish (:func:`numbafa.linking.native_address`).
BwdEntries = namedtuple("BwdEntries", ["item", "finish"])
FwdInputs = namedtuple("FwdInputs", ["q", "k", "v", "sinks"])
FwdOutputs = namedtuple("FwdOutputs", ["o", "lse"])
BwdInputs = namedtuple("BwdInputs", ["q", "k", "v", "o", "dy", "lse", "sinks"])
BwdOutputs = namedtuple("BwdOutputs", ["dq", "dk", "dv", "dsinks", "part_dk", "part_dv"])


def make_plan(prob, backward: bool, gemm_path: str | None = None) -> Plan:
    """The :class:`Plan` of one validated problem (:class:`numbafa.validation.Problem`).

    ``backward`` selects the backward's Q-chunk rule (bf16 accumulators are
    never split there; the forward's rows are independent). ``gemm_path``: ``"blas"`` or
    ``"onednn"`` (:mod:`numbafa.onednn`); None: :func:`~numbafa.onednn.active_gemm_path`.
    """
    if gemm_path is None:
        gemm_path = active_gemm_path()
    bs, _, d_head, seqlen_q = prob.q.shape
    nheads_kv, seqlen_k = prob.k.shape[1], prob.k.shape[3]
    if max(seqlen_q, seqlen_k) >= 2 ** 31:
        raise ValueError(f"sequence lengths must be below 2**31, got seqlen_q={seqlen_q}, "
                         f"seqlen_k={seqlen_k}")
    # Zero-length sequences run the same kernels with empty loops.
    cfg = setup_config(max(seqlen_q, 1), max(seqlen_k, 1), d_head, prob.v.shape[2])
    # The flags' type names the kernel dtype they round to: bool for bf16, uint8 for fp16 (Precision).
    flag = np.uint8 if prob.is_fp16 else bool
    narrow = bool(prob.is_bf16 or prob.is_fp16)
    round_kernel = flag(narrow)
    bf16_accumulators = flag(narrow and not prob.mixed_precision)
    acc = accumulator_dtype(prob.dtype)
    # A bias's gradient is summed by whole units, in one order (numbafa.kernels.scores): no split.
    chunks = 1 if prob.return_dbias else q_chunks(bs * nheads_kv, seqlen_q,
                                                  bool(bf16_accumulators) if backward else False)
    tiling = Tiling(cfg.q_tile, cfg.k_tile, cfg.k_sub_tile, cfg.q_tile_group, cfg.d_tile,
                    cfg.section_len, chunks)
    key_lo = np.empty(seqlen_q, dtype=np.int32)
    key_hi = np.empty(seqlen_q, dtype=np.int32)
    fill_key_ranges(prob.use_causal_mask, prob.window, prob.use_packing, prob.bound_min,
                    prob.bound_max, seqlen_k, key_lo, key_hi)
    mask = Mask(bool(prob.use_causal_mask), int(prob.window), bool(prob.use_packing), key_lo, key_hi)
    precision = Precision(round_kernel, bf16_accumulators)
    onednn = gemm_path == "onednn"
    # bf16 tiles on the bf16 units; without them (a forced oneDNN path) bf16 is widened to float32
    operand = np.empty(0, dtype=np.uint16 if prob.is_bf16 and onednn and bf16_units() else acc)
    dropout = make_dropout(prob.dropout_p, prob.seed, prob.seed_offset, acc)
    return Plan(tiling, mask, precision, acc.type(prob.softmax_scale), ONEDNN if onednn else None,
                operand, dropout, np.empty(0, dtype=acc), make_scores(prob, acc))



_PLANS = Memo()


def shared_plan(prob, backward: bool) -> Plan:
    """:func:`make_plan`, built once for all calls with the same shapes, dtype and options.

    Small models make thousands of calls of one shape; building a plan is most of
    the Python work of a small call. Problems with packing bounds (whose key
    ranges depend on the bounds' values) get a fresh plan; with dropout the
    shared plan gets this call's :data:`~numbafa.kernels.dropout.Dropout`, with score variants
    this call's :data:`~numbafa.kernels.scores.ScoreMods` (its arrays, a new ``dbias``). The GEMM
    path (:func:`~numbafa.onednn.active_gemm_path`) is part of the key.
    The shared plan's arrays (the key ranges) are read by the kernels and never
    written: nobody may write into a plan.
    """
    path = active_gemm_path()
    if prob.use_packing:
        return make_plan(prob, backward, path)
    key = (prob.q.shape, prob.k.shape, prob.v.shape[2], prob.dtype, prob.mixed_precision, prob.use_causal_mask,
           prob.window, prob.softmax_scale, prob.dropout_p > 0.0, backward, prob.has_score_mods, prob.return_dbias,
           path)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(prob, backward, path)
        # Kept without the call's score arrays (a bias and its gradient may be large).
        _PLANS.put(key, plan._replace(scores=None) if prob.has_score_mods else plan)
        return plan
    if prob.dropout_p > 0.0:
        plan = plan._replace(dropout=make_dropout(prob.dropout_p, prob.seed, prob.seed_offset, plan.acc.dtype))
    if prob.has_score_mods:
        plan = plan._replace(scores=make_scores(prob, plan.acc.dtype))
    return plan
