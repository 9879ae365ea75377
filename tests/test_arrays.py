"""numbafa.compiler.arrays: the array intrinsics against what NumPy's functions give."""

from __future__ import annotations

import gc

import numba
import numpy as np
import pytest

from numbafa.compiler.arrays import bitcast, empty, empty_like, fetch_add, ones, zeros


@numba.njit
def _bitcast(x, to):
    return bitcast(x, to)


@numba.njit
def _made(n, m, like):
    """Every constructor, with an int shape, a tuple shape, a NumPy type and an array's dtype."""
    return (empty(n, np.float32), zeros((n, m), np.uint16), ones(n, like.dtype), ones((m, n), np.int32),
            empty_like(like), zeros(0, np.float64))


@pytest.mark.parametrize("x, to", [(np.float32(-1.5), np.int32), (np.int32(0x3F800000), np.float32),
                                   (np.float64(2.0 ** -1074), np.int64), (np.uint64(0x7FF8000000000001), np.float64),
                                   (np.float32(-0.0), np.uint32)])
def test_bitcast_of_a_scalar_is_its_view(x, to):
    got = _bitcast(x, to)   # (back in Python as an int or a float, which holds it exactly)
    assert np.asarray(got).astype(to).tobytes() == np.asarray(x).view(to).tobytes()


def test_bitcast_of_an_array_is_a_view_that_keeps_it_alive():
    x = np.array([1.0, -2.5, np.inf, -0.0], dtype=np.float32)
    expected = x.view(np.int32).copy()
    v = _bitcast(x, np.int32)
    assert v.dtype == np.int32
    np.testing.assert_array_equal(v, expected)
    v[0] = np.float32(3.0).view(np.int32)   # the same memory
    assert x[0] == 3.0
    del x
    gc.collect()
    assert v[1] == expected[1]               # still held by the view's reference


@pytest.mark.parametrize("x, to", [(np.float32(1.0), np.int64), (np.ones(3, np.float32)[::2], np.int32),
                                   (np.ones((2, 2), np.float32), np.int32)])
def test_bitcast_refuses_another_width_or_layout(x, to):
    with pytest.raises(numba.core.errors.TypingError):
        _bitcast(x, to)


def test_constructors_match_numpy():
    like = np.ones((3, 4, 5), dtype=np.float64)[:, ::2]
    e, z, o, oi, el, z0 = _made(3, 2, like)
    assert (e.shape, e.dtype) == ((3,), np.float32)
    assert (z.shape, z.dtype) == ((3, 2), np.uint16) and not z.any()
    assert o.dtype == np.float64 and (o == 1.0).all() and o.shape == (3,)
    assert oi.dtype == np.int32 and (oi == 1).all() and oi.shape == (2, 3)
    assert (el.shape, el.dtype) == (like.shape, like.dtype) and el.flags.c_contiguous
    assert z0.shape == (0,)
    assert all(a.flags.c_contiguous and a.flags.writeable for a in (e, z, o, oi, el))


def test_a_negative_size_is_numpys_error():
    with pytest.raises(ValueError, match="negative dimensions"):
        _made(-1, 2, np.ones(1))


@numba.njit(parallel=True)
def _taken(n, per):
    """Every iteration of a ``prange`` takes ``per`` values of one shared counter."""
    counter = zeros(1, np.int64)
    got = np.empty(n * per, np.int64)
    for t in numba.prange(n):
        for j in range(per):
            got[t * per + j] = fetch_add(counter, 1)
    return counter[0], got


def test_fetch_add_gives_every_thread_its_own_values():
    """Two threads (or more) taking values of one counter at once: each value is taken once and
    none is lost (a plain load, add and store loses some under this contention)."""
    previous = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        for _ in range(3):
            total, got = _taken(numba.get_num_threads() * 4, 50_000)
            assert total == got.size
            assert np.array_equal(np.sort(got), np.arange(got.size))
    finally:
        numba.set_num_threads(previous)
