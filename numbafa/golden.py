"""Golden references: textbook attention forward and backward in float64 NumPy.

This module is the yardstick the kernels are tested against, so it is written
to be *obviously* right rather than fast:

* everything is computed in float64 from the raw inputs (bf16 inputs are
  widened exactly);
* the score matrix ``S`` and the probabilities ``P`` are materialised for one
  (batch, head) at a time: memory is O(seqlen_q * seqlen_k) and time is
  O(seqlen_q * seqlen_k * d_head) per head -- use it on test-sized problems;
* the backward recomputes the forward from q/k/v (like the upstream torch
  golden, ``o_ref`` and ``lse_ref`` are accepted only to match the kernel's
  signature) and uses the textbook softmax backward
  ``dS = P * (dP - rowsum(P * dP))``, not the kernel's ``rowsum(O * dO)``;
* masked scores are ``-inf`` (not the kernel's float32 minimum); a query row
  that attends to nothing has ``o = 0``, ``lse = +inf`` and zero gradient;
* attention dropout materialises its keep mask (:func:`keep_mask`) with a
  Philox-4x32-10 of its own, in NumPy, and differentiates the dropped
  forward ``O = (P * Z / (1 - p)) V`` as written;
* the score variants (docs/numerics.md, "Score variants") are the definition written
  out: ``s = softcap * tanh(s / softcap)``, plus the bias broadcast to the full
  ``[bs, nheads, seqlen_q, seqlen_k]`` and ALiBi's ``-slope * |i + seqlen_k - seqlen_q - j|``,
  then the masks; the backward multiplies the softmax's dS by ``1 - tanh^2`` and sums
  it over the bias's broadcast dims for ``dbias``.

The numerics golden :func:`attention_bwd_rounded` is the same backward
computed the kernel's way: float32, rounded to bf16 at every point where the
Neuron kernel writes a bf16 tile (docs/numerics.md, "The rounding points"),
and nothing else. Citations ``attention_bwd.py:NNN`` are line numbers of
``nkilib/core/attention/attention_bwd.py`` in neuronx_cc 2.24.5133.0+58f8de22.
How far another faithful implementation may stray from it (the tolerance of
the bf16 tests) is the tests' business: ``tests/_budget.py`` computes it from
the tiles an ``Observer`` is shown.

It shares no code with :mod:`numbafa.kernels`, nor with the API's input checks
(``numbafa.checks``): it checks its inputs itself, as strictly (floating arrays of
consistent shapes, integer windows and seeds, options in range), with a ``TypeError`` or
``ValueError`` naming the argument as the function spells it (``q`` in the forward,
``q_ref`` in the backwards).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np

__all__ = ["attention_fwd", "attention_bwd", "attention_bwd_rounded", "allowed_mask", "keep_mask",
           "ROUNDING_POINTS"]


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


# -- input checks: the golden's own, sharing nothing with numbafa.checks ------------------------

def _float_array(x, name):
    """``x`` as an array of a floating dtype (float16, bfloat16, float32, float64), else TypeError."""
    a = np.asarray(x)
    if not (a.dtype.kind == "f" or a.dtype.name == "bfloat16"):
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 array, got dtype {a.dtype}")
    return a


def _shape_is(a, name, expected, what):
    """ValueError naming ``name`` unless ``a.shape == expected`` (``what`` spells the dims)."""
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {tuple(a.shape)}")


def _checked(names, q, k, v, dy, sinks, options):
    """Check a golden call's arrays (``names``: the names of q, k, v, dy, sinks as the caller
    passed them) and its ``options`` (a dict: bound_min, bound_max, softmax_scale, sliding_window,
    dropout_p, seed, keep, bias, alibi_slopes, softcap); return ``(bs, nheads, d_head, seqlen_q)``.
    TypeError for a wrong type or dtype, ValueError for a wrong shape or value."""
    qn, kn, vn, dyn, sn = names
    q, k, v = (_float_array(a, n) for a, n in ((q, qn), (k, kn), (v, vn)))
    if q.ndim != 4:
        raise ValueError(f"{qn} must be 4-D [bs, nheads, d_head, seqlen_q], got shape {q.shape}")
    bs, nheads, d_head, seqlen_q = q.shape
    if k.ndim != 4 or k.shape[0] != bs or k.shape[2] != d_head:
        raise ValueError(f"{kn} must be 4-D [bs, nheads_kv, d_head, seqlen_k] with bs = {bs} and d_head = {d_head} "
                         f"(from {qn}), got shape {k.shape}")
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}, {qn}.shape[1]) must be a multiple of nheads_kv ({nheads_kv}, "
                         f"{kn}.shape[1])")
    if v.ndim != 4 or (v.shape[0], v.shape[1], v.shape[3]) != (bs, nheads_kv, seqlen_k):
        raise ValueError(f"{vn} must be 4-D [bs, nheads_kv, d_head_v, seqlen_k] = [{bs}, {nheads_kv}, *, {seqlen_k}] "
                         f"(from {qn} and {kn}), got shape {v.shape}")
    d_head_v = v.shape[2]
    if dy is not None:
        _shape_is(_float_array(dy, dyn), dyn, (bs, nheads, d_head_v, seqlen_q), "[bs, nheads, d_head_v, seqlen_q]")
    if sinks is not None:
        s = _float_array(sinks, sn)
        if s.shape != (nheads,) and (s.ndim not in (2, 3) or s.shape[:2] != (bs, nheads)):
            raise ValueError(f"{sn} must have shape [nheads], [bs, nheads] or [bs, nheads, num_sinks] with "
                             f"[bs, nheads] = [{bs}, {nheads}], got {s.shape}")
    _check_options(options, (bs, nheads, seqlen_q, seqlen_k))
    return bs, nheads, d_head, seqlen_q


#: The backwards' names of q, k, v, dy and sinks (the kernels' signature).
_BWD_NAMES = ("q_ref", "k_ref", "v_ref", "dy_ref", "sinks_ref")


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x):
    return _is_int(x) or isinstance(x, (float, np.floating))


def _check_options(options, scores):
    """:func:`_checked`'s ``options``, for scores ``[bs, nheads, seqlen_q, seqlen_k]``."""
    opt = {**dict.fromkeys(("bound_min", "bound_max", "softmax_scale", "sliding_window", "seed", "keep", "bias",
                            "alibi_slopes", "softcap")), "dropout_p": 0.0, **options}
    if (opt["bound_min"] is None) != (opt["bound_max"] is None):
        raise ValueError("bound_min and bound_max must be given together")
    for name in ("bound_min", "bound_max"):
        if opt[name] is not None:
            b = np.asarray(opt[name])
            if b.dtype.kind not in "iuf":
                raise TypeError(f"{name} must be a real array (the kernels take float32), got dtype {b.dtype}")
            _shape_is(b, name, scores[2:3], "[seqlen_q]")
    for name in ("softmax_scale", "softcap"):
        if opt[name] is not None and not _is_real(opt[name]):
            raise TypeError(f"{name} must be a real number or None, got {type(opt[name]).__name__} {opt[name]!r}")
    if opt["softcap"] is not None and opt["softcap"] < 0:
        raise ValueError(f"softcap must be >= 0 (0 or None: none), got {opt['softcap']}")
    window = opt["sliding_window"]
    if window is not None and not _is_int(window):
        raise TypeError(f"sliding_window must be an int or None (< 1, e.g. -1: no window), got "
                        f"{type(window).__name__} {window!r}")
    dropout_p = opt["dropout_p"]
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p and opt["keep"] is not None:
        _shape_is(np.asarray(opt["keep"]), "keep", scores, "[bs, nheads, seqlen_q, seqlen_k]")
    elif dropout_p and not (_is_int(opt["seed"]) and opt["seed"] >= 0):
        raise TypeError(f"seed must be an int >= 0 with dropout_p > 0 (or pass keep), got {opt['seed']!r}")
    for name, shape, what in (("bias", scores, "[bs, nheads, seqlen_q, seqlen_k]"),
                              ("alibi_slopes", scores[:2], "[bs, nheads]")):
        if opt[name] is None:
            continue
        a = _float_array(opt[name], name)
        try:
            ok = a.ndim <= len(shape) and np.broadcast_shapes(a.shape, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must broadcast to {what} = {shape}, got shape {a.shape}")


def _check_counts(**counts):
    """Each of ``counts`` an int >= 0 (a size, an index, a seed or an offset)."""
    for name, x in counts.items():
        if not _is_int(x):
            raise TypeError(f"{name} must be an int >= 0, got {type(x).__name__} {x!r}")
        if x < 0:
            raise ValueError(f"{name} must be >= 0, got {x}")


def allowed_mask(seqlen_q, seqlen_k, use_causal_mask=False, sliding_window=None,
                 bound_min=None, bound_max=None):
    """Boolean ``[seqlen_q, seqlen_k]`` matrix: True where query i may attend key j.

    Causal keeps ``j <= i``; a window ``w`` (causal only, capped at seqlen_k)
    also requires ``j >= i - w + 1``. With packing bounds, the row bounds are
    first clamped by causal (``bound_max[i] <= i + 1``) and window
    (``bound_min[i] >= i - w + 1``), then ``bound_min[i] <= j < bound_max[i]``.
    Bad arguments raise ``TypeError``/``ValueError`` naming them.
    """
    _check_counts(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    _check_options(dict(bound_min=bound_min, bound_max=bound_max, sliding_window=sliding_window),
                   (1, 1, seqlen_q, seqlen_k))
    i = np.arange(seqlen_q, dtype=np.float64)[:, None]
    j = np.arange(seqlen_k, dtype=np.float64)[None, :]
    # Upstream convention: None or any value < 1 (e.g. -1) means no window.
    window = min(int(sliding_window), seqlen_k) if sliding_window is not None and sliding_window >= 1 else 0
    if bound_min is not None:
        lo = np.asarray(bound_min, dtype=np.float64)[:, None]
        hi = np.asarray(bound_max, dtype=np.float64)[:, None]
        if use_causal_mask:
            hi = np.minimum(hi, i + 1)
            if window:
                lo = np.maximum(lo, i - window + 1)
        return (j >= lo) & (j < hi)
    allowed = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if use_causal_mask:
        allowed &= j <= i
        if window:
            allowed &= j >= i - window + 1
    return allowed


def philox(counter, key, rounds=10):
    """Philox-4x32 (Salmon et al., SC 2011) on NumPy arrays.

    ``counter``: four uint64 arrays (32-bit words, broadcastable), ``key``:
    two; returns four uint64 arrays. Each round bumps the key first (from the
    second round on), then multiplies words 0 and 2 by the Philox constants
    and mixes the high halves with the other words and the key.
    """
    mask = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) for x in counter]
    k = [np.uint64(key[0]), np.uint64(key[1])]
    for r in range(rounds):
        if r:
            k = [(k[0] + np.uint64(0x9E3779B9)) & mask, (k[1] + np.uint64(0xBB67AE85)) & mask]
        hi_lo_0 = c[0] * np.uint64(0xD2511F53)
        hi_lo_1 = c[2] * np.uint64(0xCD9E8D57)
        c = [(hi_lo_1 >> np.uint64(32)) ^ c[1] ^ k[0], hi_lo_1 & mask,
             (hi_lo_0 >> np.uint64(32)) ^ c[3] ^ k[1], hi_lo_0 & mask]
    return c


