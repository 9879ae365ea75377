"""Running a pass: the generic launcher, the compiled entries, and their Python side.

:func:`run_items` is the launcher of both passes (upstream's SPMD shards, ``flash_attn_bwd``
lines 1134-1143): an ``@njit(parallel=True)`` ``prange`` over the work items, each called by
address with one opaque argument (a pointer to the pass's typed bundles). It knows nothing of
the bundles' types, so it is compiled once for every pass, dtype and option, and Numba's
parallel backend compiles nothing else. The entries reach it, as their work items, through the
kernel table (:func:`ensure_launcher`), so no entry's code holds it.

:func:`forward_items` and :func:`backward_items` launch a pass's work items for the compiled
entries (:mod:`numbafa.kernels.entry`, which every front door calls): they
pack the bundles behind one pointer (:func:`numbafa.compiler.linking.pack`), look up the work item
compiled for exactly their types in the process's kernel table
(:data:`numbafa.compiler.linking.KERNELS`: a work item not compiled or loaded in this process is an
error, never a jump into nothing), launch the items and, in the backward, finish the units (a
split unit's dK/dV partials summed in chunk order, the sink gradients: :func:`bwd_finish_unit`).

:func:`prepare_forward` and :func:`prepare_backward` register, from Python, the work items
of the bundles' types (compiling them, or loading them from the disk cache, on the first
call), and the plugins a call's options need; :func:`call_entry` calls an entry
(:mod:`numbafa.kernels.entry`), from the second call of a signature on through the compiled
overload's entry point (no dispatcher typing of the nested bundles).

Threading layers: the launcher runs its ``prange`` on Numba's threading layer, with
``numba.get_num_threads()`` threads of the calling thread (a single work item runs on the
calling thread, without a parallel region). ``omp`` and ``tbb`` take launches from several
Python threads at once; ``workqueue`` is not thread-safe (a second concurrent launch aborts the
process), so under it launches are serialised by a lock: concurrent calls then run one after
the other, each on all its threads. Until the first launch the layer is unknown (Numba picks
it then), so the first launches take the lock too.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import prange

from ..compiler.arrays import empty, fetch_add, zeros
from ..compiler.jit import jit
from numba import types

from ..platform.blas import pin, unpin
from ..compiler.linking import (KERNELS, _key_of, address_of, call_or_raise, call_status, native_address, pack,
                                register_kernel, type_key)
from .backward import FinishArgs, bwd_finish_unit, bwd_work_item, rowsum_plugins
from .forward import fwd_work_item
from .dropout import dropout_plugins
from .scores import score_plugins
from .stored import bits_plugins
from .values import value_plugins
from .table import ensure_plugins, kernel_address

__all__ = ["run_items", "ensure_launcher", "forward_items", "backward_items", "call_entry", "call_prepared",
           "prepared_entry", "prepare_forward", "prepare_backward", "needs_finish", "threading_layer_is_thread_safe"]

_entries: dict = {}          # (entry, signature) -> the compiled overload's entry point
_launch_lock = threading.Lock()
_thread_safe_layer = None    # None: not known yet


@jit(parallel=True)
def run_items(address, args, items, status):
    """The launcher: ``status[i] = 0`` if the work item at ``address`` ran ``items[i]`` with the
    packed bundles ``args`` (an opaque word), 1 if it raised, on ``numba.get_num_threads()``
    threads. Each thread takes the next item not yet taken (an atomic counter), so a thread that
    starts late (the threading layer's workers wake after the caller) or runs slow (a shared
    machine) takes fewer items, where the ``prange``'s own equal shares made the others wait for
    it. Items write disjoint outputs, and every cross-item sum is a later, fixed-order pass, so
    the bits never depend on the thread count or on which thread ran an item. One item runs on
    the calling thread: a parallel region would only wake the threading layer's workers (~30 us
    under omp after Python work; ~0.8 ms under workqueue) for nothing to share."""
    if items.size == 1:
        status[0] = call_status(address, (args, items[0]))
    else:
        taken = zeros(1, np.int64)
        for _ in prange(items.size):   # (the first iteration a thread runs takes items until none is left)
            i = fetch_add(taken, 1)
            while i < items.size:
                status[i] = call_status(address, (args, items[i]))
                i = fetch_add(taken, 1)


@jit()
def _raise_failed(address, word, items, status):
    """After the launcher: run the first item whose ``status`` is not 0 again, in this thread, and
    let its exception propagate (an exception cannot leave a ``prange`` body). ``word``: the
    packed bundles as the launcher passes them, an opaque int64, so this is compiled once for
    every pass and dtype."""
    for i in range(items.size):
        if status[i] != 0:
            call_or_raise(address, (word, items[i]))
            raise RuntimeError("numbafa: a work item failed, then passed when run again")


#: The launcher's argument types: it is compiled for these alone.
LAUNCHER_TYPES = (types.int64, types.int64, types.Array(types.int64, 1, "C"), types.Array(types.int32, 1, "C"))
#: The launcher's key in the kernel table (:func:`ensure_launcher`).
LAUNCHER_KEY = type_key("run_items", LAUNCHER_TYPES)


def ensure_launcher() -> None:
    """Compile (or load) the launcher and record it in the kernel table (once per process)."""
    if not KERNELS.get(LAUNCHER_KEY):
        KERNELS.register(LAUNCHER_KEY, native_address(run_items, LAUNCHER_TYPES))


@jit()
def _launch(address, word, items):
    """Run the work item at ``address`` on ``items`` with the launcher, found in the kernel table
    like the work items: code of the entries that a user's ``@njit`` function holds (and Numba
    caches with it) reaches no numbafa code but through that table. ``word``: the packed bundles'
    address (:func:`~numbafa.compiler.linking.address_of`), so this is compiled once, not once
    per pass and dtype."""
    if address == 0:
        raise ValueError("numbafa: the work item of these arrays' types was not compiled or loaded in this "
                         "process (numbafa.nb: make the plan with numbafa.nb.plan in this process)")
    launcher = kernel_address(np.int64(LAUNCHER_KEY))
    if launcher == 0:
        raise ValueError("numbafa: the launcher was not compiled or loaded in this process")
    work = empty(items.size, np.int64)
    for i in range(items.size):   # (not work[:] = items: Numba compiles a shape-formatting error path for that)
        work[i] = items[i]
    status = zeros(items.size, np.int32)
    call_or_raise(launcher, (address, word, work, status))
    _raise_failed(address, word, work, status)


@jit()
def forward_items(ins, outs, plan, items):
    """The forward's work ``items`` (``unit * q_chunks + chunk``) of the bundles ``ins``, ``outs``,
    ``plan`` (:mod:`numbafa.kernels.bundles`)."""
    args = pack((ins, outs, plan))
    _launch(kernel_address(_key_of("fwd_work_item", (ins, outs, plan))), address_of(args), items)


@jit()
def backward_items(ins, outs, stats, plan, items, units):
    """The backward's work ``items``, then the ``units`` to finish (:func:`bwd_finish_unit`), in
    order: O(seqlen) work per unit, not worth a second parallel region."""
    if items.size:
        args = pack((ins, outs, stats, plan))
        _launch(kernel_address(_key_of("bwd_work_item", (ins, outs, stats, plan))), address_of(args), items)
    if units.size:
        finish = pack(FinishArgs(outs, stats, ins.sinks, plan))
        address = kernel_address(_key_of("bwd_finish_unit", FinishArgs(outs, stats, ins.sinks, plan)))
        if address == 0:
            raise ValueError("numbafa: the unit finish of these arrays' types was not compiled or loaded in this "
                             "process")
        for i in range(units.size):
            call_or_raise(address, (finish, units[i]))


# --- the Python side -----------------------------------------------------------------------

def threading_layer_is_thread_safe() -> bool:
    """True once Numba's threading layer is known and is not ``workqueue``."""
    global _thread_safe_layer
    if _thread_safe_layer is None:
        try:
            layer = numba.threading_layer()
        except ValueError:   # no parallel region has run yet: Numba has not chosen
            return False
        _thread_safe_layer = layer != "workqueue"
    return _thread_safe_layer


