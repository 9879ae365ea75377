"""User-facing input checks (the seed's ``validate_inputs``, and more).

Every contract is checked here, before any kernel runs, and reported as a
``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape or value)
that names the argument and gives the expected and the actual value. The
kernels themselves never validate. Callers with other argument names or
array layouts (:func:`numbafa.attention`) pass ``names`` and ``layout`` so
that messages use their names, shapes and axes.

Conventions shared with the upstream NKI kernel:

``softmax_scale``
    ``None`` or ``0.0`` selects the default ``1 / sqrt(d_head)`` (upstream
    computes ``softmax_scale or 1 / sqrt(d_head)``). Any other finite value
    is used as given, negative ones included. The kernels use the scale as
    a float32, so it must be finite in float32: ``|softmax_scale| <=
    3.4028235e+38`` (``1e39`` is rejected like NaN and inf).
``sliding_window``
    ``None`` or any int ``< 1`` (upstream passes ``-1``) means no window,
    with or without ``use_causal_mask``. A window ``w >= 1`` needs
    ``use_causal_mask=True`` and is capped at ``seqlen_k``. Bools and
    non-integers are rejected.
``dropout_p``, ``seed``, ``seed_offset``
    Attention dropout: ``dropout_p`` a real number in ``[0, 1)`` (0: none,
    the default); with ``dropout_p > 0`` an int ``seed`` in ``[0, 2**64)``
    is required (the mask is a function of it, so the backward can draw it
    again), and ``seed_offset``, an int in ``[0, 2**64)`` (default 0),
    selects a fresh mask per training step from one seed.
Empty problems
    ``bs = 0`` and ``seqlen_q = seqlen_k = 0`` are valid, as empty arrays
    are in NumPy: the outputs are empty arrays of the right shapes.
    ``nheads``, ``nheads_kv`` and ``d_head`` describe the model and must be
    ``>= 1`` (with ``d_head = 0`` the default scale would be ``1 / 0``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from .jit import jit
from .tiling import Q_TILE
from .dtypes import is_bf16, widen
from .layout import _check_layout

__all__ = ["Problem", "validate_bwd_inputs", "validate_dropout", "validate_fwd_inputs"]

#: Largest finite float32, the bound of ``|softmax_scale|``.
FLOAT32_MAX = float(np.finfo(np.float32).max)



def _allowed_dtype(dtype) -> bool:
    return dtype == np.float32 or is_bf16(dtype)


@functools.lru_cache(maxsize=None)
def _inverse_perm(layout: str) -> tuple:
    return tuple(int(i) for i in np.argsort(_check_layout(layout)))


@dataclass(frozen=True)
class _Caller:
    """How the caller spells the arguments, for the messages.

    ``names`` maps the kernel's argument names (``q_ref``, ``dy_ref``, ...)
    to the caller's; ``layout`` is the layout the caller's 4-D arrays had
    before :func:`numbafa.layout.to_neuron`: shapes and axes are shown in it.
    """

    names: Mapping[str, str] = field(default_factory=dict)
    layout: str = "neuron"

    def __call__(self, name: str) -> str:
        return self.names.get(name, name)

    def _perm(self) -> tuple:
        return _check_layout(self.layout)

    def axis(self, neuron_axis: int) -> int:
        """The caller's index of a Neuron-layout axis."""
        return self._perm()[neuron_axis]

    def order(self, neuron_items) -> tuple:
        """Items given in the Neuron layout's axis order, in the caller's order."""
        return tuple(neuron_items[i] for i in _inverse_perm(self.layout))

    def shape(self, x: np.ndarray) -> tuple:
        """Shape of a 4-D Neuron-layout view as the caller's array has it."""
        return self.order(tuple(x.shape)) if x.ndim == 4 else tuple(x.shape)

    def dims(self, neuron_dims: tuple) -> str:
        return "[" + ", ".join(self.order(neuron_dims)) + "]"


