"""The kernels from your own ``@numba.njit`` code: a plan built once in Python, calls in njit::

    import numba, numbafa.nb

    plan = numbafa.nb.plan(q, k, v, use_causal_mask=True)      # Python, once: validates

    @numba.njit
    def step(plan, q, k, v, o, lse, dy, dq, dk, dv):
        numbafa.nb.attention_fwd(plan, q, k, v, o, lse)
        ...                                                    # the loss, dy = dL/do
        numbafa.nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)

:func:`plan` validates the shapes, dtypes and options exactly as
:func:`numbafa.attention_bwd` does and returns a :data:`NbPlan`, a named tuple
Numba passes around. :func:`attention_fwd` and :func:`attention_bwd` are
jitted functions (callable from Python too) that write preallocated outputs
in the Neuron layout, exactly the bits :func:`numbafa.attention_fwd` and
:func:`numbafa.attention_bwd` return for the same inputs. Inside njit code
nothing is validated again but the arrays' shapes and dtypes against the
plan: a mismatch raises a ``ValueError`` before anything is written.

Arrays: ``q, dq`` ``[bs, nheads, d_head, seqlen_q]``; ``o, dy`` ``[bs, nheads, d_head_v,
seqlen_q]``; ``k, dk`` ``[bs, nheads_kv, d_head, seqlen_k]``; ``v, dv`` ``[bs, nheads_kv,
d_head_v, seqlen_k]`` (``d_head_v``, the value head dim, may differ from ``d_head``); float32, or uint16 holding bf16
bit patterns (``x.view(numpy.uint16)`` of an ``ml_dtypes.bfloat16`` array)
for a plan made from bf16 inputs. ``lse`` is float32 ``[bs, nheads, 128,
seqlen_q // 128]`` (the Neuron packing: ``seqlen_q`` must be a multiple of
128). A plan made with ``with_sinks=True`` takes ``sinks`` (float32 ``[bs,
nheads]`` or ``[bs, nheads, num_sinks]``) after ``lse`` in the forward, and
``sinks, dsinks`` (same shape) after ``dv`` in the backward.

Threads: the passes run their ``prange`` launchers, on
``numba.get_num_threads()`` threads. The tile GEMMs inside call BLAS from
every thread: wrap your loop in ``with numbafa.nb.single_threaded_blas():``
(what the Python API does around each call) so that a multi-threaded
OpenBLAS does not oversubscribe the cores; it changes no bit. Under Numba's
``workqueue`` threading layer only one launch may run at a time in the
process (Numba's rule; the Python API serialises its own calls).

A plan holds addresses of compiled code of this process: it is valid only
in the process that made it (a plan from another process, e.g. unpickled,
raises ``ValueError``). Attention dropout is set in the plan
(``dropout_p``, ``seed``, ``seed_offset``); :func:`with_seed_offset` gives the
plan of another step's mask, in njit code too.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import namedtuple

import numba
import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.extending import overload

from .blas import single_threaded_blas
from .dtypes import bf16_dtype, is_bf16
from .jit import jit
from .kernels.backward import BwdStats, bwd_finish_unit, bwd_work_item, flash_attn_bwd
from .kernels.bundles import BwdEntries, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, Plan, make_plan
from .kernels.dropout import Dropout, philox_words
from .kernels.forward import flash_attn_fwd, fwd_work_item
from .kernels.launch import work_item_address
from .options import AttentionOptions, Caller
from .runtime import kernel_call
from .tiling import Q_TILE
from .validation import validate_fwd_inputs

__all__ = ["NbPlan", "plan", "attention_fwd", "attention_bwd", "with_seed_offset", "single_threaded_blas"]

#: A validated problem for the njit functions: ``fwd``/``bwd`` the kernels' plans of each pass,
#: ``shape`` ``(bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_head_v)``, ``bf16`` (arrays are uint16
#: bf16 bits), ``with_sinks``, ``fwd_item``/``bwd_item``/``bwd_finish`` the work items' addresses,
#: ``fwd_key``/``bwd_key`` (a hash of the argument types the work items were compiled for: a call
#: whose types differ is refused, never run), ``seed`` (the dropout seed as two 32-bit words) and
#: ``pid`` (the process the addresses belong to).
NbPlan = namedtuple("NbPlan", ["fwd", "bwd", "shape", "bf16", "with_sinks", "fwd_item", "bwd_item",
                               "bwd_finish", "fwd_key", "bwd_key", "seed", "pid"])

_CALLER = Caller({"q_ref": "q", "k_ref": "k", "v_ref": "v"})
_getpid = types.ExternalFunction("_getpid" if sys.platform == "win32" else "getpid", types.int32())


def _as_bf16_view(x):
    """uint16 arrays are bf16 bit patterns here; other arrays pass unchanged."""
    return x.view(bf16_dtype()) if isinstance(x, np.ndarray) and x.dtype == np.uint16 else x


def plan(q, k, v, *, use_causal_mask=False, sliding_window=None, bound_min=None, bound_max=None,
         softmax_scale=None, mixed_precision=False, with_sinks=False, dropout_p=0.0, seed=None,
         seed_offset=0) -> NbPlan:
    """Validate a problem once, for :func:`attention_fwd` and :func:`attention_bwd` in njit code.

    Parameters
    ----------
    q : ndarray ``[bs, nheads, d_head, seqlen_q]``
        float32, ``ml_dtypes.bfloat16``, or uint16 (bf16 bits); ``seqlen_q % 128 == 0``.
    k, v : ndarray ``[bs, nheads_kv, d_head, seqlen_k]`` and ``[bs, nheads_kv, d_head_v, seqlen_k]``,
        same dtype. Their values are checked (finite) here, as :func:`numbafa.attention_fwd` does; the
        njit calls may pass other values of the same shapes and dtype.
    use_causal_mask, sliding_window, bound_min, bound_max, softmax_scale, mixed_precision
        As in :func:`numbafa.attention_bwd`.
    with_sinks : bool
        The calls pass attention-sink logits (and the backward their gradient).
    dropout_p, seed, seed_offset
        Attention dropout, as in :func:`numbafa.attention_bwd`; :func:`with_seed_offset`.

    Returns
    -------
    NbPlan
        Valid in this process only. Compiles (or loads from the disk cache) the kernels of this
        dtype and these options first, announced as by the Python API.

    Raises
    ------
    TypeError, ValueError
        As :func:`numbafa.attention_bwd`, naming ``q``, ``k``, ``v``; ``seqlen_q`` not a
        multiple of 128; ``with_sinks`` not a bool; float64 or float16 arrays (the Python API takes them).
    """
    if not isinstance(with_sinks, (bool, np.bool_)):
        raise TypeError(f"with_sinks must be a bool, got {type(with_sinks).__name__}")
    q, k, v = (_as_bf16_view(x) for x in (q, k, v))
    options = AttentionOptions(None, bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale,
                               sliding_window, dropout_p, seed, seed_offset)
    prob = validate_fwd_inputs(q, k, v, options, _CALLER)
    if prob.dtype in (np.float64, np.float16):
        raise TypeError(f"numbafa.nb takes float32 or bf16 arrays, got q of {prob.dtype}; {prob.dtype} runs "
                        f"through numbafa.attention_fwd / attention_bwd")
    bs, nheads, d_head, seqlen_q = prob.q.shape
    nheads_kv, seqlen_k = prob.k.shape[1], prob.k.shape[3]
    if seqlen_q % Q_TILE:
        raise ValueError(f"numbafa.nb takes lse in the Neuron layout [bs, nheads, {Q_TILE}, seqlen_q // "
                         f"{Q_TILE}]: seqlen_q must be a multiple of {Q_TILE}, got {seqlen_q}")
    # Start Numba's threading layer: a user's function loaded from Numba's cache may run a
    # launcher without doing it (its cached code does not always carry the reload hook).
    numba.get_num_threads()
    fwd = make_plan(prob, backward=False)
    bwd = make_plan(prob, backward=True)
    kind = np.uint16 if prob.is_bf16 else np.float32
    q4 = np.empty((0, 0, 0, 0), kind)
    f4, f3 = np.empty((0, 0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32)
    fwd_args = (FwdInputs(q4, q4, q4, f3), FwdOutputs(f4, f3), fwd)
    bwd_args = (BwdInputs(q4, q4, q4, q4, q4, f3, f3), BwdOutputs(f4, f4, f4, f3, f4, f4),
                _stats_like(f3), bwd)
    with kernel_call("forward" if fwd.dropout is None else "forward (with dropout)", prob.dtype.name):
        fwd_item = work_item_address(fwd_work_item, fwd_args)
    with kernel_call("backward" if bwd.dropout is None else "backward (with dropout)", prob.dtype.name):
        bwd_item = work_item_address(bwd_work_item, bwd_args)
        # The finish runs only for split units or sinks (as in launch.run_backward); 0: never called.
        needs_finish = bwd.tiling.q_chunks > 1 or with_sinks
        bwd_finish = work_item_address(bwd_finish_unit, bwd_args) if needs_finish else 0
    return NbPlan(fwd, bwd, (bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, prob.v.shape[2]),
                  bool(prob.is_bf16),
                  bool(with_sinks), fwd_item, bwd_item, bwd_finish, _type_key(numba.typeof(fwd_args)),
                  _type_key(numba.typeof(bwd_args)), (prob.seed & 0xFFFFFFFF, prob.seed >> 32), os.getpid())


def _type_key(numba_type) -> int:
    """A 63-bit hash of a Numba type's name (the same in Python and at njit typing time)."""
    return int(hashlib.sha256(str(numba_type).encode()).hexdigest()[:15], 16)


