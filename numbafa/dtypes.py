"""bf16 <-> float32 conversion and rounding, usable inside ``@njit`` code.

NumPy has no bf16; numbafa takes ``ml_dtypes.bfloat16`` arrays at the API and
hands the kernels their ``uint16`` bit patterns. Inside the kernels every
bf16-valued quantity lives in a float32 buffer holding an exactly
representable bf16 value, so a float32 BLAS ``sgemm`` of two such buffers is
exactly "bf16 products, fp32 accumulation" (a bf16 x bf16 product has at most
16 significant bits and is exact in float32).

Rounding float32 -> bf16 is round-to-nearest-even on the bit pattern, the
same rule as ``ml_dtypes`` (NaN stays NaN and becomes quiet, +-inf stay
+-inf, finite values above the bf16 range round to +-inf).

``ml_dtypes`` is imported only when a bf16 array is made here (its import
takes about a second on the project's machine). Recognising one needs no
import: an array can only have the bf16 dtype if ``ml_dtypes`` is loaded.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic, overload

from .jit import jit

__all__ = [
    "bf16_dtype",
    "is_bf16",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "round_to_bf16",
    "round_to_bf16_inplace",
    "round_to_fp16",
    "round_to_fp16_bits",
    "round_to_fp16_inplace",
    "round_to_kernel_dtype",
    "round_inplace_if",
    "widen",
    "widened",
    "to_bf16_array",
    "from_bf16_array",
    "to_fp16_array",
    "from_fp16_array",
    "as_operand",
    "narrowed",
    "accumulator_dtype",
]

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def accumulator_dtype(dtype) -> np.dtype:
    """The dtype the kernels compute, accumulate and return lse in for inputs of ``dtype`` (a NumPy
    dtype): float64 for float64, else float32 (bf16, float16 and float32 inputs). The dtype's
    one-letter code is the cheap test (``==`` with a type costs ~1 us; byte orders other than the
    native one are refused by the validation)."""
    return _F64 if dtype.char == "d" else _F32


def bf16_dtype() -> np.dtype:
    """The NumPy dtype of bf16 arrays at the API, ``ml_dtypes.bfloat16`` (imported here)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def is_bf16(dtype) -> bool:
    """True if ``dtype`` is ``ml_dtypes.bfloat16`` (never imports ``ml_dtypes``)."""
    module = sys.modules.get("ml_dtypes")
    try:
        return module is not None and np.dtype(dtype) == np.dtype(module.bfloat16)
    except TypeError:  # not a NumPy dtype (a framework's dtype name)
        return False


@jit()
def bf16_bits_to_f32(bits):
    """Widen one bf16 bit pattern (uint16) to its exact float32 value."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@jit()
def _rounded_bits(u):
    """The float32 bits ``u`` rounded to bf16 (nearest, ties to even), low half zero.

    Selects only, no branch, so that loops over it vectorise: NaN keeps its
    sign and becomes quiet; every other value rounds on its bit pattern.
    """
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    quiet = (u | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
    return quiet if nan else rounded


@jit()
def f32_to_bf16_bits(x):
    """Round one float32 to bf16 (nearest, ties to even); return the uint16 bits."""
    return np.uint16(_rounded_bits(np.float32(x).view(np.uint32)) >> np.uint32(16))


@jit()
def round_to_bf16(x):
    """Round one float32 to the nearest bf16 value, returned as float32."""
    return np.uint32(_rounded_bits(np.float32(x).view(np.uint32))).view(np.float32)


@jit()
def round_to_bf16_inplace(buf):
    """Round every element of a contiguous 1-D float32 array to bf16, in place.

    The same rule as :func:`f32_to_bf16_bits` (:func:`_rounded_bits`), on the uint32 view.
    """
    u = buf.view(np.uint32)
    for i in range(u.size):
        u[i] = _rounded_bits(u[i])


_F16_SUBNORMAL_SCALE = np.float32(2.0 ** 24)
_F16_SUBNORMAL_STEP = np.float32(2.0 ** -24)
_F16_MIN_NORMAL_BITS = np.uint32(0x38800000)   # 2**-14
_F16_MAX_BITS = np.uint32(0x477FE000)          # 65504
_F32_INF_BITS = np.uint32(0x7F800000)


def _has_f16c() -> bool:
    """Whether the code Numba generates here may use the F16C conversions: the host's LLVM
    features, or those the user set for Numba (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``)."""
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return "+f16c" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding
    return bool(binding.get_host_cpu_features().get("f16c"))


#: Frozen into the compiled code (Numba's disk cache is per CPU and its features).
_F16C = _has_f16c()


@intrinsic
def _fp16_round_trip(typingctx, x):
    """``float(half(x))``: LLVM's ``fptrunc`` to half (round to nearest even, fp16's subnormals
    and range) and ``fpext`` back, which F16C does in one vector instruction each
    (``vcvtps2ph``/``vcvtph2ps``, 8 lanes)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.float32), codegen


