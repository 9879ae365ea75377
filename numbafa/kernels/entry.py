"""The compiled entries of the two passes: everything a call does after its metadata is checked.

:func:`forward_entry` and :func:`backward_entry` are the one pipeline of every front door: the
Python API (:mod:`numbafa.pipeline.core`), :mod:`numbafa.nb` from a user's ``@njit`` code, the torch and
JAX host calls and the Dask shares all call them. In compiled code, once per call:

1. **values** -- every input is finite (the lse has no NaN and no ``-inf``; a bias no NaN and
   no ``+inf``), by one integer max reduction per array that also gives its largest
   ``|element|`` (:func:`_largest`); a bad array is counted only then;
2. **range** (:func:`_check_range`, docs/numerics.md) -- ``softmax_scale * q`` must fit the
   kernel dtype where Q is rounded at load, and the scores ``softmax_scale * q^T k`` (plus the
   largest bias and ALiBi term) must fit the arithmetic: a cheap bound from the largest
   elements, and only when it does not fit, the exact largest product
   (:func:`exact_scores`). Sums that may overflow although the result fits are computed on
   ``v * 2**-e`` (forward) or ``dy * 2**-e`` (backward) and the outputs multiplied by ``2**e``:
   exact, as scaling by a power of two commutes with every rounding (:func:`_exponent`);
3. **launch** -- the work items (:func:`numbafa.kernels.launch.forward_items`,
   :func:`~numbafa.kernels.launch.backward_items`, which also finishes the units);
4. **outputs** -- the rescale undone, each output finite (float16's range ends at 65504: a tile
   rounded to fp16 beyond it is inf, as on the hardware); without fp16 the backward's gradients
   are scanned for NaN and inf before (:func:`_finite_gradient`): with inputs in range only an
   lse far below the log-sum-exp of the scores makes them so (``exp(s - lse)`` overflows).

A failure writes the ``status`` array (``code, which, count, value``: :data:`STATUS_WORDS`)
and returns before anything is launched where it can; the caller turns it into the exception,
in its own words (:func:`numbafa.pipeline.core.raise_status`; :mod:`numbafa.nb` raises in compiled code).

Inputs are the kernels' arrays, C-contiguous, float32, bf16 bits (uint16) or float64 (float16
inputs arrive widened to float32), each in a :data:`~numbafa.kernels.stored.Stored` record
(:func:`~numbafa.kernels.stored.stored_fwd`, ``stored_bwd``, which the callers apply): one
compiled entry serves float32 and bf16 inputs, the bf16 scans being plugins
(:mod:`numbafa.kernels.values`); outputs the kernels' float32 (float64) arrays, converted to the
caller's dtype by the caller. ``exponent`` is ``-1`` for a whole call (the checks, then the
rescale this call needs), or a Dask share's ``e >= 0``: its client checked the whole problem
and chose the rescale of all its shares (a block's chunks must share it).
"""

from __future__ import annotations

import math

import numpy as np
from numba import types

from ..conventions.dtypes import ROUND_BF16, ROUND_FP16, widen
from ..compiler.arrays import bitcast, empty, empty_like, zeros
from ..compiler.jit import jit, overload
from ..compiler.linking import _plugin_key, call_or_raise, pack, unpack
from ..compiler.scalars import max_, min_
from .bundles import BwdInputs, FwdInputs
from .heads import BHSD, BSHD, dims4
from .launch import backward_items, forward_items
from .matmul import flat
from .stored import Stored, stored_dims
from .table import call_plugin, kernel_address
from .values import bits_value, count_nonfinite, largest_of_bits, magnitude_bits, scaled, scaled_bits

__all__ = ["forward_entry", "backward_entry", "unscale_output", "exact_scores", "exact_scores_plugin", "STATUS_WORDS",
           "OK", "NONFINITE", "LSE_VALUES", "SCALED_Q", "SCORES", "SCORES_WITH_BIAS", "SUMS", "OUTPUT", "EXACT_SCORES",
           "GRADIENTS", "INPUTS", "OUTPUTS"]

