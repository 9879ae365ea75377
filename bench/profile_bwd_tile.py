"""Time the parts of one (Q group, K tile) step of the backward, one thread.

    python bench/profile_bwd_tile.py [--dtype bf16|float32] [--d-head 128] [--repeats 30]

Builds one head of S 2048 (the benchmark's inputs, o and lse from numbafa's
forward), loads the last Q group (rows 1536:2048) as the kernel does, and
times, inside Numba (no Python per call), each piece of
``backward._flash_attn_bwd_core`` on a full 512-key tile (K tile 0) and on the
diagonal tile (K tile 1536, causal: 128-key sub-blocks): the whole step, the
five GEMMs alone on 512 x 512 operands, and the non-GEMM passes one by one.
Prints the best of ``--repeats`` batches, in ms per call. Which GEMM path
runs follows ``NUMBAFA_GEMM`` (:mod:`numbafa.platform.onednn`).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import numbafa
from numbafa.conventions.dtypes import as_operand, narrowed, round_to_bf16_inplace
from numbafa.kernels import backward as B
from numbafa.kernels.bundles import BwdInputs, make_plan
from numbafa.kernels.common import load_scaled
from numbafa.kernels.matmul import matmul
from numbafa.checks.options import AttentionOptions
from numbafa.checks.validation import validate_bwd_inputs

ONE = np.float32(1.0)
ZERO = np.float32(0.0)
ROWS = 512
Q0 = 1536


@numba.njit
def prepare(ins, plan, scratch, neg_lse, d_sum):
    sec = B.load_kv_section(ins, plan, 0, 0, 0, scratch)
    dq = scratch.dq[:, :ROWS]
    dq[:] = ZERO
    load_scaled(ins.q[0, 0], Q0, ROWS, scratch.q_s, plan.softmax_scale, plan.precision.round_kernel)
    q_op = narrowed(scratch.q_s[:, :ROWS], scratch.q_op, plan.operand)
    dy_n = as_operand(ins.dy[0, 0][:, Q0:Q0 + ROWS], plan.operand)
    B.load_neg_lse(ins.lse[0, 0], Q0, ROWS, plan.precision.bf16_accumulators, neg_lse)
    B.compute_rowsum(ins.o[0, 0], ins.dy[0, 0], Q0, ROWS, plan.tiling.d_tile, d_sum, plan.precision)
    return sec, B.QGroup(Q0, ROWS, q_op, dy_n, dq, neg_lse, d_sum, 0, 0)


@numba.njit
def t_core(plan, sec, qg, scratch, k0, n):
    for _ in range(n):
        B._flash_attn_bwd_core(plan, sec, qg, k0, scratch)


@numba.njit
def t_gemms5(plan, sec, qg, scratch, k0, n):
    """The five GEMMs of a full tile on the kernel's operands (P, dS: whatever the scratch holds)."""
    n_k = 512
    d = qg.q_s.shape[0]
    s_t = scratch.s_t.reshape(n_k, ROWS)
    dp_t = scratch.dp_t.reshape(n_k, ROWS)
    p_t = narrowed(s_t, scratch.p_op, plan.operand)
    ds_t = narrowed(dp_t, scratch.ds_op, plan.operand)
    kd = scratch.kd_psum.reshape(n_k, d)
    dq = scratch.dq_psum.reshape(d, ROWS)
    k = sec.k[:, k0:k0 + n_k]
    v = sec.v[:, k0:k0 + n_k]
    for _ in range(n):
        matmul(k, qg.q_s, s_t, True, False, ONE, ZERO, plan.gemm)
        matmul(v, qg.dy, dp_t, True, False, ONE, ZERO, plan.gemm)
        matmul(k, ds_t, dq, False, False, ONE, ONE, plan.gemm)
        matmul(p_t, qg.dy, sec.dv_acc[k0:k0 + n_k], False, True, ONE, ONE, plan.gemm)
        matmul(ds_t, qg.q_s, sec.dk_acc[k0:k0 + n_k], False, True, ONE, ONE, plan.gemm)


@numba.njit
def t_gemms_sdp(plan, sec, qg, scratch, k0, n):
    n_k = 512
    s_t = scratch.s_t.reshape(n_k, ROWS)
    dp_t = scratch.dp_t.reshape(n_k, ROWS)
    k = sec.k[:, k0:k0 + n_k]
    v = sec.v[:, k0:k0 + n_k]
    for _ in range(n):
        matmul(k, qg.q_s, s_t, True, False, ONE, ZERO, plan.gemm)
        matmul(v, qg.dy, dp_t, True, False, ONE, ZERO, plan.gemm)


@numba.njit
def t_recompute_p_ds(plan, sec, qg, scratch, k0, n):
    blk = B.Block(k0, 512, 0, ROWS)
    for _ in range(n):
        B.recompute_p_ds(plan, sec, qg, blk, scratch)


@numba.njit
def t_softmax(plan, sec, qg, scratch, k0, s_keep, dp_keep, n):
    """Copy S^T and dP^T back, then Steps 2.3-4 (subtract t_copy)."""
    s_t = scratch.s_t.reshape(512, ROWS)
    dp_t = scratch.dp_t.reshape(512, ROWS)
    for _ in range(n):
        s_t[:] = s_keep
        dp_t[:] = dp_keep
        B.recompute_softmax_backward(s_t, dp_t, k0, Q0, qg, plan)


