"""The CPU schedule: how one call's work is split into parallel work items.

Nothing here changes a result bit for a given problem: the split depends on
the problem only, never on the thread count (docs/architecture.md).
"""

from __future__ import annotations

from ..conventions.tiling import Q_TILE, Q_TILE_GROUP

__all__ = ["q_chunks", "fwd_q_chunks", "q_group_rows"]

#: The forward's smallest Q group when a short unit is split (rows).
_MIN_SPLIT_ROWS = 32


def q_chunks(n_units: int, seqlen_q: int, bf16_accumulators: bool, causal: bool) -> int:
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
    are never split: their per-addition rounding fixes the order. Otherwise the
    backward splits where the forward does (:func:`fwd_q_chunks`: units longer
    than 64 rows; float32 accumulators' additions reordered, no rounding point
    moved: docs/numerics.md), a unit of at most two Q tiles only under a causal
    mask: there its Q groups of less than a Q tile skip the keys their rows do
    not see, while without a mask the smaller GEMMs cost more than the second
    core gives (docs/performance.md, "Both cores for every shape").
    """
    if bf16_accumulators or (seqlen_q <= 2 * Q_TILE and not causal):
        return 1
    return fwd_q_chunks(n_units, seqlen_q)


def fwd_q_chunks(n_units: int, seqlen_q: int) -> int:
    """:func:`q_chunks` of the forward: its rows are independent, so short sequences split too
    (into the smaller Q groups of :func:`q_group_rows`), down to the three 32-row groups the
    zigzag needs to give both items work."""
    if n_units % 2 == 1 and n_units < 9 and seqlen_q > 2 * _MIN_SPLIT_ROWS:
        return 2
    return 1


def q_group_rows(seqlen_q: int, chunks: int, backward: bool) -> int:
    """Rows of a Q group: Neuron's ``q_tile_group`` Q tiles (512 rows), except in a unit split
    into two items (``chunks > 1``) whose 512-row groups would be fewer than three (two groups
    are one zigzag pair, :func:`numbafa.kernels.loops.owns_group`, all the first item's): then
    smaller groups, at least three: a multiple of 32 rows giving at least four groups (a
    quarter Q tile each at 128 rows), in the backward (causal) up to 256 rows only (two Q tiles),
    whose blocks then run on the keys their rows may see (:func:`numbafa.kernels.mask.seen_keys`).
    Longer units' backward groups stay whole Q tiles (128 rows up to 512 rows, 256 up to 1024:
    a group's rows are the contraction of its dK/dV GEMMs).
    A CPU blocking choice: the K tile order sets a forward row's arithmetic, but a GEMM library
    may pick its kernel, and so a row's summation order, by the call's row count, so a split
    unit's bits (``seqlen_q`` up to 1024, an odd number of units below 9) are not those of the
    same sequence in an unsplit batch."""
    full = Q_TILE * Q_TILE_GROUP
    if chunks == 1 or seqlen_q > 2 * full:
        return full
    if backward and seqlen_q > 2 * Q_TILE:
        return Q_TILE * -(-seqlen_q // full)
    return max(_MIN_SPLIT_ROWS, -(-seqlen_q // (4 * _MIN_SPLIT_ROWS)) * _MIN_SPLIT_ROWS)
