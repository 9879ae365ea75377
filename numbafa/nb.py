"""numbafa from your own ``@numba.njit`` code: a plan made once in Python, the passes called in njit::

    import numba, numbafa.nb

    plan = numbafa.nb.plan(q, k, v, use_causal_mask=True, bias=bias, return_dbias=True)   # Python, once

    @numba.njit
    def step(plan, q, k, v, o, lse, dy, dq, dk, dv, bias, dbias):
        numbafa.nb.attention_fwd(plan, q, k, v, o, lse, bias=bias)
        ...                                                    # the loss, dy = dL/do
        numbafa.nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, bias=bias, dbias=dbias)

:func:`plan` takes every argument :func:`numbafa.attention_fwd` and :func:`numbafa.attention_bwd`
take and checks them as they do (arrays given to it fix shapes and dtypes; their values are not
kept, but the packing bounds'). :func:`attention_fwd` and :func:`attention_bwd` run the same
compiled entries the Python API runs (``numbafa.kernels.entry``, which :func:`plan` compiles or
loads and records in the process's kernel table; a user's function calls them through it and
holds none of their code). nb's own checks and conversions around them are compiled once per
argument types, kept on the disk cache too, and called through the same table: typing a call
compiles or loads them and records them there, :func:`plan` records those the disk cache holds
for its plan (for a user's function loaded from Numba's own cache), so a user's function holds
none of their code either and a later process compiles only the user's function and a one-line
call. Their compile is announced as the kernels' is (logger ``"numbafa"``); a ``RuntimeError``
says so if a function loaded from Numba's cache finds them missing (numbafa's cache off, or
cleared since Numba cached it). They make the same value checks
(non-finite inputs raise ``ValueError`` naming the array), the same exact rescale or
``FloatingPointError`` past float32's range, and give exactly the bits of the Python API for the same
inputs and options, in float32, bf16, float16 and float64. They write preallocated outputs.

Arrays (the Neuron layout): ``q, dq`` ``[bs, nheads, d_head, seqlen_q]``; ``o, dy`` ``[bs, nheads,
d_head_v, seqlen_q]``; ``k, dk`` ``[bs, nheads_kv, d_head, seqlen_k]``; ``v, dv`` ``[bs, nheads_kv,
d_head_v, seqlen_k]``; float32 or float64 as the plan's inputs, or uint16 holding the bits of bf16
(``x.view(numpy.uint16)`` of an ``ml_dtypes.bfloat16`` array) or float16 (of a ``numpy.float16``
array) for a plan made from bf16 or float16 inputs (Numba has no 16-bit float arrays). ``lse``: the
accumulator dtype (float32; float64 for float64 plans) in the plan's ``lse_layout``: the Neuron one
``[bs, nheads, 128, seqlen_q // 128]`` (``seqlen_q`` a multiple of 128) or the natural ``[bs,
nheads, seqlen_q]``. ``sinks``/``dsinks``, ``bias``/``dbias``, ``alibi_slopes``: the shapes the plan
was made with, the accumulator dtype (``sinks`` may also be bf16/fp16 bits for such plans), given
exactly when the plan has them. ``dbias`` is written when the plan was made with
``return_dbias=True``.

Every misuse is an error naming the argument, with the expected and the actual value, raised
before anything is written: a shape, dtype or rank the plan does not have, a read-only output,
outputs that share memory with each other or with an input still needed. A plan is checked on
every call against this process's record of the plans it made (its fields and a random token):
a plan changed since, built from another plan's fields, or made in another process (pickled,
a container whose PID repeats) raises ``ValueError``; no value in a plan is an address. Errors
whose message carries values (a shape, a count, a name) are :class:`NbValueError`,
:class:`NbTypeError` or :class:`NbFloatingPointError`: subclasses of the
builtin exceptions (``except ValueError`` catches them) whose message is formatted in Python when
raised, so that compiled code builds no strings (pickled, they are the builtin exception). Attention
dropout is set in the plan (``dropout_p``, ``seed``, ``seed_offset``); :func:`with_seed_offset`
gives the plan of another step's mask, in njit code too.

Threads: the passes run their ``prange`` launcher, on ``numba.get_num_threads()`` threads. The
tile GEMMs inside call BLAS from every thread, so each pass holds SciPy's BLAS at one thread
while it runs, with the Python API's reference-counted pin
(:func:`numbafa.nb.single_threaded_blas`, entered and left through two C functions found
in the kernel table, on every path out of the entry: with SciPy's OpenBLAS the native pin,
without the GIL, ``numbafa/platform/blas.py``). On the BLAS GEMM path (CPUs without
bf16 units) a multi-threaded OpenBLAS called from those threads is not only oversubscribed but
returns other results: with OpenBLAS 0.3.30's Haswell kernels, 42-44 % of ``o``'s elements
differed from the Python API's without the pin. ``with numbafa.nb.single_threaded_blas():``
around a loop holds the pin once for the loop (each pass then only counts). Under Numba's
``workqueue`` threading layer only one launch may run at a time in the process (Numba's rule;
the Python API serialises its own calls).
"""

from __future__ import annotations

import os
from collections import namedtuple

import numba
import numpy as np
from numba import types
from numba.core.registry import CPUDispatcher

from .pipeline import core
from .platform.blas import single_threaded_blas
from .conventions.dtypes import bf16_dtype, f32_to_bf16_bits, f32_to_fp16_bits, fp16_bits_to_f32, widen
from .compiler.arrays import bitcast, empty, zeros
from .compiler.jit import cached_signatures, jit, overload
from .kernels.backward import BwdStats
from .kernels.bundles import BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, Plan, make_plan
from .kernels.dropout import Dropout, dropout_plugins, philox_words
from .kernels.entry import (EXACT_SCORES, GRADIENTS, LSE_VALUES, NONFINITE, OUTPUT, OUTPUTS, SCALED_Q, SCORES,
                            SCORES_WITH_BIAS, STATUS_WORDS, SUMS, backward_entry, exact_scores_plugin, forward_entry)
from .kernels.launch import prepare_backward, prepare_forward
from .kernels.stored import stored_bwd, stored_fwd
from .kernels.scores import ScoreMods, score_plugins
from .kernels.table import ensure_plugins, kernel_address
from .compiler.linking import KERNELS, call_key, call_or_raise, call_value_between, register_function
from .compiler.runtime import PIN_KEY, UNPIN_KEY, announced_compile, register_pin
from .checks.options import AttentionOptions, Caller
from .compiler.records import replaced
from .conventions.tiling import Q_TILE
from .checks.validation import require_uint64, validate_fwd_inputs

__all__ = ["NbPlan", "plan", "attention_fwd", "attention_bwd", "with_seed_offset", "single_threaded_blas",
           "to_bf16_bits", "from_bf16_bits", "NbValueError", "NbTypeError", "NbFloatingPointError"]

#: The inputs' storage, as a plan records it: float32, bf16 bits, fp16 bits, float64.
FLOAT32, BF16, FP16, FLOAT64 = 0, 1, 2, 3

#: A problem made ready for the njit calls by :func:`plan`: ``fwd``/``bwd`` the kernels' plans of
#: each pass; ``dims`` ``(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_head_v)``; ``kind``
#: (:data:`FLOAT32`, :data:`BF16`, :data:`FP16`, :data:`FLOAT64`); ``sinks_shape`` ``(ndim, ...)``
#: (ndim 0: none), ``bias_shape``, ``alibi_shape`` likewise; ``return_dbias``; ``lse_natural``
#: (the lse layout); ``seed`` (the dropout seed as two 32-bit words, for :func:`with_seed_offset`);
#: ``token``, a random number this process recorded the plan with.
NbPlan = namedtuple("NbPlan", ["fwd", "bwd", "dims", "kind", "sinks_shape", "bias_shape", "alibi_shape",
                               "return_dbias", "lse_natural", "seed", "token"])

#: The fields of an :data:`NbPlan` that a call's checks and conversions read, without the kernel
#: plans (whose arrays make an NbPlan ~200 values: every compiled call flattens its arguments into
#: values, and every copy of an array is reference-counted). Built once per pass, in njit code
#: (:func:`_planned`); the checks and conversions ``_storage_kind``, ``_expect_lse``, ``_call_scores``,
#: ``_kernel_sinks``, ``_run_forward`` and ``_run_backward`` take it as their ``plan``.
_Planned = namedtuple("_Planned", ["dims", "kind", "sinks_shape", "bias_shape", "alibi_shape", "return_dbias",
                                   "lse_natural"])


class _Formatted:
    """An exception raised in njit code as ``Error(template, *values)``: the template a constant of
    the compiled code, the values (ints, tuples of ints, names) boxed when it reaches Python, the
    message ``template.format(*values)`` built here. Compiled code then holds no string building
    (Numba compiles every concatenation and ``str(int)`` into each caller, most of a user's compile).
    Pickled, it is the builtin exception with its message."""

    def __init__(self, template, *values):
        super().__init__(template.format(*values))

    def __reduce__(self):
        return type(self).__mro__[2], self.args


