"""Compiling passes ahead, in a second process: :func:`compile_ahead` (``numbafa.compile_ahead``).

A cold first call compiles its pass's kernels in the calling process, on one core (Numba
compiles one function at a time; float32's forward and backward together take 20-31 s of CPU
on Zen 4, docs/performance.md, "Compile time"). On a machine with two cores or more, a second
process can compile the backward's kernels into the on-disk cache while this one compiles (and
runs) the forward; the backward's first call, after :meth:`CompileAhead.wait`, loads them
instead of compiling them. It is asked for, never automatic: a library call does not start
processes its caller did not ask for. ``python -m numbafa`` does it at its first calls' first
compile.

The second process runs :func:`numbafa.pipeline.shards.warm` (a tiny call of the pass on
stand-in arrays, the backward on zeros standing in for the forward's outputs so that it does
not compile the forward too) and ends; it hands its code over through the disk cache only, so
the cache must be on. It costs CPU: the helpers both passes share are compiled in both
processes (the README's main job on Zen 4: 37-40 -> 43-45 s of CPU, 36-38 -> 29-30 s of wall
time). Where the cache already holds the kernels, the process loads them and ends (about a
second).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from ..compiler.jit import cache_info
from ..conventions.dtypes import is_bf16

__all__ = ["compile_ahead", "CompileAhead", "start", "dtype_name", "refusal"]

#: What each second process runs: :func:`numbafa.pipeline.shards.warm` of one pass.
SCRIPT = """
import json, sys
from numbafa.pipeline.shards import warm
kernel, dtype, dropout, variants = json.loads(sys.argv[1])
warm(kernel, dtype, dropout, variants, backward_only=kernel == "backward")
"""

#: The dtype names :func:`numbafa.pipeline.shards.warm` takes, by the names a caller may give.
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "float64": "float64"}
_PASSES = ("forward", "backward")


class CompileAhead:
    """The second processes of :func:`compile_ahead`: wait for them before the passes' first
    calls (or use the object as a context manager, which waits on exit and ends them if the
    block raised). Safe to wait on from several threads."""

    def __init__(self, processes: list, specs: list):
        self._processes = processes
        #: ``[pass, dtype name, dropout, score variants]`` of each process, in order.
        self.specs = specs

    @property
    def pids(self) -> list:
        """The process ids of the second processes."""
        return [p.pid for p in self._processes]

    def done(self) -> bool:
        """Whether every second process has ended."""
        return all(p.poll() is not None for p in self._processes)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the second processes to end (at most ``timeout`` seconds in all, None: for
        as long as they run). True if each one compiled (or loaded) its pass into the cache;
        False if one failed (its traceback went to stderr; the pass then compiles in this
        process at its first call, as without :func:`compile_ahead`). Raises ``TimeoutError``
        if one still runs after ``timeout`` (it goes on: wait again, or :meth:`cancel`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self._processes:
            try:
                p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"numbafa.compile_ahead: the second process {p.pid} still compiles after "
                                   f"{timeout} s") from None
        return all(p.returncode == 0 for p in self._processes)

    def cancel(self) -> None:
        """End the second processes that still run (their passes compile at their first calls)."""
        for p in self._processes:
            if p.poll() is None:
                p.kill()
                p.wait()

    def __enter__(self) -> "CompileAhead":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.wait()
        else:
            self.cancel()


def dtype_name(dtype) -> str:
    """The :data:`_DTYPES` name of ``dtype`` (a name, a NumPy dtype or ``ml_dtypes.bfloat16``)."""
    if isinstance(dtype, str):
        name = _DTYPES.get(dtype)
    elif dtype is None:   # (np.dtype(None) is float64)
        name = None
    elif is_bf16(dtype):
        name = "bfloat16"
    else:
        try:
            name = _DTYPES.get(np.dtype(dtype).name)
        except TypeError:
            name = None
    if name is None:
        raise ValueError(f"numbafa.compile_ahead: dtype must be one of float32, bfloat16 (bf16), float16, "
                         f"float64 (a name or a NumPy dtype), got {dtype!r}")
    return name


def refusal() -> str | None:
    """Why a second process cannot hand compiled code over to this one (the on-disk cache is off,
    or a save to it failed in this process), or None."""
    cache = cache_info()
    if not cache["enabled"] or cache["save_error"]:
        return cache["save_error"] or cache["reason"]
    return None


def start(specs: list, stderr=None) -> CompileAhead:
    """Start one process per ``[pass, dtype name, dropout, score variants]`` of ``specs``
    (``stderr``: where theirs goes, ``subprocess``'s argument; None: this process's).
    Raises ``OSError`` if a process cannot be started (the ones started are ended)."""
    processes = []
    try:
        for spec in specs:
            processes.append(subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(spec)],
                                              stdout=subprocess.DEVNULL, stderr=stderr))
    except OSError:
        CompileAhead(processes, specs).cancel()
        raise
    return CompileAhead(processes, specs)


def compile_ahead(dtype="float32", *, passes=("backward",), dropout=False, score_variants=False) -> CompileAhead:
    """Compile passes' kernels in second processes, into the on-disk cache, while this one goes on.

    Typical use, on two cores or more, before a script's first forward::

        ahead = numbafa.compile_ahead("float32")          # the backward, in a second process
        o, lse = numbafa.attention_fwd(q, k, v)           # the forward compiles here meanwhile
        ahead.wait()
        grads = numbafa.attention_bwd(q, k, v, o, dy, lse)   # loads what the second process compiled

    Parameters
    ----------
    dtype : str or dtype
        The inputs' dtype: ``"float32"``, ``"bfloat16"`` (or ``"bf16"``, ``ml_dtypes.bfloat16``),
        ``"float16"``, ``"float64"``, or a NumPy dtype of these.
    passes : tuple of str
        ``"forward"`` and/or ``"backward"``: one second process each (the backward compiled on
        stand-ins for the forward's outputs, so without the forward).
    dropout, score_variants : bool
        The kernels with dropout, and with the score variants (``bias``, ``alibi_slopes``,
        ``softcap``), which are compiled apart; sinks, windows and masks need nothing more.

    Returns
    -------
    CompileAhead
        Wait for it (:meth:`CompileAhead.wait`) before the passes' first calls.

    Raises ``ValueError`` for an unknown dtype or pass, ``TypeError`` for flags that are not
    bools, and ``RuntimeError`` when the on-disk cache is off or cannot be written (the only way
    compiled code reaches this process). Each process's own compile announcement goes to stderr
    when it starts compiling (none when the cache already holds the kernels).
    """
    name = dtype_name(dtype)
    if not isinstance(passes, (tuple, list)) or not all(isinstance(p, str) for p in passes) or not passes \
            or not set(passes) <= set(_PASSES) or len(set(passes)) != len(passes):
        raise ValueError(f"numbafa.compile_ahead: passes must be a tuple of distinct 'forward', 'backward', "
                         f"got {passes!r}")
    for flag, value in (("dropout", dropout), ("score_variants", score_variants)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"numbafa.compile_ahead: {flag} must be True or False, got {value!r}")
    why = refusal()
    if why is not None:
        raise RuntimeError(f"numbafa.compile_ahead: the on-disk kernel cache is off or not writable ({why}); "
                           f"a second process hands its compiled code over through it only")
    return start([[p, name, bool(dropout), bool(score_variants)] for p in _PASSES if p in passes])
