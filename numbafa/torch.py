"""numbafa from PyTorch: attention as custom operators, with autograd.

    import numbafa.torch
    o = numbafa.torch.attention(q, k, v, causal=True, window=128, sinks=sinks)   # [b, h, s, d]
    o.sum().backward()                     # q.grad, k.grad, v.grad, sinks.grad

Two operators, ``torch.ops.numbafa.attention_fwd`` and
``torch.ops.numbafa.attention_bwd``, are defined with
``torch.library.custom_op``, each with a fake (meta) implementation, and
tied together by ``torch.library.register_autograd``. :func:`attention`
calls them through an ``autograd.Function`` with ``setup_context`` (the one
``register_autograd`` generates has none, and torch.func refuses it): it
works in eager mode, under ``torch.no_grad``, ``torch.compile`` (opaque
calls; the graph around them is compiled), ``torch.func.grad``, ``vjp``,
``jacrev`` and ``torch.vmap`` (the mapped axis folded into the batch axis:
one kernel call); not in forward
mode (``torch.func.jvp``, ``jacfwd``, ``hessian``) and not twice
differentiated (no double backward). Both operators take and return tensors in the
Neuron layout ``[batch, heads, head_dim, seq]``; :func:`attention` permutes
the caller's tensors to it and back (views, no copies), so autograd sees the
permutes and returns gradients in the caller's layout. In plain eager mode
(no ``torch.compile``, no torch.func transform, no dispatch mode) it runs the
operators' bodies without the dispatcher, in one autograd node whose layout
changes are NumPy views, and a repeated call of plain tensors without option
tensors or dropout skips its shape checks (remembered per shapes, dtypes and
scalar options).

Tensors cross to NumPy without copies: float32 and float64 as ``tensor.numpy()``,
bfloat16 as a view of its bits (``tensor.view(torch.int16).numpy()`` viewed
as ``ml_dtypes.bfloat16``), and back the same way. CPU tensors only.

This module imports ``torch``; ``import numbafa`` does not import it.
"""

# No ``from __future__ import annotations`` here: torch.library.custom_op reads
# the operators' schemas from their annotations, as objects.
from typing import Optional, Tuple

import ml_dtypes
import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .pipeline import core as _core
from .pipeline import frameworks as _frameworks
from .layout import check_layout, from_neuron_perm
from .layout import cu_seqlens_to_bounds as _cu_seqlens_to_bounds
from .checks.options import AttentionOptions, scalar_key
from .compiler.memo import Memo
from .checks.validation import KERNEL_LAYOUT_PERMS, layout_of_strides

__all__ = ["attention", "cu_seqlens_to_bounds", "to_numpy", "from_numpy"]

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (same memory, same strides); bfloat16 as ``ml_dtypes.bfloat16``."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing the memory of ``a``; ``ml_dtypes.bfloat16`` becomes ``torch.bfloat16``."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ---------------------------------------------------------------------------
# The operators (Neuron layout in and out)
# ---------------------------------------------------------------------------

@torch.library.custom_op("numbafa::attention_fwd", mutates_args=(), device_types="cpu")
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                   bound_min: Optional[torch.Tensor], bound_max: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], causal: bool,
                   window: int, softmax_scale: float, layout: str, dropout_p: float, seed: Optional[int],
                   seed_offset: int, softcap: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """o ``[b, h, d_v, s]`` (q's dtype, v's head dim) and lse ``[b, h, s]`` (float32; float64 for float64
    inputs); ``layout`` only names shapes in errors."""
    return _host_fwd((q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes),
                     (causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap))


def _host_fwd(tensors: tuple, scalars: tuple, perm=None):
    """The forward operator's body on its ``tensors`` (q, k, v, sinks, bound_min, bound_max, bias,
    alibi_slopes) and ``scalars`` (causal ... softcap): plain eager calls run it without the
    dispatcher (a remembered call's straight away, :func:`numbafa.pipeline.core.remembered_fwd`).
    ``perm``: q, k, v are in the caller's layout, this permutation of it the Neuron layout
    (:func:`attention`'s eager paths), and o comes back in the caller's layout."""
    _, o, lse = _fwd_arrays(tensors, scalars, perm)
    if perm is not None:
        o = o.transpose(from_neuron_perm(scalars[3]))
    return from_numpy(o), torch.from_numpy(lse)