class NbValueError(_Formatted, ValueError):
    """A ``ValueError`` raised by :mod:`numbafa.nb`'s calls in njit code."""


class NbTypeError(_Formatted, TypeError):
    """A ``TypeError`` raised by :mod:`numbafa.nb`'s calls in njit code."""


class NbFloatingPointError(_Formatted, FloatingPointError):
    """A ``FloatingPointError`` raised by :mod:`numbafa.nb`'s calls in njit code."""


_CALLER = Caller({"q_ref": "q", "k_ref": "k", "v_ref": "v", "sinks_ref": "sinks"})
_U64 = np.uint64


def _padded(shape, n: int) -> tuple:
    """``(len(shape), *shape)`` padded with zeros to ``n + 1`` ints (``shape`` None: all zeros)."""
    if shape is None:
        return (0,) * (n + 1)
    shape = tuple(int(x) for x in shape)
    return (len(shape),) + shape + (0,) * (n - len(shape))


def _as_numpy_dtype(x):
    """uint16 arrays as bf16 (the njit calls' bits); other arrays as they are."""
    return x.view(bf16_dtype()) if isinstance(x, np.ndarray) and x.dtype == np.uint16 else x


def plan(q, k, v, *, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False, mixed_precision=False,
         softmax_scale=None, sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0, bias=None,
         alibi_slopes=None, softcap=None, return_dbias=False, with_sinks=None, lse_layout="neuron") -> NbPlan:
    """Check a problem once, for :func:`attention_fwd` and :func:`attention_bwd` in njit code.

    Parameters
    ----------
    q, k, v : ndarray
        As :func:`numbafa.attention_fwd` (float32, ``ml_dtypes.bfloat16``, float16, float64; uint16
        is taken as bf16 bits): they fix the shapes and the dtype of the calls; their values are
        not kept.
    sinks, bias, alibi_slopes : ndarray, optional
        Fix the shapes of the calls' arrays of that name (``bias`` and ``alibi_slopes`` must be in
        the accumulator dtype: float32, float64 for float64 inputs).
    bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale, sliding_window,
    dropout_p, seed, seed_offset, softcap, return_dbias
        As in :func:`numbafa.attention_bwd` (the bounds' values are kept: they set the mask).
    with_sinks : bool, optional
        A shorthand: sinks ``[bs, nheads]`` without giving an array.
    lse_layout : {"neuron", "natural"}
        The calls' lse: ``[bs, nheads, 128, seqlen_q // 128]`` or ``[bs, nheads, seqlen_q]``.

    Returns
    -------
    NbPlan
        Valid in this process only. Compiles (or loads from the disk cache) the kernels of this
        dtype and these options first, announced as by the Python API.

    Raises
    ------
    TypeError, ValueError
        As :func:`numbafa.attention_bwd`, naming ``q``, ``k``, ``v``, ...; a bias or slopes not
        in the accumulator dtype; the Neuron lse layout with ``seqlen_q`` not a multiple of 128.
    """
    if with_sinks is not None and not isinstance(with_sinks, (bool, np.bool_)):
        raise TypeError(f"with_sinks must be a bool, got {type(with_sinks).__name__}")
    q, k, v = (_as_numpy_dtype(x) for x in (q, k, v))
    if with_sinks and sinks is None:
        sinks = np.zeros(np.shape(q)[:2], np.float32)   # (q is checked below)
    options = AttentionOptions(sinks=_as_numpy_dtype(sinks), bound_min=bound_min, bound_max=bound_max,
                               use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                               softmax_scale=softmax_scale, sliding_window=sliding_window, dropout_p=dropout_p,
                               seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                               softcap=softcap, return_dbias=return_dbias)
    prob = validate_fwd_inputs(q, k, v, options, _CALLER)
    core.check_lse_layout(lse_layout, prob.q.shape[3])
    _check_score_dtypes(prob, bias, alibi_slopes)
    kind = FLOAT64 if prob.dtype.char == "d" else FP16 if prob.is_fp16 else BF16 if prob.is_bf16 else FLOAT32
    fwd, bwd = make_plan(prob, backward=False), make_plan(prob, backward=True)
    nb_plan = NbPlan(fwd=_without_arrays(fwd), bwd=_without_arrays(bwd),
                     dims=(prob.q.shape[0], prob.q.shape[1], prob.k.shape[1], prob.q.shape[2], prob.q.shape[3],
                           prob.k.shape[3], prob.v.shape[2]),
                     kind=kind, sinks_shape=_padded(prob.sinks_shape, 3), bias_shape=_padded(prob.bias_shape, 4),
                     alibi_shape=_padded(None if prob.alibi is None else np.shape(alibi_slopes), 2),
                     return_dbias=bool(prob.return_dbias), lse_natural=lse_layout == "natural",
                     seed=(prob.seed & 0xFFFFFFFF, prob.seed >> 32),
                     token=int.from_bytes(os.urandom(8), "little") >> 2)
    _prepare(prob, fwd, bwd)
    _register_cached_bodies(nb_plan)
    KERNELS.register(int(plan_digest(nb_plan)), 1)
    return nb_plan


def _check_score_dtypes(prob, bias, alibi_slopes) -> None:
    acc = np.float64 if prob.dtype.char == "d" else np.float32
    for name, x in (("bias", bias), ("alibi_slopes", alibi_slopes)):
        if x is not None and x.dtype != acc:
            raise TypeError(f"numbafa.nb takes {name} in the accumulator dtype, {np.dtype(acc)} for {prob.dtype} "
                            f"inputs, got {x.dtype}")


def _without_arrays(kernel_plan):
    """A kernel plan whose score variants hold no arrays (the calls give them)."""
    scores = kernel_plan.scores
    empty4, empty2 = np.zeros((0, 0, 0, 0), scores.bias.dtype), np.zeros((0, 0), scores.bias.dtype)
    return kernel_plan._replace(scores=scores._replace(bias=empty4, alibi=empty2, dbias=empty4))


def _prepare(prob, fwd, bwd) -> None:
    """Compile (or load) and register every kernel the calls of this problem's types can need."""
    register_pin()
    numba.get_num_threads()   # start the threading layer: a user's function loaded from Numba's cache
    storage = prob.q          # may launch before anything else did
    acc = fwd.acc.dtype
    q4 = np.empty((0,) * 4, storage.dtype)
    a4, a3 = np.empty((0,) * 4, acc), np.empty((0,) * 3, acc)
    acc_of = fwd.acc
    fwd_ins, fwd_outs = FwdInputs(q4, q4, q4, a3), FwdOutputs(a4, a3)
    bwd_ins = BwdInputs(q=q4, k=q4, v=q4, o=q4, dy=q4, lse=a3, sinks=a3)
    bwd_outs, stats = BwdOutputs(dq=a4, dk=a4, dv=a4, dsinks=a3, part_dk=a4, part_dv=a4), BwdStats(a3, a3)
    items, status, exponent = np.zeros(0, np.int64), np.zeros(STATUS_WORDS, np.int64), np.int64(-1)
    # the entries, for the argument tuples _call_forward and _call_backward build
    fwd_args = (stored_fwd(fwd_ins, acc_of), fwd_outs, _without_arrays(fwd), items, exponent, status)
    bwd_args = (stored_bwd(bwd_ins, acc_of), bwd_outs, stats, _without_arrays(bwd), items, items, exponent, status)
    with core.kernel_call("forward", core._dtype_name(fwd_ins, fwd)):
        prepare_forward(fwd_args[0], fwd_outs, fwd)
        ensure_plugins(exact_scores_plugin(fwd_ins, fwd))
        register_function(forward_entry, [numba.typeof(x) for x in fwd_args])
    with core.kernel_call("backward", core._dtype_name(bwd_ins, bwd)):
        prepare_backward(bwd_args[0], bwd_outs, stats, bwd, finish=True)
        register_function(backward_entry, [numba.typeof(x) for x in bwd_args])
    for kernel_plan in (fwd, bwd):
        if kernel_plan.dropout.active:
            ensure_plugins(dropout_plugins(kernel_plan))
        if kernel_plan.scores.active:
            ensure_plugins(score_plugins(kernel_plan))


# --- the plan's record ---------------------------------------------------------------------

@jit()
def _mix(h, word):
    """One step of FNV-1a over 64-bit words."""
    return (h ^ _U64(word)) * _U64(0x100000001B3)


