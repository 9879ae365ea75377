"""Bounded memos of checks that passed, so that repeated calls of one shape skip them.

Small models make thousands of calls with the same shapes, dtypes and
options; the checks that depend on nothing else are a large share of such a
call's Python time. :class:`Memo` remembers their result per key (the
arguments' metadata and the scalar options: :meth:`numbafa.checks.options.AttentionOptions.scalar_key`),
holds at most ``limit`` keys (it is emptied when full), and is safe to use
from several threads (single dict operations, atomic in CPython; two threads
computing one key both store the same value). A failing check is never
remembered, so every bad call still raises.
"""

from __future__ import annotations

__all__ = ["Memo"]


class Memo:
    """A bounded ``key -> value`` store; ``None`` keys are never stored nor found."""

    __slots__ = ("_items", "limit")

    def __init__(self, limit: int = 256):
        self._items: dict = {}
        self.limit = limit

    def get(self, key):
        if key is None:
            return None
        try:
            return self._items.get(key)
        except TypeError:   # an unhashable option value: never remembered
            return None

    def put(self, key, value) -> None:
        if key is None:
            return
        if len(self._items) >= self.limit:
            self._items.clear()
        try:
            self._items[key] = value
        except TypeError:   # unhashable: not remembered
            pass

    def __len__(self) -> int:
        return len(self._items)
