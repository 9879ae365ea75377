"""Attention dropout: the keep mask as a pure function of its coordinates.

The mask is drawn by Philox-4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator: the
random words of an element are a function of its *counter* and a *key*,
not of a stream position, so any tile can draw its elements in any order.
For attention element ``(batch, q_head, query, key)``::

    counter = (key // 4, query, q_head, batch)     # four 32-bit words
    words   = philox4x32_10(counter, call_key)     # four 32-bit words
    word    = words[key % 4]
    keep    = word >= threshold,   threshold = round(dropout_p * 2**32)

so keys ``4m .. 4m + 3`` of a query row share one Philox call. The
``call_key`` (two words) is derived once per call from the user's
``seed`` and ``seed_offset`` (:func:`derive_key`): the Philox of counter
``(offset_lo, offset_hi, 0, 0)`` under key ``(seed_lo, seed_hi)``, its
first two words. Nothing here depends on the tiling, the Q chunks, the KV
sections, the thread count or the machine, so the backward regenerates
exactly the forward's mask.

A kept element is scaled by ``scale = float32(1 / (1 - dropout_p))``:
``P~ = P * Z * scale``. The kernels apply it through a *multiplier* tile
``M = Z * scale`` (0 or ``scale``) written next to the score tile:
:func:`fill_multipliers` in the forward's ``[queries, keys]`` orientation
and in the backward's ``[keys, queries]`` one.

The float64 and rounding-point goldens (:mod:`numbafa.golden`) have an
implementation of their own, in NumPy; ``tests/test_dropout.py`` checks both
against the Random123 known-answer vectors and against each other.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..dtypes import round_to_bf16_inplace
from ..jit import jit

__all__ = ["Dropout", "make_dropout", "derive_key", "philox4x32_10", "philox_words", "fill_multipliers", "apply_multipliers"]

#: Dropout of one call: ``active`` (bool), ``threshold`` (int, keep iff word >=
#: it), ``scale`` (float32, 1 / (1 - p)), ``key0``/``key1`` (ints < 2**32, the call key).
Dropout = namedtuple("Dropout", ["active", "threshold", "scale", "key0", "key1"])

_MASK32 = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_SHIFT = np.uint64(32)
_ZERO = np.float32(0.0)


@jit(inline=True)
def _philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox-4x32 round: two 32 x 32 -> 64-bit products, split into high and low words.

    Every value is a ``uint64`` holding a 32-bit word; the masks tell LLVM the
    high halves are zero, so the products vectorise (``vpmuludq``).
    """
    p0 = _M0 * (c0 & _MASK32)
    p1 = _M1 * (c2 & _MASK32)
    return (((p1 >> _SHIFT) ^ c1 ^ k0) & _MASK32, p1 & _MASK32,
            ((p0 >> _SHIFT) ^ c3 ^ k1) & _MASK32, p0 & _MASK32)