@jit(inline=True)
def _round_to_fp16_f16c(x):
    """Round one float32 to the nearest float16 value (ties to even), returned as float32, by
    F16C's conversions (every AVX2 CPU has them)."""
    return _fp16_round_trip(np.float32(x))


@jit()
def round_to_fp16_bits(x):
    """Round one float32 to the nearest float16 value (ties to even), returned as float32, on the
    bit pattern (CPUs without F16C).

    fp16's range and subnormals: below ``2**-14`` the values are multiples of
    ``2**-24`` (``rint(x * 2**24) * 2**-24``, exact in float32); above, the
    mantissa is rounded to 10 bits on the bit pattern as for bf16; beyond
    65504 (from 65520 on) the result is ``+-inf``; inf and NaN stay. The same
    rule as NumPy's float32 -> float16 cast. Selects only, no branch, so that
    loops over it vectorise (2.5x the time of the bf16 rounding; F16C's: 0.5x).
    """
    x = np.float32(x)
    u = x.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    rounded = (a + np.uint32(0x0FFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    rounded = _F32_INF_BITS if rounded > _F16_MAX_BITS else rounded
    normal = (u & np.uint32(0x80000000)) | rounded
    subnormal = np.float32(np.float32(np.rint(x * _F16_SUBNORMAL_SCALE)) * _F16_SUBNORMAL_STEP).view(np.uint32)
    bits = subnormal if a < _F16_MIN_NORMAL_BITS else normal
    bits = u if a >= _F32_INF_BITS else bits
    return np.uint32(bits).view(np.float32)


#: Round one float32 to the nearest float16 value (ties to even), returned as float32: F16C's
#: conversions where the CPU has them, else :func:`round_to_fp16_bits`; the same bits either way
#: (``tests/test_float16.py`` checks both at every rounding boundary). Chosen here, once, so that
#: the compiled kernels hold only the one they use.
round_to_fp16 = _round_to_fp16_f16c if _F16C else round_to_fp16_bits


@jit()
def round_to_fp16_inplace(buf):
    """Round every element of a contiguous 1-D float32 array to fp16 (:func:`round_to_fp16`), in place."""
    for i in range(buf.size):
        buf[i] = round_to_fp16(buf[i])


def round_to_kernel_dtype(x, flag):  # pragma: no cover - replaced by the overload inside njit code
    """Round one float32 to the kernel dtype that the *type* of the rounding ``flag`` names: a
    bool flag (bf16 inputs) rounds to bf16, a uint8 flag (fp16 inputs) to fp16
    (:class:`numbafa.kernels.bundles.Precision`). The flag's value is not read."""
    raise NotImplementedError("round_to_kernel_dtype is only callable from @njit code")


@overload(round_to_kernel_dtype)
def _round_to_kernel_dtype_overload(x, flag):
    if isinstance(flag, types.Boolean):
        return lambda x, flag: round_to_bf16(x)
    if isinstance(flag, types.Integer):
        return lambda x, flag: round_to_fp16(x)
    return None


def round_inplace_if(buf, flag):  # pragma: no cover - replaced by the overload inside njit code
    """If ``flag``, round a contiguous 1-D float32 array in place to the kernel dtype the flag's
    type names (as :func:`round_to_kernel_dtype`)."""
    raise NotImplementedError("round_inplace_if is only callable from @njit code")


@overload(round_inplace_if)
def _round_inplace_if_overload(buf, flag):
    if isinstance(flag, types.Boolean):
        def bf16(buf, flag):
            if flag:
                round_to_bf16_inplace(buf)
        return bf16
    if isinstance(flag, types.Integer):
        def fp16(buf, flag):
            if flag:
                round_to_fp16_inplace(buf)
        return fp16
    return None


def widen(x):  # pragma: no cover - replaced by the overload inside njit code
    """Element as a float: identity for float32 and float64, bf16 widening (to float32) for uint16 bits."""
    raise NotImplementedError("widen is only callable from @njit code")


@overload(widen)
def _widen_overload(x):
    if x == types.uint16:
        return lambda x: bf16_bits_to_f32(x)
    if x in (types.float32, types.float64):
        return lambda x: x
    return None


def widened(x):  # pragma: no cover - replaced by the overload inside njit code
    """A 2-D array as a float array: ``x`` itself if float32 or float64, a widened float32 copy of
    uint16 bf16 bits."""
    raise NotImplementedError("widened is only callable from @njit code")


@overload(widened)
def _widened_overload(x):
    if not isinstance(x, types.Array) or x.ndim != 2:
        return None
    if x.dtype in (types.float32, types.float64):
        return lambda x: x

    if x.dtype == types.uint16:
        def impl(x):
            out = np.empty(x.shape, dtype=np.float32)
            for i in range(x.shape[0]):
                src = x[i]
                dst = out[i]
                for j in range(x.shape[1]):
                    dst[j] = bf16_bits_to_f32(src[j])
            return out
        return impl
    return None


def _converted(x):  # pragma: no cover - replaced by the overload inside njit code
    """One element across the bf16 boundary: float32 -> its RNE bf16 bits, bf16 bits -> float32."""
    raise NotImplementedError("_converted is only callable from @njit code")


@overload(_converted)
def _converted_overload(x):
    convert = {types.float32: f32_to_bf16_bits, types.uint16: bf16_bits_to_f32}.get(x)
    return None if convert is None else (lambda x: convert(x))


@jit(entry=True)
def _convert_array(src, dst):
    """``dst[i] = _converted(src[i])`` over two C-contiguous arrays of one size."""
    s = src.reshape(-1)
    d = dst.reshape(-1)
    for i in range(s.size):
        d[i] = _converted(s[i])


def from_bf16_array(x: np.ndarray) -> np.ndarray:
    """Widen a ``ml_dtypes.bfloat16`` array to a new float32 array, bit-exactly (NaN payloads kept)."""
    bits = np.ascontiguousarray(x).view(np.uint16)
    out = np.empty(bits.shape, dtype=np.float32)
    _convert_array(bits, out)
    return out


def to_bf16_array(x: np.ndarray) -> np.ndarray:
    """Round a float32 array to a new ``ml_dtypes.bfloat16`` array (RNE)."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    bits = np.empty(src.shape, dtype=np.uint16)
    _convert_array(src, bits)
    return bits.view(bf16_dtype())


@intrinsic
def _fp16_bits_to_f32(typingctx, bits):
    """The float32 value of fp16 bits (uint16): LLVM's ``fpext`` of the half (F16C: ``vcvtph2ps``)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_fp16_bits(typingctx, x):
    """The fp16 bits (uint16) of a float32 rounded to fp16: LLVM's ``fptrunc`` (F16C: ``vcvtps2ph``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@jit(entry=True)
def _widen_fp16(bits, out):
    for i in range(bits.size):
        out[i] = _fp16_bits_to_f32(bits[i])


@jit(entry=True)
def _narrow_fp16(x, bits):
    for i in range(x.size):
        bits[i] = _f32_to_fp16_bits(x[i])


def from_fp16_array(x: np.ndarray) -> np.ndarray:
    """A float16 array as a new C-contiguous float32 array (exact); by F16C's vector conversion
    where the CPU has it (5-10x NumPy's cast), else NumPy's."""
    if not _F16C:
        return np.array(x, dtype=np.float32, order="C")
    bits = np.ascontiguousarray(x).view(np.uint16)
    out = np.empty(bits.shape, dtype=np.float32)
    _widen_fp16(bits.reshape(-1), out.reshape(-1))
    return out


def to_fp16_array(x: np.ndarray) -> np.ndarray:
    """A float32 array rounded to a new float16 array (nearest even; exact for fp16 values), as
    :func:`from_fp16_array`, by F16C where the CPU has it."""
    if not _F16C:
        return np.asarray(x).astype(np.float16)
    src = np.ascontiguousarray(x, dtype=np.float32)
    bits = np.empty(src.shape, dtype=np.uint16)
    _narrow_fp16(src.reshape(-1), bits.reshape(-1))
    return bits.view(np.float16)


def as_operand(x, operand):  # pragma: no cover - replaced by the overload inside njit code
    """An input tile as a GEMM operand of the path ``operand`` marks (its dtype):
    float32 -> :func:`widened`; uint16 (bf16 bits, the oneDNN path) and float64 -> ``x`` itself."""
    raise NotImplementedError("as_operand is only callable from @njit code")


@overload(as_operand)
def _as_operand_overload(x, operand):
    if not isinstance(x, types.Array) or not isinstance(operand, types.Array):
        return None
    if operand.dtype == types.float32:
        return lambda x, operand: widened(x)
    if operand.dtype in (types.uint16, types.float64) and x.dtype == operand.dtype:
        return lambda x, operand: x
    return None


def narrowed(t, buf, operand):  # pragma: no cover - replaced by the overload inside njit code
    """A bf16-valued float32 2-D tile as a GEMM operand of the path ``operand`` marks:
    float32 and float64 -> ``t`` itself; uint16 -> its bf16 bits written into the flat uint16 scratch
    ``buf`` (exact: every value is a bf16 value), returned as a ``t``-shaped view of it."""
    raise NotImplementedError("narrowed is only callable from @njit code")


@overload(narrowed)
def _narrowed_overload(t, buf, operand):
    if not isinstance(operand, types.Array) or not isinstance(t, types.Array) or t.ndim != 2:
        return None
    if operand.dtype in (types.float32, types.float64):
        return lambda t, buf, operand: t
    if operand.dtype == types.uint16:
        def impl(t, buf, operand):
            rows, cols = t.shape
            out = buf[:rows * cols].reshape(rows, cols)
            for i in range(rows):
                src = t[i]
                dst = out[i]
                for j in range(cols):
                    dst[j] = np.uint16(np.float32(src[j]).view(np.uint32) >> np.uint32(16))
            return out
        return impl
    return None

