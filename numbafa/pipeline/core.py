"""The Python side of every call: validate the metadata -> plan -> allocate -> the compiled entry -> convert.

:func:`attention_fwd` and :func:`attention_bwd` are what every Python front end runs on NumPy
arrays (the public API, :func:`numbafa.attention`, the torch and JAX adapters' host calls),
with the caller's :class:`~numbafa.checks.options.AttentionOptions` and
:class:`~numbafa.checks.options.Caller`. Everything after the metadata -- the values, the range and its
exact rescale, the work items, the finish, the output checks -- runs in the compiled entries
(:mod:`numbafa.kernels.entry`), which :mod:`numbafa.nb` calls from a user's ``@njit`` code too;
:func:`run_fwd` / :func:`run_bwd` call them for a whole problem or a Dask share's items
(:mod:`numbafa.pipeline.shards`), and :func:`raise_status` turns a failure they report into the
exception, in the caller's words.
"""

from __future__ import annotations

import contextlib
import math

import numba
import numpy as np

from ..conventions.dtypes import ROUND_FP16, UINT16, to_bf16_array, to_fp16_array
from ..kernels.backward import BwdStats
from ..kernels.bundles import BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, shared_plan
from ..kernels.entry import (EXACT_SCORES, GRADIENTS, INPUTS, LSE_VALUES, NONFINITE, OUTPUT, OUTPUTS, SCALED_Q, SCORES,
                             SCORES_WITH_BIAS, STATUS_WORDS, SUMS, backward_entry, exact_scores_plugin, forward_entry)
from ..kernels.table import ensure_plugins
from ..kernels.launch import call_entry, call_prepared, needs_finish, prepare_backward, prepare_forward, prepared_entry
from ..kernels.stored import stored_bwd, stored_fwd, stored_members, stored_records
from ..kernels.scores import n_backward_items
from ..layout import lse_to_neuron
from ..compiler.memo import Memo
from ..platform.onednn import active_gemm_path
from ..checks.options import AttentionOptions, Caller
from ..compiler.runtime import kernel_call
from ..conventions.tiling import Q_TILE
from ..checks.validation import (KERNEL_LAYOUT_PERMS, as_kernel_array, kernel_lse, neuron_shape, validate_bwd_inputs,
                                 validate_fwd_inputs)

__all__ = ["LSE_LAYOUTS", "attention_bwd", "attention_fwd", "check_lse_layout", "lse_out", "raise_status",
           "remembered_bwd", "remembered_fwd", "run_bwd", "run_fwd", "to_dtype", "user_dbias", "user_dsinks", "bwd_outputs"]

#: The layouts of the forward's lse: the Neuron kernel's ``[bs, nheads, 128, seqlen_q // 128]``
#: and the natural ``[bs, nheads, seqlen_q]``.
LSE_LAYOUTS = ("neuron", "natural")


def check_lse_layout(lse_layout, seqlen_q=None) -> None:
    """``lse_layout`` is one of :data:`LSE_LAYOUTS`, and ``"neuron"`` fits ``seqlen_q`` (when given)."""
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    if seqlen_q is not None and lse_layout == "neuron" and seqlen_q % Q_TILE:
        raise ValueError(f"lse_layout='neuron' needs seqlen_q divisible by {Q_TILE}, got "
                         f"seqlen_q={seqlen_q}; use lse_layout='natural'")


def lse_out(lse: np.ndarray, lse_layout: str) -> np.ndarray:
    """The kernels' natural lse ``[bs, nheads, seqlen_q]`` in ``lse_layout``."""
    return lse_to_neuron(lse) if lse_layout == "neuron" else lse


def to_dtype(x: np.ndarray, dtype, name: str = "the output") -> np.ndarray:
    """Kernel output (float32, or float64 for float64 inputs) -> ``dtype``: itself, bf16 (the values
    of a bf16 output are already rounded: exact), or another float dtype (rounded once: a
    float64 call's float32 sinks' gradient; a float16 output, which must stay finite, else
    ``FloatingPointError`` naming it)."""
    if x.dtype == dtype:
        return x
    dtype = np.dtype(dtype)
    if dtype.kind == "V":   # bf16 (ml_dtypes'; other kinds never reach here)
        return to_bf16_array(x, dtype)
    if dtype == np.float16:
        out = to_fp16_array(x)
        if not np.isfinite(out).all():
            raise FloatingPointError(_FP16_OVERFLOW.format(name=name))
        return out
    return x.astype(dtype)