def _stats_like(f3):
    return BwdStats(f3, f3)


# --- checks and conversions inside njit code ---------------------------------------------------

def _is_bits(x):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_is_bits)
def _is_bits_overload(x):
    """True for uint16 arrays (bf16 bits), False for float32 ones; anything else: a typing error."""
    if not isinstance(x, types.Array) or x.ndim == 0:
        raise TypingError("numbafa.nb: arrays must be NumPy arrays")
    if x.dtype == types.uint16:
        return lambda x: True
    if x.dtype == types.float32:
        return lambda x: False
    raise TypingError(f"numbafa.nb: arrays must be float32, or uint16 holding bf16 bits, got {x.dtype}")


def _kernel_input(x):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_kernel_input)
def _kernel_input_overload(x):
    """``x`` as the kernels take it: C-contiguous and of a writable type (a copy otherwise)."""
    if x.layout == "C" and x.mutable:
        return lambda x: x
    return lambda x: x.copy()


def _kernel_output(x):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_kernel_output)
def _kernel_output_overload(x):
    """A float32 C-contiguous array the kernel writes: ``x`` itself if it is one, else a new one."""
    if x.dtype == types.float32 and x.layout == "C" and x.mutable:
        return lambda x: x
    return lambda x: np.empty(x.shape, dtype=np.float32)


