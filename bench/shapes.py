"""Benchmark shapes, shared by the pytest-benchmark suite and compare.py.

Each shape: (id, batch, q-heads, KV heads, seqlen, head_dim, options); the
option ``head_dim_v`` gives v (and o, dy) a head dim of its own.
FLOPs follow flash-attention's convention: forward 4*B*Hq*Sq*Sk*D, halved
when causal; backward 2.5x the forward. A causal window of w < S keys counts
its visible (query, key) pairs exactly, w*S - w*(w - 1)/2 of S*S (before
2026-12-06 it counted half of them, which put the window shape's figures 2.3x
too high: 113 % of the bf16 peak). With two head dims the products are
counted as they are: forward 2*B*Hq*Sq*Sk*(D + Dv) (S = Q^T K, O = P V),
backward 2*B*Hq*Sq*Sk*(3 D + 2 Dv) (S, dQ, dK over D; dP, dV over Dv).
"""

from __future__ import annotations

import numpy as np

SHAPES = [
    ("h8-s2048-d128-full", 1, 8, 8, 2048, 128, dict(use_causal_mask=False)),
    ("h8-s2048-d128-causal", 1, 8, 8, 2048, 128, dict(use_causal_mask=True)),
    ("gqa32/8-s2048-d128-causal", 1, 32, 8, 2048, 128, dict(use_causal_mask=True)),
    ("h8-s4096-d64-causal", 1, 8, 8, 4096, 64, dict(use_causal_mask=True)),
    ("h8-s4096-d128-full", 1, 8, 8, 4096, 128, dict(use_causal_mask=False)),
    ("h8-s4096-d128-causal", 1, 8, 8, 4096, 128, dict(use_causal_mask=True)),
    ("gqa8/2-s2048-d128-causal-window512-sinks", 1, 8, 2, 2048, 128,
     dict(use_causal_mask=True, sliding_window=512, sinks=1)),
]


#: Shapes of training small models on a CPU (B*H 1-64, S 128-1024, d 32-128): many short calls,
#: where a call's fixed cost counts as much as its kernel.
TRAINING_SHAPES = [
    ("train-b1-h1-s128-d64-causal", 1, 1, 1, 128, 64, dict(use_causal_mask=True)),
    ("train-b8-h4-s256-d32-causal", 8, 4, 4, 256, 32, dict(use_causal_mask=True)),
    ("train-b16-h4-s128-d32-full", 16, 4, 4, 128, 32, dict(use_causal_mask=False)),
    ("train-b4-h8-s512-d64-causal", 4, 8, 8, 512, 64, dict(use_causal_mask=True)),
    ("train-b2-h8/2-s1024-d128-causal", 2, 8, 2, 1024, 128, dict(use_causal_mask=True)),
]


#: A value head dim of its own: DeepSeek's MLA trains with d_qk 192, d_v 128 (torch's CPU SDPA
#: runs it on its math backend, which materialises the S x S scores).
HEAD_DIM_SHAPES = [
    ("mla-h8-s2048-d192-dv128-causal", 1, 8, 8, 2048, 192, dict(use_causal_mask=True, head_dim_v=128)),
    ("mla-gqa16/4-s2048-d192-dv128-causal", 1, 16, 4, 2048, 192, dict(use_causal_mask=True, head_dim_v=128)),
]


def forward_flops(bs, nheads, seqlen, d_head, options):
    return flops("forward", bs, nheads, seqlen, d_head, options)


def visible_fraction(seqlen, options) -> float:
    """The share of the ``seqlen x seqlen`` (query, key) pairs the mask leaves visible: all, the
    causal half (flash-attention's convention), or a causal window's exact pairs."""
    if not options.get("use_causal_mask"):
        return 1.0
    window = options.get("sliding_window") or 0
    if 0 < window < seqlen:
        return (window * seqlen - window * (window - 1) / 2) / seqlen ** 2
    return 0.5


def flops(pass_, bs, nheads, seqlen, d_head, options):
    """FLOPs of one pass (module docstring)."""
    visible = visible_fraction(seqlen, options)
    d_v = options.get("head_dim_v", d_head)
    dims = {"forward": d_head + d_v, "backward": 3 * d_head + 2 * d_v, "step": 4 * d_head + 3 * d_v}[pass_]
    return 2.0 * bs * nheads * seqlen * seqlen * dims * visible


def make_inputs(bs, nheads, nheads_kv, seqlen, d_head, dtype, options, seed=0):
    """q, k, v, dy in the Neuron layout and the numbafa keyword options."""
    rng = np.random.default_rng(seed)
    d_v = options.get("head_dim_v", d_head)
    q = rng.standard_normal((bs, nheads, d_head, seqlen)).astype(dtype)
    k = rng.standard_normal((bs, nheads_kv, d_head, seqlen)).astype(dtype)
    v = rng.standard_normal((bs, nheads_kv, d_v, seqlen)).astype(dtype)
    dy = rng.standard_normal((bs, nheads, d_v, seqlen)).astype(dtype)
    kwargs = {k_: v_ for k_, v_ in options.items() if k_ not in ("sinks", "head_dim_v")}
    if options.get("sinks"):
        kwargs["sinks_ref"] = rng.standard_normal((bs, nheads)).astype(np.float32)
    return q, k, v, dy, kwargs
