"""Attention dropout: the keep mask as a pure function of its coordinates.

The mask is drawn by Philox-4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator: the
random words of an element are a function of its *counter* and a *key*,
not of a stream position, so any tile can draw its elements in any order.
For attention element ``(batch, q_head, query, key)``::

    call    = (key // 64) * 16 + key % 16
    counter = (call, query, q_head, batch)         # four 32-bit words
    words   = philox4x32_10(counter, call_key)     # four 32-bit words
    word    = words[(key % 64) // 16]
    keep    = word >= threshold,   threshold = round(dropout_p * 2**32)

so the four words of a call are keys 16 apart in a block of 64. Both
kernels' loops then vectorise over consecutive calls: the backward's
``[keys, queries]`` tiles along the queries (four key rows per call), the
forward's ``[queries, keys]`` tiles along a row (each word a run of 16
consecutive keys). With four *adjacent* keys per call, the forward had to
interleave the words into its rows, which took as long as drawing them. The
``call_key`` (two words) is derived once per call from the user's
``seed`` and ``seed_offset`` (:func:`derive_key`): the Philox of counter
``(offset_lo, offset_hi, 0, 0)`` under key ``(seed_lo, seed_hi)``, its
first two words. Nothing here depends on the tiling, the Q chunks, the KV
sections, the thread count or the machine, so the backward regenerates
exactly the forward's mask. ``batch``, ``q_head``, ``query`` and ``key`` are
absolute: the kernels index queries and keys absolutely, and add the
bundle's ``batch0``/``head0`` to their batch and head indices, so a kernel
given a slice of the batches and heads (a share of :mod:`numbafa.pipeline.shards`)
draws the whole problem's mask for them (:func:`with_origin`).

A kept element is scaled by ``scale = float32(1 / (1 - dropout_p))`` (float64 for float64 inputs):
``P~ = P * Z * scale``. The kernels apply it through a *multiplier* tile
``M = Z * scale`` (0 or ``scale``): the backward writes them into a
``[keys, queries]`` tile (:func:`fill_multipliers`), used twice; the forward
multiplies its ``[queries, keys]`` P tile row by row (:func:`drop_rows`).

The float64 and rounding-point goldens (:mod:`numbafa.golden`) have an
implementation of their own, in NumPy; ``tests/test_dropout.py`` checks both
against the Random123 known-answer vectors and against each other.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..conventions.dtypes import round_inplace
from ..compiler.jit import jit
from ..compiler.linking import unpack
from .mask import TilePos

__all__ = ["Dropout", "make_dropout", "with_origin", "derive_key", "philox4x32_10", "philox_words",
           "fill_multipliers", "drop_rows", "drop_scores", "drop_probabilities", "drop_tile", "dropout_plugins"]

#: Dropout of one call: ``active`` (bool: False, no dropout; the kernels skip all of it),
#: ``threshold`` (int, keep iff word >= it), ``scale`` (the accumulator dtype, 1 / (1 - p)),
#: ``key0``/``key1`` (ints < 2**32, the call key), ``batch0``/``head0`` (ints: the absolute batch
#: and q-head of the arrays' batch 0 and head 0, which the counter adds to the kernels' array
#: indices; 0 in the single-process call, a share's origin in :mod:`numbafa.pipeline.shards`).
Dropout = namedtuple("Dropout", ["active", "threshold", "scale", "key0", "key1", "batch0", "head0"])

_MASK32 = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_SHIFT = np.uint64(32)
_ZERO = np.float32(0.0)

#: Keys are drawn in blocks of 64: Philox calls ``16 b .. 16 b + 15`` give the 64 keys of
#: block ``b``, word ``r`` of call ``16 b + g`` being key ``64 b + 16 r + g``.
BLOCK_KEYS = 64
CALLS_PER_BLOCK = 16


@jit(inline=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``: four words.

    Arguments and results are ``uint64`` values holding 32-bit words. A
    round multiplies counter words 0 and 2 by the Philox constants (64-bit
    products, split into high and low words) and mixes the high halves with
    the other two words and the key; the key gets the Weyl constants added
    between rounds. The masks tell LLVM the high halves are zero, so the
    products vectorise (``vpmuludq``). The ten rounds are written out, in one
    function, inlined at the Numba IR level into the draw loops: a loop (even
    of constant length) or a call kept LLVM from vectorising those loops (10x
    slower), and nested inlined helpers cost seconds of compile time.
    """
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    p0, p1 = _M0 * (c0 & _MASK32), _M1 * (c2 & _MASK32)
    c0, c1, c2, c3 = (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
                      ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)
    return c0, c1, c2, c3


@jit(entry=True)
def philox_words(c0, c1, c2, c3, k0, k1):
    """:func:`philox4x32_10` as a function of its own, callable from Python (ints in, a tuple
    of four ints out) and from the rarely taken edge paths of the draw loops (inlining it
    there too would add compile time and no speed). The package's calls pass six uint64s: one
    compile for all of them."""
    return philox4x32_10(np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3),
                         np.uint64(k0), np.uint64(k1))