def keep_mask(bs, nheads, seqlen_q, seqlen_k, dropout_p, seed, seed_offset=0, first_row=0):
    """The dropout keep mask ``Z``, bool ``[bs, nheads, seqlen_q, seqlen_k]`` (True: kept).

    ``first_row``: the query index of the first row (for a block of rows).

    The spec (docs/numerics.md, "Dropout"): the call key is the first two
    words of Philox(counter = (offset low, offset high, 0, 0), key = (seed
    low, seed high)); element ``(b, h, i, j)`` takes word ``(j % 64) // 16``
    of Philox(counter = ((j // 64) * 16 + j % 16, i, h, b), call key) and is
    kept when that word is at least ``round(dropout_p * 2**32)``. Bad arguments raise
    ``TypeError``/``ValueError`` naming them (``seed`` and ``seed_offset`` below ``2**64``).
    """
    _check_counts(bs=bs, nheads=nheads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, seed=seed, seed_offset=seed_offset,
                  first_row=first_row)
    _check_options(dict(dropout_p=dropout_p, seed=seed), (bs, nheads, seqlen_q, seqlen_k))
    for name, x in (("seed", seed), ("seed_offset", seed_offset)):
        if x >= 2 ** 64:
            raise ValueError(f"{name} must be < 2**64, got {x}")
    lo32 = 0xFFFFFFFF
    words = philox([seed_offset & lo32, seed_offset >> 32, 0, 0], [seed & lo32, seed >> 32])
    call_key = (int(words[0]), int(words[1]))
    threshold = np.uint64(min(int(round(dropout_p * 2.0 ** 32)), 2 ** 32))
    b, h, i, j = np.meshgrid(np.arange(bs), np.arange(nheads), first_row + np.arange(seqlen_q),
                             np.arange(seqlen_k), indexing="ij")
    words = philox([(j // 64) * 16 + j % 16, i, h, b], call_key)
    which = (j % 64) // 16
    word = np.choose(which, words) if words[0].size else words[0]
    return word >= threshold


def _dropout_multipliers(shape, dropout_p, seed, seed_offset, keep, dtype):
    """``Z / (1 - p)`` as ``dtype``, ``shape = [bs, nheads, seqlen_q, seqlen_k]`` (None without
    dropout); ``Z`` is ``keep`` if given, else :func:`keep_mask` of the seed and offset."""
    if not dropout_p:
        return None
    z = keep_mask(*shape, dropout_p, seed, seed_offset) if keep is None else np.asarray(keep, bool)
    return z * dtype(1.0 / (1.0 - dropout_p))


#: The score variants of one golden call, float64 (:func:`_variants`): ``softcap`` (0: none),
#: ``extra`` (bias plus ALiBi, ``[bs, nheads, seqlen_q, seqlen_k]``, or None), ``bias_shape``.
Variants = namedtuple("Variants", ["softcap", "extra", "bias_shape"])


def _variants(bias, alibi_slopes, softcap, shape, dtype=np.float64):
    """:data:`Variants` in ``dtype`` for scores of ``shape = [bs, nheads, seqlen_q, seqlen_k]``."""
    bs, nheads, seqlen_q, seqlen_k = shape
    extra = None
    if bias is not None:
        extra = np.broadcast_to(np.asarray(bias).astype(dtype), shape)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes).astype(dtype), (bs, nheads))
        i = np.arange(seqlen_q)[:, None]
        j = np.arange(seqlen_k)[None, :]
        dist = np.abs(i + seqlen_k - seqlen_q - j).astype(dtype)
        alibi = -(slopes[:, :, None, None] * dist)
        extra = alibi if extra is None else extra + alibi
    return Variants(float(softcap or 0.0), extra, None if bias is None else np.shape(bias))


def _modified(scores, variants, b, h):
    """Scores of head ``(b, h)`` after the soft cap, bias and ALiBi; and ``tanh(s / softcap)`` (None
    without a soft cap)."""
    t = None
    if variants.softcap:
        t = np.tanh(scores / variants.softcap)
        scores = variants.softcap * t
    if variants.extra is not None:
        scores = scores + variants.extra[b, h]
    return scores, t


def _sum_to_shape(full, shape):
    """``full`` ``[bs, nheads, seqlen_q, seqlen_k]`` summed over the dims ``shape`` broadcasts."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(4) if shape4[a] == 1 and full.shape[a] != 1)
    return full.sum(axis=axes, keepdims=True).reshape(shape)


def _sinks3(sinks, bs, nheads, dtype=np.float64):
    """Sinks as ``dtype`` ``[bs, nheads, num_sinks]`` (num_sinks may be 0; ``[nheads]`` sinks are
    shared by the batch)."""
    if sinks is None:
        return np.zeros((bs, nheads, 0), dtype)
    s = np.asarray(sinks).astype(dtype)
    if s.ndim == 1:
        s = np.broadcast_to(s, (bs, nheads))
    return s.reshape(bs, nheads, -1)


def _dsinks_shaped(dsinks, sinks):
    """dsinks ``[bs, nheads, num_sinks]`` in the shape of ``sinks``: summed over the batch (in
    dsinks' dtype) for ``[nheads]`` sinks, which the batch shares."""
    if np.ndim(sinks) == 1:
        dsinks = dsinks.sum(axis=0)
    return dsinks.reshape(np.shape(sinks))


def _probabilities(scores, sink_logits):
    """Softmax over the key columns and the sink columns of one head.

    Returns ``(p_keys, p_sinks, lse)``; rows with nothing to attend get zero
    probabilities and ``lse = +inf``.
    """
    full = np.concatenate([scores, np.broadcast_to(sink_logits, (scores.shape[0], sink_logits.size))], axis=1)
    row_max = full.max(axis=1, keepdims=True)
    empty = ~np.isfinite(row_max[:, 0])
    row_max[empty] = 0.0
    e = np.exp(full - row_max)
    denom = e.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        p = np.where(empty[:, None], 0.0, e / np.where(empty[:, None], 1.0, denom))
        lse = np.where(empty, np.inf, row_max[:, 0] + np.log(denom[:, 0]))
    nk = scores.shape[1]
    return p[:, :nk], p[:, nk:], lse


def _head_probabilities(qh, kh, scale, allowed, sink_logits, variants=None, index=(0, 0)):
    """Scores ``(q*scale)^T k`` of one head, the score variants, masked, then softmax:
    ``(p_keys, p_sinks, lse, tanh)`` (``tanh`` of the soft cap, or None)."""
    scores = (qh * scale).T @ kh  # [seqlen_q, seqlen_k]
    t = None
    if variants is not None:
        scores, t = _modified(scores, variants, *index)
    scores = np.where(allowed, scores, -np.inf)
    return _probabilities(scores, sink_logits) + (t,)


def _setup(q, k, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window):
    q64, k64 = _f64(q), _f64(k)
    bs, nheads, d_head, seqlen_q = q64.shape
    nheads_kv, seqlen_k = k64.shape[1], k64.shape[3]
    # Upstream convention: softmax_scale or 1/sqrt(d), so None and 0.0 select the default.
    scale = 1.0 / np.sqrt(d_head) if not softmax_scale else float(softmax_scale)
    allowed = allowed_mask(seqlen_q, seqlen_k, use_causal_mask, sliding_window, bound_min, bound_max)
    return q64, k64, scale, allowed, _sinks3(sinks, bs, nheads), nheads // nheads_kv


def attention_fwd(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
                  softmax_scale=None, sliding_window=None, lse_layout="natural", dropout_p=0.0,
                  seed=None, seed_offset=0, keep=None, bias=None, alibi_slopes=None, softcap=None):
    """Textbook attention forward in float64.

    Parameters
    ----------
    q : array ``[bs, nheads, d_head, seqlen_q]``
    k : array ``[bs, nheads_kv, d_head, seqlen_k]``
    v : array ``[bs, nheads_kv, d_head_v, seqlen_k]`` (``d_head_v`` may differ from ``d_head``)
    sinks : array ``[nheads]`` (shared by the batch), ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``, optional
        Sink logits: extra softmax columns with no value.
    bound_min, bound_max : arrays ``[seqlen_q]``, optional
        Packing bounds: query i attends keys ``bound_min[i] <= j < bound_max[i]``.
    lse_layout : {"natural", "neuron"}
        ``natural``: lse ``[bs, nheads, seqlen_q]``; ``neuron``:
        ``[bs, nheads, 128, seqlen_q // 128]`` with ``lse[b, h, p, t]`` the
        LSE of row ``t * 128 + p``.
    dropout_p, seed, seed_offset
        Attention dropout: ``o = (P * Z / (1 - dropout_p)) V`` with ``Z`` from
        :func:`keep_mask`; lse is that of the undropped softmax.
    keep : bool array ``[bs, nheads, seqlen_q, seqlen_k]``, optional
        ``Z`` given explicitly (with ``dropout_p > 0``) instead of drawn from ``seed``.
    bias, alibi_slopes, softcap
        The score variants, as :func:`numbafa.attention_bwd` takes them.

    Returns
    -------
    o : float64 ``[bs, nheads, d_head_v, seqlen_q]``
    lse : float64, in ``lse_layout``
    """
    seqlen_q = _checked(("q", "k", "v", None, "sinks"), q, k, v, None, sinks, dict(
        bound_min=bound_min, bound_max=bound_max, softmax_scale=softmax_scale, sliding_window=sliding_window,
        dropout_p=dropout_p, seed=seed, keep=keep, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap))[3]
    if lse_layout not in ("natural", "neuron"):
        raise ValueError(f"lse_layout must be 'natural' or 'neuron', got {lse_layout!r}")
    if lse_layout == "neuron" and seqlen_q % 128:
        raise ValueError(f"lse_layout='neuron' needs seqlen_q (q.shape[3]) to be a multiple of 128, got {seqlen_q}")
    q64, k64, scale, allowed, sink3, n_rep = _setup(
        q, k, sinks, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window)
    v64 = _f64(v)
    bs, nheads, _, seqlen_q = q64.shape
    o = np.zeros((bs, nheads, v64.shape[2], seqlen_q))
    lse = np.zeros((bs, nheads, seqlen_q))
    mult = _dropout_multipliers((bs, nheads, seqlen_q, k64.shape[3]), dropout_p, seed, seed_offset,
                                keep, np.float64)
    variants = _variants(bias, alibi_slopes, softcap, (bs, nheads, seqlen_q, k64.shape[3]))
    for b in range(bs):
        for h in range(nheads):
            p, _, lse[b, h], _ = _head_probabilities(q64[b, h], k64[b, h // n_rep], scale, allowed, sink3[b, h],
                                                     variants, (b, h))
            o[b, h] = v64[b, h // n_rep] @ (p if mult is None else p * mult[b, h]).T
    if lse_layout == "neuron":
        lse = lse.reshape(bs, nheads, seqlen_q // 128, 128).transpose(0, 1, 3, 2)
    return o, lse


def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0, keep=None, bias=None,
                  alibi_slopes=None, softcap=None, return_dbias=False):
    """Textbook attention backward in float64, with the kernel's signature.

    ``o_ref``, ``lse_ref`` and ``mixed_precision`` are accepted for signature
    compatibility and ignored: the forward is recomputed from q/k/v in float64.
    With dropout the forward is ``O = P~ V``, ``P~ = P * M``, ``M = Z / (1 -
    p)``, so by the chain rule ``dV = P~^T dO`` and ``dP = (dO V^T) * M``,
    then the softmax backward of P as without dropout. ``keep``: as in
    :func:`attention_fwd`. Score variants: the softmax backward gives dS of the
    modified scores, which is dbias (summed to the bias's shape); the soft cap multiplies
    it by ``1 - tanh^2`` for dQ and dK.

    Returns
    -------
    dq : float64 ``[bs, nheads, d_head, seqlen_q]``
    dk, dv : float64 ``[bs, nheads_kv, d_head, seqlen_k]``, ``[bs, nheads_kv, d_head_v, seqlen_k]``
        (summed over the q-heads sharing each KV head)
    dsinks : float64, shape of ``sinks_ref`` (only when sinks are given; ``[nheads]`` sinks: summed
        over the batch)
    dbias : float64, shape of ``bias`` (only with ``return_dbias``)
    """
    del o_ref, lse_ref, mixed_precision
    _checked(_BWD_NAMES, q_ref, k_ref, v_ref, dy_ref, sinks_ref, dict(
        bound_min=bound_min, bound_max=bound_max, softmax_scale=softmax_scale, sliding_window=sliding_window,
        dropout_p=dropout_p, seed=seed, keep=keep, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap))
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    q64, k64, scale, allowed, sink3, n_rep = _setup(
        q_ref, k_ref, sinks_ref, bound_min, bound_max, use_causal_mask, softmax_scale, sliding_window)
    v64, dy64 = _f64(v_ref), _f64(dy_ref)
    bs, nheads, d_head, seqlen_q = q64.shape
    dq = np.zeros_like(q64)
    dk = np.zeros_like(k64)
    dv = np.zeros_like(v64)
    dsinks = np.zeros_like(sink3)
    mult = _dropout_multipliers((bs, nheads, seqlen_q, k64.shape[3]), dropout_p, seed, seed_offset,
                                keep, np.float64)
    variants = _variants(bias, alibi_slopes, softcap, (bs, nheads, seqlen_q, k64.shape[3]))
    dbias = np.zeros((bs, nheads, seqlen_q, k64.shape[3])) if return_dbias else None
    for b in range(bs):
        for h in range(nheads):
            hk = h // n_rep
            p, p_sink, _, t = _head_probabilities(q64[b, h], k64[b, hk], scale, allowed, sink3[b, h],
                                                  variants, (b, h))
            dp = dy64[b, h].T @ v64[b, hk]                       # [seqlen_q, seqlen_k]
            p_dv = p
            if mult is not None:  # dropout: dP = (dO V^T) * M, and dV takes P~ = P * M
                dp = dp * mult[b, h]
                p_dv = p * mult[b, h]
            # Textbook softmax backward over all columns; sink columns have dP = 0.
            row_dot = (p * dp).sum(axis=1, keepdims=True)
            ds = p * (dp - row_dot)
            ds_sink = p_sink * (0.0 - row_dot)
            if dbias is not None:
                dbias[b, h] = ds
            if t is not None:   # the soft cap: d(softcap * tanh(s / softcap)) / ds = 1 - tanh^2
                ds = ds * (1.0 - t * t)
            dq[b, h] = (ds @ k64[b, hk].T).T * scale
            dk[b, hk] += (q64[b, h] * scale) @ ds
            dv[b, hk] += dy64[b, h] @ p_dv
            dsinks[b, h] = ds_sink.sum(axis=0)
    out = (dq, dk, dv)
    if sinks_ref is not None:
        out += (_dsinks_shaped(dsinks, sinks_ref),)
    if return_dbias:
        out += (_sum_to_shape(dbias, np.shape(bias)),)
    return out


# ---------------------------------------------------------------------------
# The numerics golden: the kernel's rounding points, in plain NumPy.
# ---------------------------------------------------------------------------

#: Rounding points of the numerics golden (docs/numerics.md, "The rounding points"), by name.
ROUNDING_POINTS = (
    "q_load",      # Q * softmax_scale written in kernel_dtype
    "neg_lse",     # -LSE bias written in mixed_dtype (attention_bwd.py:1149-1160)
    "d_product",   # each O * dO product in kernel_dtype
    "d_partial",   # per-head-dim-tile partial of D in mixed_dtype
    "d_total",     # D in mixed_dtype
    "p",           # P in kernel_dtype
    "ds",          # dS in kernel_dtype
    "acc",         # dQ/dK/dV accumulators in mixed_dtype after each addition
    "dq_section",  # dQ written in kernel_dtype between KV sections
    "sinks",       # the sink logits, p_sink, the dsinks accumulator and its sum in mixed_dtype
                   # (attention_bwd.py:1361-1372, 1397-1398)
)

#: The rounding points written in kernel_dtype; the others are written in mixed_dtype.
_KERNEL_DTYPE_POINTS = frozenset({"q_load", "d_product", "p", "ds", "dq_section"})


def _bf16_round(x):
    """float32 -> nearest bf16 (ties to even) -> float32, by ml_dtypes' own cast."""
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _fp16_round(x):
    """float32 -> nearest float16 (ties to even; fp16 subnormals, inf beyond 65504) -> float32, by
    NumPy's own cast."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class Rounding:
    """Which tiles :func:`attention_bwd_rounded` rounds to the kernel dtype (bf16 or fp16).

    ``bf16``: the inputs are bf16 (kernel_dtype is bf16); ``fp16``: they are
    float16 (kernel_dtype is fp16); ``mixed_precision``: mixed_dtype is
    float32 (else kernel_dtype); ``disable``: rounding points skipped. Calling
    it with ``(x, point)`` gives ``x`` as the kernel writes it at ``point``:
    rounded to the kernel dtype, or float32.
    """

    bf16: bool
    mixed_precision: bool
    disable: frozenset = frozenset()
    fp16: bool = False

    @property
    def narrow(self) -> bool:
        """Whether kernel_dtype is narrower than float32 (bf16 or fp16 inputs)."""
        return self.bf16 or self.fp16

    def rounds(self, point):
        """Whether a tile written at ``point`` is rounded to the kernel dtype."""
        narrow = self.narrow and (point in _KERNEL_DTYPE_POINTS or not self.mixed_precision)
        return narrow and point not in self.disable

    def round(self, x):
        """``x`` rounded to the kernel dtype (float32 values)."""
        return _fp16_round(x) if self.fp16 else _bf16_round(x)

    def __call__(self, x, point):
        return self.round(x) if self.rounds(point) else np.asarray(x, np.float32)


#: The constants of one :func:`attention_bwd_rounded` call: ``scale`` (float32), ``d_tile`` and
#: ``section_len`` (the Neuron tiling), ``allowed`` (:func:`allowed_mask`), ``n_rep`` (q-heads per
#: KV head), ``rounding`` (:class:`Rounding`), ``softcap`` (0: none) and ``bias_shape`` (the bias
#: as 4-D, or None).
Setup = namedtuple("Setup", ["scale", "d_tile", "section_len", "allowed", "n_rep", "rounding", "softcap",
                             "bias_shape"])

#: The tiles of one q-head, float32 as written (queries are rows): ``qs`` Q_s ``[rows, d]``,
#: ``kt``/``vt`` K, V ``[keys, d]``, ``dyt`` dO ``[rows, d]``, ``neg_lse`` and ``d_sum``
#: ``[rows]``, ``prod`` the O * dO products ``[rows, d]``; ``[rows, keys]``: ``t = S + (-LSE)``,
#: ``p_pre = exp(t)`` and its rounding ``p``, ``mult`` the dropout multipliers M (None without
#: dropout), ``dp`` (dO V^T, times M with dropout), ``m = dP - D``, ``ds_pre = m * P`` and its
#: rounding ``ds``, ``p_dv`` the P (P~ = P * M with dropout) that dV takes.
#: Score variants (docs/numerics.md): ``s`` the float32 scores before them (``Q_s K^T``), ``tanh``
#: the soft cap's ``fl(tanh(fl(s * (1 / softcap))))`` (None without), ``steps`` the float32 scores
#: after each later step (the soft cap's product, ``+ bias``, ``- ALiBi``: those present),
#: ``ds_mod`` the rounded dS of the modified scores (dbias's terms; ``ds`` is it times
#: ``1 - tanh^2``, rounded, with a soft cap).
HeadTiles = namedtuple("HeadTiles", ["qs", "kt", "vt", "dyt", "neg_lse", "prod", "d_sum", "t", "p_pre",
                                     "p", "mult", "dp", "m", "ds_pre", "ds", "p_dv", "s", "tanh", "steps", "ds_mod"])

#: The float32 inputs of :func:`attention_bwd_rounded`: lse natural, sinks ``[bs, nheads,
#: num_sinks]``, mult the dropout multipliers ``[bs, nheads, seqlen_q, seqlen_k]`` or None;
#: the score variants: ``bias`` (float32, 4-D, broadcastable) or None, ``slopes`` (float32
#: ``[bs, nheads]``) or None, ``softcap`` (0: none).
_Inputs = namedtuple("_Inputs", ["q", "k", "v", "o", "dy", "lse", "sinks", "mult", "bias", "slopes", "softcap"])


def _modified_f32(scores, ins, b, h):
    """The score variants in float32, each step rounded as the kernel writes it:
    ``(scores, tanh, steps)`` (:data:`HeadTiles`)."""
    f32 = np.float32
    t = None
    steps = []
    if ins.softcap:
        t = np.tanh(scores * f32(1.0 / ins.softcap))
        scores = f32(ins.softcap) * t
        steps.append(scores)
    if ins.bias is not None:
        scores = scores + ins.bias[b if ins.bias.shape[0] > 1 else 0, h if ins.bias.shape[1] > 1 else 0]
        steps.append(scores)
    if ins.slopes is not None:
        seqlen_q, seqlen_k = scores.shape
        dist = np.abs(np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q - np.arange(seqlen_k)[None, :])
        scores = scores - ins.slopes[b, h] * dist.astype(f32)
        steps.append(scores)
    return scores.astype(f32), t, steps


class Observer:
    """What :func:`attention_bwd_rounded` shows of its work (``observer=``); this one ignores it.

    Tests derive the error budgets of their tolerances from the tiles
    (``tests/_budget.py``); nothing the golden returns depends on an observer.
    Arrays passed may be views: copy what you keep.
    """

    def start(self, setup):
        """Called once, first, with the call's :data:`Setup`."""

    def head(self, index, tiles):
        """The :data:`HeadTiles` of q-head ``index = (b, h)``, before its accumulations."""

    def accumulated(self, output, index, value, point):
        """An accumulator of ``output`` was just written at ``point`` (rounded there if
        ``setup.rounding.rounds(point)``): "dq" (``index = (b, h)``, ``value`` dQ^T
        ``[rows, d]``), "dk" or "dv" (``(b, hk)``, ``[keys, d]``) or "dsinks" (``(b, h, i_sink)``,
        the lanes of one Q tile, 128 or fewer)."""

    def sink(self, index, logit, lanes):
        """dsinks ``index = (b, h, i_sink)``: the logit as loaded and the 128 lanes before their sum."""


def _neuron_tiling(d_head, d_head_v):
    """(d_tile, section_len) of the Neuron kernel: D's head-dim tiles (over ``d_head_v``) of
    <= 128, KV sections of ``8192 // power_of_2(#head-dim tiles)`` keys (>= 512), the tiles
    counted for the wider of the two head dims (one head dim upstream)."""
    n_dv = -(-d_head_v // 128)
    d_tile = -(-d_head_v // n_dv)
    n_d = -(-max(d_head, d_head_v) // 128)
    pow2 = 1 << (n_d - 1).bit_length()
    return d_tile, max(512, (8192 // pow2) // 512 * 512)


def _head_tiles(ins, setup, b, h):
    """Steps 1-4 (the pseudocode at attention_bwd.py:113-139) of q-head ``h`` of batch ``b``: :data:`HeadTiles`."""
    f32 = np.float32
    rnd = setup.rounding
    hk = h // setup.n_rep
    kt, vt = ins.k[b, hk].T, ins.v[b, hk].T                      # [seqlen_k, d]
    qs = rnd(ins.q[b, h].T * setup.scale, "q_load")              # [seqlen_q, d]
    dyt = ins.dy[b, h].T
    neg_lse = rnd(-ins.lse[b, h], "neg_lse")
    prod = rnd(ins.o[b, h].T * dyt, "d_product")
    parts = [rnd(prod[:, i:i + setup.d_tile].sum(axis=1, dtype=f32), "d_partial")
             for i in range(0, prod.shape[1], setup.d_tile)]
    d_sum = rnd(np.sum(parts, axis=0, dtype=f32), "d_total")
    s = qs @ kt.T
    scores, tanh, steps = _modified_f32(s, ins, b, h)
    scores = np.where(setup.allowed, scores, f32(-3.4028234663852886e38))
    t = scores + neg_lse[:, None]
    p_pre = np.exp(t)
    p = rnd(p_pre, "p")
    mult = None if ins.mult is None else ins.mult[b, h]
    dp = dyt @ vt.T
    if mult is not None:  # dropout: dP * M (an fp32 product), and P~ = P * M for dV
        dp = dp * mult
    m = dp - d_sum[:, None]
    ds_pre = m * p
    ds_mod = rnd(ds_pre, "ds")
    ds = ds_mod if tanh is None else rnd(ds_mod * (f32(1.0) - tanh * tanh), "ds")
    p_dv = p if mult is None else rnd(p * mult, "p")
    return HeadTiles(qs=qs, kt=kt, vt=vt, dyt=dyt, neg_lse=neg_lse, prod=prod, d_sum=d_sum, t=t, p_pre=p_pre, p=p,
                     mult=mult, dp=dp, m=m, ds_pre=ds_pre, ds=ds, p_dv=p_dv, s=s, tanh=tanh, steps=steps, ds_mod=ds_mod)


def _dq_of_head(tiles, setup, observer, index):
    """dQ^T ``[rows, d]`` of one q-head: one rounded addition per K tile (512 keys), and dQ
    written in kernel_dtype (and reloaded) at the end of each KV section but the last."""
    rnd = setup.rounding
    seqlen_k = tiles.kt.shape[0]
    acc = np.zeros(tiles.qs.shape, np.float32)
    for s0 in range(0, seqlen_k, setup.section_len):
        if s0 > 0:
            acc = rnd(acc, "dq_section")
            observer.accumulated("dq", index, acc, "dq_section")
        for t0 in range(s0, min(s0 + setup.section_len, seqlen_k), 512):
            t1 = min(t0 + 512, s0 + setup.section_len, seqlen_k)
            acc = rnd((tiles.ds[:, t0:t1] @ tiles.kt[t0:t1]) * setup.scale + acc, "acc")
            observer.accumulated("dq", index, acc, "acc")
    return acc


def _add_dk_dv(dk_acc, dv_acc, tiles, setup, observer, index):
    """dK^T, dV^T ``[keys, d]`` plus one q-head's share: one rounded addition per Q group of
    512 rows (per K tile, which holds different keys, so all keys are updated at once)."""
    rnd = setup.rounding
    for g0 in range(0, tiles.qs.shape[0], 512):
        g1 = min(g0 + 512, tiles.qs.shape[0])
        dv_acc = rnd(dv_acc + tiles.p_dv[g0:g1].T @ tiles.dyt[g0:g1], "acc")
        observer.accumulated("dv", index, dv_acc, "acc")
        dk_acc = rnd(dk_acc + tiles.ds[g0:g1].T @ tiles.qs[g0:g1], "acc")
        observer.accumulated("dk", index, dk_acc, "acc")
    return dk_acc, dv_acc


def _dsinks_of_head(sinks, tiles, setup, observer, index):
    """dsinks ``[num_sinks]`` of one q-head (attention_bwd.py:1355-1405): each logit loaded into a
    mixed_dtype tile, one accumulator lane per row of a 128-row Q tile taking
    ``lane - p_sink * D``, the lanes summed into a mixed_dtype tile."""
    f32 = np.float32
    rnd = setup.rounding
    seqlen_q = tiles.d_sum.shape[0]
    out = np.zeros(len(sinks), f32)
    for i_sink, logit in enumerate(sinks):
        sink = rnd(logit, "sinks")
        lanes = np.zeros(128, f32)
        for t0 in range(0, seqlen_q, 128):
            n = min(128, seqlen_q - t0)
            p_sink = rnd(np.exp(sink + tiles.neg_lse[t0:t0 + n]), "sinks")
            lanes[:n] = rnd(lanes[:n] - p_sink * tiles.d_sum[t0:t0 + n], "sinks")
            observer.accumulated("dsinks", index + (i_sink,), lanes[:n], "sinks")
        observer.sink(index + (i_sink,), sink, lanes)
        out[i_sink] = rnd(lanes.sum(dtype=f32), "sinks")
    return out


def attention_bwd_rounded(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                          bound_max=None, use_causal_mask=False, mixed_precision=False,
                          softmax_scale=None, sliding_window=None, dropout_p=0.0, seed=None,
                          seed_offset=0, bias=None, alibi_slopes=None, softcap=None, return_dbias=False,
                          disable=(), observer=None):
    """The kernel's numerics in materialising NumPy: the numerics golden.

    Unlike :func:`attention_bwd`, this uses ``o_ref`` and ``lse_ref`` (the
    kernel does) and computes in float32, rounding to bf16 exactly where the
    Neuron kernel writes a bf16 tile (docs/numerics.md, "The rounding
    points"); float16 inputs get the same rounding points, to fp16. Tiling
    appears only where it sets the order of rounded
    additions: dQ is accumulated K tile (512 keys) by K tile and rounded to
    the output dtype at the end of each KV section; dK/dV are accumulated Q
    group (512 rows) by Q group, q-head by q-head; the sink accumulator has
    one lane per row of a 128-row Q tile. Matmuls are float32 (bf16- or
    fp16-valued operands: exact products, float32 accumulation). Full score matrices are
    materialised per head.

    Parameters
    ----------
    q_ref ... seed_offset
        As :func:`numbafa.attention_bwd`; ``lse_ref`` natural or Neuron layout.
        Dropout: ``M = Z * float32(1 / (1 - p))``; ``dS = (dP * M - D) * P``
        (the fp32 product, then the fused op) and ``P~ = P * M`` written in
        kernel_dtype for dV. Score variants: on the float32 score tile, each step rounded to
        float32 (``s * (1 / softcap)``, its tanh, ``softcap * tanh``, ``+ bias``,
        ``- slope * distance``); dS of the modified scores rounded to kernel_dtype (dbias's
        terms, summed in float32), then times ``1 - tanh^2`` and rounded again.
    disable : iterable of str
        Names from :data:`ROUNDING_POINTS` to skip (test-only: proves each
        rounding point changes the result).
    observer : ``numbafa.golden.Observer``, optional
        Test-only: shown the call's constants, each q-head's tiles, every
        write of an accumulator and the sink lanes (the tests' error budgets
        are computed from them). It changes nothing in the result.

    Returns
    -------
    dq, dk, dv[, dsinks][, dbias] : float32 arrays holding values of the output dtype
        (bf16 or fp16 values for bf16 or float16 inputs; dsinks in the dtype of ``sinks_ref``,
        dbias in that of ``bias``).
    """
    import ml_dtypes

    unknown = set(disable) - set(ROUNDING_POINTS)
    if unknown:
        raise ValueError(f"disable must name rounding points from {ROUNDING_POINTS}, got {sorted(unknown)}")
    bs, nheads, _, seqlen_q = _checked(_BWD_NAMES, q_ref, k_ref, v_ref, dy_ref, sinks_ref, dict(
        bound_min=bound_min, bound_max=bound_max, softmax_scale=softmax_scale, sliding_window=sliding_window,
        dropout_p=dropout_p, seed=seed, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap))
    _shape_is(_float_array(o_ref, "o_ref"), "o_ref", np.shape(dy_ref), "dy_ref's shape")
    lse_shape = np.shape(lse_ref)
    if lse_shape != (bs, nheads, seqlen_q) and (seqlen_q % 128 or lse_shape != (bs, nheads, 128, seqlen_q // 128)):
        raise ValueError(f"lse_ref must have shape [bs, nheads, seqlen_q] = {(bs, nheads, seqlen_q)} or, for seqlen_q "
                         f"a multiple of 128, the Neuron layout [bs, nheads, 128, seqlen_q // 128], got {lse_shape}")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    is_bf16 = np.asarray(q_ref).dtype == ml_dtypes.bfloat16
    is_fp16 = np.asarray(q_ref).dtype == np.float16
    f32 = np.float32
    q, k, v, o, dy = (np.asarray(a).astype(f32) for a in (q_ref, k_ref, v_ref, o_ref, dy_ref))
    bs, nheads, d_head, seqlen_q = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[3]
    n_rep = nheads // nheads_kv
    lse = np.asarray(lse_ref, dtype=f32)
    if lse.ndim == 4:
        lse = lse.transpose(0, 1, 3, 2).reshape(bs, nheads, seqlen_q)
    sink3 = _sinks3(sinks_ref, bs, nheads, f32)
    mult = _dropout_multipliers((bs, nheads, seqlen_q, seqlen_k), dropout_p, seed, seed_offset, None, f32)
    bias32 = None if bias is None else np.asarray(bias).astype(f32).reshape((1,) * (4 - np.ndim(bias))
                                                                         + np.shape(bias))
    slopes = None if alibi_slopes is None else \
        np.broadcast_to(np.asarray(alibi_slopes).astype(f32), (bs, nheads))
    ins = _Inputs(q=q, k=k, v=v, o=o, dy=dy, lse=lse, sinks=sink3, mult=mult, bias=bias32, slopes=slopes,
                  softcap=float(softcap or 0.0))
    d_tile, section_len = _neuron_tiling(d_head, v.shape[2])
    setup = Setup(scale=f32(1.0 / np.sqrt(d_head) if not softmax_scale else softmax_scale), d_tile=d_tile,
                  section_len=section_len,
                  allowed=allowed_mask(seqlen_q, seqlen_k, use_causal_mask, sliding_window, bound_min, bound_max),
                  n_rep=n_rep, rounding=Rounding(bool(is_bf16), bool(mixed_precision), frozenset(disable),
                                                 bool(is_fp16)),
                  softcap=ins.softcap, bias_shape=None if bias32 is None else bias32.shape)
    observer = Observer() if observer is None else observer
    observer.start(setup)

    dq = np.zeros((bs, nheads, d_head, seqlen_q), f32)
    dk = np.zeros((bs, nheads_kv, d_head, seqlen_k), f32)
    dv = np.zeros((bs, nheads_kv, v.shape[2], seqlen_k), f32)
    dsinks = np.zeros(sink3.shape, f32)
    dbias = None if not return_dbias else np.zeros(bias32.shape, f32)
    for b in range(bs):
        for hk in range(nheads_kv):
            dk_acc = np.zeros((seqlen_k, d_head), f32)
            dv_acc = np.zeros((seqlen_k, v.shape[2]), f32)
            for h in range(hk * n_rep, (hk + 1) * n_rep):
                tiles = _head_tiles(ins, setup, b, h)
                observer.head((b, h), tiles)
                if dbias is not None:
                    _add_dbias(dbias, tiles.ds_mod, b, h)
                dq[b, h] = _dq_of_head(tiles, setup, observer, (b, h)).T
                dk_acc, dv_acc = _add_dk_dv(dk_acc, dv_acc, tiles, setup, observer, (b, hk))
                dsinks[b, h] = _dsinks_of_head(sink3[b, h], tiles, setup, observer, (b, h))
            dk[b, hk] = dk_acc.T
            dv[b, hk] = dv_acc.T
    if setup.rounding.narrow:  # outputs are written in the kernel dtype (not a point one can disable)
        dq, dk, dv = (setup.rounding.round(x) for x in (dq, dk, dv))
    out = (dq, dk, dv)
    if sinks_ref is not None:
        out += (_in_dtype_of(_dsinks_shaped(dsinks, sinks_ref), sinks_ref),)
    if dbias is not None:
        out += (_in_dtype_of(dbias, bias).reshape(np.shape(bias)),)
    return out


def _in_dtype_of(x, like):
    """float32 ``x`` rounded to the dtype of ``like`` (bf16 or fp16; float32 and float64: as is)."""
    import ml_dtypes

    dtype = np.asarray(like).dtype
    if dtype == ml_dtypes.bfloat16:
        return _bf16_round(x)
    return _fp16_round(x) if dtype == np.float16 else x


def _add_dbias(dbias, ds_mod, b, h):
    """dbias (float32, the bias's 4-D shape) plus q-head ``(b, h)``'s ``ds_mod`` ``[rows, keys]``,
    summed over the rows when the bias is shared by the queries (float32)."""
    slab = dbias[b if dbias.shape[0] > 1 else 0, h if dbias.shape[1] > 1 else 0]
    terms = ds_mod.sum(axis=0, dtype=np.float32, keepdims=True) if slab.shape[0] == 1 else ds_mod
    slab += terms
