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
single-threaded; a BLAS thread count another thread sets *during* a call is
kept (the last call to leave restores a library only if it still runs on the
one thread the pin set).

Per call, threadpoolctl's own get/set cost tens of microseconds (its
controlling-thread bookkeeping), a large share of a small call. Where every
pinned library is an OpenBLAS on pthreads (SciPy's), the pin is therefore
native code (:class:`_NativePin`, a few dozen LLVM instructions compiled at
the first pin): a spin lock and the count in a small word array, and
OpenBLAS's exported C functions (``openblas_get_num_threads`` /
``openblas_set_num_threads`` with the library's symbol affixes). Python
calls it through ctypes, and :mod:`numbafa.nb`'s passes call it from compiled
code by address without the GIL (:func:`pin_addresses`): a microsecond, not
the ten a Python callback costs a compiled caller. It never goes through
threadpoolctl, so it neither takes nor needs threadpoolctl's "controlling
thread" (threadpoolctl 3.8 lets one thread change OpenBLAS at a time and
ignores the others): a limit another thread holds with ``threadpool_limits``
is pinned to one thread while a kernel runs, like any other setting, and
put back afterwards (a count that thread sets meanwhile, threadpoolctl
restoring on leaving its context, say, is kept, as above).

Where a library is not OpenBLAS on pthreads (an OpenMP build, MKL, BLIS),
the pin goes through threadpoolctl in Python, and each change behaves like
a ``with threadpool_limits(...)`` of zero length (it takes control only if
no other thread holds it, and gives it back at once): only what was really
changed is restored, and a library another thread holds is left alone, at
the price of oversubscription. Compiled callers reach it through two C
callbacks into Python (:mod:`numbafa.compiler.runtime`).

``threadpoolctl`` only sees libraries that are already loaded, so SciPy's
BLAS is imported first: when the controller is built, at the first pin (before
any kernel runs), not when numbafa is imported (SciPy's linalg is a fifth of
the import). Scanning the process for libraries costs about a
millisecond, so the controller is built once (on first use) and reused; it
holds no setting of its own, only the list of BLAS libraries found.
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

__all__ = ["single_threaded_blas", "blas_controller", "pin", "unpin", "pin_addresses"]


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
    serves them all): a library that is not OpenBLAS on pthreads."""
    direct = []
    for lib in blas_controller().lib_controllers:
        if getattr(lib, "internal_api", None) != "openblas" or getattr(lib, "threading_layer", None) != "pthreads":
            return None
        try:
            direct.append(_Direct(lib))
        except (OSError, LookupError):
            return None
    return direct


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
    """Put back what threadpoolctl's path of the pin changed (``(library, count)`` pairs), where a
    library still runs on the one thread the pin set (module docstring)."""
    saved = [(lib, n) for lib, n in saved if lib.get_num_threads() == 1]
    if saved:
        _set_threads([lib for lib, _ in saved], [n for _, n in saved])


#: The native pin's words: the spin lock, the calls inside the pin, how many pins and unpins ran
#: (a check for tests), then per library the count to restore (0: nothing).
_LOCK, _ACTIVE, _PINS, _UNPINS, _SAVED = 0, 1, 2, 3, 4
_native_names = itertools.count()


class _NativePin:
    """The pin as native code, for OpenBLAS libraries on pthreads (module docstring): ``void
    pin(void)`` and ``void unpin(void)`` at :attr:`pin_address` and :attr:`unpin_address`,
    callable from Python (:meth:`pin`, :meth:`unpin`), from compiled code and from any thread,
    without the GIL. Their state is :attr:`words` (``_LOCK`` ... ``_SAVED + i``)."""

    def __init__(self, direct):
        self.direct = list(direct)
        self.words = (ctypes.c_int64 * (_SAVED + len(self.direct)))()
        self._library, self.pin_address, self.unpin_address = self._compile()
        self.pin = ctypes.CFUNCTYPE(None)(self.pin_address)
        self.unpin = ctypes.CFUNCTYPE(None)(self.unpin_address)

    @property
    def active(self) -> int:
        return self.words[_ACTIVE]

    def _compile(self):
        """Build the two functions' LLVM IR (the words' and the C functions' addresses as
        constants) and compile it with Numba's JIT (a few milliseconds)."""
        from llvmlite import ir
        from numba.core.compiler_lock import global_compiler_lock
        from numba.core.registry import cpu_target

        i64, i32 = ir.IntType(64), ir.IntType(32)
        zero, one, one32 = ir.Constant(i64, 0), ir.Constant(i64, 1), ir.Constant(i32, 1)
        get_type = ir.FunctionType(i32, []).as_pointer()
        set_type = ir.FunctionType(ir.VoidType(), [i32]).as_pointer()
        calls = [(ctypes.cast(d.get, ctypes.c_void_p).value, ctypes.cast(d.set, ctypes.c_void_p).value)
                 for d in self.direct]
        base = ctypes.addressof(self.words)
        module = ir.Module(name="numbafa_blas_pin")
        suffix = next(_native_names)

        def function(name, body):
            fn = ir.Function(module, ir.FunctionType(ir.VoidType(), []), name=f"{name}_{suffix}")
            b = ir.IRBuilder(fn.append_basic_block("entry"))
            spin, held = fn.append_basic_block("spin"), fn.append_basic_block("held")
            b.branch(spin)
            b.position_at_end(spin)

            def word(i):
                return b.inttoptr(ir.Constant(i64, base + 8 * i), i64.as_pointer())

            def get(i):
                return b.call(b.inttoptr(ir.Constant(i64, calls[i][0]), get_type), [])

            def set_(i, n):
                b.call(b.inttoptr(ir.Constant(i64, calls[i][1]), set_type), [n])

            acquired = b.extract_value(b.cmpxchg(word(_LOCK), zero, one, "acquire", "monotonic"), 1)
            b.cbranch(acquired, held, spin)
            b.position_at_end(held)
            body(b, word, get, set_)
            b.store_atomic(zero, word(_LOCK), "release", 8)
            b.ret_void()
            return fn.name

        def pin_body(b, word, get, set_):
            active = b.load(word(_ACTIVE))
            with b.if_then(b.icmp_signed("==", active, zero)):
                for i in range(len(calls)):
                    n = get(i)
                    changed = b.icmp_signed("!=", n, one32)
                    with b.if_then(changed):
                        set_(i, one32)
                    b.store(b.select(changed, b.sext(n, i64), zero), word(_SAVED + i))
            b.store(b.add(active, one), word(_ACTIVE))
            b.store(b.add(b.load(word(_PINS)), one), word(_PINS))

        def unpin_body(b, word, get, set_):
            active = b.sub(b.load(word(_ACTIVE)), one)
            b.store(active, word(_ACTIVE))
            b.store(b.add(b.load(word(_UNPINS)), one), word(_UNPINS))
            with b.if_then(b.icmp_signed("==", active, zero)):
                for i in range(len(calls)):
                    saved = b.load(word(_SAVED + i))
                    with b.if_then(b.icmp_signed("!=", saved, zero)):
                        b.store(zero, word(_SAVED + i))
                        with b.if_then(b.icmp_signed("==", get(i), one32)):   # still the pin's 1
                            set_(i, b.trunc(saved, i32))

        pin_name, unpin_name = function("numbafa_blas_pin", pin_body), function("numbafa_blas_unpin", unpin_body)
        with global_compiler_lock:
            library = cpu_target.target_context.codegen().create_library("numbafa.platform.blas.pin")
            library.add_ir_module(module)
            library.finalize()
        return library, library.get_pointer_to_function(pin_name), library.get_pointer_to_function(unpin_name)

    def after_fork_in_child(self) -> None:
        """The calls that held the pin belong to threads the child does not have: unlock, and
        restore what they saved."""
        self.words[_LOCK] = 0
        if self.words[_ACTIVE]:
            self.words[_ACTIVE] = 0
            for i, fn in enumerate(self.direct):
                saved, self.words[_SAVED + i] = self.words[_SAVED + i], 0
                if saved and fn.get() == 1:
                    fn.set(saved)