@dataclass(frozen=True)
class Problem:
    """Validated, normalised inputs of one forward or backward call.

    Arrays are C-contiguous; bf16 arrays are given as their uint16 bit
    patterns. Nothing here aliases a caller's array in a writable way.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: Optional[np.ndarray]    # backward only
    dy: Optional[np.ndarray]   # backward only
    lse: Optional[np.ndarray]  # backward only: float32 [bs, nheads, seqlen_q]
    sinks: np.ndarray          # float32 [bs, nheads, num_sinks]; num_sinks may be 0
    sinks_shape: Optional[tuple]
    sinks_dtype: Optional[np.dtype]
    bound_min: np.ndarray      # float32 [seqlen_q] or [0]
    bound_max: np.ndarray
    use_packing: bool
    use_causal_mask: bool
    window: int                # min(sliding_window, seqlen_k), 0 for none
    softmax_scale: float
    dtype: np.dtype            # the shared input dtype
    mixed_precision: bool
    dropout_p: float = 0.0     # attention dropout, [0, 1)
    seed: int = 0              # the dropout mask's seed and offset (numbafa.kernels.dropout)
    seed_offset: int = 0

    @property
    def is_bf16(self) -> bool:
        return is_bf16(self.dtype)


@jit(entry=True)
def _count_nonfinite(flat):
    n = 0
    for i in range(flat.size):
        if not math.isfinite(widen(flat[i])):
            n += 1
    return n


@jit(entry=True)
def _count_nan_or_neg_inf(flat):
    n = 0
    for i in range(flat.size):
        x = flat[i]
        if math.isnan(x) or x == -math.inf:
            n += 1
    return n


class _WritableView:
    """Exposes a read-only array's memory as writable (``__array_interface__``), for
    :func:`kernel_view` only: the kernels never write their inputs."""

    def __init__(self, x: np.ndarray):
        self.base = x
        interface = dict(x.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def kernel_view(x: np.ndarray) -> np.ndarray:
    """``x`` as the kernels take an input: C-contiguous and aligned (a copy only if it is not),
    and of a writable type (a read-only array, such as a buffer JAX hands to a callback, is
    viewed as writable, not copied): every call then has the one compiled signature."""
    flags = x.flags
    if not (flags.c_contiguous and flags.aligned):
        x = np.require(x, requirements=("C", "A"))
    if not x.flags.writeable:
        x = np.asarray(_WritableView(x))
    return x


def _as_kernel_array(x: np.ndarray) -> np.ndarray:
    """:func:`kernel_view`; bf16 as uint16 bits, float32 as is."""
    x = kernel_view(x)
    return x.view(np.uint16) if is_bf16(x.dtype) else x


def _short_repr(x, limit: int = 40) -> str:
    text = repr(float(x)) if isinstance(x, (float, np.floating)) else repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


def _require_array(name: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    return x


def _require_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def _require_ndim(name: str, x: np.ndarray, ndim: int, layout) -> None:
    """``layout``: the dims' text, or a function giving it (called only for the message)."""
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout() if callable(layout) else layout}, got shape "
                         f"{x.shape}")


def _require_shape(name: str, shape: tuple, expected: tuple, why: str = "") -> None:
    """``shape`` and ``expected`` as the caller sees them."""
    if tuple(shape) != tuple(expected):
        suffix = f" ({why})" if why else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{suffix}, got {tuple(shape)}")


def _require_finite(name: str, arr: np.ndarray) -> None:
    bad = _count_nonfinite(arr.reshape(-1))
    if bad:
        raise ValueError(f"{name} must be finite, got {bad} NaN/inf element(s) of {arr.size}")


