"""pytest-benchmark suite: forward and backward, float32 and bf16, per shape.

Off in the normal test run (``testpaths = tests``); run with

    python -m pytest bench --benchmark-enable

Every benchmark is warmed up (JIT compile happens outside the timing) and
records GFLOP/s in ``extra_info``. ``test_compile_time`` times a cold first
call in a fresh process, i.e. compilation.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import numbafa

from shapes import SHAPES, forward_flops, make_inputs

DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16}
ROUNDS = 5


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_attention(benchmark, pass_, shape, dtype):
    name, bs, h, hkv, s, d, options = shape
    q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, DTYPES[dtype], options)
    kw["mixed_precision"] = True
    o, lse = numbafa.attention_fwd(q, k, v, **kw)        # also the warm-up (compile)
    if pass_ == "forward":
        def run():
            return numbafa.attention_fwd(q, k, v, **kw)
        flops = forward_flops(bs, h, s, d, options)
    else:
        numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)

        def run():
            return numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
        flops = 2.5 * forward_flops(bs, h, s, d, options)
    benchmark.group = f"{name} {pass_}"
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:   # None under --benchmark-disable
        benchmark.extra_info["gflops"] = flops / benchmark.stats.stats.median / 1e9
        benchmark.extra_info["flops"] = flops


DROPOUT_SHAPE = SHAPES[0]  # h8-s2048-d128-full, the standard shape


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_dropout(benchmark, pass_, dropout_p, dtype):
    """The cost of the dropout mask (its RNG): p = 0.1 against p = 0 in one group."""
    name, bs, h, hkv, s, d, options = DROPOUT_SHAPE
    q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, DTYPES[dtype], options)
    kw.update(mixed_precision=True, dropout_p=dropout_p, seed=7)
    o, lse = numbafa.attention_fwd(q, k, v, **kw)
    if pass_ == "forward":
        def run():
            return numbafa.attention_fwd(q, k, v, **kw)
    else:
        numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)

        def run():
            return numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
    benchmark.group = f"dropout {name} {dtype} {pass_}"
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)


COLD_CALL = """
import time, numpy as np{extra_import}
t0 = time.perf_counter()
import numbafa
t1 = time.perf_counter()
q = np.ones((1, 2, 64, 256), {dtype})
o, lse = numbafa.attention_fwd(q, q, q, use_causal_mask=True)
numbafa.attention_bwd(q, q, q, o, q, lse, use_causal_mask=True)
print(t1 - t0, time.perf_counter() - t1)
"""


@pytest.mark.parametrize("cache", ["0", "1"], ids=["cold-compile", "from-disk-cache"])
@pytest.mark.parametrize("dtype", ["np.float32", "ml_dtypes.bfloat16"])
def test_compile_time(benchmark, dtype, cache):
    """Import + first forward and backward call in a fresh process (tiny shape: ~all compile).

    ``NUMBAFA_CACHE=0`` times compilation; ``1`` (after one warm-up process that fills
    the cache) times loading the compiled kernels from disk.
    """
    env = dict(os.environ, NUMBAFA_CACHE=cache)

    def cold():
        script = COLD_CALL.format(dtype=dtype, extra_import=", ml_dtypes" if "ml_dtypes" in dtype else "")
        out = subprocess.run([sys.executable, "-c", script], check=True,
                             capture_output=True, text=True, env=env).stdout.split()
        return float(out[0]), float(out[1])

    benchmark.group = "compile"
    result = benchmark.pedantic(cold, rounds=1, iterations=1, warmup_rounds=1 if cache == "1" else 0)
    benchmark.extra_info["import_s"], benchmark.extra_info["first_calls_s"] = result
