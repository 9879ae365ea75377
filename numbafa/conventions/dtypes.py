"""bf16 and fp16 <-> float32 conversion and rounding, usable inside ``@njit`` code.

NumPy has no bf16; numbafa takes ``ml_dtypes.bfloat16`` arrays at the API and
hands the kernels their ``uint16`` bit patterns. Inside the kernels every
bf16-valued quantity lives in a float32 buffer holding an exactly
representable bf16 value, so a float32 BLAS ``sgemm`` of two such buffers is
exactly "bf16 products, fp32 accumulation" (a bf16 x bf16 product has at most
16 significant bits and is exact in float32).

Rounding float32 -> bf16 is round-to-nearest-even on the bit pattern, the
same rule as ``ml_dtypes`` (NaN stays NaN and becomes quiet, +-inf stay
+-inf, finite values above the bf16 range round to +-inf).

Inside the kernels the format a tile is rounded to is a *value*, a code
(:data:`ROUND_NONE`, :data:`ROUND_BF16`, :data:`ROUND_FP16`), not a type:
one compiled kernel serves float32, bf16 and float16 inputs (the rounding
leaves are LLVM intrinsics, :func:`rounded` and :func:`widen`, so they cost
no compile unit of their own).

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
from numba.extending import intrinsic

from ..compiler.arrays import bitcast
from ..compiler.jit import jit, overload

__all__ = [
    "fp16_bits_to_f32",
    "f32_to_fp16_bits",
    "ROUND_NONE",
    "ROUND_BF16",
    "ROUND_FP16",
    "bf16_dtype",
    "is_bf16",
    "rounded",
    "widen",
    "round_inplace",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "round_to_bf16",
    "round_to_fp16",
    "round_to_fp16_bits",
    "to_bf16_array",
    "from_bf16_array",
    "to_fp16_array",
    "from_fp16_array",
    "accumulator_dtype",
    "UINT16",
]

_F32_DTYPE, _F64_DTYPE = np.dtype(np.float32), np.dtype(np.float64)


def accumulator_dtype(dtype) -> np.dtype:
    """The dtype the kernels compute, accumulate and return lse in for inputs of ``dtype`` (a NumPy
    dtype): float64 for float64, else float32 (bf16, float16 and float32 inputs). The dtype's
    one-letter code is the cheap test (``==`` with a type costs ~1 us; byte orders other than the
    native one are refused by the validation)."""
    return _F64_DTYPE if dtype.char == "d" else _F32_DTYPE


#: The dtype of bf16 and fp16 bits, made once (``np.dtype(np.uint16)`` costs a remembered call
#: ~0.2 us each time).
UINT16 = np.dtype(np.uint16)


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


#: The rounding formats of the kernels' written tiles, as values (:class:`numbafa.kernels.bundles.Precision`):
#: none (float32 and float64 inputs), bf16, fp16.
#: (NumPy ints: a Python int constant passed to a jitted function would be a literal, and
#: Numba would compile the callee once per value.)
ROUND_NONE, ROUND_BF16, ROUND_FP16 = np.int64(0), np.int64(1), np.int64(2)

_F16_MIN_NORMAL_BITS = 0x38800000   # 2**-14
_F16_MAX_BITS = 0x477FE000          # 65504
_F32_INF_BITS = 0x7F800000


def _has_f16c() -> bool:
    """Whether the code Numba generates here may use the F16C conversions: the host's LLVM
    features, or those the user set for Numba (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``)."""
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return "+f16c" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding
    return bool(binding.get_host_cpu_features().get("f16c"))


#: Frozen into the compiled code (Numba's disk cache is per CPU and its features).
_F16C = _has_f16c()

_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _ir_bf16(builder, x):
    """LLVM IR: float32 ``x`` rounded to bf16 (nearest, ties to even), as float32. On the bit
    pattern, selects only: NaN keeps its sign and becomes quiet; every other value rounds."""
    u = builder.bitcast(x, _I32)
    nan = builder.icmp_unsigned(">", builder.and_(u, _I32(0x7FFFFFFF)), _I32(0x7F800000))
    lsb = builder.and_(builder.lshr(u, _I32(16)), _I32(1))
    rounded_bits = builder.and_(builder.add(builder.add(u, _I32(0x7FFF)), lsb), _I32(0xFFFF0000))
    quiet = builder.and_(builder.or_(u, _I32(0x00400000)), _I32(0xFFFF0000))
    return builder.bitcast(builder.select(nan, quiet, rounded_bits), _F32)


def _ir_fp16(builder, x, f16c=None):
    """LLVM IR: float32 ``x`` rounded to float16 (nearest, ties to even; fp16's range and
    subnormals; from 65520 on, +-inf), as float32: F16C's conversions (``fptrunc``/``fpext``,
    one vector instruction each) where the CPU has them, else on the bit pattern (below
    ``2**-14`` multiples of ``2**-24``: ``rint(x * 2**24) * 2**-24``, exact in float32; above,
    the mantissa rounded to 10 bits), selects only. NumPy's float32 -> float16 rule."""
    if _F16C if f16c is None else f16c:
        return builder.fpext(builder.fptrunc(x, ir.HalfType()), _F32)
    u = builder.bitcast(x, _I32)
    a = builder.and_(u, _I32(0x7FFFFFFF))
    lsb = builder.and_(builder.lshr(a, _I32(13)), _I32(1))
    bits = builder.and_(builder.add(builder.add(a, _I32(0x0FFF)), lsb), _I32(0xFFFFE000))
    bits = builder.select(builder.icmp_unsigned(">", bits, _I32(_F16_MAX_BITS)), _I32(_F32_INF_BITS), bits)
    normal = builder.or_(builder.and_(u, _I32(0x80000000)), bits)
    rint = builder.module.declare_intrinsic("llvm.rint", [_F32])
    scaled = builder.call(rint, [builder.fmul(x, _F32(2.0 ** 24))])
    subnormal = builder.bitcast(builder.fmul(scaled, _F32(2.0 ** -24)), _I32)
    bits = builder.select(builder.icmp_unsigned("<", a, _I32(_F16_MIN_NORMAL_BITS)), subnormal, normal)
    bits = builder.select(builder.icmp_unsigned(">=", a, _I32(_F32_INF_BITS)), u, bits)
    return builder.bitcast(bits, _F32)


