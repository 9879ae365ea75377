"""``python -m numbafa``: run the backward on a built-in default shape, check it, time it.

The forward (o, lse) comes from the float64 golden, the gradients from the
kernel; the kernel's result is compared with the golden backward and the
kernel is timed after a warm-up call (the first call includes JIT compile,
reported separately).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import __version__, golden
from .api import attention_bwd
from .dtypes import BFLOAT16


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m numbafa", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--heads", type=_positive_int, default=8, help="q heads (default 8)")
    p.add_argument("--kv-heads", type=_positive_int, default=2, help="KV heads (default 2)")
    p.add_argument("--seqlen", type=_positive_int, default=2048)
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--dtype", choices=("float32", "bf16"), default="float32")
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls (median reported)")
    p.add_argument("--version", action="version", version=f"numbafa {__version__}")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.heads % args.kv_heads:
        print(f"error: --heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})",
              file=sys.stderr)
        return 2
    dtype = BFLOAT16 if args.dtype == "bf16" else np.dtype(np.float32)
    causal = not args.no_causal
    b, h, hkv, s, d = args.batch, args.heads, args.kv_heads, args.seqlen, args.head_dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, d, s)).astype(dtype)
    k = rng.standard_normal((b, hkv, d, s)).astype(dtype)
    v = rng.standard_normal((b, hkv, d, s)).astype(dtype)
    dy = rng.standard_normal((b, h, d, s)).astype(dtype)
    print(f"numbafa {__version__}: attention_bwd q [{b}, {h}, {d}, {s}], k/v [{b}, {hkv}, {d}, {s}], "
          f"{args.dtype}, {'causal' if causal else 'full'}")
    t0 = time.perf_counter()
    o, lse = golden.attention_fwd(q, k, v, use_causal_mask=causal, lse_layout="neuron" if s % 128 == 0
                                  else "natural")
    o, lse = o.astype(dtype), lse.astype(np.float32)
    print(f"  golden forward (float64)         {time.perf_counter() - t0:8.2f} s")
    kwargs = dict(use_causal_mask=causal, mixed_precision=True)

    t0 = time.perf_counter()
    grads = attention_bwd(q, k, v, o, dy, lse, **kwargs)
    print(f"  first call (includes JIT compile) {time.perf_counter() - t0:8.2f} s")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        attention_bwd(q, k, v, o, dy, lse, **kwargs)
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    flops = 10.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    print(f"  backward, median of {args.repeats}         {median * 1e3:8.1f} ms  "
          f"({flops / median / 1e9:.0f} GFLOP/s)")

    expected = golden.attention_bwd(q, k, v, o, dy, lse, **kwargs)
    ok = True
    rtol = 1e-4 if dtype == np.float32 else 2e-2
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        err = float(np.abs(g.astype(np.float64) - e).max())
        bound = 1e-5 + rtol * float(np.abs(e).max())
        ok &= err <= bound
        print(f"  {name}: max|kernel - golden| = {err:.2e}  (bound {bound:.2e}) "
              f"{'ok' if err <= bound else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
