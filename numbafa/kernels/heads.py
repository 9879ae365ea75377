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
gives the Neuron layout's bits; no whole-array copy is made. Where a GEMM reads an operand as
``[seq, d]`` rows (the forward's V, the backward's dO for dV), an s-major head's rows are that
operand as they lie: a view, with the input's row stride as the GEMM's ``ld``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np import arrayobj

from ..conventions.dtypes import ROUND_NONE, round_inplace, widen
from ..compiler.arrays import empty
from ..compiler.jit import jit

__all__ = ["NEURON", "BHSD", "BSHD", "LAYOUT_CODES", "shape_dims", "dims4", "head_rows", "head_slice", "gather_head",
           "load_scaled_rows", "store_rows", "store_head_rows", "reduce_partials_rows"]

NEURON, BHSD, BSHD = np.int64(0), np.int64(1), np.int64(2)
#: The plan's layout code of each layout name (:mod:`numbafa.layout`).
LAYOUT_CODES = {"neuron": 0, "bhsd": 1, "bshd": 2}

# Transposes go in 8 x 8 blocks held in vector registers (:func:`_transpose8`).
_BLOCK = 8
# A store into an output's [d, seq] head (gather_head's by_band) walks that side in bands of 8
# rows (all of seq, then the next band), so that only 8 of its rows, often a power-of-two stride
# apart (the same L1 set), are written at a time; block row by block row over all of d, each block
# wrote to all d rows, more than L1's ways: a 512 x 128 float32 store into a [128, 2048] output,
# 8.5 -> 4.5 us (Xeon, an njit loop; no change at a 2112 stride). A load from an s-major input keeps
# the row blocks outside: banded, it read the input's strided rows d / 8 times (bshd forward +
# backward 2-5 % slower).

# The shuffles of an 8 x 8 transpose of eight 8-lane vectors: within 128-bit halves, interleave
# pairs of rows (unpack lo/hi), then pairs of pairs (shuffle 0x44/0xEE), then swap halves
# (permute 0x20/0x31); LLVM lowers them to the target's shuffles (AVX2, AVX-512 or SSE pairs).
_UNPACK = ((0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15))
_PAIRS = ((0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))
_HALVES = ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))


def _element_pointer(context, builder, array_type, array, row, col):
    a = arrayobj.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer2(context, builder, a.data, cgutils.unpack_tuple(builder, a.shape),
                                     cgutils.unpack_tuple(builder, a.strides), array_type.layout, [row, col])


