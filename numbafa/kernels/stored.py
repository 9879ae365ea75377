"""The inputs as the work items read them: one type for float32 values and bf16 bits.

The entries (:mod:`numbafa.kernels.entry`) take the caller's arrays: float32, bf16 bits (uint16)
or float64. Below them a pass's 4-D inputs (q, k, v, o, dy) travel as :data:`Stored` records, a
pair of 4-D arrays of which one holds the input and the other is empty, and a flag: the work
items, their loop nests and loads have one type for float32 and bf16 inputs and are compiled
once for both (float64 inputs, float64 arithmetic, apart). What depends on the storage is a
branch on :attr:`Stored.is_bits` per KV section or Q group in the few steps below. Their float32
side is called directly; the bf16 side of the larger ones (the transposed copies, Q's scaled
load, the row sum D) is a *plugin* (:mod:`numbafa.kernels.table`): compiled, or loaded, only
when a call with bf16 inputs registers it (:func:`bits_plugins`), so a float32 process never
compiles bf16 code, and bf16 after float32 compiles only that.

The empty member of a record has size 0 (in Python one shared array per dtype, with zero strides;
in compiled code the input's first two dimensions and zeros after them), so that the head views
taken of both members (``x[b]``, ``x[b, h]``) stay in bounds; nothing reads it.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
from numba import types
from numpy.lib.stride_tricks import as_strided

from ..compiler.arrays import empty
from ..compiler.jit import jit, overload
from ..compiler.linking import unpack
from ..conventions.dtypes import widen
from .bundles import BwdInputs, FwdInputs
from .common import load_scaled
from .heads import NEURON, gather_head, head_rows, load_scaled_rows, shape_dims
from .matmul import any_layout, bits_operand, row_of, values_operand
from .loops import rows_operand
from .table import call_plugin

__all__ = ["Stored", "stored", "stored_fwd", "stored_bwd", "stored_members", "stored_records", "stored_dims", "load_q",
           "gather_input", "input_operand", "input_rows_operand", "bits_plugins"]

Stored = namedtuple("Stored", ["f", "bits", "is_bits"])
Stored.__doc__ = """A 4-D input as the work items read it (module docstring): ``f``, its values in the
accumulator dtype (float32; float64 for float64 inputs), or ``bits``, its bf16 bit patterns (uint16),
both C-contiguous; the member not used is empty. ``is_bits``: which one holds the input."""


def _empty_member(dtype) -> np.ndarray:
    """An empty 4-D member of a record (module docstring): size 0, zero strides, so that every
    head view taken of it (``x[b]``, ``x[b, h]``) is an empty array whatever ``b`` and ``h``.
    One per dtype, shared (nothing writes it; its size is 0)."""
    return as_strided(np.empty((1, 1, 0, 0), dtype=dtype), shape=(2 ** 24, 2 ** 24, 0, 0), strides=(0, 0, 0, 0))


#: The empty members, by dtype character code (float32, float64, uint16).
_EMPTY = {code: _empty_member(code) for code in ("f", "d", "H")}
_new_record = tuple.__new__   # (a record from its three fields, in Stored's order: 0.1 us, not 0.3)


def stored(x, acc):  # pragma: no cover - replaced inside njit code
    """The :data:`Stored` record of the 4-D kernel input ``x`` (float32, float64, or bf16 bits as
    uint16), ``acc`` the accumulator dtype's empty array (``plan.acc``), in compiled code (the
    compiled :func:`stored_fwd` / :func:`stored_bwd`, for :mod:`numbafa.nb`); Python makes its
    records in :func:`stored_fwd` / :func:`stored_bwd` directly, with the shared empty members."""
    raise NotImplementedError("stored is only callable from @njit code")


@overload(stored, inline="always")
def _stored_overload(x, acc):
    if not isinstance(x, types.Array) or x.ndim != 4:
        return None
    if x.dtype == types.uint16:
        def bits(x, acc):
            return Stored(empty((x.shape[0], x.shape[1], 0, 0), acc.dtype), x, True)
        return bits

    def values(x, acc):
        return Stored(x, empty((x.shape[0], x.shape[1], 0, 0), np.uint16), False)
    return values


def stored_members(x, acc) -> tuple:
    """The members :func:`stored_records` gives the records of kernel inputs stored as ``x``
    (float32, float64, or bf16 bits as uint16), ``acc`` the accumulator dtype's empty array: ``(empty
    values, empty bits, is_bits)``."""
    if x.dtype.char == "H":
        return _EMPTY[acc.dtype.char], None, True
    return None, _EMPTY["H"], False


def stored_records(arrays, members) -> list:
    """The :data:`Stored` records of the 4-D kernel inputs ``arrays`` (one storage for all), with
    the :func:`stored_members` of their storage."""
    no_f, no_bits, is_bits = members
    new = _new_record
    if is_bits:
        return [new(Stored, (no_f, x, True)) for x in arrays]
    return [new(Stored, (x, no_bits, False)) for x in arrays]


def stored_fwd(ins, acc):
    """``ins`` (:data:`~numbafa.kernels.bundles.FwdInputs` of arrays) with :data:`Stored` inputs."""
    q, k, v = stored_records((ins.q, ins.k, ins.v), stored_members(ins.q, acc))
    return FwdInputs(q, k, v, ins.sinks)


def stored_bwd(ins, acc):
    """``ins`` (:data:`~numbafa.kernels.bundles.BwdInputs` of arrays) with :data:`Stored` inputs."""
    q, k, v, o, dy = stored_records((ins.q, ins.k, ins.v, ins.o, ins.dy), stored_members(ins.q, acc))
    return BwdInputs(q=q, k=k, v=v, o=o, dy=dy, lse=ins.lse, sinks=ins.sinks)


@overload(stored_fwd, inline="always")
def _stored_fwd_overload(ins, acc):
    return lambda ins, acc: FwdInputs(stored(ins.q, acc), stored(ins.k, acc), stored(ins.v, acc), ins.sinks)


@overload(stored_bwd, inline="always")
def _stored_bwd_overload(ins, acc):
    return lambda ins, acc: BwdInputs(q=stored(ins.q, acc), k=stored(ins.k, acc), v=stored(ins.v, acc),
                                      o=stored(ins.o, acc), dy=stored(ins.dy, acc), lse=ins.lse, sinks=ins.sinks)


@jit()
def stored_dims(x, layout):
    """``(batch, heads, head_dim, seq)`` of a :data:`Stored` input in ``layout``
    (:func:`numbafa.kernels.heads.dims4`)."""
    return shape_dims(x.bits.shape if x.is_bits else x.f.shape, layout)


# --- the bf16 sides: plugins ------------------------------------------------------------------

@jit()
def load_scaled_bits(args, _):
    """:func:`numbafa.kernels.common.load_scaled` of a head's bf16 bits ``(src, start, count, out,
    scale, round_kernel)``."""
    src, start, count, out, scale, round_kernel = unpack(args)
    load_scaled(src, start, count, out, scale, round_kernel)


@jit()
def load_scaled_rows_bits(args, _):
    """:func:`numbafa.kernels.heads.load_scaled_rows` of an s-major head's bf16 bits ``(rows, col0,
    d, start, count, out, scale, round_kernel)``."""
    rows, col0, d, start, count, out, scale, round_kernel = unpack(args)
    load_scaled_rows((rows, col0, d), start, count, out, scale, round_kernel)


@jit()
def gather_bits(args, _):
    """:func:`numbafa.kernels.heads.gather_head` of bf16 bits ``(rows, col0, d, start, count,
    out)`` (a load: not by band)."""
    rows, col0, d, start, count, out = unpack(args)
    gather_head((rows, col0, d), start, count, out, False)


@jit()
def widen_bits(args, _):
    """``out = `` the float32 values of the 2-D bf16 bits ``src`` (any layout), ``(src, out)``."""
    src, out = unpack(args)
    for i in range(src.shape[0]):
        s = row_of(src, i)   # (a contiguous view of the any-layout operand's row: the loop vectorises)
        o = out[i]
        for j in range(src.shape[1]):
            o[j] = widen(s[j])


_U16_2D = types.Array(types.uint16, 2, "C")


def bits_plugins(plan) -> list:
    """The bf16 sides of the loads (``(function, argument types)``) for
    :func:`numbafa.kernels.table.ensure_plugins`: what a call with bf16 inputs needs."""
    acc2 = types.Array(numba.from_dtype(plan.acc.dtype), 2, "C")
    i64 = types.int64
    scale = numba.typeof(plan.softmax_scale)
    code = numba.typeof(plan.precision.round_kernel)
    return [
        (load_scaled_bits, types.Tuple((_U16_2D, i64, i64, acc2, scale, code))),
        (load_scaled_rows_bits, types.Tuple((_U16_2D, i64, i64, i64, i64, acc2, scale, code))),
        (gather_bits, types.Tuple((_U16_2D, i64, i64, i64, i64, _U16_2D))),
        (widen_bits, types.Tuple((types.Array(types.uint16, 2, "A"), acc2))),
    ]


# --- the storage-independent steps --------------------------------------------------------------

@jit(apart=True, refcount=False)
def load_q(x, layout, b, h, start, count, out, scale, round_kernel):
    """Q's rows ``start:start + count`` of head ``(b, h)``, scaled at load into ``out`` ``[d, rows]``
    (:func:`numbafa.kernels.common.load_scaled`, :func:`numbafa.kernels.heads.load_scaled_rows`)."""
    if not x.is_bits:
        if layout == NEURON:
            load_scaled(x.f[b, h], start, count, out, scale, round_kernel)
        else:
            load_scaled_rows(head_rows(x.f, layout, b, h), start, count, out, scale, round_kernel)
    elif layout == NEURON:
        call_plugin(load_scaled_bits, (x.bits[b, h], np.int64(start), np.int64(count), out, scale, round_kernel))
    else:
        rows, col0, d = head_rows(x.bits, layout, b, h)
        call_plugin(load_scaled_rows_bits, (rows, np.int64(col0), np.int64(d), np.int64(start), np.int64(count), out,
                                          scale, round_kernel))


@jit(apart=True, refcount=False)
def gather_input(x, layout, b, h, start, count, out_f, out_bits):
    """Rows ``start:start + count`` of an s-major input's head ``(b, h)`` transposed into
    ``out_f[:, :count]`` (values) or ``out_bits[:, :count]`` (bf16 bits), as the input is stored
    (:func:`numbafa.kernels.heads.gather_head`)."""
    if x.is_bits:
        rows, col0, d = head_rows(x.bits, layout, b, h)
        call_plugin(gather_bits, (rows, np.int64(col0), np.int64(d), np.int64(start), np.int64(count), out_bits))
    else:
        gather_head(head_rows(x.f, layout, b, h), start, count, out_f, False)


@jit(inline=True)
def input_operand(f, bits, is_bits, plan, no_values, no_bits):
    """A 2-D ``[d, seq]`` slice of an input (``f`` or ``bits``, as :data:`Stored`) as a GEMM
    operand: float32 and float64 values, and bf16 bits on the bf16 path (``plan.gemm.bits``), in
    place (a view: no call); bf16 bits on a float32 path widened into a new float32 tile."""
    if not is_bits:
        return values_operand(f, no_bits)
    if plan.gemm.bits:
        return bits_operand(bits, no_values)
    return _widened_operand(any_layout(bits), no_values, no_bits)


@jit(apart=True)
def _widened_operand(bits, no_values, no_bits):
    """The float32 operand of bf16 ``bits`` (any layout): a new tile, filled by the plugin
    :func:`widen_bits`."""
    wide = empty(bits.shape, no_values.dtype)
    call_plugin(widen_bits, (bits, wide))
    return values_operand(wide, no_bits)


@jit(apart=True, refcount=False)
def input_rows_operand(rows, is_bits, op, values_buf, no_values, no_bits, on_bits):
    """The ``[cols, d]`` transpose of ``op`` (an input's ``[d, cols]`` operand) as a GEMM operand
    (:func:`numbafa.kernels.loops.rows_operand`), when ``rows`` is that input's ``[cols, d]`` rows
    (a view of an s-major float input, any row stride): float values are that transpose as they
    lie, so the operand is the view (the same values: the same GEMM, only its ``ld`` differs);
    bf16 bits were widened, so transposed as :func:`~numbafa.kernels.loops.rows_operand` does."""
    if is_bits:
        return rows_operand(op, values_buf, no_values, no_bits, on_bits)
    if on_bits:
        return values_operand(no_values, no_bits)
    return values_operand(any_layout(rows), no_bits)