@jit()
def _plan_words(h, p):
    """:func:`_mix` every field of a kernel plan but the dropout's key (which
    :func:`with_seed_offset` changes) into ``h``."""
    t = p.tiling
    for x in (t.q_tile, t.k_tile, t.k_sub_tile, t.q_tile_group, t.d_tile, t.section_len, t.q_chunks, t.group_rows):
        h = _mix(h, x)
    m = p.mask
    h = _mix(_mix(_mix(h, m.causal), m.window), m.use_packing)
    h = _mix(h, m.key_lo.size)
    for i in range(m.key_lo.size):
        h = _mix(_mix(h, m.key_lo[i]), m.key_hi[i])
    h = _mix(_mix(h, p.precision.round_kernel), p.precision.round_acc)
    h = _mix(h, bitcast(np.float64(p.softmax_scale), np.int64))
    h = _mix(_mix(_mix(h, p.gemm.onednn), p.gemm.bits), p.gemm.onednn_max_mnk)
    d = p.dropout
    h = _mix(_mix(_mix(h, d.active), d.threshold), bitcast(np.float64(d.scale), np.int64))
    h = _mix(_mix(h, d.batch0), d.head0)
    s = p.scores
    h = _mix(_mix(h, s.active), bitcast(np.float64(s.softcap), np.int64))
    h = _mix(h, bitcast(np.float64(s.inv_softcap), np.int64))
    h = _mix(_mix(_mix(h, s.offset), s.serial_batch), s.serial_heads)
    return _mix(_mix(h, s.bias.size + s.alibi.size + s.dbias.size), p.layout)


@jit(entry=True)
def plan_digest(plan):
    """A 63-bit digest of every field of an :data:`NbPlan` (its token included) that the calls
    trust; :func:`plan` records it, every call looks it up (:func:`_check_plan`)."""
    h = _U64(0xCBF29CE484222325)
    for x in plan.dims:
        h = _mix(h, x)
    h = _mix(h, plan.kind)
    for x in plan.sinks_shape + plan.bias_shape + plan.alibi_shape:
        h = _mix(h, x)
    h = _mix(_mix(_mix(h, plan.return_dbias), plan.lse_natural), plan.token)
    h = _plan_words(_plan_words(h, plan.fwd), plan.bwd)
    return np.int64(h >> _U64(1)) | np.int64(1)


@jit()
def _check_plan(plan):
    if kernel_address(plan_digest(plan)) != 1:
        raise ValueError("numbafa.nb: this plan was not made by numbafa.nb.plan in this process, or was changed "
                         "since (a field replaced, or taken from another plan); make it with numbafa.nb.plan here")


# --- the calls' arguments, checked when they are typed (the message raised when called) -----

_NAMES = ("q", "k", "v", "o", "dy", "lse", "dq", "dk", "dv", "sinks", "dsinks", "bias", "dbias", "alibi_slopes")
_STORAGE = {types.float32: "float32", types.uint16: "uint16 (bf16 or float16 bits)", types.float64: "float64"}


#: The 4-D arrays of the calls and their layouts; the largest rank of the optional ones.
_LAYOUTS = {"q": "[bs, nheads, d_head, seqlen_q]", "dq": "[bs, nheads, d_head, seqlen_q]",
            "k": "[bs, nheads_kv, d_head, seqlen_k]", "dk": "[bs, nheads_kv, d_head, seqlen_k]",
            "v": "[bs, nheads_kv, d_head_v, seqlen_k]", "dv": "[bs, nheads_kv, d_head_v, seqlen_k]",
            "o": "[bs, nheads, d_head_v, seqlen_q]", "dy": "[bs, nheads, d_head_v, seqlen_q]"}
_MAX_DIMS = {"sinks": 3, "dsinks": 3, "bias": 4, "dbias": 4, "alibi_slopes": 2}


def _type_problem(arrays: dict, outputs: tuple) -> tuple | None:
    """What is wrong with the Numba types of a call's arrays (``arrays``: name -> type, None for
    an argument not given), or None: the arrays are arrays, q's dtype is a storage dtype and every
    other tensor's is q's, the optional ones are the accumulator dtype, ``outputs`` are writable, and
    the ranks are the calls' (the 4-D arrays; 3 or 4 for lse; at most the largest for the optional
    ones). A problem is ``(TypeError or ValueError, message)``."""
    q = arrays["q"]
    if not isinstance(q, types.Array) or q.dtype not in _STORAGE:
        got = q.dtype if isinstance(q, types.Array) else q
        return TypeError, f"numbafa.nb: q must be a float32, float64 or uint16 (bf16 or float16 bits) array, got {got}"
    acc = types.float64 if q.dtype == types.float64 else types.float32
    for name, t in arrays.items():
        if t is None or isinstance(t, (types.NoneType, types.Omitted)):
            if name in _LAYOUTS or name == "lse":
                return TypeError, f"numbafa.nb: {name} must be a NumPy array, got {t if t is not None else 'nothing'}"
            continue
        if not isinstance(t, types.Array):
            return TypeError, f"numbafa.nb: {name} must be a NumPy array, got {t}"
        expected = q.dtype if name in ("q", "k", "v", "o", "dy", "dq", "dk", "dv") else acc
        allowed = (expected, types.uint16) if name == "sinks" and q.dtype == types.uint16 else (expected,)
        if t.dtype not in allowed:
            names = " or ".join(map(str, allowed))
            return TypeError, f"numbafa.nb: {name} must be {names} (q is {q.dtype}), got {t.dtype}"
        if name in outputs and not t.mutable:
            return ValueError, f"numbafa.nb: {name} must be writable, got a read-only array"
        if name in _LAYOUTS and t.ndim != 4:
            return ValueError, f"numbafa.nb: {name} must be 4-D {_LAYOUTS[name]}, got a {t.ndim}-D array"
        if name == "lse" and t.ndim not in (3, 4):
            return ValueError, (f"numbafa.nb: lse must be 3-D [bs, nheads, seqlen_q] (lse_layout='natural') or 4-D "
                                f"[bs, nheads, 128, seqlen_q // 128] (the Neuron layout), got a {t.ndim}-D array")
        if name in _MAX_DIMS and not 1 <= t.ndim <= _MAX_DIMS[name]:
            return ValueError, f"numbafa.nb: {name} must have 1 to {_MAX_DIMS[name]} dims as the plan's, got {t.ndim}"
    return None


def _given(t) -> bool:
    return t is not None and not isinstance(t, (types.NoneType, types.Omitted))


# --- conversions inside njit code ----------------------------------------------------------

def _kernel_input(x):  # pragma: no cover - replaced inside njit code
    """An input array as the kernels take it: C-contiguous and of a writable type (a read-only
    array is typed as a writable one, no copy: the kernels never write their inputs; a strided
    one is copied)."""
    raise NotImplementedError


@overload(_kernel_input)
def _kernel_input_overload(x):
    if x.layout != "C":
        return lambda x: np.ascontiguousarray(x)
    if not x.mutable:
        return lambda x: _as_mutable(x)
    return lambda x: x


from numba.extending import intrinsic  # noqa: E402


@intrinsic
def _as_mutable(typingctx, x):
    """A read-only array typed as a writable one (the same data; the kernels never write inputs)."""
    if not isinstance(x, types.Array):
        return None
    retty = x.copy(readonly=False)

    def codegen(context, builder, sig, args):
        context.nrt.incref(builder, sig.args[0], args[0])
        return args[0]

    return retty(x), codegen


@jit()
def _widen_fp16(x):
    """fp16 bits (uint16) as a new C-contiguous float32 array of their exact values."""
    out = empty(x.shape, np.float32)
    src = np.ascontiguousarray(x).reshape(-1)
    dst = out.reshape(-1)
    for i in range(src.size):
        dst[i] = fp16_bits_to_f32(src[i])
    return out


def _store(y, x, kind):  # pragma: no cover - replaced inside njit code
    """Write the kernels' output ``y`` (C, the accumulator dtype, values of the output dtype) into
    the caller's ``x`` (its storage: float32/float64 values, bf16 or fp16 bits), unless ``y`` is
    ``x`` itself."""
    raise NotImplementedError


@overload(_store)
def _store_overload(y, x, kind):
    if x.dtype == types.uint16:
        if x.layout == "C":
            def bits_in_place(y, x, kind):
                _to_bits(y.reshape(-1), x.reshape(-1), kind)
            return bits_in_place

        def bits(y, x, kind):
            out = empty(y.size, np.uint16)
            _to_bits(y.reshape(-1), out, kind)
            _assign(x, out.reshape(x.shape))
        return bits

    def values(y, x, kind):
        if y.ctypes.data != x.ctypes.data:
            _assign(x, y)
    return values


@jit()
def _to_bits(src, out, kind):
    """``out`` (1-D uint16) = the bf16 or fp16 (``kind``) bits of the 1-D float32 ``src``'s values."""
    if kind == FP16:
        for i in range(src.size):
            out[i] = f32_to_fp16_bits(src[i])
    else:   # bf16 values: their upper half (exact)
        for i in range(src.size):
            out[i] = np.uint16(bitcast(np.float32(src[i]), np.uint32) >> np.uint32(16))


