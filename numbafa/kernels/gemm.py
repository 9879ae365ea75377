"""``sgemm`` for the kernels: ``C = alpha * op(A) op(B) + beta * C`` on float32 tiles.

``np.dot`` inside ``@njit`` always writes ``C = A B`` (``beta = 0``) and
copies any operand that is not contiguous. The kernels want more of BLAS:
accumulate into an existing tile (``beta = 1``, so no separate ``C += T``
pass over memory), scale the product (``alpha``), and read a transposed
operand where it lies. :func:`gemm` gives them that.

It calls the same BLAS as ``np.dot``: Numba's C helper ``numba_xxgemm``,
which forwards to SciPy's ``cython_blas.sgemm`` (OpenBLAS in SciPy's
wheels). The helper is a symbol of Numba's own runtime, bound by name when
a kernel is linked, so the kernels stay cacheable (a ctypes function
pointer would not be) and the BLAS is pinned to one thread exactly like
``np.dot`` (:mod:`numbafa.blas`).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg.cython_blas  # noqa: F401  -- the BLAS behind numba_xxgemm must be importable
from numba.core import types

from ..jit import jit

__all__ = ["gemm"]

# int numba_xxgemm(char kind, char transa, char transb, intp m, intp n, intp k,
#                  T *alpha, T *a, intp lda, T *b, intp ldb, T *beta, T *c, intp ldc)
# (numba/_lapack.c; Fortran, column-major semantics).
_f32p = types.CPointer(types.float32)
_numba_xxgemm = types.ExternalFunction(
    "numba_xxgemm",
    types.intc(types.char, types.char, types.char, types.intp, types.intp, types.intp,
               _f32p, _f32p, types.intp, _f32p, types.intp, _f32p, _f32p, types.intp),
)

_KIND_S = ord("s")
_NO_TRANS = ord("n")
_TRANS = ord("t")


@jit()
def _leading_dim(x):
    """Row stride of a 2-D float32 array with unit inner stride, in elements (BLAS ``ld``)."""
    return max(x.strides[0] // 4, x.shape[1], 1)


@jit()
def gemm(a, b, c, trans_a, trans_b, alpha, beta):
    """``c = alpha * op(a) @ op(b) + beta * c`` in place, for 2-D float32 arrays.

    ``op(x)`` is ``x.T`` when its ``trans_`` flag is set. Every array must be
    row-major with unit inner stride (rows may be strided: slices of a larger
    tile are fine); the kernels only pass such views, so this is not
    re-checked per call beyond the shapes. With ``beta = 0``, ``c`` need not
    be initialised. Returns nothing; raises ``RuntimeError`` if the BLAS
    symbol cannot be resolved.

    Row-major ``C = op(A) op(B)`` is column-major ``C^T = op(B)^T op(A)^T``:
    the operands are passed to the Fortran routine swapped, with the same
    transpose flags.
    """
    m = c.shape[0]
    n = c.shape[1]
    k = a.shape[0] if trans_a else a.shape[1]
    a_rows = a.shape[1] if trans_a else a.shape[0]
    b_rows = b.shape[1] if trans_b else b.shape[0]
    b_cols = b.shape[0] if trans_b else b.shape[1]
    if a_rows != m or b_rows != k or b_cols != n:
        raise ValueError("gemm: operand shapes do not match")
    if a.strides[1] != 4 or b.strides[1] != 4 or c.strides[1] != 4:
        if min(m, n, k) > 0:
            raise ValueError("gemm: operands need a unit inner stride")
    scal = np.empty(2, dtype=np.float32)
    scal[0] = alpha
    scal[1] = beta
    status = _numba_xxgemm(_KIND_S,
                           _TRANS if trans_b else _NO_TRANS,
                           _TRANS if trans_a else _NO_TRANS,
                           n, m, k,
                           scal[0:1].ctypes, b.ctypes, _leading_dim(b),
                           a.ctypes, _leading_dim(a),
                           scal[1:2].ctypes, c.ctypes, _leading_dim(c))
    if status != 0:
        raise RuntimeError("gemm: SciPy's BLAS sgemm could not be loaded")
