"""A float32 ``exp`` (and ``tanh``) that LLVM can vectorise.

Numba's ``math.exp`` on float32 becomes one scalar libm ``expf`` call per
element (no SVML in the PyPI llvmlite), and ``expf`` of the masked score
-3.4e38 takes libm's slow underflow path. This version is branch-free
(selects only), so the loops that call it vectorise to AVX2.

Algorithm (Cody & Waite range reduction with the Cephes ``expf``
polynomial): ``n = rint(x / ln 2)``, ``r = x - n ln 2`` with ln 2 split in
two so that ``n * C1`` is exact, ``exp(r)`` by a degree-7 polynomial on
``|r| <= ln2 / 2``, then ``2^n`` applied as two exact power-of-two factors
(so subnormal results are right). Accuracy: at most 1 ulp from the correctly
rounded result over all float32 inputs in [-104, 88.7] (checked exhaustively
while developing; ``tests/test_fastexp.py`` re-checks a dense sample). Inputs
below -104 (including -inf and the float32 minimum used as the mask) give
exactly 0; above 88.72, +inf; NaN stays NaN.

:func:`tanhf`, for the soft cap of the score variants (:mod:`numbafa.kernels.scores`), is
built on it, branch-free too: ``1 - 2 / (exp(2|x|) + 1)`` for ``|x| >= 0.625`` (no
cancellation there: the result is above 0.55) and the Cephes ``tanhf`` odd polynomial
below; the sign is put back last. Within 2 ulp of the correctly rounded result
(``tests/test_fastexp.py`` checks a dense sample against float64's tanh).
"""

from __future__ import annotations

import math

import numpy as np
from numba import types

from ..compiler.jit import jit, overload
from ..compiler.arrays import bitcast

__all__ = ["expf", "exp_of", "log_of", "tanhf", "tanh_of"]

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_C1 = _F(0.693359375)          # ln 2, high part (exact in 9 bits)
_C2 = _F(-2.12194440e-4)       # ln 2 - C1
_LO = _F(-104.0)
_HI = _F(88.8)
_ONE = _F(1.0)
_ZERO = _F(0.0)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)


@jit()
def expf(x):
    """exp of one float32, vectorisable; see the module docstring."""
    underflow = x < _LO
    x = _ZERO if underflow else x      # keep those lanes off the slow subnormal path
    x = _HI if x > _HI else x          # exp(88.8) overflows to +inf below
    n = np.rint(x * _LOG2E)
    r = x - n * _C1
    r = r - n * _C2
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = p * (r * r) + r + _ONE
    k = np.int32(n)
    k1 = np.int32(k >> 1)              # 2^n = 2^k1 * 2^(n - k1), each factor normal
    s1 = bitcast(np.int32((k1 + 127) << 23), np.float32)
    s2 = bitcast(np.int32((k - k1 + 127) << 23), np.float32)
    return _ZERO if underflow else (p * s1) * s2


_TWO = _F(2.0)
_T_SWITCH = _F(0.625)
_T0, _T1, _T2 = _F(-5.70498872745e-3), _F(2.06390887954e-2), _F(-5.37397155531e-2)
_T3, _T4 = _F(1.33314422036e-1), _F(-3.33332819422e-1)


@jit()
def tanhf(x):
    """tanh of one float32, vectorisable; see the module docstring."""
    a = abs(x)
    big = _ONE - _TWO / (expf(a + a) + _ONE)      # exp(2|x|) = inf for |x| > 44.4: exactly 1
    z = a * a
    small = ((((_T0 * z + _T1) * z + _T2) * z + _T3) * z + _T4) * z * a + a
    r = big if a >= _T_SWITCH else small
    return -r if x < _ZERO else r


def tanh_of(x):  # pragma: no cover - replaced by the overload inside njit code
    """The kernels' tanh of one float: :func:`tanhf` for float32, libm's ``tanh`` for float64."""
    raise NotImplementedError("tanh_of is only callable from @njit code")


def exp_of(x):  # pragma: no cover - replaced by the overload inside njit code
    """The kernels' exp of one float: :func:`expf` for float32, libm's ``exp`` for float64 (the
    float64 kernels are the reference-quality path: correctly rounded to within libm's ulp)."""
    raise NotImplementedError("exp_of is only callable from @njit code")


def log_of(x):  # pragma: no cover - replaced by the overload inside njit code
    """The kernels' log of one positive float, in its own precision: ``float32(log(x))`` for
    float32 (libm's double log, rounded), ``log(x)`` for float64."""
    raise NotImplementedError("log_of is only callable from @njit code")


# inline="always": the one-line body goes into the caller's IR, so a float32 caller gets exactly
# the code of a direct expf call. expf and tanhf themselves are functions of their own, compiled
# once with the package's flags (contraction on, as in every caller: a contract=False step
# takes its exp through a helper, backward._sink_probability): LLVM inlines them into the
# callers' loops, which still vectorise (tests/test_fastexp.py). Copied into each caller's
# Numba IR instead (inline=True), they cost ~70 ms of compile at each of their 12 call sites.
@overload(exp_of, inline="always")
def _exp_of_overload(x):
    if x == types.float32:
        return lambda x: expf(x)
    if x == types.float64:
        return lambda x: math.exp(x)
    return None


@overload(tanh_of, inline="always")
def _tanh_of_overload(x):
    if x == types.float32:
        return lambda x: tanhf(x)
    if x == types.float64:
        return lambda x: math.tanh(x)
    return None


@overload(log_of, inline="always")
def _log_of_overload(x):
    if x == types.float32:
        return lambda x: np.float32(math.log(x))
    if x == types.float64:
        return lambda x: math.log(x)
    return None
