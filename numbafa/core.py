"""The one execution path of every call: validate -> plan -> allocate -> run items -> finish -> convert.

:func:`attention_fwd` and :func:`attention_bwd` are what every front end
runs on NumPy arrays (the public API, :func:`numbafa.attention`, the torch
and JAX adapters' host calls), with the caller's
:class:`~numbafa.options.AttentionOptions` and
:class:`~numbafa.options.Caller`. The Dask shares (:mod:`numbafa.shards`)
run parts of a problem through the same steps below it:
:func:`run_fwd` / :func:`run_bwd` allocate the kernels' outputs and launch
the work items (:mod:`numbafa.kernels.launch`), :func:`to_dtype` and
:func:`user_dsinks` convert the float32 results to the caller's dtypes.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np

from .dtypes import to_bf16_array, to_fp16_array
from .kernels.backward import new_bwd_stats
from .kernels.bundles import BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, shared_plan
from .kernels.launch import run_backward, run_forward
from .layout import lse_to_neuron
from .options import AttentionOptions, Caller
from .ranges import in_range, unscaled_output
from .runtime import kernel_call
from .tiling import Q_TILE
from .validation import validate_bwd_inputs, validate_fwd_inputs

__all__ = ["LSE_LAYOUTS", "attention_bwd", "attention_fwd", "check_lse_layout", "finite_output", "lse_out",
           "run_bwd", "run_fwd", "to_dtype", "user_dbias", "user_dsinks"]

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


def to_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """Kernel output (float32, or float64 for float64 inputs) -> ``dtype``: itself, bf16 (the values
    of a bf16 output are already rounded: exact), or another float dtype (a float64 call's float32
    sinks' gradient: rounded once)."""
    if x.dtype == dtype:
        return x
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return to_fp16_array(x)
    return x.astype(dtype) if dtype.kind == "f" else to_bf16_array(x)


def user_dsinks(dsinks: np.ndarray, shape: tuple, dtype) -> np.ndarray:
    """The kernels' dsinks ``[bs, nheads, num_sinks]`` (float32, or float64) in the sinks' ``shape``
    and ``dtype``; sinks ``[nheads]`` (shared by the batch) get the sum over the batch in the kernels'
    dtype, rounded once."""
    if len(shape) == 1:
        dsinks = dsinks.reshape(dsinks.shape[0], -1).sum(axis=0, dtype=dsinks.dtype)
    return to_dtype(np.ascontiguousarray(dsinks), dtype).reshape(shape)


def _kernel_name(pass_name: str, plan) -> str:
    """The kernel's name in the compile announcement: kernels with dropout or score variants are
    compiled apart."""
    extras = [what for what, absent in (("dropout", plan.dropout is None), ("score variants", plan.scores is None))
              if not absent]
    return pass_name if not extras else f"{pass_name} (with {' and '.join(extras)})"


#: The input dtype's name of a kernel input array's dtype (bf16 arrive as uint16 bits).
_KERNEL_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64",
                       np.dtype(np.uint16): "bfloat16"}


def _dtype_name(ins, plan) -> str:
    """The input dtype a kernel is compiled for (fp16 inputs reach the kernels widened: their
    precision flags are uint8, :class:`~numbafa.kernels.bundles.Precision`)."""
    if isinstance(plan.precision.round_kernel, np.uint8):
        return "float16"
    name = _KERNEL_DTYPE_NAMES.get(ins.q.dtype)
    return str(ins.q.dtype) if name is None else name


def finite_output(x: np.ndarray, dtype, name: str) -> np.ndarray:
    """``x``; for float16 inputs, raise ``FloatingPointError`` unless it is finite (fp16's range ends
    at 65504: a tile rounded to fp16 beyond it is inf, as on the hardware, docs/numerics.md)."""
    if np.dtype(dtype).char == "e" and not np.isfinite(x).all():   # float16
        raise FloatingPointError(f"{name} overflows float16 at one of the kernels' float16 rounding points "
                                 f"(float16's largest value is 65504): scale the inputs down, or compute in "
                                 f"float32 or bfloat16")
    return x


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


def bwd_outputs(ins: BwdInputs, q_chunks: int) -> BwdOutputs:
    """The backward's float32 outputs, with the dK/dV partials of split units (``q_chunks > 1``)."""
    nb, nheads, d_head, seqlen_q = ins.q.shape
    nheads_kv, d_v, seqlen_k = ins.v.shape[1:]
    acc = ins.lse.dtype   # float32, or float64 for float64 inputs
    lead, keys = ((nb * nheads_kv, q_chunks - 1), seqlen_k) if q_chunks > 1 else ((1, 1), 0)
    return BwdOutputs(np.empty((nb, nheads, d_head, seqlen_q), dtype=acc),
                      np.empty((nb, nheads_kv, d_head, seqlen_k), dtype=acc),
                      np.empty((nb, nheads_kv, d_v, seqlen_k), dtype=acc),
                      np.empty(ins.sinks.shape, dtype=acc), np.empty(lead + (d_head, keys), dtype=acc),
                      np.empty(lead + (d_v, keys), dtype=acc))


