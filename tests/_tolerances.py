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
