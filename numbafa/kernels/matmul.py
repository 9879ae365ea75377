"""The matmul seam: every product of both kernels goes through :func:`matmul`.

    matmul(a, b, c, trans_a, trans_b, alpha, beta, gemm)   # c = alpha * op(a) @ op(b) + beta * c

The implementation is chosen when a kernel is compiled, from the operand
types and the GEMM path marker ``gemm`` (``plan.gemm``: ``None`` for BLAS,
:data:`ONEDNN` for oneDNN, :mod:`numbafa.onednn`), so a new backend or dtype
is one more branch of :func:`_matmul_impl` and no call site changes:

* 2-D float32 ``a``, ``b``, ``c``: BLAS ``sgemm`` (float32 tiles, and
  bf16 values widened into float32 tiles: a bf16 x bf16 product is exact in
  float32, so this is "bf16 in, fp32 accumulate"); with ``gemm`` =
  :data:`ONEDNN`, oneDNN's ``dnnl_sgemm`` instead (faster per core than
  OpenBLAS on the CPUs that take that path, docs/performance.md).
* 2-D float64: BLAS ``dgemm`` (on either path: oneDNN has no float64 GEMM).
* 2-D ``a`` and 1-D ``b``, ``c``, all float32 or all float64: a matrix-vector
  product (``np.dot``, BLAS ``sgemv``/``dgemv``), ``alpha = 1``, ``beta = 0`` only,
  on either path.
* 2-D uint16 ``a``, ``b`` (bf16 bit patterns) and float32 ``c``, ``gemm`` =
  :data:`ONEDNN`: oneDNN's ``dnnl_gemm_bf16bf16f32`` on the CPU's bf16
  units, float32 accumulation.

The oneDNN implementations call symbols of the library that
:func:`numbafa.onednn.gemm_path` loads process-wide; a :data:`ONEDNN` marker
is only put into a plan after it did, so a kernel compiled (or loaded from the
cache) for that path always finds them. The marker is a type of its own, so
the two paths are separate compiled specialisations of every kernel.

Why not ``np.dot`` for everything: inside ``@njit`` it always writes
``C = A B`` (``beta = 0``) and copies an operand that is not contiguous.
The kernels want more of BLAS: accumulate into an existing tile (``beta =
1``, so no separate ``C += T`` pass over memory), scale the product
(``alpha``), and read a transposed operand where it lies.

The GEMMs call Numba's C helper ``numba_xxgemm``, which forwards to SciPy's
``cython_blas`` (OpenBLAS in SciPy's wheels) -- the BLAS ``np.dot`` uses.
The helper is a symbol of Numba's own runtime, bound by name when a kernel
is linked, so the kernels stay cacheable (a ctypes function pointer would
not be), and the BLAS is pinned to one thread like ``np.dot``'s
(:mod:`numbafa.blas`).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  -- the BLAS behind numba_xxgemm must be importable
from numba import types
from numba.extending import intrinsic, overload

from ..jit import jit
from ..onednn import load_library

__all__ = ["matmul", "OneDNN", "ONEDNN"]

#: The marker type of the oneDNN GEMM path (``plan.gemm``); BLAS is ``None``. It has no
#: fields: only its type matters, which picks the implementation when a kernel is compiled.
OneDNN = namedtuple("OneDNN", [])
#: The oneDNN path's marker (each of its GEMM calls runs on one OpenMP thread, :func:`_gemm_onednn`).
ONEDNN = OneDNN()


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
# libgomp, which oneDNN runs its GEMMs on: the calling thread's OpenMP thread count.
# dnnl_status_t dnnl_sgemm(char transa, char transb, dnnl_dim_t M, N, K, float alpha,
#     const float *A, dnnl_dim_t lda, const float *B, dnnl_dim_t ldb, float beta, float *C,
#     dnnl_dim_t ldc) -- row-major, like dnnl_gemm_bf16bf16f32.
_dnnl_sgemm_fn = types.ExternalFunction(
    "dnnl_sgemm",
    types.int32(types.char, types.char, types.int64, types.int64, types.int64, types.float32,
                _f32p, types.int64, _f32p, types.int64, types.float32, _f32p, types.int64))
_omp_set_num_threads = types.ExternalFunction("omp_set_num_threads", types.void(types.int32))
_omp_get_max_threads = types.ExternalFunction("omp_get_max_threads", types.int32())
_sgemm_fn = _xxgemm(types.float32)
_dgemm_fn = _xxgemm(types.float64)
_KIND_S = ord("s")
_KIND_D = ord("d")
_NO_TRANS = ord("n")
_TRANS = ord("t")


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
        if min(m, n, k) > 0:
            raise ValueError("matmul: operands need a unit inner stride")
    return m, n, k


@jit()
def _leading_dim(x):
    """Row stride of a 2-D array with unit inner stride, in elements (BLAS ``ld``)."""
    return max(x.strides[0] // x.itemsize, x.shape[1], 1)


def _xxgemm_call(a, b, c, trans_a, trans_b, m, n, k, scal):  # pragma: no cover - njit only
    """BLAS ``sgemm``/``dgemm`` for the operands' dtype (float32/float64), column-major with the
    operands swapped; ``scal`` holds alpha and beta; returns Numba's status (0: called)."""
    raise NotImplementedError("_xxgemm_call is only callable from @njit code")


