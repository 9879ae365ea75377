"""Public entry points: the Neuron kernel's signature, run by the execution core (:mod:`numbafa.pipeline.core`)."""

from __future__ import annotations

import numpy as np

from .pipeline import core
from .kernels.dropout import drop_rows, make_dropout
from .kernels.mask import TilePos
from .checks.options import KERNEL_CALLER, AttentionOptions, scalar_key
from .checks.validation import validate_dropout

__all__ = ["attention_fwd", "attention_bwd", "dropout_mask"]

#: The most elements :func:`dropout_mask` materialises (1 GiB of bools).
MAX_MASK_ELEMENTS = 2 ** 30


def attention_fwd(q_ref, k_ref, v_ref, sinks_ref=None, bound_min=None, bound_max=None,
                  use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None, lse_layout="neuron", dropout_p=0.0, seed=None, seed_offset=0,
                  bias=None, alibi_slopes=None, softcap=None):
    """Flash-attention forward producing ``o`` and the ``lse`` the backward consumes.

    An online-softmax kernel over K tiles of 512 keys: the score matrix is
    never materialised. Arguments are those of :func:`attention_bwd` (same
    layout, dtypes, masks, packing bounds, sinks, scale and window).

    Parameters
    ----------
    q_ref : ndarray ``[bs, nheads, d_head, seqlen_q]``, float32, ``ml_dtypes.bfloat16``, float16 or float64
    k_ref : ndarray ``[bs, nheads_kv, d_head, seqlen_k]``, same dtype
    v_ref : ndarray ``[bs, nheads_kv, d_head_v, seqlen_k]``, same dtype (``d_head_v`` may differ
        from ``d_head``)
    sinks_ref : ``[nheads]``, ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``, optional
        Sink logits: extra softmax columns in the denominator, no value.
    bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale, sliding_window
        As in :func:`attention_bwd`.
    lse_layout : {"neuron", "natural"}
        ``"neuron"`` (default): lse ``[bs, nheads, 128, seqlen_q // 128]``
        with ``lse[b, h, p, t]`` the LSE of row ``t * 128 + p`` (needs
        ``seqlen_q % 128 == 0``); ``"natural"``: ``[bs, nheads, seqlen_q]``.
    dropout_p, seed, seed_offset
        Attention dropout, as in :func:`attention_bwd`: ``o = (P * Z / (1 -
        dropout_p)) V``; ``lse`` is that of the undropped softmax. Pass the
        same three values to the backward.
    bias, alibi_slopes, softcap
        Score variants, as in :func:`attention_bwd` (pass the same to the backward).

    Returns
    -------
    o : ``[bs, nheads, d_head_v, seqlen_q]`` in the inputs' dtype
    lse : float32 (float64 for float64 inputs) in ``lse_layout``. A row that attends to nothing (no key
        and no sink) has ``o = 0`` and ``lse = +inf``.

    Notes
    -----
    bf16 inputs: Q*scale is rounded to bf16 at load, P is rounded to bf16
    before the PV matmul, the running max/sum and the O accumulator are
    float32 (``mixed_precision=True``) or bf16 (``False``), o is written in
    bf16. See ``docs/numerics.md``.
    """
    option_arrays = (sinks_ref, bound_min, bound_max, bias, alibi_slopes)
    done = core.remembered_fwd((q_ref, k_ref, v_ref), option_arrays, dropout_p,
                               scalar_key(use_causal_mask, mixed_precision, softmax_scale, sliding_window, dropout_p,
                                          seed, seed_offset, softcap), lse_layout)
    if done is not None:
        return done
    options = AttentionOptions(sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                               use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                               softmax_scale=softmax_scale, sliding_window=sliding_window, dropout_p=dropout_p,
                               seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                               softcap=softcap)
    return core.attention_fwd(q_ref, k_ref, v_ref, options, KERNEL_CALLER, lse_layout)


def attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, sinks_ref=None, bound_min=None,
                  bound_max=None, use_causal_mask=False, mixed_precision=False, softmax_scale=None,
                  sliding_window=None, dropout_p=0.0, seed=None, seed_offset=0, bias=None,
                  alibi_slopes=None, softcap=None, return_dbias=False):
    """Flash-attention backward, the CPU twin of Neuron's NKI ``attention_bwd``.

    Computes dQ, dK, dV (and dsinks) from the forward's output ``o`` and its
    log-sum-exp ``lse`` without materialising the score matrix: P is
    recomputed tile by tile as ``exp(S - lse)`` and the softmax-backward row
    sum is ``D = rowsum(o * dy)``.

    Parameters
    ----------
    q_ref : ndarray ``[bs, nheads, d_head, seqlen_q]``, float32, ``ml_dtypes.bfloat16``, float16 or float64
        Queries, head_dim before seq (the Neuron layout). bf16 and float16 run with the
        Neuron kernel's rounding points (docs/numerics.md); float64 in float64 throughout.
    k_ref : ndarray ``[bs, nheads_kv, d_head, seqlen_k]``, same dtype
        Keys; ``nheads % nheads_kv == 0`` (GQA / MQA).
    v_ref : ndarray ``[bs, nheads_kv, d_head_v, seqlen_k]``, same dtype
        Values. Their head dim ``d_head_v`` may differ from ``d_head`` (DeepSeek's
        MLA trains with 192 and 128); the default scale stays ``1 / sqrt(d_head)``.
    o_ref : ndarray ``[bs, nheads, d_head_v, seqlen_q]``, same dtype
        Forward output; used for ``D = rowsum(o * dy)``.
    dy_ref : ndarray ``[bs, nheads, d_head_v, seqlen_q]``, same dtype
        Upstream gradient dL/do.
    lse_ref : ndarray ``[bs, nheads, 128, seqlen_q // 128]`` or ``[bs, nheads, seqlen_q]``
        Log-sum-exp of each query row, from the forward: float32 (float64 for
        float64 inputs). The 4-D Neuron
        packing has ``lse[b, h, p, t]`` = LSE of row ``t * 128 + p``; the 3-D
        natural layout works for any seqlen_q. ``+inf`` marks a row that
        attends to nothing (its gradient is zero); NaN and ``-inf`` are errors.
    sinks_ref : ndarray ``[nheads]``, ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``, float32 or bf16, optional
        Attention-sink logits: extra softmax columns without a value (``[nheads]``: shared by
        the batch; its gradient is summed over the batch in float32).
    bound_min, bound_max : float32 ndarray ``[seqlen_q]``, optional (both or neither)
        Sequence packing: query ``i`` attends keys ``bound_min[i] <= j < bound_max[i]``.
        With ``use_causal_mask`` the bounds are clamped to ``j <= i`` (and to
        the window).
    use_causal_mask : bool
        Key ``j`` is visible to query ``i`` only if ``j <= i``; needs
        ``seqlen_q == seqlen_k``.
    mixed_precision : bool
        bf16 (float16) inputs: accumulate dQ/dK/dV and the softmax statistics in
        float32 (True) or in bf16 (fp16) as the hardware does without it (False).
        No effect on float32 and float64 inputs.
    softmax_scale : float, optional
        Score scale, default ``1 / sqrt(d_head)``; folded into Q at load. ``None``
        or ``0.0`` selects the default (the upstream NKI convention
        ``softmax_scale or 1 / sqrt(d_head)``); any other finite value is used as
        given, negative ones included. The kernels use it as a float32, so it
        must be finite in float32 (``|softmax_scale| <= 3.4028235e+38``).
    sliding_window : int, optional
        Causal only: query ``i`` sees keys ``i - w + 1 .. i`` with
        ``w = min(sliding_window, seqlen_k)``. ``None`` or any value ``< 1``
        (upstream passes ``-1``) means no window, with or without
        ``use_causal_mask``; a window ``>= 1`` needs ``use_causal_mask=True``.
    dropout_p : float in ``[0, 1)``
        Attention dropout (not in the Neuron kernel; docs/numerics.md): the
        forward used ``P~ = P * Z / (1 - dropout_p)`` with a keep mask ``Z``
        (keep probability ``1 - dropout_p``), and the gradients are exact
        for that forward. 0 (default): no dropout, outputs bit-identical to
        a call without it.
    seed : int in ``[0, 2**64)``, required when ``dropout_p > 0``
    seed_offset : int in ``[0, 2**64)``, default 0
        ``Z[b, h, i, j]`` is a pure function of ``(seed, seed_offset, b, h,
        i, j)`` (Philox-4x32-10, :func:`numbafa.dropout_mask`), so the
        backward draws exactly the forward's mask: pass the forward's values.
        Change ``seed_offset`` per training step for fresh masks.
    bias : ndarray broadcastable to ``[bs, nheads, seqlen_q, seqlen_k]``, optional
        An additive score bias (not in the Neuron kernel; docs/numerics.md, "Score
        variants"), in that layout whatever the tensors' layout: 1 to 4 dims, the last
        ``seqlen_k``, any of the others 1 (per-head ``[nheads, seqlen_q, seqlen_k]``,
        key padding ``[bs, 1, 1, seqlen_k]``, ...); float32 or the inputs' dtype. ``-inf``
        masks a score (a query left with no visible key and no sink gets ``o = 0``,
        ``lse = +inf`` and zero gradients, as under the other masks); NaN and ``+inf`` are errors.
        A float32 (float64 for float64 inputs) C-contiguous bias is read in place.
    alibi_slopes : float32 ndarray ``[nheads]`` or ``[bs, nheads]``, optional
        ALiBi, flash-attn's convention: score ``(i, j)`` gets ``-slope * |i + seqlen_k -
        seqlen_q - j|``, computed on the fly (no gradient for the slopes).
    softcap : float > 0, optional
        Logit soft cap (Gemma 2): the scaled scores become ``softcap * tanh(s /
        softcap)`` before the bias, ALiBi and the masks. ``None`` or 0: none.
    return_dbias : bool
        Also return the bias's gradient (needs ``bias``). Without it no ``seqlen_q x
        seqlen_k`` gradient is written.

    Returns
    -------
    dq : ``[bs, nheads, d_head, seqlen_q]``
    dk, dv : ``[bs, nheads_kv, d_head, seqlen_k]`` and ``[bs, nheads_kv, d_head_v, seqlen_k]``,
        summed over the q-heads of each KV head
    dsinks : shape and dtype of ``sinks_ref`` (only when sinks are given)
        ``dsinks = -sum_q p_sink * D``.
    dbias : shape and dtype of ``bias`` (only with ``return_dbias=True``)
        The gradient of the modified scores, summed over the bias's broadcast dims (in one
        fixed order: bit-identical for any thread count).

    Gradients come back in the inputs' dtype. Inputs are never modified.

    Raises
    ------
    TypeError
        A non-array input, a dtype other than float32/bf16/float16/float64, mixed dtypes, a
        non-bool flag, a non-real scale or a non-integer window.
    ValueError
        Inconsistent shapes, causal with ``seqlen_q != seqlen_k``, a window
        without causal, bounds given alone, non-finite inputs, NaN or
        ``-inf`` in ``lse_ref``, a ``softmax_scale`` that is not finite in float32,
        ``dropout_p`` outside ``[0, 1)`` (or NaN), a missing or negative ``seed``, a bias not
        broadcastable (or with NaN / ``+inf``), ALiBi slopes of another shape, a ``softcap``
        that is negative or NaN, ``return_dbias`` without a bias.
    """
    done = core.remembered_bwd((q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref),
                               (sinks_ref, bound_min, bound_max, bias, alibi_slopes), dropout_p,
                               scalar_key(use_causal_mask, mixed_precision, softmax_scale, sliding_window, dropout_p,
                                          seed, seed_offset, softcap, return_dbias))
    if done is not None:
        return done
    options = AttentionOptions(sinks=sinks_ref, bound_min=bound_min, bound_max=bound_max,
                               use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                               softmax_scale=softmax_scale, sliding_window=sliding_window, dropout_p=dropout_p,
                               seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                               softcap=softcap, return_dbias=return_dbias)
    return core.attention_bwd(q_ref, k_ref, v_ref, o_ref, dy_ref, lse_ref, options, KERNEL_CALLER)