def derive_key(seed: int, seed_offset: int) -> tuple:
    """The call key ``(k0, k1)`` of ``(seed, seed_offset)``, both ints in ``[0, 2**64)``."""
    words = philox_words(*(np.uint64(x) for x in (seed_offset & 0xFFFFFFFF, seed_offset >> 32, 0, 0,
                                                  seed & 0xFFFFFFFF, seed >> 32)))
    return int(words[0]), int(words[1])


def make_dropout(dropout_p: float, seed: int, seed_offset: int, dtype=np.float32):
    """The :data:`Dropout` bundle of validated arguments (``active`` False for ``dropout_p ==
    0``); its ``scale`` in ``dtype``, the kernels' accumulator dtype (float32, or float64).

    Its origin ``batch0``/``head0`` is 0, a whole problem's; :func:`with_origin`
    moves it for a share of the batches and heads. The bundle has one type whether dropout is
    on or off: the kernels test ``active`` per tile, so a call with dropout runs the kernels a
    call without it compiled (and a call without it runs none of the dropout code).
    """
    scale = np.dtype(dtype).type(1.0)
    if dropout_p == 0.0:
        return Dropout(active=False, threshold=0, scale=scale, key0=0, key1=0, batch0=0, head0=0)
    threshold = min(int(round(dropout_p * 2.0 ** 32)), 2 ** 32)
    k0, k1 = derive_key(seed, seed_offset)
    return Dropout(active=True, threshold=threshold, scale=np.dtype(dtype).type(1.0 / (1.0 - dropout_p)),
                   key0=k0, key1=k1, batch0=0, head0=0)


def with_origin(dropout, batch0: int, head0: int):
    """``dropout`` for arrays whose batch 0 / head 0 are absolute batch ``batch0`` / q-head
    ``head0`` (plain ints: the same compiled kernels)."""
    return dropout._replace(batch0=int(batch0), head0=int(head0))


@jit(inline=True)
def _multiplier(word, threshold, scale):
    return scale if word >= threshold else _ZERO


