"""The input dtypes side by side: float32, bf16, float16 and float64, alternated in one process.

    python bench/dtypes.py [--repeats 7] [--shape h8-s2048-d128-causal]

Prints, per pass, the median time of each dtype (``mixed_precision=True``)
and the ratios the dtypes are held to: float64's backward against
float32's (target <= 2.5x) and float16 against bf16 (target <= 1.1x; both
on the same GEMM path: bf16 values or fp16 values in float32 tiles on the
BLAS path). The dtypes alternate within each repeat, so machine noise hits
all alike; the machine and its numbafa backend are printed first.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import ml_dtypes
import numpy as np

import numbafa

from shapes import SHAPES, make_inputs

DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16, "float16": np.float16, "float64": np.float64}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _calls(shape):
    """Per dtype, the forward and backward calls of ``shape`` (compiled and warmed up here)."""
    _, bs, h, hkv, s, d, options = shape
    calls = {}
    for name, dtype in DTYPES.items():
        q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, dtype, options)
        kw = dict(kw, mixed_precision=True)
        o, lse = numbafa.attention_fwd(q, k, v, **kw)
        numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
        calls[name] = {"forward": lambda q=q, k=k, v=v, kw=kw: numbafa.attention_fwd(q, k, v, **kw),
                       "backward": lambda q=q, k=k, v=v, o=o, dy=dy, lse=lse, kw=kw:
                       numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)}
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shape", default="h8-s2048-d128-causal", choices=[s[0] for s in SHAPES])
    args = parser.parse_args()
    info = numbafa.backend_info()
    print(f"{platform.machine()} {info['cpu_model']}, GEMM path {info['gemm']['path']}, threads {info['threads']}")
    calls = _calls(next(s for s in SHAPES if s[0] == args.shape))
    medians = {}
    for pass_ in ("forward", "backward"):
        times = {name: [] for name in DTYPES}
        for _ in range(args.repeats):
            for name in DTYPES:
                times[name].append(_time(calls[name][pass_]))
        medians[pass_] = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        m = medians[pass_]
        print(f"{args.shape} {pass_}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in m.items())
              + f"; float64/float32 {m['float64'] / m['float32']:.2f}x, float16/bf16 {m['float16'] / m['bf16']:.2f}x")
    print(json.dumps({"shape": args.shape, "median_ms": medians}))


if __name__ == "__main__":
    main()
