"""BLAS threading around the parallel kernels.

The kernels call BLAS (``np.dot`` inside ``@njit``, which Numba routes to
SciPy's BLAS) from every work-item thread. A multi-threaded BLAS under
multi-threaded work items oversubscribes the cores, so every kernel call runs
inside :func:`single_threaded_blas`, which pins the BLAS libraries loaded in
the process to one thread and restores their previous setting afterwards.

The BLAS thread count is process-wide, so the pin is too: it is reference
counted under a lock. The first call to enter saves each library's setting and
pins it to one thread; calls that overlap it (from other Python threads) only
count; the last one to leave restores exactly what the first one saved. The
user's own setting therefore comes back once no numbafa kernel runs, however
the calls of several threads interleave. While any kernel runs, BLAS calls of
the whole process (the user's ``np.dot`` in another thread too) are
single-threaded; a BLAS thread count set by another thread *during* a call is
overwritten when the last call ends.

Recent threadpoolctl (3.8 here) lets only one "controlling" thread change
OpenBLAS (pthreads builds) at a time and silently ignores the others. Each
change made here behaves like a ``with threadpool_limits(...)`` of zero
length (it takes control only if no other thread holds it, and gives it back
at once), and only what was really changed is restored. A library another
thread holds (a ``threadpool_limits`` context open in the main thread while
numbafa runs in workers, say) is left alone: the user's explicit setting
wins, at the price of oversubscription.

``threadpoolctl`` only sees libraries that are already loaded, so SciPy's
BLAS is imported first: when the controller is built, at the first pin (before
any kernel runs), not when numbafa is imported (SciPy's linalg is a fifth of
the import). Scanning the process for libraries costs about a
millisecond, so the controller is built once (on first use) and reused; it
holds no setting of its own, only the list of BLAS libraries found.

Per call, threadpoolctl's own get/set cost tens of microseconds (its
controlling-thread bookkeeping), a large share of a small call. An OpenBLAS
on pthreads (SciPy's) is therefore read and set by its exported C functions
(``openblas_get_num_threads`` / ``openblas_set_num_threads`` with the
library's symbol affixes: under a microsecond) whenever no thread holds
threadpoolctl's control; when one does, the change goes through threadpoolctl
as described above, so its rule still decides.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import pathlib
import threading
from typing import Optional

import threadpoolctl
from threadpoolctl import ThreadpoolController

__all__ = ["single_threaded_blas", "blas_controller", "pin", "unpin"]


@functools.lru_cache(maxsize=1)
def blas_controller() -> ThreadpoolController:
    """The BLAS thread pools the kernels call, found once: SciPy's BLAS (Numba's GEMM helper and
    its ``np.dot`` call SciPy's ``cython_blas``), or every loaded BLAS where SciPy's cannot be
    told apart (one shared by NumPy and SciPy, say). Imports SciPy's BLAS first (module docstring)."""
    import scipy
    import scipy.linalg.cython_blas  # noqa: F401  -- loads the BLAS the kernels call, so it can be pinned

    blas = ThreadpoolController().select(user_api="blas")
    scipy_dir = pathlib.Path(scipy.__file__).resolve().parent
    own = [str(scipy_dir), str(scipy_dir.parent / (scipy_dir.name + ".libs"))]
    mine = [lib for lib in blas.lib_controllers
            if any(str(pathlib.Path(lib.filepath).resolve()).startswith(d + os.sep) for d in own)]
    return ThreadpoolController._from_controllers(mine) if mine else blas


