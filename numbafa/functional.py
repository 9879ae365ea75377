"""A functional attention for NumPy training loops.

    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bshd")
    ...                                   # loss, dL/do
    dq, dk, dv = ctx.backward(do)         # (+ dsinks when sinks were given)

The context keeps what the backward needs -- q, k, v, o, lse and the
options -- and nothing quadratic in the sequence length (never P).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .api import attention_bwd, attention_fwd
from .layout import LAYOUTS, from_neuron, to_neuron

__all__ = ["attention", "AttentionContext"]


@dataclass(frozen=True)
class AttentionContext:
    """What :func:`attention` saved for the backward.

    Attributes
    ----------
    q, k, v, o : ndarray
        Neuron-layout views ``[bs, heads, head_dim, seq]`` of the inputs and the output.
    lse : float32 ndarray ``[bs, nheads, seqlen_q]``
    options : dict
        Keyword arguments shared by forward and backward (sinks, bounds, mask, scale, ...).
    layout : str
        Layout of the caller's arrays, used for ``do`` and the gradients.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    lse: np.ndarray
    options: dict = field(default_factory=dict)
    layout: str = "bshd"

    def backward(self, do):
        """Gradients of the loss with respect to q, k, v (and sinks).

        Parameters
        ----------
        do : ndarray, the shape and dtype of ``o`` in the caller's layout
            dL/do.

        Returns
        -------
        dq, dk, dv : arrays in the caller's layout and dtype (dk/dv summed over
            the q-heads sharing a KV head)
        dsinks : shape and dtype of the sinks (only when sinks were given)
        """
        if not isinstance(do, np.ndarray):
            raise TypeError(f"do must be a numpy.ndarray, got {type(do).__name__}")
        expected = from_neuron(self.o, self.layout).shape
        if do.shape != expected:
            raise ValueError(f"do must have the shape of o {expected}, got {do.shape}")
        grads = attention_bwd(self.q, self.k, self.v, self.o, to_neuron(do, self.layout), self.lse,
                              **self.options)
        return tuple(from_neuron(g, self.layout) for g in grads[:3]) + tuple(grads[3:])


def attention(q, k, v, sinks=None, bound_min=None, bound_max=None, use_causal_mask=False,
              mixed_precision=False, softmax_scale=None, sliding_window=None, layout="bshd"):
    """Attention forward that returns a context for the backward.

    Parameters
    ----------
    q : ndarray ``[bs, seqlen_q, nheads, d_head]`` for ``layout="bshd"``
        (``[bs, nheads, seqlen_q, d_head]`` for ``"bhsd"``,
        ``[bs, nheads, d_head, seqlen_q]`` for ``"neuron"``); float32 or bf16.
    k, v : ndarray, likewise with ``nheads_kv`` and ``seqlen_k``
    sinks, bound_min, bound_max, use_causal_mask, mixed_precision, softmax_scale, sliding_window
        As in :func:`numbafa.attention_fwd`.
    layout : {"bshd", "bhsd", "neuron"}

    Returns
    -------
    o : ndarray in ``layout`` (a view of a Neuron-layout array), the inputs' dtype
    ctx : AttentionContext
        ``ctx.backward(do)`` gives the gradients.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    qn, kn, vn = (to_neuron(x, layout) for x in (q, k, v))
    options = dict(sinks_ref=sinks, bound_min=bound_min, bound_max=bound_max,
                   use_causal_mask=use_causal_mask, mixed_precision=mixed_precision,
                   softmax_scale=softmax_scale, sliding_window=sliding_window)
    o, lse = attention_fwd(qn, kn, vn, lse_layout="natural", **options)
    return from_neuron(o, layout), AttentionContext(qn, kn, vn, o, lse, options, layout)
