"""The GEMM path for bf16 inputs: dispatch (CPU flags mocked), forcing, and both paths' results."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.platform import onednn
from numbafa.kernels import bundles

from _problems import Case, make_inputs, validated
from _tolerances import MIN_IDENTICAL
from test_bf16 import faithfulness
from _budget import rounded_with_budget

BF16 = ml_dtypes.bfloat16
LIB = "/opt/lib/libdnnl.so.3"


@pytest.mark.parametrize("requested, flags, library, path, reason", [
    ("auto", {"avx2", "fma"}, LIB, "mixed", "no bf16 units"),
    ("auto", {"avx2", "avx512f"}, LIB, "mixed", "no bf16 units"),
    ("auto", {"avx512f", "avx512_bf16"}, None, "blas", "pip install onednn-cpu-gomp"),
    ("auto", {"avx2", "fma"}, None, "blas", "pip install onednn-cpu-gomp"),
    ("auto", None, LIB, "mixed", "no bf16 units"),
    ("auto", {"avx512_bf16"}, LIB, "onednn", "avx512_bf16"),
    ("auto", {"amx_bf16", "amx_tile"}, LIB, "onednn", "amx_bf16"),
    ("onednn", {"avx512_bf16", "amx_bf16"}, LIB, "onednn", LIB),
    ("onednn", {"avx2", "fma"}, LIB, "onednn", "no bf16 units"),
    ("blas", {"avx512_bf16"}, LIB, "blas", "NUMBAFA_GEMM=blas"),
    ("mixed", {"avx512_bf16"}, LIB, "mixed", "2**21 multiply-adds"),
    ("mixed", {"avx2"}, LIB, "mixed", "NUMBAFA_GEMM=mixed"),
])
def test_dispatch_by_cpu_flags(requested, flags, library, path, reason, monkeypatch):
    monkeypatch.setattr(onednn.sys, "platform", "linux")
    got_path, got_reason = onednn.choose_gemm_path(requested, flags, library)
    assert got_path == path and reason in got_reason


def test_forcing_an_unsupported_path_is_a_clear_error():
    with pytest.raises(RuntimeError, match="oneDNN is not installed"):
        onednn.choose_gemm_path("onednn", {"avx512_bf16"}, None)
    with pytest.raises(RuntimeError, match="NUMBAFA_GEMM=mixed, but oneDNN is not installed"):
        onednn.choose_gemm_path("mixed", {"avx2"}, None)
    with pytest.raises(ValueError, match="NUMBAFA_GEMM must be one of"):
        onednn.choose_gemm_path("mkl", {"avx512_bf16"}, LIB)


def test_forced_onednn_where_it_cannot_load_fails_the_call_not_the_process(monkeypatch):
    """The env var is read once per process; here the decision is remade with oneDNN "missing"."""
    monkeypatch.setenv("NUMBAFA_GEMM", "onednn")
    monkeypatch.setattr(onednn, "library_path", lambda: None)
    onednn.gemm_path.cache_clear()
    try:
        inputs = make_inputs(Case(nheads=1, nheads_kv=1, seqlen_q=128, seqlen_k=128), BF16)
        with pytest.raises(RuntimeError, match="oneDNN is not installed"):
            numbafa.attention_bwd(**inputs)
        with pytest.raises(RuntimeError, match=r"forced_gemm_path\('onednn'\), but oneDNN is not installed"):
            with numbafa.forced_gemm_path("onednn"):
                pass
    finally:
        onednn.gemm_path.cache_clear()


def test_forced_onednn_without_bf16_units_runs_float32_tiles():
    """Forcing oneDNN on a CPU without bf16 units (AVX2) is allowed: float32 tiles on dnnl_sgemm."""
    path, reason = onednn.choose_gemm_path("onednn", {"avx2", "fma"}, LIB)
    assert path == "onednn" and "no bf16 units" in reason and "dnnl_sgemm" in reason


def test_forced_gemm_path_takes_only_the_two_paths():
    with pytest.raises(ValueError, match="path must be 'blas', 'mixed' or 'onednn', got 'mkl'"):
        with numbafa.forced_gemm_path("mkl"):
            pass


def test_backend_info_names_the_path():
    info = numbafa.backend_info()
    assert info["gemm"]["path"] in ("onednn", "mixed", "blas") and info["gemm"]["reason"]


def _expected_operand(dtype, path):
    """The operand tiles' dtype of a plan: bf16 bits only on the oneDNN path of a CPU with bf16 units."""
    return np.uint16 if dtype is BF16 and path == "onednn" and onednn.bf16_units() else np.float32