class _Direct:
    """An OpenBLAS (pthreads) library's exported ``get``/``set`` thread-count functions."""

    def __init__(self, lib):
        dll = ctypes.CDLL(lib.filepath)   # already loaded: the same handle
        for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
            get = getattr(dll, f"{prefix}openblas_get_num_threads{suffix}", None)
            set_ = getattr(dll, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                self.get, self.set = get, set_
                return
        raise LookupError(lib.filepath)


@functools.lru_cache(maxsize=1)
def _direct_calls() -> Optional[list]:
    """The direct functions of every library the pin touches, or None (then threadpoolctl
    serves them all): a library that is not OpenBLAS on pthreads, or a threadpoolctl whose
    controlling-thread state cannot be read."""
    if _controlling_thread() is _UNKNOWN:
        return None
    direct = []
    for lib in blas_controller().lib_controllers:
        if getattr(lib, "internal_api", None) != "openblas" or getattr(lib, "threading_layer", None) != "pthreads":
            return None
        try:
            direct.append(_Direct(lib))
        except (OSError, LookupError):
            return None
    return direct


_UNKNOWN = object()


def _controlling_thread():
    """The thread holding threadpoolctl's control of OpenBLAS (None: nobody), or
    ``_UNKNOWN`` for a threadpoolctl without that rule or whose state is laid out otherwise."""
    state = getattr(getattr(threadpoolctl, "OpenBLASController", None), "_SHARED_STATE", None)
    if state is None or not hasattr(state, "controlling_thread"):
        return None if not hasattr(threadpoolctl, "CONTROLLING_THREAD_OWNERSHIP") else _UNKNOWN
    thread = state.controlling_thread
    return thread if thread is not None and thread.is_alive() else None


def _pin_direct(direct) -> list:
    """Pin through the direct calls; the ``(functions, count)`` to restore."""
    saved = []
    for fn in direct:
        n = fn.get()
        if n != 1:
            fn.set(1)
            saved.append((fn, n))
    return saved


def _set_threads(libs, counts) -> None:
    """Set each library's thread count, as a zero-length ``threadpool_limits`` would."""
    ownership = getattr(threadpoolctl, "CONTROLLING_THREAD_OWNERSHIP", None)
    if ownership is not None:
        ownership.increment()
    try:
        for lib, count in zip(libs, counts):
            lib.set_num_threads(count)
    finally:
        if ownership is not None:
            ownership.decrement()  # gives control back unless this thread held it already


def _restore(saved) -> None:
    """Put back what the pin changed: ``(direct functions, count)`` pairs (:func:`_pin_direct`)
    or ``(library, count)`` pairs (threadpoolctl's path), never both."""
    if saved and isinstance(saved[0][0], _Direct):
        for fn, n in saved:
            fn.set(n)
    elif saved:
        _set_threads([lib for lib, _ in saved], [n for _, n in saved])


class _BlasPin:
    """The process-wide, reference-counted "BLAS on one thread" (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0      # kernel calls inside the pin
        self._saved = []      # (library, thread count) to restore when the last call leaves
        self._hooked = False  # the fork hook registered (first enter: importing registers nothing)

    def enter(self) -> None:
        with self._lock:
            if not self._hooked:
                if hasattr(os, "register_at_fork"):
                    os.register_at_fork(after_in_child=self._after_fork_in_child)
                self._hooked = True
            if self._active == 0:
                direct = _direct_calls()
                if direct is not None and _controlling_thread() is None:
                    self._saved = _pin_direct(direct)
                    self._active += 1
                    return
                libs = blas_controller().lib_controllers
                before = [(lib, lib.get_num_threads()) for lib in libs]
                change = [(lib, n) for lib, n in before if n != 1]
                if change:
                    _set_threads([lib for lib, _ in change], [1] * len(change))
                    # restore only what really changed (threadpoolctl may have ignored us)
                    change = [(lib, n) for lib, n in change if lib.get_num_threads() == 1]
                self._saved = change
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved:
                saved, self._saved = self._saved, []
                _restore(saved)

    def _after_fork_in_child(self) -> None:
        # The calls that held the pin belong to threads the child does not have.
        self._lock = threading.Lock()
        if self._active:
            self._active = 0
            saved, self._saved = self._saved, []
            try:
                _restore(saved)
            except Exception:  # never fail a fork
                pass


_PIN = _BlasPin()


def pin() -> None:
    """Enter the pin (:func:`single_threaded_blas`); each call is matched by one :func:`unpin`."""
    _PIN.enter()


def unpin() -> None:
    """Leave the pin entered by :func:`pin`."""
    _PIN.leave()


@contextlib.contextmanager
def single_threaded_blas():
    """Context in which every loaded BLAS runs on one thread.

    Reference counted across threads: the setting found when the first
    overlapping call entered is restored when the last one leaves.
    """
    _PIN.enter()
    try:
        yield
    finally:
        _PIN.leave()
