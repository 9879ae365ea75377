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


def _native_pin():
    """The native pin (every pinned library an OpenBLAS on pthreads); skip where threadpoolctl's
    path serves (tested apart: test_threadpoolctls_path_pins_and_leaves_a_held_limit_alone)."""
    from numbafa.platform import blas

    native = blas._PIN.native()
    if native is None:
        pytest.skip("the pinned BLAS is not OpenBLAS on pthreads here: threadpoolctl's path serves")
    return native


def _another_count(counts) -> int:
    """A thread count that is neither the pin's 1 nor one of ``counts`` (small: any OpenBLAS takes it)."""
    return next(n for n in (2, 3, 4) if n not in counts)


def test_a_limit_another_thread_holds_is_pinned_during_a_call_and_kept_after():
    # threadpoolctl lets one thread control OpenBLAS at a time; the native pin sets OpenBLAS's
    # own count whoever holds that control: one thread while a worker's kernels run, then the
    # main thread's explicit limit again.
    before = _multi_threaded_blas()
    _native_pin()
    limit = _another_count(before.values())
    with blas_controller().limit(limits=limit):
        assert set(_blas_threads().values()) == {limit}
        seen = []
        t = threading.Thread(target=lambda: seen.append(_overlap(single_threaded_blas)))
        t.start()
        t.join()
        assert seen == [{1}] and set(_blas_threads().values()) == {limit}
    assert _blas_threads() == before


def test_a_count_set_during_a_call_is_kept():
    # e.g. threadpoolctl restoring its setting as another thread leaves a threadpool_limits
    # context while a kernel runs: the last call to leave does not write its saved count over it
    before = _multi_threaded_blas()
    native = _native_pin()
    other = _another_count(before.values())
    try:
        with single_threaded_blas():
            for fn in native.direct:
                fn.set(other)
        assert set(_blas_threads().values()) == {other}
        with single_threaded_blas():
            for fn in native.direct:
                fn.set(1)   # indistinguishable from the pin's own 1: restored
        assert set(_blas_threads().values()) == {other}
    finally:
        for fn, n in zip(native.direct, before.values()):
            fn.set(n)
    assert _blas_threads() == before


THREADPOOLCTLS_PATH = r"""
import json, sys, threading, numpy as np, numba
from numbafa.platform import blas
from numbafa.compiler import runtime
if sys.argv[1] == "not-openblas":          # as for a BLAS that is not OpenBLAS on pthreads
    blas._direct_calls = lambda: None
else:                                       # as if LLVM could not build the native pin
    def _no_native(direct):
        raise RuntimeError("no native pin")
    blas._NativePin = _no_native
import numbafa
from numbafa import nb
from threadpoolctl import threadpool_info
libs = {lib.filepath for lib in blas.blas_controller().lib_controllers}

def threads():
    return sorted(i["num_threads"] for i in threadpool_info() if i["filepath"] in libs)

out = dict(native=blas._PIN.native() is not None, before=threads())
with blas.single_threaded_blas():
    out["inside"] = threads()
out["after"] = threads()
limit = next(n for n in (2, 3, 4) if n not in out["before"])
with blas.blas_controller().limit(limits=limit):
    seen = []
    def worker():
        with blas.single_threaded_blas():
            seen.append(threads())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    out["held"], out["worker"] = [limit] * len(libs), seen[0]
out["after_limit"] = threads()
calls = []
runtime.pin, runtime.unpin = (lambda: (calls.append("pin"), blas.pin())), (lambda: (calls.append("unpin"), blas.unpin()))

@numba.njit
def fwd(plan, q, k, v, o, lse):
    nb.attention_fwd(plan, q, k, v, o, lse)

q = np.ones((1, 1, 16, 128), np.float32)
o, lse = np.empty_like(q), np.empty((1, 1, 128, 1), np.float32)
plan = nb.plan(q, q, q)
fwd(plan, q, q, q, o, lse)      # compiled (its kernel calls pin too)
calls.clear()
fwd(plan, q, q, q, o, lse)
out["nb"] = calls
print(json.dumps(out))
"""


@pytest.mark.parametrize("why", ["not-openblas", "no-native-pin"])
def test_threadpoolctls_path_pins_and_leaves_a_held_limit_alone(why):
    """Where a library is not OpenBLAS on pthreads (or the native pin cannot be built) the pin
    goes through threadpoolctl: one thread inside, the setting back after, a limit another thread
    holds left alone (threadpoolctl's rule), and numbafa.nb's passes reach it through the C
    callbacks into Python."""
    before = _multi_threaded_blas()
    proc = subprocess.run([sys.executable, "-c", THREADPOOLCTLS_PATH, why], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    n = len(before)
    assert out["native"] is False
    assert (out["inside"], out["after"], out["after_limit"]) == ([1] * n, out["before"], out["before"])
    assert out["worker"] == out["held"]      # left alone: the main thread's limit, not 1
    assert out["nb"] == ["pin", "unpin"]


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


def _controlling_thread():
    """The thread holding threadpoolctl's control of OpenBLAS (None: nobody); skip for a
    threadpoolctl whose state is laid out otherwise."""
    import threadpoolctl

    state = getattr(getattr(threadpoolctl, "OpenBLASController", None), "_SHARED_STATE", None)
    if state is None or not hasattr(state, "controlling_thread"):
        pytest.skip("this threadpoolctl's controlling-thread state is laid out otherwise")
    return state.controlling_thread


def test_scipys_openblas_is_pinned_natively_without_taking_threadpoolctl_control():
    """Where every pinned library is OpenBLAS on pthreads (SciPy's wheels) the pin is native code
    calling OpenBLAS's own C functions (a microsecond, not threadpoolctl's tens) and leaves
    threadpoolctl's controlling thread unset."""
    from numbafa.platform import blas

    libs = blas_controller().lib_controllers
    if not all(getattr(lib, "internal_api", "") == "openblas" and getattr(lib, "threading_layer", "") == "pthreads"
               for lib in libs):
        pytest.skip(f"the pinned BLAS is not OpenBLAS on pthreads here: {[lib.filepath for lib in libs]}")
    assert _controlling_thread() is None
    native = blas._PIN.native()
    assert native is not None and len(native.direct) == len(libs)
    assert blas.pin_addresses() == (native.pin_address, native.unpin_address)
    before = _blas_threads()
    pins = native.words[blas._PINS]
    with single_threaded_blas():
        assert [fn.get() for fn in native.direct] == [1] * len(native.direct)
        assert set(_blas_threads().values()) == {1} and blas._PIN.active == 1
        assert _controlling_thread() is None
    assert _blas_threads() == before and blas._PIN.active == 0 and native.words[blas._PINS] == pins + 1
