"""Launching a pass from Python: the work items' addresses, the item lists, the threading layer.

:func:`run_forward` and :func:`run_backward` call the launchers
(:func:`~numbafa.kernels.forward.flash_attn_fwd`,
:func:`~numbafa.kernels.backward.flash_attn_bwd`). A launcher calls its work
item by address (:mod:`numbafa.linking`); the address is that of the work
item compiled for exactly the types of the bundles the launcher gets, looked
up by their fingerprint (the one Numba's dispatcher computes, in C, a few
microseconds) or by a caller's signature (:func:`work_item_address`) and
compiled -- or loaded from the disk cache -- on the first call with new
types. From the second launch of a signature on, the launcher is entered
through the compiled overload the dispatcher chose the first time.

Threading layers: a launcher runs its ``prange`` on Numba's threading layer,
with ``numba.get_num_threads()`` threads of the calling thread (a single
work item runs on the calling thread, without a parallel region). ``omp`` and
``tbb`` take launches from several Python threads at once; ``workqueue`` is
not thread-safe (a second concurrent launch aborts the process), so under it
launches are serialised by a lock: concurrent calls then run one after the
other, each on all its threads. Until the first launch the layer is unknown
(Numba picks it then), so the first launches take the lock too.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import _dispatcher, types

from ..linking import native_address
from .backward import bwd_finish_unit, bwd_work_item, flash_attn_bwd
from .bundles import BwdEntries
from .forward import flash_attn_fwd, fwd_work_item
from .scores import n_backward_items

__all__ = ["run_forward", "run_backward", "work_item_address", "needs_finish", "threading_layer_is_thread_safe"]

_addresses: dict = {}        # (kernel, fingerprint of the argument bundles) -> address
_entries: dict = {}          # (launcher, signature) -> the compiled overload's entry point
_launch_lock = threading.Lock()
_thread_safe_layer = None    # None: not known yet


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


def _remember_entry(launcher, args: tuple, signature) -> None:
    """After a dispatcher launch, keep the overload it ran under ``signature``."""
    if signature is None or (launcher, signature) in _entries:
        return
    compiled = launcher.overloads.get(tuple(numba.typeof(a) for a in args))
    if compiled is not None:
        _entries[(launcher, signature)] = compiled.entry_point


def _launch(launcher, args: tuple, signature=None) -> None:
    # For a signature (work_item_address) seen before: the compiled overload's own entry point,
    # which skips the dispatcher's typing of the nested bundles (about 10 us a call).
    entry = launcher if signature is None else _entries.get((launcher, signature), launcher)
    if threading_layer_is_thread_safe():
        entry(*args)
    else:
        with _launch_lock:
            entry(*args)
    if entry is launcher:
        _remember_entry(launcher, args, signature)


def work_item_address(kernel, args: tuple, signature=None) -> int:
    """Address of ``kernel`` (a work item or the unit finish) compiled for a pointer to the type
    of ``args`` (the launcher's packed bundles: ``(ins, outs, plan)`` forward, ``(ins, outs,
    stats, plan)`` backward) and an int64.

    ``signature``: a hashable value that determines the Numba types of ``args`` for this caller
    (the execution core's: the input dtype and whether there is dropout, its bundles being
    built one way), to look the address up by instead of Numba's fingerprint of ``args``
    (about 10 us for the nested bundles); None: the fingerprint."""
    if signature is not None:
        key = (kernel, "signature", signature)
        address = _addresses.get(key)
        if address is None:
            address = _addresses[key] = work_item_address(kernel, args)
        return address
    try:
        key = (kernel, _dispatcher.compute_fingerprint(args))
    except (ValueError, TypeError):   # a value Numba fingerprints no faster than it types
        key = None
    address = _addresses.get(key) if key is not None else None
    if address is None:
        address = native_address(kernel, (types.CPointer(numba.typeof(args)), types.int64))
        if key is not None:
            _addresses[key] = address
    return address


def _all(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def run_forward(ins, outs, plan, items=None, signature=None) -> None:
    """The forward's work ``items`` (default: all, ``range(units * q_chunks)``); ``signature`` as
    :func:`work_item_address`."""
    if items is None:
        items = _all(ins.q.shape[0] * ins.k.shape[1] * plan.tiling.q_chunks)
    _launch(flash_attn_fwd, (ins, outs, plan, work_item_address(fwd_work_item, (ins, outs, plan), signature), items),
            signature)


def needs_finish(ins, plan) -> bool:
    """Whether the backward's units need :func:`~numbafa.kernels.backward.bwd_finish_unit`:
    split units (dK/dV partials to sum) or sinks (dsinks)."""
    return plan.tiling.q_chunks > 1 or ins.sinks.shape[2] > 0


def run_backward(ins, outs, stats, plan, items=None, units=None, signature=None) -> None:
    """The backward's work ``items``, then the ``units`` to finish (defaults: every item
    (:func:`~numbafa.kernels.scores.n_backward_items`), then every unit if :func:`needs_finish`);
    ``signature`` as :func:`work_item_address`."""
    n_units = ins.q.shape[0] * ins.k.shape[1]
    if items is None:
        items = _all(n_backward_items(ins.q.shape[0], ins.k.shape[1], plan.tiling.q_chunks, plan.scores))
    if units is None:
        units = _all(n_units if needs_finish(ins, plan) else 0)
    args = (ins, outs, stats, plan)
    # The finish is compiled only when some call needs it (0: never called).
    entries = BwdEntries(work_item_address(bwd_work_item, args, signature),
                         work_item_address(bwd_finish_unit, args, signature) if units.size else 0)
    _launch(flash_attn_bwd, (ins, outs, stats, plan, entries, items, units), signature)