def _store_output(y, x):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_store_output)
def _store_output_overload(y, x):
    """Write the kernel's float32 ``y`` into the caller's ``x`` (bf16 values: exact bits)."""
    if x.dtype == types.float32 and x.layout == "C" and x.mutable:
        return lambda y, x: None   # the kernel wrote x itself
    if x.dtype == types.uint16:
        def store_bits(y, x):
            src = y.reshape(-1).view(np.uint32)
            dst = x.reshape(x.size) if x.flags.c_contiguous else np.empty(x.size, np.uint16)
            for i in range(src.size):
                dst[i] = np.uint16(src[i] >> np.uint32(16))
            if not x.flags.c_contiguous:
                x[...] = dst.reshape(x.shape)
        return store_bits
    return lambda y, x: _assign(x, y)


def _key_of(value):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_key_of)
def _key_of_overload(value):
    """:func:`_type_key` of ``value``'s type, a constant of the compiled code."""
    key = _type_key(value)
    return lambda value: key


def _canonical(kernel_plan):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_canonical)
def _canonical_overload(kernel_plan):
    """A kernel plan with its float32 fields float32 again (a plan that went back to Python
    from njit code comes back with float64 ones: Numba boxes float32 as a Python float)."""
    def impl(kernel_plan):
        p = kernel_plan
        return Plan(p.tiling, p.mask, p.precision, np.float32(p.softmax_scale), p.gemm, p.operand,
                    _canonical_dropout(p.dropout), p.acc, p.scores)
    return impl


