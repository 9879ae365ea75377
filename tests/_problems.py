"""Test problems: random inputs plus o/lse from the float64 golden forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from numbafa import golden


def bounds_from_lengths(lengths):
    """Packing bounds for back-to-back sequences of the given lengths."""
    bmin, bmax = [], []
    start = 0
    for n in lengths:
        bmin += [start] * n
        bmax += [start + n] * n
        start += n
    return np.array(bmin, dtype=np.float32), np.array(bmax, dtype=np.float32)


@dataclass
class Case:
    """One backward test case: shapes and options."""

    bs: int = 1
    nheads: int = 2
    nheads_kv: int = 2
    d_head: int = 64
    seqlen_q: int = 256
    seqlen_k: int = 256
    causal: bool = False
    window: int | None = None
    packing: tuple | None = None       # sequence lengths summing to seqlen_q
    num_sinks: int = 0                 # 0: none; 1: sinks [bs, nheads]; n > 1: [bs, nheads, n]
    softmax_scale: float | None = None
    seed: int = 0
    options: dict = field(default_factory=dict)

    def kwargs(self):
        """Options shared by the golden and the kernel (no arrays but bounds/sinks)."""
        kw = dict(use_causal_mask=self.causal, softmax_scale=self.softmax_scale,
                  sliding_window=self.window)
        if self.packing is not None:
            kw["bound_min"], kw["bound_max"] = bounds_from_lengths(self.packing)
        return kw


def make_inputs(case: Case, dtype=np.float32):
    """Inputs of ``attention_bwd`` for ``case``: a dict of keyword arguments.

    q/k/v/dy are standard normal, rounded to ``dtype``; o and lse come from the
    float64 golden forward of the rounded q/k/v, o rounded to ``dtype`` and
    lse to float32 (natural layout).
    """
    rng = np.random.default_rng(case.seed)
    q_shape = (case.bs, case.nheads, case.d_head, case.seqlen_q)
    kv_shape = (case.bs, case.nheads_kv, case.d_head, case.seqlen_k)
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(kv_shape).astype(dtype)
    v = rng.standard_normal(kv_shape).astype(dtype)
    dy = rng.standard_normal(q_shape).astype(dtype)
    kw = case.kwargs()
    if case.num_sinks:
        shape = (case.bs, case.nheads) + ((case.num_sinks,) if case.num_sinks > 1 else ())
        kw["sinks_ref"] = rng.standard_normal(shape).astype(np.float32)
    o, lse = golden.attention_fwd(q, k, v, sinks=kw.get("sinks_ref"), bound_min=kw.get("bound_min"),
                                  bound_max=kw.get("bound_max"), use_causal_mask=case.causal,
                                  softmax_scale=case.softmax_scale, sliding_window=case.window)
    return dict(q_ref=q, k_ref=k, v_ref=v, o_ref=o.astype(dtype), dy_ref=dy,
                lse_ref=lse.astype(np.float32), **kw)
