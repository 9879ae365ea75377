"""The guard around every kernel call: :func:`kernel_call`.

``numbafa.attention_fwd`` and ``numbafa.attention_bwd`` (and so
``numbafa.attention``) run their kernel inside ``with kernel_call(kernel,
dtype):``, which

1. pins BLAS to one thread while any kernel runs (:mod:`numbafa.platform.blas`; numbafa.nb's
   passes enter the same pin from compiled code, :func:`register_pin`);
2. announces a real compilation before it starts, once per kernel and dtype.

Thread safety
-------------
The public functions may be called from several Python threads at once.
Each pass is launched by one parallel function whose ``prange`` runs its
work items on ``numba.get_num_threads()`` threads (:mod:`numbafa.kernels.launch`),
in jitted code that releases the GIL and writes only its own outputs, so
results never depend on the interleaving. Under Numba's ``omp`` and ``tbb``
threading layers concurrent calls run concurrently; ``workqueue`` aborts the
process on concurrent parallel launches, so under it the launches take a
lock and run one after the other. The BLAS pin is shared and reference
counted (see :mod:`numbafa.platform.blas`).

Compile announcement
--------------------
The first call of a kernel for a dtype compiles it unless the on-disk cache
(:mod:`numbafa.compiler.jit`) holds it: :data:`numbafa.compiler.jit.COMPILE_TIME` (docs/performance.md,
"Compile time", per CPU); a later kernel or dtype in the same process takes less. Just before Numba starts compiling inside a kernel call, logger
``"numbafa"`` emits one WARNING naming the kernel, the dtype, that figure
and where the compiled code is cached. It is triggered by Numba's
``"numba:compile"`` event, which fires only for a real compilation (not for
a cache load), so it is shown by default exactly when there is a wait to
explain. WARNING rather than INFO because Python shows only WARNING and
above when logging is not configured, and a silent first call of several
seconds looks like a hang; it happens at most once per kernel and dtype per
process, and normally once per machine and numbafa version.
Silence it with ``logging.getLogger("numbafa").setLevel(logging.ERROR)``.
A compile outside a kernel call is announced the same way inside
:class:`announced_compile`, in its own words: :mod:`numbafa.nb`'s checks and
conversions, compiled when a user's function that calls a pass is typed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

from numba.core import event

from ..platform.blas import pin, pin_addresses, unpin
from .jit import COMPILE_TIME, cache_info
from .linking import KERNELS, type_key

__all__ = ["kernel_call", "announced_compile", "PIN_KEY", "UNPIN_KEY", "register_pin"]

logger = logging.getLogger("numbafa")

#: The measured cold compile (docs/performance.md, "Compile time"), in the announcement.

class _CompileAnnouncer(event.Listener):
    """Logs one WARNING per (kernel, dtype) when Numba really compiles inside a kernel call."""

    def __init__(self):
        self._current = threading.local()   # .call: the (kernel, dtype) this thread runs
        self._announced = set()              # (kernel, dtype) already announced
        self._lock = threading.Lock()
        self._listening = False              # registered with Numba's compile events (first enter)

    def _listen(self) -> None:
        """Listen to Numba's compile events (and reset the lock in a forked child) from the first
        kernel call on: importing numbafa registers nothing."""
        with self._lock:
            if self._listening:
                return
            event.register("numba:compile", self)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=self._after_fork_in_child)
            self._listening = True

    def enter(self, call: tuple):
        """Mark this thread as running ``call`` (kernel, dtype); returns what to :meth:`leave` with."""
        if not self._listening:
            self._listen()
        previous = getattr(self._current, "call", None)
        self._current.call = call
        return previous

    def leave(self, previous) -> None:
        self._current.call = previous

    def on_start(self, ev):
        call = getattr(self._current, "call", None)
        if call is None:
            return
        with self._lock:
            if call in self._announced:
                return
            self._announced.add(call)
        if call[0] == _NOTICE:
            text = call[2]
        else:
            kernel, dtype = call
            text = f"compiling the {kernel} kernel for {dtype} inputs, once per kernel and dtype ({COMPILE_TIME})"
        cache = cache_info()
        if cache["enabled"] and cache["save_error"]:
            where = (f"saving compiled code to the on-disk cache in {cache['dir']} failed in this process "
                     f"({cache['save_error']}), so later processes compile again")
        elif cache["enabled"]:
            where = f"the compiled code is cached in {cache['dir']} for later processes"
        else:
            where = f"the on-disk cache is off ({cache['reason']}), so every new process compiles again"
        logger.warning("numbafa: %s; %s.", text, where)

    def on_end(self, ev):
        pass

    def _after_fork_in_child(self):
        self._lock = threading.Lock()


_ANNOUNCER = _CompileAnnouncer()


class kernel_call:  # noqa: N801 -- used as a function: ``with kernel_call(kernel, dtype):``
    """The context every numbafa kernel runs in.

    Pins BLAS to one thread while it runs (reference counted across
    threads) and announces a real compilation once per kernel and dtype
    (logger ``"numbafa"``, WARNING); the kernel is compiled in the calling
    thread (:mod:`numbafa.kernels.launch`). See the module docstring for the thread-safety
    guarantees.

    Parameters
    ----------
    kernel : str
        The kernel's name for the announcement (``"forward"``, ``"backward"``).
    dtype : str
        The input dtype's name (``"float32"``, ``"bfloat16"``).

    A class rather than a generator-based context manager: it runs around every
    call, and costs a microsecond this way instead of ten.
    """

    __slots__ = ("_call", "_previous")

    def __init__(self, kernel: str, dtype: str):
        self._call = (kernel, dtype)
        self._previous = None

    def __enter__(self):
        pin()
        try:
            self._previous = _ANNOUNCER.enter(self._call)
        except BaseException:
            unpin()
            raise
        return self

    def __exit__(self, *exc):
        try:
            _ANNOUNCER.leave(self._previous)
        finally:
            unpin()
        return False


_NOTICE = object()   # the first item of an announced_compile's call: never a kernel's name


class announced_compile:  # noqa: N801 -- used as a function: ``with announced_compile(key, text):``
    """Announce a real compilation inside it as :class:`kernel_call` does (logger ``"numbafa"``,
    WARNING, once per ``key`` in the process, with where the code is cached), in the words
    ``text`` ("compiling ..."), without the BLAS pin: for compiles outside a kernel call, such
    as :mod:`numbafa.nb`'s checks, compiled when a user's function that calls them is typed.
    A load from the disk cache is silent."""

    __slots__ = ("_call", "_previous")

    def __init__(self, key, text: str):
        self._call = (_NOTICE, key, text)
        self._previous = None

    def __enter__(self):
        self._previous = _ANNOUNCER.enter(self._call)
        return self

    def __exit__(self, *exc):
        _ANNOUNCER.leave(self._previous)
        return False


# --- the pin for compiled callers ------------------------------------------------------------
#
# numbafa.nb's passes run inside a user's njit code, where no ``with`` can open: they call the
# same reference-counted pin through two C functions found in the kernel table under these keys
# -- a user's code cached on disk holds the keys, never an address: the native pin's
# (numbafa.platform.blas: no GIL, no Python), or where threadpoolctl's path serves, two ctypes
# callbacks into Python (each takes the GIL for the microseconds it runs).

#: Kernel-table keys of the C functions ``void pin(void)`` and ``void unpin(void)``.
PIN_KEY = type_key("numbafa.platform.blas.pin", ())
UNPIN_KEY = type_key("numbafa.platform.blas.unpin", ())

_CALLBACK = ctypes.CFUNCTYPE(None)
_callbacks = []    # kept alive as long as the process: the table holds their addresses
_callbacks_lock = threading.Lock()


def register_pin() -> None:
    """Record the BLAS pin's C functions in the kernel table (idempotent)."""
    if KERNELS.get(PIN_KEY):
        return
    with _callbacks_lock:
        if KERNELS.get(PIN_KEY):
            return
        addresses = pin_addresses()
        if addresses is None:
            callbacks = _CALLBACK(lambda: pin()), _CALLBACK(lambda: unpin())
            _callbacks.extend(callbacks)
            addresses = tuple(ctypes.cast(cb, ctypes.c_void_p).value for cb in callbacks)
        KERNELS.register(UNPIN_KEY, addresses[1])
        KERNELS.register(PIN_KEY, addresses[0])
