"""The exact rescale of a pass cut into shares (Dask): the client's checks, and ``2**e`` back.

A whole call checks its values and the range of its scores, and rescales a pass whose sums may
overflow, in its compiled entry (:mod:`numbafa.kernels.entry`). The shares of one call on a Dask
cluster must run with one rescale: :func:`check` runs the entry's checks alone (no work item) on
the whole problem and returns its exponent ``e``; each share's compiled entry then computes on
``v`` or ``dy`` times ``2**-e`` (its ``exponent`` argument: the scaling is the entry's, exact, a
power of two keeps every mantissa) and leaves its outputs scaled; the merged outputs are
multiplied back here, by :func:`unscaled_output`: the entry's own compiled rescale
(:func:`numbafa.kernels.entry.unscale_output`) and its error.
"""

from __future__ import annotations

import numpy as np

from ..checks.options import KERNEL_CALLER

__all__ = ["check", "unscaled_output"]


def check(prob, caller, backward: bool) -> int:
    """The checks of a call's compiled entry on the whole problem ``prob`` (values, range), none of
    its work items: the exponent ``e`` of the rescale its passes need (raises as the call would)."""
    from .core import raise_status, run_bwd, run_fwd
    from ..kernels.bundles import BwdInputs, FwdInputs, make_plan

    none = np.empty(0, dtype=np.int64)
    plan = make_plan(prob, backward)
    if backward:
        ins = BwdInputs(q=prob.q, k=prob.k, v=prob.v, o=prob.o, dy=prob.dy, lse=prob.lse, sinks=prob.sinks)
        *_, e, status = run_bwd(ins, plan, none, none)
    else:
        _, e, status = run_fwd(FwdInputs(prob.q, prob.k, prob.v, prob.sinks), plan, none)
    if status[0]:
        raise_status(status, prob, caller)
    return int(e)


def unscaled_output(x: np.ndarray, e: int, name: str) -> np.ndarray:
    """An output (float32, float64 or bf16) of a pass run on inputs scaled by ``2**-e``, times
    ``2**e`` (exact), by the compiled entry's rescale; raise its ``FloatingPointError`` if it
    leaves the range of float32 (float64 for a float64 output: the exact output is not
    representable). A gradient is scanned first, as a whole call's entry scans it: NaN or inf in
    it is the ``ValueError`` of an lse that is not the scores' log-sum-exp."""
    from .core import raise_status
    from ..kernels.entry import OUTPUTS, STATUS_WORDS, unscale_output

    if e == 0 and name == "o":
        return x
    acc = np.dtype(np.float64 if x.dtype.char == "d" else np.float32)
    # (with e > 0 a copy: the merged output may be a worker's buffer; with e == 0 only scanned)
    out = np.array(x, dtype=acc, order="C") if e else np.ascontiguousarray(x, dtype=acc)
    status = np.zeros(STATUS_WORDS, dtype=np.int64)
    unscale_output(out.reshape(-1), np.int64(e), np.int64(OUTPUTS.index(name)), status)
    if status[0]:
        raise_status(status, None, KERNEL_CALLER, acc=acc)
    return out.astype(x.dtype, copy=False) if e else x
