"""The kernels on the caller's layout: one head of a 4-D array, read and written tile by tile.

The kernels' arrays are C-contiguous in one of three layouts, the plan's ``layout`` code (a
runtime int: one compiled kernel for all three):

* ``NEURON`` ``[batch, heads, head_dim, seq]``: a head is ``[d, seq]``, the Neuron kernel's
  layout, which the tiles and the GEMM operands use. K and V are GEMM operands in place.
* ``BHSD`` ``[batch, heads, seq, head_dim]`` and ``BSHD`` ``[batch, seq, heads, head_dim]``
  (PyTorch's and flash-attn's): a head is ``[seq, d]`` rows (:func:`head_rows`; row stride
  ``d`` or ``heads * d``). They are *s-major*.

Upstream, every input tile is transposed on chip (``nc_transpose`` of the Q, K, V, dO, O
tiles, ``flash_attn_bwd`` lines 1184-1270) and every output tile on its way out. Here an
s-major head is transposed where upstream transposes: at load, tile by tile, into the same
``[d, seq]`` tiles the Neuron layout gives in place (:func:`gather_head`,
:func:`load_scaled_rows`), and at store (:func:`store_rows`, :func:`store_head_rows`). The
GEMMs then see the same operands in the same orientation whatever the layout, so every layout
gives the Neuron layout's bits; no whole-array copy is made.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import round_inplace, rounded, widen
from ..jit import jit

__all__ = ["NEURON", "BHSD", "BSHD", "LAYOUT_CODES", "dims4", "head_rows", "gather_head", "load_scaled_rows",
           "store_rows", "store_head_rows", "reduce_partials_rows"]

NEURON, BHSD, BSHD = np.int64(0), np.int64(1), np.int64(2)
#: The plan's layout code of each layout name (:mod:`numbafa.layout`).
LAYOUT_CODES = {"neuron": 0, "bhsd": 1, "bshd": 2}

# Transposes go in square blocks: the block's source rows stay in L1 and each destination row
# gets whole cache lines (numbafa.kernels.common).
_BLOCK = 16


@jit()
def dims4(x, layout):
    """``(batch, heads, head_dim, seq)`` of a 4-D kernel array in ``layout``."""
    if layout == BSHD:
        return x.shape[0], x.shape[2], x.shape[3], x.shape[1]
    if layout == BHSD:
        return x.shape[0], x.shape[1], x.shape[3], x.shape[2]
    return x.shape[0], x.shape[1], x.shape[2], x.shape[3]


@jit()
def head_rows(x, layout, b, h):
    """Head ``(b, h)`` of an s-major array as ``(rows, col0, d)``: element ``[s, j]`` of the head
    is ``rows[s, col0 + j]``, ``rows`` a C-contiguous 2-D view (bhsd: the head itself; bshd: the
    batch's ``[seq, heads * d]``), so the transposes below index C arrays with fixed-size
    blocks, which LLVM turns into vector shuffles."""
    if layout == BSHD:
        d = x.shape[3]
        return x[b].reshape((x.shape[1], x.shape[2] * d)), h * d, d
    return x[b, h], 0, x.shape[3]


@jit(apart=True)
def gather_head(head, start, count, out):
    """``out[:, :count]`` = rows ``start:start + count`` of the s-major ``head`` (:func:`head_rows`),
    transposed to ``[d, count]``, elements as they are (bf16 bits stay bits)."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    for i0 in range(0, full_i, b):
        for j0 in range(0, full_j, b):
            for j in range(j0, j0 + b):
                for i in range(i0, i0 + b):
                    out[j, i] = rows[start + i, col0 + j]
        for j in range(full_j, d):
            for i in range(i0, i0 + b):
                out[j, i] = rows[start + i, col0 + j]
    for i in range(full_i, count):
        for j in range(d):
            out[j, i] = rows[start + i, col0 + j]


@jit(apart=True)
def load_scaled_rows(head, start, count, out, scale, round_kernel):
    """:func:`numbafa.kernels.common.load_scaled` of an s-major head: ``out[:, :count]`` the
    transposed rows, widened to float, times ``scale`` and rounded (``scale == 1``: an exact copy)."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    for i0 in range(0, full_i, b):
        for j0 in range(0, full_j, b):
            for j in range(j0, j0 + b):
                for i in range(i0, i0 + b):
                    out[j, i] = widen(rows[start + i, col0 + j])
        for j in range(full_j, d):
            for i in range(i0, i0 + b):
                out[j, i] = widen(rows[start + i, col0 + j])
    for i in range(full_i, count):
        for j in range(d):
            out[j, i] = widen(rows[start + i, col0 + j])
    if scale != 1.0:
        for j in range(d):
            dst = out[j]
            for i in range(count):
                dst[i] = dst[i] * scale
            round_inplace(dst[:count], round_kernel)


@jit(apart=True)
def store_rows(src, count, head, start, round_out):
    """Rows ``start:start + count`` of the s-major ``head`` = ``src[:count]`` (``[seq, d]``
    accumulators: no transpose), rounded to the format ``round_out`` names."""
    rows, col0, d = head
    for i in range(count):
        dst = rows[start + i]
        for j in range(d):
            dst[col0 + j] = src[i, j]
        round_inplace(dst[col0:col0 + d], round_out)


@jit(apart=True)
def store_head_rows(src, count, head, start, round_out):
    """Rows ``start:start + count`` of the s-major ``head`` = ``src[:, :count]`` transposed (a
    ``[d, count]`` tile, dQ), rounded to the format ``round_out`` names."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    for i0 in range(0, full_i, b):
        for j0 in range(0, full_j, b):
            for i in range(i0, i0 + b):
                for j in range(j0, j0 + b):
                    rows[start + i, col0 + j] = src[j, i]
        for i in range(i0, i0 + b):
            for j in range(full_j, d):
                rows[start + i, col0 + j] = src[j, i]
    for i in range(full_i, count):
        for j in range(d):
            rows[start + i, col0 + j] = src[j, i]
    for i in range(count):
        round_inplace(rows[start + i, col0:col0 + d], round_out)


@jit()
def reduce_partials_rows(head, parts, round_out):
    """A split unit's dK (or dV) of an s-major head: ``[k, d] = round([k, d] + parts[0][d, k] +
    parts[1][d, k] + ...)``, in that order (the Neuron layout's sum)."""
    rows, col0, d = head
    for k in range(rows.shape[0]):
        for x in range(d):
            acc = rows[k, col0 + x]
            for c in range(parts.shape[0]):
                acc += parts[c, x, k]
            rows[k, col0 + x] = rounded(acc, round_out)
