"""float64 inputs: the kernels compute in float64 end to end (no bf16 rounding points).

The float64 golden is the reference; the tolerance (tests/_tolerances.py, FLOAT64) is derived
from float64 summation error and fails any float32 step. Front ends: tests/test_torch.py
(gradcheck), tests/test_jax.py (check_grads), tests/test_distributed.py, tests/test_cli.py.
"""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

import numbafa
from numbafa import golden

from _problems import CASES, Case, forward_options, make_inputs
from _tolerances import FLOAT32, FLOAT64, assert_close

#: Families of tests/_problems.py that cover every feature and tiling edge, in float64.
FAMILIES = ["gqa4-causal", "window128-gqa", "packing-causal-window", "sinks2-window", "d256", "ragged97",
            "sq<sk", "tiny", "2-sections", "scale-causal-sinks", "mla-192-128-window", "dv-wider-packing"]
F64_CASES = [(name, case) for name, case in CASES if name in FAMILIES]
DROP = dict(dropout_p=0.3, seed=99, seed_offset=4)   # 1 / (1 - p) is not a float32


def test_every_family_is_known():
    assert {name for name, _ in F64_CASES} == set(FAMILIES)


@pytest.mark.parametrize("case", [c for _, c in F64_CASES], ids=[n for n, _ in F64_CASES])
def test_forward_and_backward_match_the_float64_golden(case):
    inputs = make_inputs(case, np.float64)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural",
                                   **forward_options(inputs))
    o_exp, lse_exp = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                          sinks=inputs.get("sinks_ref"), bound_min=inputs.get("bound_min"),
                                          bound_max=inputs.get("bound_max"), use_causal_mask=case.causal,
                                          softmax_scale=case.softmax_scale, sliding_window=case.window)
    assert o.dtype == lse.dtype == np.float64
    assert_close(o, o_exp, FLOAT64, "o")
    finite = np.isfinite(lse_exp)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert_close(lse[finite], lse_exp[finite], FLOAT64, "lse")
    got = numbafa.attention_bwd(**inputs)
    expected = golden.attention_bwd(**inputs)
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert g.dtype == np.float64, name
        assert_close(g, e, FLOAT64, name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64-sinks", "float32-sinks"])
def test_dropout_and_the_sinks_dtype(dtype):
    """Dropout's multiplier is float64 too; float32 sinks of a float64 call get a float32 gradient."""
    case = Case(nheads=3, nheads_kv=1, d_head=48, d_head_v=40, seqlen_q=640, seqlen_k=640, causal=True,
                num_sinks=1)   # one unit: split in two Q chunks
    inputs = make_inputs(case, np.float64)
    inputs["sinks_ref"] = inputs["sinks_ref"].astype(dtype)
    fwd = dict(forward_options(inputs), **DROP)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], lse_layout="natural", **fwd)
    o_exp, _ = golden.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                    sinks=inputs["sinks_ref"], use_causal_mask=True, lse_layout="natural", **DROP)
    assert_close(o, o_exp, FLOAT64, "o")
    inputs.update(o_ref=o, lse_ref=lse)
    got = numbafa.attention_bwd(**inputs, **DROP)
    expected = golden.attention_bwd(**inputs, **DROP)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert_close(g, e, FLOAT64, name)
    assert got[3].dtype == dtype
    assert_close(got[3], expected[3], FLOAT64 if dtype == np.float64 else FLOAT32, "dsinks")


def test_mixed_precision_has_no_effect_and_threads_change_no_bit():
    inputs = make_inputs(Case(bs=2, nheads=4, nheads_kv=2, causal=True, num_sinks=1, seqlen_q=640,
                              seqlen_k=640), np.float64)
    base = numbafa.attention_bwd(**inputs)
    previous = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single = numbafa.attention_bwd(**inputs, mixed_precision=True)
    finally:
        numba.set_num_threads(previous)
    for a, b in zip(base, single):
        np.testing.assert_array_equal(a.view(np.uint64), b.view(np.uint64))


def test_float32_and_bf16_calls_are_not_widened():
    """A float32 call still computes in float32: its error against the float64 golden is a
    float32 one, well above float64's (the float64 kernels are another specialisation)."""
    inputs = make_inputs(Case(causal=True), np.float32)
    got = numbafa.attention_bwd(**inputs)
    expected = golden.attention_bwd(**inputs)
    assert got[0].dtype == np.float32
    assert np.abs(got[0] - expected[0]).max() > 1e-9 * np.abs(expected[0]).max()


@pytest.mark.parametrize("change, error, message", [
    (dict(lse_ref=np.float32), TypeError, "lse_ref must be float64 for float64 inputs, got float32"),
    (dict(sinks_ref=ml_dtypes.bfloat16), TypeError, "sinks_ref must be float64 or float32 for float64 inputs, "
                                                     "got bfloat16"),
    (dict(v_ref=np.float32), TypeError, "v_ref must have the dtype of q_ref (float64), got float32"),
])
def test_dtype_errors_name_the_argument(change, error, message):
    inputs = make_inputs(Case(num_sinks=1, seqlen_q=128, seqlen_k=128), np.float64)
    for key, dtype in change.items():
        inputs[key] = inputs[key].astype(dtype)
    with pytest.raises(error, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        numbafa.attention_bwd(**inputs)


def test_the_range_is_float64s():
    """Scores beyond float32 are fine in float64; beyond float64 they are refused, named."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 16, 128)) for _ in range(3))
    big = 1e25   # |q k| ~ 1e50: float32 would overflow, float64 does not
    o, lse = numbafa.attention_fwd(q * big, k * big, v, lse_layout="natural")
    o_exp, lse_exp = golden.attention_fwd(q * big, k * big, v)
    assert_close(o, o_exp, FLOAT64, "o")
    assert_close(lse, lse_exp, FLOAT64, "lse")
    with pytest.raises(FloatingPointError, match="overflow float64"):
        numbafa.attention_fwd(q * 1e160, k * 1e160, v)
