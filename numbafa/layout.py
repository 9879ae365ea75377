"""Layout helpers: between the Neuron layout and the layouts users hold.

The kernels take ``[batch, heads, head_dim, seq]`` (the Neuron layout:
head_dim on the partition axis). Users of flash-attn hold
``[batch, seq, heads, head_dim]`` (``"bshd"``); users of PyTorch SDPA hold
``[batch, heads, seq, head_dim]`` (``"bhsd"``). The conversions below return
*views* (``np.transpose``), never copies. The kernels run on an array
C-contiguous in any of the three layouts as it is (numbafa.kernels.heads)
and return ``o`` and the gradients C-contiguous in q's layout; a view
contiguous in none of them is copied into the Neuron layout first.
"""

from __future__ import annotations

import numbers

import numpy as np

from .conventions.tiling import Q_TILE

__all__ = [
    "LAYOUTS",
    "to_neuron",
    "from_neuron",
    "lse_to_natural",
    "lse_to_neuron",
    "cu_seqlens_to_bounds",
    "lse_from_cte",
    "MAX_BOUND",
]

#: Axis permutation from each layout to the Neuron layout [b, h, d, s].
_TO_NEURON = {"neuron": (0, 1, 2, 3), "bshd": (0, 2, 3, 1), "bhsd": (0, 1, 3, 2)}
LAYOUTS = tuple(_TO_NEURON)
#: The inverse permutations: from the Neuron layout to each layout.
_FROM_NEURON = {name: tuple(perm.index(axis) for axis in range(4)) for name, perm in _TO_NEURON.items()}


def check_layout(layout) -> tuple:
    """The axis permutation from ``layout`` to the Neuron layout; ``ValueError`` for an unknown layout."""
    if layout not in _TO_NEURON:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return _TO_NEURON[layout]


def from_neuron_perm(layout) -> tuple:
    """The axis permutation from the Neuron layout to ``layout`` (plain ints, no NumPy: the torch
    adapter uses it under ``torch.compile``)."""
    check_layout(layout)
    return _FROM_NEURON[layout]


#: Axis names of the Neuron layout, the order of every permutation above.
_NEURON_DIMS = ("batch", "heads", "head_dim", "seq")


def _dims(layout: str) -> str:
    """``"[batch, seq, heads, head_dim]"`` for ``"bshd"``, and so on."""
    inverse = np.argsort(check_layout(layout))
    return "[" + ", ".join(_NEURON_DIMS[i] for i in inverse) + "]"


def _check_4d(name: str, x, layout: str) -> np.ndarray:
    """``x`` must be a 4-D array in ``layout``; messages say so in ``name``."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.ndim != 4:
        where = "" if layout == "neuron" else f" for layout={layout!r}"
        raise ValueError(f"{name} must be 4-D {_dims(layout)}{where}, got shape {x.shape}")
    return x


def to_neuron(x: np.ndarray, layout: str, name: str = "x") -> np.ndarray:
    """View of ``x`` in the Neuron layout ``[batch, heads, head_dim, seq]``.

    Parameters
    ----------
    x : ndarray
        ``[batch, seq, heads, head_dim]`` for ``layout="bshd"``,
        ``[batch, heads, seq, head_dim]`` for ``"bhsd"``, or already
        ``[batch, heads, head_dim, seq]`` for ``"neuron"``.
    layout : {"bshd", "bhsd", "neuron"}
    name : str
        How error messages call ``x`` (e.g. ``"q"``).
    """
    perm = check_layout(layout)
    return _check_4d(name, x, layout).transpose(perm)


def from_neuron(x: np.ndarray, layout: str, name: str = "x") -> np.ndarray:
    """View of a Neuron-layout ``[batch, heads, head_dim, seq]`` array in ``layout``.

    ``name`` is how error messages call ``x``.
    """
    return _check_4d(name, x, "neuron").transpose(from_neuron_perm(layout))


def _floats(name: str, x, kinds: str = "f") -> np.ndarray:
    """``x`` as an array whose dtype kind is in ``kinds`` (``"f"``: floating; ``"fiu"``: any real
    number), else a ``TypeError`` naming it (None, strings, bools, complex numbers: no lse)."""
    a = np.asarray(x)
    if a.dtype.kind not in kinds:
        what = "a floating-point" if kinds == "f" else "a real (float or int)"
        got = type(x).__name__ if a.dtype.kind == "O" else f"dtype {a.dtype}"
        raise TypeError(f"{name} must be {what} array, got {got}")
    return a


def lse_to_natural(lse: np.ndarray) -> np.ndarray:
    """Neuron-packed ``[bs, heads, 128, seq // 128]`` -> natural ``[bs, heads, seq]`` (a copy).

    ``lse[b, h, p, t]`` is the LSE of query row ``t * 128 + p``; a ``TypeError`` unless it is
    floating-point.
    """
    lse = _floats("lse", lse)
    if lse.ndim != 4 or lse.shape[2] != Q_TILE:
        raise ValueError(f"lse must be [bs, heads, {Q_TILE}, seq // {Q_TILE}], got shape {lse.shape}")
    bs, h, _, n_tiles = lse.shape
    return np.ascontiguousarray(lse.transpose(0, 1, 3, 2)).reshape(bs, h, n_tiles * Q_TILE)


def lse_to_neuron(lse: np.ndarray) -> np.ndarray:
    """Natural ``[bs, heads, seq]`` -> Neuron-packed ``[bs, heads, 128, seq // 128]`` (a copy).

    Raises ``ValueError`` unless ``seq`` is a multiple of 128 (keep the
    natural layout then: every numbafa function accepts it), ``TypeError`` unless ``lse`` is
    floating-point.
    """
    lse = _floats("lse", lse)
    if lse.ndim != 3:
        raise ValueError(f"lse must be [bs, heads, seq], got shape {lse.shape}")
    bs, h, seq = lse.shape
    if seq % Q_TILE:
        raise ValueError(f"the Neuron lse layout needs seq divisible by {Q_TILE}, got seq={seq}; "
                         f"use the natural layout [bs, heads, seq]")
    return np.ascontiguousarray(lse.reshape(bs, h, seq // Q_TILE, Q_TILE).transpose(0, 1, 3, 2))


#: Largest row count of packing bounds: float32 holds every integer up to 2**24 exactly.
MAX_BOUND = 2 ** 24


def _check_cu_seqlens(cu_seqlens) -> np.ndarray:
    """``cu_seqlens`` as int64, after checking kind, order and range (any integer dtype)."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [num_seqs + 1], got "
                         f"{cu.dtype} array of shape {cu.shape}")
    # Compare neighbours, not np.diff: on unsigned dtypes the difference wraps around.
    if cu[0] != 0 or np.any(cu[1:] < cu[:-1]):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:8]}"
                         f"{'...' if cu.size > 8 else ''}")
    if cu[-1] > MAX_BOUND:  # before the cast: a uint64 beyond int64 must not wrap
        raise ValueError(f"cu_seqlens[-1] must be <= 2**24 = {MAX_BOUND} (float32 bounds are exact "
                         f"integers up to there), got {int(cu[-1])}")
    return cu.astype(np.int64)