def _validate_scale(softmax_scale, d_head: int) -> float:
    """The scale the kernels use; ``None`` and 0 select ``1 / sqrt(d_head)`` (upstream's ``or``)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int beyond float64
        scale = math.inf
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(scale)))  # the kernels' value: 1e39 -> inf
    if not finite:
        raise ValueError(f"softmax_scale must be finite in float32 (|softmax_scale| <= {FLOAT32_MAX:.8g}), "
                         f"got {_short_repr(softmax_scale)}")
    return scale if scale != 0.0 else 1.0 / math.sqrt(d_head)


def _validate_window(sliding_window, use_causal_mask: bool, seqlen_k: int) -> int:
    """The window the kernels use: 0 for none (``None`` or any int < 1, as upstream's -1)."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"sliding_window must be an int or None (None or a value < 1: no window), got "
                        f"{type(sliding_window).__name__}")
    window = int(sliding_window)
    if window < 1:
        return 0
    if not use_causal_mask:
        raise ValueError(f"sliding_window={window} requires use_causal_mask=True (None or a value < 1: no "
                         f"window), got use_causal_mask=False")
    return min(window, seqlen_k)


def _require_uint64(name: str, x, what: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int ({what}), got {type(x).__name__} {_short_repr(x)}")
    value = int(x)
    if not 0 <= value < 2 ** 64:
        raise ValueError(f"{name} must be in [0, 2**64) ({what}), got {value}")
    return value


def validate_dropout(dropout_p, seed, seed_offset, names: Optional[Mapping[str, str]] = None) -> dict:
    """``dropout_p``, ``seed`` and ``seed_offset`` checked and normalised (``Problem`` fields).

    ``names`` maps these three names to the caller's, for the messages.
    """
    c = _Caller(dict(names or {}))
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{c('dropout_p')} must be a real number in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails both comparisons
        raise ValueError(f"{c('dropout_p')} must be in [0, 1), got {_short_repr(dropout_p)}")
    offset = _require_uint64(c("seed_offset"), seed_offset, "the dropout mask's offset")
    if seed is None:
        if p > 0.0:
            raise ValueError(f"{c('seed')} is required with {c('dropout_p')}={p!r} (the backward draws "
                             f"the forward's mask again from it), got None")
        return dict(dropout_p=p, seed=0, seed_offset=offset)
    return dict(dropout_p=p, seed=_require_uint64(c("seed"), seed, "the dropout mask's seed"),
                seed_offset=offset)


def _validate_lse(c: _Caller, lse_ref, bs: int, nheads: int, seqlen_q: int) -> np.ndarray:
    name = c("lse_ref")
    lse = _require_array(name, lse_ref)
    if lse.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {lse.dtype}")
    natural = (bs, nheads, seqlen_q)
    if lse.ndim == 3:
        _require_shape(name, lse.shape, natural, "natural layout [bs, nheads, seqlen_q]")
        out = kernel_view(lse)
    elif lse.ndim == 4:
        if seqlen_q % Q_TILE:
            raise ValueError(
                f"{name} in the Neuron layout [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}] needs seqlen_q "
                f"divisible by {Q_TILE}, got seqlen_q={seqlen_q}; pass lse as [bs, nheads, seqlen_q] instead")
        _require_shape(name, lse.shape, (bs, nheads, Q_TILE, seqlen_q // Q_TILE),
                       f"Neuron layout [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}]")
        # lse[b, h, p, t] is row t * 128 + p.
        out = kernel_view(np.ascontiguousarray(lse.transpose(0, 1, 3, 2)).reshape(natural))
    else:
        raise ValueError(f"{name} must be 4-D [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}] or 3-D "
                         f"[bs, nheads, seqlen_q], got shape {lse.shape}")
    bad = _count_nan_or_neg_inf(out.reshape(-1))
    if bad:
        raise ValueError(f"{name} must not contain NaN or -inf, got {bad} such element(s)")
    return out


def _validate_bounds(c: _Caller, bound_min, bound_max, seqlen_q: int):
    if (bound_min is None) != (bound_max is None):
        given = c("bound_min") if bound_max is None else c("bound_max")
        raise ValueError(f"{c('bound_min')} and {c('bound_max')} must be given together, got only {given}")
    if bound_min is None:
        empty = np.zeros(0, dtype=np.float32)
        return empty, empty, False
    out = []
    for name, b in ((c("bound_min"), bound_min), (c("bound_max"), bound_max)):
        b = _require_array(name, b)
        if b.dtype != np.float32:
            raise TypeError(f"{name} must be float32, got {b.dtype}")
        _require_shape(name, b.shape, (seqlen_q,), "one bound per query row")
        if np.isnan(b).any():
            raise ValueError(f"{name} must not contain NaN")
        out.append(kernel_view(b))
    return out[0], out[1], True


def _validate_sinks(c: _Caller, sinks_ref, bs: int, nheads: int):
    if sinks_ref is None:
        return np.zeros((bs, nheads, 0), dtype=np.float32), None, None
    name = c("sinks_ref")
    s = _require_array(name, sinks_ref)
    if not _allowed_dtype(s.dtype):
        raise TypeError(f"{name} must be float32 or bfloat16, got {s.dtype}")
    if s.ndim == 2:
        _require_shape(name, s.shape, (bs, nheads), "[bs, nheads] or [bs, nheads, num_sinks]")
    elif s.ndim == 3:
        if s.shape[:2] != (bs, nheads) or s.shape[2] < 1:
            raise ValueError(f"{name} must have shape ({bs}, {nheads}, num_sinks >= 1), got {s.shape}")
    else:
        raise ValueError(f"{name} must be [bs, nheads] or [bs, nheads, num_sinks], got shape {s.shape}")
    num_sinks = 1 if s.ndim == 2 else s.shape[2]  # explicit: -1 is ambiguous when bs == 0
    s32 = np.ascontiguousarray(s.astype(np.float32)).reshape(bs, nheads, num_sinks)
    _require_finite(name, s32)
    return s32, tuple(s.shape), s.dtype


def _validate_attention(c: _Caller, keys, arrays, sinks_ref, bound_min, bound_max, use_causal_mask,
                        mixed_precision, softmax_scale, sliding_window):
    """Checks shared by forward and backward; ``arrays`` starts with q, k, v.

    ``keys`` are the kernel's names of ``arrays`` (``q_ref``, ...); messages
    show them, and the shapes and axes, as the caller ``c`` has them.
    """
    use_causal_mask = _require_bool(c("use_causal_mask"), use_causal_mask)
    mixed_precision = _require_bool(c("mixed_precision"), mixed_precision)
    for key, x in zip(keys, arrays):
        dims = ("bs", "nheads_kv", "d_head", "seqlen_k") if key in ("k_ref", "v_ref") \
            else ("bs", "nheads", "d_head", "seqlen_q")
        _require_ndim(c(key), x, 4, functools.partial(c.dims, dims))
    q, k, v = arrays[:3]
    qn, kn = c("q_ref"), c("k_ref")
    dtype = q.dtype
    if not _allowed_dtype(dtype):
        raise TypeError(f"{qn} must be float32 or bfloat16 (ml_dtypes.bfloat16), got {dtype}")
    for key, x in zip(keys[1:], arrays[1:]):
        if x.dtype != dtype:
            raise TypeError(f"{c(key)} must have the dtype of {qn} ({dtype}), got {x.dtype}")
    bs, nheads, d_head, seqlen_q = q.shape
    if d_head < 1:
        raise ValueError(f"d_head ({qn}.shape[{c.axis(2)}]) must be >= 1, got {d_head}")
    if nheads < 1:
        raise ValueError(f"nheads ({qn}.shape[{c.axis(1)}]) must be >= 1, got {nheads}")
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    if k.shape[0] != bs or k.shape[2] != d_head:
        expected = ", ".join(c.order((str(bs), "nheads_kv", str(d_head), "seqlen_k")))
        raise ValueError(f"{kn} must have shape ({expected}) to match {qn}, got {c.shape(k)}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({kn}.shape[{c.axis(1)}]), got "
                         f"nheads_kv={nheads_kv}")
    if v.shape != k.shape:
        _require_shape(c("v_ref"), c.shape(v), c.shape(k), f"same as {kn}")
    for key, x in zip(keys[3:], arrays[3:]):
        if x.shape != q.shape:
            _require_shape(c(key), c.shape(x), c.shape(q), f"same as {qn}")
    if use_causal_mask and seqlen_q != seqlen_k:
        raise ValueError(f"use_causal_mask=True requires seqlen_q == seqlen_k, got seqlen_q={seqlen_q}, "
                         f"seqlen_k={seqlen_k}")
    window = _validate_window(sliding_window, use_causal_mask, seqlen_k)
    scale = _validate_scale(softmax_scale, d_head)
    bmin, bmax, use_packing = _validate_bounds(c, bound_min, bound_max, seqlen_q)
    sinks, sinks_shape, sinks_dtype = _validate_sinks(c, sinks_ref, bs, nheads)
    kernel_arrays = [_as_kernel_array(x) for x in arrays]
    for key, x in zip(keys, kernel_arrays):
        _require_finite(c(key), x)
    return kernel_arrays, dict(sinks=sinks, sinks_shape=sinks_shape, sinks_dtype=sinks_dtype,
                               bound_min=bmin, bound_max=bmax, use_packing=use_packing,
                               use_causal_mask=use_causal_mask, window=window, softmax_scale=scale,
                               dtype=np.dtype(dtype), mixed_precision=mixed_precision)


def validate_fwd_inputs(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None,
                        use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                        sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0, *,
                        names: Optional[Mapping[str, str]] = None, layout: str = "neuron") -> Problem:
    """Check every argument of :func:`numbafa.attention_fwd`; return them normalised.

    Parameters
    ----------
    q_ref ... seed_offset
        As :func:`numbafa.attention_fwd` (Neuron-layout arrays, possibly views).
    names : mapping, optional
        The caller's names of the arguments, keyed by the names above (e.g.
        ``{"q_ref": "q", "dy_ref": "do"}``); error messages use them.
    layout : {"neuron", "bshd", "bhsd"}
        The layout of the caller's arrays before :func:`numbafa.layout.to_neuron`;
        error messages give shapes and axes in it.
    """
    c = _Caller(dict(names or {}), layout)
    keys = ("q_ref", "k_ref", "v_ref")
    arrays = [_require_array(c(n), x) for n, x in zip(keys, (q_ref, k_ref, v_ref))]
    (q, k, v), opts = _validate_attention(c, keys, arrays, sinks_ref, bound_min, bound_max,
                                          use_causal_mask, mixed_precision, softmax_scale,
                                          sliding_window)
    opts.update(validate_dropout(dropout_p, seed, seed_offset, names))
    return Problem(q, k, v, None, None, None, **opts)


def validate_bwd_inputs(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                        bound_max=None, use_causal_mask=False, mixed_precision=False,
                        softmax_scale=None, sliding_window=None, dropout_p=0.0, seed=None,
                        seed_offset=0, *, names: Optional[Mapping[str, str]] = None,
                        layout: str = "neuron") -> Problem:
    """Check every argument of :func:`numbafa.attention_bwd`; return them normalised.

    Parameters
    ----------
    q_ref ... seed_offset
        As :func:`numbafa.attention_bwd` (Neuron-layout arrays, possibly views).
    names : mapping, optional
        The caller's names of the arguments, keyed by the names above (e.g.
        ``{"q_ref": "q", "dy_ref": "do"}``); error messages use them.
    layout : {"neuron", "bshd", "bhsd"}
        The layout of the caller's arrays before :func:`numbafa.layout.to_neuron`;
        error messages give shapes and axes in it.
    """
    c = _Caller(dict(names or {}), layout)
    keys = ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref")
    arrays = [_require_array(c(n), x) for n, x in zip(keys, (q_ref, k_ref, v_ref, o_ref, dy_ref))]
    kernel_arrays, opts = _validate_attention(c, keys, arrays, sinks_ref, bound_min, bound_max,
                                              use_causal_mask, mixed_precision, softmax_scale,
                                              sliding_window)
    bs, nheads, _, seqlen_q = arrays[0].shape
    lse = _validate_lse(c, lse_ref, bs, nheads, seqlen_q)
    opts.update(validate_dropout(dropout_p, seed, seed_offset, names))
    return Problem(*kernel_arrays, lse=lse, **opts)
