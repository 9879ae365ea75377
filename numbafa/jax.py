"""numbafa from JAX: attention as a ``jax.custom_vjp`` over host callbacks.

    import numbafa.jax
    o = numbafa.jax.attention(q, k, v, causal=True, window=128, sinks=sinks)   # [b, s, h, d]
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

The forward and the backward each run numbafa on the host through
``jax.pure_callback`` (``vmap_method="broadcast_all"``); the custom VJP
saves q, k, v, o and the log-sum-exp, never anything quadratic in the
sequence length. It works under ``jax.jit``, ``jax.grad`` and
``jax.vmap`` (a vmapped call is one host call: the mapped axis is folded
into the batch, or looped over when the packing bounds differ along it).
float32, bfloat16 (``jnp.bfloat16`` *is* ``ml_dtypes.bfloat16``: the
arrays cross without conversion) and, under ``jax_enable_x64``, float64.

Arguments are checked from their shapes and dtypes when the function is
traced, so a bad call raises ``TypeError``/``ValueError`` at once, naming
your argument. Values (NaN/inf in ``q``, ``do``, ...) are checked on the host
when the callback runs; JAX reports such an error as a ``JaxRuntimeError``
whose message is numbafa's (``q must be finite, ...``).

This module imports ``jax``; ``import numbafa`` does not import it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .pipeline import frameworks as _frameworks
from .layout import cu_seqlens_to_bounds as _cu_seqlens_to_bounds
from .layout import from_neuron, to_neuron
from .checks.options import AttentionOptions

__all__ = ["attention", "cu_seqlens_to_bounds"]

#: How pure_callback treats jax.vmap: every argument gets the mapped axis in
#: front (materialised), so the callback folds it into numbafa's batch axis.
VMAP_METHOD = "broadcast_all"


def _dtype_name(x) -> str:
    return "bfloat16" if x.dtype == jnp.bfloat16 else str(x.dtype)


# ---------------------------------------------------------------------------
# Host side: NumPy arrays, possibly with leading vmap axes
# ---------------------------------------------------------------------------

def _fold(arrays, bounds, base_ndim, loop=False):
    """Fold the leading vmap axes of ``arrays`` into their batch axis.

    Returns ``(lead, calls)``: ``lead`` the vmap shape, ``calls`` a list of
    ``(arrays, bound_min, bound_max)`` to run, one call when the bounds are
    the same along the vmap axes, one per mapped element otherwise (and with ``loop``:
    score variants, whose bias or slopes may or may not carry the batch).
    """
    lead = arrays[0].shape[:arrays[0].ndim - base_ndim]
    if not lead:
        return lead, [(arrays, *bounds)]
    n = math.prod(lead)
    flat = [None if a is None else a.reshape((n,) + a.shape[len(lead):]) for a in arrays]
    bmin, bmax = (None if b is None else b.reshape(n, -1) for b in bounds)
    if not loop and (bmin is None or ((bmin == bmin[0]).all() and (bmax == bmax[0]).all())):
        merged = [None if a is None else a.reshape((-1,) + a.shape[2:]) for a in flat]
        return lead, [(merged, None if bmin is None else bmin[0], None if bmax is None else bmax[0])]
    return lead, [([None if a is None else a[i] for a in flat], None if bmin is None else bmin[i],
                   None if bmax is None else bmax[i]) for i in range(n)]


def _unfold(lead, results):
    """Per-output: concatenate the calls' batch axes, then restore the vmap axes."""
    if not lead:
        return results[0]
    out = []
    for parts in zip(*results):
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        out.append(whole.reshape(lead + (-1,) + whole.shape[1:]))
    return tuple(out)


def _optional(*arrays):
    return [None if a is None else np.asarray(a) for a in arrays]


def _offsets(words) -> list:
    """The dropout's seed offsets of a host call: ``words`` ``[..., 2]`` uint32 (low, high word),
    one pair per mapped element under ``jax.vmap``."""
    pairs = np.asarray(words, dtype=np.uint64).reshape(-1, 2)
    return [int(lo) | int(hi) << 32 for lo, hi in pairs]


