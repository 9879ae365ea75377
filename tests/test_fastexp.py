"""The vectorisable float32 exp used by the kernels."""

from __future__ import annotations

import re

import numpy as np
from numba import types

from numbafa.compiler.jit import jit
from numbafa.kernels.fastexp import expf


@jit(entry=True)
def _apply(x, out):
    for i in range(x.size):
        out[i] = expf(x[i])


def _expf(x):
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    _apply(x, out)
    return out


def test_within_one_ulp_of_correctly_rounded_exp():
    x = np.linspace(-104, 88.72, 4_000_001, dtype=np.float32)
    got = _expf(x)
    ref = np.exp(x.astype(np.float64)).astype(np.float32)   # correctly rounded (to ~1e-16)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1


def test_special_values():
    x = np.array([-np.inf, -3.4028235e38, -1e4, -104.5, 0.0, -0.0, 88.8, 1e30, np.inf, np.nan], np.float32)
    got = _expf(x)
    np.testing.assert_array_equal(got[:4], 0.0)
    assert got[4] == got[5] == 1.0
    assert np.isposinf(got[6:9]).all()
    assert np.isnan(got[9])


def test_subnormal_results():
    x = np.array([-87.5, -90.0, -100.0, -103.9], np.float32)
    got = _expf(x)
    ref = np.exp(x.astype(np.float64)).astype(np.float32)
    assert (got > 0).all() and (got < np.finfo(np.float32).tiny).any()
    np.testing.assert_array_max_ulp(got, ref, maxulp=1)


def _fresh_asm(py_func, sig) -> str:
    """The machine code of ``py_func`` compiled now with the package's flags (off the disk cache:
    a function loaded from it keeps no assembly)."""
    dispatcher = jit(disk_cache=False)(py_func)
    dispatcher.compile(sig)
    return "".join(cres.library.get_asm_str() for cres in dispatcher.overloads.values())


def test_loops_calling_it_are_vectorised_with_it_inlined():
    """expf is a function of its own (compiled once, not copied into each caller's Numba IR):
    LLVM must still inline it into its callers' loops and vectorise them, or every score's exp
    would be a scalar call."""
    from numbafa.kernels import forward

    row = types.float32[::1]
    for asm in (_fresh_asm(_apply.py_func, (row, row)),
                _fresh_asm(forward._exp_shifted.py_func, (row, types.float32))):
        assert "mulps" in asm                       # packed single-precision arithmetic
        assert not re.search(r"call\w*\s+\S*expf", asm)
