"""GEMMs through oneDNN (bf16 on the CPU's bf16 units), and the choice of the GEMM path.

Three paths compute the kernels' products (:mod:`numbafa.kernels.matmul`):

``"blas"``
    Every tile is float32 (bf16 inputs widened: exact products) and BLAS
    ``sgemm`` multiplies them. Runs everywhere.
``"onednn"``
    bf16 inputs stay bf16 tiles (the bf16-valued P and dS tiles too) and
    oneDNN's ``dnnl_gemm_bf16bf16f32`` multiplies them on the bf16 units
    (AVX512_BF16 or AMX), accumulating in float32: about twice sgemm's
    throughput per core on AVX512_BF16. float32 inputs take oneDNN's
    ``dnnl_sgemm``, 6-13 % faster per core than OpenBLAS on the kernels'
    tile shapes on Zen 4 (docs/performance.md). ``auto`` takes the path only
    where the CPU has bf16 units: on an AVX2 CPU (Zen 3) oneDNN's sgemm was
    a quarter slower than OpenBLAS on the score GEMMs and 5-10 % faster on
    the gradient GEMMs on the backward's large tiles.
``"mixed"``
    As ``"blas"`` (float32 tiles, bf16 inputs widened), but a float32 GEMM of
    at most :data:`SMALL_SGEMM` multiply-adds (``m * n * k``: the tiles of
    short sequences, the blocks of a diagonal tile) goes to oneDNN's
    ``dnnl_sgemm``, which has less fixed cost per call than OpenBLAS's (on
    Zen 3 0.61-0.92x its time up to 2**20 multiply-adds, 0.67-1.15x at 2**21,
    0.62-1.90x above; docs/performance.md). ``auto`` takes it where the CPU has no bf16 units
    and the library loads.

The path is chosen once per process by :func:`gemm_path`: ``NUMBAFA_GEMM``
(``auto``, the default; ``onednn``; ``mixed``; ``blas``) and the CPU. ``auto`` takes
oneDNN where the CPU has bf16 units and the library (PyPI
``onednn-cpu-gomp``, a default dependency on Linux x86-64) loads, ``mixed`` where
it loads on a CPU without them, else ``blas``. ``onednn``
forces it wherever the library loads: on a CPU without bf16 units float32
tiles take ``dnnl_sgemm`` and bf16 inputs are widened into float32 tiles
(oneDNN's bf16 GEMM needs the units). Forcing it where the library cannot
load raises a ``RuntimeError`` that says why (``mixed`` likewise).

:func:`forced_gemm_path` (``numbafa.forced_gemm_path``) runs the calls of a
``with`` block on a given path, whatever the process's: a context variable,
so other threads (and asyncio tasks) keep theirs. The path is part of what
a plan is made and remembered for (:func:`active_gemm_path`), so a call
inside the block never reuses a plan of the other path.

oneDNN is reached by symbol name (``numba.types.ExternalFunction``), like
BLAS, so the kernels stay cacheable; the library is loaded process-wide
(``llvmlite.binding.load_library_permanently``, :func:`load_library`) before
any package kernel is compiled against it or loaded from the disk cache
(``numbafa.compiler.jit`` loads it before every cached entry, so that machine code
referring to its symbols always finds them, in any process: a Dask worker
whose first act is to run a cached kernel included). oneDNN parallelises a
GEMM with OpenMP; each call runs single-threaded inside a work item
(:mod:`numbafa.kernels.matmul` sets the calling thread's OpenMP thread
count to 1 around it and restores it).

Numerics: the bf16 units multiply bf16 exactly and accumulate in float32
(pairwise, in their own order) and flush bf16 subnormals (below 1.2e-38) to
zero: differences of float32 summation order, like another BLAS kernel's
(docs/numerics.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import pathlib
import sys
import threading

from .cpu import cpu_flags

__all__ = ["gemm_path", "choose_gemm_path", "library_path", "GEMM_PATHS", "forced_gemm_path",
           "active_gemm_path", "bf16_units", "load_library", "ensure_symbols", "SYMBOLS", "SMALL_SGEMM",
           "SMALL_SGEMM_TEXT"]

#: Values of ``NUMBAFA_GEMM``.
GEMM_PATHS = ("auto", "onednn", "mixed", "blas")
#: The most multiply-adds (``m * n * k``) of a float32 GEMM the ``"mixed"`` path gives to oneDNN's
#: ``dnnl_sgemm`` (module docstring): on Zen 3 it was faster than OpenBLAS on every kernel GEMM
#: shape up to 2**20 and on most of 2**21, slower on most above.
SMALL_SGEMM = 1 << 21
#: :data:`SMALL_SGEMM` as the path's reason and ``backend_info`` write it.
SMALL_SGEMM_TEXT = f"2**{SMALL_SGEMM.bit_length() - 1}"
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


def bf16_units(flags=None) -> list:
    """The CPU's bf16 units among ``avx512_bf16`` and ``amx_bf16`` (``flags``: the CPU's feature
    flags; None: this CPU's, and only if oneDNN's bf16 GEMM runs on them here, which
    ``ONEDNN_MAX_CPU_ISA`` may forbid), sorted; empty where there are none (or they are unknown)."""
    if flags is not None:
        return sorted(set(flags) & set(_BF16_UNITS))
    units = sorted(set(cpu_flags() or ()) & set(_BF16_UNITS))
    return units if units and _bf16_gemm_runs() else []


@functools.lru_cache(maxsize=1)
def _bf16_gemm_runs() -> bool:
    """Whether oneDNN's ``dnnl_gemm_bf16bf16f32`` computes a 1 x 1 x 1 product here (oneDNN
    says "unimplemented" where it may not use the bf16 units, e.g. ``ONEDNN_MAX_CPU_ISA=AVX2``)."""
    if not load_library():
        return False
    import ctypes

    f = ctypes.CDLL(library_path()).dnnl_gemm_bf16bf16f32
    dim, u16p, f32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(ctypes.c_float)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_char, ctypes.c_char, dim, dim, dim, ctypes.c_float, u16p, dim, u16p, dim,
                  ctypes.c_float, f32p, dim]
    one = (ctypes.c_uint16 * 1)(0x3F80)   # bf16 1.0
    out = (ctypes.c_float * 1)(0.0)
    status = f(b"N", b"N", 1, 1, 1, 1.0, one, 1, one, 1, 0.0, out, 1)
    return status == 0 and out[0] == 1.0


def _cannot_run(library) -> str | None:
    """Why oneDNN cannot run in this process, or None."""
    if sys.platform != "linux":
        return "oneDNN is only wired up on Linux"
    if library is None:
        return "oneDNN is not installed (pip install onednn-cpu-gomp)"
    return None


def choose_gemm_path(requested: str, cpu_flags, library) -> tuple:
    """``(path, reason)``: which GEMM path the kernels take, and why.

    Parameters
    ----------
    requested : str
        ``NUMBAFA_GEMM``: ``"auto"``, ``"onednn"``, ``"mixed"`` or ``"blas"``.
    cpu_flags : set of str or None
        The CPU's feature flags (None: unknown, e.g. off Linux).
    library : str or None
        Path of the oneDNN library, None if not installed.

    Raises
    ------
    ValueError
        ``requested`` is not one of :data:`GEMM_PATHS`.
    RuntimeError
        ``"onednn"`` or ``"mixed"`` was requested where it cannot run.
    """
    if requested not in GEMM_PATHS:
        raise ValueError(f"NUMBAFA_GEMM must be one of {GEMM_PATHS}, got {requested!r}")
    if requested == "blas":
        return "blas", "NUMBAFA_GEMM=blas"
    units = bf16_units(cpu_flags or set())
    problem = _cannot_run(library)
    small = (f"float32 GEMMs of at most {SMALL_SGEMM_TEXT} multiply-adds on oneDNN's dnnl_sgemm, larger ones on "
             f"BLAS sgemm")
    if requested in ("onednn", "mixed") and problem is not None:
        raise RuntimeError(f"NUMBAFA_GEMM={requested}, but {problem}; unset it or use NUMBAFA_GEMM=blas")
    if requested == "mixed":
        return "mixed", f"NUMBAFA_GEMM=mixed, oneDNN at {library}: {small}"
    if requested == "onednn":
        if not units:
            return "onednn", (f"NUMBAFA_GEMM=onednn, oneDNN at {library}; the CPU has no bf16 units (neither "
                              f"avx512_bf16 nor amx_bf16): float32 tiles on dnnl_sgemm, bf16 inputs widened")
        return "onednn", f"NUMBAFA_GEMM=onednn: bf16 units ({', '.join(units)}) and oneDNN at {library}"
    if problem is not None:
        return "blas", problem
    if not units:
        return "mixed", f"the CPU has no bf16 units (neither avx512_bf16 nor amx_bf16), oneDNN at {library}: {small}"
    return "onednn", f"bf16 units ({', '.join(units)}) and oneDNN at {library}"


_load_lock = threading.Lock()
_loaded: list = []     # the path of the library once loaded process-wide


def load_library() -> bool:
    """Load oneDNN's library process-wide, once, if it is installed here; whether it is loaded.

    Machine code that calls ``dnnl_sgemm`` or ``dnnl_gemm_bf16bf16f32`` (a kernel compiled
    for the oneDNN path, or loaded from the disk cache) must find those symbols when it is
    linked, or LLVM aborts the process: :mod:`numbafa.compiler.jit` calls this before loading any cached
    kernel, and the matmul seam before compiling one for the oneDNN path.
    """
    if _loaded:
        return True
    library = library_path()
    if _cannot_run(library) is not None:
        return False
    with _load_lock:
        if not _loaded:
            import llvmlite.binding

            llvmlite.binding.load_library_permanently(library)
            _loaded.append(library)
    return True


#: The symbols of oneDNN and libgomp the compiled GEMM refers to (numbafa.kernels.matmul).
SYMBOLS = ("dnnl_gemm_bf16bf16f32", "dnnl_sgemm", "omp_set_num_threads", "omp_get_max_threads")
_stand_ins: list = []   # the ctypes functions standing in for missing symbols (kept alive)


def ensure_symbols() -> None:
    """Make every symbol of :data:`SYMBOLS` resolvable in this process, before code that refers
    to it is compiled or loaded: oneDNN's library (and libgomp with it) where it is installed,
    else stand-ins that return an error status (a plan takes the oneDNN path only where the
    library loads, so they are never called but by a kernel that then raises). Once per process."""
    if _stand_ins or load_library() or _stand_ins:
        return
    import ctypes

    import llvmlite.binding as llvm

    with _load_lock:
        if _stand_ins:
            return
        fail = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 3)          # dnnl_unimplemented
        one = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 1)
        nothing = ctypes.CFUNCTYPE(None, ctypes.c_int)(lambda n: None)
        stand_in = {"dnnl_gemm_bf16bf16f32": fail, "dnnl_sgemm": fail, "omp_set_num_threads": nothing,
                    "omp_get_max_threads": one}
        for name in SYMBOLS:
            if not llvm.address_of_symbol(name):
                llvm.add_symbol(name, ctypes.cast(stand_in[name], ctypes.c_void_p).value)
        _stand_ins.extend(stand_in.values())


@functools.lru_cache(maxsize=1)
def gemm_path() -> tuple:
    """``(path, reason)`` of this process, decided on first use (module docstring).

    Loads oneDNN process-wide when the path is ``"onednn"``.
    """
    flags = set(cpu_flags() or ())
    if not bf16_units():   # none, or oneDNN may not use them here
        flags -= set(_BF16_UNITS)
    path, reason = choose_gemm_path(os.environ.get("NUMBAFA_GEMM", "auto").strip().lower() or "auto",
                                    flags, library_path())
    if path != "blas":
        load_library()
    return path, reason


_forced = contextvars.ContextVar("numbafa_forced_gemm_path", default=None)


def active_gemm_path() -> str:
    """The GEMM path of a call made now: the one :func:`forced_gemm_path` set for this thread
    (or task), else the process's (:func:`gemm_path`)."""
    forced = _forced.get()
    return gemm_path()[0] if forced is None else forced


