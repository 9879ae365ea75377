"""The JIT policy: every ``@njit`` flag of the package, and its on-disk cache.

Every ``@njit`` in the package is created through :func:`jit`, so its flags
(``fastmath``, ``cache``, ``error_model``, ...) come from :data:`JIT_FLAGS` and
nowhere else. ``tests/test_jit.py`` greps the sources for hard-coded flags.

Flags are read when a module defining kernels is first imported. To change them,
set the environment variables below *before* ``import numbafa``:

``NUMBAFA_CACHE=0``
    Compile kernels without Numba's on-disk cache. The cache is on by
    default: a cold first call compiles the kernels of its dtype (tens of
    seconds, see README), a cached one loads in about a second. Numba keys each cached function on its own
    file's timestamp only, so editing a helper in another module would leave
    a caller's cache stale; :func:`invalidate_stale_cache` therefore clears
    the package's cache files whenever any of its sources changed
    (checked once at import, ~1 ms).

``fastmath`` is restricted to ``{"contract"}`` and not configurable: it lets
LLVM fuse ``a * b + c`` into one FMA (faster, and never less accurate), but
forbids reassociation, flush-to-zero and "no NaN/inf" assumptions, which
would make the results depend on the compiler rather than on the algorithm
(and break the bit tricks of :mod:`numbafa.kernels.fastexp`). The bf16
rounding points are unaffected: they are explicit integer operations.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import numba

__all__ = ["JIT_FLAGS", "jit", "invalidate_stale_cache"]


def _env_flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    return value not in ("", "0", "false", "no", "off")


def invalidate_stale_cache(package_dir) -> bool:
    """Delete the Numba cache files under ``package_dir`` if any ``.py`` there changed.

    A SHA-256 of every source file (path and content) is kept in
    ``__pycache__/numbafa-sources.sha256``. Returns True if caches were
    cleared. A read-only tree is left alone (Numba then caches elsewhere,
    and an installed package only changes by reinstalling, which renews
    every file's timestamp and so every cache entry).
    """
    package_dir = pathlib.Path(package_dir)
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        digest.update(str(path.relative_to(package_dir)).encode())
        digest.update(path.read_bytes())
    marker = package_dir / "__pycache__" / "numbafa-sources.sha256"
    try:
        if marker.read_text() == digest.hexdigest():
            return False
    except OSError:
        pass
    try:
        for stale in list(package_dir.rglob("__pycache__/*.nbi")) + list(package_dir.rglob("__pycache__/*.nbc")):
            stale.unlink()
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(digest.hexdigest())
    except OSError:
        return False
    return True


#: Flags shared by every jitted function of the package.
JIT_FLAGS: dict = {
    "fastmath": frozenset({"contract"}),
    "cache": _env_flag("NUMBAFA_CACHE", "1"),
    # 'numpy' error model: float division by zero gives inf/nan instead of
    # raising, as in NumPy, and lets LLVM vectorise divisions.
    "error_model": "numpy",
    "nogil": True,
}


if JIT_FLAGS["cache"]:
    invalidate_stale_cache(pathlib.Path(__file__).parent)


def jit(*, parallel: bool = False, inline: bool = False):
    """Return ``numba.njit`` configured with :data:`JIT_FLAGS`.

    Parameters
    ----------
    parallel : bool
        Only the top-level kernels that ``prange`` over work units set this.
    inline : bool
        Inline at the Numba IR level (``inline="always"``): for tiny scalar
        functions called in vectorised inner loops.
    """
    flags = dict(JIT_FLAGS, fastmath=set(JIT_FLAGS["fastmath"]))
    return numba.njit(parallel=parallel, inline="always" if inline else "never", **flags)