#: Words of a status array (int64): ``code, which, count, value`` (``value``: a float64's bits).
STATUS_WORDS = 4
#: Status codes (:data:`EXACT_SCORES`: the exact score check is needed and not compiled in this
#: process; the caller compiles it, :func:`exact_scores_plugin`, and calls again;
#: :data:`GRADIENTS`: a gradient holds NaN or inf, ``which`` of :data:`OUTPUTS`, how many).
OK, NONFINITE, LSE_VALUES, SCALED_Q, SCORES, SCORES_WITH_BIAS, SUMS, OUTPUT, EXACT_SCORES, GRADIENTS = range(10)
#: ``which`` of an input (:data:`NONFINITE`), as the kernel's argument names.
INPUTS = ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "sinks_ref", "bias", "alibi_slopes", "lse_ref")
# (NumPy ints, not Python ones: Numba would compile a helper once per literal value)
_Q, _K, _V, _O, _DY, _SINKS, _BIAS, _ALIBI, _LSE = (np.int64(i) for i in range(9))
#: ``which`` of an output (:data:`OUTPUT`; :data:`SUMS`: 0 forward, 1 backward).
OUTPUTS = ("o", "dq", "dk", "dv", "dsinks", "dbias")

_F32_MAX = float(np.finfo(np.float32).max)
_F64_MAX = float(np.finfo(np.float64).max)
#: Slack on the bounds of accumulated sums (float32 and bf16 roundings).
_SLACK = 1.25
#: Rows of q per block of the exact score check.
_ROWS = 256
# The smallest magnitude that rounds to infinity in a format: its largest value plus half an
# ulp, 2**(emax + 1) - 2**(emax - p) (ties go to the even infinity).
_FP16_INF = 2.0 ** 16 - 2.0 ** 4
_BF16_INF = 2.0 ** 128 - 2.0 ** 119
_F32_INF = 2.0 ** 128 - 2.0 ** 103


# --- values ---------------------------------------------------------------------------------

@jit()
def _largest(x, which, status):
    """The largest ``|element|`` of the 1-D array ``x``; with a NaN or an inf in it, the status
    :data:`NONFINITE` (``which``, how many) and -1."""
    finite, value = bits_value(magnitude_bits(x), x)
    if finite:
        return value
    status[0], status[1], status[2] = NONFINITE, which, count_nonfinite(x)
    return -1.0


@jit()
def _largest_input(x, which, status):
    """:func:`_largest` of a :data:`~numbafa.kernels.stored.Stored` input (of bf16 bits: the plugin
    :func:`~numbafa.kernels.values.largest_of_bits`)."""
    if not x.is_bits:
        return _largest(flat(x.f), which, status)
    out = zeros(2, np.float64)
    call_plugin(largest_of_bits, (flat(x.bits), out))
    if out[1] == 0.0:
        return out[0]
    status[0], status[1], status[2] = NONFINITE, which, np.int64(out[1])
    return -1.0


@jit()
def _largest_bias(scores, longest, status):
    """The largest ``|finite bias|`` plus the largest ALiBi term (``|slope| * longest``, the
    longest sequence bounding the distances); 0 without them. NaN/+inf in the bias (``-inf``
    masks a score) or a non-finite slope: the status :data:`NONFINITE` and -1."""
    bias = flat(scores.bias)
    largest = 0.0
    bad = 0
    for i in range(bias.size):
        b = np.float64(bias[i])
        bad += not (b < math.inf)        # NaN or +inf
        a = abs(b)
        largest = max_(largest, a if a < math.inf else 0.0)
    if bad:
        status[0], status[1], status[2] = NONFINITE, _BIAS, bad
        return -1.0
    slopes = _largest(flat(scores.alibi), _ALIBI, status)
    if slopes < 0.0:
        return -1.0
    return largest + slopes * longest


@jit()
def _lse_values(lse, status):
    """The status :data:`LSE_VALUES` (how many) if the 1-D lse holds a NaN or a ``-inf``."""
    n = 0
    for i in range(lse.size):
        x = lse[i]
        n += (x != x) | (x == -math.inf)
    if n:
        status[0], status[2] = LSE_VALUES, n


# --- range ----------------------------------------------------------------------------------

def _limit(acc):  # pragma: no cover - replaced inside njit code
    """The largest value of the arithmetic of kernels whose accumulator array is ``acc``."""
    raise NotImplementedError


@overload(_limit)
def _limit_overload(acc):
    limit = _F64_MAX if acc.dtype == types.float64 else _F32_MAX
    return lambda acc: limit


def _is_float64(acc):  # pragma: no cover - replaced inside njit code
    raise NotImplementedError


@overload(_is_float64)
def _is_float64_overload(acc):
    result = acc.dtype == types.float64
    return lambda acc: result


