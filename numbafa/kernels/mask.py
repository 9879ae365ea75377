"""The one mask definition: which keys each query sees, and the tiles it lets us skip.

Every mask of the kernel keeps, for query ``q``, one contiguous key range
``[lo(q), hi(q))``:

* no mask: ``[0, seqlen_k)``;
* causal: ``hi = q + 1``; with a window ``w > 0`` also ``lo = q - w + 1``
  (the *static* mask, known before the data: upstream's ``affine_select``
  and its compile-time tile skipping, ``get_required_tiles_mask``);
* sequence packing intersects that with ``[bound_min[q], bound_max[q])``
  (upstream ``range_select``; the causal/window clamp of the bounds,
  ``flash_attn_bwd`` lines 1120-1131, is this intersection). For an integer
  key ``k``, ``bound_min <= k`` is ``ceil(bound_min) <= k`` and ``k <
  bound_max`` is ``k < ceil(bound_max)``, so the bounds become integers by
  ``ceil``, clamped to ``[0, seqlen_k]`` *before* the conversion: bounds of
  any magnitude, +-inf included, are exact. (NaN bounds are rejected by
  validation.)

:func:`fill_key_ranges` writes ``lo``/``hi`` once per call into the
:class:`Mask` bundle's ``key_lo``/``key_hi``; the forward reads them per
query row, the backward per key row (where the visible queries of a key are
contiguous, i.e. without packing) or per element (packing). An empty row has
``lo == hi``. Tile skipping uses the static mask only, like upstream, so it
never depends on the bounds' values.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np

from ..compiler.jit import jit
from ..compiler.scalars import max_, min_

__all__ = ["TilePos", "tile_pos", "static_key_range", "seen_keys", "fill_key_ranges", "visible_keys",
           "queries_seeing_key", "required_q_rows", "cut_by_mask"]

#: Where a score tile (or block) sits: its batch and q-head in the arrays, its first query and
#: first key (absolute, int64). Every step that needs them takes this one bundle, built by name,
#: so that no two of the four same-typed integers can be swapped in a call.
TilePos = namedtuple("TilePos", ["batch", "q_head", "q0", "k0"])


@jit(inline=True)
def tile_pos(head_like, q0, k0):
    """The :data:`TilePos` of a tile of ``head_like``'s (any record with ``batch`` and ``q_head``)
    queries from ``q0`` and keys from ``k0``."""
    return TilePos(batch=np.int64(head_like.batch), q_head=np.int64(head_like.q_head), q0=np.int64(q0),
                   k0=np.int64(k0))


@jit()
def static_key_range(q, causal, window, seqlen_k):
    """``(lo, hi)`` of the keys query ``q`` sees under the static (causal / window) mask."""
    if not causal:
        return 0, seqlen_k
    lo = q - window + 1 if window > 0 else 0
    return max_(lo, 0), min_(q + 1, seqlen_k)


@jit()
def seen_keys(mask, k_base, q_first, q_last, k0, n_k):
    """``(first key, count)`` of the keys ``[k0, k0 + n_k)`` (relative to ``k_base``) that rows
    ``q_first..q_last`` may see under the static mask: from the first row's ``lo`` to the last
    row's ``hi`` (the keys a block cut by the causal diagonal or a window edge runs on)."""
    big = np.int64(1) << 62
    lo, _ = static_key_range(q_first, mask.causal, mask.window, big)
    _, hi = static_key_range(q_last, mask.causal, mask.window, big)
    first = max_(k0, lo - k_base)
    return first, min_(k0 + n_k, hi - k_base) - first


@jit()
def _ceil_clamped(bound, seqlen_k):
    """``ceil(bound)`` clamped to ``[0, seqlen_k]``, exact for any float (+-inf included)."""
    x = min_(max_(np.float64(bound), 0.0), np.float64(seqlen_k))
    return np.int64(math.ceil(x))


