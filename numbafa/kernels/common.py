"""Tile helpers shared by the forward and backward kernels.

Both kernels keep the Neuron ``[d_head, seq]`` layout for their inputs and
let BLAS read operands transposed; only Q is copied, scaled at load
(:func:`load_scaled`). Their ``[seq, d_head]`` accumulators go to the outputs
through :func:`store_transposed`; the backward's dQ accumulator is ``[d_head,
rows]``, stored with :func:`store` and reloaded between KV sections with
:func:`load_scaled` (scale 1: an exact copy).
"""

from __future__ import annotations

from ..conventions.dtypes import ROUND_NONE, round_inplace, widen
from ..compiler.jit import jit
from .heads import gather_head
from .matmul import row_of

__all__ = ["load_scaled", "store", "store_transposed"]


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
    rounded to the format ``round_out`` names. The transpose goes in 8 x 8 blocks held in vector
    registers (:func:`numbafa.kernels.heads.gather_head`, ``src``'s rows taken as a head's), 8 rows
    of ``dst`` at a time (``by_band``)."""
    d_head = dst.shape[0]
    out = dst[:, start:start + count]
    gather_head((src, 0, d_head), 0, count, out, True)
    if round_out != ROUND_NONE:
        for j in range(d_head):   # (dst's row slices: contiguous arrays, a loop that vectorises)
            round_inplace(dst[j, start:start + count], round_out)


@jit(apart=True, refcount=False)
def store(src, count, dst, start, round_out):
    """Store ``src[:, :count]`` into ``dst[:, start:start+count]`` (both ``[d, seq]``), rounded to
    the format ``round_out`` names."""
    for j in range(dst.shape[0]):   # (rows as contiguous views, so that the loops vectorise)
        s_row = row_of(src, j)
        d_row = row_of(dst, j)[start:start + count]
        for i in range(count):
            d_row[i] = s_row[i]
        round_inplace(d_row, round_out)