@intrinsic
def rounded(typingctx, x, code):
    """``rounded(x, code)``: float32 ``x`` rounded to the format ``code`` names
    (:data:`ROUND_BF16`, :data:`ROUND_FP16`; :data:`ROUND_NONE`: ``x`` itself). The code is a
    runtime value: LLVM splits a loop whose code does not change into one loop per format (or
    computes the roundings and selects), so one compiled kernel serves every format. float64
    values (the float64 kernels round nothing) come back unchanged."""
    if not isinstance(code, types.Integer) or x not in (types.float32, types.float64):
        return None

    def codegen(context, builder, sig, args):
        value, fmt = args
        if sig.args[0] == types.float64:
            return value
        i64 = ir.IntType(64)
        fmt = builder.sext(fmt, i64) if fmt.type.width < 64 else fmt
        entry = builder.block
        bf16_block = builder.append_basic_block("round_bf16")
        fp16_block = builder.append_basic_block("round_fp16")
        done = builder.append_basic_block("rounded")
        switch = builder.switch(fmt, done)
        switch.add_case(i64(ROUND_BF16), bf16_block)
        switch.add_case(i64(ROUND_FP16), fp16_block)
        builder.position_at_end(bf16_block)
        as_bf16 = _ir_bf16(builder, value)
        builder.branch(done)
        builder.position_at_end(fp16_block)
        as_fp16 = _ir_fp16(builder, value)
        builder.branch(done)
        builder.position_at_end(done)
        phi = builder.phi(_F32)
        phi.add_incoming(value, entry)
        phi.add_incoming(as_bf16, bf16_block)
        phi.add_incoming(as_fp16, fp16_block)
        return phi

    return x(x, code), codegen


@intrinsic
def widen(typingctx, x):
    """``widen(x)``: one input element as a float: bf16 bits (uint16) -> their exact float32 value
    (the bits in the upper half); float32 and float64 unchanged."""
    if x == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _I32(16)), _F32)
        return types.float32(x), codegen
    if x in (types.float32, types.float64):
        return x(x), lambda context, builder, sig, args: args[0]
    return None


@intrinsic
def _fp16_on_the_bits(typingctx, x):
    """:func:`rounded` to fp16 by the bit-pattern rule, whatever the CPU."""
    if x != types.float32:
        return None
    return types.float32(x), lambda context, builder, sig, args: _ir_fp16(builder, args[0], f16c=False)


@jit()
def round_inplace(buf, code):
    """Round every element of a contiguous 1-D float32 array in place to the format ``code``
    (:func:`rounded`; nothing for :data:`ROUND_NONE`): one vectorised loop per format."""
    if code == ROUND_BF16:
        for i in range(buf.size):
            buf[i] = rounded(buf[i], ROUND_BF16)
    elif code == ROUND_FP16:
        for i in range(buf.size):
            buf[i] = rounded(buf[i], ROUND_FP16)


@jit()
def bf16_bits_to_f32(bits):
    """Widen one bf16 bit pattern (uint16) to its exact float32 value."""
    return widen(np.uint16(bits))


@jit()
def f32_to_bf16_bits(x):
    """Round one float32 to bf16 (nearest, ties to even); return the uint16 bits."""
    return np.uint16(bitcast(rounded(np.float32(x), ROUND_BF16), np.uint32) >> np.uint32(16))


@jit()
def round_to_bf16(x):
    """Round one float32 to the nearest bf16 value, returned as float32."""
    return rounded(np.float32(x), ROUND_BF16)


@jit()
def round_to_fp16(x):
    """Round one float32 to the nearest float16 value (ties to even), returned as float32: F16C's
    conversions where the CPU has them, else the rule of :func:`round_to_fp16_bits`."""
    return rounded(np.float32(x), ROUND_FP16)


@jit()
def round_to_fp16_bits(x):
    """Round one float32 to the nearest float16 value on the bit pattern, whatever the CPU (the
    rule the kernels use where it has no F16C; ``tests/test_float16.py`` checks that both agree
    at every rounding boundary)."""
    return _fp16_on_the_bits(np.float32(x))


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


def to_bf16_array(x: np.ndarray, bf16=None) -> np.ndarray:
    """Round a float32 array to a new ``ml_dtypes.bfloat16`` array (RNE). ``bf16``: that dtype,
    when the caller has it at hand (:func:`bf16_dtype`)."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    bits = np.empty(src.shape, dtype=UINT16)
    _convert_array(src, bits)
    return bits.view(bf16_dtype() if bf16 is None else bf16)


@intrinsic
def fp16_bits_to_f32(typingctx, bits):
    """The float32 value of fp16 bits (uint16): LLVM's ``fpext`` of the half (F16C: ``vcvtph2ps``)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_fp16_bits(typingctx, x):
    """The fp16 bits (uint16) of a float32 rounded to fp16: LLVM's ``fptrunc`` (F16C: ``vcvtps2ph``)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@jit(entry=True)
def _widen_fp16(bits, out):
    for i in range(bits.size):
        out[i] = fp16_bits_to_f32(bits[i])


@jit(entry=True)
def _narrow_fp16(x, bits):
    for i in range(x.size):
        bits[i] = f32_to_fp16_bits(x[i])


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