def _fwd_arrays(tensors: tuple, scalars: tuple, perm=None):
    """:func:`_host_fwd` in NumPy: ``((q, k, v), o, lse)``, q, k, v the kernels' Neuron-layout views
    of the tensors' memory, o the Neuron-layout output (a NumPy array each)."""
    arrays = [None if t is None else to_numpy(t) for t in tensors]
    if perm is not None:
        arrays[:3] = [x.transpose(perm) for x in arrays[:3]]
    done = _core.remembered_fwd(arrays[:3], arrays[3:], scalars[4], _scalar_key(scalars), "natural")
    if done is None:
        options, layout = _host_options(arrays[3:], scalars)
        done = _frameworks.host_forward(*arrays[:3], options, layout)
    return arrays[:3], done[0], done[1]


def _scalar_key(scalars: tuple, return_dbias: bool = False):
    """:func:`~numbafa.checks.options.scalar_key` of the options :func:`_host_options` makes of
    the operator's ``scalars`` (causal ... softcap)."""
    causal, window, softmax_scale, _, dropout_p, seed, seed_offset, softcap = scalars
    return scalar_key(causal, True, softmax_scale, window, dropout_p, seed, seed_offset, softcap, return_dbias)


def _host_options(option_arrays: tuple, scalars: tuple, return_dbias: bool = False):
    """``(options, layout)`` of an operator call: ``option_arrays`` the NumPy sinks, bound_min,
    bound_max, bias, alibi_slopes (or None), ``scalars`` the operator's causal ... softcap."""
    causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap = scalars
    sinks, bound_min, bound_max, bias, alibi_slopes = option_arrays
    return _frameworks.host_options(sinks=sinks, bound_min=bound_min, bound_max=bound_max, use_causal_mask=causal,
                                    softmax_scale=softmax_scale, sliding_window=window, dropout_p=dropout_p,
                                    seed=seed, seed_offset=seed_offset, bias=bias, alibi_slopes=alibi_slopes,
                                    softcap=softcap, return_dbias=return_dbias), layout


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, causal, window, softmax_scale,
                        layout, dropout_p, seed, seed_offset, softcap):
    b, h, _, s = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return _output_like(q, (b, h, v.shape[2], s)), q.new_empty((b, h, s), dtype=lse_dtype)