@numba.njit
def t_copy(plan, sec, qg, scratch, k0, s_keep, dp_keep, n):
    s_t = scratch.s_t.reshape(512, ROWS)
    dp_t = scratch.dp_t.reshape(512, ROWS)
    for _ in range(n):
        s_t[:] = s_keep
        dp_t[:] = dp_keep


@numba.njit
def t_round2(plan, sec, qg, scratch, k0, n):
    """Two bf16 rounding passes over a 512 x 512 tile (P and dS), row by row as the kernel."""
    s_t = scratch.s_t.reshape(512, ROWS)
    dp_t = scratch.dp_t.reshape(512, ROWS)
    for _ in range(n):
        for j in range(512):
            round_to_bf16_inplace(s_t[j])
            round_to_bf16_inplace(dp_t[j])


@numba.njit
def t_narrow2(plan, sec, qg, scratch, k0, n):
    s_t = scratch.s_t.reshape(512, ROWS)
    dp_t = scratch.dp_t.reshape(512, ROWS)
    for _ in range(n):
        narrowed(s_t, scratch.p_op, plan.operand)
        narrowed(dp_t, scratch.ds_op, plan.operand)


@numba.njit
def t_update(plan, sec, qg, scratch, k0, n):
    blk = B.Block(k0, 512, 0, ROWS)
    s_t = scratch.s_t.reshape(512, ROWS)
    dp_t = scratch.dp_t.reshape(512, ROWS)
    p_t = narrowed(s_t, scratch.p_op, plan.operand)
    ds_t = narrowed(dp_t, scratch.ds_op, plan.operand)
    d = qg.q_s.shape[0]
    dq = scratch.dq_psum.reshape(d, ROWS)
    for _ in range(n):
        B.update_gradients(plan, sec, qg, blk, p_t, ds_t, dq, False, scratch)


@numba.njit
def t_accumulate(plan, sec, qg, scratch, k0, n):
    d = qg.q_s.shape[0]
    dq = scratch.dq_psum.reshape(d, ROWS)
    for _ in range(n):
        B.accumulate(qg.dq, dq, plan.softmax_scale, plan.precision.bf16_accumulators)


def best(fn, args, n, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args, n)
        times.append((time.perf_counter() - t) / n * 1e3)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--d-head", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args()
    numba.set_num_threads(1)
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if args.dtype == "bf16" else np.float32
    rng = np.random.default_rng(0)
    shape = (1, 1, args.d_head, 2048)
    q, k, v, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, mixed_precision=True,
                                   lse_layout="natural")
    prob = validate_bwd_inputs(q, k, v, o, dy, lse, AttentionOptions(use_causal_mask=True, mixed_precision=True))
    plan = make_plan(prob, backward=True)
    ins = BwdInputs(prob.q, prob.k, prob.v, prob.o, prob.dy, prob.lse, prob.sinks)
    scratch = B.make_scratch(args.d_head, 2048, plan)
    neg_lse = np.empty(2048, np.float32)
    d_sum = np.empty(2048, np.float32)
    print(f"GEMM path: {__import__('numbafa.platform.onednn').onednn.gemm_path()[0]}, operand {plan.operand.dtype}, "
          f"d_head {args.d_head}, dtype {args.dtype}, 1 thread")
    with numbafa.platform.blas.single_threaded_blas():
        sec, qg = prepare(ins, plan, scratch, neg_lse, d_sum)
        # realistic S^T and dP^T of the diagonal-free tile 0
        t_gemms_sdp(plan, sec, qg, scratch, 0, 1)
        s_keep = scratch.s_t.reshape(512, ROWS).copy()
        dp_keep = scratch.dp_t.reshape(512, ROWS).copy()
        rows = []
        common = (plan, sec, qg, scratch)
        for name, fn, k0, extra in [
            ("core, full tile (k0=0)", t_core, 0, ()),
            ("core, diagonal tile (k0=1536)", t_core, 1536, ()),
            ("5 GEMMs alone, 512x512xd", t_gemms5, 0, ()),
            ("  S + dP GEMMs", t_gemms_sdp, 0, ()),
            ("recompute_p_ds (full)", t_recompute_p_ds, 0, ()),
            ("  copy S,dP back (subtract)", t_copy, 0, (s_keep, dp_keep)),
            ("  copy + softmax bwd (mask/exp/dS/round)", t_softmax, 0, (s_keep, dp_keep)),
            ("  2 bf16 rounding passes (in the softmax)", t_round2, 0, ()),
            ("  2 narrowed copies (P, dS)", t_narrow2, 0, ()),
            ("update_gradients (full)", t_update, 0, ()),
            ("dQ PSUM accumulate", t_accumulate, 0, ()),
        ]:
            a = common + (k0,) + extra
            fn(*a, 1)
            rows.append((name, best(fn, a, args.n, args.repeats)))
        for causal, n_tiles in ((False, 16), (True, 10)):
            o2, lse2 = numbafa.attention_fwd(q, k, v, use_causal_mask=causal, mixed_precision=True,
                                             lse_layout="natural")
            numbafa.attention_bwd(q, k, v, o2, dy, lse2, use_causal_mask=causal, mixed_precision=True)
            times = []
            for _ in range(max(3, args.repeats // 3)):
                t = time.perf_counter()
                numbafa.attention_bwd(q, k, v, o2, dy, lse2, use_causal_mask=causal,
                                      mixed_precision=True)
                times.append((time.perf_counter() - t) / n_tiles * 1e3)
            rows.append((f"whole backward / {n_tiles} tiles ({'causal' if causal else 'full'})",
                         min(times)))
    for name, ms in rows:
        print(f"{name:45s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