def _output(x):  # pragma: no cover - replaced inside njit code
    """An array the kernels may write in place of the caller's output ``x`` (``x`` itself when it
    is C-contiguous in the accumulator dtype), else a new one."""
    raise NotImplementedError


@overload(_output)
def _output_overload(x):
    if x.dtype in (types.float32, types.float64) and x.layout == "C":
        return lambda x: x
    acc = np.float64 if x.dtype == types.float64 else np.float32
    return lambda x: empty(x.shape, acc)


@jit()
def _extent(x):
    """``(first, last)`` byte addresses (int64) an array's elements span."""
    lo = np.int64(x.ctypes.data)
    hi = lo + np.int64(x.itemsize)
    for axis in range(x.ndim):
        span = np.int64(x.shape[axis] - 1) * np.int64(x.strides[axis])
        if x.shape[axis] == 0:
            return lo, lo
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi


# (The checks that take an argument's name are overloads: Numba types a call's constant strings as
# literals and compiles a jitted function once for each, an overload once for all.)

def _expect_shape(shape, name, expected):  # pragma: no cover - replaced inside njit code
    """Raise unless an array's ``shape`` is the tuple ``expected`` (its rank too). (Shapes, not
    arrays: one compile per rank, and a pass's arrays of different types, a read-only input and
    its writable gradient, checked in one loop.)"""
    raise NotImplementedError


@overload(_expect_shape)
def _expect_shape_overload(shape, name, expected):
    def impl(shape, name, expected):
        same = len(shape) == len(expected)
        if same:
            for axis in range(len(shape)):
                same = same and shape[axis] == expected[axis]
        if not same:
            raise NbValueError("numbafa.nb: {} must have shape {} as the plan's, got {}", name, expected, shape)
    return impl


def _element(x, b, h, s):  # pragma: no cover - replaced inside njit code
    """Element ``(b, h, s)`` of sinks ``[nheads]``, ``[bs, nheads]`` or ``[bs, nheads, n]``."""
    raise NotImplementedError


@overload(_element)
def _element_overload(x, b, h, s):
    if x.ndim == 1:
        return lambda x, b, h, s: x[h]
    if x.ndim == 2:
        return lambda x, b, h, s: x[b, h]
    return lambda x, b, h, s: x[b, h, s]


def _value(x, kind):  # pragma: no cover - replaced inside njit code
    """One stored element as a float: bf16 or fp16 bits (by ``kind``) widened, floats as they are."""
    raise NotImplementedError


@overload(_value)
def _value_overload(x, kind):
    if x == types.uint16:
        return lambda x, kind: fp16_bits_to_f32(x) if kind == FP16 else widen(x)
    return lambda x, kind: x


def _kernel_sinks(plan, acc, sinks):  # pragma: no cover - replaced inside njit code
    """The call's sinks as the kernels take them: ``[bs, nheads, num_sinks]`` in the accumulator
    dtype (``acc``'s, an array's; ``num_sinks`` 0 without sinks), after checking them against the
    plan (a :data:`_Planned`)."""
    raise NotImplementedError


@overload(_kernel_sinks)
def _kernel_sinks_overload(plan, acc, sinks):
    dtype = np.float64 if acc.dtype == types.float64 else np.float32
    if not _given(sinks):
        def none(plan, acc, sinks):
            if plan.sinks_shape[0] != 0:
                raise ValueError("numbafa.nb: the plan was made with sinks: pass sinks")
            return zeros((plan.dims[0], plan.dims[1], 0), dtype)
        return none
    ndim = sinks.ndim

    def given(plan, acc, sinks):
        if plan.sinks_shape[0] == 0:
            raise ValueError("numbafa.nb: the plan was made without sinks: make it with sinks (or with_sinks=True)")
        if plan.sinks_shape[0] != ndim:
            raise NbValueError("numbafa.nb: sinks must have the rank of the plan's sinks ({}), got {}",
                               plan.sinks_shape[0], ndim)
        _expect_planned(sinks, "sinks", plan.sinks_shape)
        bs, nheads = plan.dims[0], plan.dims[1]
        n = sinks.shape[2] if ndim == 3 else 1
        out = empty((bs, nheads, n), dtype)
        for b in range(bs):
            for h in range(nheads):
                for i in range(n):
                    out[b, h, i] = _value(_element(sinks, b, h, i), plan.kind)
        return out
    return given


def _padded4(x):  # pragma: no cover - replaced inside njit code
    """A bias-shaped array (1 to 4 dims) as a 4-D C-contiguous one, leading axes of 1 added (``x``'s
    memory when it is C-contiguous, else a copy)."""
    raise NotImplementedError


@overload(_padded4)
def _padded4_overload(x):
    reshape = {1: lambda c: c.reshape((1, 1, 1, c.shape[0])),
               2: lambda c: c.reshape((1, 1, c.shape[0], c.shape[1])),
               3: lambda c: c.reshape((1, c.shape[0], c.shape[1], c.shape[2])),
               4: lambda c: c}[x.ndim]
    reshape = jit()(reshape)
    return lambda x: reshape(np.ascontiguousarray(x))


def _expect_planned(x, name, planned):  # pragma: no cover - replaced inside njit code
    """Raise unless ``x`` has the rank and shape ``planned`` (``(ndim, *dims)``, zero-padded)
    records."""
    raise NotImplementedError


@overload(_expect_planned)
def _expect_planned_overload(x, name, planned):
    ndim = x.ndim
    dims = jit()({1: lambda p: (p[1],), 2: lambda p: (p[1], p[2]), 3: lambda p: (p[1], p[2], p[3]),
                  4: lambda p: (p[1], p[2], p[3], p[4])}[ndim])

    def impl(x, name, planned):
        if planned[0] != ndim:
            raise NbValueError("numbafa.nb: {} must have {} dims as the plan's, got {}", name, planned[0], ndim)
        _expect_shape(x.shape, name, dims(planned))
    return impl


def _call_scores(scores, plan, bias, alibi, dbias, backward):  # pragma: no cover - replaced inside njit code
    """The plan's :data:`~numbafa.kernels.scores.ScoreMods` with the call's bias, slopes and dbias
    (checked against the plan's shapes; dbias zeroed: the kernels add into it; the backward of a
    plan made with ``return_dbias`` needs one)."""
    raise NotImplementedError


@overload(_call_scores)
def _call_scores_overload(scores, plan, bias, alibi, dbias, backward):
    has_bias, has_alibi, has_dbias = _given(bias), _given(alibi), _given(dbias)

    def impl(scores, plan, bias, alibi, dbias, backward):
        if (plan.bias_shape[0] != 0) != has_bias:
            raise ValueError("numbafa.nb: pass bias exactly when the plan was made with a bias")
        if (plan.alibi_shape[0] != 0) != has_alibi:
            raise ValueError("numbafa.nb: pass alibi_slopes exactly when the plan was made with them")
        if has_dbias and not plan.return_dbias:
            raise ValueError("numbafa.nb: the plan was made without return_dbias: pass no dbias")
        out = scores
        if has_bias:
            _expect_planned(bias, "bias", plan.bias_shape)
            out = replaced(out, "bias", _padded4(bias))
        if has_alibi:
            _expect_planned(alibi, "alibi_slopes", plan.alibi_shape)
            out = replaced(out, "alibi", _padded2(alibi))
        if has_dbias:
            _expect_planned(dbias, "dbias", plan.bias_shape)
            kernel_dbias = zeros(out.bias.shape, out.bias.dtype)
            out = replaced(out, "dbias", kernel_dbias)
        elif backward and plan.return_dbias:
            raise ValueError("numbafa.nb: the plan was made with return_dbias=True: pass dbias")
        return out
    return impl


def _padded2(x):  # pragma: no cover - replaced inside njit code
    """ALiBi slopes ``[nheads]`` or ``[bs, nheads]`` as a 2-D C-contiguous array."""
    raise NotImplementedError


@overload(_padded2)
def _padded2_overload(x):
    if x.ndim == 1:
        return lambda x: np.ascontiguousarray(x).reshape((1, x.shape[0]))
    return lambda x: np.ascontiguousarray(x)


# --- the plan's fields back in the kernels' types -------------------------------------------

def _canonical(kernel_plan):  # pragma: no cover - replaced inside njit code
    """A kernel plan with its float fields in the accumulator dtype again (a plan that went back to
    Python from njit code comes back with float64 ones: Numba boxes float32 as a Python float)."""
    raise NotImplementedError


@overload(_canonical)
def _canonical_overload(kernel_plan):
    cast = np.float64 if kernel_plan.types[kernel_plan.fields.index("acc")].dtype == types.float64 else np.float32

    def impl(kernel_plan):
        p = kernel_plan
        d, s = p.dropout, p.scores
        return Plan(tiling=p.tiling, mask=p.mask, precision=p.precision, softmax_scale=cast(p.softmax_scale),
                    gemm=p.gemm, dropout=Dropout(active=d.active, threshold=d.threshold, scale=cast(d.scale), key0=d.key0,
                                                 key1=d.key1, batch0=d.batch0, head0=d.head0),
                    acc=p.acc, scores=ScoreMods(active=s.active, softcap=cast(s.softcap), inv_softcap=cast(s.inv_softcap),
                                                bias=s.bias, alibi=s.alibi, offset=s.offset, dbias=s.dbias,
                                                serial_batch=s.serial_batch, serial_heads=s.serial_heads),
                    layout=p.layout)
    return impl


