"""Measured error of numbafa.attention_bwd against the float64 golden.

Prints a Markdown table: for each shape, the max relative error
``max|a - e| / max|e|`` per gradient, for float32 inputs, bf16 inputs with
``mixed_precision=True`` and bf16 with ``mixed_precision=False``; plus the
share of bf16 elements bit-identical to the numerics golden
(``golden.attention_bwd_rounded``). The golden materialises S x S float64
matrices per head: allow a few seconds per shape.

    python bench/accuracy.py
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import numbafa
from numbafa import golden

from shapes import make_inputs

SHAPES = [
    # (label, bs, nheads, nheads_kv, d_head, seqlen, options)
    ("GQA 8/2, d128, S2048, causal", 1, 8, 2, 128, 2048, dict(use_causal_mask=True)),
    ("MHA 4, d64, S4096, causal, window 1024", 1, 4, 4, 64, 4096,
     dict(use_causal_mask=True, sliding_window=1024)),
    ("MHA 4, d256, S5120 (2 KV sections), full, 1 sink", 1, 4, 4, 256, 5120, dict(sinks=True)),
]


def make(bs, nheads, nheads_kv, d_head, seqlen, dtype, options):
    """Backward inputs: random q/k/v/dy (bench/shapes.py) plus o, lse from the float64 golden."""
    q, k, v, dy, kw = make_inputs(bs, nheads, nheads_kv, seqlen, d_head, dtype, options)
    o, lse = golden.attention_fwd(q, k, v, sinks=kw.get("sinks_ref"), use_causal_mask=kw.get("use_causal_mask", False),
                                  sliding_window=kw.get("sliding_window"))
    return dict(q_ref=q, k_ref=k, v_ref=v, o_ref=o.astype(dtype), dy_ref=dy, lse_ref=lse.astype(np.float32), **kw)


def cells(got, exact):
    errs = [f"{rel(g, e):.1e}" for g, e in zip(got, exact)]
    return " | ".join(errs + ["-"] * (4 - len(errs)))


def rel(a, e):
    return float(np.abs(np.asarray(a, np.float64) - e).max() / np.abs(e).max())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first shape")
    args = parser.parse_args(argv)
    print("| shape | inputs | dq | dk | dv | dsinks | bit-identical to numerics golden (dq/dk/dv) |")
    print("|---|---|---|---|---|---|---|")
    for label, bs, h, hkv, d, s, opts in SHAPES[:1] if args.quick else SHAPES:
        f32 = make(bs, h, hkv, d, s, np.float32, opts)
        exact = golden.attention_bwd(**f32)
        got = numbafa.attention_bwd(**f32)
        print(f"| {label} | float32 | {cells(got, exact)} | - |")
        b16 = make(bs, h, hkv, d, s, ml_dtypes.bfloat16, opts)
        exact = golden.attention_bwd(**b16)
        for mixed in (True, False):
            got = numbafa.attention_bwd(**b16, mixed_precision=mixed)
            emu = golden.attention_bwd_rounded(**b16, mixed_precision=mixed)
            same = [float(np.mean(g.astype(np.float32) == e)) for g, e in zip(got[:3], emu[:3])]
            print(f"| {label} | bf16, mixed_precision={mixed} | {cells(got, exact)} | "
                  + " / ".join(f"{x:.2%}" for x in same) + " |")


if __name__ == "__main__":
    main()