def _host_calls(static, arrays, options):
    """``(lead, calls)`` of :func:`_fold` for a host call, each call with its seed offset: one
    call per mapped element when the score variants or the offsets differ along the vmap axes."""
    sinks, bound_min, bound_max, bias, slopes, offset_words = options
    offsets = _offsets(offset_words)
    loop = bias is not None or slopes is not None or len(set(offsets)) > 1
    lead, calls = _fold(arrays + _optional(sinks, bias, slopes), _optional(bound_min, bound_max), 4, loop=loop)
    return lead, [(*call, offsets[i if len(calls) > 1 else 0]) for i, call in enumerate(calls)]


def _host_fwd(static, q, k, v, *options):
    """The forward on the host; ``options`` the ``(sinks, bound_min, bound_max, bias, slopes,
    seed-offset words)``."""
    causal, window, scale, layout, softcap, dropout_p, seed = static
    lead, calls = _host_calls(static, [np.asarray(x) for x in (q, k, v)], options)
    results = []
    for (qa, ka, va, sa, ba, aa), bmin, bmax, offset in calls:
        options = _frameworks.host_options(sinks=sa, bound_min=bmin, bound_max=bmax, use_causal_mask=causal,
                                           softmax_scale=scale, sliding_window=window, dropout_p=dropout_p,
                                           seed=seed, seed_offset=offset, bias=ba, alibi_slopes=aa, softcap=softcap)
        o, lse = _frameworks.host_forward(to_neuron(qa, layout), to_neuron(ka, layout), to_neuron(va, layout),
                                          options, layout)
        results.append((from_neuron(o, layout), lse))
    return _unfold(lead, results)


def _host_bwd(static, q, k, v, o, do, lse, *options):
    """The backward on the host; ``options`` as :func:`_host_fwd`'s."""
    causal, window, scale, layout, softcap, dropout_p, seed = static
    lead, calls = _host_calls(static, [np.asarray(x) for x in (q, k, v, o, do, lse)], options)
    results = []
    for (qa, ka, va, oa, da, la, sa, ba, aa), bmin, bmax, offset in calls:
        neuron = tuple(to_neuron(x, layout) for x in (qa, ka, va, oa, da))
        options = _frameworks.host_options(sinks=sa, bound_min=bmin, bound_max=bmax, use_causal_mask=causal,
                                           softmax_scale=scale, sliding_window=window, dropout_p=dropout_p,
                                           seed=seed, seed_offset=offset, bias=ba, alibi_slopes=aa, softcap=softcap,
                                           return_dbias=ba is not None)
        grads = _frameworks.host_backward(neuron, la, options, layout)
        results.append(tuple(from_neuron(g, layout) for g in grads[:3]) + tuple(grads[3:]))
    return _unfold(lead, results)


# ---------------------------------------------------------------------------
# The custom VJP (sinks already [b, h] or [b, h, n])
# ---------------------------------------------------------------------------

def _lse_shape(q, layout):
    b, h, s = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    return jax.ShapeDtypeStruct((b, h, s), jnp.float64 if q.dtype == jnp.float64 else jnp.float32)


def _forward_call(static, q, k, v, options):
    shapes = (jax.ShapeDtypeStruct(q.shape[:-1] + v.shape[-1:], q.dtype), _lse_shape(q, static[3]))
    return jax.pure_callback(functools.partial(_host_fwd, static), shapes, q, k, v, *options,
                             vmap_method=VMAP_METHOD)


# options: (sinks, bound_min, bound_max, bias, alibi_slopes, seed-offset words), arrays or None
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, options):
    return _forward_call(static, q, k, v, options)[0]


def _attention_fwd(static, q, k, v, options):
    o, lse = _forward_call(static, q, k, v, options)
    return o, (q, k, v, o, lse, options)


