"""BLAS is pinned to one thread only while a kernel runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numba
import numpy as np
import pytest
from threadpoolctl import threadpool_info

import numbafa
from numbafa.platform.blas import blas_controller, single_threaded_blas
from numbafa.compiler.runtime import kernel_call


def _all_blas_threads():
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


def _blas_threads():
    """Thread counts of the BLAS libraries the kernels call (the ones the pin touches)."""
    pinned = {lib.filepath for lib in blas_controller().lib_controllers}
    return {path: n for path, n in _all_blas_threads().items() if path in pinned}


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


_LAZY = """
import sys
import numpy as np
import numbafa
from numbafa.platform.blas import blas_controller, single_threaded_blas
from threadpoolctl import threadpool_info
assert "scipy.linalg" not in sys.modules, "importing numbafa loaded SciPy's linalg"
with single_threaded_blas():
    assert "scipy.linalg.cython_blas" in sys.modules
    pinned = {lib.filepath for lib in blas_controller().lib_controllers}
    assert any("scipy" in path for path in pinned), pinned
    threads = {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["filepath"] in pinned}
    assert set(threads.values()) == {1}, threads
q = np.ones((1, 1, 8, 64), np.float32)
numbafa.attention_bwd(q, q, q, q, q, np.zeros((1, 1, 64), np.float32))
"""


def test_scipys_blas_is_loaded_by_the_first_pin_not_by_the_import():
    """``import numbafa`` leaves SciPy's linalg (a fifth of the import) unloaded; the pin every
    kernel call runs in loads it first, so it finds and pins the BLAS the kernels call."""
    done = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_numpys_own_blas_is_left_alone():
    """The kernels call SciPy's BLAS only: where NumPy ships another one (the PyPI wheels),
    the pin does not touch it, so NumPy work in other threads keeps its threads."""
    others = {path: n for path, n in _all_blas_threads().items() if path not in _blas_threads()}
    if not others:
        pytest.skip("NumPy and SciPy share one BLAS here")
    with single_threaded_blas():
        assert {path: n for path, n in _all_blas_threads().items() if path in others} == others


def test_backend_info_reports_the_blas_the_kernels_pin():
    info = numbafa.backend_info()
    json.dumps(info)  # serialisable, for bug reports and benchmark metadata
    assert info["numbafa"] == numbafa.__version__
    assert info["gemm"]["path"] in ("onednn", "mixed", "blas")
    path = info["gemm"]["path"]
    assert ("dnnl_sgemm" in info["float32"]) == (path != "blas")
    assert ("cython_blas" in info["float32"]) == (path != "onednn")
    pinned = {lib.filepath for lib in blas_controller().lib_controllers}
    assert {lib["filepath"] for lib in info["blas"]} == pinned
    assert all(lib["num_threads"] >= 1 for lib in info["blas"])
    assert info["threads"] == numba.get_num_threads()
    assert info["cache"]["enabled"] in (True, False) and set(info["cache"]) == {"enabled", "dir", "reason", "save_error"}
    if info["cpu"] is not None:
        assert set(info["cpu"]) == {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}
        assert isinstance(info["cpu_model"], str) and "family" in info["cpu_model"]


def _multi_threaded_blas():
    """The BLAS thread counts now; skip unless BLAS is multi-threaded (nothing to restore)."""
    before = _blas_threads()
    if min(before.values()) < 2:
        pytest.skip(f"BLAS runs on one thread already: {before}")
    # Set nothing here: a threadpoolctl limit held by this thread would make it the
    # "controlling thread" and hide what the worker threads do to OpenBLAS.
    return before


def _overlap(pin):
    """Two threads whose pins overlap: A enters, B enters, A leaves, B leaves.

    Returns the BLAS thread counts B sees after A left (B's kernel still runs).
    """
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with pin():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with pin():
            b_in.set()
            a_out.wait(10)
            seen["b"] = set(_blas_threads().values())

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return seen["b"]


def test_overlapping_calls_keep_the_pin_and_restore_the_users_setting():
    # Deterministic version of the race. It used to lose the pin while B still ran
    # (A restored on leaving) and then leave BLAS pinned for good (B restored the
    # 1 it had saved on entering).
    before = _multi_threaded_blas()
    during = _overlap(single_threaded_blas)
    after = _blas_threads()
    assert (during, after) == ({1}, before)
    # the same through the guard of the kernel calls
    during = _overlap(lambda: kernel_call("probe", "float32"))
    assert (during, _blas_threads()) == ({1}, before)


def test_a_thread_holding_threadpoolctl_control_is_left_alone():
    # threadpoolctl lets one thread control OpenBLAS at a time: the pin of a worker
    # thread must neither steal the main thread's explicit limit nor restore over it.
    before = _multi_threaded_blas()
    with blas_controller().limit(limits=2):
        seen = []
        t = threading.Thread(target=lambda: seen.append(_overlap(single_threaded_blas)))
        t.start()
        t.join()
        assert seen and _blas_threads() == before
    assert _blas_threads() == before


def test_concurrent_kernel_calls_leave_the_users_blas_setting_alone():
    # 2 threads x 5 calls, a few rounds: before the reference-counted pin, the last
    # thread to leave usually wrote the pinned value back.
    before = _multi_threaded_blas()
    q = np.ones((1, 2, 64, 512), np.float32)
    lse = np.zeros((1, 2, 512), np.float32)
    numbafa.attention_bwd(q, q, q, q, q, lse)  # compiled before the threads start
    errors = []

    def calls():
        try:
            for _ in range(5):
                numbafa.attention_bwd(q, q, q, q, q, lse)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for _ in range(4):
        threads = [threading.Thread(target=calls) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert _blas_threads() == before


def test_scipys_openblas_is_pinned_by_direct_calls_without_taking_threadpoolctl_control():
    """The per-call pin goes through OpenBLAS's own C functions (a microsecond, not
    threadpoolctl's tens) and leaves threadpoolctl's controlling thread unset."""
    from numbafa.platform import blas

    libs = blas_controller().lib_controllers
    if not all(getattr(lib, "internal_api", "") == "openblas" and getattr(lib, "threading_layer", "") == "pthreads"
               for lib in libs):
        pytest.skip(f"the pinned BLAS is not OpenBLAS on pthreads here: {[lib.filepath for lib in libs]}")
    if blas._controlling_thread() is blas._UNKNOWN:
        pytest.skip("this threadpoolctl's controlling-thread state is laid out otherwise")
    direct = blas._direct_calls()
    assert direct is not None and len(direct) == len(libs)
    before = _blas_threads()
    with single_threaded_blas():
        assert [fn.get() for fn in direct] == [1] * len(direct)
        assert set(_blas_threads().values()) == {1}
        assert blas._controlling_thread() is None
    assert _blas_threads() == before