@jit(entry=True)
def fill_key_ranges(causal, window, use_packing, bound_min, bound_max, seqlen_k, key_lo, key_hi):
    """Write every query's visible key range ``[key_lo[q], key_hi[q])`` (module docstring).

    ``bound_min``/``bound_max`` (float32 ``[seqlen_q]``) are read only when
    ``use_packing``. ``key_lo``/``key_hi`` are int32 ``[seqlen_q]``;
    ``lo <= hi`` always (an empty row has ``lo == hi``).
    """
    for q in range(key_lo.size):
        lo, hi = static_key_range(q, causal, window, seqlen_k)
        if use_packing:
            lo = max_(lo, _ceil_clamped(bound_min[q], seqlen_k))
            hi = min_(hi, _ceil_clamped(bound_max[q], seqlen_k))
        key_lo[q] = lo
        key_hi[q] = max_(hi, lo)


@jit()
def visible_keys(mask, q, k0, n_k):
    """Keys of the tile ``[k0, k0 + n_k)`` that query ``q`` sees, as ``[lo, hi)`` relative to ``k0``."""
    hi = min_(max_(mask.key_hi[q] - k0, 0), n_k)
    lo = min_(max_(mask.key_lo[q] - k0, 0), hi)
    return lo, hi


@jit()
def queries_seeing_key(mask, q0, n_q, k):
    """Queries of ``[q0, q0 + n_q)`` that see key ``k``, as ``[lo, hi)`` relative to ``q0``.

    Valid when the ranges are monotone in ``q`` (no packing): then the
    queries seeing ``k`` are contiguous, from the first ``q`` with ``hi(q) >
    k`` to the first with ``lo(q) > k``. Both are found by bisection in the
    same ``key_lo``/``key_hi`` the forward reads.
    """
    lo = _first_above(mask.key_hi, k, q0, q0 + n_q)
    hi = _first_above(mask.key_lo, k, lo, q0 + n_q)
    return lo - q0, hi - q0


@jit()
def _first_above(values, k, start, stop):
    """First index ``i`` in ``[start, stop)`` with ``values[i] > k`` (``stop`` if none);
    ``values`` nondecreasing there."""
    while start < stop:
        mid = (start + stop) // 2
        if values[mid] > k:
            stop = mid
        else:
            start = mid + 1
    return start


@jit()
def required_q_rows(mask, q_grp0, rows, q_tile, k_min, k_max):
    """Rows ``[r0, r1)`` of a Q group (relative to ``q_grp0``) whose Q tiles see keys ``k_min..k_max``.

    Upstream's ``get_required_tiles_mask`` on the static mask: a Q tile is
    skipped when its last row's keys all precede ``k_min`` or its first
    row's keys all follow ``k_max``. The required tiles are contiguous, so
    they are returned as one row range of whole Q tiles (the group's last
    may be short); ``r0 >= r1`` when no tile is required.
    """
    n_tiles = (rows + q_tile - 1) // q_tile
    g_lo = n_tiles
    g_hi = 0
    big = np.int64(1) << 62
    for g in range(n_tiles):
        q_min = q_grp0 + g * q_tile
        q_max = q_grp0 + min_((g + 1) * q_tile, rows) - 1
        _, hi = static_key_range(q_max, mask.causal, mask.window, big)
        lo, _ = static_key_range(q_min, mask.causal, mask.window, big)
        if hi - 1 >= k_min and lo <= k_max:
            g_lo = min_(g_lo, g)
            g_hi = g + 1
    if g_lo >= g_hi:
        return 0, 0
    return g_lo * q_tile, min_(g_hi * q_tile, rows)


@jit()
def cut_by_mask(mask, q_first, k_last):
    """True if the causal diagonal (or a window edge) may cut through a tile.

    ``k_last`` is the tile's last key, ``q_first`` its first query row. Such
    a tile runs in smaller blocks, each on only the part the static mask
    leaves visible; with a window every tile counts as cut. A scheduling
    choice: it sets BLAS shapes, not which keys are masked.
    """
    return mask.causal and (k_last > q_first or mask.window > 0)
