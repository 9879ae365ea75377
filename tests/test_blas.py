"""BLAS is pinned to one thread only while a kernel runs."""

from __future__ import annotations

import json

import numba
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


def test_backend_info_reports_the_blas_the_kernels_pin():
    info = numbafa.backend_info()
    json.dumps(info)  # serialisable, for bug reports and benchmark metadata
    assert info["numbafa"] == numbafa.__version__
    assert info["gemm"].endswith("cython_blas.sgemm")
    pinned = {lib.filepath for lib in blas_controller().lib_controllers}
    assert {lib["filepath"] for lib in info["blas"]} == pinned
    assert all(lib["num_threads"] >= 1 for lib in info["blas"])
    assert info["threads"] == numba.get_num_threads()
    assert info["cache"] in (True, False)
    if info["cpu"] is not None:
        assert set(info["cpu"]) == {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}


def test_backend_info_names_the_threading_layer_after_a_kernel_ran():
    q = np.ones((1, 1, 8, 64), np.float32)
    numbafa.attention_bwd(q, q, q, q, q, np.zeros((1, 1, 64), np.float32))
    assert numbafa.backend_info()["threading_layer"] == numba.threading_layer()
