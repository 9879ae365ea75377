"""Time the parts of one (Q group, K tile) step of the backward, one thread.

    python bench/profile_bwd_tile.py [--dtype bf16|float32] [--d-head 128] [--seqlen 2048] [--repeats 30]

Builds one head of ``--seqlen`` tokens (a multiple of 512 from 1024; the benchmark's inputs, o and lse from
numbafa's forward), loads the last Q group (the plan's group rows: 512 at S 2048) as the kernel does
(``backward.load_kv_section``, ``load_q_group``), and times, inside Numba (no Python per call),
the kernel's own steps on a full 512-key tile (K tile 0) and on the diagonal tile (the last K
tile, causal: 128-key blocks): the whole step (``_flash_attn_bwd_core``), its S and dP GEMMs alone, Steps 2-4
(``recompute_p_ds``: the two GEMMs, mask, exp, dS and the operands' copies) and Steps 5.1,
3.1, 5.2 (``update_gradients``: the dQ, dV and dK GEMMs and accumulations); then the whole
backward per tile. Prints the best of ``--repeats`` batches of ``--n`` calls, in ms per call.
Which GEMM path runs follows ``NUMBAFA_GEMM`` (:mod:`numbafa.platform.onednn`).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import numbafa
from numbafa.checks.options import AttentionOptions
from numbafa.checks.validation import validate_bwd_inputs
from numbafa.kernels import backward as B
from numbafa.kernels.bundles import BwdInputs, make_plan
from numbafa.kernels.matmul import gemm
from numbafa.kernels.launch import prepare_backward
from numbafa.kernels.stored import stored_bwd
from numbafa.kernels.loops import columns
from numbafa.pipeline.core import bwd_outputs, new_bwd_stats
from numbafa.platform.blas import single_threaded_blas

ONE = np.float32(1.0)
ZERO = np.float32(0.0)


@numba.njit
def prepare(ins, outs, stats, plan, d_head, seqlen, last_group):
    """An item's scratch, the first section and the last Q group of head (0, 0), as
    ``bwd_work_item`` makes and loads them."""
    scratch = B.make_scratch(d_head, d_head, seqlen, seqlen, plan)
    copies = B.make_copies(ins.k.is_bits, plan, d_head, d_head, scratch)
    sec = B.load_kv_section(ins.k, ins.v, plan, 0, 0, 0, scratch, copies)
    head = B.Head(0, 0, stats.neg_lse[0, 0], stats.d_sum[0, 0])
    q_ins = B.QInputs(q=ins.q, o=ins.o, dy=ins.dy, lse=ins.lse)
    return scratch, sec, B.load_q_group(q_ins, outs, plan, sec, head, last_group, scratch, copies)


@numba.njit
def t_core(plan, sec, qg, scratch, k0, n):
    for _ in range(n):
        B._flash_attn_bwd_core(plan, sec, qg, k0, scratch)


@numba.njit
def t_gemms_sdp(plan, sec, qg, scratch, k0, n):
    """Step 2.1 ``S^T = K^T Q_s`` and Step 3.2 ``dP^T = V^T dO`` of a full 512-key tile."""
    s_t = scratch.s_t[:512 * qg.rows].reshape(512, qg.rows)
    dp_t = scratch.dp_t[:512 * qg.rows].reshape(512, qg.rows)
    for _ in range(n):
        gemm(columns(sec.k, k0, k0 + 512), qg.q_s, s_t, trans_a=True, trans_b=False, alpha=ONE, beta=ZERO,
             path=plan.gemm)
        gemm(columns(sec.v, k0, k0 + 512), qg.dy, dp_t, trans_a=True, trans_b=False, alpha=ONE, beta=ZERO,
             path=plan.gemm)


@numba.njit
def t_recompute_p_ds(plan, sec, qg, scratch, k0, n):
    blk = B.Block(k0, 512, 0, qg.rows)
    for _ in range(n):
        B.recompute_p_ds(plan, sec, qg, blk, scratch)


@numba.njit
def t_update(plan, sec, qg, scratch, k0, n):
    blk = B.Block(k0, 512, 0, qg.rows)
    p_t, ds_t = B.recompute_p_ds(plan, sec, qg, blk, scratch)
    dq_psum = scratch.dq_psum[:qg.dq.shape[0] * qg.rows].reshape(qg.dq.shape[0], qg.rows)
    for _ in range(n):
        B.update_gradients(plan, sec, qg, blk, p_t, ds_t, dq_psum, False, scratch)


def best(fn, args, n, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args, n)
        times.append((time.perf_counter() - t) / n * 1e3)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "float32"])
    ap.add_argument("--d-head", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048, help="a multiple of 512 (the K tile and the Q group) from 1024")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--n", type=int, default=10)
    args = ap.parse_args(argv)
    if args.seqlen < 1024 or args.seqlen % 512:   # K tile 0 unmasked for the last Q group
        ap.error(f"--seqlen must be a multiple of 512 from 1024, got {args.seqlen}")
    seq, n_k = args.seqlen, args.seqlen // 512
    numba.set_num_threads(1)
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if args.dtype == "bf16" else np.float32
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((1, 1, args.d_head, seq)).astype(dtype) for _ in range(4))
    options = AttentionOptions(use_causal_mask=True, mixed_precision=True)
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, mixed_precision=True, lse_layout="natural")
    prob = validate_bwd_inputs(q, k, v, o, dy, lse, options)
    plan = make_plan(prob, backward=True)
    raw = BwdInputs(prob.q, prob.k, prob.v, prob.o, prob.dy, prob.lse, prob.sinks)
    outs, stats = bwd_outputs(raw, plan), new_bwd_stats(raw, plan)
    ins = stored_bwd(raw, plan.acc)   # the inputs' storage records, as the entry passes them
    prepare_backward(ins, outs, stats, plan, finish=False)   # the bf16 steps' plugins, as a call registers them
    print(f"GEMM path {'oneDNN' if plan.gemm.onednn or plan.gemm.bits else 'BLAS'}, bf16 operands "
          f"{plan.gemm.bits}, d_head {args.d_head}, dtype {args.dtype}, Q groups of {plan.tiling.group_rows} rows, 1 thread, "
          f"{numbafa.backend_info()['cpu_model']}")
    rows = []
    with single_threaded_blas():
        last_group = seq // plan.tiling.group_rows - 1   # the plan's Q groups (256 rows at S 1024)
        scratch, sec, qg = prepare(ins, outs, stats, plan, args.d_head, seq, last_group)
        for name, fn, k0 in [("core, full tile (k0=0)", t_core, 0),
                             (f"core, diagonal tile (k0={seq - 512})", t_core, seq - 512),
                             ("  S + dP GEMMs, 512 keys", t_gemms_sdp, 0),
                             ("  recompute_p_ds (Steps 2-4), full", t_recompute_p_ds, 0),
                             ("  update_gradients (Steps 5.1, 3.1, 5.2), full", t_update, 0)]:
            a = (plan, sec, qg, scratch, k0)
            fn(*a, 1)
            rows.append((name, best(fn, a, args.n, args.repeats)))
        for causal, n_tiles in ((False, n_k * n_k), (True, n_k * (n_k + 1) // 2)):
            kw = dict(use_causal_mask=causal, mixed_precision=True)
            o2, lse2 = numbafa.attention_fwd(q, k, v, **kw)
            numbafa.attention_bwd(q, k, v, o2, dy, lse2, **kw)
            times = []
            for _ in range(max(3, args.repeats // 3)):
                t = time.perf_counter()
                numbafa.attention_bwd(q, k, v, o2, dy, lse2, **kw)
                times.append((time.perf_counter() - t) / n_tiles * 1e3)
            rows.append((f"whole backward / {n_tiles} tiles ({'causal' if causal else 'full'})", min(times)))
    for name, ms in rows:
        print(f"{name:48s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