@overload(_xxgemm_call)
def _xxgemm_call_overload(a, b, c, trans_a, trans_b, m, n, k, scal):
    fn, kind = (_sgemm_fn, _KIND_S) if c.dtype == types.float32 else (_dgemm_fn, _KIND_D)

    def impl(a, b, c, trans_a, trans_b, m, n, k, scal):
        return fn(kind, _TRANS if trans_b else _NO_TRANS, _TRANS if trans_a else _NO_TRANS,
                  n, m, k, scal[0:1].ctypes, b.ctypes, _leading_dim(b),
                  a.ctypes, _leading_dim(a), scal[1:2].ctypes, c.ctypes, _leading_dim(c))
    return impl


@jit(apart=True)
def _gemm_blas(a, b, c, trans_a, trans_b, alpha, beta):
    """float32 or float64 ``c = alpha op(a) op(b) + beta c`` by BLAS sgemm or dgemm.

    Row-major ``C = op(A) op(B)`` is column-major ``C^T = op(B)^T op(A)^T``:
    the operands are passed to the Fortran routine swapped, with the same
    transpose flags. With ``beta = 0``, ``c`` need not be initialised.
    """
    m, n, k = _check_operands(a, b, c, trans_a, trans_b)
    scal = np.empty(2, dtype=c.dtype)
    scal[0] = alpha
    scal[1] = beta
    if _xxgemm_call(a, b, c, trans_a, trans_b, m, n, k, scal) != 0:
        raise RuntimeError("matmul: SciPy's BLAS sgemm/dgemm could not be loaded")


def _dnnl_gemm(a, b, c, trans_a, trans_b, m, n, k, alpha, beta):  # pragma: no cover - njit only
    """oneDNN's GEMM for the operand dtype (uint16 bf16 bits: ``dnnl_gemm_bf16bf16f32``; float32:
    ``dnnl_sgemm``), row-major, on the calling thread's OpenMP team; returns its status."""
    raise NotImplementedError("_dnnl_gemm is only callable from @njit code")


@overload(_dnnl_gemm)
def _dnnl_gemm_overload(a, b, c, trans_a, trans_b, m, n, k, alpha, beta):
    fn = _gemm_bf16_fn if a.dtype == types.uint16 else _dnnl_sgemm_fn

    def impl(a, b, c, trans_a, trans_b, m, n, k, alpha, beta):
        return fn(_TRANS if trans_a else _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k,
                  np.float32(alpha), a.ctypes, _leading_dim(a), b.ctypes, _leading_dim(b),
                  np.float32(beta), c.ctypes, _leading_dim(c))
    return impl


@jit()
def _gemm_onednn(a, b, c, trans_a, trans_b, alpha, beta):
    """``c = alpha op(a) op(b) + beta c`` by oneDNN: bf16 ``a``, ``b`` (uint16 bits) on the bf16
    units, or float32 ``a``, ``b`` by ``dnnl_sgemm``; float32 ``c``.

    One thread: the call runs inside a work item, so the calling thread's
    OpenMP thread count is set to 1 around it (and restored).
    """
    m, n, k = _check_operands(a, b, c, trans_a, trans_b)
    if min(m, n) == 0:
        return
    previous = _omp_get_max_threads()
    _omp_set_num_threads(1)
    status = _dnnl_gemm(a, b, c, trans_a, trans_b, m, n, k, alpha, beta)
    _omp_set_num_threads(previous)
    if status != 0:
        raise RuntimeError("matmul: oneDNN's GEMM (dnnl_gemm_bf16bf16f32 or dnnl_sgemm) failed")


