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

# * Faithfulness of the bf16 kernel to the numerics golden (same rounding
#   points, float32 in between). The two differ only in float32 summation
#   order (BLAS picks its kernel per CPU: OpenBLAS Haswell, SkylakeX, ...)
#   and in the last bit of exp. Those float32-level differences (~1e-6
#   relative) are far below a bf16 ulp (2^-8 relative), so a bf16 rounding
#   point gives the same bf16 value on both sides unless its input lies
#   within that noise of a rounding boundary: then it flips, by one ulp of
#   the value rounded. Error analysis, per output element:
#     - the output's own rounding may flip: FINAL_ULPS = 1 ulp of the element;
#     - each earlier rounding of its accumulator (dQ between KV sections;
#       with mixed_precision=False every rounded addition of dQ/dK/dV) may
#       flip by one ulp of the accumulator *at that point*; later additions
#       carry the flip unchanged. When later terms cancel, the output is
#       smaller than the intermediate, so one such flip can be several ulps
#       of the output (4 measured on an AVX-512 CPU, 2-sections case). The
#       golden returns this sum of ulps (``ulp_budget=True``);
#     - flips of P and dS (kernel_dtype tiles) change a float32 sum by about
#       a bf16 ulp of one term out of hundreds: float32-level noise again,
#       covered by the final rounding's ulp.
#   So |a - e| <= FINAL_ULPS * ulp(e) + budget on every element with
#   |e| >= max|e| / 16 (near zero, float32 noise of a long cancelling sum can
#   exceed the element's own bf16 spacing), and flips are rare: at least
#   MIN_IDENTICAL of all elements are bit-identical (measured 99.88-100 %
#   on both OpenBLAS kernels). A rounding point left out of the kernel is
#   caught by the per-point tests (tests/test_bf16.py), which compare
#   mismatch fractions with and without it.
MIN_IDENTICAL = 0.99
FINAL_ULPS = 1

# * A float32 output of the bf16 kernel (dsinks of float32 sinks) against the
#   numerics golden: the same float32 terms summed in another order.
FLOAT32_SUM_ORDER = {"rtol": 1e-5, "atol": 1e-7}

# * Forward lse: float32 lse against the float64 golden. float32: the
#   row sums carry float32 noise of ~1e-6 absolute. bf16: rounding Q*scale
#   moves every score by up to 2^-8 of its size, hence the lse by up to
#   ~2^-8 * max|S|; the upstream relative rule (2e-2 of max|lse|) covers it.
LSE_FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}
