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

__all__ = ["single_threaded_blas", "blas_controller", "backend_info"]


@functools.lru_cache(maxsize=1)
def blas_controller() -> ThreadpoolController:
    """The BLAS thread pools loaded in this process (found once)."""
    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def single_threaded_blas():
    """Context in which every loaded BLAS runs on one thread (restored on exit)."""
    with blas_controller().limit(limits=1):
        yield


def _cpu_flags():
    """The CPU feature flags (Linux ``/proc/cpuinfo``), or None where unavailable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def backend_info() -> dict:
    """Which compute path the kernels take in this process, and on what.

    Returns a JSON-serialisable dict:

    ``gemm``
        How tile matmuls are computed: Numba's ``numba_xxgemm`` helper, which
        calls SciPy's ``cython_blas.sgemm`` (:mod:`numbafa.kernels.gemm`).
    ``float32``, ``bfloat16``
        The arithmetic of each input dtype. bf16 values are widened into
        float32 tiles, so the same sgemm gives exact bf16 products with
        float32 accumulation; there is no separate bf16 GEMM backend.
    ``blas``
        The BLAS libraries threadpoolctl finds (``internal_api``,
        ``version``, ``architecture``, ``filepath``, ``num_threads`` outside
        a kernel call; inside one they are pinned to 1).
    ``threads``, ``threading_layer``
        Numba's thread count and layer (the layer is ``None`` until the first
        parallel kernel ran).
    ``cpu``
        Whether the CPU advertises ``avx2``, ``fma``, ``avx512f``,
        ``avx512_bf16`` and ``amx_bf16`` (None off Linux).
    ``cache``
        Whether kernels use Numba's on-disk cache (``NUMBAFA_CACHE``).
    """
    import numba
    import numpy
    import scipy

    from . import __version__
    from .jit import JIT_FLAGS

    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = None
    flags = _cpu_flags()
    cpu = None if flags is None else {
        name: name in flags for name in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")}
    blas = [{key: lib.info().get(key) for key in
             ("internal_api", "version", "architecture", "filepath", "num_threads")}
            for lib in blas_controller().lib_controllers]
    return {
        "numbafa": __version__,
        "numba": numba.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "gemm": "numba_xxgemm -> scipy.linalg.cython_blas.sgemm",
        "float32": "float32 tiles, sgemm, float32 accumulation",
        "bfloat16": "bf16 values in float32 tiles, sgemm: exact bf16 products, float32 accumulation",
        "blas": blas,
        "threads": numba.get_num_threads(),
        "threading_layer": layer,
        "cpu": cpu,
        "cache": bool(JIT_FLAGS["cache"]),
    }
