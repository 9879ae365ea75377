"""numbafa.compiler.scalars: min_ and max_ against Numba's builtin min and max (and Python's)."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from numba.core import event
from numba.core.errors import TypingError

from numbafa.compiler.scalars import max_, min_


@numba.njit
def _ours(a, b, c):
    return min_(a, b), max_(a, b), min_(a, b, c), max_(a, b, c), min_(c, a), max_(c, 2)


@numba.njit
def _builtin(a, b, c):
    return min(a, b), max(a, b), min(a, b, c), max(a, b, c), min(c, a), max(c, 2)


NAN = math.nan


def _same(x, y) -> bool:
    """Both NaN, or equal with the same sign (-0.0 is not 0.0 here)."""
    return (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y))

ARGS = [(3, 7, 5), (-2, -2, 9), (2.5, 1.5, 2.0), (np.float32(1.5), np.float32(-0.0), np.float32(0.0)),
        (-0.0, 0.0, -0.0), (NAN, 1.0, 2.0), (1.0, NAN, 2.0), (1.0, 2.0, NAN), (np.float32(NAN), np.float32(3), 1.0),
        (3, 2.5, np.int32(4)), (np.uint32(7), np.int64(-1), np.int16(3)), (True, False, 3), (-math.inf, math.inf, 0.0)]


@pytest.mark.parametrize("a, b, c", ARGS)
def test_the_values_and_types_of_numbas_builtins(a, b, c):
    """The same values (NaN in every position: Python's rule, the first argument kept unless a later
    one compares beyond it), signed zeros included, and the same result types."""
    got, expected = _ours(a, b, c), _builtin(a, b, c)
    for g, e in zip(got, expected):
        assert type(g) is type(e)
        assert _same(g, e), (got, expected)
    python = (min(a, b), max(a, b), min(a, b, c), max(a, b, c), min(c, a), max(c, 2))
    for g, p in zip(got, python):
        assert _same(g, p), (got, python)


@numba.njit
def _one_caller(a, b):
    return min_(a, b) + max_(a, b, 1.5)


def test_no_function_of_their_own_is_compiled():
    """A caller compiles alone: the two calls are part of its code (Numba's builtins are a compiled
    function each)."""
    with event.install_recorder("numba:compile") as recorder:
        assert _one_caller(2.0, 3.0) == 5.0
    assert [ev.data["dispatcher"].py_func.__name__ for _, ev in recorder.buffer if ev.is_start] == ["_one_caller"]


@numba.njit
def _of_arrays(x):
    return min_(x, x)


@numba.njit
def _of_nothing():
    return max_()


@pytest.mark.parametrize("fn, args", [(_of_arrays, (np.zeros(2),)), (_of_nothing, ())], ids=["arrays", "no-arguments"])
def test_anything_but_numbers_is_a_typing_error(fn, args):
    with pytest.raises(TypingError):
        fn(*args)


def test_from_python_they_are_the_builtins():
    """The kernels' helpers also run as Python (``.py_func``): there min_ and max_ are min and max."""
    assert min_(3, 2.5) == 2.5 and max_(1.5, NAN, 2.5) == 2.5 and min_(-0.0, 0.0) == 0.0
    assert math.copysign(1, min_(-0.0, 0.0)) == -1 and type(max_(2, 1)) is int
    with pytest.raises(TypeError):
        max_()
