"""A functional attention for NumPy training loops.

    o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bshd")
    ...                                   # loss, dL/do
    dq, dk, dv = ctx.backward(do)         # (+ dsinks when sinks were given)
    dq, dk, dv, dbias = ctx.backward(do, return_dbias=True)   # with a bias

The context keeps what the backward needs -- q, k, v, o, lse and the
options -- and nothing quadratic in the sequence length (never P). It keeps
the caller's arrays, not copies, so it also keeps a fingerprint of each
(``fingerprint``): an array changed in place between the forward and the
backward is reported instead of silently changing the gradients.

The kernels run on the caller's arrays in their own layout (``bshd`` or
``bhsd``, C-contiguous: no copy; :mod:`numbafa.kernels.heads`), and ``o`` and the
gradients come back C-contiguous in it.

Errors name the caller's arguments (``q``, ``do``, ...) and give shapes in
the caller's layout: the execution core (:mod:`numbafa.pipeline.core`) validates with
this module's :class:`~numbafa.checks.options.Caller`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from .pipeline import core
from .compiler.jit import jit
from .layout import LAYOUTS, from_neuron, to_neuron
from .checks.options import AttentionOptions, Caller

__all__ = ["attention", "AttentionContext"]

#: The caller's names of the kernels' arguments, for the messages.
NAMES = {"q_ref": "q", "k_ref": "k", "v_ref": "v", "sinks_ref": "sinks", "o_ref": "o", "dy_ref": "do",
         "lse_ref": "ctx.lse"}


#: Arrays of more than :data:`FINGERPRINT_WHOLE` elements are fingerprinted by this many
#: elements: :data:`FINGERPRINT_RUNS` runs of consecutive elements, one in each of as many equal
#: stretches of the array (a run is one or two cache lines: few memory accesses).
FINGERPRINT_SAMPLES = 4096
FINGERPRINT_RUNS = 256
#: Arrays of at most this many elements are fingerprinted whole: every element (0.36 ns each on
#: Zen 3) costs less than placing the runs (~5 us), so a one-tile head's 8192 are hashed whole.
FINGERPRINT_WHOLE = 2 * FINGERPRINT_SAMPLES

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


#: The hash runs in four independent lanes, sample ``j`` in lane ``j % 4``, so that the multiply
#: chains overlap (a 1 MB float32 array, Zen 4: one chain 15.7 us in cache, 31 us from memory; four
#: lanes 8.7 and 22.5 us; eight fingerprints a training step). A sampled run fills the lanes evenly:
assert (FINGERPRINT_SAMPLES // FINGERPRINT_RUNS) % 4 == 0

_PRIME = np.uint64(0x100000001B3)


@jit(inline=True)
def _lanes(words, start, stop, h0, h1, h2, h3):
    """The four lanes after hashing ``words[start:stop]`` (``stop - start`` a multiple of 4)."""
    for j in range(start, stop, 4):
        h0 = (h0 ^ np.uint64(words[j])) * _PRIME
        h1 = (h1 ^ np.uint64(words[j + 1])) * _PRIME
        h2 = (h2 ^ np.uint64(words[j + 2])) * _PRIME
        h3 = (h3 ^ np.uint64(words[j + 3])) * _PRIME
    return h0, h1, h2, h3


@jit(entry=True)
def _fingerprint(words, runs, seed):
    """A 64-bit FNV-1a-style hash of elements of ``words`` and their positions: every element when
    ``runs`` is 0, else a run of ``FINGERPRINT_SAMPLES // runs`` elements at a pseudo-random
    place (splitmix64 of ``seed``) in each of ``runs`` equal stretches. Four lanes hash every
    fourth element each (:func:`_lanes`); they are combined at the end."""
    prime = _PRIME
    h0 = np.uint64(0xCBF29CE484222325)
    h1 = h0 ^ np.uint64(1)
    h2 = h0 ^ np.uint64(2)
    h3 = h0 ^ np.uint64(3)
    if runs == 0:
        full = words.size - words.size % 4
        h0, h1, h2, h3 = _lanes(words, 0, full, h0, h1, h2, h3)
        for j in range(full, words.size):
            h0 = (h0 ^ np.uint64(words[j])) * prime
    else:
        length = FINGERPRINT_SAMPLES // runs
        stretch = words.size // runs
        places = np.uint64(stretch - length + 1)
        for i in range(runs):
            z = np.uint64(seed) + np.uint64(i) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            start = i * stretch + np.int64((z ^ (z >> np.uint64(31))) % places)
            h0 = (h0 ^ np.uint64(start)) * prime
            h0, h1, h2, h3 = _lanes(words, start, start + length, h0, h1, h2, h3)
    h = ((h0 ^ h1) * prime ^ h2) * prime
    return (h ^ h3) * prime


def fingerprint(x: np.ndarray, seed: int) -> int:
    """A fingerprint of the values of ``x`` (their bit patterns, in C order): all of them for an
    array of at most :data:`FINGERPRINT_WHOLE` (``2 S``) elements, else ``S`` =
    :data:`FINGERPRINT_SAMPLES` of them: a run of
    ``S / R`` consecutive elements, placed at random by ``seed`` (each context draws its own),
    in each of ``R`` = :data:`FINGERPRINT_RUNS` equal stretches. O(S) work whatever the size.

    It detects for certain a change of a small array, or of any contiguous part of at least
    ``2 n / R`` elements of a large one (a new batch written into the same buffer, ``x *= 2``,
    an optimizer step); a change of a fraction ``f`` of scattered elements with probability
    about ``1 - (1 - f)**S`` (``f = 0.1 %``: 98 %); a single changed element of a large array
    with probability ``S / n``."""
    flat = x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)
    words = flat.view(_UINT[flat.itemsize])
    runs = 0 if flat.size <= FINGERPRINT_WHOLE else FINGERPRINT_RUNS
    return int(_fingerprint(words, runs, seed))


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
        ``fingerprint`` of q, k, v, o (and sinks, bound_min, bound_max, bias, alibi_slopes
        when given), taken by the forward; :meth:`backward` raises ``ValueError`` if one of
        these arrays changed since. Empty: no check.
    seed : int
        The fingerprints' random choice of samples (``fingerprint``).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    lse: np.ndarray
    options: AttentionOptions = field(default_factory=AttentionOptions)
    layout: str = "bshd"
    checksums: dict = field(default_factory=dict)
    seed: int = 0

    def _watched(self) -> dict:
        """The arrays the checksums cover, by the caller's names, as the caller holds them."""
        arrays = {name: from_neuron(x, self.layout) for name, x in
                  (("q", self.q), ("k", self.k), ("v", self.v))}
        arrays["o"] = from_neuron(self.o, self.layout)   # ours, returned to the caller
        for name, x in self.options.arrays().items():
            if x is not None:
                arrays[name] = x
        return arrays

    def _check_unchanged(self) -> None:
        arrays = self._watched()
        for name, expected in self.checksums.items():
            actual = fingerprint(arrays[name], self.seed)
            if actual != expected:
                raise ValueError(
                    f"{name} was modified in place after numbafa.attention() returned (fingerprint "
                    f"0x{expected:016x} at the forward, 0x{actual:016x} now): the context keeps the "
                    f"forward's arrays, not copies, so the gradients would mix old and new values; pass a copy "
                    f"to attention() or call it again after the change")

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
    options = AttentionOptions(sinks=sinks, bound_min=bound_min, bound_max=bound_max, use_causal_mask=use_causal_mask,
                               mixed_precision=mixed_precision, softmax_scale=softmax_scale,
                               sliding_window=sliding_window, dropout_p=dropout_p, seed=seed, seed_offset=seed_offset,
                               bias=bias, alibi_slopes=alibi_slopes, softcap=softcap)
    o, lse = core.attention_fwd(qn, kn, vn, options, caller)   # checks the options (and the backward again)
    seed = int.from_bytes(os.urandom(8), "little") >> 1   # (an int64)
    ctx = AttentionContext(q=qn, k=kn, v=vn, o=o, lse=lse, options=options, layout=layout, seed=seed)
    checksums = {name: fingerprint(x, seed) for name, x in ctx._watched().items()}
    return from_neuron(o, layout), dataclasses.replace(ctx, checksums=checksums)