@jit()
def fill_multipliers(out, at, dropout):
    """Write ``M = Z * scale`` into a ``[keys, queries]`` tile (the backward's orientation).

    Parameters
    ----------
    out : float32 ``[n_k, n_q]``, C-contiguous rows
        Row ``j`` is key ``at.k0 + j``, column ``i`` query ``at.q0 + i`` (absolute indices).
    at : :data:`~numbafa.kernels.mask.TilePos`
        ``at.q_head``, ``at.batch``: the elements' q-head and batch in the arrays; the counter's
        last two words are ``q_head + dropout.head0`` and ``batch + dropout.batch0`` (absolute).
    dropout : :data:`Dropout`

    The four words of a Philox call are four key rows: the loop runs along
    the queries, and vectorises. Rows outside the tile (at its edges) are
    not written.
    """
    n_k, n_q = out.shape
    k0, q0 = at.k0, at.q0
    thr = np.uint64(dropout.threshold)
    scale = dropout.scale
    key0 = np.uint64(dropout.key0)
    key1 = np.uint64(dropout.key1)
    c2 = np.uint64(at.q_head + dropout.head0)
    c3 = np.uint64(at.batch + dropout.batch0)
    for blk in range(k0 // BLOCK_KEYS, (k0 + n_k + BLOCK_KEYS - 1) // BLOCK_KEYS):
        for g in range(CALLS_PER_BLOCK):
            c0 = np.uint64(blk * CALLS_PER_BLOCK + g)
            j0 = blk * BLOCK_KEYS + g - k0          # row of word 0; word r is CALLS_PER_BLOCK rows on
            j1 = j0 + CALLS_PER_BLOCK
            j2 = j1 + CALLS_PER_BLOCK
            j3 = j2 + CALLS_PER_BLOCK
            if j0 >= 0 and j3 < n_k:
                for i in range(n_q):
                    w0, w1, w2, w3 = philox4x32_10(c0, np.uint64(q0 + i), c2, c3, key0, key1)
                    out[j0, i] = _multiplier(w0, thr, scale)
                    out[j1, i] = _multiplier(w1, thr, scale)
                    out[j2, i] = _multiplier(w2, thr, scale)
                    out[j3, i] = _multiplier(w3, thr, scale)
                continue
            for i in range(n_q):  # a block the tile cuts: only its rows (a call, not inlined)
                words = philox_words(c0, np.uint64(q0 + i), c2, c3, key0, key1)
                for r in range(4):
                    j = j0 + r * CALLS_PER_BLOCK
                    if 0 <= j < n_k:
                        out[j, i] = _multiplier(words[r], thr, scale)


@jit(entry=True)
def drop_rows(s, at, dropout, round_kernel):
    """``s *= M`` in place on a ``[queries, keys]`` tile (the forward's orientation).

    Row ``i`` is query ``at.q0 + i``, column ``j`` key ``at.k0 + j`` (``at`` a
    :data:`~numbafa.kernels.mask.TilePos`, as in :func:`fill_multipliers`); each row is rounded afterwards to the format
    ``round_kernel`` names (:func:`numbafa.conventions.dtypes.round_inplace`). Along a row, the 16 calls
    of a block of 64 keys run as one vectorised loop, each word multiplying
    its run of 16 consecutive keys in place. No tile of multipliers is
    written (one the size of ``s``, 1 MiB, cost another pass through L2, and
    a per-row buffer of words 2x the time of this loop).
    """
    n_q, n_k = s.shape
    k0, q0 = at.k0, at.q0
    thr = np.uint64(dropout.threshold)
    scale = dropout.scale
    key0 = np.uint64(dropout.key0)
    key1 = np.uint64(dropout.key1)
    c2 = np.uint64(at.q_head + dropout.head0)
    c3 = np.uint64(at.batch + dropout.batch0)
    blk0 = k0 // BLOCK_KEYS
    n_blk = (k0 + n_k + BLOCK_KEYS - 1) // BLOCK_KEYS - blk0
    step = CALLS_PER_BLOCK
    for i in range(n_q):
        row = s[i]
        c1 = np.uint64(q0 + i)
        for b in range(n_blk):
            base = (blk0 + b) * BLOCK_KEYS - k0   # tile column of the block's first key
            first_call = (blk0 + b) * CALLS_PER_BLOCK
            if base < 0 or base + BLOCK_KEYS > n_k:  # a block the tile cuts (at most two per row)
                for g in range(CALLS_PER_BLOCK):
                    words = philox_words(np.uint64(first_call + g), c1, c2, c3, key0, key1)   # a call, not inlined
                    _drop_cut(row, base + g, words, thr, scale)
                continue
            for g in range(CALLS_PER_BLOCK):
                w0, w1, w2, w3 = philox4x32_10(np.uint64(first_call + g), c1, c2, c3, key0, key1)
                row[base + g] *= _multiplier(w0, thr, scale)
                row[base + step + g] *= _multiplier(w1, thr, scale)
                row[base + 2 * step + g] *= _multiplier(w2, thr, scale)
                row[base + 3 * step + g] *= _multiplier(w3, thr, scale)
        round_inplace(row, round_kernel)


@jit()
def _drop_cut(row, j0, words, thr, scale):
    """The in-tile keys of one call of a cut block: ``row[j0 + 16 r] *= M(word r)``."""
    for r in range(4):
        j = j0 + r * CALLS_PER_BLOCK
        if 0 <= j < row.size:
            row[j] *= _multiplier(words[r], thr, scale)


# --- the kernels' dropout steps: plugins (numbafa.kernels.table), compiled at the first call with dropout

@jit()
def drop_scores(args, _):
    """Backward, before Step 4: draw ``M^T`` into ``mult_buf`` and ``dP^T *= M^T``.

    ``args`` points to ``(mult_buf, dp_t, at, dropout)`` (``at`` the tile's
    :data:`~numbafa.kernels.mask.TilePos`); ``mult_buf`` is flat scratch of at least ``dp_t.size``
    elements; the multipliers stay there for :func:`drop_probabilities`.
    """
    mult_buf, dp_t, at, dropout = unpack(args)
    mult = mult_buf[:dp_t.size].reshape(dp_t.shape)
    fill_multipliers(mult, at, dropout)
    a = dp_t.reshape(-1)
    b = mult.reshape(-1)
    for i in range(a.size):
        a[i] = a[i] * b[i]


@jit()
def drop_probabilities(args, _):
    """Backward, after Step 4: ``P~^T = P^T * M^T`` written in kernel_dtype; ``args`` points to
    ``(mult_buf, p_t, round_kernel)``, ``M^T`` from :func:`drop_scores`."""
    mult_buf, p_t, round_kernel = unpack(args)
    a = p_t.reshape(-1)
    b = mult_buf[:a.size]
    for i in range(a.size):
        a[i] = a[i] * b[i]
    round_inplace(a, round_kernel)


@jit()
def drop_tile(args, _):
    """Forward: ``P~ = P * M`` on a ``[queries, keys]`` tile (:func:`drop_rows`); ``args`` points to
    ``(s, at, dropout, round_kernel)``."""
    s, at, dropout, round_kernel = unpack(args)
    drop_rows(s, at, dropout, round_kernel)


def dropout_plugins(plan) -> list:
    """The dropout plugins and sample arguments of the types the kernels pass them, for
    :func:`numbafa.kernels.table.ensure_plugins`."""
    acc = plan.acc.dtype
    vector, tile = np.empty(0, acc), np.empty((0, 0), acc)
    code = plan.precision.round_kernel
    at = TilePos(batch=0, q_head=0, q0=0, k0=0)
    return [(drop_scores, (vector, tile, at, plan.dropout)), (drop_probabilities, (vector, tile, code)),
            (drop_tile, (tile, at, plan.dropout, code))]
