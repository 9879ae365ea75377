"""The njit side of the process's table of compiled kernels (:data:`numbafa.compiler.linking.KERNELS`).

:func:`kernel_address` finds a work item (or a plugin) compiled for given types by its key
(:func:`numbafa.compiler.linking.type_key`, a constant of the calling code); :func:`run_plugin` calls a
*plugin* (:func:`plugin_address`): a step compiled apart and only when a call needs it -- the code of attention dropout
and of the score variants, which a call without them never compiles. A kernel reaches a
plugin by key, at run time, so its own compiled code is the same with or without the
variant; the Python side registers the plugins a call needs (:func:`ensure_plugins`) before
the call runs. A work item or plugin not compiled in this process is a clear error, never a
jump through a null address.
"""

from __future__ import annotations

import numba
import numpy as np

from ..compiler.jit import jit
from ..compiler.linking import (KERNEL_TABLE_CAPACITY, _plugin_key, _table_words, address_of, call_or_raise, pack,
                                register_kernel)

__all__ = ["kernel_address", "plugin_address", "call_plugin", "run_plugin", "ensure_plugins"]


@jit()
def kernel_address(key):
    """The address of the function registered under ``key``, 0 if none is (open addressing over
    the table's words)."""
    n = KERNEL_TABLE_CAPACITY
    words = _table_words()   # a pointer: indexing it needs no array (nor reference counting)
    i = key % n
    for _ in range(n):
        found = words[2 * i]
        if found == key:
            return words[2 * i + 1]
        if found == 0:
            return 0
        i = (i + 1) % n
    return 0


@jit()
def plugin_address(key):
    """The address of the plugin registered under ``key``; raises if it is not (the kernels call
    it ``call_or_raise(plugin_address(key), (pack(args), 0))``: one compiled lookup for every
    plugin, no compiled function per call site)."""
    address = kernel_address(key)
    if address == 0:
        raise RuntimeError("numbafa: this call's bf16, dropout or score-variant code was not compiled in this process "
                           "(numbafa.nb: make the plan with numbafa.nb.plan, with these options and dtypes, in this "
                           "process)")
    return address


@jit(apart=True)
def run_plugin(key, word):
    """Call the plugin registered under ``key`` on the packed arguments at ``word`` (an int64, as
    :func:`numbafa.compiler.linking.address_of` gives it); its exception propagates. Compiled once
    for every plugin: a call site holds no lookup and no exception path of its own."""
    call_or_raise(plugin_address(key), (word, np.int64(0)))


@jit(inline=True)
def call_plugin(function, args):
    """Call the plugin ``function`` (registered for the types of the tuple ``args``) on ``args``."""
    run_plugin(_plugin_key(function, args), address_of(pack(args)))


_ensured: set = set()


def ensure_plugins(plugins) -> None:
    """Compile (or load) and register each ``(function, sample arguments)`` of ``plugins``: the
    sample's Numba type (or the sample itself, a Numba type) is that of the arguments the kernels
    pass (``numbafa.kernels.dropout``, ``numbafa.kernels.scores``, ``numbafa.kernels.stored``:
    ``*_plugins``), once per process and type."""
    for function, sample in plugins:
        args_type = sample if isinstance(sample, numba.types.Type) else numba.typeof(sample)
        key = (function, args_type)
        if key not in _ensured:
            register_kernel(function, args_type)
            _ensured.add(key)