# --- the checks of a call ---------------------------------------------------------------------

_STORAGE_NAMES = ("float32", "bf16 bits (uint16)", "float16 bits (uint16)", "float64")


def _storage_kind(q, plan):  # pragma: no cover - replaced inside njit code
    """Raise unless the arrays' dtype is the plan's (:data:`FLOAT32`, bits for :data:`BF16` and
    :data:`FP16`, :data:`FLOAT64`)."""
    raise NotImplementedError


@overload(_storage_kind)
def _storage_kind_overload(q, plan):
    kinds = {types.float32: (FLOAT32, FLOAT32), types.uint16: (BF16, FP16), types.float64: (FLOAT64, FLOAT64)}[q.dtype]
    template = "numbafa.nb: the arrays must be {} as the plan's inputs, got " + _STORAGE[q.dtype]

    def impl(q, plan):
        if plan.kind != kinds[0] and plan.kind != kinds[1]:
            raise NbTypeError(template, _STORAGE_NAMES[plan.kind])
    return impl


def _expect_lse(lse, plan):  # pragma: no cover - replaced inside njit code
    """Raise unless ``lse`` has the plan's layout and shape."""
    raise NotImplementedError


@overload(_expect_lse)
def _expect_lse_overload(lse, plan):
    ndim = lse.ndim
    natural = f"numbafa.nb: lse must be 3-D [bs, nheads, seqlen_q] (the plan's lse_layout='natural'), got {ndim} dims"
    neuron = (f"numbafa.nb: lse must be 4-D [bs, nheads, 128, seqlen_q // 128] (the plan's lse_layout='neuron'), "
              f"got {ndim} dims")

    def impl(lse, plan):
        bs, nheads, sq = plan.dims[0], plan.dims[1], plan.dims[4]
        if plan.lse_natural:
            if ndim != 3:
                raise ValueError(natural)
            _expect_shape(lse.shape, "lse", (bs, nheads, sq))
        else:
            if ndim != 4:
                raise ValueError(neuron)
            _expect_shape(lse.shape, "lse", (bs, nheads, Q_TILE, sq // Q_TILE))
    return impl


def _apart(a, name_a, b, name_b):  # pragma: no cover - replaced inside njit code
    """Raise if the byte extents ``a`` (an output's) and ``b`` (:func:`_extent`) intersect."""
    raise NotImplementedError


@overload(_apart)
def _apart_overload(a, name_a, b, name_b):
    def impl(a, name_a, b, name_b):
        if a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]:
            raise NbValueError("numbafa.nb: {} shares memory with {}: outputs must not overlap each other or the "
                               "inputs", name_a, name_b)
    return impl


def _apart_if(a, name_a, b, name_b):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_apart_if)
def _apart_if_overload(a, name_a, b, name_b):
    if not (_given(a) and _given(b)):
        return lambda a, name_a, b, name_b: None
    return lambda a, name_a, b, name_b: _apart(_extent(a), name_a, _extent(b), name_b)


#: The arrays whose byte extents a pass compares (outputs first) and the pairs that must not
#: intersect, in the order they are checked: the forward's outputs against the inputs; the
#: backward's gradients against every input (all are read until the end) and each other.
_FWD_NAMES = ("o", "lse", "q", "k", "v")
_FWD_PAIRS = ((0, 2), (0, 3), (0, 4), (0, 1), (1, 2), (1, 3), (1, 4))
_BWD_NAMES = ("dq", "dk", "dv", "q", "k", "v", "o", "dy", "lse")
_BWD_PAIRS = tuple((g, i) for g in (0, 1, 2) for i in (3, 6, 7, 8)) + tuple((g, i) for g in (0, 1, 2) for i in (4, 5)) \
    + ((0, 1), (0, 2), (1, 2))


@jit()
def _check_apart(extents, names, pairs):
    """Raise for the first pair ``(i, j)`` of ``pairs`` whose extents (:func:`_extent`) intersect,
    naming ``names[i]`` and ``names[j]``. Its arguments' types are the same for every array type of
    a call: compiled once, not with each pass body."""
    for n in range(len(pairs)):
        i, j = pairs[n]
        _apart(extents[i], names[i], extents[j], names[j])


# --- the outputs ---------------------------------------------------------------------------

def _store_lse(natural, lse):  # pragma: no cover - replaced inside njit code
    """The kernels' natural lse into the caller's (its layout: checked before)."""
    raise NotImplementedError


@overload(_store_lse)
def _store_lse_overload(natural, lse):
    if lse.ndim == 3:
        def same(natural, lse):
            _assign(lse, natural)
        return same

    def neuron(natural, lse):
        bs, nheads, tile, n_tiles = lse.shape
        for b in range(bs):
            for h in range(nheads):
                for t in range(n_tiles):
                    for p in range(tile):
                        lse[b, h, p, t] = natural[b, h, t * tile + p]
    return neuron


def _store_dsinks(dsinks, out):  # pragma: no cover - replaced inside njit code
    """The kernels' dsinks ``[bs, nheads, n]`` into the caller's (the sinks' shape: ``[nheads]`` is
    summed over the batch in the accumulator dtype)."""
    raise NotImplementedError


@overload(_store_dsinks)
def _store_dsinks_overload(dsinks, out):
    if not _given(out):
        return lambda dsinks, out: None
    if out.ndim == 1:
        def heads(dsinks, out):
            for h in range(out.size):
                total = dsinks[0, h, 0]
                for b in range(1, dsinks.shape[0]):
                    total += dsinks[b, h, 0]
                out[h] = total
        return heads
    if out.ndim == 2:
        def rows(dsinks, out):
            for b in range(out.shape[0]):
                for h in range(out.shape[1]):
                    out[b, h] = dsinks[b, h, 0]
        return rows

    def whole(dsinks, out):
        _assign(out, dsinks)
    return whole


def _store_dbias(kernel_dbias, dbias):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_store_dbias)
def _store_dbias_overload(kernel_dbias, dbias):
    if not _given(dbias):
        return lambda kernel_dbias, dbias: None
    return lambda kernel_dbias, dbias: _copy_flat(kernel_dbias, dbias)


@jit()
def _copy_flat(src, dst):
    """``dst`` (any layout) gets the elements of the C-contiguous ``src`` of its size, in C order."""
    _assign(dst, src.reshape(dst.shape))


def _assign(dst, src):  # pragma: no cover - replaced inside njit code
    """``dst[...] = src`` for arrays of one shape, element by element: Numba compiles a
    shape-formatting error path into the slice assignment, a second or more of every user's
    compile. Two C-contiguous arrays are copied as flat ones (a loop that vectorises); others
    index by ``np.ndindex`` (a tuple index an element)."""
    raise NotImplementedError


@overload(_assign)
def _assign_overload(dst, src):
    if dst.layout == "C" and src.layout == "C":
        def flat(dst, src):
            d, s = dst.reshape(-1), src.reshape(-1)
            for i in range(d.size):
                d[i] = s[i]
        return flat

    def each(dst, src):
        for index in np.ndindex(dst.shape):
            dst[index] = src[index]
    return each


# --- the status of a failed entry, raised --------------------------------------------------

_INPUT_NAMES = ("q", "k", "v", "o", "dy", "sinks", "bias", "alibi_slopes", "lse")


