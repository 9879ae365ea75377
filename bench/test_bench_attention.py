"""pytest-benchmark suite: what users run, with figures that survive a noisy machine.

Not part of the unit tests (``testpaths = tests``). Record a run, compare later runs with it
(docs/performance.md, "Tracking performance")::

    python -m pytest bench --benchmark-autosave                  # .benchmarks/<machine>/0001_*.json
    python -m pytest bench --benchmark-autosave --benchmark-compare
    python -m bench.track compare 0001 0002                      # robust figures; exit 1 on a regression

``--numbafa-profile=quick`` runs tiny shapes (CI keeps the workflow alive with it). Every
benchmark is warmed up first (compiles outside the timing) and records in ``extra_info``:

* ``flops``, ``gflops`` (flash-attention's FLOP convention, ``shapes.flops``);
* ``gemm_gflops``: the float32 GEMM's throughput at the kernels' tile shape (``[512, d] @
  [d, 512]``, one single-threaded stream per numbafa thread at once, ~20 ms), measured right
  before every round (the median is kept); ``gemm_fraction``, the median over the rounds of
  the round's GFLOP/s over the ceiling measured just before it: the kernel's share of the
  GEMM ceiling, round by round, so that a slower (or busier) moment moves both;
  ``gemm_fractions``, every round's (their spread is the noise ``bench.track compare`` judges
  a change against; cheap calls get more rounds, up to 3x the profile's);
* ``torch_ratio``: torch's SDPA time on the same shape over numbafa's, measured right after
  (where torch is installed and SDPA takes the shape's options);
* ``source``, ``gemm_path``, ``threads``: numbafa's source hash and backend for this run.

Cold compiles (a fresh process) and peak memory (``bench/memory.py``) record their figures
in ``extra_info`` too (``first_calls_s``, ``peak_extra_bytes``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa.layout import cu_seqlens_to_bounds, from_neuron_perm

from shapes import HEAD_DIM_SHAPES, SHAPES, flops, make_inputs

DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16, "float16": np.float16, "float64": np.float64}

#: Tiny shapes of the quick profile: the same families as the standard ones (MHA, GQA, MQA;
#: full, causal, window, sinks, packing; a value head dim of its own).
QUICK_SHAPES = [
    ("mha-s256-d32-full", 1, 2, 2, 256, 32, dict(use_causal_mask=False)),
    ("gqa4/2-s256-d32-causal-window64-sinks", 1, 4, 2, 256, 32,
     dict(use_causal_mask=True, sliding_window=64, sinks=1)),
    ("mqa4/1-s256-d32-causal-packing", 1, 4, 1, 256, 32, dict(use_causal_mask=True, packing=(100, 156))),
    ("mla-s256-d48-dv32-causal", 1, 2, 2, 256, 48, dict(use_causal_mask=True, head_dim_v=32)),
]
#: Per profile: (shapes, dtypes on every shape, dtypes on the first shape only, rounds). The
#: full profile's rounds are a minimum: cheap calls get more (:func:`_rounds`).
PROFILES = {"full": (SHAPES + HEAD_DIM_SHAPES[:1], ("float32", "bf16"), ("float16", "float64"), 5),
            "quick": (QUICK_SHAPES, ("float32", "bf16"), ("float16", "float64"), 3)}
#: Seconds of calls a full-profile benchmark times at most when it adds rounds to the minimum
#: (up to 3x the minimum): more rounds where they are cheap, for the spread ``bench.track`` judges by.
ROUND_BUDGET_S = 1.5
#: The score variants, on the first shape of the profile.
VARIANTS = {"softcap": dict(softcap=30.0), "alibi": dict(alibi=True), "bias": dict(bias=True),
            "bias+dbias": dict(bias=True, return_dbias=True)}


def _cases(kind):
    """The parameters of every profile (selected at run time: :func:`_skip_other_profiles`):
    every shape (``kind="all"``), or each profile's first shape in its main dtypes (``"first"``)."""
    cases = []
    for profile, (shapes, dtypes, first_only, _) in PROFILES.items():
        for i, shape in enumerate(shapes):
            if kind == "first" and i > 0:
                break
            for dtype in dtypes + (first_only if i == 0 and kind == "all" else ()):
                cases.append(pytest.param(profile, shape, dtype, id=f"{profile}-{shape[0]}-{dtype}"))
    return cases


