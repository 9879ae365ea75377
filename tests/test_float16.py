"""float16 inputs: the Neuron kernel's dtype logic with fp16 as kernel_dtype.

The same rounding points as bf16 (docs/numerics.md), to fp16 (its range and subnormals);
float32 accumulation with ``mixed_precision=True``. The kernels take the fp16 values widened to
float32 (exact), so every GEMM is float32 on fp16-valued operands: exact products.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numba
import numpy as np
import pytest

import numbafa
from numbafa import golden
from numbafa.conventions.dtypes import round_to_fp16, round_to_fp16_bits

from _budget import assert_faithful, faithfulness as _faithfulness, fp16_ulp, rounded_with_budget
from _problems import CASES, Case, forward_options, make_inputs
from _tolerances import FP16_MIXED, LSE_FLOAT32, MIN_IDENTICAL_FP16, assert_close

F16 = np.float16
NAMES = ("dq", "dk", "dv", "dsinks")
FAMILIES = ["gqa4-causal", "window128-gqa", "packing-causal-window", "sinks2-window", "d256", "ragged97",
            "2-sections", "scale-causal-sinks", "mla-192-128-window", "mqa-causal"]
F16_CASES = [(name, case) for name, case in CASES if name in FAMILIES]


def _elementwise(rounding):
    """An njit function applying the njit scalar ``rounding`` to every element of a 1-D array."""
    @numba.njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = rounding(x[i])
        return out
    return apply


_rounded, _rounded_on_bits = _elementwise(round_to_fp16), _elementwise(round_to_fp16_bits)


@pytest.mark.parametrize("rounded", [_rounded, _rounded_on_bits], ids=["kernels-rounding", "on-the-bits"])
def test_rounding_matches_numpys_cast_at_every_boundary(rounded):
    """Every finite fp16 value, every midpoint between neighbours (ties to even) and the float32
    values either side of it, the overflow edge (65520 rounds to inf), subnormals, and a wide
    random sample: bit for bit NumPy's float32 -> float16 cast."""
    values = np.arange(65536, dtype=np.uint16).view(F16)
    values = np.unique(values[np.isfinite(values)].astype(np.float32))
    mid = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    sample = (rng.standard_normal(200000) * 10.0 ** rng.integers(-44, 6, 200000)).astype(np.float32)
    x = np.concatenate([values, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                        np.float32([65504.0, 65519.996, 65520.0, -65520.0, 1e30, np.inf, -np.inf, 0.0, -0.0]),
                        sample])
    with np.errstate(over="ignore"):
        expected = x.astype(F16).astype(np.float32)
    np.testing.assert_array_equal(rounded(x).view(np.uint32), expected.view(np.uint32))
    assert np.isnan(rounded(np.float32([np.nan])))[0]


@pytest.fixture(scope="module", params=F16_CASES, ids=[n for n, _ in F16_CASES])
def f16_case(request):
    _, case = request.param
    inputs = make_inputs(case, F16)
    return case, inputs, {mixed: numbafa.attention_bwd(**inputs, mixed_precision=mixed) for mixed in (True, False)}


def test_every_family_is_known():
    assert {name for name, _ in F16_CASES} == set(FAMILIES)


def test_accuracy_against_the_float64_golden(f16_case):
    case, inputs, got = f16_case
    expected = golden.attention_bwd(**inputs)
    for name, g, e in zip(NAMES, got[True], expected):
        assert g.dtype == (F16 if name != "dsinks" else np.float32), name
        assert_close(g.astype(np.float32), e, FP16_MIXED, name)


def faithfulness(actual, expected, budget):
    """:func:`_budget.faithfulness` in fp16 ulps."""
    return _faithfulness(actual, expected, budget, fp16_ulp)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "not-mixed"])
def test_faithful_to_the_numerics_golden(f16_case, mixed):
    _, inputs, got = f16_case
    assert_faithful(inputs, got[mixed], mixed, MIN_IDENTICAL_FP16, fp16_ulp)