@jit()
def _raise_status(status):
    """Raise the exception a compiled entry's ``status`` stands for, in :mod:`numbafa.nb`'s words
    (:func:`numbafa.pipeline.core.raise_status` is the Python API's)."""
    code, which, count = status[0], status[1], status[2]
    if code == NONFINITE:
        if which == 6:
            raise NbValueError("numbafa.nb: bias must not contain NaN or +inf (-inf masks a score), got {} such "
                               "element(s)", count)
        raise NbValueError("numbafa.nb: {} must be finite, got {} NaN/inf element(s)", _INPUT_NAMES[which], count)
    if code == LSE_VALUES:
        raise NbValueError("numbafa.nb: lse must not contain NaN or -inf, got {} such element(s)", count)
    if code == GRADIENTS:
        raise NbValueError("numbafa.nb: lse must be the log-sum-exp of these inputs' scores: the gradient {} came out "
                           "with {} NaN/inf element(s), as exp(scores - lse) overflows where a score exceeds its "
                           "row's lse by about 89 (float32) or 710 (float64) or more; pass the lse the forward "
                           "returned for these inputs", OUTPUTS[which], count)
    if code == SCALED_Q:
        raise FloatingPointError("numbafa.nb: the attention scores overflow the kernel dtype: the kernels scale the "
                                 "queries at load and softmax_scale * q does not fit; scale q down, or make the plan "
                                 "with a smaller softmax_scale")
    if code == SCORES:
        raise FloatingPointError("numbafa.nb: the attention scores softmax_scale * q^T k overflow the arithmetic's "
                                 "range (the log-sum-exp is at least the largest score); scale q or k down, or "
                                 "make the plan with a smaller softmax_scale")
    if code == SCORES_WITH_BIAS:
        raise FloatingPointError("numbafa.nb: the attention scores plus bias and the ALiBi terms overflow the "
                                 "arithmetic's range; scale the bias or the ALiBi slopes down")
    if code == SUMS:
        raise FloatingPointError("numbafa.nb: the sums of the pass overflow float64 beyond an exact rescale: scale the "
                                 "inputs down")
    if code == OUTPUT:
        if count == 1:
            raise NbFloatingPointError("numbafa.nb: {} overflows float16 at one of the kernels' float16 rounding "
                                       "points (float16's largest value is 65504): scale the inputs down, or compute "
                                       "in float32 or bfloat16", OUTPUTS[which])
        raise NbFloatingPointError("numbafa.nb: {} overflows the arithmetic's range: some of its exact values exceed "
                                   "its largest value", OUTPUTS[which])
    if code == EXACT_SCORES:
        raise RuntimeError("numbafa.nb: the exact score check was not compiled in this process: make the plan "
                           "with numbafa.nb.plan in this process")
    raise RuntimeError("numbafa.nb: unknown status")


# --- the passes ----------------------------------------------------------------------------

_NOT_PLANNED = ("numbafa.nb: the compiled entry of these arrays' types was not compiled or loaded in this process: "
                "make the plan with numbafa.nb.plan in this process")


@jit()
def _pin_addresses():
    """The BLAS pin's C functions ``(pin, unpin)`` in the kernel table
    (:func:`numbafa.compiler.runtime.register_pin`, called by :func:`plan`); 0 if not registered."""
    return kernel_address(PIN_KEY), kernel_address(UNPIN_KEY)


@jit()
def _call_forward(ins, outs, kernel_plan, items, status):
    """:func:`~numbafa.kernels.entry.forward_entry` through the kernel table (registered by
    :func:`plan`), inside the BLAS pin (module docstring): the code of a user's function holds
    none of its body, so it is compiled once for the Python API and every njit caller, and a
    user's compile neither links nor emits it."""
    args = (stored_fwd(ins, kernel_plan.acc), outs, kernel_plan, items, np.int64(-1), status)
    address = kernel_address(call_key("forward_entry", args))
    pin, unpin = _pin_addresses()
    if address == 0 or pin == 0:
        raise RuntimeError(_NOT_PLANNED)
    call_value_between(address, args, np.int64, pin, unpin)


@jit()
def _call_backward(ins, outs, stats, kernel_plan, items, units, status):
    """:func:`~numbafa.kernels.entry.backward_entry` through the kernel table (as :func:`_call_forward`)."""
    args = (stored_bwd(ins, kernel_plan.acc), outs, stats, kernel_plan, items, units, np.int64(-1), status)
    address = kernel_address(call_key("backward_entry", args))
    pin, unpin = _pin_addresses()
    if address == 0 or pin == 0:
        raise RuntimeError(_NOT_PLANNED)
    call_value_between(address, args, np.int64, pin, unpin)


def _run_forward(plan, kernel_plan, q, k, v, sinks, outs, status):  # pragma: no cover - replaced inside njit
    """The forward entry on the kernel forms of the call's arrays: bf16 bits as they are, float16
    bits widened to float32 (the kernels' fp16 inputs), floats C-contiguous."""
    raise NotImplementedError


@overload(_run_forward)
def _run_forward_overload(plan, kernel_plan, q, k, v, sinks, outs, status):
    def items(dims, q_chunks):
        return np.arange(dims[0] * dims[2] * q_chunks)
    items = jit()(items)
    if q.dtype == types.uint16:
        def bits(plan, kernel_plan, q, k, v, sinks, outs, status):
            if plan.kind == FP16:
                ins = FwdInputs(_widen_fp16(q), _widen_fp16(k), _widen_fp16(v), sinks)
                _call_forward(ins, outs, kernel_plan, items(plan.dims, kernel_plan.tiling.q_chunks), status)
            else:
                ins = FwdInputs(_kernel_input(q), _kernel_input(k), _kernel_input(v), sinks)
                _call_forward(ins, outs, kernel_plan, items(plan.dims, kernel_plan.tiling.q_chunks), status)
        return bits

    def values(plan, kernel_plan, q, k, v, sinks, outs, status):
        ins = FwdInputs(_kernel_input(q), _kernel_input(k), _kernel_input(v), sinks)
        _call_forward(ins, outs, kernel_plan, items(plan.dims, kernel_plan.tiling.q_chunks), status)
    return values


@jit(inline=True)
def _planned(nb_plan):
    """The :data:`_Planned` fields of an :data:`NbPlan`."""
    p = nb_plan
    return _Planned(dims=p.dims, kind=p.kind, sinks_shape=p.sinks_shape, bias_shape=p.bias_shape,
                    alibi_shape=p.alibi_shape, return_dbias=p.return_dbias, lse_natural=p.lse_natural)


def _forward(plan, q, k, v, o, lse, sinks, bias, alibi_slopes):
    planned = _planned(plan)
    _storage_kind(q, planned)
    bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_v = plan.dims
    _expect_shape(q.shape, "q", (bs, nheads, d_head, seqlen_q))
    _expect_shape(k.shape, "k", (bs, nheads_kv, d_head, seqlen_k))
    _expect_shape(v.shape, "v", (bs, nheads_kv, d_v, seqlen_k))
    _expect_shape(o.shape, "o", (bs, nheads, d_v, seqlen_q))
    _expect_lse(lse, planned)
    _check_apart((_extent(o), _extent(lse), _extent(q), _extent(k), _extent(v)), _FWD_NAMES, _FWD_PAIRS)
    kernel_plan = _canonical(plan.fwd)
    kernel_plan = replaced(kernel_plan, "scores", _call_scores(kernel_plan.scores, planned, bias, alibi_slopes, None,
                                                                 False))
    o_k = _output(o)
    lse_k = np.empty((bs, nheads, seqlen_q), dtype=kernel_plan.acc.dtype)
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    _run_forward(planned, kernel_plan, q, k, v, _kernel_sinks(planned, kernel_plan.acc, sinks),
                 FwdOutputs(o_k, lse_k), status)
    if status[0] != 0:
        _raise_status(status)
    _store(o_k, o, plan.kind)
    _store_lse(lse_k, lse)


#: The passes' bodies (:func:`_checked`), which :func:`plan` registers from the disk cache.
_BODIES: list = []
_registered_plans: set = set()

_BODY_NOT_LOADED = ("numbafa.nb: the checks and conversions of this call's argument types were not compiled or "
                    "loaded in this process (a function loaded from Numba's own cache, with numbafa's disk cache "
                    "off or cleared since): compile the function again, or turn numbafa's cache on")


def _checked(stub, public, outputs, names):
    """An overload of ``stub`` (a call of :mod:`numbafa.nb`): for argument types that pass
    :func:`_type_problem`, a call of ``impl`` compiled by :func:`~numbafa.compiler.jit.jit` (on the
    disk cache, like the kernels: a later process, or another of a user's functions, loads it for
    the same argument types instead of compiling it again) through the kernel table, as the
    entries are called: typing the call compiles (or loads) ``impl`` for those types and records
    it (:func:`~numbafa.compiler.linking.register_function`), so the caller's code holds none of
    ``impl``'s and a user's compile neither links nor optimises it again; :func:`plan` records
    the types the disk cache holds for its plan (a user's function loaded from Numba's own cache
    is typed in another process). A real compile of ``impl`` is announced first
    (:class:`~numbafa.compiler.runtime.announced_compile`, naming ``public``). Else a function
    raising the message."""
    def decorate(impl):
        params = ", ".join(impl.__code__.co_varnames[:impl.__code__.co_argcount])
        body = jit()(impl)
        _BODIES.append(body)
        callers = {}

        def caller(key):
            if key not in callers:
                source = (f"def call({params}):\n"
                          f"    check_plan(plan)\n"
                          f"    address = kernel_address(np.int64({key}))\n"
                          f"    if address == 0:\n"
                          f"        raise RuntimeError(message)\n"
                          f"    call_or_raise(address, ({params},))\n")
                namespace = {"check_plan": _check_plan, "kernel_address": kernel_address,
                             "call_or_raise": call_or_raise, "np": np, "message": _BODY_NOT_LOADED}
                exec(source, namespace)
                callers[key] = namespace["call"]
            return callers[key]

        def typer(*args):
            arrays = {name: t for name, t in zip(names, args[1:])}
            plan_t = args[0]
            if not (isinstance(plan_t, types.BaseNamedTuple) and plan_t.instance_class is NbPlan):
                problem = TypeError, f"numbafa.nb: plan must be a numbafa.nb.plan(...), got {plan_t}"
            else:
                problem = _type_problem(arrays, outputs)
            if problem is None:
                with announced_compile((public, args), f"compiling numbafa.nb's checks and conversions around "
                                                       f"{public} for the argument types of a call being compiled, "
                                                       f"once per argument types (several seconds of CPU)"):
                    key = register_function(body, args)
                return caller(key)
            error, message = problem
            source = (f"def fail({params}):\n"
                      f"    raise {error.__name__}(message)\n")
            namespace = {"message": message}
            exec(source, namespace)
            return namespace["fail"]
        overload(stub, strict=False)(typer)
        return impl
    return decorate


