"""The matmul seam: every tile product of both kernels goes through :func:`gemm`.

    gemm(a, b, c, trans_a, trans_b, alpha, beta, path)   # c = alpha * op(a) @ op(b) + beta * c

``a`` and ``b`` are :data:`Operand` s, a pair of views of one tile: ``f``, its
values in the accumulator dtype (float32, or float64 for float64 inputs), and
``bits``, its bf16 bit patterns (uint16). ``path`` is the plan's
:class:`~numbafa.kernels.bundles.Gemm`, values of one type whatever the path, so
one compiled kernel runs every path; the branch is taken per call:

* ``path.bits`` (bf16 inputs on a CPU with bf16 units, the oneDNN path):
  ``bits`` of both operands, oneDNN's ``dnnl_gemm_bf16bf16f32`` on the bf16
  units, float32 accumulation;
* ``path.onednn`` (float32 tiles: float32 and float16 inputs, bf16 ones
  widened): ``f``, oneDNN's ``dnnl_sgemm`` (faster per core than OpenBLAS on
  the CPUs that take that path, docs/performance.md);
* ``m * n * k <= path.onednn_max_mnk`` (the mixed path's small float32 GEMMs):
  ``f``, ``dnnl_sgemm``, which has less fixed cost per call than OpenBLAS;
* otherwise ``f`` by BLAS ``sgemm`` (``dgemm`` for float64: oneDNN has no float64
  GEMM, so the float64 kernels take BLAS on every path). bf16 values widened
  into float32 tiles multiply exactly (a bf16 x bf16 product is exact in
  float32), so this is "bf16 in, fp32 accumulate" too.

The other member of an operand is an empty array (:func:`values_operand`,
:func:`bits_operand`): a tile is held once. ``c`` is a 2-D array of the accumulator dtype with unit inner stride
(a view of a wider tile is fine: its row stride is the ``ld``).

:func:`gemm` is compiled once per accumulator dtype, apart (:func:`numbafa.compiler.jit.jit`):
every caller calls that one function. Why not ``np.dot``: inside ``@njit`` it always
writes ``C = A B`` (``beta = 0``) and copies an operand that is not contiguous;
the kernels accumulate into an existing tile (``beta = 1``), scale the product
(``alpha``) and read a transposed operand where it lies. (The forward's row sums
of P are one matrix-vector product, :func:`row_sums`: ``np.dot``.)

The GEMMs call Numba's C helper ``numba_xxgemm``, which forwards to SciPy's
``cython_blas`` (OpenBLAS in SciPy's wheels) -- the BLAS ``np.dot`` uses; loaded by
the BLAS pin every kernel call runs in (:func:`numbafa.platform.blas.blas_controller`),
and looked up by Numba's helper at its first call -- and
oneDNN's functions by symbol name. Both are bound when a kernel is linked, so
the kernels stay cacheable (a ctypes function pointer would not be): the
symbols must exist then, which :func:`numbafa.platform.onednn.ensure_symbols` makes sure
of (oneDNN's library, or stand-ins that refuse to run where it is not
installed: a plan takes the oneDNN path only where it loads). Each oneDNN call
runs on one OpenMP thread (the calling thread's count is set to 1 around it and
restored): the GEMMs run inside the work items.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import make_array

from ..compiler.arrays import vector_view
from ..compiler.jit import jit, overload
from ..compiler.linking import pack
from ..compiler.scalars import max_, min_
from ..platform.onednn import ensure_symbols

__all__ = ["Operand", "values_operand", "bits_operand", "gemm", "row_sums", "any_layout", "flat", "row_of"]

#: A GEMM operand (module docstring): ``f`` (values, 2-D, accumulator dtype) and ``bits`` (2-D
#: uint16 bf16 bits); the member the path does not read is empty.
Operand = namedtuple("Operand", ["f", "bits"])


def _xxgemm(dtype):
    """``int numba_xxgemm(char kind, char transa, char transb, intp m, intp n, intp k,
    T *alpha, T *a, intp lda, T *b, intp ldb, T *beta, T *c, intp ldc)``
    (numba/_lapack.c; Fortran, column-major semantics) for ``T = dtype``."""
    ptr = types.CPointer(dtype)
    return types.ExternalFunction(
        "numba_xxgemm",
        types.intc(types.char, types.char, types.char, types.intp, types.intp, types.intp,
                   ptr, ptr, types.intp, ptr, types.intp, ptr, ptr, types.intp))


_u16p = types.CPointer(types.uint16)
_f32p = types.CPointer(types.float32)
# dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M, N, K, float alpha,
#     const bf16 *A, dnnl_dim_t lda, const bf16 *B, dnnl_dim_t ldb, float beta, float *C,
#     dnnl_dim_t ldc) -- row-major (oneDNN's dnnl.h).
_gemm_bf16_fn = types.ExternalFunction(
    "dnnl_gemm_bf16bf16f32",
    types.int32(types.char, types.char, types.int64, types.int64, types.int64, types.float32,
                _u16p, types.int64, _u16p, types.int64, types.float32, _f32p, types.int64))
# dnnl_status_t dnnl_sgemm(char transa, char transb, dnnl_dim_t M, N, K, float alpha,
#     const float *A, dnnl_dim_t lda, const float *B, dnnl_dim_t ldb, float beta, float *C,
#     dnnl_dim_t ldc) -- row-major, like dnnl_gemm_bf16bf16f32.
_dnnl_sgemm_fn = types.ExternalFunction(
    "dnnl_sgemm",
    types.int32(types.char, types.char, types.int64, types.int64, types.int64, types.float32,
                _f32p, types.int64, _f32p, types.int64, types.float32, _f32p, types.int64))
# libgomp, which oneDNN runs its GEMMs on: the calling thread's OpenMP thread count.
_omp_set_num_threads = types.ExternalFunction("omp_set_num_threads", types.void(types.int32))
_omp_get_max_threads = types.ExternalFunction("omp_get_max_threads", types.int32())
_KIND_S = ord("s")
_KIND_D = ord("d")
_NO_TRANS = ord("n")
_TRANS = ord("t")


@intrinsic
def any_layout(typingctx, x):
    """``x`` typed as an array of any layout (``"A"``): the GEMMs and the operands read pointers
    and strides only, so each is compiled once, not once per combination of layouts."""
    if not isinstance(x, types.Array):
        return None

    def codegen(context, builder, sig, args):
        if context.enable_nrt:
            context.nrt.incref(builder, sig.return_type, args[0])
        return args[0]

    return x.copy(layout="A")(x), codegen


@intrinsic
def flat(typingctx, x):
    """``flat(x)``: a C-contiguous array as a 1-D view of all its elements (no copy, and no
    compiled ``reshape`` per rank: one intrinsic for every array)."""
    if not isinstance(x, types.Array) or x.layout != "C":
        return None
    retty = x.copy(ndim=1, layout="C")

    def codegen(context, builder, sig, args):
        src = make_array(sig.args[0])(context, builder, value=args[0])
        return vector_view(context, builder, src, retty, src.data, src.nitems)

    return retty(x), codegen


@intrinsic
def row_of(typingctx, x, i):
    """``row_of(x, i)``: row ``i`` of a 2-D array whose rows are contiguous (unit inner stride, as
    every GEMM operand's: :func:`_check_operands`) as a C-contiguous 1-D view, so that a loop
    over it vectorises whatever ``x``'s layout type (``any_layout``'s rows have runtime strides).
    No bounds check."""
    if not (isinstance(x, types.Array) and x.ndim == 2 and isinstance(i, types.Integer)):
        return None
    retty = x.copy(ndim=1, layout="C")

    def codegen(context, builder, sig, args):
        src = make_array(sig.args[0])(context, builder, value=args[0])
        row = context.cast(builder, args[1], sig.args[1], types.intp)
        shape = cgutils.unpack_tuple(builder, src.shape)
        strides = cgutils.unpack_tuple(builder, src.strides)
        start = builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [builder.mul(row, strides[0])])
        return vector_view(context, builder, src, retty, builder.bitcast(start, src.data.type), shape[1])

    return retty(x, i), codegen


@jit(inline=True)
def values_operand(values, no_bits):
    """The :data:`Operand` of a tile held as ``values`` (2-D, accumulator dtype); ``no_bits``: an
    empty 2-D uint16 array."""
    return Operand(any_layout(values), any_layout(no_bits))


@jit(inline=True)
def bits_operand(bits, no_values):
    """The :data:`Operand` of a tile held as bf16 ``bits`` (2-D uint16); ``no_values``: an empty
    2-D array of the accumulator dtype."""
    return Operand(any_layout(no_values), any_layout(bits))


@jit()
def _check_operands(a, b, c, trans_a, trans_b):
    """``(m, n, k)`` of ``op(a) @ op(b)`` into ``c``; raises on a shape or stride mismatch.

    Every array must be row-major with unit inner stride (rows may be
    strided: slices of a larger tile are fine).
    """
    m = c.shape[0]
    n = c.shape[1]
    k = a.shape[0] if trans_a else a.shape[1]
    a_rows = a.shape[1] if trans_a else a.shape[0]
    b_rows = b.shape[1] if trans_b else b.shape[0]
    b_cols = b.shape[0] if trans_b else b.shape[1]
    if a_rows != m or b_rows != k or b_cols != n:
        raise ValueError("matmul: operand shapes do not match")
    if a.strides[1] != a.itemsize or b.strides[1] != b.itemsize or c.strides[1] != c.itemsize:
        if min_(m, n, k) > 0:
            raise ValueError("matmul: operands need a unit inner stride")
    return m, n, k


@jit()
def _leading_dim(x):
    """Row stride of a 2-D array with unit inner stride, in elements (BLAS ``ld``)."""
    return max_(x.strides[0] // x.itemsize, x.shape[1], 1)


def _blas(a, b, c, trans_a, trans_b, alpha, beta):  # pragma: no cover - njit only
    """BLAS ``sgemm``/``dgemm`` (the operands' dtype) of ``c = alpha op(a) op(b) + beta c``.
    Row-major ``C = op(A) op(B)`` is column-major ``C^T = op(B)^T op(A)^T``: the operands go
    to the Fortran routine swapped, with the same transpose flags; with ``beta = 0``, ``c``
    need not be initialised. Returns Numba's status (0: called)."""
    raise NotImplementedError("_blas is only callable from @njit code")


@overload(_blas)
def _blas_overload(a, b, c, trans_a, trans_b, alpha, beta):
    fn, kind = (_xxgemm(types.float32), _KIND_S) if c.dtype == types.float32 else (_xxgemm(types.float64), _KIND_D)
    cast = np.float32 if c.dtype == types.float32 else np.float64

    def impl(a, b, c, trans_a, trans_b, alpha, beta):
        m, n, k = _check_operands(a, b, c, trans_a, trans_b)
        # alpha and beta by pointer: copies in this frame (no allocation per call)
        return fn(kind, _TRANS if trans_b else _NO_TRANS, _TRANS if trans_a else _NO_TRANS,
                  n, m, k, pack(cast(alpha)), b.ctypes, _leading_dim(b),
                  a.ctypes, _leading_dim(a), pack(cast(beta)), c.ctypes, _leading_dim(c))
    return impl


def _onednn(a, b, c, trans_a, trans_b, alpha, beta):  # pragma: no cover - njit only
    """oneDNN's GEMM for the operands' dtype (uint16 bf16 bits: ``dnnl_gemm_bf16bf16f32``;
    float32: ``dnnl_sgemm``), row-major, on one OpenMP thread; returns its status (float64:
    never called, 1)."""
    raise NotImplementedError("_onednn is only callable from @njit code")


@overload(_onednn)
def _onednn_overload(a, b, c, trans_a, trans_b, alpha, beta):
    if c.dtype != types.float32:
        return lambda a, b, c, trans_a, trans_b, alpha, beta: np.int32(1)
    fn = _gemm_bf16_fn if a.dtype == types.uint16 else _dnnl_sgemm_fn

    def impl(a, b, c, trans_a, trans_b, alpha, beta):
        m, n, k = _check_operands(a, b, c, trans_a, trans_b)
        if min_(m, n) == 0:
            return np.int32(0)
        previous = _omp_get_max_threads()
        _omp_set_num_threads(1)
        status = fn(_TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k,
                    np.float32(alpha), a.ctypes, _leading_dim(a), b.ctypes, _leading_dim(b),
                    np.float32(beta), c.ctypes, _leading_dim(c))
        _omp_set_num_threads(previous)
        return status
    return impl


def _sgemm_on_onednn(path, c, a, trans_a):  # pragma: no cover - njit only
    """Whether the float32 GEMM ``c = op(a) op(b)`` goes to ``dnnl_sgemm`` (the oneDNN path; the
    mixed path's small GEMMs); float64 tiles never do."""
    raise NotImplementedError("_sgemm_on_onednn is only callable from @njit code")


@overload(_sgemm_on_onednn)
def _sgemm_on_onednn_overload(path, c, a, trans_a):
    if c.dtype == types.float32:
        def impl(path, c, a, trans_a):
            mnk = c.shape[0] * c.shape[1] * (a.shape[0] if trans_a else a.shape[1])
            return path.onednn or 0 < mnk <= path.onednn_max_mnk
        return impl
    return lambda path, c, a, trans_a: False


@jit(apart=True)
def _gemm(a, b, c, trans_a, trans_b, alpha, beta, path):
    """:func:`gemm` (compiled once per accumulator dtype)."""
    if path.bits:
        status = _onednn(a.bits, b.bits, c, trans_a, trans_b, alpha, beta)
    elif _sgemm_on_onednn(path, c, a.f, trans_a):
        status = _onednn(a.f, b.f, c, trans_a, trans_b, alpha, beta)
    else:
        status = _blas(a.f, b.f, c, trans_a, trans_b, alpha, beta)
    if status != 0:
        raise RuntimeError("matmul: the GEMM failed (oneDNN's returned an error, or BLAS could not be loaded)")


def gemm(a, b, c, trans_a, trans_b, alpha, beta, path):  # pragma: no cover - replaced inside njit code
    """``c = alpha * op(a) @ op(b) + beta * c`` in place; ``op(x)`` is ``x.T`` when its flag is set.

    Parameters
    ----------
    a, b : :data:`Operand`
    c : 2-D array of the accumulator dtype ``[m, n]``, written in place
    trans_a, trans_b : bool
    alpha, beta : scalars of the accumulator dtype
    path : :class:`~numbafa.kernels.bundles.Gemm`
        Which member of the operands, and which library (module docstring).

    Only callable from ``@njit`` code. Raises ``ValueError`` on mismatched shapes or a non-unit
    inner stride, ``RuntimeError`` if the library fails.
    """
    raise NotImplementedError("gemm is only callable from @njit code")


@overload(gemm)
def _gemm_entry(a, b, c, trans_a, trans_b, alpha, beta, path):
    if not (isinstance(c, types.Array) and c.ndim == 2 and c.dtype in (types.float32, types.float64)
            and all(isinstance(x, types.BaseNamedTuple) and x.instance_class is Operand for x in (a, b))
            and all(x.types[0].dtype == c.dtype and x.types[1].dtype == types.uint16 for x in (a, b))):
        return None   # a typing error: only float32/float64 tiles, operands of their dtype (and bf16 bits)
    # Every symbol the compiled GEMM refers to must exist before it is linked.
    ensure_symbols()
    # one compiled _gemm per accumulator dtype: the scalars in it, the flags as plain bools
    cast = np.float32 if c.dtype == types.float32 else np.float64

    def impl(a, b, c, trans_a, trans_b, alpha, beta, path):
        _gemm(a, b, any_layout(c), bool(trans_a), bool(trans_b), cast(alpha), cast(beta), path)
    return impl


@jit()
def row_sums(x, ones, out):
    """``out = x @ ones``: the row sums of a 2-D tile (a matrix-vector product, BLAS gemv)."""
    np.dot(x, ones, out)