@contextlib.contextmanager
def forced_gemm_path(path: str):
    """Run the numbafa calls of a ``with`` block on GEMM path ``path``: ``"blas"``, ``"mixed"`` or ``"onednn"``.

    ``with numbafa.forced_gemm_path("blas"): ...`` computes every tile product of the calls
    made in the block, in this thread or asyncio task only, by BLAS sgemm (``"onednn"``: by
    oneDNN, as ``NUMBAFA_GEMM=onednn`` would; on a CPU without bf16 units float32 tiles take
    ``dnnl_sgemm``, and bf16 inputs are widened into float32 tiles; ``"mixed"``: the small float32
    GEMMs by oneDNN, the others by BLAS, module docstring). The results differ from
    the other path's by float32 summation order only (docs/numerics.md). Plans made in the
    block are the path's own, so no call mixes them up.

    Raises
    ------
    ValueError
        ``path`` is not ``"blas"``, ``"mixed"`` or ``"onednn"``.
    RuntimeError
        ``"onednn"`` or ``"mixed"`` where oneDNN cannot run (not installed, not Linux).
    """
    if path not in ("blas", "mixed", "onednn"):
        raise ValueError(f"path must be 'blas', 'mixed' or 'onednn', got {path!r}")
    if path != "blas":
        problem = _cannot_run(library_path())
        if problem is not None:
            raise RuntimeError(f"forced_gemm_path({path!r}), but {problem}")
        load_library()
    token = _forced.set(path)
    try:
        yield
    finally:
        _forced.reset(token)