@jit(inline=True)
def _bump(k0, k1):
    """The key schedule between rounds: add the Weyl constants, modulo 2**32."""
    return (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32


@jit(inline=True)
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``: four words.

    Arguments and results are ``uint64`` values holding 32-bit words. The ten
    rounds are written out: a loop (even of constant length) kept LLVM from
    vectorising the callers' loops, which made the generator 10x slower.
    """
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, k0, k1)
    k0, k1 = _bump(k0, k1)
    return _philox_round(c0, c1, c2, c3, k0, k1)


@jit()
def philox_words(c0, c1, c2, c3, k0, k1):
    """:func:`philox4x32_10` callable from Python (ints in, a tuple of four ints out)."""
    return philox4x32_10(np.uint64(c0), np.uint64(c1), np.uint64(c2), np.uint64(c3),
                         np.uint64(k0), np.uint64(k1))


def derive_key(seed: int, seed_offset: int) -> tuple:
    """The call key ``(k0, k1)`` of ``(seed, seed_offset)``, both ints in ``[0, 2**64)``."""
    words = philox_words(seed_offset & 0xFFFFFFFF, seed_offset >> 32, 0, 0, seed & 0xFFFFFFFF,
                         seed >> 32)
    return int(words[0]), int(words[1])


def make_dropout(dropout_p: float, seed: int, seed_offset: int) -> Dropout:
    """The :data:`Dropout` bundle of validated arguments (inactive for ``dropout_p == 0``)."""
    if dropout_p == 0.0:
        return Dropout(False, 0, np.float32(1.0), 0, 0)
    threshold = min(int(round(dropout_p * 2.0 ** 32)), 2 ** 32)
    k0, k1 = derive_key(seed, seed_offset)
    return Dropout(True, threshold, np.float32(1.0 / (1.0 - dropout_p)), k0, k1)


@jit(inline=True)
def _multiplier(word, threshold, scale):
    return scale if word >= threshold else _ZERO


@jit()
def _fill_key_group(out, keys_major, m, k0, n_k, q0, n_q, q_head, batch, dropout):
    """The multipliers of keys ``4m .. 4m + 3`` (those in ``[k0, k0 + n_k)``) for ``n_q`` queries."""
    thr = np.uint64(dropout.threshold)
    scale = dropout.scale
    key0 = np.uint64(dropout.key0)
    key1 = np.uint64(dropout.key1)
    c0 = np.uint64(m)
    c2 = np.uint64(q_head)
    c3 = np.uint64(batch)
    j0 = 4 * m - k0  # tile index of key 4m (may be < 0 or past the tile at its edges)
    full = j0 >= 0 and j0 + 4 <= n_k
    if keys_major and full:  # the backward's inner loop: contiguous along queries
        for i in range(n_q):
            w0, w1, w2, w3 = philox4x32_10(c0, np.uint64(q0 + i), c2, c3, key0, key1)
            out[j0, i] = _multiplier(w0, thr, scale)
            out[j0 + 1, i] = _multiplier(w1, thr, scale)
            out[j0 + 2, i] = _multiplier(w2, thr, scale)
            out[j0 + 3, i] = _multiplier(w3, thr, scale)
        return
    for i in range(n_q):
        words = philox4x32_10(c0, np.uint64(q0 + i), c2, c3, key0, key1)
        for r in range(4):
            j = j0 + r
            if 0 <= j < n_k:
                value = _multiplier(words[r], thr, scale)
                if keys_major:
                    out[j, i] = value
                else:
                    out[i, j] = value


@jit()
def _fill_queries_major(out, k0, n_k, q0, n_q, q_head, batch, dropout):
    """``out[i, j]`` of the whole key groups of a ``[queries, keys]`` tile; returns their range.

    Per query row, the groups' four words go to four short buffers first (a
    loop along the groups, which vectorises), then are interleaved into the
    row: writing them interleaved directly kept the loop scalar (5x slower).
    """
    thr = np.uint64(dropout.threshold)
    scale = dropout.scale
    key0 = np.uint64(dropout.key0)
    key1 = np.uint64(dropout.key1)
    c2 = np.uint64(q_head)
    c3 = np.uint64(batch)
    m_lo = (k0 + 3) // 4            # first whole group
    m_hi = (k0 + n_k) // 4          # past the last whole group
    n_m = max(0, m_hi - m_lo)
    words = np.empty((4, n_m), dtype=np.float32)
    for i in range(n_q):
        c1 = np.uint64(q0 + i)
        for g in range(n_m):
            w0, w1, w2, w3 = philox4x32_10(np.uint64(m_lo + g), c1, c2, c3, key0, key1)
            words[0, g] = _multiplier(w0, thr, scale)
            words[1, g] = _multiplier(w1, thr, scale)
            words[2, g] = _multiplier(w2, thr, scale)
            words[3, g] = _multiplier(w3, thr, scale)
        row = out[i]
        j0 = 4 * m_lo - k0
        for g in range(n_m):
            j = j0 + 4 * g
            row[j] = words[0, g]
            row[j + 1] = words[1, g]
            row[j + 2] = words[2, g]
            row[j + 3] = words[3, g]
    return m_lo, m_hi


@jit()
def fill_multipliers(out, keys_major, k0, n_k, q0, n_q, q_head, batch, dropout):
    """Write ``M = Z * scale`` of keys ``k0 .. k0 + n_k`` and queries ``q0 .. q0 + n_q``.

    Parameters
    ----------
    out : float32 ``[n_k, n_q]`` (``keys_major``, the backward's tiles) or ``[n_q, n_k]``
    keys_major : bool
    k0, n_k, q0, n_q : int
        First key and query (absolute indices) and their counts.
    q_head, batch : int
        The elements' q-head and batch (the counter's last two words).
    dropout : :data:`Dropout` (active)
    """
    if keys_major:
        for m in range(k0 // 4, (k0 + n_k + 3) // 4):
            _fill_key_group(out, True, m, k0, n_k, q0, n_q, q_head, batch, dropout)
        return
    m_lo, m_hi = _fill_queries_major(out, k0, n_k, q0, n_q, q_head, batch, dropout)
    if m_lo > m_hi:  # the tile lies inside one key group
        _fill_key_group(out, False, k0 // 4, k0, n_k, q0, n_q, q_head, batch, dropout)
        return
    if 4 * m_lo > k0:  # a partial group before the whole ones
        _fill_key_group(out, False, m_lo - 1, k0, n_k, q0, n_q, q_head, batch, dropout)
    if 4 * m_hi < k0 + n_k:  # and after them
        _fill_key_group(out, False, m_hi, k0, n_k, q0, n_q, q_head, batch, dropout)


@jit()
def apply_multipliers(x, mult, round_kernel):
    """``x = x * mult`` element-wise on two same-shape C-contiguous tiles, rounded to bf16 if asked."""
    a = x.reshape(-1)
    b = mult.reshape(-1)
    for i in range(a.size):
        a[i] = a[i] * b[i]
    if round_kernel:
        round_to_bf16_inplace(a)
