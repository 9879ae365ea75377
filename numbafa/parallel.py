"""The launcher: runs a kernel's work items on a pool of threads.

The upstream kernel is SPMD-sharded over ``bs * nheads_kv`` work units
(``flash_attn_bwd`` lines 1134-1143): a launcher starts one program per core
and each program loops over its share. Here the launcher is
:func:`parallel_for`: it calls a jitted, GIL-free (``nogil``) function once
per work item from a pool of Python threads. The loop nest inside an item is
the kernel's.

Why not Numba's ``prange``: a ``prange`` loop compiles its body into a
separate gufunc that links, re-optimises and re-emits the whole kernel below
it, which cost about 11 s of the backward's cold compile and 5 s of the
forward's (measured with Numba's compile events, docs/performance.md); a
thread pool compiles nothing. Items write disjoint outputs and every
cross-item reduction is a later, fixed-order pass, so results are bitwise
identical for any thread count.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba

__all__ = ["parallel_for"]


def parallel_for(kernel, n_items: int, args: tuple, n_threads: int) -> None:
    """Call ``kernel(*args, item)`` for every ``item`` in ``range(n_items)``.

    Parameters
    ----------
    kernel : a Numba dispatcher compiled with ``nogil=True``
        Must write only its item's share of the outputs.
    n_items : int
    args : tuple
        Arguments before the item index, the same for every item.
    n_threads : int
        Threads to use (at most ``n_items``); 1 runs the items in order in
        the calling thread. Exceptions raised by an item propagate.
    """
    # Compile (or load from the on-disk cache) once, in the calling thread, before any
    # item runs: the threads then share the compiled code instead of queueing on Numba's
    # compiler lock, and the compile announcement (numbafa.runtime) sees its call.
    kernel.compile(tuple(numba.typeof(a) for a in args) + (numba.types.int64,))
    n_threads = max(1, min(int(n_threads), n_items))
    if n_threads == 1:
        for item in range(n_items):
            kernel(*args, item)
        return
    with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="numbafa") as pool:
        futures = [pool.submit(kernel, *args, item) for item in range(n_items)]
        for future in futures:
            future.result()