def _as_boxed(value):
    """``value`` (a plan, or a field of one) as njit code returns it to Python: float32 scalars
    become Python floats (Numba boxes them so), the rest is unchanged."""
    if isinstance(value, np.float32):
        return float(value)
    if isinstance(value, tuple):
        fields = [_as_boxed(x) for x in value]
        return type(value)(*fields) if hasattr(value, "_fields") else tuple(fields)
    return value


def _register_cached_bodies(nb_plan) -> None:
    """Record in the kernel table every pass body the disk cache holds for plans of this plan's
    type, or of its type once returned by njit code (:func:`_as_boxed`): loaded, not compiled.
    A user's function loaded from Numba's own cache calls them by key without having been typed
    in this process."""
    plan_types = {numba.typeof(nb_plan), numba.typeof(_as_boxed(nb_plan))}
    if plan_types <= _registered_plans:
        return
    for body in _BODIES:
        for argtys in cached_signatures(body):
            if argtys and argtys[0] in plan_types:
                register_function(body, argtys)
    _registered_plans.update(plan_types)


def _fwd_stub(plan, q, k, v, o, lse, sinks, bias, alibi_slopes):  # pragma: no cover - replaced inside njit
    raise NotImplementedError


_checked(_fwd_stub, "attention_fwd", ("o", "lse"),
         ("q", "k", "v", "o", "lse", "sinks", "bias", "alibi_slopes"))(_forward)


@jit(entry=True, inline=True, disk_cache=False)
def attention_fwd(plan, q, k, v, o, lse, sinks=None, bias=None, alibi_slopes=None):
    """The forward of :func:`numbafa.attention_fwd` into ``o`` and ``lse`` (module docstring).

    ``o``: ``[bs, nheads, d_head_v, seqlen_q]`` in ``q``'s storage; ``lse``: the accumulator dtype
    in the plan's layout; ``sinks``, ``bias``, ``alibi_slopes`` exactly when the plan has them, of
    the shapes it was made with. Raises as :func:`numbafa.attention_fwd` (and ``ValueError`` for a
    plan not made in this process, or changed since), before anything is written.
    """
    _fwd_stub(plan, q, k, v, o, lse, sinks, bias, alibi_slopes)


def _run_backward(plan, kernel_plan, raw, outs, stats, status):  # pragma: no cover - replaced inside njit
    """The backward entry on the kernel forms of the call's arrays ``raw`` (a
    :data:`~numbafa.kernels.bundles.BwdInputs` of the caller's arrays; as :func:`_run_forward`)."""
    raise NotImplementedError


@overload(_run_backward)
def _run_backward_overload(plan, kernel_plan, raw, outs, stats, status):
    def work(dims, serial_batch, serial_heads, chunks, n_sinks):
        """``(items, units)`` of the backward (:func:`numbafa.kernels.scores.n_backward_items`)."""
        bs, nheads_kv = dims[0], dims[2]
        if serial_batch or serial_heads:
            n_items = (1 if serial_batch else bs) * (1 if serial_heads else nheads_kv)
        else:
            n_items = bs * nheads_kv * chunks
        finish = chunks > 1 or n_sinks > 0
        return np.arange(n_items), np.arange(bs * nheads_kv if finish else 0)
    work = jit()(work)
    if raw.types[raw.fields.index("q")].dtype == types.uint16:
        def bits(plan, kernel_plan, raw, outs, stats, status):
            items, units = work(plan.dims, kernel_plan.scores.serial_batch, kernel_plan.scores.serial_heads,
                                kernel_plan.tiling.q_chunks, raw.sinks.shape[2])
            if plan.kind == FP16:
                ins = BwdInputs(q=_widen_fp16(raw.q), k=_widen_fp16(raw.k), v=_widen_fp16(raw.v), o=_widen_fp16(raw.o),
                                dy=_widen_fp16(raw.dy), lse=raw.lse, sinks=raw.sinks)
                _call_backward(ins, outs, stats, kernel_plan, items, units, status)
            else:
                ins = BwdInputs(q=_kernel_input(raw.q), k=_kernel_input(raw.k), v=_kernel_input(raw.v),
                                o=_kernel_input(raw.o), dy=_kernel_input(raw.dy), lse=raw.lse, sinks=raw.sinks)
                _call_backward(ins, outs, stats, kernel_plan, items, units, status)
        return bits

    def values(plan, kernel_plan, raw, outs, stats, status):
        items, units = work(plan.dims, kernel_plan.scores.serial_batch, kernel_plan.scores.serial_heads,
                            kernel_plan.tiling.q_chunks, raw.sinks.shape[2])
        ins = BwdInputs(q=_kernel_input(raw.q), k=_kernel_input(raw.k), v=_kernel_input(raw.v), o=_kernel_input(raw.o),
                        dy=_kernel_input(raw.dy), lse=raw.lse, sinks=raw.sinks)
        _call_backward(ins, outs, stats, kernel_plan, items, units, status)
    return values


def _natural_lse(lse):  # pragma: no cover - replaced inside njit code
    """The caller's lse in the natural layout ``[bs, nheads, seqlen_q]``, C-contiguous."""
    raise NotImplementedError


@overload(_natural_lse)
def _natural_lse_overload(lse):
    if lse.ndim == 3:
        return lambda lse: _kernel_input(lse)

    def neuron(lse):
        bs, nheads, tile, n_tiles = lse.shape
        out = empty((bs, nheads, tile * n_tiles), lse.dtype)
        for b in range(bs):
            for h in range(nheads):
                for t in range(n_tiles):
                    for p in range(tile):
                        out[b, h, t * tile + p] = lse[b, h, p, t]
        return out
    return neuron


def _backward(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks, bias, dbias, alibi_slopes):
    planned = _planned(plan)
    _storage_kind(q, planned)
    bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_v = plan.dims
    _expect_shape(q.shape, "q", (bs, nheads, d_head, seqlen_q))   # (one by one: their ranks may differ)
    _expect_shape(dq.shape, "dq", (bs, nheads, d_head, seqlen_q))
    _expect_shape(k.shape, "k", (bs, nheads_kv, d_head, seqlen_k))
    _expect_shape(dk.shape, "dk", (bs, nheads_kv, d_head, seqlen_k))
    _expect_shape(v.shape, "v", (bs, nheads_kv, d_v, seqlen_k))
    _expect_shape(dv.shape, "dv", (bs, nheads_kv, d_v, seqlen_k))
    _expect_shape(o.shape, "o", (bs, nheads, d_v, seqlen_q))
    _expect_shape(dy.shape, "dy", (bs, nheads, d_v, seqlen_q))
    _expect_lse(lse, planned)
    if (sinks is None) != (dsinks is None):
        raise ValueError("numbafa.nb: pass sinks and dsinks together")
    _check_apart((_extent(dq), _extent(dk), _extent(dv), _extent(q), _extent(k), _extent(v), _extent(o),
                  _extent(dy), _extent(lse)), _BWD_NAMES, _BWD_PAIRS)
    _apart_if(dsinks, "dsinks", dq, "dq")
    _apart_if(dbias, "dbias", dq, "dq")
    _apart_if(dbias, "dbias", bias, "bias")
    kernel_plan = _canonical(plan.bwd)
    kernel_plan = replaced(kernel_plan, "scores", _call_scores(kernel_plan.scores, planned, bias, alibi_slopes, dbias,
                                                                 True))
    kernel_sinks = _kernel_sinks(planned, kernel_plan.acc, sinks)
    if dsinks is not None:
        _expect_planned(dsinks, "dsinks", plan.sinks_shape)
    acc = kernel_plan.acc.dtype
    chunks = kernel_plan.tiling.q_chunks
    lead, keys = ((bs * nheads_kv, chunks - 1), seqlen_k) if chunks > 1 else ((1, 1), 0)
    outs = BwdOutputs(dq=_output(dq), dk=_output(dk), dv=_output(dv), dsinks=np.empty(kernel_sinks.shape, dtype=acc),
                      part_dk=np.empty(lead + (d_head, keys), dtype=acc),
                      part_dv=np.empty(lead + (d_v, keys), dtype=acc))
    shape = (bs * nheads_kv, nheads // nheads_kv, seqlen_q)
    stats = BwdStats(np.empty(shape, dtype=acc), np.empty(shape, dtype=acc))
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    raw = BwdInputs(q=q, k=k, v=v, o=o, dy=dy, lse=_natural_lse(lse), sinks=kernel_sinks)
    _run_backward(planned, kernel_plan, raw, outs, stats, status)
    if status[0] != 0:
        _raise_status(status)
    _store(outs.dq, dq, plan.kind)
    _store(outs.dk, dk, plan.kind)
    _store(outs.dv, dv, plan.kind)
    _store_dsinks(outs.dsinks, dsinks)
    _store_dbias(kernel_plan.scores.dbias, dbias)


def _bwd_stub(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks, bias, dbias,
              alibi_slopes):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


_checked(_bwd_stub, "attention_bwd", ("dq", "dk", "dv", "dsinks", "dbias"),
         ("q", "k", "v", "o", "dy", "lse", "dq", "dk", "dv", "sinks", "dsinks", "bias", "dbias", "alibi_slopes"))(
    _backward)


@jit(entry=True, inline=True, disk_cache=False)
def attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks=None, dsinks=None, bias=None, dbias=None,
                  alibi_slopes=None):
    """The backward of :func:`numbafa.attention_bwd` into ``dq, dk, dv`` (and ``dsinks``, ``dbias``).

    ``dq``: ``q``'s shape, ``dk``: ``k``'s, ``dv``: ``v``'s, all in ``q``'s storage; ``lse`` as the
    forward wrote it; ``sinks`` and ``dsinks`` (the sinks' shape, the accumulator dtype) together,
    with a plan made with sinks; ``bias`` (and ``dbias``, its shape, with ``return_dbias=True``)
    and ``alibi_slopes`` exactly when the plan has them. Raises as :func:`numbafa.attention_bwd`
    (and ``ValueError`` for a plan not made in this process, or changed since; outputs that share
    memory with each other or with an input), before anything is written.
    """
    _bwd_stub(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks, bias, dbias, alibi_slopes)