def _attention_bwd(static, residuals, do):
    q, k, v, o, lse, options = residuals
    sinks, bound_min, bound_max, bias, slopes, offset_words = options
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    for x in (sinks, bias):   # the gradients the host returns after dq, dk, dv
        if x is not None:
            shapes += (jax.ShapeDtypeStruct(x.shape, x.dtype),)
    grads = list(jax.pure_callback(functools.partial(_host_bwd, static), shapes, q, k, v, o, do, lse, *options,
                                   vmap_method=VMAP_METHOD))
    zero = (lambda b: None if b is None else jnp.zeros_like(b))
    dsinks = grads.pop(3) if sinks is not None else None
    dbias = grads.pop(3) if bias is not None else None
    offset_zero = np.zeros(offset_words.shape, dtype=jax.dtypes.float0)   # an integer input's cotangent
    return tuple(grads[:3]) + ((dsinks, zero(bound_min), zero(bound_max), dbias, zero(slopes), offset_zero),)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------
# The user's function
# ---------------------------------------------------------------------------

def attention(q, k, v, *, causal=False, window=None, sinks=None, bound_min=None, bound_max=None,
              softmax_scale=None, layout="bshd", bias=None, alibi_slopes=None, softcap=None, dropout_p=0.0,
              seed=None, seed_offset=0):
    """Attention with numbafa's CPU kernels, differentiable with respect to q, k, v, sinks and bias.

    Parameters
    ----------
    q : array ``[batch, seq_q, heads, head_dim]`` for ``layout="bshd"`` (the default: JAX's
        convention, as ``jax.nn.dot_product_attention`` and Flax take it),
        ``[batch, heads, seq_q, head_dim]`` for ``"bhsd"``; float32, bfloat16, or float64 under
        ``jax_enable_x64`` (computed in float64: ``jax.test_util.check_grads`` works)
    k, v : arrays, likewise with ``heads_kv`` (``heads % heads_kv == 0``) and ``seq_k``; ``v``'s
        head dim (``head_dim_v``) may differ from ``head_dim`` (as DeepSeek's MLA: 192 and 128)
    causal : bool
        Key ``j`` is visible to query ``i`` only if ``j <= i`` (needs ``seq_q == seq_k``).
    window : int, optional
        Causal sliding window of ``window`` keys, the query's own included:
        ``jax.nn.dot_product_attention(..., local_window_size=(window - 1, 0))``
        and flash-attn's ``window_size=(window - 1, 0)``. ``None`` or < 1: none.
    sinks : array ``[heads]``, ``[batch, heads]`` or ``[batch, heads, num_sinks]``, optional
        Attention-sink logits (float32 or bfloat16), differentiable.
    bound_min, bound_max : float32 arrays ``[seq_q]``, optional (both or neither)
        Sequence packing: query ``i`` attends keys ``bound_min[i] <= j < bound_max[i]``
        (see :func:`cu_seqlens_to_bounds`). Not differentiable (zero cotangent).
    softmax_scale : float, optional
        Default (``None`` or 0.0) ``1 / sqrt(head_dim)``.
    layout : {"bshd", "bhsd"}
        ``"bshd"`` by default, as JAX's own attention; ``numbafa.torch`` defaults to torch's ``"bhsd"``.
    bias : array broadcastable to ``[batch, heads, seq_q, seq_k]``, optional
        An additive score bias in that layout for either ``layout`` (``jax.nn.dot_product_attention``'s
        ``bias``; last dim ``seq_k``, any other may be 1), float32 or q's dtype; ``-inf`` masks.
        Differentiable: the backward always computes its gradient when a bias is given.
    alibi_slopes : float32 array ``[heads]`` or ``[batch, heads]``, optional
        ALiBi, flash-attn's convention (``-slope * |i + seq_k - seq_q - j|``); zero cotangent.
    softcap : float, optional (static)
        Logit soft cap: ``softcap * tanh(s / softcap)`` before the bias. ``None`` or 0: none.
    dropout_p : float in ``[0, 1)``, optional (static)
        Attention dropout, as :func:`numbafa.attention_fwd`'s: the same mask in the forward and
        the backward, a pure function of ``(seed, seed_offset, batch, head, query, key)``.
    seed : int in ``[0, 2**63)``, required when ``dropout_p > 0`` (static)
    seed_offset : int in ``[0, 2**63)``, or an integer JAX scalar (may be traced: a step
        counter under ``jax.jit`` gives a fresh mask per step without retracing), default 0

    Returns
    -------
    array of the shape of ``q`` with ``v``'s head dim, the dtype of ``q``

    Notes
    -----
    bfloat16 is computed with ``mixed_precision=True`` (bf16 operands,
    float32 accumulation). Static arguments (``causal``, ``window``,
    ``softmax_scale``, ``layout``, ``softcap``, ``dropout_p``, ``seed``) must be Python values, not
    traced arrays. Under ``jax.vmap`` with a bias, slopes or per-element seed offsets, the host
    runs one call per mapped element; otherwise the mapped axis is folded into the batch, so
    each mapped element's dropout mask is that of its place in the folded batch.

    Raises
    ------
    TypeError, ValueError
        At trace time, a bad argument named as you passed it, with the
        expected and the actual value.
    """
    named = (("q", q), ("k", k), ("v", v), ("sinks", sinks), ("bound_min", bound_min), ("bound_max", bound_max),
             ("bias", bias), ("alibi_slopes", alibi_slopes))
    for name, x in named:
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
    given = {name: (tuple(x.shape), _dtype_name(x)) for name, x in named if x is not None}
    offset_words = _offset_words(seed_offset)
    options = _frameworks.check_call(layout, given, AttentionOptions(
        use_causal_mask=causal, mixed_precision=True, softmax_scale=softmax_scale, sliding_window=window,
        softcap=softcap, dropout_p=dropout_p, seed=seed,
        seed_offset=seed_offset if isinstance(seed_offset, int) else 0))   # (a JAX scalar: its words)
    for name in ("seed", "seed_offset"):
        value = getattr(options, name)
        if value is not None and value >= 2 ** 63:
            raise ValueError(f"{name} must be in [0, 2**63), got {value}")
    if offset_words is None:
        offset_words = _offset_words(options.seed_offset)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.ndim == 1:  # [heads]: one float32 (float64) sum over the batch in the transpose of this broadcast
            acc = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
            sinks = jnp.broadcast_to(sinks.astype(acc), (q.shape[0], sinks.shape[0]))
    if bound_min is not None:
        bound_min, bound_max = jnp.asarray(bound_min), jnp.asarray(bound_max)
    bias, alibi_slopes = (None if x is None else jnp.asarray(x) for x in (bias, alibi_slopes))
    static = (options.use_causal_mask, options.sliding_window, options.softmax_scale or 0.0, layout, options.softcap,
              options.dropout_p, options.seed)
    return _attention(static, q, k, v, (sinks, bound_min, bound_max, bias, alibi_slopes, offset_words))


