"""The CPU schedule: how one call's work is split into parallel work items.

Nothing here changes a result bit for a given problem: the split depends on
the problem only, never on the thread count (docs/architecture.md).
"""

from __future__ import annotations

from ..conventions.tiling import Q_TILE, Q_TILE_GROUP

__all__ = ["q_chunks"]


def q_chunks(n_units: int, seqlen_q: int, bf16_accumulators: bool) -> int:
    """How many parallel items each work unit is split into (forward and backward).

    The Neuron kernel shards over ``bs * nheads_kv``. With an odd number of
    work units (e.g. MQA at batch 1) the last round of work items leaves a core
    idle on a 2-core machine: one unit of three is half the run. Then every
    unit's Q groups are split in two items (zigzag), which each own their dQ
    rows and, in the backward, a private float32 dK/dV partial summed in a
    fixed order afterwards. From 9 units on, the idle tail is small and the
    partials' memory is not worth it. The rule depends on the problem only,
    never on the thread count, so results stay bitwise identical across
    thread counts. bf16 accumulators (bf16 inputs, ``mixed_precision=False``)
    are never split: their per-addition rounding fixes the order. The
    forward's rows are independent, so its split (``bf16_accumulators=False``)
    changes no result at all.
    """
    if n_units % 2 == 1 and n_units < 9 and not bf16_accumulators and seqlen_q > Q_TILE * Q_TILE_GROUP:
        return 2
    return 1
