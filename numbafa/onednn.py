"""GEMMs through oneDNN (bf16 on the CPU's bf16 units), and the choice of the GEMM path.

Two paths compute the kernels' products (:mod:`numbafa.kernels.matmul`):

``"blas"``
    Every tile is float32 (bf16 inputs widened: exact products) and BLAS
    ``sgemm`` multiplies them. Runs everywhere.
``"onednn"``
    bf16 inputs stay bf16 tiles (the bf16-valued P and dS tiles too) and
    oneDNN's ``dnnl_gemm_bf16bf16f32`` multiplies them on the bf16 units
    (AVX512_BF16 or AMX), accumulating in float32: about twice sgemm's
    throughput per core on AVX512_BF16. float32 inputs take oneDNN's
    ``dnnl_sgemm``, 6-13 % faster per core than OpenBLAS on the kernels'
    tile shapes on Zen 4 (docs/performance.md). The path is taken only
    where the CPU has bf16 units: on an AVX2 CPU (Zen 3) oneDNN's sgemm was
    a quarter slower than OpenBLAS on the score GEMMs and 5-10 % faster on
    the gradient GEMMs, no gain overall, so those CPUs keep BLAS.

The path is chosen once per process by :func:`gemm_path`: ``NUMBAFA_GEMM``
(``auto``, the default; ``onednn``; ``blas``) and the CPU. ``auto`` takes
oneDNN where the CPU has bf16 units and the library (PyPI
``onednn-cpu-gomp``, a default dependency on Linux x86-64) loads; forcing
``onednn`` where it cannot run raises a ``RuntimeError`` that says why.

oneDNN is reached by symbol name (``numba.types.ExternalFunction``), like
BLAS, so the kernels stay cacheable; the library is loaded process-wide
(``llvmlite.binding.load_library_permanently``) before a kernel that uses it
is compiled or loaded. oneDNN parallelises a GEMM with OpenMP; each call runs
single-threaded inside a work item (:mod:`numbafa.kernels.matmul` sets the
calling thread's OpenMP thread count to 1 around it and restores it).

Numerics: the bf16 units multiply bf16 exactly and accumulate in float32
(pairwise, in their own order) and flush bf16 subnormals (below 1.2e-38) to
zero: differences of float32 summation order, like another BLAS kernel's
(docs/numerics.md).
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys

from .cpu import cpu_flags

__all__ = ["gemm_path", "choose_gemm_path", "library_path", "GEMM_PATHS"]

#: Values of ``NUMBAFA_GEMM``.
GEMM_PATHS = ("auto", "onednn", "blas")
_BF16_UNITS = ("avx512_bf16", "amx_bf16")


def library_path():
    """Path of oneDNN's shared library from PyPI ``onednn-cpu-gomp``, or None if not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        dist = distribution("onednn-cpu-gomp")
    except PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name.startswith("libdnnl.so"):
            path = pathlib.Path(dist.locate_file(file)).resolve()
            if path.exists():
                return str(path)
    return None


def choose_gemm_path(requested: str, cpu_flags, library) -> tuple:
    """``(path, reason)``: which GEMM path the kernels take, and why.

    Parameters
    ----------
    requested : str
        ``NUMBAFA_GEMM``: ``"auto"``, ``"onednn"`` or ``"blas"``.
    cpu_flags : set of str or None
        The CPU's feature flags (None: unknown, e.g. off Linux).
    library : str or None
        Path of the oneDNN library, None if not installed.

    Raises
    ------
    ValueError
        ``requested`` is not one of :data:`GEMM_PATHS`.
    RuntimeError
        ``"onednn"`` was requested where it cannot run.
    """
    if requested not in GEMM_PATHS:
        raise ValueError(f"NUMBAFA_GEMM must be one of {GEMM_PATHS}, got {requested!r}")
    if requested == "blas":
        return "blas", "NUMBAFA_GEMM=blas"
    units = sorted(set(cpu_flags or ()) & set(_BF16_UNITS))
    problem = None
    if not units:
        problem = "the CPU has no bf16 units (neither avx512_bf16 nor amx_bf16)"
    elif sys.platform != "linux":
        problem = "oneDNN is only wired up on Linux"
    elif library is None:
        problem = "oneDNN is not installed (pip install onednn-cpu-gomp)"
    if problem is None:
        return "onednn", f"bf16 units ({', '.join(units)}) and oneDNN at {library}"
    if requested == "onednn":
        raise RuntimeError(f"NUMBAFA_GEMM=onednn, but {problem}; unset it or use NUMBAFA_GEMM=blas")
    return "blas", problem


@functools.lru_cache(maxsize=1)
def gemm_path() -> tuple:
    """``(path, reason)`` of this process, decided on first use (module docstring).

    Loads oneDNN process-wide when the path is ``"onednn"``.
    """
    path, reason = choose_gemm_path(os.environ.get("NUMBAFA_GEMM", "auto").strip().lower() or "auto",
                                    cpu_flags(), library_path())
    if path == "onednn":
        import llvmlite.binding

        llvmlite.binding.load_library_permanently(library_path())
    return path, reason
