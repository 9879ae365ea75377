"""What :mod:`numbafa.torch` and :mod:`numbafa.jax` share: argument checks and the host calls.

Neither framework is imported here. The adapters check every argument from
its shape and dtype *before* tracing or calling anything (so that under
``torch.compile`` and ``jax.jit`` a bad call fails at once, with the user's
names), then run :func:`host_forward` / :func:`host_backward` on NumPy views
of the framework's buffers. Value checks (NaN/inf) happen in numbafa's own
validation; a failure there is raised again in the user's names
(``q``, ``do``, ...), as :func:`numbafa.attention` does.

The user's function is ``attention(q, k, v, *, causal, window, sinks,
bound_min, bound_max, softmax_scale, layout)``; its names differ from the
kernels' (``causal`` for ``use_causal_mask``, ``window`` for
``sliding_window``, ``do`` for ``dy_ref``), so the checks that mention them
are made here in the user's words.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from .api import attention_bwd, attention_fwd
from .validation import _validate_scale, validate_bwd_inputs, validate_fwd_inputs

#: Layouts the framework adapters take (SDPA's and flash-attn's).
FRAMEWORK_LAYOUTS = ("bhsd", "bshd")

_DIMS = {"bhsd": ("batch", "heads", "seq", "head_dim"), "bshd": ("batch", "seq", "heads", "head_dim")}

#: The adapters' names of the kernels' arguments, for numbafa's messages.
NAMES = {"q_ref": "q", "k_ref": "k", "v_ref": "v", "o_ref": "o", "dy_ref": "do", "lse_ref": "lse",
         "sinks_ref": "sinks", "use_causal_mask": "causal"}


def _split(shape, layout):
    """(batch, heads, seq, head_dim) of a 4-D shape in ``layout``."""
    if layout == "bhsd":
        b, h, s, d = shape
    else:
        b, s, h, d = shape
    return b, h, s, d


def _in_layout(layout, b, h, s, d):
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


def check_arguments(layout, shapes, dtypes, causal, window, softmax_scale):
    """Check the adapters' arguments from shapes and dtypes alone; return ``(window, scale)``.

    Parameters
    ----------
    layout : str
    shapes : dict
        Shape tuples of ``q``, ``k``, ``v`` and, when given, ``sinks``,
        ``bound_min``, ``bound_max``.
    dtypes : dict
        ``"float32"``, ``"bfloat16"`` or another dtype name, by the same keys.
    causal, window, softmax_scale
        As the user passed them.

    Returns
    -------
    window : int
        0 for no window (``None`` or a value < 1), else the window.
    softmax_scale : float
        0.0 for the default ``1 / sqrt(head_dim)``.

    Raises
    ------
    TypeError, ValueError
        Naming the user's argument, with the expected and the actual value.
    """
    if layout not in FRAMEWORK_LAYOUTS:
        raise ValueError(f"layout must be one of {FRAMEWORK_LAYOUTS}, got {layout!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    dims = "[" + ", ".join(_DIMS[layout]) + "]"
    for name in ("q", "k", "v"):
        if len(shapes[name]) != 4:
            raise ValueError(f"{name} must be 4-D {dims} for layout={layout!r}, got shape {tuple(shapes[name])}")
    dtype = dtypes["q"]
    if dtype not in ("float32", "bfloat16"):
        raise TypeError(f"q must be float32 or bfloat16, got {dtype}")
    for name in ("k", "v"):
        if dtypes[name] != dtype:
            raise TypeError(f"{name} must have the dtype of q ({dtype}), got {dtypes[name]}")
    b, h, sq, d = _split(shapes["q"], layout)
    _, h_kv, sk, _ = _split(shapes["k"], layout)
    if h < 1 or d < 1:
        raise ValueError(f"q must have heads >= 1 and head_dim >= 1, got shape {tuple(shapes['q'])} {dims}")
    kb, _, _, kd = _split(shapes["k"], layout)
    if (kb, kd) != (b, d):
        expected = ", ".join(map(str, _in_layout(layout, b, "heads_kv", "seq_k", d)))
        raise ValueError(f"k must have shape ({expected}) {dims} to match q, got {tuple(shapes['k'])}")
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"the heads of q ({h}) must be a multiple of the heads of k, got {h_kv} "
                         f"(k shape {tuple(shapes['k'])} {dims})")
    if tuple(shapes["v"]) != tuple(shapes["k"]):
        raise ValueError(f"v must have the shape of k {tuple(shapes['k'])}, got {tuple(shapes['v'])}")
    if causal and sq != sk:
        raise ValueError(f"causal=True requires the same seq for q and k, got q seq {sq}, k seq {sk}")
    if window is None:
        window = 0
    elif isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int or None, got {type(window).__name__} {window!r}")
    window = max(int(window), 0)
    if window and not causal:
        raise ValueError(f"window={window} requires causal=True (a sliding window is causal), got causal=False")
    _check_sinks(shapes.get("sinks"), dtypes.get("sinks"), b, h)
    _check_bounds(shapes, dtypes, sq)
    scale = _validate_scale(softmax_scale, d)  # names softmax_scale, as the user does
    return window, (0.0 if softmax_scale is None else scale)


def _check_sinks(shape, dtype, b, h):
    if shape is None:
        return
    shape = tuple(shape)
    ok = (len(shape) == 1 and shape == (h,)) or (len(shape) == 2 and shape == (b, h)) or \
         (len(shape) == 3 and shape[:2] == (b, h) and shape[2] >= 1)
    if not ok:
        raise ValueError(f"sinks must have shape ({h},) [heads], ({b}, {h}) [batch, heads] or ({b}, {h}, "
                         f"num_sinks) [batch, heads, num_sinks], got {shape}")
    if dtype not in ("float32", "bfloat16"):
        raise TypeError(f"sinks must be float32 or bfloat16, got {dtype}")


def _check_bounds(shapes, dtypes, sq):
    given = [name for name in ("bound_min", "bound_max") if shapes.get(name) is not None]
    if len(given) == 1:
        raise ValueError(f"bound_min and bound_max must be given together, got only {given[0]}")
    for name in given:
        if tuple(shapes[name]) != (sq,):
            raise ValueError(f"{name} must have shape ({sq},) [seq of q], got {tuple(shapes[name])}")
        if dtypes[name] != "float32":
            raise TypeError(f"{name} must be float32, got {dtypes[name]}")


def neuron_sinks(sinks: Optional[np.ndarray], b: int) -> Optional[np.ndarray]:
    """Sinks ``[heads]`` as a ``[batch, heads]`` view (stride 0 over the batch); others unchanged."""
    if sinks is None or sinks.ndim != 1:
        return sinks
    return np.broadcast_to(sinks, (b, sinks.shape[0]))


def _options(sinks, bound_min, bound_max, causal, window, softmax_scale, dropout):
    dropout_p, seed, seed_offset = dropout
    return dict(sinks_ref=sinks, bound_min=bound_min, bound_max=bound_max, use_causal_mask=bool(causal),
                mixed_precision=True, softmax_scale=float(softmax_scale), sliding_window=int(window),
                dropout_p=float(dropout_p), seed=seed, seed_offset=int(seed_offset))


def host_forward(qn, kn, vn, sinks, bound_min, bound_max, causal, window, softmax_scale, layout,
                 dropout=(0.0, None, 0)):
    """numbafa's forward on Neuron-layout arrays: ``o`` ``[b, h, d, s]``, lse ``[b, h, s]`` (float32).

    bf16 accumulates in float32 (``mixed_precision=True``). Errors name the
    user's arguments, shapes given in ``layout``. ``dropout``: ``(dropout_p,
    seed, seed_offset)`` as numbafa takes them.
    """
    options = _options(sinks, bound_min, bound_max, causal, window, softmax_scale, dropout)
    try:
        return attention_fwd(qn, kn, vn, lse_layout="natural", **options)
    except (TypeError, ValueError):
        _raise_named(lambda: validate_fwd_inputs(qn, kn, vn, **options, names=NAMES, layout=layout))
        raise


def host_backward(qn, kn, vn, on, don, lse, sinks, bound_min, bound_max, causal, window, softmax_scale,
                  layout, dropout=(0.0, None, 0)):
    """numbafa's backward on Neuron-layout arrays: ``dq, dk, dv`` ``[b, h, d, s]`` (+ dsinks)."""
    options = _options(sinks, bound_min, bound_max, causal, window, softmax_scale, dropout)
    try:
        return attention_bwd(qn, kn, vn, on, don, lse, **options)
    except (TypeError, ValueError):
        _raise_named(lambda: validate_bwd_inputs(qn, kn, vn, on, don, lse, **options, names=NAMES,
                                                 layout=layout))
        raise


def _raise_named(check):
    """Run numbafa's checks again with the user's names; raise their error, if any."""
    try:
        check()
    except (TypeError, ValueError) as named:
        raise named from None