def call_entry(entry, args: tuple, signature):
    """Call a compiled entry (:mod:`numbafa.kernels.entry`) from Python; return what it returns.

    For a ``signature`` seen before (a hashable value that decides the Numba types of ``args``):
    the compiled overload's own entry point, which skips the dispatcher's typing of the nested
    bundles (about 10 us a call). Under ``workqueue`` the call takes the launch lock."""
    call = entry if signature is None else _entries.get((entry, signature), entry)
    result = _locked_call(call, args)
    if call is entry and signature is not None:
        compiled = entry.overloads.get(tuple(numba.typeof(a) for a in args))
        if compiled is not None:
            _entries[(entry, signature)] = compiled.entry_point
    return result


def prepared_entry(entry, signature):
    """What :func:`call_prepared` calls for ``entry`` and a ``signature`` :func:`call_entry` has
    called it with: the compiled overload's own entry point (``entry`` itself if not known)."""
    return _entries.get((entry, signature), entry)


def call_prepared(call, args: tuple):
    """:func:`call_entry` for a call whose every compiled piece a call of the same signature
    prepared and ran before (:func:`prepare_forward` / :func:`prepare_backward`; a remembered
    call of :mod:`numbafa.pipeline.core`), ``call`` its :func:`prepared_entry`: nothing is left to
    compile, so it runs inside the BLAS pin only (:func:`numbafa.platform.blas.pin`), without the
    compile announcer's context (:func:`numbafa.compiler.runtime.kernel_call`)."""
    pin()
    try:
        return _locked_call(call, args)
    finally:
        unpin()


