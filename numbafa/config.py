"""The one place for numbafa's tunables: JIT flags and the Neuron tiling constants.

Every ``@njit`` in the package is created through :func:`jit`, so its flags
(``fastmath``, ``cache``, ``error_model``, ...) come from :data:`JIT_FLAGS` and
nowhere else. ``tests/test_config.py`` greps the sources for hard-coded flags.

Flags are read when a module defining kernels is first imported. To change them,
set the environment variables below *before* ``import numbafa``:

``NUMBAFA_CACHE=0``
    Compile kernels without Numba's on-disk cache. The cache is on by
    default: a cold first call compiles for ~15-25 s per dtype, a cached one
    loads in about a second. Numba keys each cached function on its own
    file's timestamp only, so editing a helper in another module would leave
    a caller's cache stale; :func:`invalidate_stale_cache` therefore clears
    the package's cache files whenever any of its sources changed
    (checked once at import, ~1 ms).

``fastmath`` is restricted to ``{"contract"}`` and not configurable: it lets
LLVM fuse ``a * b + c`` into one FMA (faster, and never less accurate), but
forbids reassociation, flush-to-zero and "no NaN/inf" assumptions, which
would make the results depend on the compiler rather than on the algorithm
(and break the bit tricks of :mod:`numbafa.kernels.fastexp`). The bf16
rounding points are unaffected: they are explicit integer operations.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
from dataclasses import dataclass

import numba

__all__ = [
    "JIT_FLAGS",
    "jit",
    "Q_TILE",
    "K_TILE",
    "K_SUB_TILE",
    "Q_TILE_GROUP",
    "SECTION_BUDGET",
    "D_TILE_MAX",
    "FLOAT32_MIN",
    "TileConfig",
    "setup_config",
]


def _env_flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    return value not in ("", "0", "false", "no", "off")


def invalidate_stale_cache(package_dir) -> bool:
    """Delete the Numba cache files under ``package_dir`` if any ``.py`` there changed.

    A SHA-256 of every source file (path and content) is kept in
    ``__pycache__/numbafa-sources.sha256``. Returns True if caches were
    cleared. A read-only tree is left alone (Numba then caches elsewhere,
    and an installed package only changes by reinstalling, which renews
    every file's timestamp and so every cache entry).
    """
    package_dir = pathlib.Path(package_dir)
    digest = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        digest.update(str(path.relative_to(package_dir)).encode())
        digest.update(path.read_bytes())
    marker = package_dir / "__pycache__" / "numbafa-sources.sha256"
    try:
        if marker.read_text() == digest.hexdigest():
            return False
    except OSError:
        pass
    try:
        for stale in list(package_dir.rglob("__pycache__/*.nbi")) + list(package_dir.rglob("__pycache__/*.nbc")):
            stale.unlink()
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(digest.hexdigest())
    except OSError:
        return False
    return True


#: Flags shared by every jitted function of the package.
JIT_FLAGS: dict = {
    "fastmath": frozenset({"contract"}),
    "cache": _env_flag("NUMBAFA_CACHE", "1"),
    # 'numpy' error model: float division by zero gives inf/nan instead of
    # raising, as in NumPy, and lets LLVM vectorise divisions.
    "error_model": "numpy",
    "nogil": True,
}


if JIT_FLAGS["cache"]:
    invalidate_stale_cache(pathlib.Path(__file__).parent)


def jit(*, parallel: bool = False, inline: bool = False):
    """Return ``numba.njit`` configured with :data:`JIT_FLAGS`.

    Parameters
    ----------
    parallel : bool
        Only the top-level kernels that ``prange`` over work units set this.
    inline : bool
        Inline at the Numba IR level (``inline="always"``): for tiny scalar
        functions called in vectorised inner loops.
    """
    flags = dict(JIT_FLAGS, fastmath=set(JIT_FLAGS["fastmath"]))
    return numba.njit(parallel=parallel, inline="always" if inline else "never", **flags)


# --------------------------------------------------------------------------
# Tiling constants of the Neuron kernel (seed: "Tile sizes", NUMERICS.md).
# --------------------------------------------------------------------------

#: Query rows per Q tile (the partition dimension, ``pmax``).
Q_TILE = 128
#: Keys per K tile (``k_seq_tile_size``), capped by seqlen_k.
K_TILE = 512
#: Width of the transposed K sub-tiles of the dQ matmul (``k_seq_tile_size_backward``).
#: On the PE array they are 4 matmuls accumulating into one fp32 PSUM; on the CPU that is
#: one BLAS contraction over the K tile, so the kernels have no loop over them.
K_SUB_TILE = 128
#: Q tiles processed together (``q_tile_group_size``).
Q_TILE_GROUP = 4
#: Key budget of one KV section before dividing by power_of_2(head-dim tiles).
SECTION_BUDGET = 8192
#: Largest head-dim tile (the partition count).
D_TILE_MAX = 128
#: The finite float32 minimum the kernel writes into masked scores.
FLOAT32_MIN = -3.4028234663852886e38


def q_chunks(n_units: int, seqlen_q: int, bf16_accumulators: bool) -> int:
    """How many parallel items each work unit is split into (forward and backward).

    The Neuron kernel shards over ``bs * nheads_kv``. With an odd number of
    work units (e.g. MQA at batch 1) the last round of ``prange`` leaves a core
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


def power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (the seed's ``power_of_2``)."""
    if n < 1:
        raise ValueError(f"power_of_2 expects n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Every tile count of one call, derived by :func:`setup_config`.

    Attributes
    ----------
    seqlen_q, seqlen_k, d_head : int
        Problem sizes.
    q_tile : int
        Rows per Q tile (128; the last tile may be shorter).
    k_tile : int
        Keys per K tile, ``min(512, seqlen_k)`` (the last tile may be shorter).
    k_sub_tile : int
        Transposed K sub-tile width of the dQ matmul.
    q_tile_group : int
        Q tiles per group (4).
    d_tile : int
        Head-dim tile, ``ceil(d_head / ceil(d_head / 128))``.
    d_n_tiles : int
        Number of head-dim tiles.
    section_len : int
        Keys per KV section, ``8192 // power_of_2(d_n_tiles)``.
    """

    seqlen_q: int
    seqlen_k: int
    d_head: int
    q_tile: int
    k_tile: int
    k_sub_tile: int
    q_tile_group: int
    d_tile: int
    d_n_tiles: int
    section_len: int

    @property
    def q_n_tiles(self) -> int:
        return -(-self.seqlen_q // self.q_tile)

    @property
    def n_sections(self) -> int:
        return -(-self.seqlen_k // self.section_len)


def setup_config(seqlen_q: int, seqlen_k: int, d_head: int) -> TileConfig:
    """Derive the tiling of one call (the seed's ``setup_config``).

    Unlike the hardware kernel, any positive sizes are accepted: the last Q, K
    and section tiles are simply shorter.
    """
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("d_head", d_head)):
        if value < 1:
            raise ValueError(f"{name} should be >= 1, got {value}")
    d_n_tiles = math.ceil(d_head / D_TILE_MAX)
    d_tile = math.ceil(d_head / d_n_tiles)
    k_tile = min(K_TILE, seqlen_k)
    section_len = SECTION_BUDGET // power_of_2(d_n_tiles)
    # A section always holds whole K tiles.
    section_len = max(K_TILE, (section_len // K_TILE) * K_TILE)
    return TileConfig(
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        d_head=d_head,
        q_tile=Q_TILE,
        k_tile=k_tile,
        k_sub_tile=K_SUB_TILE,
        q_tile_group=Q_TILE_GROUP,
        d_tile=d_tile,
        d_n_tiles=d_n_tiles,
        section_len=section_len,
    )