def _canonical_dropout(dropout):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_canonical_dropout)
def _canonical_dropout_overload(dropout):
    if isinstance(dropout, types.NoneType):
        return lambda dropout: None
    return lambda dropout: Dropout(dropout.threshold, np.float32(dropout.scale), dropout.key0,
                                   dropout.key1, dropout.batch0, dropout.head0)


@jit()
def _check_key(key, expected):
    if key != expected:
        raise ValueError("numbafa.nb: the plan's kernels were compiled for other argument types than "
                         "this call's (a plan changed after numbafa.nb.plan made it?); make it again")


@jit()
def _assign(x, y):
    x[...] = y


@jit()
def _check_plan(plan, bits):
    if plan.pid != _getpid():
        raise ValueError("numbafa.nb: this plan was made in another process; make it again with "
                         "numbafa.nb.plan in this one")
    if bits != plan.bf16:
        raise ValueError("numbafa.nb: the arrays' dtype is not the plan's (float32, or uint16 bf16 bits "
                         "for a plan made from bf16 inputs)")


@jit()
def _check_shape(x, d0, d1, d2, d3):
    s = x.shape
    if x.ndim != 4 or s[0] != d0 or s[1] != d1 or s[2] != d2 or s[3] != d3:
        raise ValueError("numbafa.nb: an array's shape is not the plan's")


@jit()
def _check_dtypes(bits, a, b, c):
    if _is_bits(a) != bits or _is_bits(b) != bits or _is_bits(c) != bits:
        raise ValueError("numbafa.nb: every array must have q's dtype")


@jit()
def _check_lse(lse, bs, nheads, seqlen_q):
    s = lse.shape
    if lse.ndim != 4 or s[0] != bs or s[1] != nheads or s[2] != 128 or s[3] * 128 != seqlen_q:
        raise ValueError("numbafa.nb: lse must be [bs, nheads, 128, seqlen_q // 128] float32")