def _output_like(q: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An empty Neuron-order tensor of ``shape`` laid out as the kernels lay out their outputs: C-contiguous
    in the layout q is C-contiguous in (numbafa.checks.validation.kernel_layout)."""
    perm = KERNEL_LAYOUT_PERMS[layout_of_strides(tuple(q.shape), tuple(q.stride()))]
    return q.new_empty(tuple(shape[axis] for axis in perm)).permute(tuple(perm.index(axis) for axis in range(4)))


@torch.library.custom_op("numbafa::attention_bwd", mutates_args=(), device_types="cpu")
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                   lse: torch.Tensor, sinks: Optional[torch.Tensor], bound_min: Optional[torch.Tensor],
                   bound_max: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   alibi_slopes: Optional[torch.Tensor], causal: bool, window: int, softmax_scale: float,
                   layout: str, dropout_p: float, seed: Optional[int], seed_offset: int, softcap: float,
                   return_dbias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv ``[b, h(_kv), d, s]``, dsinks (the sinks' shape; empty without sinks) and dbias (the
    bias's shape with ``return_dbias``; else empty)."""
    return _host_bwd((q, k, v, o, do, lse, sinks, bound_min, bound_max, bias, alibi_slopes),
                     (causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap), return_dbias)


def _host_bwd(tensors: tuple, scalars: tuple, return_dbias: bool, perm=None, forward_arrays=None):
    """The backward operator's body on its ``tensors`` (q ... alibi_slopes) and ``scalars``
    (causal ... softcap): plain eager calls run it without the dispatcher (:func:`_backward`).
    ``perm``: q, k, v, o and do are in the caller's layout, this permutation of it the Neuron
    layout (:class:`_EagerAttention`), and dq, dk, dv come back in the caller's layout; dsinks
    and dbias are then None when not asked for (no operator output to fill).
    ``forward_arrays``: the forward's NumPy q, k, v, o (Neuron layout) and lse, views of those
    tensors' memory (:class:`_EagerAttention`, whose ``perm`` is always given), used instead of
    converting them again."""
    q, k, v, o, do, lse, *option_tensors = tensors
    option_arrays = tuple([None if t is None else to_numpy(t) for t in option_tensors])
    if forward_arrays is None:
        arrays = [to_numpy(x) for x in (q, k, v, o, do)]
        if perm is not None:
            arrays = [x.transpose(perm) for x in arrays]
        arrays.append(to_numpy(lse))
    else:
        dy = to_numpy(do)
        arrays = [*forward_arrays[:4], dy.transpose(perm), forward_arrays[4]]
    grads = _core.remembered_bwd(arrays, option_arrays, scalars[4], _scalar_key(scalars, return_dbias))
    if grads is None:
        options, layout = _host_options(option_arrays, scalars, return_dbias)
        grads = _frameworks.host_backward(arrays[:5], arrays[5], options, layout)
    sinks = option_tensors[0]
    if perm is not None:
        back = from_neuron_perm(scalars[3])
        return (from_numpy(grads[0].transpose(back)), from_numpy(grads[1].transpose(back)),
                from_numpy(grads[2].transpose(back)), None if sinks is None else from_numpy(grads[3]),
                from_numpy(grads[-1]) if return_dbias else None)
    # (two empty tensors: an operator's outputs must not alias each other)
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else from_numpy(grads[3])
    dbias = from_numpy(grads[-1]) if return_dbias else q.new_empty((0,), dtype=torch.float32)
    return from_numpy(grads[0]), from_numpy(grads[1]), from_numpy(grads[2]), dsinks, dbias


@_attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, do, lse, sinks, bound_min, bound_max, bias, alibi_slopes, causal, window,
                        softmax_scale, layout, dropout_p, seed, seed_offset, softcap, return_dbias):
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
    dbias = bias.new_empty(bias.shape) if return_dbias else q.new_empty((0,), dtype=torch.float32)
    return (_output_like(q, q.shape), _output_like(q, k.shape), _output_like(q, v.shape), dsinks,
            dbias)


#: The forward operator's tensor arguments, then its scalars.
_FWD_TENSORS = 8


