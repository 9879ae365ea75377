"""A functional attention for NumPy training loops.

    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bshd")
    ...                                   # loss, dL/do
    dq, dk, dv = ctx.backward(do)         # (+ dsinks when sinks were given)
    dq, dk, dv, dbias = ctx.backward(do, return_dbias=True)   # with a bias

The context keeps what the backward needs -- q, k, v, o, lse and the
options -- and nothing quadratic in the sequence length (never P). It keeps
*views* of the caller's arrays, not copies, so it also keeps a CRC-32 of
each of them: an array changed in place between the forward and the
backward is reported instead of silently changing the gradients.

Errors name the caller's arguments (``q``, ``do``, ...) and give shapes in
the caller's layout: the execution core (:mod:`numbafa.core`) validates with
this module's :class:`~numbafa.options.Caller`.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

import numpy as np

from . import core
from .layout import LAYOUTS, from_neuron, to_neuron
from .options import AttentionOptions, Caller

__all__ = ["attention", "AttentionContext"]

#: The caller's names of the kernels' arguments, for the messages.
NAMES = {"q_ref": "q", "k_ref": "k", "v_ref": "v", "sinks_ref": "sinks", "o_ref": "o", "dy_ref": "do",
         "lse_ref": "ctx.lse"}


def _crc32(x: np.ndarray) -> int:
    """CRC-32 of the array's bytes in C order (a contiguous copy first if it is a strided view)."""
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


@dataclass(frozen=True)
class AttentionContext:
    """What :func:`attention` saved for the backward.

    Attributes
    ----------
    q, k, v, o : ndarray
        Neuron-layout views ``[bs, heads, head_dim, seq]`` of the inputs and the output.
    lse : float32 ndarray ``[bs, nheads, seqlen_q]``
    options : AttentionOptions
        The options shared by forward and backward (sinks, bounds, mask, scale, dropout, score
        variants), as given
        (the forward checked them; the backward checks them again with its own inputs).
    layout : str
        Layout of the caller's arrays, used for ``do`` and the gradients.
    checksums : dict
        CRC-32 of q, k, v, o (and sinks, bound_min, bound_max when given),
        taken by the forward; :meth:`backward` raises ``ValueError`` if one
        of these arrays changed since. Empty: no check.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    lse: np.ndarray
    options: AttentionOptions = field(default_factory=AttentionOptions)
    layout: str = "bshd"
    checksums: dict = field(default_factory=dict)

    def _watched(self) -> dict:
        """The arrays the checksums cover, by the caller's names, as the caller holds them."""
        arrays = {name: from_neuron(x, self.layout) for name, x in
                  (("q", self.q), ("k", self.k), ("v", self.v))}
        arrays["o"] = self.o  # ours, returned to the caller as a view
        for name, x in self.options.arrays().items():
            if x is not None:
                arrays[name] = x
        return arrays

    def _check_unchanged(self) -> None:
        arrays = self._watched()
        for name, expected in self.checksums.items():
            actual = _crc32(arrays[name])
            if actual != expected:
                raise ValueError(
                    f"{name} was modified in place after numbafa.attention() returned (CRC-32 "
                    f"0x{expected:08x} at the forward, 0x{actual:08x} now): the context keeps views of "
                    f"the forward's arrays, so the gradients would mix old and new values; pass a copy to "
                    f"attention() or call it again after the change")

    def backward(self, do, return_dbias=False):
        """Gradients of the loss with respect to q, k, v (and sinks, and the bias).

        Parameters
        ----------
        do : ndarray, the shape and dtype of ``o`` in the caller's layout
            dL/do.
        return_dbias : bool
            Also return the bias's gradient (the forward must have had a ``bias``).

        Returns
        -------
        dq, dk, dv : arrays in the caller's layout and dtype (dk/dv summed over
            the q-heads sharing a KV head)
        dsinks : shape and dtype of the sinks (only when sinks were given)
        dbias : shape and dtype of the bias (only with ``return_dbias``)

        Raises
        ------
        TypeError, ValueError
            A bad ``do`` (named ``do``), or an input of the forward (``q``,
            ``k``, ``v``, ``o``, ``sinks``, ``bound_min``, ``bound_max``)
            changed in place since the forward.
        """
        if not isinstance(do, np.ndarray):
            raise TypeError(f"do must be a numpy.ndarray, got {type(do).__name__}")
        expected = from_neuron(self.o, self.layout).shape
        if do.shape != expected:
            raise ValueError(f"do must have the shape of o {expected}, got {do.shape}")
        self._check_unchanged()
        don = to_neuron(do, self.layout, name="do")
        options = self.options if return_dbias is False else \
            dataclasses.replace(self.options, return_dbias=return_dbias)
        grads = core.attention_bwd(self.q, self.k, self.v, self.o, don, self.lse, options,
                                   Caller(NAMES, self.layout))
        return tuple(from_neuron(g, self.layout) for g in grads[:3]) + tuple(grads[3:])


def attention(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
              mixed_precision=False, softmax_scale=None, sliding_window=None, layout="bshd",
              dropout_p=0.0, seed=None, seed_offset=0, bias=None, alibi_slopes=None, softcap=None):
    """Attention forward that returns a context for the backward.

    Parameters
    ----------
    q : ndarray ``[bs, seqlen_q, nheads, d_head]`` for ``layout="bshd"``
        (``[bs, nheads, seqlen_q, d_head]`` for ``"bhsd"``,
        ``[bs, nheads, d_head, seqlen_q]`` for ``"neuron"``); float32 or bf16.
    k, v : ndarray, likewise with ``nheads_kv`` and ``seqlen_k``; ``v``'s head dim
        ``d_head_v`` may differ from ``d_head`` (``o`` and ``do`` carry it)
    sinks, bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale, sliding_window
        As in :func:`numbafa.attention_fwd`.
    layout : {"bshd", "bhsd", "neuron"}
    dropout_p, seed, seed_offset
        Attention dropout, as in :func:`numbafa.attention_bwd`; ``ctx.backward``
        draws the forward's mask again from the same seed and offset.
    bias, alibi_slopes, softcap
        Score variants, as in :func:`numbafa.attention_bwd`; the bias is
        ``[bs, nheads, seqlen_q, seqlen_k]`` (or broadcastable to it) whatever ``layout`` is.
        ``ctx.backward(do, return_dbias=True)`` adds its gradient.

    Returns
    -------
    o : ndarray in ``layout`` (a view of a Neuron-layout array), the inputs' dtype
    ctx : AttentionContext
        ``ctx.backward(do)`` gives the gradients. Do not change q, k, v, o,
        sinks, the bounds or the bias in place before it: it raises ``ValueError``.

    Raises
    ------
    TypeError, ValueError
        As :func:`numbafa.attention_fwd`, naming ``q``, ``k``, ``v``,
        ``sinks``, ... with shapes and axes in ``layout``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    qn, kn, vn = (to_neuron(x, layout, name=name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    caller = Caller(NAMES, layout)
    options = AttentionOptions(sinks, bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale,
                               sliding_window, dropout_p, seed, seed_offset, bias, alibi_slopes, softcap)
    o, lse = core.attention_fwd(qn, kn, vn, options, caller)   # checks the options (and the backward again)
    ctx = AttentionContext(qn, kn, vn, o, lse, options, layout)
    checksums = {name: _crc32(x) for name, x in ctx._watched().items()}
    return from_neuron(o, layout), dataclasses.replace(ctx, checksums=checksums)
