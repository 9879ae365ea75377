"""float32's range: what may overflow in a pass, and the exact rescale that avoids it.

The kernels compute in float32 (bf16 values are float32 values with fewer
mantissa bits: the same exponent range), or in float64 for float64 inputs,
where everything below holds with float64's range. Finite inputs can still overflow:

* **the scores** ``S = softmax_scale * q^T k``: when ``|S|`` may exceed
  float32's largest value the pass raises ``FloatingPointError``: the row's
  ``lse >= max S`` is not a float32 either;
* **the forward's accumulator** ``sum_j exp(S_ij - m) v_j``, unnormalised,
  up to ``seqlen_k * max|v|`` even when ``o`` itself is representable;
* **the backward's** ``dP = dy v^T``, ``D = rowsum(o * dy)``, ``dS`` and the
  gradients, all linear in ``dy``.

The second and third are avoided by running the pass on ``v * 2**-e``
(forward) or ``dy * 2**-e`` (backward) and multiplying the outputs by
``2**e``: scaling by a power of two commutes with every float32 and bf16
rounding, so the result is bitwise what an unbounded exponent range would
give (unless values underflow into subnormals); an output that is not
representable after the rescale raises ``FloatingPointError``, naming it.
The bounds below come from the largest ``|element|`` of each input
(measured by the validation's finiteness pass); a loose bound costs an exact
rescale, never a wrong result, so they take a generous slack. A call whose
bounds fit (every realistic one) runs exactly as before.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .dtypes import from_bf16_array, to_bf16_array

__all__ = ["F32_MAX", "check_scores", "in_range", "rescale_exponent", "scaled_input", "unscaled_output"]

F32_MAX = float(np.finfo(np.float32).max)
F64_MAX = float(np.finfo(np.float64).max)

#: Slack on the bounds of accumulated sums (float32 and bf16 roundings; see the module docstring).
_SLACK = 1.25
#: Rows of q per block of the exact score check.
_ROWS = 256


def _as_f32(x: np.ndarray) -> np.ndarray:
    """A kernel array (float32, or bf16 as uint16 bits) as float32 values; float64 as it is."""
    return from_bf16_array(x) if x.dtype == np.uint16 else x


def _limit(dtype) -> tuple:
    """``(largest finite value, name)`` of the arithmetic of a pass on inputs of ``dtype``."""
    return (F64_MAX, "float64") if dtype.char == "d" else (F32_MAX, "float32")   # "d": float64


def _largest_abs_score(prob) -> float:
    """``max |scale| * sum_d |q_d| |k_d|`` over every (query, key) pair of a q-head and its KV
    head, in float64: a bound of every partial sum of the kernels' score products."""
    n_rep = prob.q.shape[1] // prob.k.shape[1]
    largest = 0.0
    for b in range(prob.q.shape[0]):
        for h in range(prob.q.shape[1]):
            k = np.abs(_as_f32(prob.k[b, h // n_rep]).astype(np.float64))   # [d, seqlen_k]
            q = np.abs(_as_f32(prob.q[b, h]).astype(np.float64))            # [d, seqlen_q]
            for r in range(0, q.shape[1], _ROWS):
                largest = max(largest, float((q[:, r:r + _ROWS].T @ k).max(initial=0.0)))
    return largest * abs(prob.softmax_scale)


#: ``(largest value, smallest magnitude that rounds to infinity)`` of each kernel dtype: its largest
#: value plus half an ulp, ``2**(emax + 1) - 2**(emax - p)`` (ties go to the even infinity).
_RANGE = {"float16": (65504.0, 2.0 ** 16 - 2.0 ** 4), "bfloat16": (float(np.float32(3.3895314e38)), 2.0 ** 128 - 2.0 ** 119),
          "float32": (F32_MAX, 2.0 ** 128 - 2.0 ** 103)}


def _check_scaled_queries(prob, caller) -> None:
    """Raise ``FloatingPointError`` if ``softmax_scale * q`` overflows where the kernels write it:
    Q is scaled at load and rounded to the kernel dtype (docs/numerics.md), so float16 inputs
    overflow from 65520 on, bf16 ones beyond bf16's largest value, float32 beyond float32's."""
    if prob.dtype.char == "d":   # float64 inputs: float64's range, checked with the scores
        return
    kind = "float16" if prob.dtype.char == "e" else "bfloat16" if prob.is_bf16 else "float32"
    largest_value, rounds_to_inf = _RANGE[kind]
    largest = abs(float(prob.softmax_scale)) * prob.max_abs["q_ref"]   # a float64 product: exact enough
    if largest >= rounds_to_inf:
        q, scale = caller("q_ref"), caller("softmax_scale")
        raise FloatingPointError(
            f"the attention scores overflow {kind}: the kernels scale the queries at load, rounding {scale} * "
            f"{q} to {kind} (largest value {largest_value:.6g}), and it reaches {largest:.4g}; scale {q} "
            f"down, or pass a smaller {scale}")


def check_scores(prob, caller) -> None:
    """Raise ``FloatingPointError`` if the scores may leave the range of the pass's arithmetic.

    The scaled queries first (:func:`_check_scaled_queries`); then a bound from the largest
    elements (free), and only when it does not fit, the exact largest absolute score product (a
    float64 pass over the pairs). With score variants, the scores after the soft cap (``|s| <=
    softcap``) plus the largest bias and ALiBi term must fit too.
    """
    _check_scaled_queries(prob, caller)
    m = prob.max_abs
    d_head = prob.q.shape[2]
    limit, name = _limit(prob.dtype)
    margin = (1.0 + 2.0 ** -7) * (1.0 + d_head * 2.0 ** -23)    # q * scale rounded (bf16), the sums
    # Python floats: a product beyond float64 is inf, no warning
    largest = abs(float(prob.softmax_scale)) * m["q_ref"] * m["k_ref"] * d_head * margin
    if largest >= limit:
        with np.errstate(over="ignore"):
            largest = _largest_abs_score(prob) * margin
    q, k, scale = caller("q_ref"), caller("k_ref"), caller("softmax_scale")
    if largest >= limit:
        raise FloatingPointError(
            f"the attention scores {scale} * {q}^T {k} overflow {name}: their products reach "
            f"{largest:.4g} > {limit:.4g} ({name}'s largest value), and the log-sum-exp is at least "
            f"the largest score; scale {q} or {k} down, or pass a smaller {scale}")
    if prob.max_abs_bias:
        total = (min(largest, prob.softcap) if prob.softcap else largest) + prob.max_abs_bias * (1.0 + 2.0 ** -23)
        if total >= limit:
            raise FloatingPointError(
                f"the attention scores plus {caller('bias')} and the ALiBi terms overflow {name}: they reach "
                f"{total:.4g} > {limit:.4g} ({name}'s largest value); scale {caller('bias')} down")


def _backward_bound(prob) -> float:
    """A bound of every float32 value the backward accumulates, for ``max|dy|``."""
    m = prob.max_abs
    d_v, seqlen_q = prob.v.shape[2], prob.q.shape[3]   # dP = dO V^T and D = rowsum(dO * O) run over d_v
    seqlen_k, n_rep = prob.k.shape[3], prob.q.shape[1] // prob.k.shape[1]
    keep = 1.0 / (1.0 - prob.dropout_p)
    dy, scale = m["dy_ref"], abs(prob.softmax_scale)
    d_sum = d_v * m["o_ref"] * dy
    d_s = d_v * dy * (m["v_ref"] * keep + m["o_ref"])
    dbias = prob.q.shape[0] * prob.q.shape[1] * seqlen_q * d_s if prob.return_dbias else 0.0
    return max(d_v * dy * m["v_ref"] * keep, d_sum, d_s, n_rep * seqlen_q * dy * keep,
               n_rep * seqlen_q * d_s * m["q_ref"] * scale, scale * seqlen_k * d_s * m["k_ref"],
               seqlen_q * d_sum, dbias)


def rescale_exponent(prob, backward: bool) -> int:
    """The ``e >= 0`` to run the pass on ``v * 2**-e`` (forward) or ``dy * 2**-e`` (backward): 0 when
    nothing may overflow."""
    if backward:
        bound = _backward_bound(prob)
    else:
        bound = prob.k.shape[3] * prob.max_abs["v_ref"] / (1.0 - prob.dropout_p)
    bound *= _SLACK
    limit, name = _limit(prob.dtype)
    if bound < limit:
        return 0
    if not math.isfinite(bound):   # float64 inputs near float64's largest value
        what = "dy" if backward else "v"
        raise FloatingPointError(f"the sums of the {'backward' if backward else 'forward'} overflow {name} "
                                 f"beyond an exact rescale of {what}: scale the inputs down")
    return int(math.ceil(math.log2(bound / limit))) + 1


def scaled_input(prob, e: int, backward: bool):
    """``prob`` with ``v`` (forward) or ``dy`` (backward) times ``2**-e``, in the kernels' form."""
    key = "dy" if backward else "v"
    x = getattr(prob, key)
    scaled = np.ldexp(_as_f32(x), -e)
    if x.dtype == np.uint16:   # exact: a power of two keeps the bf16 mantissa
        scaled = to_bf16_array(scaled).view(np.uint16)
    return dataclasses.replace(prob, **{key: scaled})


def unscaled_output(x: np.ndarray, e: int, name: str) -> np.ndarray:
    """An output (float32, float64 or bf16) of a pass run on inputs scaled by ``2**-e``, times
    ``2**e`` (exact); raise ``FloatingPointError`` if it leaves the range of float32 (float64 for a
    float64 output: the exact output is not representable)."""
    if e == 0:
        return x
    limit, kind = _limit(x.dtype)
    with np.errstate(over="ignore"):
        out = np.ldexp(x.astype(kind), e).astype(kind)
    if not np.isfinite(out).all():
        raise FloatingPointError(f"{name} overflows {kind}: some of its exact values exceed {limit:.4g} "
                                 f"({kind}'s largest value)")
    return out.astype(x.dtype)


def in_range(prob, caller, backward: bool):
    """``(prob, e)``: the scores checked (:func:`check_scores`), and ``prob`` with its ``v`` or ``dy``
    scaled by ``2**-e`` when something else may overflow (``e = 0``: ``prob`` itself)."""
    check_scores(prob, caller)
    e = rescale_exponent(prob, backward)
    return (scaled_input(prob, e, backward) if e else prob), e
