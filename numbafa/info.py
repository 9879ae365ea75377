"""The backend report: which compute path the kernels take in this process, and on what.

:func:`backend_info` (``numbafa.backend_info()``, ``numbafa --info``) gathers
what the other modules decide: the GEMM path (:mod:`numbafa.platform.onednn`), the BLAS
libraries the kernels pin (:mod:`numbafa.platform.blas`), the CPU (:mod:`numbafa.platform.cpu`)
and the kernel cache (:mod:`numbafa.compiler.jit`).
"""

from __future__ import annotations

import numba
import numpy
import scipy

from .platform.blas import blas_controller
from .platform.cpu import cpu_flags, cpu_model
from .compiler.jit import cache_info
from .platform.onednn import SMALL_SGEMM_TEXT, bf16_units, gemm_path
from .version import __version__

__all__ = ["backend_info"]


def backend_info() -> dict:
    """Which compute path the kernels take in this process, and on what.

    Returns a JSON-serialisable dict:

    ``gemm``
        How tile matmuls are computed (:mod:`numbafa.kernels.matmul`):
        the ``path`` (``"onednn"``, ``"mixed"`` or ``"blas"``) and the ``reason`` it was
        chosen (:func:`numbafa.platform.onednn.gemm_path`: ``NUMBAFA_GEMM``, the
        CPU's bf16 units, oneDNN installed; :func:`numbafa.forced_gemm_path` changes it for
        the calls of a block, not this report); ``path`` is None, and ``reason``
        the error the kernels would raise, when ``NUMBAFA_GEMM`` names a path
        that cannot run here.
    ``float32``, ``bfloat16``, ``float16``, ``float64``
        The arithmetic of each input dtype on that path: float32 tiles and
        sgemm, oneDNN's ``dnnl_sgemm`` or BLAS (Numba's ``numba_xxgemm`` ->
        SciPy's ``cython_blas``), or by size (the mixed path); bf16 either as bf16 tiles on the bf16
        units (oneDNN) or widened into float32 tiles for BLAS sgemm, float32
        accumulation either way; fp16 values widened into float32 tiles (exact
        products: no fp16 GEMM units are used, on any CPU) and the float32
        GEMM; float64 tiles and BLAS dgemm.
    ``blas``
        The BLAS libraries threadpoolctl finds (``internal_api``,
        ``version``, ``architecture``, ``filepath``, ``num_threads`` outside
        a kernel call; inside one they are pinned to 1).
    ``threads``
        Threads each kernel call runs its work items on
        (``numba.get_num_threads()``: the launchers' ``prange``, :mod:`numbafa.kernels.launch`).
    ``cpu``
        Whether the CPU advertises ``avx2``, ``fma``, ``avx512f``,
        ``avx512_bf16`` and ``amx_bf16`` (None off Linux).
    ``cpu_model``
        The CPU's model name, vendor, family and model numbers (None off
        Linux), so that a benchmark figure names the CPU it ran on.
    ``cache``
        Whether the on-disk kernel cache is on and where:
        :func:`numbafa.compiler.jit.cache_info` (``enabled``, ``dir``, ``reason``).
    """
    try:
        path, reason = gemm_path()
    except (ValueError, RuntimeError) as exc:   # NUMBAFA_GEMM names what cannot run: report it
        path, reason = None, str(exc)

    flags = cpu_flags()
    cpu = None if flags is None else {
        name: name in flags for name in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")}
    blas = [{key: lib.info().get(key) for key in
             ("internal_api", "version", "architecture", "filepath", "num_threads")}
            for lib in blas_controller().lib_controllers]
    sgemm = {"onednn": "oneDNN dnnl_sgemm",
             "mixed": f"oneDNN dnnl_sgemm up to {SMALL_SGEMM_TEXT} multiply-adds, sgemm (numba_xxgemm -> "
                      "scipy.linalg.cython_blas) beyond"}.get(path, "sgemm")
    return {
        "numbafa": __version__,
        "numba": numba.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "gemm": {"path": path, "reason": reason},
        "float32": ("float32 tiles, sgemm (numba_xxgemm -> scipy.linalg.cython_blas), float32 accumulation"
                    if path in ("blas", None) else f"float32 tiles, {sgemm}, float32 accumulation"),
        "bfloat16": ("bf16 tiles, oneDNN dnnl_gemm_bf16bf16f32 on the bf16 units, float32 accumulation"
                     if path == "onednn" and bf16_units() else
                     f"bf16 values in float32 tiles, {sgemm}: exact bf16 products, float32 accumulation"),
        "float16": (f"fp16 values in float32 tiles, {sgemm}: exact fp16 products, float32 accumulation "
                    f"(no fp16 GEMM units used)"),
        "float64": "float64 tiles, dgemm (numba_xxgemm -> scipy.linalg.cython_blas), float64 accumulation",
        "blas": blas,
        "threads": numba.get_num_threads(),
        "cpu": cpu,
        "cpu_model": cpu_model(),
        "cache": cache_info(),
    }
