"""The Neuron kernel's tiling: its constants and the tile counts of one call.

These are properties of the upstream kernel (``nkilib/core/attention/attention_bwd.py``,
``setup_config``), not CPU tuning knobs: they set which values are rounded
together (docs/numerics.md), so changing one changes the numerics. The CPU's
own work split is in :mod:`numbafa.kernels.schedule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Q_TILE",
    "K_TILE",
    "K_SUB_TILE",
    "Q_TILE_GROUP",
    "SECTION_BUDGET",
    "D_TILE_MAX",
    "FLOAT32_MIN",
    "TileConfig",
    "power_of_2",
    "setup_config",
]


#: Query rows per Q tile (the partition dimension, ``pmax``).
Q_TILE = 128
#: Keys per K tile (``k_seq_tile_size``), capped by seqlen_k.
K_TILE = 512
#: Width of the transposed K sub-tiles of the dQ matmul (``k_seq_tile_size_backward``).
#: On the PE array they are 4 matmuls accumulating into one fp32 PSUM; on the CPU a K tile
#: is one BLAS contraction, except a tile the causal diagonal (or a window edge) cuts
#: through, which the backward runs sub-tile by sub-tile on the Q tiles each one needs.
K_SUB_TILE = 128
#: Q tiles processed together (``q_tile_group_size``).
Q_TILE_GROUP = 4
#: Key budget of one KV section before dividing by power_of_2(head-dim tiles).
SECTION_BUDGET = 8192
#: Largest head-dim tile (the partition count).
D_TILE_MAX = 128
#: The finite float32 minimum the kernel writes into masked scores.
FLOAT32_MIN = -3.4028234663852886e38


def power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (the upstream kernel's ``power_of_2``)."""
    if n < 1:
        raise ValueError(f"power_of_2 expects n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """The tile sizes of one call, derived by :func:`setup_config`.

    Attributes
    ----------
    q_tile : int
        Rows per Q tile (128; the last tile may be shorter).
    k_tile : int
        Keys per K tile, ``min(512, seqlen_k)`` (the last tile may be shorter).
    k_sub_tile : int
        Transposed K sub-tile width of the dQ matmul.
    q_tile_group : int
        Q tiles per group (4).
    d_tile : int
        Head-dim tile of the value head dim (the one ``D = rowsum(dO * O)`` runs over),
        ``ceil(d_head_v / d_n_tiles)`` for ``d_n_tiles = ceil(d_head_v / 128)`` head-dim tiles.
    section_len : int
        Keys per KV section, ``8192 // power_of_2(d_n_tiles)``, with ``d_n_tiles`` counted for
        the larger of the two head dims (a section holds K and dK, ``d_head`` wide, and V and
        dV, ``d_head_v`` wide; upstream has one head dim, and both rules are its rule then).
    """

    q_tile: int
    k_tile: int
    k_sub_tile: int
    q_tile_group: int
    d_tile: int
    section_len: int


def setup_config(seqlen_q: int, seqlen_k: int, d_head: int, d_head_v: int | None = None) -> TileConfig:
    """Derive the tiling of one call (the upstream kernel's ``setup_config``).

    Unlike the hardware kernel, any positive sizes are accepted: the last Q, K
    and section tiles are simply shorter. ``d_head`` is the query/key head dim,
    ``d_head_v`` the value head dim (default: ``d_head``, the upstream kernel's
    only case).
    """
    d_head_v = d_head if d_head_v is None else d_head_v
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("d_head", d_head),
                        ("d_head_v", d_head_v)):
        if value < 1:
            raise ValueError(f"{name} should be >= 1, got {value}")
    d_n_tiles = math.ceil(d_head_v / D_TILE_MAX)
    d_tile = math.ceil(d_head_v / d_n_tiles)
    k_tile = min(K_TILE, seqlen_k)
    section_len = SECTION_BUDGET // power_of_2(math.ceil(max(d_head, d_head_v) / D_TILE_MAX))
    # A section always holds whole K tiles.
    section_len = max(K_TILE, (section_len // K_TILE) * K_TILE)
    return TileConfig(
        q_tile=Q_TILE,
        k_tile=k_tile,
        k_sub_tile=K_SUB_TILE,
        q_tile_group=Q_TILE_GROUP,
        d_tile=d_tile,
        section_len=section_len,
    )
