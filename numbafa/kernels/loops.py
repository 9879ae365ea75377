"""Loop scaffolding shared by the forward and the backward kernels.

Both kernels run over *work items* (the launchers' ``prange``): the upstream kernel's work
units (one per ``(batch, KV head)``, ``flash_attn_bwd`` lines 1134-1143),
each split into ``q_chunks`` items when there are few units
(:func:`numbafa.schedule.q_chunks`). Within an item, the q-heads of the GQA
group share the unit's K and V, and each q-head's queries run in Q groups of
``q_tile_group`` tiles of ``q_tile`` rows; an item owns every
``q_chunks``-th group in zigzag order.
"""

from __future__ import annotations

from ..jit import jit
from ..linking import call_or_raise

__all__ = ["decode_item", "n_q_groups", "owns_group", "group_rows", "raise_failed"]


@jit()
def decode_item(item, q_chunks, nheads_kv):
    """``(unit, chunk, batch, kv_head)`` of a work item."""
    unit = item // q_chunks
    chunk = item % q_chunks
    return unit, chunk, unit // nheads_kv, unit % nheads_kv


@jit()
def n_q_groups(seqlen_q, tiling):
    """Number of Q groups (``q_tile_group`` tiles of ``q_tile`` rows) over ``seqlen_q`` rows."""
    rows = tiling.q_tile * tiling.q_tile_group
    return (seqlen_q + rows - 1) // rows


@jit()
def owns_group(i_group, n_groups, chunk, q_chunks):
    """True if item ``chunk`` of a unit owns Q group ``i_group``.

    Zigzag ownership: groups ``g`` and ``n - 1 - g`` go to the same item, so
    under a causal mask (later groups see more keys) every item gets the
    same amount of work.
    """
    return min(i_group, n_groups - 1 - i_group) % q_chunks == chunk


@jit()
def group_rows(i_group, seqlen_q, tiling):
    """``(first row, number of rows)`` of Q group ``i_group`` (the last group may be short)."""
    size = tiling.q_tile * tiling.q_tile_group
    start = i_group * size
    return start, min(size, seqlen_q - start)


@jit()
def raise_failed(address, args, items, status):
    """After a launcher's ``prange``: run the first item whose ``status`` is not 0 again, in this
    thread, and let its exception propagate (an exception cannot leave a ``prange`` body).
    ``address``: the item's entry; ``args``: the packed arguments it takes before the item."""
    for i in range(items.size):
        if status[i] != 0:
            call_or_raise(address, (args, items[i]))
            raise RuntimeError("numbafa: a work item failed, then passed when run again")