def user_dsinks(dsinks: np.ndarray, shape: tuple, dtype) -> np.ndarray:
    """The kernels' dsinks ``[bs, nheads, num_sinks]`` (float32, or float64) in the sinks' ``shape``
    and ``dtype``; sinks ``[nheads]`` (shared by the batch) get the sum over the batch in the kernels'
    dtype, rounded once."""
    if len(shape) == 1:
        dsinks = dsinks.reshape(dsinks.shape[0], -1).sum(axis=0, dtype=dsinks.dtype)
    return to_dtype(np.ascontiguousarray(dsinks), dtype, "dsinks").reshape(shape)


def user_dbias(prob, dbias: np.ndarray) -> np.ndarray:
    """The kernels' ``dbias`` (accumulator dtype, the bias padded to 4-D) in the bias's shape and dtype."""
    return to_dtype(dbias, prob.bias_dtype, "dbias").reshape(prob.bias_shape)


#: The input dtype's name of a kernel input array's dtype (bf16 arrive as uint16 bits).
_KERNEL_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
                       np.dtype(np.uint16): "bfloat16"}

_FP16_OVERFLOW = ("{name} overflows float16 at one of the kernels' float16 rounding points (float16's largest value "
                  "is 65504): scale the inputs down, or compute in float32 or bfloat16")


def _dtype_name(ins, plan) -> str:
    """The input dtype of a call, for the compile announcement (fp16 inputs reach the kernels
    widened to float32: their rounding code says fp16, :class:`~numbafa.kernels.bundles.Precision`)."""
    if plan.precision.round_kernel == ROUND_FP16:
        return "float16"
    name = _KERNEL_DTYPE_NAMES.get(ins.q.dtype)
    return str(ins.q.dtype) if name is None else name