def _setup_context(ctx, inputs, output):
    _save_for_backward(ctx, inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _save_for_backward(ctx, inputs, o, lse):
    """What :func:`_backward` reads: the forward's tensors (their in-place changes detected by
    autograd) and scalars."""
    q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, *options = inputs
    ctx.save_for_backward(q, k, v, o, lse, sinks, bound_min, bound_max, bias, alibi_slopes)
    ctx.options = tuple(options)   # causal, window, softmax_scale, layout, the dropout's three, softcap
    ctx.has_sinks = sinks is not None
    ctx.needs_dbias = bias is not None and ctx.needs_input_grad[6]


def _plain_eager() -> bool:
    """Neither ``torch.compile`` tracing nor a torch.func transform: the operators may be called
    directly (``autograd.Function.apply`` costs ~0.1 ms a call: it binds the signature of its
    ``forward`` with ``inspect`` every time). Under a transform the Functions below are needed."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _bodies_directly(*tensors) -> bool:
    """Whether the operators' bodies may run without the dispatcher: plain eager mode, plain
    CPU tensors (not the fake or functional ones of tracing), no dispatch mode active (a
    user's ``TorchDispatchMode``, a FLOP counter, must see the operators)."""
    return (_plain_eager() and all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)
            and _get_current_dispatch_mode() is None)


def _backward(ctx, do, dlse, perm=None):
    """The gradients of the forward's inputs. ``perm``: the saved q, k, v, o and ``do`` are in the
    caller's layout, this permutation of it the Neuron layout (:class:`_EagerAttention`)."""
    del dlse  # lse is not differentiable
    q, k, v, o, lse, sinks, bound_min, bound_max, bias, alibi_slopes = ctx.saved_tensors
    args = (q, k, v, o, do, lse, sinks, bound_min, bound_max, bias, alibi_slopes)
    # create_graph=True (grad mode on in the backward): the Function, which refuses a second backward;
    # else, in plain eager mode, the operator's body without its dispatcher
    if not torch.is_grad_enabled() and _bodies_directly(do, *args):
        dq, dk, dv, dsinks, dbias = _host_bwd(args, ctx.options, ctx.needs_dbias, perm, getattr(ctx, "arrays", None))
    else:
        if perm is not None:
            args = tuple(x.permute(perm) for x in args[:5]) + args[5:]
        dq, dk, dv, dsinks, dbias = _AttentionBackward.apply(*args, ctx.options + (ctx.needs_dbias,))
        if perm is not None:
            back = from_neuron_perm(ctx.options[3])
            dq, dk, dv = (x.permute(back) for x in (dq, dk, dv))
    return ((dq, dk, dv, (dsinks if ctx.has_sinks else None), None, None, (dbias if ctx.needs_dbias else None),
             None) + (None,) * len(ctx.options))


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# Batching rules (torch.vmap, and jacrev, which maps the backward)
# ---------------------------------------------------------------------------

def _folded(x: Optional[torch.Tensor], bdim: Optional[int], size: int) -> Optional[torch.Tensor]:
    """``x`` with its mapped axis (``bdim``; None: unmapped, broadcast) folded into its batch axis."""
    if x is None:
        return None
    x = x.movedim(bdim, 0) if bdim is not None else x.expand(size, *x.shape)
    return x.reshape(size * x.shape[1], *x.shape[2:])


#: The arguments a folded call folds (the mapped axis into the batch axis); the others pass as they are.
_FOLDED = frozenset({"q", "k", "v", "o", "do", "lse", "sinks"})


def _vmap_rule(op):
    """A batching rule for ``op``: one call on the mapped axis folded into the batch axis.

    Each (batch, KV head) unit is computed on its own, so the folded call gives
    every mapped element the bits of its own call. Loops instead (one call per
    element, as PyTorch's fallback) where folding would change a result: with
    dropout (the mask depends on the batch index), packing bounds that differ
    along the mapped axis, ``[heads]`` sinks (their gradient is summed over the batch), or
    score variants (a bias or slopes may or may not carry the batch). Arguments are read
    by their names in the operator's schema.
    """
    names = [argument.name for argument in op._schema.arguments]

    def rule(info, in_dims, *args):
        arg, dim = dict(zip(names, args)), dict(zip(names, in_dims))
        sinks = arg["sinks"]
        if (arg["dropout_p"] > 0 or dim["bound_min"] is not None or dim["bound_max"] is not None
                or (sinks is not None and sinks.dim() - (dim["sinks"] is not None) < 2)
                or arg["bias"] is not None or arg["alibi_slopes"] is not None or arg["softcap"]):
            outs = [op(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
                    for i in range(info.batch_size)]
            return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
        size = info.batch_size
        outs = op(*(_folded(a, d, size) if name in _FOLDED else a for name, a, d in zip(names, args, in_dims)))
        if len(outs) == 2:   # the forward: o, lse
            return tuple(o.reshape(size, -1, *o.shape[1:]) for o in outs), (0, 0)
        unfolded = tuple(o.reshape(size, -1, *o.shape[1:]) for o in outs[:3])
        if sinks is None:   # the backward's dsinks: empty, not mapped (dbias: empty, no bias here)
            return unfolded + outs[3:], (0,) * 3 + (None, None)
        return unfolded + (outs[3].reshape(size, -1, *outs[3].shape[1:]), outs[4]), (0,) * 4 + (None,)
    return rule


_attention_fwd.register_vmap(_vmap_rule(torch.ops.numbafa.attention_fwd.default))
_attention_bwd.register_vmap(_vmap_rule(torch.ops.numbafa.attention_bwd.default))


class _AttentionBackward(torch.autograd.Function):
    """The backward operator, which has no gradient of its own, as torch.func's transforms take it.

    Called through the operator's autograd kernel, it would be the Function
    that ``torch.library.custom_op`` generates, which ``torch.func.grad``
    refuses (no ``setup_context``) even though nothing differentiates it.
    The operator's scalar arguments travel as one tuple, ``options``; the
    parameters are spelled out because ``torch.compile`` passes ``ctx`` to a
    ``forward(*inputs)``.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, o, do, lse, sinks, bound_min, bound_max, bias, alibi_slopes, options):
        return torch.ops.numbafa.attention_bwd(q, k, v, o, do, lse, sinks, bound_min, bound_max, bias, alibi_slopes,
                                               *options)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "numbafa.torch.attention has no double backward: its backward (numbafa::attention_bwd) "
            "cannot be differentiated (torch.func.hessian, grad of grad, create_graph=True then "
            "a second backward)")


class _Attention(torch.autograd.Function):
    """The forward operator with its backward, as torch.func's transforms take them.

    The Function that ``register_autograd`` generates has no ``setup_context``
    staticmethod, and ``torch.func.grad``, ``vjp`` and ``jacrev`` refuse such a
    Function; this one has it (the same ``_setup_context`` and ``_backward``;
    the scalar arguments as one tuple, ``options``, as in :class:`_AttentionBackward`).
    ``generate_vmap_rule``: under ``vmap`` the operators run with their
    batching rules (:func:`_vmap_rule`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, options):
        return torch.ops.numbafa.attention_fwd(q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, *options)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, options = inputs
        _setup_context(ctx, (*tensors, *options), output)

    @staticmethod
    def backward(ctx, do, dlse):
        return _backward(ctx, do, dlse)[:_FWD_TENSORS] + (None,)


class _EagerAttention(torch.autograd.Function):
    """The forward with its backward in plain eager mode (no ``torch.compile``, no torch.func
    transform): an old-style Function (``ctx`` in ``forward``, no ``setup_context``), whose
    ``apply`` goes straight to C++, running the operators' bodies. The operator's own autograd
    kernel rebuilds its 13-argument schema's Python objects on every call, and a new-style
    Function binds its ``forward``'s signature with ``inspect``: 0.1-0.2 ms a call each, a
    small model's whole kernel time. It takes q, k, v in the caller's layout and returns o in
    it: the permutations to and from the Neuron layout are NumPy views inside it, not four
    permutes in the autograd graph. Same results, bit for bit (the same bodies, on the same
    memory). Its one output is o: lse is saved, not returned (no second edge in the graph, no
    gradient of it made), and the backward reuses the forward's NumPy views of q, k, v, o and lse
    (``ctx.arrays``; the saved tensors are still read, so autograd still detects their in-place
    changes), then lets them go: a node kept alive with o holds no memory the saved tensors
    would not."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, options):
        scalars, perm = options
        tensors = (q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes)
        (qn, kn, vn), o_n, lse_n = _fwd_arrays(tensors, scalars, perm)
        o = from_numpy(o_n.transpose(from_neuron_perm(scalars[3])))
        _save_for_backward(ctx, (*tensors, *scalars), o, torch.from_numpy(lse_n))
        ctx.perm = perm
        ctx.arrays = (qn, kn, vn, o_n, lse_n)
        return o

    @staticmethod
    def backward(ctx, do):
        grads = _backward(ctx, do, None, ctx.perm)
        ctx.arrays = None   # (released as the saved tensors are; a retain_graph backward converts those again)
        return grads[:_FWD_TENSORS] + (None,)


# ---------------------------------------------------------------------------
# The user's function
# ---------------------------------------------------------------------------

def _check_tensor(name: str, t, required: bool = True) -> None:
    if t is None and not required:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (numbafa runs there), got device {t.device}")


def _checked_call(tensors: tuple, given_scalars: tuple) -> tuple:
    """:func:`attention`'s checks of its arguments (shapes, dtypes, scalar options), ``tensors`` its
    q, k, v, sinks, bound_min, bound_max, bias and alibi_slopes as given, ``given_scalars`` its
    causal, window, softmax_scale, layout, dropout_p, seed, seed_offset and softcap: the operators'
    scalar arguments ``(causal, ..., softcap)`` and the permutation of the caller's layout to the
    Neuron layout."""
    q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes = tensors
    causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap = given_scalars
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    optional = (("sinks", sinks), ("bound_min", bound_min), ("bound_max", bound_max), ("bias", bias),
                ("alibi_slopes", alibi_slopes))
    for name, t in optional:
        _check_tensor(name, t, required=False)
    given = {name: (tuple(t.shape), _DTYPES.get(t.dtype, str(t.dtype).replace("torch.", "")))
             for name, t in (("q", q), ("k", k), ("v", v)) + optional if t is not None}
    options = _frameworks.check_call(layout, given, AttentionOptions(sinks=None, bound_min=None, bound_max=None,
                                                                     use_causal_mask=causal, mixed_precision=True,
                                                                     softmax_scale=softmax_scale, sliding_window=window,
                                                                     dropout_p=dropout_p, seed=seed,
                                                                     seed_offset=seed_offset, softcap=softcap))
    for name in ("seed", "seed_offset"):
        if getattr(options, name) >= 2 ** 63:
            raise ValueError(f"{name} must be in [0, 2**63) for PyTorch's int64 operator arguments, "
                             f"got {getattr(options, name)}")
    scalars = (options.use_causal_mask, options.sliding_window, options.softmax_scale or 0.0, layout,
               options.dropout_p, options.seed, options.seed_offset, options.softcap)
    return scalars, check_layout(layout)


#: :func:`attention`'s plain calls whose checks passed: :func:`_plain_key` -> ``(scalars, perm)``.
_PLAIN_CALLS = Memo()


def _plain_key(tensors: tuple, given_scalars: tuple):
    """What :func:`_checked_call` depends on (same arguments), for a call of three plain CPU
    tensors without option tensors or dropout (else None: checked every time): the layout, the
    tensors' shapes and dtypes, the scalar options with their types."""
    q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes = tensors
    causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap = given_scalars
    if (type(q) not in _PLAIN_TENSORS or type(k) not in _PLAIN_TENSORS or type(v) not in _PLAIN_TENSORS
            or not (q.is_cpu and k.is_cpu and v.is_cpu) or sinks is not None or bound_min is not None
            or bound_max is not None or bias is not None or alibi_slopes is not None or seed is not None
            or type(seed_offset) is not int or seed_offset != 0 or type(dropout_p) not in (int, float)
            or dropout_p != 0):
        return None
    return (layout, q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, type(causal), causal, type(window), window,
            type(softmax_scale), softmax_scale, type(dropout_p), type(softcap), softcap)


def attention(q, k, v, *, causal=False, window=None, sinks=None, bound_min=None, bound_max=None,
              softmax_scale=None, layout="bhsd", dropout_p=0.0, seed=None, seed_offset=0, bias=None,
              alibi_slopes=None, softcap=None):
    """Attention with numbafa's CPU kernels, differentiable with respect to q, k, v, sinks and bias.

    Parameters
    ----------
    q : Tensor ``[batch, heads, seq_q, head_dim]`` for ``layout="bhsd"`` (as SDPA),
        ``[batch, seq_q, heads, head_dim]`` for ``"bshd"`` (as flash-attn); float32, bfloat16 or
        float64 (computed in float64 throughout: ``torch.autograd.gradcheck`` works), CPU
    k, v : Tensor, likewise with ``heads_kv`` (``heads % heads_kv == 0``: GQA, MQA) and ``seq_k``;
        ``v``'s head dim (``head_dim_v``) may differ from ``head_dim`` (as DeepSeek's MLA: 192 and 128)
    causal : bool
        Key ``j`` is visible to query ``i`` only if ``j <= i`` (needs ``seq_q == seq_k``).
    window : int, optional
        Causal sliding window: query ``i`` sees keys ``i - window + 1 .. i``
        (``window`` keys, itself included). ``None`` or a value < 1: no
        window. flash-attn's ``window_size=(left, 0)`` is ``window=left + 1``.
    sinks : Tensor ``[heads]``, ``[batch, heads]`` or ``[batch, heads, num_sinks]``, optional
        Attention-sink logits: extra softmax columns with no value
        (gpt-oss). float32 or bfloat16 (float64 or float32 with float64 inputs); gets a gradient (a
        ``torch.nn.Parameter`` of sinks trains).
    bound_min, bound_max : float32 Tensor ``[seq_q]``, optional (both or neither)
        Sequence packing: query ``i`` attends keys ``bound_min[i] <= j < bound_max[i]``
        (see :func:`cu_seqlens_to_bounds`); clamped by ``causal`` and ``window``.
    softmax_scale : float, optional
        Default (``None`` or 0.0) ``1 / sqrt(head_dim)``.
    layout : {"bhsd", "bshd"}
    dropout_p : float in ``[0, 1)``, default 0
        Attention dropout with the exact gradient (:func:`numbafa.attention_bwd`);
        the backward draws the forward's mask again.
    seed : int in ``[0, 2**63)``, required when ``dropout_p > 0``
    seed_offset : int in ``[0, 2**63)``, default 0
        The mask is a function of ``(seed, seed_offset)`` and each element's
        coordinates (:func:`numbafa.dropout_mask`): pass e.g. the training
        step as ``seed_offset`` for a fresh mask per step. (PyTorch operators
        take 64-bit signed ints, hence ``2**63`` instead of numbafa's ``2**64``.)
    bias : Tensor broadcastable to ``[batch, heads, seq_q, seq_k]``, optional
        An additive score bias in that layout for either ``layout`` (SDPA's float
        ``attn_mask``; its last dim ``seq_k``, any other may be 1), float32 or q's dtype;
        ``-inf`` masks. Gets a gradient when it requires one (never an ``seq_q x seq_k``
        gradient otherwise). A bool mask: pass ``torch.where(mask, 0.0, -inf)``.
    alibi_slopes : float32 Tensor ``[heads]`` or ``[batch, heads]``, optional
        ALiBi (flash-attn's ``alibi_slopes``): score ``(i, j)`` gets ``-slope * |i + seq_k -
        seq_q - j|``; no gradient.
    softcap : float, optional
        Logit soft cap (flash-attn's ``softcap``, Gemma 2): scores become ``softcap *
        tanh(s / softcap)`` before the bias. ``None`` or 0: none.

    Returns
    -------
    Tensor in ``layout``, the shape of ``q`` with the head dim of ``v`` (``head_dim_v``), the dtype of ``q``
        A view of a Neuron-layout ``[batch, heads, head_dim_v, seq]`` tensor.

    Notes
    -----
    bfloat16 is computed as on Trainium with ``mixed_precision=True``
    (bf16 matmul operands, float32 accumulation); float32 throughout
    otherwise. The backward is numbafa's: P is recomputed from the saved
    log-sum-exp, nothing quadratic in the sequence length is stored.

    Raises
    ------
    TypeError, ValueError
        A bad argument, named as you passed it (``q``, ``sinks``,
        ``window``, ...; ``do`` for a bad gradient in the backward), with
        the expected and the actual value.
    """
    given = ((q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes),
             (causal, window, softmax_scale, layout, dropout_p, seed, seed_offset, softcap))
    key = _plain_key(*given)
    known = _PLAIN_CALLS.get(key)
    if known is None:
        scalars, perm = _checked_call(*given)
        _PLAIN_CALLS.put(key, (scalars, perm))
    else:
        scalars, perm = known
    direct = _bodies_directly(q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes)
    if direct and not (torch.is_grad_enabled()
                       and any(t is not None and t.requires_grad for t in (q, k, v, sinks, bias))):
        # nothing to differentiate: the operator's body, without the dispatcher (~0.1 ms), the
        # layout changed in NumPy (torch's permutes cost a few us each); no tensor made of lse
        _, o, _ = _fwd_arrays((q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes), scalars, perm)
        return from_numpy(o.transpose(from_neuron_perm(scalars[3])))
    if sinks is not None and sinks.dim() == 1:
        # [heads] -> [batch, heads], a view; float32 (float64 for float64 inputs), so that the
        # gradient is summed over the batch in that dtype and rounded once to the sinks' dtype.
        sinks = sinks.to(torch.float64 if q.dtype == torch.float64 else torch.float32).expand(
            q.shape[0], sinks.shape[0])
    if direct:   # (q, k, v and o in the caller's layout: the permutes inside, in NumPy)
        return _EagerAttention.apply(q, k, v, sinks, bound_min, bound_max, bias, alibi_slopes, (scalars, perm))
    qn, kn, vn = (x.permute(perm) for x in (q, k, v))
    tensors = (qn, kn, vn, sinks, bound_min, bound_max, bias, alibi_slopes)
    if not _plain_eager():
        o, _ = _Attention.apply(*tensors, scalars)
    else:
        o, _ = torch.ops.numbafa.attention_fwd(*tensors, *scalars)
    return o.permute(from_neuron_perm(layout))


def cu_seqlens_to_bounds(cu_seqlens, seqlen=None):
    """Packing bounds (float32 Tensors ``[seqlen]``) from flash-attn's ``cu_seqlens``.

    As :func:`numbafa.layout.cu_seqlens_to_bounds`, for a Tensor (or array) ``cu_seqlens``.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    return tuple(torch.from_numpy(b) for b in _cu_seqlens_to_bounds(cu_seqlens, seqlen))