def _skip_other_profiles(request, profile_of_case):
    if request.config.getoption("--numbafa-profile") != profile_of_case:
        pytest.skip(f"in the {profile_of_case} profile (--numbafa-profile={profile_of_case})")


def _inputs(shape, dtype, extra=None):
    _, bs, h, hkv, s, d, options = shape
    options = dict(options)
    packing = options.pop("packing", None)
    q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, DTYPES[dtype], options)
    kw["mixed_precision"] = True
    if packing:
        cu = np.cumsum((0,) + tuple(packing))
        kw["bound_min"], kw["bound_max"] = cu_seqlens_to_bounds(cu)
    extra = dict(extra or {})
    rng = np.random.default_rng(1)
    if extra.pop("bias", False):
        kw["bias"] = rng.standard_normal((1, h, s, s)).astype(np.float32)
    if extra.pop("alibi", False):
        kw["alibi_slopes"] = (2.0 ** -np.arange(1, h + 1)).astype(np.float32)
    kw.update(extra)
    return q, k, v, dy, kw


def _gemm_gflops(d: int) -> float:
    """The float32 GEMM's throughput at the kernels' tile shape ``[512, d] @ [d, 512]``, one
    single-threaded GEMM stream per numbafa thread at once (as the kernels run them), 1 GFLOP
    each: GFLOP/s of all streams together."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    threads = numbafa.backend_info()["threads"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((512, d), dtype=np.float32), rng.standard_normal((d, 512), dtype=np.float32)
    n = max(1, int(1e9 // (2 * 512 * 512 * d)))            # 1 GFLOP per stream: ~10-20 ms

    def stream(_):
        out = np.empty((512, 512), np.float32)
        for _ in range(n):
            np.matmul(a, b, out=out)

    with threadpool_limits(1), ThreadPoolExecutor(threads) as pool:
        list(pool.map(stream, range(threads)))               # warm
        t0 = time.perf_counter()
        list(pool.map(stream, range(threads)))
        seconds = time.perf_counter() - t0
    return 2.0 * 512 * 512 * d * n * threads / seconds / 1e9


def _torch_seconds(shape, dtype, pass_, rounds):
    """Median time of torch's SDPA on ``shape`` (None without torch, or for options SDPA lacks)."""
    if dtype not in ("float32", "bf16") or set(shape[6]) - {"use_causal_mask"}:
        return None
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    _, bs, h, hkv, s, d, options = shape
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    q = torch.randn(bs, h, s, d, dtype=tdtype, requires_grad=pass_ == "backward")
    k, v = (torch.randn(bs, hkv, s, d, dtype=tdtype, requires_grad=pass_ == "backward") for _ in range(2))
    causal = options.get("use_causal_mask", False)

    def run():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=h != hkv)
        if pass_ == "backward":
            o.backward(torch.ones_like(o))
    run()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run_info(benchmark, flop_count, d, shape=None, dtype=None, pass_=None, rounds=3, ceilings=()):
    """The figures of ``extra_info`` (module docstring); call after the timing, with the GEMM
    ceilings measured before each round (``ceilings``, :func:`_with_ceilings`)."""
    from numbafa.compiler.jit import source_hash

    info = numbafa.backend_info()
    benchmark.extra_info.update(source=source_hash(), gemm_path=info["gemm"]["path"], threads=info["threads"])
    if benchmark.stats is None or flop_count is None:   # --benchmark-disable: no timing
        return
    times = list(benchmark.stats.stats.data)
    ceilings = list(ceilings)[-len(times):] or [_gemm_gflops(d)] * len(times)
    fractions = [flop_count / t / 1e9 / c for t, c in zip(times, ceilings)]
    benchmark.extra_info.update(flops=flop_count, gflops=flop_count / benchmark.stats.stats.median / 1e9,
                                gemm_gflops=statistics.median(ceilings), gemm_fraction=statistics.median(fractions),
                                gemm_fractions=[float(f"{f:.5g}") for f in fractions])
    if shape is not None:
        torch_s = _torch_seconds(shape, dtype, pass_, rounds)
        if torch_s is not None:
            benchmark.extra_info["torch_ratio"] = torch_s / benchmark.stats.stats.median


