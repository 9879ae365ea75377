"""The GEMM path for bf16 inputs: dispatch (CPU flags mocked), forcing, and both paths' results."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa import golden, onednn
from numbafa.kernels import bundles

from _problems import Case, make_inputs, validated
from _tolerances import MIN_IDENTICAL
from test_bf16 import faithfulness
from _budget import rounded_with_budget

BF16 = ml_dtypes.bfloat16
LIB = "/opt/lib/libdnnl.so.3"


@pytest.mark.parametrize("requested, flags, library, path, reason", [
    ("auto", {"avx2", "fma"}, LIB, "blas", "no bf16 units"),
    ("auto", {"avx2", "avx512f"}, LIB, "blas", "no bf16 units"),
    ("auto", {"avx512f", "avx512_bf16"}, None, "blas", "pip install onednn-cpu-gomp"),
    ("auto", None, LIB, "blas", "no bf16 units"),
    ("auto", {"avx512_bf16"}, LIB, "onednn", "avx512_bf16"),
    ("auto", {"amx_bf16", "amx_tile"}, LIB, "onednn", "amx_bf16"),
    ("onednn", {"avx512_bf16", "amx_bf16"}, LIB, "onednn", LIB),
    ("blas", {"avx512_bf16"}, LIB, "blas", "NUMBAFA_GEMM=blas"),
])
def test_dispatch_by_cpu_flags(requested, flags, library, path, reason, monkeypatch):
    monkeypatch.setattr(onednn.sys, "platform", "linux")
    got_path, got_reason = onednn.choose_gemm_path(requested, flags, library)
    assert got_path == path and reason in got_reason


def test_forcing_an_unsupported_path_is_a_clear_error():
    with pytest.raises(RuntimeError, match="NUMBAFA_GEMM=onednn, but the CPU has no bf16 units"):
        onednn.choose_gemm_path("onednn", {"avx2"}, LIB)
    with pytest.raises(RuntimeError, match="oneDNN is not installed"):
        onednn.choose_gemm_path("onednn", {"avx512_bf16"}, None)
    with pytest.raises(ValueError, match="NUMBAFA_GEMM must be one of"):
        onednn.choose_gemm_path("mkl", {"avx512_bf16"}, LIB)


def test_forced_onednn_without_bf16_units_fails_the_call_not_the_process(monkeypatch):
    """The env var is read once per process; here the decision is remade with mocked flags."""
    monkeypatch.setenv("NUMBAFA_GEMM", "onednn")
    monkeypatch.setattr(onednn, "cpu_flags", lambda: {"avx2", "fma"})
    onednn.gemm_path.cache_clear()
    try:
        inputs = make_inputs(Case(nheads=1, nheads_kv=1, seqlen_q=128, seqlen_k=128), BF16)
        with pytest.raises(RuntimeError, match="no bf16 units"):
            numbafa.attention_bwd(**inputs)
    finally:
        onednn.gemm_path.cache_clear()


def test_backend_info_names_the_path():
    info = numbafa.backend_info()
    assert info["gemm"]["path"] in ("onednn", "blas") and info["gemm"]["reason"]


def test_plan_marks_the_gemm_path():
    """plan.gemm is None on the BLAS path and the ONEDNN marker on the oneDNN one, for both dtypes;
    only bf16 inputs on the oneDNN path take bf16 operand tiles."""
    from numbafa.kernels.matmul import ONEDNN
    for dtype, path, gemm, operand in ((np.float32, "blas", None, np.float32),
                                       (np.float32, "onednn", ONEDNN, np.float32),
                                       (BF16, "blas", None, np.float32),
                                       (BF16, "onednn", ONEDNN, np.uint16)):
        inputs = make_inputs(Case(seqlen_q=128, seqlen_k=128), dtype)
        prob = validated(inputs)
        original = bundles.gemm_path
        bundles.gemm_path = lambda: (path, "set by the test")
        try:
            plan = bundles.make_plan(prob, backward=True)
        finally:
            bundles.gemm_path = original
        assert plan.gemm == gemm and plan.operand.dtype == operand, (dtype, path)


def test_float32_inputs_never_take_bf16_operands():
    inputs = make_inputs(Case(seqlen_q=128, seqlen_k=128))
    plan = bundles.make_plan(validated(inputs), backward=True)
    assert plan.operand.dtype == np.float32


@pytest.mark.skipif(onednn.gemm_path()[0] != "onednn",
                    reason=f"the oneDNN path does not run here: {onednn.gemm_path()[1]}")
@pytest.mark.parametrize("mixed", [True, False])
def test_both_paths_are_faithful_to_the_numerics_golden(mixed, monkeypatch):
    """On a CPU with bf16 units the default is oneDNN; the BLAS path is forced for comparison.
    Both differ from the golden only by float32 summation order, within the budget (tests/_tolerances.py)."""
    case = Case(nheads=4, nheads_kv=2, d_head=128, seqlen_q=640, seqlen_k=640, causal=True, num_sinks=1)
    inputs = make_inputs(case, BF16)
    *emulated, budgets = rounded_with_budget(**inputs, mixed_precision=mixed)
    results = {"onednn": numbafa.attention_bwd(**inputs, mixed_precision=mixed)}
    monkeypatch.setattr(bundles, "gemm_path", lambda: ("blas", "forced by the test"))
    results["blas"] = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
    for path, got in results.items():
        for name, g, e, budget in zip(("dq", "dk", "dv"), got, emulated, budgets):
            identical, excess = faithfulness(g.astype(np.float32), e, budget)
            assert identical >= MIN_IDENTICAL and excess <= 1.0, (path, name, identical, excess)
    assert any((a != b).any() for a, b in zip(results["onednn"][:3], results["blas"][:3])), \
        "the two paths gave identical bits: the oneDNN path did not run"


@pytest.mark.skipif(onednn.gemm_path()[0] != "onednn",
                    reason=f"the oneDNN path does not run here: {onednn.gemm_path()[1]}")
def test_float32_on_both_paths_matches_the_float64_golden(monkeypatch):
    """float32 inputs run dnnl_sgemm on the oneDNN path and BLAS sgemm on the other: another
    float32 summation order each, both within the derived float32 tolerance of the float64
    golden, both bitwise the same on 1 and 2 threads."""
    import numba

    from _tolerances import FLOAT32, assert_close

    case = Case(nheads=4, nheads_kv=2, d_head=128, seqlen_q=1152, seqlen_k=1152, causal=True, num_sinks=1)
    inputs = make_inputs(case)
    expected = golden.attention_bwd(**inputs)
    results = {}
    for path in ("onednn", "blas"):
        if path == "blas":
            monkeypatch.setattr(bundles, "gemm_path", lambda: ("blas", "forced by the test"))
        runs = []
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
        results[path] = runs[0]
    assert any((a != b).any() for a, b in zip(results["onednn"], results["blas"])), \
        "the two paths gave identical bits: dnnl_sgemm did not run"