def dropout_mask(bs, nheads, seqlen_q, seqlen_k, dropout_p, seed, seed_offset=0):
    """The attention-dropout keep mask the kernels draw, materialised (small shapes).

    ``Z[b, h, i, j]`` is True where query ``i`` of q-head ``h`` in batch
    ``b`` keeps key ``j``. It is a pure function of ``(seed, seed_offset, b,
    h, i, j)``: Philox-4x32-10 (docs/numerics.md, "Dropout"), with keep
    probability ``1 - dropout_p``. :func:`attention_fwd` and
    :func:`attention_bwd` with the same ``dropout_p``, ``seed`` and
    ``seed_offset`` use ``P * Z / (1 - dropout_p)`` for every shape, tiling
    and thread count; the mask does not depend on ``d_head``, the mask
    options or the dtype.

    Parameters
    ----------
    bs, nheads, seqlen_q, seqlen_k : int >= 0
        Batch, q-heads (not KV heads) and sequence lengths.
    dropout_p : float in ``[0, 1)``
    seed, seed_offset : int in ``[0, 2**64)``

    Returns
    -------
    bool ndarray ``[bs, nheads, seqlen_q, seqlen_k]`` (all True for ``dropout_p = 0``)

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_bwd` for the dropout arguments; negative sizes;
        more than ``2**30`` elements.
    """
    dims = {"bs": bs, "nheads": nheads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    for name, value in dims.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    size = int(bs) * int(nheads) * int(seqlen_q) * int(seqlen_k)
    if size > MAX_MASK_ELEMENTS:
        raise ValueError(f"dropout_mask materialises bs * nheads * seqlen_q * seqlen_k elements, at most "
                         f"{MAX_MASK_ELEMENTS}, got {size}")
    opts = validate_dropout(dropout_p, seed, seed_offset)
    out = np.ones((bs, nheads, seqlen_q, seqlen_k), dtype=bool)
    dropout = make_dropout(opts["dropout_p"], opts["seed"], opts["seed_offset"])
    if dropout is None:
        return out
    tile = np.empty((seqlen_q, seqlen_k), dtype=np.float32)
    for b in range(bs):
        for h in range(nheads):
            tile[:] = 1.0
            drop_rows(tile, TilePos(batch=b, q_head=h, q0=0, k0=0), dropout, False)   # the forward's own code path
            out[b, h] = tile != 0
    return out