def cu_seqlens_to_bounds(cu_seqlens, seqlen=None):
    """Packing bounds from flash-attn style cumulative sequence lengths.

    Parameters
    ----------
    cu_seqlens : 1-D integer array ``[num_seqs + 1]``, any integer dtype
        ``0 = cu[0] <= cu[1] <= ... <= cu[-1]``; sequence ``i`` occupies
        rows ``cu[i] .. cu[i+1] - 1`` of the packed batch.
    seqlen : int, optional
        Total rows, default ``cu[-1]``. Rows ``cu[-1] .. seqlen - 1``
        (padding) attend to nothing: zero output, zero gradient.

    Returns
    -------
    bound_min, bound_max : float32 ``[seqlen]``
        Query ``r`` attends keys ``bound_min[r] <= j < bound_max[r]``.

    Raises
    ------
    TypeError
        ``seqlen`` is not an int (a float such as 5.7 is not truncated).
    ValueError
        ``cu_seqlens`` is not a 1-D integer array starting at 0 and
        non-decreasing, ``seqlen < cu[-1]``, or a row count above 2**24
        (beyond it float32 bounds are not exact).
    """
    cu = _check_cu_seqlens(cu_seqlens)
    total = int(cu[-1])
    if seqlen is None:
        seqlen = total
    elif isinstance(seqlen, (bool, np.bool_)) or not isinstance(seqlen, numbers.Integral):
        raise TypeError(f"seqlen must be an int or None, got {type(seqlen).__name__} {seqlen!r}")
    seqlen = int(seqlen)
    if seqlen < total:
        raise ValueError(f"seqlen must be >= cu_seqlens[-1] = {total}, got {seqlen}")
    if seqlen > MAX_BOUND:
        raise ValueError(f"seqlen must be <= 2**24 = {MAX_BOUND} (float32 bounds are exact integers up "
                         f"to there), got {seqlen}")
    lengths = np.diff(cu)
    bound_min = np.zeros(seqlen, dtype=np.float32)
    bound_max = np.zeros(seqlen, dtype=np.float32)
    bound_min[:total] = np.repeat(cu[:-1], lengths)
    bound_max[:total] = np.repeat(cu[1:], lengths)
    return bound_min, bound_max


def lse_from_cte(neg_max, sum_recip):
    """LSE from the forward CTE kernel's checkpoint pair.

    The CTE kernel stores the negated row max ``neg_max = -max`` and the
    reciprocal row sum ``sum_recip = 1 / sum(exp(s - max))``; then
    ``lse = max + log(sum) = -(neg_max + log(sum_recip))`` (seed: the torch
    golden's line 230). Shapes are kept; the result is float32.
    ``sum_recip = 0`` gives ``lse = +inf`` (a row that attends to nothing).

    Raises
    ------
    TypeError
        Either not an array of real numbers (None, strings, bools, complex).
    ValueError
        Different shapes, NaN in either input, a negative ``sum_recip``
        (no real log), or ``neg_max = +inf`` with ``sum_recip = 0``
        (``inf - inf``): pairs that have no lse.
    """
    neg_max = _floats("neg_max", neg_max, "fiu").astype(np.float64)
    sum_recip = _floats("sum_recip", sum_recip, "fiu").astype(np.float64)
    if neg_max.shape != sum_recip.shape:
        raise ValueError(f"neg_max and sum_recip must have the same shape, got {neg_max.shape} and "
                         f"{sum_recip.shape}")
    for name, x in (("neg_max", neg_max), ("sum_recip", sum_recip)):
        n_nan = int(np.isnan(x).sum())
        if n_nan:
            raise ValueError(f"{name} must not contain NaN, got {n_nan} NaN element(s)")
    negative = sum_recip < 0
    if negative.any():
        raise ValueError(f"sum_recip must be >= 0 (a reciprocal row sum), got {int(negative.sum())} negative "
                         f"element(s), e.g. {float(sum_recip[negative].flat[0])}")
    undefined = (neg_max == np.inf) & (sum_recip == 0)
    if undefined.any():
        raise ValueError(f"neg_max = +inf with sum_recip = 0 has no lse (inf - inf), at "
                         f"{int(undefined.sum())} element(s)")
    with np.errstate(divide="ignore"):
        return (-(neg_max + np.log(sum_recip))).astype(np.float32)
