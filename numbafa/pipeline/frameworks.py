"""What :mod:`numbafa.torch` and :mod:`numbafa.jax` share: the argument checks and the host calls.

Neither framework is imported here. The adapters check every argument from
its shape and dtype *before* tracing or calling anything (so that under
``torch.compile`` and ``jax.jit`` a bad call fails at once, with the user's
names): :func:`check_call` runs numbafa's own checks
(:func:`numbafa.checks.validation.check_options`, :func:`~numbafa.checks.validation.check_tensors`)
with the adapters' :class:`~numbafa.checks.options.Caller`. On the host,
:func:`host_forward` / :func:`host_backward` run the execution core
(:mod:`numbafa.pipeline.core`) on NumPy views of the framework's buffers with the same
caller, so that value errors (NaN/inf) name the user's arguments too.

The user's function is ``attention(q, k, v, *, causal, window, sinks,
bound_min, bound_max, softmax_scale, layout)``: ``causal`` for
``use_causal_mask``, ``window`` for ``sliding_window``, ``do`` for ``dy_ref``.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np

from . import core
from ..conventions.dtypes import bf16_dtype
from ..layout import check_layout
from ..compiler.memo import Memo
from ..checks.options import AttentionOptions, Caller
from ..checks.validation import check_options, check_tensors

__all__ = ["FRAMEWORK_LAYOUTS", "NAMES", "check_call", "host_backward", "host_forward", "host_options"]

#: Layouts the framework adapters take (SDPA's and flash-attn's).
FRAMEWORK_LAYOUTS = ("bhsd", "bshd")

#: The adapters' names of the kernels' arguments, for numbafa's messages.
NAMES = {"q_ref": "q", "k_ref": "k", "v_ref": "v", "o_ref": "o", "dy_ref": "do", "lse_ref": "lse",
         "sinks_ref": "sinks", "use_causal_mask": "causal", "sliding_window": "window",
         # the dimensions, as SDPA's and flash-attn's documentation name them
         "bs": "batch", "nheads": "heads", "nheads_kv": "heads_kv", "d_head": "head_dim",
         "d_head_v": "head_dim_v", "seqlen_q": "seq",
         "seqlen_k": "seq_k", "bfloat16": "bfloat16"}

#: A tensor described by its shape and dtype (NumPy's, or the framework's name when NumPy has none).
_Spec = namedtuple("_Spec", ["shape", "dtype"])


def _numpy_dtype(name: str):
    if name == "bfloat16":
        return bf16_dtype()
    try:
        return np.dtype(name)
    except TypeError:
        return name


def _spec(shape, dtype_name, layout=None) -> _Spec:
    """A tensor's spec, its shape permuted to the Neuron layout when ``layout`` is given (4-D only)."""
    shape = tuple(shape)
    if layout is not None and len(shape) == 4:
        perm = check_layout(layout)
        shape = tuple(shape[i] for i in perm)
    return _Spec(shape, _numpy_dtype(dtype_name))


def check_call(layout: str, given: dict, options: AttentionOptions) -> AttentionOptions:
    """Check an adapter's call from shapes and dtypes alone; return the checked options.

    Parameters
    ----------
    layout : {"bhsd", "bshd"}
    given : dict
        ``(shape, dtype name)`` of ``q``, ``k``, ``v`` and, when given, ``sinks``,
        ``bound_min``, ``bound_max``, ``bias``, ``alibi_slopes`` (``"float32"``, ``"bfloat16"``, or
        another name).
    options : the user's options (the option arrays' values are not looked at).

    Returns
    -------
    AttentionOptions, checked, with ``sliding_window`` capped at the keys' seq (0: none).

    Raises
    ------
    TypeError, ValueError
        Naming the user's argument, with the expected and the actual value.
    """
    key = _call_key(layout, given, options)
    known = _CHECKED_CALLS.get(key)
    if known is not None:
        return known.with_call_values(options)
    checked = _check_call(layout, given, options)
    _CHECKED_CALLS.put(key, checked)
    return checked


#: Adapter calls whose checks passed: :func:`_call_key` -> checked options (no arrays).
_CHECKED_CALLS = Memo()


def _call_key(layout, given: dict, options: AttentionOptions):
    """What :func:`check_call` depends on (the arrays' values aside), or None."""
    scalars = options.scalar_key()
    if scalars is None or any(x is not None for x in options.arrays().values()):
        return None
    return layout, tuple(given.items()), scalars


def _check_call(layout: str, given: dict, options: AttentionOptions) -> AttentionOptions:
    if layout not in FRAMEWORK_LAYOUTS:
        raise ValueError(f"layout must be one of {FRAMEWORK_LAYOUTS}, got {layout!r}")
    caller = Caller(NAMES, layout)
    options = check_options(options, caller)
    tensors = {key: _spec(*given[name], layout) for key, name in (("q_ref", "q"), ("k_ref", "k"), ("v_ref", "v"))}
    arrays = {name: None if name not in given else _spec(*given[name]) for name in options.arrays()}
    dims = check_tensors(tensors, dataclasses.replace(options, **arrays), caller)
    return dataclasses.replace(options, sliding_window=min(options.sliding_window, dims.seqlen_k))


def host_options(**fields) -> AttentionOptions:
    """The options of a host call: :class:`~numbafa.checks.options.AttentionOptions` of ``fields``, by
    name (its arrays as NumPy arrays or None; ``softmax_scale`` 0.0 for the default), bf16
    accumulating in float32 (``mixed_precision=True``)."""
    return AttentionOptions(mixed_precision=True, **fields)


def host_forward(qn, kn, vn, options: AttentionOptions, layout: str):
    """numbafa's forward on Neuron-layout arrays: ``o`` ``[b, h, d_v, s]``, lse ``[b, h, s]`` (float32,
    float64 for float64 inputs);
    errors name the user's arguments, shapes given in ``layout``."""
    return core.attention_fwd(qn, kn, vn, options, Caller(NAMES, layout))


def host_backward(neuron: tuple, lse, options: AttentionOptions, layout: str):
    """numbafa's backward: ``neuron`` the Neuron-layout ``(q, k, v, o, do)``; ``dq, dk, dv`` ``[b, h, d,
    s]`` (+ dsinks, + dbias when ``options.return_dbias``)."""
    q, k, v, o, do = neuron
    return core.attention_bwd(q, k, v, o, do, lse, options, Caller(NAMES, layout))