@jit()
def _kernel_sinks(plan, sinks):
    """The sinks as the kernels take them: float32 ``[bs, nheads, num_sinks]`` (empty without)."""
    bs, nheads = plan.shape[0], plan.shape[1]
    if sinks is None:
        if plan.with_sinks:
            raise ValueError("numbafa.nb: the plan was made with_sinks=True: pass sinks")
        return np.zeros((bs, nheads, 0), dtype=np.float32)
    if not plan.with_sinks:
        raise ValueError("numbafa.nb: the plan was made without sinks: make it with with_sinks=True")
    if sinks.shape[0] != bs or sinks.shape[1] != nheads or (sinks.ndim == 3 and sinks.shape[2] < 1):
        raise ValueError("numbafa.nb: sinks must be [bs, nheads] or [bs, nheads, num_sinks >= 1]")
    flat = np.ascontiguousarray(sinks).astype(np.float32)
    return flat.reshape(bs, nheads, flat.size // max(1, bs * nheads))


@jit()
def _lse_to_natural(lse):
    bs, nheads, tile, n_tiles = lse.shape
    out = np.empty((bs, nheads, tile * n_tiles), dtype=np.float32)
    for b in range(bs):
        for h in range(nheads):
            for t in range(n_tiles):
                for p in range(tile):
                    out[b, h, t * tile + p] = lse[b, h, p, t]
    return out


@jit()
def _lse_from_natural(natural, lse):
    bs, nheads, tile, n_tiles = lse.shape
    for b in range(bs):
        for h in range(nheads):
            for t in range(n_tiles):
                for p in range(tile):
                    lse[b, h, p, t] = natural[b, h, t * tile + p]


# --- the passes ---------------------------------------------------------------------------------

@jit()
def _check_problem(plan, q, k, v, o, lse):
    """The checks both passes make of the plan, q, k, v, o and lse; True for bf16 bits."""
    bits = _is_bits(q)
    _check_plan(plan, bits)
    _check_dtypes(bits, k, v, o)
    bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_v = plan.shape
    _check_shape(q, bs, nheads, d_head, seqlen_q)
    _check_shape(o, bs, nheads, d_v, seqlen_q)
    _check_shape(k, bs, nheads_kv, d_head, seqlen_k)
    _check_shape(v, bs, nheads_kv, d_v, seqlen_k)
    _check_lse(lse, bs, nheads, seqlen_q)
    return bits


@jit(entry=True)
def attention_fwd(plan, q, k, v, o, lse, sinks=None):
    """The forward of :func:`numbafa.attention_fwd` into ``o`` and ``lse`` (module docstring).

    ``o``: ``q``'s shape with ``v``'s head dim, ``q``'s dtype; ``lse``: float32 ``[bs, nheads, 128, seqlen_q // 128]``;
    ``sinks`` only (and required) when the plan was made ``with_sinks=True``.
    """
    _check_problem(plan, q, k, v, o, lse)
    bs, nheads, nheads_kv, _, seqlen_q, _, _ = plan.shape
    ins = FwdInputs(_kernel_input(q), _kernel_input(k), _kernel_input(v), _kernel_sinks(plan, sinks))
    o32 = _kernel_output(o)
    lse_natural = np.empty((bs, nheads, seqlen_q), dtype=np.float32)
    outs = FwdOutputs(o32, lse_natural)
    kernel_plan = _canonical(plan.fwd)
    _check_key(_key_of((ins, outs, kernel_plan)), plan.fwd_key)
    items = np.arange(bs * nheads_kv * kernel_plan.tiling.q_chunks)
    flash_attn_fwd(ins, outs, kernel_plan, plan.fwd_item, items)
    _store_output(o32, o)
    _lse_from_natural(lse_natural, lse)


@jit(entry=True)
def attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks=None, dsinks=None):
    """The backward of :func:`numbafa.attention_bwd` into ``dq, dk, dv`` (and ``dsinks``).

    ``dq``: ``q``'s shape, ``dk``: ``k``'s, ``dv``: ``v``'s, all in ``q``'s dtype; ``lse`` as the forward wrote
    it; ``sinks`` and ``dsinks`` (float32, the sinks' shape) only, and both, with a plan made
    ``with_sinks=True``.
    """
    _check_problem(plan, q, k, v, o, lse)
    _check_problem(plan, dq, dk, dv, dy, lse)   # the gradients and dy: the plan's dtype, q's, k's, v's, o's shapes
    bs, nheads, nheads_kv, d_head, seqlen_q, seqlen_k, d_v = plan.shape
    kernel_sinks = _kernel_sinks(plan, sinks)
    if (sinks is None) != (dsinks is None):
        raise ValueError("numbafa.nb: pass sinks and dsinks together")
    ins = BwdInputs(_kernel_input(q), _kernel_input(k), _kernel_input(v), _kernel_input(o),
                    _kernel_input(dy), _lse_to_natural(lse), kernel_sinks)
    q_chunks = plan.bwd.tiling.q_chunks
    n_units = bs * nheads_kv
    split = q_chunks > 1
    parts_k = (n_units, q_chunks - 1, d_head, seqlen_k) if split else (1, 1, d_head, 0)
    parts_v = (n_units, q_chunks - 1, d_v, seqlen_k) if split else (1, 1, d_v, 0)
    dq32, dk32, dv32 = _kernel_output(dq), _kernel_output(dk), _kernel_output(dv)
    dsinks32 = np.empty(kernel_sinks.shape, dtype=np.float32)
    outs = BwdOutputs(dq32, dk32, dv32, dsinks32, np.empty(parts_k, dtype=np.float32),
                      np.empty(parts_v, dtype=np.float32))
    stats_shape = (n_units, nheads // nheads_kv, seqlen_q)
    stats = BwdStats(np.empty(stats_shape, dtype=np.float32), np.empty(stats_shape, dtype=np.float32))
    n_finish = n_units if q_chunks > 1 or kernel_sinks.shape[2] > 0 else 0
    kernel_plan = _canonical(plan.bwd)
    _check_key(_key_of((ins, outs, stats, kernel_plan)), plan.bwd_key)
    flash_attn_bwd(ins, outs, stats, kernel_plan, BwdEntries(plan.bwd_item, plan.bwd_finish),
                   np.arange(n_units * q_chunks), np.arange(n_finish))
    _store_output(dq32, dq)
    _store_output(dk32, dk)
    _store_output(dv32, dv)
    if dsinks is not None:
        _store_sinks(dsinks32, dsinks)


@jit()
def _store_sinks(dsinks32, dsinks):
    if dsinks.size != dsinks32.size:
        raise ValueError("numbafa.nb: dsinks must have the sinks' shape")
    flat = dsinks32.reshape(-1)
    out = dsinks.reshape(dsinks.size) if dsinks.flags.c_contiguous else np.empty(dsinks.size, np.float32)
    for i in range(flat.size):
        out[i] = flat[i]
    if not dsinks.flags.c_contiguous:
        _assign(dsinks, out.reshape(dsinks.shape))


@jit(entry=True)
def with_seed_offset(plan, seed_offset):
    """The plan with the dropout mask of ``seed_offset`` (e.g. the training step), same seed;
    callable in njit code. A plan without dropout is returned unchanged."""
    return NbPlan(_with_offset(plan.fwd, plan.seed, seed_offset),
                  _with_offset(plan.bwd, plan.seed, seed_offset), plan.shape, plan.bf16, plan.with_sinks,
                  plan.fwd_item, plan.bwd_item, plan.bwd_finish, plan.fwd_key, plan.bwd_key, plan.seed,
                  plan.pid)


def _with_offset(kernel_plan, seed, seed_offset):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_with_offset)
def _with_offset_overload(kernel_plan, seed, seed_offset):
    if isinstance(kernel_plan.types[kernel_plan.fields.index("dropout")], types.NoneType):
        return lambda kernel_plan, seed, seed_offset: kernel_plan

    def impl(kernel_plan, seed, seed_offset):
        # numbafa.kernels.dropout.derive_key, in njit code
        offset = np.uint64(seed_offset)
        words = philox_words(offset & np.uint64(0xFFFFFFFF), offset >> np.uint64(32), np.uint64(0),
                             np.uint64(0), np.uint64(seed[0]), np.uint64(seed[1]))
        d = kernel_plan.dropout
        dropout = Dropout(d.threshold, d.scale, np.int64(words[0]), np.int64(words[1]), d.batch0, d.head0)
        return Plan(kernel_plan.tiling, kernel_plan.mask, kernel_plan.precision, kernel_plan.softmax_scale,
                    kernel_plan.gemm, kernel_plan.operand, dropout, kernel_plan.acc, kernel_plan.scores)
    return impl