@contextlib.contextmanager
def _threads(n_threads):
    """Numba's thread count of this thread set to ``n_threads``, then restored
    (``numba.set_num_threads`` is per thread)."""
    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(int(n_threads), numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _on_threads(n_threads):
    """:func:`_threads`, or nothing for ``n_threads=None`` (the calling thread's count)."""
    return contextlib.nullcontext() if n_threads is None else _threads(n_threads)


def _in_layout(neuron_shape: tuple, layout: int) -> tuple:
    """A Neuron-order shape ``(b, h, d, s)`` as the arrays of layout code ``layout`` have it."""
    return tuple(neuron_shape[i] for i in KERNEL_LAYOUT_PERMS[layout])


def bwd_outputs(ins: BwdInputs, plan) -> BwdOutputs:
    """The backward's outputs in the accumulator dtype and the plan's layout, with the dK/dV
    partials of split units (``q_chunks > 1``, always ``[units, chunks - 1, d, seqlen_k]``)."""
    layout, q_chunks = plan.layout, plan.tiling.q_chunks
    nb, nheads, d_head, seqlen_q = neuron_shape(ins.q, layout)
    _, nheads_kv, d_v, seqlen_k = neuron_shape(ins.v, layout)
    acc = ins.lse.dtype   # float32, or float64 for float64 inputs
    lead, keys = ((nb * nheads_kv, q_chunks - 1), seqlen_k) if q_chunks > 1 else ((1, 1), 0)
    return BwdOutputs(dq=np.empty(_in_layout((nb, nheads, d_head, seqlen_q), layout), dtype=acc),
                      dk=np.empty(_in_layout((nb, nheads_kv, d_head, seqlen_k), layout), dtype=acc),
                      dv=np.empty(_in_layout((nb, nheads_kv, d_v, seqlen_k), layout), dtype=acc),
                      dsinks=np.empty(ins.sinks.shape, dtype=acc), part_dk=np.empty(lead + (d_head, keys), dtype=acc),
                      part_dv=np.empty(lead + (d_v, keys), dtype=acc))


def new_bwd_stats(ins: BwdInputs, plan) -> BwdStats:
    """Uninitialised :data:`~numbafa.kernels.backward.BwdStats` for every work unit,
    ``[n_units, n_rep, seqlen_q]``, in the accumulator dtype (that of ``ins.lse``)."""
    bs, nheads, seqlen_q = ins.lse.shape
    nheads_kv = neuron_shape(ins.k, plan.layout)[1]
    shape = (bs * nheads_kv, nheads // nheads_kv, seqlen_q)
    return BwdStats(np.empty(shape, dtype=ins.lse.dtype), np.empty(shape, dtype=ins.lse.dtype))


def _all(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def run_fwd(ins: FwdInputs, plan, items=None, n_threads=None, exponent=-1, signature=None):
    """The forward entry on the kernel arrays ``ins`` (:mod:`numbafa.kernels.entry`): ``(outs, e,
    status)``, the float32 ``o`` and ``lse`` (:data:`FwdOutputs`) of the work ``items`` (None:
    all), the rescale's exponent and the status array (its first word 0: success; else
    :func:`raise_status`). ``n_threads``: None for ``numba.get_num_threads()``; any number gives
    the same bits. ``exponent`` -1 checks the values and chooses the rescale; a Dask share
    passes its client's. ``signature``: a hashable value that decides the bundles' Numba types
    for the caller (:func:`~numbafa.kernels.launch.prepare_forward`; None: none known)."""
    nb, nheads, _, seqlen_q = neuron_shape(ins.q, plan.layout)
    _, nheads_kv, d_v, _ = neuron_shape(ins.v, plan.layout)
    acc = plan.acc.dtype   # float32, or float64 for float64 inputs
    outs = FwdOutputs(np.empty(_in_layout((nb, nheads, d_v, seqlen_q), plan.layout), dtype=acc),
                      np.empty((nb, nheads, seqlen_q), dtype=acc))
    if items is None:
        items = _all(nb * nheads_kv * plan.tiling.q_chunks)
    e, status = _launch_fwd(ins, outs, plan, items, n_threads, exponent, signature)
    return outs, e, status


def _launch_fwd(ins, outs, plan, items, n_threads, exponent, signature):
    """The forward entry on allocated outputs (:func:`run_fwd`): ``(e, status)``."""
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    kernel_ins = stored_fwd(ins, plan.acc)
    with kernel_call("forward", _dtype_name(ins, plan)), _on_threads(n_threads):
        prepare_forward(kernel_ins, outs, plan, signature)
        e = call_entry(forward_entry, (kernel_ins, outs, plan, items, exponent, status), signature)
        if status[0] == EXACT_SCORES:   # (rare: compiled only for a call that needs it)
            ensure_plugins(exact_scores_plugin(ins, plan))
            status[:] = 0
            e = call_entry(forward_entry, (kernel_ins, outs, plan, items, exponent, status), signature)
    return e, status


def run_bwd(ins: BwdInputs, plan, items=None, units=None, n_threads=None, state=None, exponent=-1,
            signature=None):
    """The backward entry: ``(outs, stats, e, status)``; the work ``items`` and the ``units`` to
    finish (None: all, :func:`~numbafa.kernels.scores.n_backward_items`, and every unit when
    :func:`~numbafa.kernels.launch.needs_finish`). ``state``: the ``(outs, stats)`` to finish into
    (the Dask merge of split units); None: allocated here. Other arguments as :func:`run_fwd`."""
    outs, stats = state if state is not None else (bwd_outputs(ins, plan), new_bwd_stats(ins, plan))
    bs, nheads_kv = ins.q.shape[0], neuron_shape(ins.k, plan.layout)[1]
    n_units = bs * nheads_kv
    if items is None:
        items = _all(n_backward_items(bs, nheads_kv, plan.tiling.q_chunks, plan.scores))
    if units is None:
        units = _all(n_units if needs_finish(ins, plan) else 0)
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    kernel_ins = stored_bwd(ins, plan.acc)
    with kernel_call("backward", _dtype_name(ins, plan)), _on_threads(n_threads):
        prepare_backward(kernel_ins, outs, stats, plan, bool(units.size), signature)
        e = call_entry(backward_entry, (kernel_ins, outs, stats, plan, items, units, exponent, status), signature)
        if status[0] == EXACT_SCORES:
            ensure_plugins(exact_scores_plugin(ins, plan))
            status[:] = 0
            e = call_entry(backward_entry, (kernel_ins, outs, stats, plan, items, units, exponent, status),
                           signature)
    return outs, stats, e, status


def raise_status(status, prob, caller: Caller, plan=None, acc=None) -> None:
    """Raise the exception a compiled entry's ``status`` (its first word not 0) stands for, in the
    words of ``caller``; ``prob`` holds the arrays it reports sizes of (None for a Dask share,
    which checks no input: ``plan``, or for a merged output its dtype ``acc``, gives the
    arithmetic)."""
    code, which, count, value = (int(w) for w in status)
    value = float(np.int64(value).view(np.float64))
    if acc is None:
        acc = prob.dtype if prob is not None else plan.acc.dtype
    arith = "float64" if acc.char == "d" else "float32"
    limit = float(np.finfo(arith).max)
    if code == NONFINITE:
        key = INPUTS[which]
        if key == "bias":
            raise ValueError(f"{caller('bias')} must not contain NaN or +inf (-inf masks a score), got {count} "
                             f"such element(s) of {prob.bias.size}")
        sizes = {"q_ref": prob.q, "k_ref": prob.k, "v_ref": prob.v, "o_ref": prob.o, "dy_ref": prob.dy,
                 "sinks_ref": prob.sinks, "alibi_slopes": prob.alibi}
        raise ValueError(f"{caller(key)} must be finite, got {count} NaN/inf element(s) of {sizes[key].size}")
    if code == LSE_VALUES:
        raise ValueError(f"{caller('lse_ref')} must not contain NaN or -inf, got {count} such element(s)")
    if code == GRADIENTS:
        lse = caller("lse_ref")
        raise ValueError(f"{lse} must be the log-sum-exp of these inputs' scores: the gradient {OUTPUTS[which]} "
                         f"came out with {count} NaN/inf element(s), as exp(scores - {lse}) overflows {arith} where "
                         f"a score exceeds its row's {lse} by about {math.log(limit):.0f} or more; pass the lse the "
                         f"forward returned for these inputs")
    q, k, scale = caller("q_ref"), caller("k_ref"), caller("softmax_scale")
    if code == SCALED_Q:
        kind, largest = {ROUND_FP16: ("float16", 65504.0), 1: ("bfloat16", 3.3895314e38)}.get(
            which, ("float32", float(np.finfo(np.float32).max)))
        raise FloatingPointError(
            f"the attention scores overflow {kind}: the kernels scale the queries at load, rounding {scale} * {q} "
            f"to {kind} (largest value {largest:.6g}), and it reaches {value:.4g}; scale {q} down, or pass a "
            f"smaller {scale}")
    if code == SCORES:
        raise FloatingPointError(
            f"the attention scores {scale} * {q}^T {k} overflow {arith}: their products reach {value:.4g} > "
            f"{limit:.4g} ({arith}'s largest value), and the log-sum-exp is at least the largest score; scale {q} "
            f"or {k} down, or pass a smaller {scale}")
    if code == SCORES_WITH_BIAS:
        names = [name for name, x in (("bias", prob.bias), ("alibi_slopes", prob.alibi)) if x is not None and x.size]
        terms = " and ".join(caller("bias") if name == "bias" else f"the ALiBi terms ({caller(name)} times the key "
                             "distance)" for name in names)
        raise FloatingPointError(
            f"the attention scores plus {terms} overflow {arith}: they reach {value:.4g} > {limit:.4g} ({arith}'s "
            f"largest value); scale {' or '.join(caller(name) for name in names)} down")
    if code == SUMS:
        what = "dy" if which else "v"
        raise FloatingPointError(f"the sums of the {'backward' if which else 'forward'} overflow {arith} beyond an "
                                 f"exact rescale of {what}: scale the inputs down")
    if code == OUTPUT:
        name = OUTPUTS[which]
        if count == 1:
            raise FloatingPointError(_FP16_OVERFLOW.format(name=name))
        raise FloatingPointError(f"{name} overflows {arith}: some of its exact values exceed {limit:.4g} ({arith}'s "
                                 f"largest value)")
    raise RuntimeError(f"numbafa: unknown status {tuple(status)}")


def _signature(prob) -> tuple:
    """What decides the Numba types of the bundles :func:`attention_fwd` / :func:`attention_bwd`
    build: their arrays are the validated ones (C-contiguous, aligned, of a writable type:
    :func:`numbafa.checks.validation.kernel_view`) or new ones of fixed ranks in the accumulator dtype,
    and a plan's every field has one type whatever the options (:mod:`numbafa.kernels.bundles`),
    so only the kernel arrays' dtype varies (float32, bf16 bits, float64; fp16 inputs arrive as
    float32)."""
    return ("core", prob.q.dtype.char)


# --- remembered calls --------------------------------------------------------------------
#
# Small models make thousands of calls with one shape. A call with no option arrays (sinks,
# packing bounds, a bias, ALiBi slopes) and no dropout depends on its arrays' metadata and the
# scalar options only, up to the values, which the compiled entry checks on every call: what
# the first such call derived from them -- the checks passed, the layout, the plan -- is
# remembered as a recipe (:class:`_Recipe`), and a later call with the same key (:func:`_call_key`)
# runs the entry straight away. Any failure reported by the entry is raised by the full path,
# which runs the call again and words the error.

class _Recipe:
    """What a remembered call needs: the kernel layout code, the plan and its accumulator dtype,
    the empty sinks, the work items (and units to finish), the input dtype, the natural lse shape,
    the shapes of the forward's outputs (of the backward's: each output's and statistic's shape,
    or the empty array every call shares), the entry's signature and what calls it
    (:func:`~numbafa.kernels.launch.prepared_entry`), the input records' members
    (:func:`~numbafa.kernels.stored.stored_members`), the shape of the lse's Neuron view, and
    whether the kernels took the arrays as they are (:func:`_kernel_arrays`). Everything a
    remembered call can know before its arrays is here, so the call does no more than allocate,
    call and convert."""

    __slots__ = ("layout", "perm", "plan", "acc", "sinks", "items", "units", "dtype", "lse_shape", "o_shape",
                 "signature", "as_they_are", "bits", "bwd_fields", "call", "members", "lse_tiles")

    def __init__(self, prob, plan, arrays: tuple, kernel_arrays: tuple, items, units=None, state=None):
        self.layout, self.plan, self.sinks, self.items, self.units = prob.layout, plan, prob.sinks, items, units
        self.perm = KERNEL_LAYOUT_PERMS[prob.layout] if prob.layout else None
        self.dtype, self.signature = prob.dtype, _signature(prob)
        dims = prob.dims
        self.lse_shape = (dims.bs, dims.nheads, dims.seqlen_q)
        self.o_shape = _in_layout((dims.bs, dims.nheads, dims.d_head_v, dims.seqlen_q), prob.layout)
        self.acc = plan.acc.dtype
        tiles, rest = divmod(dims.seqlen_q, Q_TILE)
        self.lse_tiles = None if rest else (dims.bs, dims.nheads, tiles, Q_TILE)
        # the backward's outputs and statistics (:func:`bwd_outputs`, :func:`new_bwd_stats`), field
        # by field: the shape of one a call writes, or the empty one (no sinks, no split units),
        # which every call shares (a kernel writes no element of it)
        self.bwd_fields = None
        if state is not None:
            self.bwd_fields = tuple(tuple(x.shape if x.size else x for x in part) for part in state)
        self.call = prepared_entry(forward_entry if state is None else backward_entry, self.signature)
        self.members = stored_members(kernel_arrays[0], plan.acc)
        self.bits = kernel_arrays[0].dtype != prob.dtype   # bf16 as uint16 bits
        self.as_they_are = all(x.flags.writeable and kx.dtype.itemsize == x.dtype.itemsize
                               and kx.__array_interface__["data"][0] == x.__array_interface__["data"][0]
                               for x, kx in zip(arrays, kernel_arrays))


def _kernel_arrays(arrays: tuple, recipe: _Recipe):
    """The kernels' views of a remembered call's 4-D arrays: the arrays themselves, in the kernel
    layout (and bf16 as bits), when the first call took them so; else
    :func:`~numbafa.checks.validation.as_kernel_array` (a copy, a widening, a writable view)."""
    if not recipe.as_they_are:
        return tuple(as_kernel_array(x, recipe.layout) for x in arrays)
    if recipe.perm is not None:
        arrays = tuple(x.transpose(recipe.perm) for x in arrays)
    return [x.view(UINT16) for x in arrays] if recipe.bits else arrays


_RECIPES = Memo()
_new = tuple.__new__   # a bundle from its fields in order (no keyword handling)


def _call_key(arrays: tuple, option_arrays: tuple, dropout_p, scalars, backward: bool, lse_layout: str):
    """The key of a call that can be remembered (:class:`_Recipe`), else None: each array's
    type, shape, strides, dtype and flags (the kernels' views of them follow), the scalar options
    (:func:`~numbafa.checks.options.scalar_key`), the pass, the lse layout and the GEMM path. A
    call with an option array (``option_arrays``: sinks, packing bounds, bias, ALiBi slopes) or
    dropout is not remembered."""
    if scalars is None or type(dropout_p) not in (int, float) or dropout_p != 0:
        return None
    for x in option_arrays:
        if x is not None:
            return None
    parts = []
    for x in arrays:
        if type(x) is not np.ndarray:
            return None
        flags = x.flags
        parts.append((x.shape, x.strides, x.dtype, flags.aligned, flags.writeable))
    return tuple(parts), scalars, backward, lse_layout, active_gemm_path()


def _options_key(arrays: tuple, options: AttentionOptions, backward: bool, lse_layout: str):
    """:func:`_call_key` of a call with ``options``."""
    return _call_key(arrays, (options.sinks, options.bound_min, options.bound_max, options.bias, options.alibi_slopes),
                     options.dropout_p, options.scalar_key(), backward, lse_layout)


def _remember(key, recipe) -> None:
    """Remember the :class:`_Recipe` ``recipe()`` for ``key`` (None: not to be remembered)."""
    if key is not None:
        recipe = recipe()
        if not recipe.plan.scores.active and not recipe.plan.dropout.active:
            _RECIPES.put(key, recipe)


def _fwd_outputs(outs, dtype, layout: int, lse_layout: str) -> tuple:
    return _as_neuron(to_dtype(outs.o, dtype, "o"), layout), lse_out(outs.lse, lse_layout)


def remembered_fwd(arrays: tuple, option_arrays: tuple, dropout_p, scalars, lse_layout: str):
    """``(o, lse)`` of the forward of ``arrays`` (q, k, v) when a call with the same
    :func:`_call_key` succeeded before and this one succeeds too, else None (then
    :func:`attention_fwd` runs, and raises what this call's values make it raise). The public
    :func:`numbafa.attention_fwd` calls it with its arguments as it got them
    (:func:`~numbafa.checks.options.scalar_key`), before it builds its options."""
    recipe = _RECIPES.get(_call_key(arrays, option_arrays, dropout_p, scalars, False, lse_layout))
    return None if recipe is None else _run_remembered_fwd(arrays, recipe, lse_layout)


def _run_remembered_fwd(arrays: tuple, recipe: _Recipe, lse_layout: str):
    """:func:`remembered_fwd` of a known recipe: the outputs, or None when the entry reports a
    failure. What :func:`attention_fwd` does after its checks, with what the recipe knows."""
    acc = recipe.acc
    o, lse = np.empty(recipe.o_shape, acc), np.empty(recipe.lse_shape, acc)
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    q, k, v = stored_records(_kernel_arrays(arrays, recipe), recipe.members)
    call_prepared(recipe.call, (_new(FwdInputs, (q, k, v, recipe.sinks)), _new(FwdOutputs, (o, lse)), recipe.plan,
                                recipe.items, -1, status))
    if status[0]:
        return None
    if lse_layout == "neuron":   # lse_to_neuron, its checks passed on the first call
        lse = np.ascontiguousarray(lse.reshape(recipe.lse_tiles).transpose(0, 1, 3, 2))
    return _as_neuron(to_dtype(o, recipe.dtype, "o"), recipe.layout), lse


def attention_fwd(q, k, v, options: AttentionOptions, caller: Caller, lse_layout: str = "natural"):
    """The forward of a whole problem: ``(o, lse)``, ``o`` in the inputs' dtype, lse in ``lse_layout``.

    ``q, k, v``: Neuron-layout NumPy arrays; ``options`` as the user gave them (checked here);
    ``caller``: names and layout for the messages.
    """
    key = _options_key((q, k, v), options, False, lse_layout)
    recipe = _RECIPES.get(key)
    if recipe is not None:
        result = _run_remembered_fwd((q, k, v), recipe, lse_layout)
        if result is not None:
            return result
    check_lse_layout(lse_layout)
    prob = validate_fwd_inputs(q, k, v, options, caller, any_layout=True)
    check_lse_layout(lse_layout, prob.dims.seqlen_q)
    plan = shared_plan(prob, backward=False)
    items = _all(prob.dims.bs * prob.dims.nheads_kv * plan.tiling.q_chunks)
    ins = FwdInputs(prob.q, prob.k, prob.v, prob.sinks)
    outs, _, status = run_fwd(ins, plan, items=items, signature=_signature(prob))
    if status[0]:
        raise_status(status, prob, caller)
    _remember(key, lambda: _Recipe(prob, plan, (q, k, v), ins[:3], items))
    return _fwd_outputs(outs, prob.dtype, prob.layout, lse_layout)


#: The permutation from each kernel layout (by code) back to the Neuron layout.
_TO_NEURON = tuple(tuple(int(i) for i in np.argsort(perm)) for perm in KERNEL_LAYOUT_PERMS)


def _as_neuron(x: np.ndarray, layout: int) -> np.ndarray:
    """A 4-D output of the kernels (layout code ``layout``) as a Neuron-layout view (no copy)."""
    return x.transpose(_TO_NEURON[layout]) if layout else x


def _grads(outs, dtype, layout: int) -> tuple:
    return tuple(_as_neuron(to_dtype(getattr(outs, name), dtype, name), layout) for name in ("dq", "dk", "dv"))


def remembered_bwd(arrays: tuple, option_arrays: tuple, dropout_p, scalars):
    """:func:`remembered_fwd` of the backward: ``(dq, dk, dv)`` of ``arrays`` (q, k, v, o, dy,
    lse), or None."""
    recipe = _RECIPES.get(_call_key(arrays, option_arrays, dropout_p, scalars, True, ""))
    return None if recipe is None else _run_remembered_bwd(arrays, recipe)


def _run_remembered_bwd(arrays: tuple, recipe: _Recipe):
    """:func:`remembered_bwd` of a known recipe: the gradients, or None when the entry reports a failure."""
    q, k, v, o, dy = stored_records(_kernel_arrays(arrays[:5], recipe), recipe.members)
    ins = _new(BwdInputs, (q, k, v, o, dy, kernel_lse(arrays[5], recipe.lse_shape), recipe.sinks))
    acc = recipe.acc
    outs_fields, stats_fields = recipe.bwd_fields
    outs = _new(BwdOutputs, [np.empty(x, acc) if type(x) is tuple else x for x in outs_fields])
    stats = _new(BwdStats, [np.empty(x, acc) if type(x) is tuple else x for x in stats_fields])
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    call_prepared(recipe.call, (ins, outs, stats, recipe.plan, recipe.items, recipe.units, -1, status))
    return None if status[0] else _grads(outs, recipe.dtype, recipe.layout)


def attention_bwd(q, k, v, o, dy, lse, options: AttentionOptions, caller: Caller) -> tuple:
    """The backward of a whole problem: ``(dq, dk, dv)`` in the inputs' dtype, ``+ (dsinks,)``
    in the sinks' shape and dtype when there are sinks, ``+ (dbias,)`` in the bias's shape and
    dtype when ``options.return_dbias``. Arguments as :func:`attention_fwd`."""
    key = _options_key((q, k, v, o, dy, lse), options, True, "")
    recipe = _RECIPES.get(key)
    if recipe is not None:
        grads = _run_remembered_bwd((q, k, v, o, dy, lse), recipe)
        if grads is not None:
            return grads
    prob = validate_bwd_inputs(q, k, v, o, dy, lse, options, caller, any_layout=True)
    plan = shared_plan(prob, backward=True)
    ins = BwdInputs(q=prob.q, k=prob.k, v=prob.v, o=prob.o, dy=prob.dy, lse=prob.lse, sinks=prob.sinks)
    dims = prob.dims
    items = _all(n_backward_items(dims.bs, dims.nheads_kv, plan.tiling.q_chunks, plan.scores))
    units = _all(dims.bs * dims.nheads_kv if needs_finish(ins, plan) else 0)
    outs, stats, _, status = run_bwd(ins, plan, items=items, units=units, signature=_signature(prob))
    if status[0]:
        raise_status(status, prob, caller)
    if prob.sinks_shape is None and not prob.return_dbias:
        _remember(key, lambda: _Recipe(prob, plan, (q, k, v, o, dy), ins[:5], items, units, (outs, stats)))
    grads = _grads(outs, prob.dtype, prob.layout)
    if prob.sinks_shape is not None:
        grads += (user_dsinks(outs.dsinks, prob.sinks_shape, prob.sinks_dtype),)
    if prob.return_dbias:
        grads += (user_dbias(prob, plan.scores.dbias),)
    return grads
