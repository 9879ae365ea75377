"""The options of one attention call, and how the caller spells its arguments.

:class:`AttentionOptions` is the one value every layer below the public
functions carries: built once from the user's keyword arguments by
:func:`numbafa.checks.validation.check_options` (which checks the scalar options),
completed by the array checks of :func:`numbafa.checks.validation.validate_fwd_inputs`
/ :func:`~numbafa.checks.validation.validate_bwd_inputs`. :class:`Caller` says how
the front end that was called names the arguments (``q`` or ``q_ref``,
``causal`` or ``use_causal_mask``) and which layout its 4-D arrays had, so
that every message speaks the caller's words.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping, Optional

import numpy as np

from ..layout import check_layout, from_neuron_perm

__all__ = ["AttentionOptions", "Caller", "KERNEL_CALLER", "scalar_key"]


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """Everything but the tensors of one forward or backward call.

    The scalar fields are checked and normalised (:func:`numbafa.checks.validation.check_options`);
    the arrays are the caller's, checked against the tensors' shapes later.

    Attributes
    ----------
    sinks : ndarray ``[nheads]``, ``[bs, nheads]`` or ``[bs, nheads, num_sinks]``, or None
    bound_min, bound_max : float32 ndarray ``[seqlen_q]``, or None (both or neither)
    use_causal_mask, mixed_precision : bool
    softmax_scale : float or None
        None: the default ``1 / sqrt(d_head)`` (the user's ``None`` or ``0.0``).
    sliding_window : int
        0: no window (the user's ``None`` or any value < 1); not yet capped at ``seqlen_k``.
    dropout_p : float in ``[0, 1)``
    seed, seed_offset : int in ``[0, 2**64)`` (seed 0 when there is no dropout)
    bias : ndarray broadcastable to ``[bs, nheads, seqlen_q, seqlen_k]``, or None
        An additive score bias (its last dim is ``seqlen_k``; any of the first three may be 1).
    alibi_slopes : float32 ndarray ``[nheads]`` or ``[bs, nheads]``, or None
    softcap : float
        0.0: no soft cap (the user's ``None`` or ``0``); else ``> 0``.
    return_dbias : bool
        Backward only: also return the bias's gradient.
    """

    sinks: Optional[np.ndarray] = None
    bound_min: Optional[np.ndarray] = None
    bound_max: Optional[np.ndarray] = None
    use_causal_mask: bool = False
    mixed_precision: bool = False
    softmax_scale: Optional[float] = None
    sliding_window: int = 0
    dropout_p: float = 0.0
    seed: int = 0
    seed_offset: int = 0
    bias: Optional[np.ndarray] = None
    alibi_slopes: Optional[np.ndarray] = None
    softcap: float = 0.0
    return_dbias: bool = False

    def as_kwargs(self) -> dict:
        """The options as :func:`numbafa.attention_fwd` / ``attention_bwd`` (and the goldens)
        take them: ``sinks_ref=...``, ``use_causal_mask=...``, ..."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs["sinks_ref"] = kwargs.pop("sinks")
        return kwargs

    def arrays(self) -> dict:
        """The options that are arrays, by field name (None when absent)."""
        return {"sinks": self.sinks, "bound_min": self.bound_min, "bound_max": self.bound_max,
                "bias": self.bias, "alibi_slopes": self.alibi_slopes}

    @property
    def has_score_mods(self) -> bool:
        """Whether a bias, ALiBi or a soft cap changes the scores (docs/numerics.md, "Score
        variants")."""
        return self.bias is not None or self.alibi_slopes is not None or bool(self.softcap)

    def scalar_key(self):
        """The scalar options as a key for remembering checks that passed (:mod:`numbafa.compiler.memo`),
        or None when they cannot be one: :func:`scalar_key` of the fields."""
        return scalar_key(self.use_causal_mask, self.mixed_precision, self.softmax_scale, self.sliding_window,
                          self.dropout_p, self.seed, self.seed_offset, self.softcap, self.return_dbias)

    def with_call_values(self, call: "AttentionOptions") -> "AttentionOptions":
        """These checked options (remembered for ``call``'s :meth:`scalar_key`) with ``call``'s
        arrays, seed (None: 0) and offset."""
        if not (call.seed or call.seed_offset or call.sinks is not None or call.bound_min is not None
                or call.bound_max is not None or call.bias is not None or call.alibi_slopes is not None):
            return self
        return AttentionOptions(sinks=call.sinks, bound_min=call.bound_min, bound_max=call.bound_max,
                                use_causal_mask=self.use_causal_mask, mixed_precision=self.mixed_precision,
                                softmax_scale=self.softmax_scale, sliding_window=self.sliding_window,
                                dropout_p=self.dropout_p, seed=call.seed or 0, seed_offset=call.seed_offset,
                                bias=call.bias, alibi_slopes=call.alibi_slopes, softcap=self.softcap,
                                return_dbias=self.return_dbias)


def scalar_key(use_causal_mask, mixed_precision, softmax_scale, sliding_window, dropout_p, seed, seed_offset,
               softcap, return_dbias=False):
    """The scalar options of a call, as the user passed them, as a key (None when they cannot
    be one): :meth:`AttentionOptions.scalar_key`, which the public functions also take from their
    arguments directly (:func:`numbafa.pipeline.core.remembered_fwd`).

    Each value with its type (``True`` and ``1`` differ: only one is a bool). Seed and
    offset enter only as "None" / "an int in ``[0, 2**64)``": their values decide nothing
    but the dropout mask, and :meth:`AttentionOptions.with_call_values` puts them back."""
    if not (seed is None or _plain_uint64(seed)) or not _plain_uint64(seed_offset):
        return None
    return ((type(use_causal_mask), use_causal_mask), (type(mixed_precision), mixed_precision),
            (type(softmax_scale), softmax_scale), (type(sliding_window), sliding_window),
            (type(dropout_p), dropout_p), seed is None, (type(softcap), softcap), (type(return_dbias), return_dbias))


def _plain_uint64(x) -> bool:
    return type(x) is int and 0 <= x < 2 ** 64


@dataclass(frozen=True)
class Caller:
    """How the caller spells the arguments, for the messages.

    ``names`` maps the kernel's argument names (``q_ref``, ``dy_ref``,
    ``use_causal_mask``, ...) to the caller's; ``layout`` is the layout the
    caller's 4-D arrays had before :func:`numbafa.layout.to_neuron`: shapes
    and axes are shown in it.
    """

    names: Mapping[str, str] = field(default_factory=dict)
    layout: str = "neuron"

    def __call__(self, name: str) -> str:
        return self.names.get(name, name)

    def axis(self, neuron_axis: int) -> int:
        """The caller's index of a Neuron-layout axis."""
        return check_layout(self.layout)[neuron_axis]

    def order(self, neuron_items) -> tuple:
        """Items given in the Neuron layout's axis order, in the caller's order."""
        return tuple(neuron_items[i] for i in from_neuron_perm(self.layout))

    def shape(self, x) -> tuple:
        """Shape of a 4-D Neuron-layout view as the caller's array has it."""
        return self.order(tuple(x.shape)) if len(x.shape) == 4 else tuple(x.shape)

    def dims(self, neuron_dims: tuple) -> str:
        return "[" + ", ".join(self.order(neuron_dims)) + "]"


#: The public NumPy API's own names, in the Neuron layout.
KERNEL_CALLER = Caller()
