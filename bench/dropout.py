"""The cost of attention dropout: p = 0.1 against p = 0, alternated in one process.

    python bench/dropout.py [--repeats 7] [--shape h8-s2048-d128-full]

Prints, per dtype and pass, the median time without and with dropout and
their ratio (issue target: backward <= 1.15x, forward <= 1.2x). The two
calls alternate, so machine noise hits both alike; the machine and its
numbafa backend are printed first.
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

DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shape", default=SHAPES[0][0], choices=[s[0] for s in SHAPES])
    parser.add_argument("--p", type=float, default=0.1)
    args = parser.parse_args()
    info = numbafa.backend_info()
    print(f"# {platform.processor() or platform.machine()}; "
          f"{json.dumps({k: info[k] for k in ('cpu', 'gemm', 'threads') if k in info}, default=str)}")
    name, bs, h, hkv, s, d, options = next(x for x in SHAPES if x[0] == args.shape)
    print(f"# {name}, dropout_p={args.p}, {args.repeats} alternated repeats, medians in ms")
    print(f"{'dtype':8} {'pass':9} {'p=0':>8} {'p=' + str(args.p):>8} {'ratio':>6}")
    for dtype_name, dtype in DTYPES.items():
        q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, dtype, options)
        kw["mixed_precision"] = True
        calls = {}
        for p in (0.0, args.p):
            kwp = dict(kw, dropout_p=p, seed=7)
            o, lse = numbafa.attention_fwd(q, k, v, **kwp)   # warm-up (and compile)
            calls[p] = (lambda kwp=kwp: numbafa.attention_fwd(q, k, v, **kwp),
                        lambda kwp=kwp, o=o, lse=lse: numbafa.attention_bwd(q, k, v, o, dy, lse, **kwp))
            calls[p][1]()
        for i_pass, pass_name in enumerate(("forward", "backward")):
            times = {p: [] for p in calls}
            for _ in range(args.repeats):
                for p in calls:
                    times[p].append(_time(calls[p][i_pass]))
            base, drop = (statistics.median(times[p]) * 1e3 for p in calls)
            print(f"{dtype_name:8} {pass_name:9} {base:8.1f} {drop:8.1f} {drop / base:6.2f}")


if __name__ == "__main__":
    main()
