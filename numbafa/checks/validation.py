"""User-facing input checks (the upstream kernel's ``validate_inputs``, and more).

Every contract is checked here, before any kernel runs, and reported as a
``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape or value)
that names the argument and gives the expected and the actual value. The
kernels themselves never validate. Every front end passes a
:class:`~numbafa.checks.options.Caller` (its argument names and array layout), so
that messages use its names, shapes and axes; the checks run once per call.

Three steps: :func:`check_options` checks the scalar options into an
:class:`~numbafa.checks.options.AttentionOptions`; :func:`check_tensors` checks the
tensors' and the option arrays' shapes and dtypes (anything with ``shape``
and ``dtype``: the torch and JAX adapters call it at trace time);
:func:`validate_fwd_inputs` / :func:`validate_bwd_inputs` run it on NumPy
arrays and return the kernels' :class:`Problem`. The values (finite inputs,
the lse, the bias; the range of the scores) are checked in compiled code,
by the entries every front door runs (:mod:`numbafa.kernels.entry`).

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
    ``nheads``, ``nheads_kv``, ``d_head`` and ``d_head_v`` describe the model
    and must be ``>= 1`` (with ``d_head = 0`` the default scale would be ``1 / 0``).
Head dims
    ``q`` and ``k`` share ``d_head``; ``v``, ``o`` and ``dy`` carry the value
    head dim ``d_head_v`` (``v.shape`` at the head-dim axis), which may differ
    (DeepSeek's MLA: 192 and 128). The default scale is ``1 / sqrt(d_head)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections import namedtuple
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..conventions.tiling import Q_TILE
from ..conventions.dtypes import accumulator_dtype, from_bf16_array, from_fp16_array, is_bf16
from ..compiler.memo import Memo
from .options import KERNEL_CALLER, AttentionOptions, Caller

__all__ = ["Dims", "Problem", "check_options", "check_tensors", "kernel_view", "kernel_layout", "layout_of_strides", "as_kernel_array", "kernel_lse", "neuron_shape",
           "resolve_scale", "validate_bwd_inputs", "validate_dropout", "validate_fwd_inputs"]

#: Largest finite float32, the bound of ``|softmax_scale|``.
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The range of ``softcap``: the kernels use it and its reciprocal as float32 normal numbers (a
#: subnormal or zero reciprocal would lose the scores, an infinite one make NaN of zero scores).
SOFTCAP_MIN, SOFTCAP_MAX = 2.0 ** -126, 2.0 ** 126



def _allowed_dtype(dtype) -> bool:
    return dtype in (np.float32, np.float64, np.float16) or is_bf16(dtype)


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
    lse: Optional[np.ndarray]  # backward only: float32 [bs, nheads, seqlen_q] (float64 for float64 inputs)
    sinks: np.ndarray          # [bs, nheads, num_sinks], lse's dtype; num_sinks may be 0
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
    bias: Optional[np.ndarray] = None     # [bs or 1, nheads or 1, seqlen_q or 1, seqlen_k], lse's dtype
    bias_shape: Optional[tuple] = None    # the caller's bias shape and dtype (dbias is returned in them)
    bias_dtype: Optional[np.dtype] = None
    alibi: Optional[np.ndarray] = None    # ALiBi slopes [bs or 1, nheads], lse's dtype
    softcap: float = 0.0                  # 0: none
    return_dbias: bool = False
    layout: int = 0     # the 4-D arrays' layout (numbafa.kernels.heads: 0 Neuron, 1 bhsd, 2 bshd)

    @property
    def dims(self) -> "Dims":
        """The problem's sizes, whatever the arrays' layout."""
        bs, nheads, d_head, seqlen_q = neuron_shape(self.q, self.layout)
        _, nheads_kv, d_v, seqlen_k = neuron_shape(self.v, self.layout)
        return Dims(bs=bs, nheads=nheads, nheads_kv=nheads_kv, d_head=d_head, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                    d_head_v=d_v)

    @property
    def has_score_mods(self) -> bool:
        return self.bias is not None or self.alibi is not None or self.softcap > 0.0

    @property
    def is_bf16(self) -> bool:
        return is_bf16(self.dtype)

    @property
    def is_fp16(self) -> bool:
        return self.dtype.char == "e"


class _WritableView:
    """Exposes a read-only array's memory as writable (``__array_interface__``), for
    :func:`kernel_view` only: the kernels never write their inputs."""

    def __init__(self, x: np.ndarray):
        self.base = x
        interface = dict(x.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def _canonical_strides(x: np.ndarray) -> bool:
    """Whether a C-contiguous ``x`` has the strides a new array of its shape would have. NumPy
    calls an array C-contiguous whatever the strides of its length-1 axes (a seqlen-1 view of
    a transposed array, say); the kernels read every stride, so those are copied too."""
    expected = x.itemsize
    for n, stride in zip(reversed(x.shape), reversed(x.strides)):
        if stride != expected:
            return False
        expected *= n
    return True


def kernel_view(x: np.ndarray) -> np.ndarray:
    """``x`` as the kernels take an input: C-contiguous and aligned (a copy only if it is not),
    and of a writable type (a read-only array, such as a buffer JAX hands to a callback, is
    viewed as writable, not copied): every call then has the one compiled signature."""
    flags = x.flags
    if not (flags.c_contiguous and flags.aligned) or (1 in x.shape and not _canonical_strides(x)):
        x = np.array(x, order="C")
    if not x.flags.writeable:
        x = np.asarray(_WritableView(x)).view(x.dtype)   # (the interface gives bf16 as void)
    return x


#: The kernels' layouts (numbafa.kernels.heads), by code: the permutation from the Neuron layout.
KERNEL_LAYOUT_PERMS = ((0, 1, 2, 3), (0, 1, 3, 2), (0, 3, 1, 2))


def neuron_shape(x: np.ndarray, layout: int) -> tuple:
    """``(batch, heads, head_dim, seq)`` of a 4-D kernel array in the layout of code ``layout``."""
    shape = x.shape
    return (shape[0], shape[1], shape[2], shape[3]) if layout == 0 else \
        (shape[0], shape[1], shape[3], shape[2]) if layout == 1 else (shape[0], shape[2], shape[3], shape[1])


def kernel_layout(x: np.ndarray) -> int:
    """The layout code in which the Neuron-layout view ``x`` is C-contiguous in memory: 0
    (Neuron), 1 (``[b, h, s, d]``), 2 (``[b, s, h, d]``); 0 when none (its copy is then made in
    the Neuron layout)."""
    itemsize = x.itemsize
    if not x.flags.aligned or any(stride % itemsize for stride in x.strides):
        return 0
    return layout_of_strides(x.shape, tuple(stride // itemsize for stride in x.strides))


def layout_of_strides(shape: tuple, strides: tuple) -> int:
    """:func:`kernel_layout` of an array given by its Neuron-order ``shape`` and ``strides`` in
    elements (a torch tensor's, or its fake's: the kernels' outputs are C-contiguous in it)."""
    if 0 in shape:
        return 0
    for code, perm in enumerate(KERNEL_LAYOUT_PERMS):
        expected = 1
        for axis in reversed(perm):
            if strides[axis] != expected:
                break
            expected *= shape[axis]
        else:
            return code
    return 0


def as_kernel_array(x: np.ndarray, layout: int = 0) -> np.ndarray:
    """The Neuron-layout view ``x`` as the kernels take it: the array in the layout of code
    ``layout`` (:func:`kernel_view`: a copy only if it is not C-contiguous there); bf16 as
    uint16 bits, float32 and float64 as they are, float16 widened to a new float32 array (exact:
    the kernels take fp16 values in float32, docs/numerics.md)."""
    x = x.transpose(KERNEL_LAYOUT_PERMS[layout]) if layout else x
    if x.dtype.char == "e":   # float16
        return from_fp16_array(np.ascontiguousarray(x))
    x = kernel_view(x)
    return x.view(np.uint16) if is_bf16(x.dtype) else x


def _short_repr(x, limit: int = 40) -> str:
    text = repr(float(x)) if isinstance(x, (float, np.floating)) else repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


def _require_array(c: Caller, key: str, x) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{c(key)} must be a numpy.ndarray, got {type(x).__name__}")
    return x


def _require_bool(c: Caller, key: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{c(key)} must be a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def _require_shape(name: str, shape: tuple, expected: tuple, why: str = "") -> None:
    """``shape`` and ``expected`` as the caller sees them."""
    if tuple(shape) != tuple(expected):
        suffix = f" ({why})" if why else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{suffix}, got {tuple(shape)}")


def require_uint64(name: str, x, what: str) -> int:
    """``x`` as an int in ``[0, 2**64)``, else a ``TypeError`` (not an int) or ``ValueError`` naming ``name``."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int ({what}), got {type(x).__name__} {_short_repr(x)}")
    value = int(x)
    if not 0 <= value < 2 ** 64:
        raise ValueError(f"{name} must be in [0, 2**64) ({what}), got {value}")
    return value


# --- the scalar options --------------------------------------------------------------------

def _check_scale(c: Caller, softmax_scale) -> Optional[float]:
    """The scale as given, or None for the default (``None`` and 0: upstream's ``or``)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{c('softmax_scale')} must be a real number or None, got {type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:  # an int beyond float64
        scale = math.inf
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(scale)))  # the kernels' value: 1e39 -> inf
    if not finite:
        name = c("softmax_scale")
        raise ValueError(f"{name} must be finite in float32 (|{name}| <= {FLOAT32_MAX:.8g}), "
                         f"got {_short_repr(softmax_scale)}")
    return None if scale == 0.0 else scale


def resolve_scale(softmax_scale: Optional[float], d_head: int) -> float:
    """The scale the kernels use: a checked ``softmax_scale``, None meaning ``1 / sqrt(d_head)``."""
    return 1.0 / math.sqrt(d_head) if softmax_scale is None else softmax_scale


def _check_window(c: Caller, sliding_window, use_causal_mask: bool) -> int:
    """The window, 0 for none (``None`` or any int < 1, as upstream's -1); capped later."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, (bool, np.bool_)) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"{c('sliding_window')} must be an int or None, got {type(sliding_window).__name__} "
                        f"{_short_repr(sliding_window)} (None or a value < 1: no window)")
    window = int(sliding_window)
    if window < 1:
        return 0
    if not use_causal_mask:
        name, causal = c("sliding_window"), c("use_causal_mask")
        raise ValueError(f"{name}={window} requires {causal}=True (None or a value < 1: no window), got "
                         f"{causal}=False")
    return window


def validate_dropout(dropout_p, seed, seed_offset, caller: Caller = KERNEL_CALLER) -> dict:
    """``dropout_p``, ``seed`` and ``seed_offset`` checked and normalised (``Problem`` fields);
    messages use ``caller``'s names."""
    c = caller
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{c('dropout_p')} must be a real number in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails both comparisons
        raise ValueError(f"{c('dropout_p')} must be in [0, 1), got {_short_repr(dropout_p)}")
    offset = seed_offset if type(seed_offset) is int and 0 <= seed_offset < 2 ** 64 else \
        require_uint64(c("seed_offset"), seed_offset, "the dropout mask's offset")
    if seed is None:
        if p > 0.0:
            raise ValueError(f"{c('seed')} is required with {c('dropout_p')}={p!r} (the backward draws "
                             f"the forward's mask again from it), got None")
        return dict(dropout_p=p, seed=0, seed_offset=offset)
    return dict(dropout_p=p, seed=require_uint64(c("seed"), seed, "the dropout mask's seed"),
                seed_offset=offset)


def check_options(options: AttentionOptions, caller: Caller = KERNEL_CALLER) -> AttentionOptions:
    """The scalar options of ``options`` (as the user gave them) checked and normalised.

    Idempotent: checked options pass unchanged. The arrays (sinks, bounds) are
    checked with the tensors (:func:`check_tensors`).

    Raises
    ------
    TypeError, ValueError
        Naming the option as ``caller`` does, with the expected and the actual value.
    """
    c = caller
    causal = _require_bool(c, "use_causal_mask", options.use_causal_mask)
    mixed = _require_bool(c, "mixed_precision", options.mixed_precision)
    window = _check_window(c, options.sliding_window, causal)
    scale = _check_scale(c, options.softmax_scale)
    dropout = validate_dropout(options.dropout_p, options.seed, options.seed_offset, c)
    softcap = _check_softcap(c, options.softcap)
    return_dbias = _require_bool(c, "return_dbias", options.return_dbias)
    if return_dbias and options.bias is None:
        raise ValueError(f"{c('return_dbias')}=True needs a {c('bias')} to differentiate, got {c('bias')}=None")
    return AttentionOptions(sinks=options.sinks, bound_min=options.bound_min, bound_max=options.bound_max,
                            use_causal_mask=causal, mixed_precision=mixed, softmax_scale=scale, sliding_window=window,
                            dropout_p=dropout["dropout_p"], seed=dropout["seed"], seed_offset=dropout["seed_offset"],
                            bias=options.bias, alibi_slopes=options.alibi_slopes, softcap=softcap,
                            return_dbias=return_dbias)


def _check_softcap(c: Caller, softcap) -> float:
    """The soft cap as a float, 0.0 for none (``None`` or 0)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{c('softcap')} must be a real number > 0, or None or 0 for none, got "
                        f"{type(softcap).__name__}")
    try:
        cap = float(softcap)
    except OverflowError:  # an int beyond float64
        cap = math.inf
    if cap == 0.0:
        return 0.0
    if not (SOFTCAP_MIN <= cap <= SOFTCAP_MAX):   # NaN fails too
        raise ValueError(f"{c('softcap')} must be in [{SOFTCAP_MIN:.8g}, {SOFTCAP_MAX:.8g}] (2**-126 to 2**126: the "
                         f"kernels compute s * (1 / {c('softcap')}) in float32, where both must be normal "
                         f"numbers), or None or 0 for none, got {_short_repr(softcap)}")
    return cap


# --- shapes and dtypes ---------------------------------------------------------------------

#: The sizes of one call, from the tensors' shapes.
#: ``d_head`` is the head dim of q and k, ``d_head_v`` that of v, o and dy.
Dims = namedtuple("Dims", ["bs", "nheads", "nheads_kv", "d_head", "seqlen_q", "seqlen_k", "d_head_v"])

_DIMS_OF = {"q_ref": ("bs", "nheads", "d_head", "seqlen_q"), "k_ref": ("bs", "nheads_kv", "d_head", "seqlen_k"),
            "v_ref": ("bs", "nheads_kv", "d_head_v", "seqlen_k"), "o_ref": ("bs", "nheads", "d_head_v", "seqlen_q"),
            "dy_ref": ("bs", "nheads", "d_head_v", "seqlen_q")}


def _check_ranks(c: Caller, tensors: dict) -> None:
    for key, x in tensors.items():
        if key == "lse_ref":
            continue
        if len(x.shape) != 4:
            dims = c.dims(tuple(map(c, _DIMS_OF[key])))
            where = "" if c.layout == "neuron" else f" for layout={c.layout!r}"
            raise ValueError(f"{c(key)} must be 4-D {dims}{where}, got shape {tuple(x.shape)}")


def _check_dtypes(c: Caller, tensors: dict) -> None:
    dtype = tensors["q_ref"].dtype
    if not _allowed_dtype(dtype):
        bf16 = c.names.get("bfloat16", "bfloat16 (ml_dtypes.bfloat16)")
        raise TypeError(f"{c('q_ref')} must be float32, float64, float16 or {bf16}, got {dtype}")
    for key, x in tensors.items():
        if key != "lse_ref" and x.dtype != dtype:
            raise TypeError(f"{c(key)} must have the dtype of {c('q_ref')} ({dtype}), got {x.dtype}")


def _check_dims(c: Caller, tensors: dict, causal: bool) -> Dims:
    q, k, v = tensors["q_ref"], tensors["k_ref"], tensors["v_ref"]
    qn, kn, vn = (c.names.get(key, key) for key in ("q_ref", "k_ref", "v_ref"))
    bs, nheads, d_head, seqlen_q = q.shape
    if d_head < 1:
        raise ValueError(f"{c('d_head')} ({qn}.shape[{c.axis(2)}]) must be >= 1, got {d_head}")
    if nheads < 1:
        raise ValueError(f"{c('nheads')} ({qn}.shape[{c.axis(1)}]) must be >= 1, got {nheads}")
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    if k.shape[0] != bs or k.shape[2] != d_head:
        expected = ", ".join(c.order((str(bs), c("nheads_kv"), str(d_head), c("seqlen_k"))))
        raise ValueError(f"{kn} must have shape ({expected}) to match {qn}, got {c.shape(k)}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"{c('nheads')} ({nheads}) must be a multiple of {c('nheads_kv')} ({kn}.shape"
                         f"[{c.axis(1)}]), got {c('nheads_kv')}={nheads_kv}")
    d_head_v = v.shape[2]
    if (v.shape[0], v.shape[1], v.shape[3]) != (bs, nheads_kv, seqlen_k):
        expected = ", ".join(c.order((str(bs), str(nheads_kv), c("d_head_v"), str(seqlen_k))))
        raise ValueError(f"{vn} must have shape ({expected}) to match {kn}, got {c.shape(v)}")
    if d_head_v < 1:
        raise ValueError(f"{c('d_head_v')} ({vn}.shape[{c.axis(2)}]) must be >= 1, got {d_head_v}")
    out_shape = c.order((bs, nheads, d_head_v, seqlen_q))
    for key in ("o_ref", "dy_ref"):
        if key in tensors and tuple(tensors[key].shape) != (bs, nheads, d_head_v, seqlen_q):
            _require_shape(c(key), c.shape(tensors[key]), out_shape,
                           f"{qn}'s with the head dim of {vn}, {c('d_head_v')}={d_head_v}")
    if causal and seqlen_q != seqlen_k:
        sq, sk = c("seqlen_q"), c("seqlen_k")
        raise ValueError(f"{c('use_causal_mask')}=True requires {sq} == {sk}, got {sq}={seqlen_q}, {sk}={seqlen_k}")
    return Dims(bs=bs, nheads=nheads, nheads_kv=nheads_kv, d_head=d_head, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                d_head_v=d_head_v)


def _check_lse_shape(c: Caller, lse, dims: Dims, dtype) -> None:
    name, (bs, nheads, seqlen_q) = c.names.get("lse_ref", "lse_ref"), (dims.bs, dims.nheads, dims.seqlen_q)
    expected = accumulator_dtype(dtype)
    if lse.dtype != expected:
        inputs = f" for {dtype} inputs" if expected == np.float64 else " (float64 only for float64 inputs)"
        raise TypeError(f"{name} must be {expected}{inputs}, got {lse.dtype}")
    if len(lse.shape) == 3:
        _require_shape(name, lse.shape, (bs, nheads, seqlen_q), "natural layout [bs, nheads, seqlen_q]")
    elif len(lse.shape) == 4:
        if seqlen_q % Q_TILE:
            raise ValueError(
                f"{name} in the Neuron layout [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}] needs seqlen_q "
                f"divisible by {Q_TILE}, got seqlen_q={seqlen_q}; pass lse as [bs, nheads, seqlen_q] instead")
        _require_shape(name, lse.shape, (bs, nheads, Q_TILE, seqlen_q // Q_TILE),
                       f"Neuron layout [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}]")
    else:
        raise ValueError(f"{name} must be 4-D [bs, nheads, {Q_TILE}, seqlen_q // {Q_TILE}] or 3-D "
                         f"[bs, nheads, seqlen_q], got shape {tuple(lse.shape)}")


def _check_bound_shapes(c: Caller, options: AttentionOptions, seqlen_q: int) -> None:
    if (options.bound_min is None) != (options.bound_max is None):
        given = c("bound_min") if options.bound_max is None else c("bound_max")
        raise ValueError(f"{c('bound_min')} and {c('bound_max')} must be given together, got only {given}")
    for key in ("bound_min", "bound_max"):
        b = getattr(options, key)
        if b is not None:
            if b.dtype != np.float32:
                raise TypeError(f"{c(key)} must be float32, got {b.dtype}")
            _require_shape(c(key), b.shape, (seqlen_q,), f"one bound per query row: [{c('seqlen_q')}]")


def _check_sinks_shape(c: Caller, sinks, bs: int, nheads: int, dtype) -> None:
    name, shape = c("sinks_ref"), tuple(sinks.shape)
    if dtype in (np.float64, np.float16):
        if sinks.dtype not in (np.float32, dtype):
            raise TypeError(f"{name} must be {dtype} or float32 for {dtype} inputs, got {sinks.dtype}")
    elif not (sinks.dtype == np.float32 or is_bf16(sinks.dtype)):
        raise TypeError(f"{name} must be float32 or bfloat16 (float64 or float16 only for inputs of that "
                        f"dtype), got {sinks.dtype}")
    if shape in ((nheads,), (bs, nheads)) or (len(shape) == 3 and shape[:2] == (bs, nheads) and shape[2] >= 1):
        return
    b, h = c("bs"), c("nheads")
    raise ValueError(f"{name} must have shape ({nheads},) [{h}], ({bs}, {nheads}) [{b}, {h}] or ({bs}, {nheads}, "
                     f"num_sinks >= 1) [{b}, {h}, num_sinks], got {shape}")


def _check_bias_shape(c: Caller, bias, dims: Dims, dtype) -> None:
    name = c("bias")
    if not (bias.dtype in (np.float32, dtype)):
        raise TypeError(f"{name} must be float32 or the inputs' dtype ({dtype}), got {bias.dtype}")
    full = (dims.bs, dims.nheads, dims.seqlen_q, dims.seqlen_k)
    shape = tuple(bias.shape)
    padded = (1,) * (4 - len(shape)) + shape
    if 1 <= len(shape) <= 4 and padded[3] == full[3] and all(n in (1, m) for n, m in zip(padded[:3], full)):
        return
    raise ValueError(f"{name} must be broadcastable to [{', '.join(c(n) for n in ('bs', 'nheads', 'seqlen_q', 'seqlen_k'))}]"
                     f" = {full} with a last dim of {c('seqlen_k')}={full[3]} (any of the first three may be 1), "
                     f"got {shape}")


def _check_alibi_shape(c: Caller, slopes, dims: Dims, dtype) -> None:
    name = c("alibi_slopes")
    if slopes.dtype not in (np.float32, accumulator_dtype(dtype)):
        raise TypeError(f"{name} must be float32{' or float64' if dtype.char == 'd' else ''}, got {slopes.dtype}")
    shape = tuple(slopes.shape)
    if shape not in ((dims.nheads,), (dims.bs, dims.nheads)):
        b, h = c("bs"), c("nheads")
        raise ValueError(f"{name} must have shape ({dims.nheads},) [{h}] or ({dims.bs}, {dims.nheads}) [{b}, {h}], "
                         f"got {shape}")


def check_tensors(tensors: dict, options: AttentionOptions, caller: Caller = KERNEL_CALLER) -> Dims:
    """Check the shapes and dtypes of one call: the tensors and the option arrays.

    Parameters
    ----------
    tensors : dict
        ``q_ref``, ``k_ref``, ``v_ref`` (and ``o_ref``, ``dy_ref``, ``lse_ref`` for the
        backward), Neuron-layout; anything with ``shape`` and ``dtype`` (NumPy dtypes).
    options : checked :class:`~numbafa.checks.options.AttentionOptions` (:func:`check_options`)
    caller : the names and layout for the messages.

    Returns
    -------
    Dims
    """
    c = caller
    _check_ranks(c, tensors)
    _check_dtypes(c, tensors)
    dims = _check_dims(c, tensors, options.use_causal_mask)
    dtype = tensors["q_ref"].dtype
    if "lse_ref" in tensors:
        _check_lse_shape(c, tensors["lse_ref"], dims, dtype)
    _check_bound_shapes(c, options, dims.seqlen_q)
    if options.sinks is not None:
        _check_sinks_shape(c, options.sinks, dims.bs, dims.nheads, dtype)
    if options.bias is not None:
        _check_bias_shape(c, options.bias, dims, np.dtype(dtype))
    if options.alibi_slopes is not None:
        _check_alibi_shape(c, options.alibi_slopes, dims, np.dtype(dtype))
    return dims


# --- values: the kernels' arrays -----------------------------------------------------------

def kernel_lse(lse: np.ndarray, natural: tuple) -> np.ndarray:
    """The lse (of checked shape) in the ``natural`` layout ``[bs, nheads, seqlen_q]`` (its
    values: checked in the compiled entry)."""
    if lse.ndim == 4:  # lse[b, h, p, t] is row t * 128 + p
        lse = np.ascontiguousarray(lse.transpose(0, 1, 3, 2)).reshape(natural)
    return kernel_view(lse)


def _kernel_bounds(c: Caller, options: AttentionOptions):
    if options.bound_min is None:
        empty = np.zeros(0, dtype=np.float32)
        return empty, empty
    for key in ("bound_min", "bound_max"):
        if np.isnan(getattr(options, key)).any():
            raise ValueError(f"{c(key)} must not contain NaN")
    return kernel_view(options.bound_min), kernel_view(options.bound_max)


def _kernel_sinks(c: Caller, sinks, dims: Dims, dtype) -> np.ndarray:
    """``[bs, nheads, num_sinks]`` in the accumulator dtype of inputs of ``dtype`` (float32, or
    float64; num_sinks 0 without sinks; ``[nheads]`` broadcast); values checked in the compiled
    entry."""
    acc = accumulator_dtype(dtype)
    if sinks is None:
        return np.zeros((dims.bs, dims.nheads, 0), dtype=acc)
    num_sinks = sinks.shape[2] if sinks.ndim == 3 else 1  # explicit: -1 is ambiguous when bs == 0
    s32 = np.broadcast_to(sinks, (dims.bs, dims.nheads)) if sinks.ndim == 1 else sinks
    return s32.astype(acc, order="C").reshape(dims.bs, dims.nheads, num_sinks)


def _kernel_bias(bias, dtype):
    """The bias ``[bs or 1, nheads or 1, seqlen_q or 1, seqlen_k]`` C-contiguous in the accumulator
    dtype (float32 bias of float32, bf16 or float16 inputs and float64 bias of float64 inputs
    are used in place; others are widened, a copy), or None."""
    if bias is None:
        return None
    acc = accumulator_dtype(dtype)
    b4 = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    if b4.dtype == acc:
        b4 = kernel_view(b4)
    elif is_bf16(b4.dtype):
        b4 = from_bf16_array(b4)
    elif b4.dtype == np.float16:
        b4 = from_fp16_array(np.ascontiguousarray(b4))
    else:
        b4 = np.ascontiguousarray(b4, dtype=acc)
    return b4


def _kernel_alibi(slopes, dtype):
    """The ALiBi slopes ``[bs or 1, nheads]`` in the accumulator dtype, or None."""
    if slopes is None:
        return None
    return np.ascontiguousarray(slopes.reshape((1,) * (2 - slopes.ndim) + tuple(slopes.shape)),
                                dtype=accumulator_dtype(dtype))


#: Metadata that passed its checks: :func:`_metadata_key` -> (checked options without arrays, Dims).
_CHECKED = Memo()


def _metadata_key(tensors: dict, options: AttentionOptions):
    """What the checks of :func:`_metadata` depend on, or None when it cannot be had cheaply: the
    arrays' types, shapes and dtypes, and :meth:`~numbafa.checks.options.AttentionOptions.scalar_key`.
    The caller's names only shape messages, so they are not part of it."""
    parts = []
    for x in tensors.values():
        if type(x) is not np.ndarray:
            return None
        parts.append((x.shape, x.dtype))
    for x in (options.sinks, options.bound_min, options.bound_max, options.bias, options.alibi_slopes):
        if x is not None and type(x) is not np.ndarray:
            return None
        parts.append(None if x is None else (x.shape, x.dtype))
    scalars = options.scalar_key()
    return None if scalars is None else (tuple(parts), scalars)


def _metadata(c: Caller, tensors: dict, options: AttentionOptions):
    """The checks that depend only on the arguments' types, shapes, dtypes and scalar options:
    ``(checked options, Dims)``, remembered per :func:`_metadata_key` (a hit skips them: they
    would pass again; a failing call is never remembered)."""
    key = _metadata_key(tensors, options)
    known = _CHECKED.get(key)
    if known is not None:
        opts, dims = known
        return opts.with_call_values(options), dims
    for k, x in tensors.items():
        _require_array(c, k, x)
    opts = check_options(options, c)
    key_of = {"sinks": "sinks_ref", "bound_min": "bound_min", "bound_max": "bound_max", "bias": "bias",
              "alibi_slopes": "alibi_slopes"}
    for field_name, x in opts.arrays().items():
        if x is not None:
            _require_array(c, key_of[field_name], x)
    dims = check_tensors(tensors, opts, c)
    _CHECKED.put(key, (dataclasses.replace(opts, sinks=None, bound_min=None, bound_max=None, bias=None,
                                           alibi_slopes=None), dims))
    return opts, dims


def _validate(c: Caller, tensors: dict, options: AttentionOptions, any_layout: bool = False) -> Problem:
    opts, dims = _metadata(c, tensors, options)
    dtype = np.dtype(tensors["q_ref"].dtype)
    bmin, bmax = _kernel_bounds(c, opts)
    layout = kernel_layout(tensors["q_ref"]) if any_layout else 0
    arrays = {key: as_kernel_array(x, layout) for key, x in tensors.items() if key != "lse_ref"}
    return Problem(q=arrays["q_ref"], k=arrays["k_ref"], v=arrays["v_ref"], o=arrays.get("o_ref"),
                   dy=arrays.get("dy_ref"), lse=kernel_lse(tensors["lse_ref"], (dims.bs, dims.nheads, dims.seqlen_q)) if "lse_ref" in tensors else None,
                   sinks=_kernel_sinks(c, opts.sinks, dims, dtype),
                   sinks_shape=None if opts.sinks is None else tuple(opts.sinks.shape),
                   sinks_dtype=None if opts.sinks is None else opts.sinks.dtype, bound_min=bmin, bound_max=bmax,
                   use_packing=opts.bound_min is not None, use_causal_mask=opts.use_causal_mask,
                   window=min(opts.sliding_window, dims.seqlen_k),
                   softmax_scale=resolve_scale(opts.softmax_scale, dims.d_head), dtype=dtype,
                   mixed_precision=opts.mixed_precision, dropout_p=opts.dropout_p, seed=opts.seed,
                   seed_offset=opts.seed_offset, bias=_kernel_bias(opts.bias, dtype),
                   bias_shape=None if opts.bias is None else tuple(opts.bias.shape),
                   bias_dtype=None if opts.bias is None else opts.bias.dtype,
                   alibi=_kernel_alibi(opts.alibi_slopes, dtype), softcap=opts.softcap,
                   return_dbias=opts.return_dbias, layout=layout)


def validate_fwd_inputs(q_ref, k_ref, v_ref, options: AttentionOptions = AttentionOptions(),
                        caller: Caller = KERNEL_CALLER, any_layout: bool = False) -> Problem:
    """Check every argument of one forward call; return them normalised for the kernels.

    Parameters
    ----------
    q_ref, k_ref, v_ref : ndarray
        As :func:`numbafa.attention_fwd` (Neuron-layout arrays, possibly views).
    options : AttentionOptions
        The other arguments, as the user gave them or already checked (:func:`check_options`).
    caller : Caller
        The caller's argument names and array layout; error messages use them.
    any_layout : bool
        Give the kernels the arrays in the layout q is C-contiguous in (:func:`kernel_layout`;
        the others copied into it if they are not), no copy into the Neuron layout. False: the
        Neuron layout (the Dask shares cut arrays along its axes).
    """
    return _validate(caller, dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref), options, any_layout)


def validate_bwd_inputs(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, options: AttentionOptions = AttentionOptions(),
                        caller: Caller = KERNEL_CALLER, any_layout: bool = False) -> Problem:
    """Check every argument of one backward call; return them normalised for the kernels.

    As :func:`validate_fwd_inputs`, with ``o_ref``, ``dy_ref`` and ``lse_ref``
    (:func:`numbafa.attention_bwd`).
    """
    return _validate(caller, dict(q_ref=q_ref, k_ref=k_ref, v_ref=v_ref, o_ref=o_ref, dy_ref=dy_ref,
                                  lse_ref=lse_ref), options, any_layout)