def _offset_words(seed_offset):
    """A seed offset as the ``uint32[2]`` (low, high word) the host calls take, or None for a Python
    int (checked by the options first). An integer JAX or NumPy scalar, traced or not, is its low
    word (int32 without ``jax_enable_x64``)."""
    if isinstance(seed_offset, int):
        if isinstance(seed_offset, bool) or not 0 <= seed_offset < 2 ** 63:
            return None
        return jnp.asarray([seed_offset & 0xFFFFFFFF, seed_offset >> 32], dtype=jnp.uint32)
    if not (hasattr(seed_offset, "dtype") and hasattr(seed_offset, "shape")):
        raise TypeError(f"seed_offset must be an int or an integer JAX scalar, got {type(seed_offset).__name__}")
    if seed_offset.shape != () or not jnp.issubdtype(seed_offset.dtype, jnp.integer):
        raise TypeError(f"seed_offset must be an int or an integer JAX scalar, got an array of shape "
                        f"{tuple(seed_offset.shape)} and dtype {seed_offset.dtype}")
    return jnp.stack([jnp.asarray(seed_offset).astype(jnp.uint32), jnp.uint32(0)])


def cu_seqlens_to_bounds(cu_seqlens, seqlen=None):
    """Packing bounds (float32 arrays ``[seqlen]``) from flash-attn's ``cu_seqlens``.

    As :func:`numbafa.layout.cu_seqlens_to_bounds`; ``cu_seqlens`` must be
    concrete (not traced): it fixes the mask.
    """
    return tuple(jnp.asarray(b) for b in _cu_seqlens_to_bounds(np.asarray(cu_seqlens), seqlen))