@pytest.mark.parametrize("point, case", [
    ("p", Case(nheads=2, nheads_kv=1, causal=True)), ("ds", Case(nheads=2, nheads_kv=1, causal=True)),
    ("acc", Case(nheads=2, nheads_kv=1, causal=True)),
    ("q_load", Case(softmax_scale=0.3)),   # 1/sqrt(64) is a power of two: Q * scale would be exact
], ids=["p", "ds", "acc", "q_load"])
def test_the_faithfulness_check_catches_a_missing_rounding_point(point, case):
    """The golden without one of its fp16 rounding points is not what the kernel computes."""
    inputs = make_inputs(case, F16)
    got = numbafa.attention_bwd(**inputs, mixed_precision=False)
    *emulated, budgets = rounded_with_budget(**inputs, mixed_precision=False, disable=(point,))
    results = [faithfulness(g.astype(np.float32), e, b) for g, e, b in zip(got, emulated, budgets)]
    assert any(identical < MIN_IDENTICAL_FP16 or excess > 1.0 for identical, excess in results)


@pytest.mark.parametrize("sinks_dtype", [np.float32, F16])
def test_forward_and_the_sinks_dtype(sinks_dtype):
    case = Case(nheads=4, nheads_kv=2, d_head=48, d_head_v=32, causal=True, num_sinks=1, seqlen_q=300,
                seqlen_k=300)
    inputs = make_inputs(case, F16)
    inputs["sinks_ref"] = inputs["sinks_ref"].astype(sinks_dtype)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural",
                                   mixed_precision=True, **forward_options(inputs))
    o_exp, lse_exp = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                          sinks=inputs["sinks_ref"], use_causal_mask=True)
    assert o.dtype == F16 and lse.dtype == np.float32
    assert_close(o.astype(np.float32), o_exp, FP16_MIXED, "o")
    assert_close(lse, lse_exp, LSE_FLOAT32 | {"rtol": FP16_MIXED["rtol"]}, "lse")
    dsinks = numbafa.attention_bwd(**dict(inputs, o_ref=o, lse_ref=lse), mixed_precision=True)[3]
    assert dsinks.dtype == sinks_dtype


def test_a_rounding_point_beyond_fp16s_range_is_an_error_naming_the_output():
    """dS = (dP - D) * P rounded to fp16 overflows for large dO and V: inf on the hardware, an
    error here rather than an inf or NaN gradient."""
    inputs = make_inputs(Case(nheads=1, nheads_kv=1, seqlen_q=128, seqlen_k=128), F16)
    inputs["v_ref"] = (inputs["v_ref"].astype(np.float32) * 3000).astype(F16)
    inputs["dy_ref"] = (inputs["dy_ref"].astype(np.float32) * 3000).astype(F16)
    with pytest.raises(FloatingPointError, match="^dq overflows float16 at one of the kernels' float16 rounding"):
        numbafa.attention_bwd(**inputs)


@pytest.mark.parametrize("mixed", [True, False])
def test_scaled_queries_beyond_fp16s_range_are_an_error_naming_the_scores(mixed):
    """Q is scaled at load and rounded to fp16 there: softmax_scale * |q| from 65520 on is inf on
    the hardware (the forward returned lse = +inf rows, and the backward blamed dq). Both passes
    raise, naming the scores; just below the threshold (rounded to 65504) runs, finite."""
    inputs = make_inputs(Case(nheads=1, nheads_kv=1, d_head=16, seqlen_q=128, seqlen_k=128), F16)
    q = np.clip(inputs["q_ref"], -1.0, 1.0)
    q[0, 0, 0, 0] = 1.0                      # max |q| = 1 exactly
    k, v = inputs["k_ref"], inputs["v_ref"]
    match = r"^the attention scores overflow float16: .* softmax_scale \* q_ref to float16 \(largest value 65504\)"
    with pytest.raises(FloatingPointError, match=match):
        numbafa.attention_fwd(q, k, v, softmax_scale=65520.0, mixed_precision=mixed)
    with pytest.raises(FloatingPointError, match=match):
        numbafa.attention_bwd(q, k, v, inputs["o_ref"], inputs["dy_ref"], inputs["lse_ref"], softmax_scale=65520.0,
                              mixed_precision=mixed)
    o, lse = numbafa.attention_fwd(q, k * np.float16(1e-3), v, softmax_scale=65519.0, mixed_precision=mixed,
                                   lse_layout="natural")
    assert np.isfinite(o.astype(np.float32)).all() and np.isfinite(lse).all()