@jit()
def exact_scores(args, _):
    """``out[0] = max |scale| * sum_d |q_d| |k_d|`` over every (query, key) pair of each q-head and
    its KV head, in float64: a bound of every partial sum of the kernels' score products.
    ``args`` points to ``(q, k, scale, layout, out)``. A plugin (:mod:`numbafa.kernels.table`):
    compiled only for a call whose cheap bound does not fit (:data:`EXACT_SCORES`)."""
    q, k, scale, layout, out = unpack(args)
    bs, nheads, d, seqlen_q = dims4(q, layout)
    _, nheads_kv, _, seqlen_k = dims4(k, layout)
    n_rep = nheads // nheads_kv
    largest = 0.0
    kk = empty((d, seqlen_k), np.float64)
    qq = empty((min_(_ROWS, seqlen_q), d), np.float64)
    for b in range(bs):
        for h in range(nheads):
            for x in range(d):
                for j in range(seqlen_k):
                    kk[x, j] = abs(np.float64(widen(_element(k, layout, b, h // n_rep, x, j))))
            for r in range(0, seqlen_q, _ROWS):
                rows = min_(_ROWS, seqlen_q - r)
                for i in range(rows):
                    for x in range(d):
                        qq[i, x] = abs(np.float64(widen(_element(q, layout, b, h, x, r + i))))
                prod = np.dot(qq[:rows], kk)
                for i in range(rows):
                    for j in range(seqlen_k):
                        largest = max_(largest, prod[i, j])
    out[0] = largest * abs(np.float64(scale))


@jit()
def _element(x, layout, b, h, d, s):
    """Element ``[b, h, d, s]`` (Neuron-order indices) of a 4-D array in ``layout``."""
    if layout == BSHD:
        return x[b, s, h, d]
    if layout == BHSD:
        return x[b, h, s, d]
    return x[b, h, d, s]


def exact_scores_plugin(ins, plan) -> list:
    """:func:`exact_scores` with sample arguments of the types the entries pass it, for
    :func:`numbafa.kernels.table.ensure_plugins`."""
    return [(exact_scores, (ins.q, ins.k, plan.softmax_scale, plan.layout, np.zeros(1)))]


@jit(inline=True)
def _exact_scores(args):
    """Run :func:`exact_scores` on ``args`` if it is compiled in this process; whether it ran."""
    address = kernel_address(_plugin_key(exact_scores, args))
    if address == 0:
        return False
    call_or_raise(address, (pack(args), np.int64(0)))
    return True


@jit()
def _check_range(plan, q, k, m_q, m_k, m_bias, status):
    """The status :data:`SCALED_Q`, :data:`SCORES` or :data:`SCORES_WITH_BIAS` (with the value that
    does not fit) unless the scaled queries and the scores fit (module docstring)."""
    scale = abs(np.float64(plan.softmax_scale))
    fmt = plan.precision.round_kernel
    if not _is_float64(plan.acc):   # Q is rounded to the kernel dtype at load
        rounds_to_inf = _FP16_INF if fmt == ROUND_FP16 else _BF16_INF if fmt == ROUND_BF16 else _F32_INF
        if scale * m_q >= rounds_to_inf:
            status[0], status[1], status[3] = SCALED_Q, fmt, bitcast(np.float64(scale * m_q), np.int64)
            return
    limit = _limit(plan.acc)
    d_head = stored_dims(q, plan.layout)[2]
    margin = (1.0 + 2.0 ** -7) * (1.0 + d_head * 2.0 ** -23)    # q * scale rounded (bf16), the sums
    largest = scale * m_q * m_k * d_head * margin               # inf past float64: no error
    if largest >= limit:
        exact = zeros(1, np.float64)
        if q.is_bits:
            ran = _exact_scores((q.bits, k.bits, plan.softmax_scale, plan.layout, exact))
        else:
            ran = _exact_scores((q.f, k.f, plan.softmax_scale, plan.layout, exact))
        if not ran:   # not compiled in this process yet: the caller compiles it and calls again
            status[0] = EXACT_SCORES
            return
        largest = exact[0] * margin
    if largest >= limit:
        status[0], status[3] = SCORES, bitcast(np.float64(largest), np.int64)
        return
    if m_bias > 0.0:
        cap = np.float64(plan.scores.softcap)
        total = (min_(largest, cap) if cap > 0.0 else largest) + m_bias * (1.0 + 2.0 ** -23)
        if total >= limit:
            status[0], status[3] = SCORES_WITH_BIAS, bitcast(np.float64(total), np.int64)


@jit()
def _exponent(bound, plan, backward, status):
    """The ``e >= 0`` to run a pass on ``v * 2**-e`` (forward) or ``dy * 2**-e`` (backward) for a
    ``bound`` of every value it accumulates (0: nothing may overflow); not finite: the status
    :data:`SUMS` and -1. ``backward``: 0 or 1, an int64 (no literal: one compile for both entries)."""
    bound *= _SLACK
    limit = _limit(plan.acc)
    if bound < limit:
        return 0
    if not bound < math.inf:   # float64 inputs near float64's largest value
        status[0], status[1] = SUMS, backward
        return -1
    return math.ceil(math.log2(bound / limit)) + 1   # an int64 in njit code


@jit()
def _backward_bound(plan, q_dims, v_dims, m_q, m_k, m_v, m_o, m_dy):
    """A bound of every value the backward accumulates, for ``max|dy| = m_dy`` (``q_dims``,
    ``v_dims``: q's and v's ``(batch, heads, head_dim, seq)``)."""
    bs, nheads, _, seqlen_q = q_dims
    _, nheads_kv, d_v, seqlen_k = v_dims
    n_rep = nheads // nheads_kv
    keep = np.float64(plan.dropout.scale) if plan.dropout.active else 1.0
    scale = abs(np.float64(plan.softmax_scale))
    d_sum = d_v * m_o * m_dy
    d_s = d_v * m_dy * (m_v * keep + m_o)
    dbias = bs * nheads * seqlen_q * d_s if plan.scores.dbias.size > 0 else 0.0
    return max_(d_v * m_dy * m_v * keep, d_sum, d_s, n_rep * seqlen_q * m_dy * keep,
               n_rep * seqlen_q * d_s * m_q * scale, scale * seqlen_k * d_s * m_k, seqlen_q * d_sum, dbias)


@jit()
def _scaled_input(x, e):
    """A new :data:`~numbafa.kernels.stored.Stored` input: ``x`` times ``2**-e``, exact
    (:func:`~numbafa.kernels.values.scaled`; of bf16 bits: the plugin
    :func:`~numbafa.kernels.values.scaled_bits`)."""
    if not x.is_bits:
        return Stored(scaled(x.f, e), x.bits, False)
    out = empty_like(x.bits)
    call_plugin(scaled_bits, (flat(x.bits), flat(out), np.int64(e)))
    return Stored(x.f, out, True)


@jit()
def _unscale(x, e, which, status):
    """``x *= 2**e`` in place on a 1-D output (exact); an element beyond the range: the status
    :data:`OUTPUT` (count 0: beyond the arithmetic's range)."""
    if e == 0 or status[0] != OK:
        return
    for i in range(x.size):
        x[i] = math.ldexp(np.float64(x[i]), e)
        if not abs(x[i]) < math.inf:
            status[0], status[1], status[2] = OUTPUT, which, 0
            return


@jit()
def _finite_gradient(x, which, status):
    """The status :data:`GRADIENTS` (``which``, how many) if the 1-D gradient ``x`` holds a NaN or
    an inf (one integer max reduction; counted only then)."""
    if status[0] != OK or bits_value(magnitude_bits(x), x)[0]:
        return
    status[0], status[1], status[2] = GRADIENTS, which, count_nonfinite(x)


@jit(entry=True)
def unscale_output(x, e, which, status):
    """:func:`_unscale` called from Python: the rescale of an output merged from the shares of a
    call (:func:`numbafa.pipeline.ranges.unscaled_output`), the one a whole call's entry runs, and
    for a gradient (``which > 0``) first its scan, :func:`_finite_gradient`."""
    if which > 0:
        _finite_gradient(x, which, status)
    _unscale(x, e, which, status)


@jit()
def _fp16_output(x, round_kernel, which, status):
    """With fp16 inputs, the status :data:`OUTPUT` (count 1: float16's range) if the 1-D output
    ``x`` holds an inf: a tile rounded to fp16 past 65504 (the kernels wrote it so)."""
    if round_kernel != ROUND_FP16 or status[0] != OK:
        return
    for i in range(x.size):
        if not abs(x[i]) < math.inf:
            status[0], status[1], status[2] = OUTPUT, which, 1
            return


# --- the entries ----------------------------------------------------------------------------

@jit(entry=True)
def forward_entry(ins, outs, plan, items, exponent, status):
    """The forward of the bundles ``ins``, ``outs``, ``plan`` (:mod:`numbafa.kernels.bundles`):
    checks, range, the work ``items``, the outputs' rescale and checks (module docstring).
    Returns the rescale's exponent (``status[0] != 0``: the call failed, nothing to use)."""
    e = exponent
    if e < 0:
        m_q = _largest_input(ins.q, _Q, status)
        m_k = _largest_input(ins.k, _K, status) if m_q >= 0.0 else -1.0
        m_v = _largest_input(ins.v, _V, status) if m_k >= 0.0 else -1.0
        m_s = _largest(flat(ins.sinks), _SINKS, status) if m_v >= 0.0 else -1.0
        longest = max_(stored_dims(ins.q, plan.layout)[3], stored_dims(ins.k, plan.layout)[3])
        m_bias = _largest_bias(plan.scores, longest, status) if m_s >= 0.0 else -1.0
        if status[0] != OK:
            return 0
        _check_range(plan, ins.q, ins.k, m_q, m_k, m_bias, status)
        if status[0] != OK:
            return 0
        keep = np.float64(plan.dropout.scale) if plan.dropout.active else 1.0
        e = _exponent(stored_dims(ins.k, plan.layout)[3] * m_v * keep, plan, np.int64(0), status)
        if e < 0 or items.size == 0:   # (no items: the checks alone, for a Dask call's client)
            return max_(e, 0)
    v = _scaled_input(ins.v, e) if e > 0 else ins.v   # (one call site: the bundles lowered once)
    forward_items(FwdInputs(ins.q, ins.k, v, ins.sinks), outs, plan, items)
    if exponent < 0:   # (a Dask share's outputs are part of a call: its client checks them)
        _unscale(flat(outs.o), e, np.int64(0), status)
        _fp16_output(flat(outs.o), plan.precision.round_kernel, np.int64(0), status)
    return e


@jit(entry=True)
def backward_entry(ins, outs, stats, plan, items, units, exponent, status):
    """The backward of the bundles (:mod:`numbafa.kernels.bundles`): checks, range, the work
    ``items``, the ``units`` finished, the outputs' rescale and checks (module docstring; the
    bias's gradient is ``plan.scores.dbias``). Returns the rescale's exponent."""
    e = exponent
    if e < 0:
        m_q = _largest_input(ins.q, _Q, status)
        m_k = _largest_input(ins.k, _K, status) if m_q >= 0.0 else -1.0
        m_v = _largest_input(ins.v, _V, status) if m_k >= 0.0 else -1.0
        m_o = _largest_input(ins.o, _O, status) if m_v >= 0.0 else -1.0
        m_dy = _largest_input(ins.dy, _DY, status) if m_o >= 0.0 else -1.0
        m_s = _largest(flat(ins.sinks), _SINKS, status) if m_dy >= 0.0 else -1.0
        longest = max_(stored_dims(ins.q, plan.layout)[3], stored_dims(ins.k, plan.layout)[3])
        m_bias = _largest_bias(plan.scores, longest, status) if m_s >= 0.0 else -1.0
        if status[0] == OK:
            _lse_values(flat(ins.lse), status)
        if status[0] != OK:
            return 0
        _check_range(plan, ins.q, ins.k, m_q, m_k, m_bias, status)
        if status[0] != OK:
            return 0
        bound = _backward_bound(plan, stored_dims(ins.q, plan.layout), stored_dims(ins.v, plan.layout), m_q, m_k, m_v,
                                m_o, m_dy)
        e = _exponent(bound, plan, np.int64(1), status)
        if e < 0 or items.size + units.size == 0:
            return max_(e, 0)
    dy = _scaled_input(ins.dy, e) if e > 0 else ins.dy   # (one call site: the bundles lowered once)
    backward_items(BwdInputs(q=ins.q, k=ins.k, v=ins.v, o=ins.o, dy=dy, lse=ins.lse, sinks=ins.sinks), outs, stats,
                   plan, items, units)
    if exponent >= 0:
        return e
    fmt = plan.precision.round_kernel
    if fmt != ROUND_FP16:   # (fp16: an inf is the overflow of a rounding point, below)
        _finite_gradient(flat(outs.dq), np.int64(1), status)
        _finite_gradient(flat(outs.dk), np.int64(2), status)
        _finite_gradient(flat(outs.dv), np.int64(3), status)
        _finite_gradient(flat(outs.dsinks), np.int64(4), status)
        _finite_gradient(flat(plan.scores.dbias), np.int64(5), status)
    _unscale(flat(outs.dq), e, np.int64(1), status)
    _unscale(flat(outs.dk), e, np.int64(2), status)
    _unscale(flat(outs.dv), e, np.int64(3), status)
    _unscale(flat(outs.dsinks), e, np.int64(4), status)
    _unscale(flat(plan.scores.dbias), e, np.int64(5), status)
    _fp16_output(flat(outs.dq), fmt, np.int64(1), status)
    _fp16_output(flat(outs.dk), fmt, np.int64(2), status)
    _fp16_output(flat(outs.dv), fmt, np.int64(3), status)
    return e
