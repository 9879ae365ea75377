"""BLAS threading around the parallel kernels.

The kernels call BLAS (``np.dot`` inside ``@njit``, which Numba routes to
SciPy's BLAS) from every ``prange`` thread. A multi-threaded BLAS under a
multi-threaded ``prange`` oversubscribes the cores, so every kernel call runs
inside :func:`single_threaded_blas`, which pins the BLAS libraries loaded in
the process to one thread and restores their previous setting afterwards.

``threadpoolctl`` only sees libraries that are already loaded, so SciPy's
BLAS is imported first. Scanning the process for libraries costs about a
millisecond, so the controller is built once (on first use) and reused; it
holds no setting of its own, only the list of BLAS libraries found.
"""

from __future__ import annotations

import contextlib
import functools

import scipy.linalg  # noqa: F401  -- loads the BLAS Numba's np.dot calls, so it can be pinned
from threadpoolctl import ThreadpoolController

__all__ = ["single_threaded_blas", "blas_controller"]


@functools.lru_cache(maxsize=1)
def blas_controller() -> ThreadpoolController:
    """The BLAS thread pools loaded in this process (found once)."""
    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def single_threaded_blas():
    """Context in which every loaded BLAS runs on one thread (restored on exit)."""
    with blas_controller().limit(limits=1):
        yield
