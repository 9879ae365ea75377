"""The entries' scans of the input values, and the rescale of an input by a power of two.

:func:`magnitude_bits` gives the bits of an array's largest ``|element|`` by one integer max
reduction, :func:`bits_value` whether it is finite and its value, :func:`count_nonfinite` how many
elements are NaN or infinite (counted only when one is); :func:`scaled` is a float input times
``2**-e``. The entries (:mod:`numbafa.kernels.entry`) call them on float inputs directly and on
bf16 bits through the plugins :func:`largest_of_bits` and :func:`scaled_bits`
(:func:`value_plugins`; :mod:`numbafa.kernels.stored`), compiled only for a call with bf16 inputs.
"""

from __future__ import annotations

import math

import numpy as np
from numba import types

from ..compiler.arrays import bitcast, empty_like
from ..compiler.jit import jit, overload
from ..compiler.linking import unpack
from ..conventions.dtypes import f32_to_bf16_bits, widen

__all__ = ["magnitude_bits", "bits_value", "count_nonfinite", "scaled", "largest_of_bits", "scaled_bits",
           "value_plugins"]


def magnitude_bits(flat):  # pragma: no cover - replaced inside njit code
    """The bits of ``flat``'s largest ``|element|`` as an unsigned int (the bits of magnitudes order
    as their values, so this is one integer max reduction, which vectorises)."""
    raise NotImplementedError


@overload(magnitude_bits)
def _magnitude_bits_overload(flat):
    # Signed views with the sign bit masked off (magnitudes order as non-negative ints), and every
    # value cast back to the element width: Numba compares unsigned ints as 64-bit ones, so a
    # uint32 max loaded 4 elements per instruction (0.14 ns per element on a Xeon with AVX-512),
    # an int32 one 16 (0.037 ns); bf16 bits as int16: 0.14 -> 0.03 ns.
    widths = {types.float32: (np.int32, 0x7FFFFFFF), types.uint16: (np.int16, 0x7FFF),   # uint16: bf16 bits
              types.float64: (np.int64, 0x7FFFFFFFFFFFFFFF)}
    if flat.dtype not in widths:
        return None
    signed, mask = widths[flat.dtype]

    def impl(flat):
        u = bitcast(flat, signed)
        largest = signed(0)
        for i in range(u.size):
            x = signed(u[i] & signed(mask))
            largest = x if x > largest else largest
        return np.uint64(largest)
    return impl


def bits_value(bits, flat):  # pragma: no cover - replaced inside njit code
    """``(finite, value)`` of the largest-magnitude bits that :func:`magnitude_bits` found."""
    raise NotImplementedError


@overload(bits_value)
def _bits_value_overload(bits, flat):
    if flat.dtype == types.float32:
        return lambda bits, flat: (bits < 0x7F800000, np.float64(bitcast(np.uint32(bits), np.float32)))
    if flat.dtype == types.uint16:
        return lambda bits, flat: (bits < 0x7F80, np.float64(widen(np.uint16(bits))))
    if flat.dtype == types.float64:
        return lambda bits, flat: (bits < np.uint64(0x7FF0000000000000), bitcast(np.uint64(bits), np.float64))
    return None


@jit()
def count_nonfinite(flat):
    """How many elements of ``flat`` are NaN or infinite."""
    n = 0
    for i in range(flat.size):
        n += not (abs(np.float64(widen(flat[i]))) < math.inf)
    return n


@jit()
def scaled(x, e):
    """A new array: the float kernel input ``x`` (float32, float64) times ``2**-e``, exact (a power
    of two keeps every mantissa; a value scaled below the normal range is rounded once, as ``ldexp``
    rounds it)."""
    out = empty_like(x)
    src, dst = x.reshape(-1), out.reshape(-1)
    for i in range(src.size):
        dst[i] = math.ldexp(np.float64(src[i]), -e)
    return out


# --- the bf16 bits' scans: plugins ------------------------------------------------------------

@jit()
def largest_of_bits(args, _):
    """``out = (largest |element|, 0)`` of the 1-D bf16 bits ``x``, or ``(-1, how many are NaN or
    infinite)``; ``args`` points to ``(x, out)``."""
    x, out = unpack(args)
    finite, value = bits_value(magnitude_bits(x), x)
    if finite:
        out[0], out[1] = value, 0.0
    else:
        out[0], out[1] = -1.0, np.float64(count_nonfinite(x))


@jit()
def scaled_bits(args, _):
    """``out = x * 2**-e`` on 1-D bf16 bits (:func:`scaled`: exact but for the lowest subnormals,
    rounded to nearest even); ``args`` points to ``(x, out, e)``."""
    x, out, e = unpack(args)
    for i in range(x.size):
        out[i] = f32_to_bf16_bits(np.float32(math.ldexp(np.float64(widen(x[i])), -e)))


def value_plugins() -> list:
    """The bf16 scans and their argument types, for :func:`numbafa.kernels.table.ensure_plugins`."""
    bits = types.Array(types.uint16, 1, "C")
    return [(largest_of_bits, types.Tuple((bits, types.Array(types.float64, 1, "C")))),
            (scaled_bits, types.Tuple((bits, bits, types.int64)))]