@jit()
def _gemv(a, b, c, trans_a, trans_b, alpha, beta):
    """``c = a @ b`` for 2-D ``a`` and 1-D ``b``, ``c`` (``np.dot``: BLAS gemv)."""
    if trans_a or trans_b or alpha != 1 or beta != 0:
        raise ValueError("matmul: a matrix-vector product takes no transposes, alpha=1, beta=0")
    np.dot(a, b, c)


def matmul(a, b, c, trans_a, trans_b, alpha, beta, gemm):  # pragma: no cover - replaced inside njit code
    """``c = alpha * op(a) @ op(b) + beta * c`` in place; ``op(x)`` is ``x.T`` when its flag is set.

    Parameters
    ----------
    a, b : 2-D arrays (``b`` may be 1-D for a matrix-vector product)
    c : 2-D array ``[m, n]`` (1-D ``[m]`` for a matrix-vector product), written in place
    trans_a, trans_b : bool
    alpha, beta : scalars of the operands' dtype
    gemm : None or :class:`OneDNN`
        The GEMM path (``plan.gemm``): None for BLAS, :data:`ONEDNN` for oneDNN.

    Only callable from ``@njit`` code; the implementation follows the
    operand types and ``gemm`` (module docstring). Raises ``ValueError`` on
    mismatched shapes or a non-unit inner stride.
    """
    raise NotImplementedError("matmul is only callable from @njit code")


def _onednn_gemm():
    """:func:`_gemm_onednn`, with oneDNN loaded first: the code compiled for it refers to the
    library's symbols, which must exist when it is linked (:func:`numbafa.onednn.load_library`)."""
    if not load_library():
        raise RuntimeError("matmul: the oneDNN GEMM path needs oneDNN's library (pip install onednn-cpu-gomp)")
    return _gemm_onednn


def _matmul_impl(a, b, c, gemm):
    """The implementation for these operand types and path marker, or None (a typing error)."""
    if not all(isinstance(x, types.Array) for x in (a, b, c)):
        return None
    onednn = isinstance(gemm, types.BaseNamedTuple) and gemm.instance_class is OneDNN
    if not onednn and not isinstance(gemm, types.NoneType):
        return None
    dtypes = {a.dtype, b.dtype, c.dtype}
    if a.ndim == 2 and b.ndim == 1 and c.ndim == 1 and len(dtypes) == 1 and a.dtype in (types.float32,
                                                                                     types.float64):
        return _gemv
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
        return None
    if a.dtype == types.uint16 and b.dtype == types.uint16 and c.dtype == types.float32:
        return _onednn_gemm() if onednn else None
    if len(dtypes) != 1:
        return None
    if dtypes == {types.float32}:
        return _onednn_gemm() if onednn else _gemm_blas
    if dtypes == {types.float64}:
        return _gemm_blas
    return None


@intrinsic
def _any_layout(typingctx, x):
    """``x`` typed as an array of any layout (``"A"``): the GEMMs read pointers and strides
    only, so each is compiled once, not once per combination of its operands' layouts."""
    if not isinstance(x, types.Array):
        return None

    def codegen(context, builder, sig, args):
        context.nrt.incref(builder, sig.return_type, args[0])
        return args[0]

    return x.copy(layout="A")(x), codegen


@overload(matmul)
def _matmul_overload(a, b, c, trans_a, trans_b, alpha, beta, gemm):
    impl = _matmul_impl(a, b, c, gemm)
    if impl is None:
        return None

    if impl is _gemv:
        return lambda a, b, c, trans_a, trans_b, alpha, beta, gemm: impl(a, b, c, trans_a, trans_b,
                                                                        alpha, beta)

    def matmul_impl(a, b, c, trans_a, trans_b, alpha, beta, gemm):
        impl(_any_layout(a), _any_layout(b), _any_layout(c), trans_a, trans_b, alpha, beta)
    return matmul_impl