def test_the_kernels_are_a_specialisation_of_their_own():
    """fp16 inputs compile kernels apart from float32's: a float32 call gives float32 bits."""
    inputs = make_inputs(Case(seqlen_q=128, seqlen_k=128), F16)
    wide = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == F16 else v) for k, v in inputs.items()}
    fp16 = numbafa.attention_bwd(**inputs, mixed_precision=True)
    fp32 = numbafa.attention_bwd(**wide)
    assert fp32[0].dtype == np.float32 and fp16[0].dtype == F16
    assert not np.array_equal(fp32[0].astype(F16), fp16[0])   # P and dS were rounded to fp16


def test_the_array_conversions_are_numpys_casts():
    """fp16 <-> float32 array conversions (F16C's vector instructions where the CPU has them):
    every fp16 pattern widens to NumPy's float32 (NaN to a NaN), and float32 values round to
    NumPy's fp16, views included."""
    from numbafa.conventions.dtypes import from_fp16_array, to_fp16_array

    patterns = np.arange(65536, dtype=np.uint16).view(F16)
    wide = from_fp16_array(patterns)
    nan = np.isnan(patterns)
    np.testing.assert_array_equal(wide[~nan].view(np.uint32), patterns[~nan].astype(np.float32).view(np.uint32))
    assert np.isnan(wide[nan]).all()
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 3, 40, 50)) * 10.0 ** rng.integers(-9, 6, (2, 3, 40, 50))).astype(np.float32)
    view = x.transpose(0, 2, 3, 1)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(to_fp16_array(view).view(np.uint16), view.astype(F16).view(np.uint16))
    with np.errstate(over="ignore"):
        half = view.astype(F16)
    np.testing.assert_array_equal(from_fp16_array(half), half.astype(np.float32))


_WITHOUT_F16C = r"""
import json, sys
import numpy as np
import numbafa
from numbafa import golden
from numbafa.conventions import dtypes
sys.path.insert(0, sys.argv[1])
from _problems import Case, make_inputs
from _tolerances import FP16_MIXED
assert not dtypes._F16C
from numbafa.compiler.jit import callable_from_python
round_to_fp16 = callable_from_python(dtypes.round_to_fp16)
round_to_fp16(np.float32(1.0))
assert not any("cvtps2ph" in asm for asm in round_to_fp16.inspect_asm().values())
x = np.float32(np.random.default_rng(1).standard_normal(100000) * 10.0 ** np.random.default_rng(2).integers(-9, 6, 100000))
with np.errstate(over="ignore"):
    narrowed = dtypes.to_fp16_array(x)
    assert np.array_equal(narrowed.view(np.uint16), x.astype(np.float16).view(np.uint16))
assert np.array_equal(dtypes.from_fp16_array(narrowed), narrowed.astype(np.float32))
inputs = make_inputs(Case(nheads=2, nheads_kv=1, causal=True, num_sinks=1, seqlen_q=200, seqlen_k=200), np.float16)
got = numbafa.attention_bwd(**inputs, mixed_precision=True)
expected = golden.attention_bwd(**inputs)
errors = [float(np.abs(g.astype(np.float64) - e).max() / np.abs(e).max()) for g, e in zip(got, expected)]
print(json.dumps(dict(errors=errors, rtol=FP16_MIXED["rtol"])))
"""


def test_cpus_without_f16c_round_on_the_bits():
    """Where Numba's target has no F16C (here: NUMBA_CPU_NAME=generic, the baseline x86-64), the
    kernels round with round_to_fp16_bits and the arrays convert with NumPy: the same casts, and
    a float16 backward within the float16 rule against the float64 golden."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBAFA_CACHE="0")
    env.pop("NUMBA_CPU_FEATURES", None)   # the baseline's own features (a set one may add F16C)
    tests = str(pathlib.Path(__file__).resolve().parent)
    out = subprocess.run([sys.executable, "-c", _WITHOUT_F16C, tests], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert max(result["errors"]) <= result["rtol"], result
