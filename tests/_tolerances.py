"""The one place where test tolerances are stated.

Acceptance rule (the upstream NKI test suite's): for every output,

    max|actual - expected| <= atol + rtol * max|expected|

with ``expected`` from the float64 golden of the *same* (rounded) inputs.

* float32: rtol 1e-4, atol 1e-5. The kernel accumulates in float32 over at
  most seqlen_k (dQ) or nheads/nheads_kv * seqlen_q (dK, dV) terms; measured
  errors are ~1e-6 relative (see the closing notes), so 1e-4 leaves a 100x
  margin without hiding an O(1) bug (a wrong mask or a missing term gives
  errors of order 1e-2 .. 1).
"""

from __future__ import annotations

import numpy as np

FLOAT32 = {"rtol": 1e-4, "atol": 1e-5}

# * float64 inputs: the kernels compute in float64, the golden too, in another
#   order. Each output is a chain of a few sums (S or dP over d <= 512, the row
#   sums and dQ over seqlen_k <= 5120, dK/dV over n_rep * seqlen_q <= 8192), an
#   exp and a few products; a float64 sum of n terms in any order is within
#   gamma_n = n * 2**-53 / (1 - n * 2**-53) <= 9.1e-13 of the exact sum,
#   relative to the sum of the terms' magnitudes, and that sum stays within
#   ~20x max|expected| for the test inputs (unit normals, softmax weights <= 1).
#   A few such steps give ~1e-10 relative to max|e|: rtol 1e-10, atol 1e-13
#   (outputs near 0). Measured: ~5e-16 (1e-15 at most) on every family. The
#   rule still fails any float32 step (a float32 scratch, scale or dropout
#   multiplier: errors of 1e-8..1e-7 relative), by 100x or more.
FLOAT64 = {"rtol": 1e-10, "atol": 1e-13}


def max_rel_error(actual, expected) -> float:
    """``max|a - e| / max|e|`` in float64 (0 when both are empty)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if e.size == 0:
        return 0.0
    scale = np.abs(e).max()
    err = np.abs(a - e).max()
    return float(err / scale) if scale > 0 else float(err)


def assert_close(actual, expected, tol, name=""):
    """Assert the acceptance rule; the message gives both sides of it."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    assert np.isfinite(a).all(), f"{name}: non-finite values in the result"
    if e.size == 0:
        return
    err = np.abs(a - e).max()
    bound = tol["atol"] + tol["rtol"] * np.abs(e).max()
    assert err <= bound, (f"{name}: max|a-e| = {err:.3e} > {bound:.3e} "
                          f"(atol {tol['atol']}, rtol {tol['rtol']}, max|e| = {np.abs(e).max():.3e})")

# * bf16 inputs, mixed_precision=True, against the float64 golden of the
#   same bf16 inputs: the upstream rule for the hardware kernel. P and dS are
#   rounded to bf16 (relative 2^-9) before the matmuls, so errors of a few
#   1e-3 relative to max|e| are expected.
BF16_MIXED = {"rtol": 2e-2, "atol": 1e-5}

# * float16 inputs, mixed_precision=True, against the float64 golden of the
#   same fp16 inputs: the same rounding points as bf16, to fp16, whose unit
#   roundoff is 2^-11 instead of 2^-8. Every rounding-error term of the bf16
#   rule scales with the unit roundoff (the float32 terms are ~2^-13 smaller
#   still), so the bf16 rule scaled by 2^-3: rtol 2.5e-3. Measured: 2.9e-4 ..
#   1.0e-3 on the test families (Zen 3); a missing mask or term still gives
#   errors of 1e-2..1.
FP16_MIXED = {"rtol": 2.5e-3, "atol": 1e-5}

