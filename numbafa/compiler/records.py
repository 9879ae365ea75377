"""Records (named tuples) in ``@njit`` code: :func:`replaced`, Numba's missing ``_replace``."""

from __future__ import annotations

from numba import types

from .jit import overload

__all__ = ["replaced"]


def replaced(record, name, value):  # pragma: no cover - replaced inside njit code
    """``record._replace(**{name: value})`` in njit code: a new record of the same class with the
    field ``name`` (a string constant) set to ``value`` (which may change that field's type)."""
    return record._replace(**{name: value})


@overload(replaced, prefer_literal=True)
def _replaced_overload(record, name, value):
    if not isinstance(record, types.BaseNamedTuple) or not isinstance(name, types.StringLiteral):
        return None
    fields = record.fields
    field = name.literal_value
    if field not in fields:
        return None
    cls = record.instance_class
    args = ", ".join(f"{f}=value" if f == field else f"{f}=record.{f}" for f in fields)
    namespace = {"cls": cls}
    exec(f"def impl(record, name, value):\n    return cls({args})\n", namespace)
    return namespace["impl"]