def run_fwd(ins: FwdInputs, plan, items=None, n_threads=None, signature=None) -> FwdOutputs:
    """Allocate the forward's float32 ``o`` and ``lse`` and run its work ``items`` (None: all)
    on ``n_threads`` threads (None: ``numba.get_num_threads()``; any number, the same bits).
    ``signature``: see :func:`~numbafa.kernels.launch.work_item_address` (None: Numba's
    fingerprint of the bundles)."""
    nb, nheads, _, seqlen_q = ins.q.shape
    acc = plan.acc.dtype   # float32, or float64 for float64 inputs
    outs = FwdOutputs(np.empty((nb, nheads, ins.v.shape[2], seqlen_q), dtype=acc),
                      np.empty((nb, nheads, seqlen_q), dtype=acc))
    with kernel_call(_kernel_name("forward", plan), _dtype_name(ins, plan)), _on_threads(n_threads):
        run_forward(ins, outs, plan, items, signature)
    return outs


def run_bwd(ins: BwdInputs, plan, items=None, units=None, n_threads=None, state=None, signature=None):
    """Run the backward's work ``items`` and finish its ``units`` (None: all, as
    :func:`~numbafa.kernels.launch.run_backward`); return ``(outs, stats)``.

    ``state``: the ``(outs, stats)`` to finish into (the Dask merge of split units); None:
    allocated here (:func:`bwd_outputs`, :func:`~numbafa.kernels.backward.new_bwd_stats`).
    ``signature`` as :func:`run_fwd`.
    """
    outs, stats = state if state is not None else (bwd_outputs(ins, plan.tiling.q_chunks), new_bwd_stats(ins))
    with kernel_call(_kernel_name("backward", plan), _dtype_name(ins, plan)), _on_threads(n_threads):
        run_backward(ins, outs, stats, plan, items, units, signature)
    return outs, stats


def _signature(prob, plan) -> tuple:
    """What decides the Numba types of the bundles :func:`attention_fwd` / :func:`attention_bwd`
    build (:func:`~numbafa.kernels.launch.work_item_address`): their arrays are the
    validated ones (C-contiguous, aligned, of a writable type: :func:`numbafa.validation.kernel_view`)
    or new float32 ones of fixed ranks, so only the input dtype, the plan's dropout and score
    variants (each ``None`` or a bundle of fixed types) and its GEMM path (its marker and operand
    dtype, :func:`numbafa.onednn.active_gemm_path`) vary."""
    return ("core", prob.dtype, plan.dropout is None, plan.scores is None, plan.gemm is None, plan.operand.dtype.char)


def attention_fwd(q, k, v, options: AttentionOptions, caller: Caller, lse_layout: str = "natural"):
    """The forward of a whole problem: ``(o, lse)``, ``o`` in the inputs' dtype, lse in ``lse_layout``.

    ``q, k, v``: Neuron-layout NumPy arrays; ``options`` as the user gave them (checked here);
    ``caller``: names and layout for the messages.
    """
    check_lse_layout(lse_layout)
    prob = validate_fwd_inputs(q, k, v, options, caller)
    check_lse_layout(lse_layout, prob.q.shape[3])
    prob, e = in_range(prob, caller, backward=False)
    plan = shared_plan(prob, backward=False)
    outs = run_fwd(FwdInputs(prob.q, prob.k, prob.v, prob.sinks), plan, signature=_signature(prob, plan))
    o = finite_output(unscaled_output(outs.o, e, "o"), prob.dtype, "o")
    return to_dtype(o, prob.dtype), lse_out(outs.lse, lse_layout)


def user_dbias(prob, dbias: np.ndarray, e: int) -> np.ndarray:
    """The kernels' ``dbias`` (accumulator dtype, the bias padded to 4-D) in the bias's shape and
    dtype, for a pass run on ``dy * 2**-e``."""
    dbias = finite_output(unscaled_output(dbias, e, "dbias"), prob.bias_dtype, "dbias")
    return to_dtype(dbias, prob.bias_dtype).reshape(prob.bias_shape)


def attention_bwd(q, k, v, o, dy, lse, options: AttentionOptions, caller: Caller) -> tuple:
    """The backward of a whole problem: ``(dq, dk, dv)`` in the inputs' dtype, ``+ (dsinks,)``
    in the sinks' shape and dtype when there are sinks, ``+ (dbias,)`` in the bias's shape and
    dtype when ``options.return_dbias``. Arguments as :func:`attention_fwd`."""
    prob = validate_bwd_inputs(q, k, v, o, dy, lse, options, caller)
    prob, e = in_range(prob, caller, backward=True)
    plan = shared_plan(prob, backward=True)
    outs, _ = run_bwd(BwdInputs(prob.q, prob.k, prob.v, prob.o, prob.dy, prob.lse, prob.sinks), plan,
                      signature=_signature(prob, plan))
    grads = tuple(to_dtype(finite_output(unscaled_output(getattr(outs, name), e, name), prob.dtype, name), prob.dtype)
                  for name in ("dq", "dk", "dv"))
    if prob.sinks_shape is not None:
        dsinks = unscaled_output(outs.dsinks, e, "dsinks")
        grads += (user_dsinks(dsinks, prob.sinks_shape, prob.sinks_dtype),)
    if prob.return_dbias:
        grads += (user_dbias(prob, plan.scores.dbias, e),)
    return grads