class _BlasPin:
    """The process-wide, reference-counted "BLAS on one thread" (see the module docstring): the
    native pin where every library is OpenBLAS on pthreads, threadpoolctl's path otherwise."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0      # kernel calls inside threadpoolctl's path of the pin
        self._saved = []      # (library, thread count) to restore when the last call leaves
        self._hooked = False  # decided (first enter: importing registers nothing): fork hook, native pin
        self._native = None   # the _NativePin, where every library is OpenBLAS on pthreads

    def native(self) -> Optional[_NativePin]:
        """The native pin (built at the first use), or None: threadpoolctl's path serves."""
        if not self._hooked:
            with self._lock:
                if not self._hooked:
                    if hasattr(os, "register_at_fork"):
                        os.register_at_fork(after_in_child=self._after_fork_in_child)
                    direct = _direct_calls()
                    if direct is not None:
                        try:
                            self._native = _NativePin(direct)
                        except Exception:   # (LLVM could not build it: threadpoolctl's path still pins)
                            self._native = None
                    self._hooked = True
        return self._native

    @property
    def active(self) -> int:
        """How many kernel calls are inside the pin now."""
        native = self.native()
        return native.active if native is not None else self._active

    def enter(self) -> None:
        native = self.native()
        if native is not None:
            native.pin()
            return
        with self._lock:
            if self._active == 0:
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
        native = self._native
        if native is not None:
            native.unpin()
            return
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved:
                saved, self._saved = self._saved, []
                _restore(saved)

    def _after_fork_in_child(self) -> None:
        # The calls that held the pin belong to threads the child does not have.
        self._lock = threading.Lock()
        try:
            if self._native is not None:
                self._native.after_fork_in_child()
            if self._active:
                self._active = 0
                saved, self._saved = self._saved, []
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


def pin_addresses() -> Optional[tuple]:
    """The native pin's C functions ``void pin(void)``, ``void unpin(void)`` as ``(address,
    address)``, for compiled callers; None where threadpoolctl's path serves (module docstring)."""
    native = _PIN.native()
    return None if native is None else (native.pin_address, native.unpin_address)


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
