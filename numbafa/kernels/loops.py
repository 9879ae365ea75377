"""Loop scaffolding shared by the forward and the backward kernels.

Both kernels run over *work items* (the launchers' ``prange``): the upstream kernel's work
units (one per ``(batch, KV head)``, ``flash_attn_bwd`` lines 1134-1143),
each split into ``q_chunks`` items when there are few units
(:func:`numbafa.kernels.schedule.q_chunks`). Within an item, the q-heads of the GQA
group share the unit's K and V, and each q-head's queries run in Q groups of
``tiling.group_rows`` rows (``q_tile_group`` tiles of ``q_tile`` rows; fewer in a split short
forward); an item owns every ``q_chunks``-th group in zigzag order.
"""

from __future__ import annotations

import numpy as np

from ..compiler.jit import jit
from ..compiler.arrays import bitcast
from ..compiler.scalars import min_
from .heads import gather_head
from .matmul import Operand, bits_operand, row_of, values_operand

__all__ = ["decode_item", "n_q_groups", "owns_group", "group_rows", "tile_operand", "rows_operand", "width",
           "columns", "row_slice"]


@jit()
def decode_item(item, q_chunks, nheads_kv):
    """``(unit, chunk, batch, kv_head)`` of a work item."""
    unit = item // q_chunks
    chunk = item % q_chunks
    return unit, chunk, unit // nheads_kv, unit % nheads_kv


@jit()
def n_q_groups(seqlen_q, tiling):
    """Number of Q groups (``tiling.group_rows`` rows each) over ``seqlen_q`` rows."""
    rows = tiling.group_rows
    return (seqlen_q + rows - 1) // rows


@jit()
def owns_group(i_group, n_groups, chunk, q_chunks):
    """True if item ``chunk`` of a unit owns Q group ``i_group``.

    Zigzag ownership: groups ``g`` and ``n - 1 - g`` go to the same item, so
    under a causal mask (later groups see more keys) every item gets the
    same amount of work.
    """
    return min_(i_group, n_groups - 1 - i_group) % q_chunks == chunk


@jit()
def group_rows(i_group, seqlen_q, tiling):
    """``(first row, number of rows)`` of Q group ``i_group`` (the last group may be short)."""
    size = tiling.group_rows
    start = i_group * size
    return start, min_(size, seqlen_q - start)


# --- GEMM operands (numbafa.kernels.matmul.Operand) ----------------------------------------

@jit(apart=True, refcount=False)
def tile_operand(t, bits_buf, no_values, no_bits, bits):
    """A tile computed in float32 (2-D, values of the kernel dtype) as a GEMM operand: itself, or
    with ``bits`` (the bf16 path) its bf16 bits written into the flat uint16 scratch ``bits_buf``
    (exact: every value is a bf16 value) and viewed in its shape."""
    if not bits:
        return values_operand(t, no_bits)
    rows, cols = t.shape
    out = bits_buf[:rows * cols].reshape(rows, cols)
    for i in range(rows):
        bits_of_row(row_of(t, i), out[i])   # (a typed-contiguous row: the loop vectorises)
    return bits_operand(out, no_values)


@jit()
def bits_of_row(src, dst):
    """``dst[j]`` = the bf16 bits of ``src[j]``, a float32 holding a bf16 value (exact)."""
    for j in range(src.size):
        dst[j] = np.uint16(bitcast(np.float32(src[j]), np.uint32) >> np.uint32(16))


@jit(apart=True, refcount=False)
def rows_operand(op, values_buf, no_values, no_bits, bits):
    """The transpose ``[cols, d]`` of a ``[d, cols]`` float operand, in the flat scratch
    ``values_buf`` (accumulator dtype): the B operand of a GEMM that then reads it as it lies
    (NN: in float32 faster than reading ``[d, cols]`` transposed). On the bf16 path (``bits``),
    where the bf16 GEMM runs as fast either way, an empty operand: the transposed one is read."""
    if bits:
        return values_operand(no_values, no_bits)
    d, n = op.f.shape
    out = values_buf[:n * d].reshape(n, d)
    gather_head((op.f, 0, n), 0, d, out, False)
    return values_operand(out, no_bits)


@jit()
def width(op, bits):
    """The number of columns of an operand (of the member the path reads)."""
    return op.bits.shape[1] if bits else op.f.shape[1]


@jit(inline=True)
def row_slice(op, r0, r1):
    """Rows ``r0:r1`` of both members of an operand (a ``[seq, d]`` one; the empty one stays empty)."""
    return Operand(op.f[r0:r1], op.bits[r0:r1])


@jit(inline=True)
def columns(op, c0, c1):
    """Columns ``c0:c1`` of both members of an operand (the empty one stays empty)."""
    return Operand(op.f[:, c0:c1], op.bits[:, c0:c1])
