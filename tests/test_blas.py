"""BLAS is pinned to one thread only while a kernel runs."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info

import numbafa
from numbafa.blas import blas_controller, single_threaded_blas


def _blas_threads():
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


def test_pinned_inside_and_restored_after():
    before = _blas_threads()
    assert before, "no BLAS library loaded"
    with single_threaded_blas():
        assert set(_blas_threads().values()) == {1}
    assert _blas_threads() == before
    q = np.ones((1, 1, 8, 64), np.float32)
    numbafa.attention_bwd(q, q, q, q, q, np.zeros((1, 1, 64), np.float32))
    assert _blas_threads() == before


def test_controller_sees_the_blas_numba_calls():
    # Numba's np.dot goes through SciPy's BLAS; the controller must hold it.
    paths = [lib.filepath for lib in blas_controller().lib_controllers]
    assert any("scipy" in p for p in paths), paths