@intrinsic
def _transpose8(typingctx, src, r0, c0, dst, o0, i0):
    """``dst[o0 + j, i0 + i] = src[r0 + i, c0 + j]`` for ``i, j < 8`` (2-D arrays whose rows hold
    the 8 elements contiguously): eight vector loads, 24 shuffles, eight vector stores. ``src``
    and ``dst`` of one dtype, or bf16 bits (uint16) into float32 (widened as :func:`widen` does)."""
    same = isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype
    bits = (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == types.uint16
            and dst.dtype == types.float32)
    if not ((same or bits) and src.ndim == 2 and dst.ndim == 2
            and all(isinstance(x, types.Integer) for x in (r0, c0, o0, i0))):
        return None

    def codegen(context, builder, signature, args):
        s_ty, _, _, d_ty, _, _ = signature.args
        src_v, row0, col0, dst_v, out0, in0 = (
            context.cast(builder, value, ty, types.intp) if isinstance(ty, types.Integer) else value
            for value, ty in zip(args, signature.args))
        intp = context.get_value_type(types.intp)
        lanes = ir.VectorType(context.get_data_type(s_ty.dtype), 8)
        rows = []
        for i in range(8):
            ptr = _element_pointer(context, builder, s_ty, src_v, builder.add(row0, intp(i)), col0)
            rows.append(builder.load(builder.bitcast(ptr, lanes.as_pointer()), align=1))
        if bits:   # bf16 bits -> float32: the bits in the upper half
            i32 = ir.VectorType(ir.IntType(32), 8)
            shift = ir.Constant(i32, [16] * 8)
            rows = [builder.bitcast(builder.shl(builder.zext(r, i32), shift), ir.VectorType(ir.FloatType(), 8))
                    for r in rows]

        def shuffle(a, b, mask):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), list(mask)))
        t = [shuffle(rows[k], rows[k + 1], m) for k in range(0, 8, 2) for m in _UNPACK]
        u = [shuffle(t[k], t[k + 2], m) for k in (0, 1, 4, 5) for m in _PAIRS]
        out = [shuffle(u[k], u[k + 4], m) for m in _HALVES for k in range(4)]
        store_lanes = out[0].type
        for j in range(8):
            ptr = _element_pointer(context, builder, d_ty, dst_v, builder.add(out0, intp(j)), in0)
            builder.store(out[j], builder.bitcast(ptr, store_lanes.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(src, r0, c0, dst, o0, i0), codegen


@jit()
def shape_dims(s, layout):
    """``(batch, heads, head_dim, seq)`` of a 4-D kernel array's shape ``s`` in ``layout``."""
    if layout == BSHD:
        return s[0], s[2], s[3], s[1]
    if layout == BHSD:
        return s[0], s[1], s[3], s[2]
    return s[0], s[1], s[2], s[3]


@jit()
def dims4(x, layout):
    """``(batch, heads, head_dim, seq)`` of a 4-D kernel array in ``layout``."""
    return shape_dims(x.shape, layout)


@jit(inline=True)
def head_rows(x, layout, b, h):
    """Head ``(b, h)`` of an s-major array as ``(rows, col0, d)``: element ``[s, j]`` of the head
    is ``rows[s, col0 + j]``, ``rows`` a C-contiguous 2-D view (bhsd: the head itself; bshd: the
    batch's ``[seq, heads * d]``), so the transposes below index C arrays with fixed-size
    blocks, which LLVM turns into vector shuffles."""
    if layout == BSHD:
        d = x.shape[3]
        return x[b].reshape((x.shape[1], x.shape[2] * d)), h * d, d
    return x[b, h], 0, x.shape[3]


@jit(inline=True)
def head_slice(head, start, count):
    """Rows ``start:start + count`` of the s-major ``head`` (:func:`head_rows`) as a ``[count, d]``
    view (its row stride the input's): a GEMM operand read as it lies."""
    rows, col0, d = head
    return rows[start:start + count, col0:col0 + d]


@jit(apart=True, refcount=False, any_layout=True)   # (its rows and out come C-contiguous or as slices)
def gather_head(head, start, count, out, by_band):
    """``out[:, :count]`` = rows ``start:start + count`` of the s-major ``head`` (:func:`head_rows`),
    transposed to ``[d, count]``, elements as they are (bf16 bits stay bits). ``by_band``: ``out``
    is a whole output array's ``[d, seq]`` head (a store), walked band by band (``_BLOCK``'s
    comment); otherwise ``head`` is the large array (a load), read 8 rows at a time."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    if by_band:
        for j0 in range(0, full_j, b):
            for i0 in range(0, full_i, b):
                _transpose8(rows, start + i0, col0 + j0, out, j0, i0)
        for j in range(full_j, d):
            for i in range(full_i):
                out[j, i] = rows[start + i, col0 + j]
    else:
        for i0 in range(0, full_i, b):
            for j0 in range(0, full_j, b):
                _transpose8(rows, start + i0, col0 + j0, out, j0, i0)
            for j in range(full_j, d):
                for i in range(i0, i0 + b):
                    out[j, i] = rows[start + i, col0 + j]
    for i in range(full_i, count):
        for j in range(d):
            out[j, i] = rows[start + i, col0 + j]


@jit(apart=True, refcount=False)
def load_scaled_rows(head, start, count, out, scale, round_kernel):
    """:func:`numbafa.kernels.common.load_scaled` of an s-major head: ``out[:, :count]`` the
    transposed rows, widened to float, times ``scale`` and rounded (``scale == 1``: an exact copy)."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    for i0 in range(0, full_i, b):
        for j0 in range(0, full_j, b):
            _transpose8(rows, start + i0, col0 + j0, out, j0, i0)
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


@jit(apart=True, refcount=False)
def store_rows(src, count, head, start, round_out):
    """Rows ``start:start + count`` of the s-major ``head`` = ``src[:count]`` (``[seq, d]``
    accumulators: no transpose), rounded to the format ``round_out`` names."""
    rows, col0, d = head
    for i in range(count):
        dst = rows[start + i, col0:col0 + d]
        s_row = src[i]
        for j in range(d):
            dst[j] = s_row[j]
        if round_out != ROUND_NONE:   # (a call per row otherwise: 2 % of a float32 bshd backward)
            round_inplace(dst, round_out)


@jit(apart=True, refcount=False)
def store_head_rows(src, count, head, start, round_out):
    """Rows ``start:start + count`` of the s-major ``head`` = ``src[:, :count]`` transposed (a
    ``[d, count]`` tile, dQ), rounded to the format ``round_out`` names."""
    rows, col0, d = head
    b = _BLOCK
    full_i = count - count % b
    full_j = d - d % b
    for i0 in range(0, full_i, b):
        for j0 in range(0, full_j, b):
            _transpose8(src, j0, i0, rows, start + i0, col0 + j0)
        for i in range(i0, i0 + b):
            for j in range(full_j, d):
                rows[start + i, col0 + j] = src[j, i]
    for i in range(full_i, count):
        for j in range(d):
            rows[start + i, col0 + j] = src[j, i]
    if round_out != ROUND_NONE:
        for i in range(count):
            round_inplace(rows[start + i, col0:col0 + d], round_out)


@jit()
def reduce_partials_rows(head, parts, round_out):
    """A split unit's dK (or dV) of an s-major head: ``[k, d] = round([k, d] + parts[0][d, k] +
    parts[1][d, k] + ...)``, in that order (the Neuron layout's sum). Eight keys at a time: each
    part's ``[d, 8]`` columns transposed in 8 x 8 blocks (:func:`_transpose8`) into a ``[8, d]``
    band, added to the eight rows, then the rows rounded."""
    rows, col0, d = head
    n = rows.shape[0]
    b = _BLOCK
    full_k = n - n % b
    full_x = d - d % b
    band = empty((b, d), parts.dtype)
    for k0 in range(0, full_k, b):
        for c in range(parts.shape[0]):
            part = parts[c]
            for x0 in range(0, full_x, b):
                _transpose8(part, x0, k0, band, 0, x0)
            for x in range(full_x, d):
                for kk in range(b):
                    band[kk, x] = part[x, k0 + kk]
            for kk in range(b):
                row = rows[k0 + kk, col0:col0 + d]
                add = band[kk]
                for x in range(d):
                    row[x] += add[x]
        for kk in range(b):
            round_inplace(rows[k0 + kk, col0:col0 + d], round_out)
    for k in range(full_k, n):
        row = rows[k, col0:col0 + d]
        for c in range(parts.shape[0]):
            part = parts[c]
            for x in range(d):
                row[x] += part[x, k]
        round_inplace(row, round_out)