def _rounds(run, minimum, request):
    """``minimum`` rounds in the quick profile; in the full one as many as fit in
    :data:`ROUND_BUDGET_S` of calls (one call timed here), between ``minimum`` and 3x it."""
    if request.config.getoption("--numbafa-profile") != "full":
        return minimum
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    return int(min(3 * minimum, max(minimum, ROUND_BUDGET_S // max(seconds, 1e-6))))


def _with_ceilings(benchmark, run, d, rounds, request=None):
    """Time ``run`` over ``rounds`` rounds (more where cheap, with ``request``: :func:`_rounds`),
    the GEMM ceiling (:func:`_gemm_gflops`) measured right before each (pedantic's untimed
    setup): each round's time is judged against the machine as it was then. Returns the
    ceilings (the warm-up round's first)."""
    if request is not None:
        rounds = _rounds(run, rounds, request)
    ceilings = []

    def setup():
        ceilings.append(_gemm_gflops(d))
    benchmark.pedantic(run, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    return ceilings


def _bench_pass(benchmark, request, shape, dtype, pass_, extra=None, rounds=3):
    """Time one pass of ``shape`` (with score ``extra`` options); record the figures."""
    q, k, v, dy, kw = _inputs(shape, dtype, extra)
    fwd_kw = {key: x for key, x in kw.items() if key != "return_dbias"}
    o, lse = numbafa.attention_fwd(q, k, v, **fwd_kw)          # also the warm-up (compile)
    if pass_ == "forward":
        def run():
            return numbafa.attention_fwd(q, k, v, **fwd_kw)
    else:
        numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)

        def run():
            return numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
    _, bs, h, _, s, d, options = shape
    ceilings = _with_ceilings(benchmark, run, d, rounds, request)
    _run_info(benchmark, flops(pass_, bs, h, s, d, options), d, None if extra else shape, dtype, pass_, rounds,
              ceilings)


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("profile_of_case, shape, dtype", _cases("all"))
def test_attention(benchmark, request, pass_, profile_of_case, shape, dtype):
    _skip_other_profiles(request, profile_of_case)
    benchmark.group = f"{shape[0]} {pass_}"
    _bench_pass(benchmark, request, shape, dtype, pass_, rounds=PROFILES[profile_of_case][3])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("profile_of_case, shape, dtype", _cases("first"))
def test_score_variants(benchmark, request, pass_, variant, profile_of_case, shape, dtype):
    """Each score variant on the profile's first shape (compare with test_attention's plain call)."""
    _skip_other_profiles(request, profile_of_case)
    if pass_ == "forward" and variant == "bias+dbias":
        pytest.skip("dbias is the backward's")
    benchmark.group = f"variants {shape[0]} {dtype} {pass_}"
    _bench_pass(benchmark, request, shape, dtype, pass_, VARIANTS[variant], rounds=PROFILES[profile_of_case][3])


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("profile_of_case, shape, dtype", _cases("first"))
def test_dropout(benchmark, request, pass_, profile_of_case, shape, dtype):
    """Attention dropout p = 0.1 on the profile's first shape (its cost: the mask's RNG)."""
    _skip_other_profiles(request, profile_of_case)
    benchmark.group = f"dropout {shape[0]} {dtype} {pass_}"
    _bench_pass(benchmark, request, shape, dtype, pass_, dict(dropout_p=0.1, seed=7),
                rounds=PROFILES[profile_of_case][3])


@pytest.mark.parametrize("layout", ["neuron", "bhsd", "bshd"])
@pytest.mark.parametrize("profile_of_case", list(PROFILES))
def test_layouts(benchmark, request, profile_of_case, layout):
    """numbafa.attention forward + ctx.backward (float32, causal) on arrays in each layout: the
    kernels read the caller's layout in place (compare the three in one run)."""
    _skip_other_profiles(request, profile_of_case)
    _, bs, h, hkv, s, d, _ = PROFILES[profile_of_case][0][0]
    rng = np.random.default_rng(0)
    q, do = (rng.standard_normal(from_neuron_shape((bs, h, d, s), layout), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal(from_neuron_shape((bs, hkv, d, s), layout), dtype=np.float32) for _ in range(2))

    def step():
        o, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout=layout)
        return ctx.backward(do)
    step()
    benchmark.group = f"layouts {PROFILES[profile_of_case][0][0][0]}"
    ceilings = _with_ceilings(benchmark, step, d, PROFILES[profile_of_case][3], request)
    causal = dict(use_causal_mask=True)
    _run_info(benchmark, flops("forward", bs, h, s, d, causal) + flops("backward", bs, h, s, d, causal), d,
              ceilings=ceilings)


@pytest.mark.parametrize("profile_of_case", list(PROFILES))
def test_torch_adapter(benchmark, request, profile_of_case):
    """numbafa.torch.attention forward and backward through autograd (float32, causal)."""
    _skip_other_profiles(request, profile_of_case)
    torch = pytest.importorskip("torch")
    import numbafa.torch as nt

    _, bs, h, hkv, s, d, _ = PROFILES[profile_of_case][0][0]
    q = torch.randn(bs, h, s, d, requires_grad=True)
    k, v = (torch.randn(bs, hkv, s, d, requires_grad=True) for _ in range(2))

    def step():
        nt.attention(q, k, v, causal=True).sum().backward()
    step()
    benchmark.group = "torch adapter"
    ceilings = _with_ceilings(benchmark, step, d, PROFILES[profile_of_case][3], request)
    causal = dict(use_causal_mask=True)
    _run_info(benchmark, flops("forward", bs, h, s, d, causal) + flops("backward", bs, h, s, d, causal), d,
              ceilings=ceilings)


def from_neuron_shape(shape: tuple, layout: str) -> tuple:
    """A Neuron-order shape ``(b, h, d, s)`` as arrays of ``layout`` have it."""
    return tuple(shape[axis] for axis in from_neuron_perm(layout))


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
def test_compile_time(benchmark, request, dtype, cache):
    """Import + first forward and backward call in a fresh process (tiny shape: ~all compile).

    ``NUMBAFA_CACHE=0`` times compilation; ``1`` (after one warm-up process that fills
    the cache) times loading the compiled kernels from disk. The quick profile loads float32's
    kernels only.
    """
    if request.config.getoption("--numbafa-profile") == "quick" and (cache == "0" or "bfloat16" in dtype):
        pytest.skip("the quick profile loads float32's kernels from the disk cache only")
    env = dict(os.environ, NUMBAFA_CACHE=cache)

    def cold():
        script = COLD_CALL.format(dtype=dtype, extra_import=", ml_dtypes" if "ml_dtypes" in dtype else "")
        out = subprocess.run([sys.executable, "-c", script], check=True,
                             capture_output=True, text=True, env=env).stdout.split()
        return float(out[0]), float(out[1])

    benchmark.group = "compile"
    result = benchmark.pedantic(cold, rounds=1, iterations=1, warmup_rounds=1 if cache == "1" else 0)
    benchmark.extra_info["import_s"], benchmark.extra_info["first_calls_s"] = result
    _run_info(benchmark, None, 0)


@pytest.mark.parametrize("profile_of_case", list(PROFILES))
def test_peak_memory(benchmark, request, profile_of_case):
    """Peak extra memory of one float32 causal backward in a fresh process (``bench/memory.py``):
    ``extra_info["peak_extra_bytes"]``."""
    _skip_other_profiles(request, profile_of_case)
    from memory import measure

    seqlen = 4096 if profile_of_case == "full" else 2048
    benchmark.group = "memory"
    result = benchmark.pedantic(lambda: measure("numbafa", seqlen, 64, True, heads=2, kv_heads=1),
                                rounds=1, iterations=1)
    benchmark.extra_info.update(seqlen=seqlen, peak_extra_bytes=int(result))
    _run_info(benchmark, None, 0)
