"""The guard around every kernel call: :func:`kernel_call`.

``numbafa.attention_fwd`` and ``numbafa.attention_bwd`` (and so
``numbafa.attention``) run their kernel inside ``with kernel_call(kernel,
dtype):``, which

1. serialises kernel calls when Numba's threading layer is ``workqueue``;
2. pins BLAS to one thread while any kernel runs (:mod:`numbafa.blas`);
3. announces a real compilation before it starts, once per kernel and dtype.

Thread safety
-------------
The public functions may be called from several Python threads at once. The
kernels release the GIL, and with Numba's ``tbb`` or ``omp`` threading layer
calls from different threads run concurrently (each one's ``prange`` shares
the same Numba worker threads). Numba's ``workqueue`` layer, its fallback
when neither TBB nor OpenMP is available (or when ``NUMBA_THREADING_LAYER=
workqueue``), aborts the process on concurrent parallel launches, so under it
(and before the first parallel launch, when the layer is not chosen yet and
could still be ``workqueue``) kernel calls take one process-wide lock and run
one at a time. That lock only covers numbafa: under ``workqueue``, parallel
Numba code of your own must not run in another thread while numbafa does.
Results never depend on the interleaving: each call writes only its own
outputs. The BLAS pin is shared and reference counted (see
:mod:`numbafa.blas`). The lock and the pin are reset in a child created by
``os.fork`` while another thread was inside a call.

Compile announcement
--------------------
The first call of a kernel for a dtype compiles it (roughly tens of seconds)
unless the on-disk cache (:mod:`numbafa.jit`) holds it. Just before Numba
starts compiling inside a kernel call, logger ``"numbafa"`` emits one WARNING
naming the kernel, the dtype and where the compiled code is cached. It is
triggered by Numba's ``"numba:compile"`` event, which fires only for a real
compilation (not for a cache load), so it is shown by default exactly when
there is a wait to explain. WARNING rather than INFO because Python shows
only WARNING and above when logging is not configured, and a silent
40-second first call looks like a hang; it happens at most once per kernel
and dtype per process, and normally once per machine and numbafa version.
Silence it with ``logging.getLogger("numbafa").setLevel(logging.ERROR)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import numba
from numba.core import event

from .blas import single_threaded_blas
from .jit import cache_info

__all__ = ["kernel_call", "serialises_kernel_calls"]

logger = logging.getLogger("numbafa")

# Layers that are never workqueue (Numba's NUMBA_THREADING_LAYER values).
_THREADSAFE_LAYER_CHOICES = ("tbb", "omp", "safe", "threadsafe")


def serialises_kernel_calls() -> bool:
    """True if kernel calls must run one at a time (the ``workqueue`` threading layer).

    Before the first parallel launch Numba has not chosen its layer yet; calls
    are serialised then too, unless ``NUMBA_THREADING_LAYER`` rules out
    ``workqueue``.
    """
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:  # no parallel region has run yet
        return numba.config.THREADING_LAYER not in _THREADSAFE_LAYER_CHOICES


class _CallLock:
    """The process-wide lock of the kernel calls under ``workqueue``."""

    def __init__(self):
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def held_if_needed(self):
        if serialises_kernel_calls():
            with self.lock:
                yield
        else:
            yield

    def _after_fork_in_child(self):
        self.lock = threading.RLock()  # its holder, if any, is not in the child


_CALLS = _CallLock()


class _CompileAnnouncer(event.Listener):
    """Logs one WARNING per (kernel, dtype) when Numba really compiles inside a kernel call."""

    def __init__(self):
        self._current = threading.local()   # .call: the (kernel, dtype) this thread runs
        self._announced = set()              # (kernel, dtype) already announced
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def calling(self, kernel: str, dtype: str):
        previous = getattr(self._current, "call", None)
        self._current.call = (kernel, dtype)
        try:
            yield
        finally:
            self._current.call = previous

    def on_start(self, ev):
        call = getattr(self._current, "call", None)
        if call is None:
            return
        with self._lock:
            if call in self._announced:
                return
            self._announced.add(call)
        kernel, dtype = call
        cache = cache_info()
        if cache["enabled"]:
            where = f"the compiled code is cached in {cache['dir']} for later processes"
        else:
            where = f"the on-disk cache is off ({cache['reason']}), so every new process compiles again"
        logger.warning("numbafa: compiling the %s kernel for %s inputs; this happens once per "
                       "kernel and dtype and takes roughly tens of seconds; %s.", kernel, dtype, where)

    def on_end(self, ev):
        pass

    def _after_fork_in_child(self):
        self._lock = threading.Lock()


_ANNOUNCER = _CompileAnnouncer()
event.register("numba:compile", _ANNOUNCER)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: (_CALLS._after_fork_in_child(),
                                                _ANNOUNCER._after_fork_in_child()))


@contextlib.contextmanager
def kernel_call(kernel: str, dtype: str):
    """The context every numbafa kernel runs in.

    Serialises the call under Numba's ``workqueue`` threading layer, pins
    BLAS to one thread while it runs (reference counted across threads) and
    announces a real compilation once per kernel and dtype (logger
    ``"numbafa"``, WARNING). See the module docstring for the thread-safety
    guarantees.

    Parameters
    ----------
    kernel : str
        The kernel's name for the announcement (``"forward"``, ``"backward"``).
    dtype : str
        The input dtype's name (``"float32"``, ``"bfloat16"``).
    """
    with _CALLS.held_if_needed(), single_threaded_blas(), _ANNOUNCER.calling(kernel, dtype):
        yield