def _locked_call(call, args: tuple):
    """``call(*args)``, under the launch lock where the threading layer is ``workqueue``."""
    if threading_layer_is_thread_safe():
        return call(*args)
    with _launch_lock:
        return call(*args)


_prepared: set = set()


def _prepare_plugins(plan) -> None:
    """Compile (or load) the plugins this plan's options need (:mod:`numbafa.kernels.table`)."""
    if plan.dropout.active:
        ensure_plugins(dropout_plugins(plan))
    if plan.scores.active:
        ensure_plugins(score_plugins(plan))


def prepare_forward(ins, outs, plan, signature=None) -> None:
    """Compile (or load) the forward's work item for these bundles' types and record it in the
    kernel table (once per ``signature``, a hashable value that determines those types for the
    caller; None: on each call), the bf16 loads' plugins for bf16 inputs, and the plugins the
    plan's options need. ``ins``: the entries' inputs (:data:`~numbafa.kernels.stored.Stored`
    records, :func:`~numbafa.kernels.stored.stored_fwd`)."""
    if signature is None or ("fwd", signature) not in _prepared:
        ensure_launcher()
        register_kernel(fwd_work_item, numba.typeof((ins, outs, plan)))
        if ins.q.is_bits:
            ensure_plugins(bits_plugins(plan) + value_plugins())
        if signature is not None:
            _prepared.add(("fwd", signature))
    _prepare_plugins(plan)


def prepare_backward(ins, outs, stats, plan, finish: bool, signature=None) -> None:
    """:func:`prepare_forward` for the backward's work item and, with ``finish``, its unit finish."""
    key = ("bwd", finish, signature)
    if signature is None or key not in _prepared:
        ensure_launcher()
        register_kernel(bwd_work_item, numba.typeof((ins, outs, stats, plan)))
        if ins.q.is_bits:
            ensure_plugins(bits_plugins(plan) + value_plugins() + rowsum_plugins(plan))
        if finish:
            register_kernel(bwd_finish_unit, numba.typeof(FinishArgs(outs, stats, ins.sinks, plan)))
        if signature is not None:
            _prepared.add(key)
    _prepare_plugins(plan)


def needs_finish(ins, plan) -> bool:
    """Whether the backward's units need :func:`~numbafa.kernels.backward.bwd_finish_unit`:
    split units (dK/dV partials to sum) or sinks (dsinks)."""
    return plan.tiling.q_chunks > 1 or ins.sinks.shape[2] > 0