@pytest.mark.parametrize("path", ["blas", "mixed", "onednn"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
def test_the_forced_path_is_part_of_the_plan(path, dtype):
    """make_plan and the remembered plans (shared_plan) follow forced_gemm_path: a plan of one
    path is never reused for a call on another."""
    if path != "blas" and not onednn.load_library():
        pytest.skip("oneDNN is not installed here")
    prob = validated(make_inputs(Case(seqlen_q=128, seqlen_k=128), dtype))
    others = [p for p in ("blas", "mixed", "onednn") if p != path and (p == "blas" or onednn.load_library())]
    for other in others:
        with numbafa.forced_gemm_path(other):
            bundles.shared_plan(prob, backward=True)   # remembered first, for the other paths
    with numbafa.forced_gemm_path(path):
        for plan in (bundles.make_plan(prob, backward=True), bundles.shared_plan(prob, backward=True)):
            assert plan.gemm.onednn == (path == "onednn")
            assert plan.gemm.bits == (_expected_operand(dtype, path) == np.uint16)
            assert plan.gemm.onednn_max_mnk == (onednn.SMALL_SGEMM if path == "mixed" else -1)


def test_forced_paths_are_per_thread():
    """The forced path is a context variable: another thread keeps the process's path."""
    import threading
    seen = []
    with numbafa.forced_gemm_path("blas"):
        assert onednn.active_gemm_path() == "blas"
        t = threading.Thread(target=lambda: seen.append(onednn.active_gemm_path()))
        t.start()
        t.join()
    assert seen == [onednn.gemm_path()[0]] and onednn.active_gemm_path() == onednn.gemm_path()[0]


def test_float32_inputs_never_take_bf16_operands():
    inputs = make_inputs(Case(seqlen_q=128, seqlen_k=128))
    plan = bundles.make_plan(validated(inputs), backward=True)
    assert not plan.gemm.bits


needs_onednn_library = pytest.mark.skipif(not onednn.load_library(), reason="oneDNN is not installed here")


@needs_onednn_library
@pytest.mark.parametrize("mixed", [True, False])
def test_both_paths_are_faithful_to_the_numerics_golden(mixed):
    """Both paths differ from the golden only by float32 summation order, within the budget
    (tests/_tolerances.py). The oneDNN path runs wherever the library loads: on bf16 units
    with bf16 tiles, elsewhere (AVX2) bf16 widened into dnnl_sgemm's float32 tiles."""
    case = Case(nheads=4, nheads_kv=2, d_head=128, seqlen_q=640, seqlen_k=640, causal=True, num_sinks=1)
    inputs = make_inputs(case, BF16)
    *emulated, budgets = rounded_with_budget(**inputs, mixed_precision=mixed)
    for path in ("onednn", "mixed", "blas"):
        with numbafa.forced_gemm_path(path):
            got = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
        for name, g, e, budget in zip(("dq", "dk", "dv"), got, emulated, budgets):
            identical, excess = faithfulness(g.astype(np.float32), e, budget)
            assert identical >= MIN_IDENTICAL and excess <= 1.0, (path, name, identical, excess)


@needs_onednn_library
def test_float32_on_both_paths_matches_the_float64_golden():
    """float32 inputs run dnnl_sgemm on the oneDNN path (any x86-64 CPU), BLAS sgemm on the
    BLAS path, both by size on the mixed one: another float32 summation order each, all within
    the derived float32 tolerance of the float64 golden, all bitwise the same on 1 and 2 threads."""
    import numba

    from _tolerances import FLOAT32, assert_close

    case = Case(nheads=4, nheads_kv=2, d_head=128, seqlen_q=1152, seqlen_k=1152, causal=True, num_sinks=1)
    inputs = make_inputs(case)
    expected = golden.attention_bwd(**inputs)
    for path in ("onednn", "mixed", "blas"):
        runs = []
        with numbafa.forced_gemm_path(path):
            for threads in (1, 2):
                numba.set_num_threads(threads)
                try:
                    runs.append(numbafa.attention_bwd(**inputs))
                finally:
                    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        for a, b in zip(*runs):
            np.testing.assert_array_equal(a, b)
        for name, g, e in zip(("dq", "dk", "dv", "dsinks"), runs[0], expected):
            assert_close(g, e, FLOAT32, f"{path} {name}")


_VERBOSE_CHILD = r"""
import sys, numpy as np, ml_dtypes, numbafa
rng = np.random.default_rng(0)
for dtype, d, s in ((np.float32, 32, 256), (ml_dtypes.bfloat16, 32, 256), (np.float32, 128, 1024)):
    q, k, v, dy = (rng.standard_normal((1, 2, d, s)).astype(dtype) for _ in range(4))
    with numbafa.forced_gemm_path(sys.argv[1]):
        o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, mixed_precision=True)
        numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, mixed_precision=True)
print("bf16 units:", numbafa.platform.onednn.bf16_units(), file=sys.stderr)
"""


@needs_onednn_library
@pytest.mark.parametrize("path", ["onednn", "mixed", "blas"])
def test_each_forced_path_runs_its_gemms(path, tmp_path):
    """oneDNN logs every GEMM it runs (ONEDNN_VERBOSE, ``MxK:KxN``): the forced oneDNN path
    runs float32 GEMMs for float32 inputs and bf16 ones for bf16 inputs on a CPU with bf16
    units (float32 elsewhere), the large tiles of S 1024, d 128 among them; the mixed path
    float32 GEMMs of at most SMALL_SGEMM multiply-adds only (the large tiles go to BLAS); the
    forced BLAS path runs none."""
    import re
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_VERBOSE="all")
    out = subprocess.run([sys.executable, "-c", _VERBOSE_CHILD, path], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    # (the 1 x 1 product is numbafa.platform.onednn's probe of the bf16 GEMM, not a kernel's)
    gemms = [line for line in out.stdout.splitlines() if ",gemm_api," in line and ",1x1:1x1," not in line]
    f32 = sum("src_f32" in line for line in gemms)
    bf16 = sum("src_bf16" in line for line in gemms)
    units = out.stderr.strip().splitlines()[-1]
    assert units.startswith("bf16 units:"), out.stderr[-2000:]
    sizes = [int(m) * int(k) * int(n) for m, k, n in
             (re.search(r",(\d+)x(\d+):\d+x(\d+),", line).groups() for line in gemms)]
    if path == "blas":
        assert gemms == []
    elif path == "mixed":
        assert f32 > 0 and bf16 == 0 and max(sizes) <= onednn.SMALL_SGEMM, (f32, bf16, max(sizes))
    elif units != "bf16 units: []":
        assert f32 > 0 and bf16 > 0, (f32, bf16)
    else:
        assert f32 > 0 and bf16 == 0, (f32, bf16)
    if path == "onednn":
        assert max(sizes) > onednn.SMALL_SGEMM


_FIRST_ACT = r"""
import pickle, sys
import numpy as np
from numbafa.pipeline import shards  # no plan made, no GEMM path chosen in this process
plan, ins, expected = pickle.load(open(sys.argv[1], "rb"))
o, lse = shards.fwd_chunk(plan, ins, False, ins.q.shape[3], 0, np.float32)
assert np.array_equal(o, expected), "another result than the process that made the plan"
print("ran")
"""


@needs_onednn_library
def test_a_process_whose_first_act_is_a_cached_onednn_kernel_runs_it(tmp_path):
    """A Dask worker runs a pickled plan's kernel before anything else: the kernel, loaded from the
    disk cache, calls oneDNN, which nothing in that process loaded yet. It must be loaded before
    the machine code is linked (it aborted with 'LLVM ERROR: Symbol not found: dnnl_sgemm')."""
    import pickle

    from numbafa.kernels.bundles import FwdInputs, shared_plan
    from numbafa.checks.validation import validate_fwd_inputs

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 32, 256)).astype(np.float32) for _ in range(3))
    with numbafa.forced_gemm_path("onednn"):   # float32's oneDNN path runs on any x86-64 CPU
        expected, _ = numbafa.attention_fwd(q, k, v, lse_layout="natural")   # compiled and cached here
        prob = validate_fwd_inputs(q, k, v)
        plan = shared_plan(prob, backward=False)
    path = tmp_path / "share.pkl"
    path.write_bytes(pickle.dumps((plan, FwdInputs(prob.q, prob.k, prob.v, prob.sinks), expected)))
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_ACT, str(path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr[-2000:]