# * Faithfulness of the bf16 kernel to the numerics golden (same rounding
#   points, float32 in between). The two differ in float32 summation order
#   (the kernel's GEMMs: OpenBLAS sgemm, whose kernel depends on the CPU, or
#   oneDNN's bf16 GEMM on the bf16 units; the golden's: NumPy's matmul; D: the
#   kernel's loops against NumPy's pairwise sum) and in exp (the kernel's expf
#   is within 1.5 ulp of the exact value; NumPy's float32 exp measured within
#   2.54 ulp over every float32 in [-104, 2], 3 assumed). A bf16 rounding gives
#   the same value on both sides unless its float32 input can land on either
#   side of a rounding boundary: then it flips. Error analysis, per output
#   element (docs/numerics.md, "How far two faithful implementations differ"):
#     - the output's own rounding: FINAL_ULPS = 1 ulp of the element;
#     - each earlier rounding of its accumulator (dQ between KV sections;
#       with mixed_precision=False every rounded addition of dQ/dK/dV): one
#       ulp of the accumulator *at that point*, carried unchanged by later
#       additions, so several ulps of a smaller output (4 measured);
#     - the tiles that feed a GEMM (D, P, dS): a float32 sum of n exact terms
#       is within gamma_n * sum|term| of the exact sum in any order
#       (gamma_n = n u / (1 - n u), u = 2^-24), so the two sides' S, dP and D
#       are within twice that. Through t = S - LSE, exp (both ulp errors) and
#       dS = (dP - D) * P, that bounds each tile element's pre-rounding value
#       on the other side; its bf16 rounding can then move by the bf16 steps
#       within reach -- zero unless a rounding boundary is -- and moves every
#       output it feeds by that times the other operand (dV: |dO|, dK: |Q_s|,
#       dQ: |K| * scale). A flip of P moves dS by ulp(P) * |dP - D|, which
#       flips dS's rounding too. This is the term the first version of this
#       note waved away as "float32 noise covered by the final ulp": where
#       later terms cancel it is not (a dq element at 2.0x the old bound on
#       oneDNN's GEMM with OpenBLAS's Haswell kernel in the golden);
#     - the output GEMM's own float32 sum of N terms: 2 gamma_N * sum|term|;
#     - oneDNN's bf16 units flush subnormal inputs and results to zero
#       (checked): at most 2^-126 per operation, counted, negligible.
#   tests/_budget.py computes the sum of all but the first (the budget), so
#   |a - e| <= FINAL_ULPS * ulp(e) + budget is a bound on *every* element, on
#   any CPU and GEMM path. The check used to skip elements with
#   |e| < max|e| / 16: a stand-in for the output GEMM's order term (near zero,
#   the absolute noise of a long cancelling sum exceeds the element's own
#   spacing), never derived, and no protection on large elements (the 2.0x
#   element above was large). The order term now covers those elements, so
#   every element is checked.
#   How sharp: a worst-case bound, and worst cases are far from typical -- the
#   float32 S of a d_head 128 head differs from float64 by at most 0.7 % of
#   gamma_n * sum|q k| (median 0.03 %). So flips are rare but candidates are
#   not: ~4 % of the P and ~18 % of the dS elements at d_head 128. The budget
#   is a fraction of an ulp on most elements of most families (median 0.37 ulp
#   of the element with mixed_precision, 0.47 without; on the large elements of
#   the causal d_head 64 family 0.02-0.09) and grows with the contraction
#   lengths: median 7-25 ulps at d_head 512 or 5120 keys. There the check
#   still catches O(1e-2) relative errors (hundreds of ulps), not few-ulp ones.
# * MIN_IDENTICAL is not derived from that bound (which allows every element
#   to flip) and cannot be: it is a statistical guard for what stays within
#   the per-element bound but is systematic -- a rounding point missing or
#   misplaced, an output off by one ulp everywhere -- which changes a large
#   fraction of the elements (0.4 % to 100 % for the rounding points, see the
#   per-point tests; 100 % for a 1-ulp bias). Flips need a float32 difference
#   that reaches a boundary: measured 99.74-100 % bit-identical over every
#   family, both settings of mixed_precision, both GEMM paths and both OpenBLAS
#   kernels on one AVX-512 CPU (docs/numerics.md), so 99 % leaves 4x the worst
#   measured mismatch. It is a fraction of all elements, near-zero ones too.
MIN_IDENTICAL = 0.99
FINAL_ULPS = 1
# * The same statistical guard for fp16 (tests/test_float16.py): fp16's ulp is 2^-3 of bf16's, so
#   the same float32 differences reach a rounding boundary ~8x as often, and how often depends on
#   the GEMM library's summation order. Measured on the test families, Zen 3, 2026-12-07, every
#   GEMM path: 99.01-99.98 % bit-identical on OpenBLAS (Haswell kernels) and on the mixed path,
#   95.9-99.9 % with every float32 GEMM on oneDNN's AVX2 kernels (NUMBAFA_GEMM=onednn; the worst:
#   dq of the 2-sections family, each element still within its bound at 0.05x). A missing
#   rounding point (test_the_faithfulness_check_catches_a_missing_rounding_point) leaves 31-73 %
#   of some output identical (acc: dk 73.2 %, dv 73.7 %; p 46-57 %; ds 57-59 %; q_load 31-36 %).
#   The guard sits between the two, at the geometric mean of the mismatches (4.1 % and 26.8 %:
#   10.5 %): 90 %, 2.4x the worst order-only mismatch and 2.7x below the smallest systematic one.
#   The per-element bound (FINAL_ULPS in fp16 ulps + budget) is derived as for bf16 and is the
#   same check; it alone catches every missing point above (1.2-23x the bound).
MIN_IDENTICAL_FP16 = 0.90

# * A float32 output of the bf16 kernel (dsinks of float32 sinks) against the
#   numerics golden: the same float32 terms summed in another order.
FLOAT32_SUM_ORDER = {"rtol": 1e-5, "atol": 1e-7}

# * Forward lse: float32 lse against the float64 golden. float32: the
#   row sums carry float32 noise of ~1e-6 absolute. bf16: rounding Q*scale
#   moves every score by up to 2^-8 of its size, hence the lse by up to
#   ~2^-8 * max|S|; the upstream relative rule (2e-2 of max|lse|) covers it.
LSE_FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
