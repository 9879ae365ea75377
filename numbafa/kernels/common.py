"""Tile helpers shared by the forward and backward kernels.

Both kernels keep the Neuron ``[d_head, seq]`` layout for their inputs and
let BLAS read operands transposed; only Q is copied, scaled at load
(:func:`load_scaled`). Their ``[seq, d_head]`` accumulators go to the outputs
through :func:`store_transposed`, and the backward's dQ comes back between
KV sections through :func:`load_transposed`.
"""

from __future__ import annotations

import numpy as np

from ..jit import jit
from ..dtypes import round_to_bf16, widen

__all__ = ["round_if", "load_transposed", "load_scaled", "store_transposed"]


@jit()
def round_if(x, flag):
    """Round a float32 to bf16 when ``flag`` (a tile written in bf16)."""
    if flag:
        return round_to_bf16(x)
    return x


# Rows of a transposed *store* handled per block: the block's rows of the
# [seq, d] source (16 x d floats, 8 KiB at d = 128) stay in L1 while every
# column is written. Storing whole columns at once reads with a stride of d
# floats over the full sequence, which at d = 128 (512-byte stride) thrashes
# L1's sets: 1.3-2.3x slower on a 2048 x 128 tile. The same blocking made
# the *load* faster in isolation but the backward 8-10 % slower (old and new
# alternated in one process), so load_transposed keeps its plain loop.
_TRANSPOSE_BLOCK = 16


@jit()
def _loaded(x, scale, round_kernel):
    """One element as loaded: widened to float32, then, if ``scale != 1``, scaled and rounded."""
    y = widen(x)
    if scale != np.float32(1.0):
        y = round_if(y * scale, round_kernel)
    return y


@jit()
def load_transposed(src, start, count, out, scale, round_kernel):
    """Load ``src[:, start:start+count]`` (``[d, seq]``) into ``out[:count]`` as ``[seq, d]``.

    Elements are widened to float32 (bf16 bit patterns included), multiplied
    by ``scale`` and, for ``round_kernel``, rounded to bf16 -- ``load_q_dy``'s
    "scale folded into Q at load" when ``scale != 1`` (``scale == 1``: an
    exact copy, never rounded).
    """
    d_head = src.shape[0]
    for i_d in range(d_head):
        row = src[i_d]
        for i in range(count):
            out[i, i_d] = _loaded(row[start + i], scale, round_kernel)


@jit()
def load_scaled(src, start, count, out, scale, round_kernel):
    """Load ``src[:, start:start+count]`` (``[d, seq]``) into ``out[:, :count]``, same layout.

    The same values as :func:`load_transposed` (widened, scaled and, when
    ``scale != 1`` and ``round_kernel``, rounded to bf16), not transposed.
    """
    d_head = src.shape[0]
    for i_d in range(d_head):
        row = src[i_d]
        dst = out[i_d]
        for i in range(count):
            dst[i] = _loaded(row[start + i], scale, round_kernel)


@jit()
def store_transposed(src, count, dst, start, round_out):
    """Store ``src[:count]`` (``[seq, d]``) into ``dst[:, start:start+count]`` (``[d, seq]``)."""
    d_head = dst.shape[0]
    for i0 in range(0, count, _TRANSPOSE_BLOCK):
        i1 = min(i0 + _TRANSPOSE_BLOCK, count)
        for i_d in range(d_head):
            for i in range(i0, i1):
                dst[i_d, start + i] = round_if(src[i, i_d], round_out)