def with_seed_offset(plan, seed_offset):
    """The plan with the dropout mask of ``seed_offset`` (e.g. the training step), same seed; a plan
    without dropout is returned unchanged. Callable in njit code too.

    Parameters
    ----------
    plan : NbPlan
        From :func:`plan` in this process.
    seed_offset : int
        In ``[0, 2**64)``, as the Python API's ``seed_offset``.

    Returns
    -------
    NbPlan
        Of ``plan``'s type (called from Python, its float32 fields stay float32), so a user's
        function compiled for ``plan`` runs it without compiling again.

    Raises
    ------
    TypeError
        ``plan`` not an :data:`NbPlan`; ``seed_offset`` not an int.
    ValueError
        ``seed_offset`` outside ``[0, 2**64)``.
    """
    if not isinstance(plan, NbPlan):
        raise TypeError(f"numbafa.nb.with_seed_offset: plan must be a numbafa.nb.plan(...), got "
                        f"{type(plan).__name__}")
    offset = require_uint64("seed_offset", seed_offset, "the dropout mask's offset")
    return _typed_like(_with_seed_offset(plan, np.uint64(offset)), plan)


def _typed_like(value, like):
    """``value`` (a plan, or a field of one, back from njit code) with the scalar types of ``like``
    (the plan it was made from): Numba boxes float32 as a Python float, whose type is float64."""
    if isinstance(like, tuple):
        fields = [_typed_like(x, y) for x, y in zip(value, like)]
        return type(like)(*fields) if hasattr(like, "_fields") else tuple(fields)
    if isinstance(like, np.generic) and type(value) is not type(like):
        return type(like)(value)
    return value


@overload(with_seed_offset)
def _with_seed_offset_overload(plan, seed_offset):
    problem = None
    if not (isinstance(plan, types.BaseNamedTuple) and plan.instance_class is NbPlan):
        problem = f"numbafa.nb.with_seed_offset: plan must be a numbafa.nb.plan(...), got {plan}"
    elif not isinstance(seed_offset, types.Integer):
        problem = (f"numbafa.nb.with_seed_offset: seed_offset must be an int (the dropout mask's offset), "
                   f"got {seed_offset}")
    if problem is not None:
        def fail(plan, seed_offset):
            raise TypeError(problem)
        return fail
    if seed_offset.signed:
        def signed(plan, seed_offset):
            if seed_offset < 0:
                raise NbValueError("numbafa.nb.with_seed_offset: seed_offset must be in [0, 2**64) (the dropout "
                                   "mask's offset), got {}", seed_offset)
            return _with_seed_offset(plan, np.uint64(seed_offset))
        return signed
    return lambda plan, seed_offset: _with_seed_offset(plan, np.uint64(seed_offset))


@jit(entry=True)
def _with_seed_offset(plan, seed_offset):
    """:func:`with_seed_offset` on a checked ``seed_offset`` (uint64)."""
    return replaced(replaced(plan, "fwd", _with_offset(plan.fwd, plan.seed, seed_offset)), "bwd",
                    _with_offset(plan.bwd, plan.seed, seed_offset))


@jit()
def _with_offset(kernel_plan, seed, seed_offset):
    """``kernel_plan`` with the dropout key of ``(seed, seed_offset)`` (numbafa.kernels.dropout.derive_key)."""
    d = kernel_plan.dropout
    if not d.active:
        return kernel_plan
    offset = np.uint64(seed_offset)
    words = philox_words(offset & np.uint64(0xFFFFFFFF), offset >> np.uint64(32), np.uint64(0), np.uint64(0),
                         np.uint64(seed[0]), np.uint64(seed[1]))
    return replaced(kernel_plan, "dropout", replaced(replaced(d, "key0", np.int64(words[0])), "key1", np.int64(words[1])))


# --- bf16 storage from njit code ------------------------------------------------------------

def _expect_storage(x, function, name, dtype):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_expect_storage, prefer_literal=True)
def _expect_storage_overload(x, function, name, dtype):
    """Nothing for an array of the dtype (a string constant) ``dtype``, else a ``TypeError`` (the
    conversions below called from njit code with another type)."""
    want = getattr(dtype, "literal_value", None)
    if isinstance(x, types.Array) and str(x.dtype) == want:
        return lambda x, function, name, dtype: None
    message = (f"numbafa.nb.{getattr(function, 'literal_value', '?')}: {getattr(name, 'literal_value', '?')} must "
               f"be a {want} array, got {x}")

    def fail(x, function, name, dtype):
        raise TypeError(message)
    return fail


class _StorageDispatcher(CPUDispatcher):
    """The dispatcher of :func:`to_bf16_bits` and :func:`from_bf16_bits`: called from Python, its
    argument is checked first (a ``TypeError`` naming it, not a typing error; no other dtype is
    converted silently); in njit code :func:`_expect_storage` checks it."""

    def __call__(self, *args, **kwargs):
        name, dtype = _STORAGE_ARGUMENT[self.py_func.__name__]
        x = args[0] if args else kwargs.get(name)
        if len(args) + len(kwargs) != 1 or not isinstance(x, np.ndarray) or x.dtype != dtype:
            got = f"{type(x).__name__} of {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
            raise TypeError(f"numbafa.nb.{self.py_func.__name__} takes one {np.dtype(dtype)} array {name}, got {got}")
        return super().__call__(*args, **kwargs)


_STORAGE_ARGUMENT = {"to_bf16_bits": ("x", np.float32), "from_bf16_bits": ("bits", np.uint16)}


@jit(entry=True)
def to_bf16_bits(x):
    """A float32 array (any layout) as the uint16 bits of bf16, rounded to nearest, ties to even
    (the rounding of ``ml_dtypes.bfloat16``): a new C-contiguous array of ``x``'s shape, the
    storage of a bf16 plan's arrays. Another dtype (float64 would be rounded twice) is a
    ``TypeError``."""
    _expect_storage(x, "to_bf16_bits", "x", "float32")
    flat = np.ascontiguousarray(x).ravel()
    out = empty(flat.size, np.uint16)
    for i in range(flat.size):
        out[i] = f32_to_bf16_bits(np.float32(flat[i]))
    return out.reshape(x.shape)


@jit(entry=True)
def from_bf16_bits(bits):
    """The float32 values (exact) of a uint16 array of bf16 bits: a new C-contiguous array of the
    same shape. Another dtype is a ``TypeError``."""
    _expect_storage(bits, "from_bf16_bits", "bits", "uint16")
    flat = np.ascontiguousarray(bits).ravel()
    out = empty(flat.size, np.float32)
    for i in range(flat.size):
        out[i] = widen(np.uint16(flat[i]))
    return out.reshape(bits.shape)


to_bf16_bits.__class__ = from_bf16_bits.__class__ = _StorageDispatcher
