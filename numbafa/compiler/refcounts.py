"""The reference-count walk of the package's functions: only into members that can hold an array.

To increment or decrement the reference counts a value holds, Numba walks its data model
(``NRTContext.get_meminfos``): it extracts every member of every tuple, record and array in it
(one LLVM ``extractvalue`` each) and descends into each, whether or not the member's type can
hold a meminfo at all. The kernels pass bundles of a few hundred values (plans, inputs,
scratch), so on float32's forward + backward that walk made 94,000 of the 202,000 LLVM
instructions Numba generated: code that Numba builds, prints and LLVM parses, only for LLVM to
delete it (docs/performance.md, "What was tried").

While a package function is lowered (:func:`lowering`, which the compiler's lowering pass
enters: :mod:`numbafa.compiler.jit`), :func:`lean_meminfos` skips the members whose type holds
no meminfo anywhere -- decided by the same data-model traversal, once per type -- so the
meminfos it returns, and their order, are Numba's: the same reference-count operations, from
less code (``tests/test_jit.py`` compares the two walks). Any other lowering, a user's Numba
functions included, gets Numba's own walk, and so does the ``prange`` launcher
(``launch.run_items``: Numba's parallel lowering is a pass of its own). :func:`install` puts
the switch in place; the compiler calls it before the first package function is lowered
(importing this module does nothing).
"""

from __future__ import annotations

import contextlib
import threading

from numba.core.runtime.context import NRTContext

__all__ = ["install", "lowering", "lean_meminfos", "numba_meminfos"]

#: Numba's own walk.
numba_meminfos = NRTContext.get_meminfos

_state = threading.local()
#: Whether a type holds a meminfo anywhere in its data model, by type (the same answer for every
#: thread; a race writes the same value twice).
_HOLDS: dict = {}
_install_lock = threading.Lock()


def _holds_meminfo(dmm, ty, builder) -> bool:
    held = _HOLDS.get(ty)
    if held is None:
        model = dmm[ty]
        held = model.has_nrt_meminfo() or any(_holds_meminfo(dmm, t, builder) for t, _ in model.traverse(builder))
        _HOLDS[ty] = held
    return held


def lean_meminfos(nrt, builder, ty, val) -> list:
    """``NRTContext.get_meminfos`` (Numba's method: the ``(type, meminfo)`` pairs in ``val`` of
    type ``ty``), descending only into members that can hold a meminfo."""
    dmm = nrt._context.data_model_manager
    model = dmm[ty]
    meminfos = []
    if model.has_nrt_meminfo():
        meminfos.append((ty, model.get_nrt_meminfo(builder, val)))
    for member_type, getter in model.traverse(builder):
        if _holds_meminfo(dmm, member_type, builder):
            meminfos.extend(lean_meminfos(nrt, builder, member_type, getter(val)))
    return meminfos


def _get_meminfos(self, builder, ty, val):
    if getattr(_state, "depth", 0):
        return lean_meminfos(self, builder, ty, val)
    return numba_meminfos(self, builder, ty, val)


def install() -> None:
    """Make ``NRTContext.get_meminfos`` take :func:`lean_meminfos` inside :func:`lowering` (and
    Numba's own walk elsewhere); idempotent."""
    with _install_lock:
        if NRTContext.get_meminfos is not _get_meminfos:
            NRTContext.get_meminfos = _get_meminfos


@contextlib.contextmanager
def lowering():
    """While this thread lowers a package function (nests)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
