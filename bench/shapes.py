"""Benchmark shapes, shared by the pytest-benchmark suite and compare.py.

Each shape: (id, batch, q-heads, KV heads, seqlen, head_dim, options).
FLOPs follow flash-attention's convention: forward 4*B*Hq*Sq*Sk*D, halved
when causal; backward 2.5x the forward.
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


def forward_flops(bs, nheads, seqlen, d_head, options):
    visible = 0.5 if options.get("use_causal_mask") else 1.0
    return 4.0 * bs * nheads * seqlen * seqlen * d_head * visible


def make_inputs(bs, nheads, nheads_kv, seqlen, d_head, dtype, options, seed=0):
    """q, k, v, dy in the Neuron layout and the numbafa keyword options."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((bs, nheads, d_head, seqlen)).astype(dtype)
    k = rng.standard_normal((bs, nheads_kv, d_head, seqlen)).astype(dtype)
    v = rng.standard_normal((bs, nheads_kv, d_head, seqlen)).astype(dtype)
    dy = rng.standard_normal((bs, nheads, d_head, seqlen)).astype(dtype)
    kwargs = {k_: v_ for k_, v_ in options.items() if k_ != "sinks"}
    if options.get("sinks"):
        kwargs["sinks_ref"] = rng.standard_normal((bs, nheads)).astype(np.float32)
    return q, k, v, dy, kwargs
