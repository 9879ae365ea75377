"""Python's ``min`` and ``max`` of numbers for the package's njit code, as intrinsics compiled into
their callers: no compile unit of their own.

Numba's builtin ``min``/``max`` are overloads (``numba.cpython.builtins.ol_min``/``ol_max``): a call
compiles a function of its own, once per argument types and per caller compiled apart, with Numba's
fixed cost per compiled function (~40 ms on Zen 4; the float32 forward and backward met 13 of
them). ``min_(*xs)`` and ``max_(*xs)`` emit in the caller the code those functions hold: Numba's
own ``do_minmax``, so the same result type (the arguments' unified type), the same comparisons and
the same answers, NaN included (Python's rule: ``max(1.5, nan, 2.5)`` is 2.5, the first argument
kept unless a later one compares greater). Called from Python, they are the builtins: the kernels'
helpers also run as Python (``.py_func``: the pipeline's ownership rule of Q groups is the kernels'
own, :func:`numbafa.pipeline.shards.owned_rows`).
"""

from __future__ import annotations

import operator

from numba import types
from numba.core import cgutils, typing
from numba.cpython.builtins import do_minmax
from numba.core.extending import _Intrinsic

__all__ = ["min_", "max_"]


class _Builtin(_Intrinsic):
    """An intrinsic that Python can call as well: the builtin it stands for (a plain intrinsic raises
    ``NotImplementedError`` there). Numba's cache and pickling rebuild it by its name."""

    _BUILTINS = {"min_": min, "max_": max}

    def __call__(self, *xs):
        return self._BUILTINS[self._name](*xs)


def _of_numbers(cmpop, name):
    def typer(typingctx, *xs):
        if len(xs) == 1 and isinstance(xs[0], types.StarArgTuple):
            xs = tuple(xs[0].types)
        if not xs or not all(isinstance(x, (types.Number, types.Boolean)) for x in xs):
            return None
        result = xs[0]
        for x in xs[1:]:
            result = typingctx.unify_types(result, x)
        if result is None:
            return None

        def codegen(context, builder, sig, args):
            return do_minmax(context, builder, list(sig.args[0].types), cgutils.unpack_tuple(builder, args[0]),
                             cmpop)

        return typing.signature(result, types.StarArgTuple(xs)), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = f"``{name}(*xs)``: Python's ``{name[:-1]}`` of one or more numbers (module docstring)."
    function = _Builtin(name, typer)
    function._register()
    return function


min_ = _of_numbers(operator.lt, "min_")
max_ = _of_numbers(operator.gt, "max_")
