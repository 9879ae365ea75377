"""Tile helpers shared by the forward and backward kernels.

Both kernels keep the Neuron ``[d_head, seq]`` layout for their inputs and
let BLAS read operands transposed; only Q is copied, scaled at load
(:func:`load_scaled`). Their ``[seq, d_head]`` accumulators go to the outputs
through :func:`store_transposed`; the backward's dQ accumulator is ``[d_head,
rows]``, stored with :func:`store` and reloaded between KV sections with
:func:`load_scaled` (scale 1: an exact copy).
"""

from __future__ import annotations

import numpy as np

from ..conventions.dtypes import ROUND_NONE, round_inplace, widen
from ..compiler.jit import jit

__all__ = ["load_scaled", "store", "store_transposed"]


# A transposed *store* goes in square blocks of 16 x 16: the block's 16 rows
# of the [seq, d] source stay in L1, each of its 16 destination rows gets one
# full 64-byte line, and LLVM turns the fixed-size block into vector shuffles.
# A store of whole columns at once would read with a stride of d floats over
# the whole sequence, which at d = 128 (512-byte stride) thrashes L1's sets.
# Loads keep their plain loop (what was measured, docs/performance.md).
_TRANSPOSE_BLOCK = 16


@jit(apart=True, refcount=False)
def load_scaled(src, start, count, out, scale, round_kernel):
    """Load ``src[:, start:start+count]`` (``[d, seq]``) into ``out[:, :count]``, same layout.

    Elements are widened to float32 (bf16 bit patterns included), multiplied
    by ``scale`` and rounded to the format ``round_kernel`` names
    (:func:`numbafa.conventions.dtypes.rounded`) -- ``load_q_dy``'s "scale folded into Q at
    load" when ``scale != 1`` (``scale == 1``: an exact copy, never rounded).
    """
    d_head = src.shape[0]
    copy = scale == 1.0
    for i_d in range(d_head):
        row = src[i_d, start:start + count]   # (a slice: indices that cannot wrap vectorise)
        dst = out[i_d, :count]
        if copy:
            for i in range(count):
                dst[i] = widen(row[i])
        else:
            for i in range(count):
                dst[i] = widen(row[i]) * scale
            round_inplace(dst, round_kernel)


@jit(apart=True, refcount=False)
def store_transposed(src, count, dst, start, round_out):
    """Store ``src[:count]`` (``[seq, d]``) into ``dst[:, start:start+count]`` (``[d, seq]``),
    rounded to the format ``round_out`` names."""
    d_head = dst.shape[0]
    b = _TRANSPOSE_BLOCK
    full_rows = count - count % b
    full_cols = d_head - d_head % b
    for i0 in range(0, full_rows, b):
        for j0 in range(0, full_cols, b):
            for j in range(j0, j0 + b):
                for i in range(i0, i0 + b):
                    dst[j, start + i] = src[i, j]
        for j in range(full_cols, d_head):
            for i in range(i0, i0 + b):
                dst[j, start + i] = src[i, j]
    for i in range(full_rows, count):
        for j in range(d_head):
            dst[j, start + i] = src[i, j]
    if round_out != ROUND_NONE:
        for j in range(d_head):
            round_inplace(dst[j, start:start + count], round_out)


@jit(apart=True, refcount=False)
def store(src, count, dst, start, round_out):
    """Store ``src[:, :count]`` into ``dst[:, start:start+count]`` (both ``[d, seq]``), rounded to
    the format ``round_out`` names."""
    for j in range(dst.shape[0]):
        s_row = src[j]
        d_row = dst[j, start:start + count]
        for i in range(count):
            d_row[i] = s_row[i]
        round_inplace(d_row, round_out)
