"""numbafa.nb: the kernels from a user's own @njit code, bit for bit the Python API's."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numba
import numpy as np
import pytest

import numbafa
import numbafa.nb as nb
from numbafa.compiler.linking import CELL_PREFIX, TABLE_SYMBOL

from _problems import Case, make_inputs

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_njit.py"

# (name, bs, nheads, nheads_kv, d_head, seqlen, options): each a feature of the kernels.
CASES = [
    ("gqa-causal-sinks", 1, 4, 2, 32, 256, dict(use_causal_mask=True, with_sinks=True)),
    ("mqa-split-window", 1, 2, 1, 16, 640, dict(use_causal_mask=True, sliding_window=100)),
    ("packing-scale", 2, 2, 2, 24, 128,
     dict(bound_min=np.repeat(np.float32([0, 64]), 64), bound_max=np.repeat(np.float32([64, 128]), 64),
          softmax_scale=0.3)),
    ("dropout", 1, 2, 1, 16, 256, dict(use_causal_mask=True, dropout_p=0.2, seed=7, seed_offset=3)),
    # d_head (40) for q and k, d_head_v (24) for v, o, dy: one unit, split in two Q chunks
    ("head-dims-split-sinks", 1, 3, 1, (40, 24), 640, dict(use_causal_mask=True, with_sinks=True)),
]
_API_ONLY = ("with_sinks",)


def _inputs(bs, nheads, nheads_kv, d_head, seqlen, dtype, seed=0):
    """q, k, v, dy, sinks; ``d_head`` an int, or ``(d_head, d_head_v)``."""
    rng = np.random.default_rng(seed)
    d_head, d_v = (d_head, d_head) if isinstance(d_head, int) else d_head
    q, dy = (rng.standard_normal((bs, nheads, d, seqlen)).astype(dtype) for d in (d_head, d_v))
    k, v = (rng.standard_normal((bs, nheads_kv, d, seqlen)).astype(dtype) for d in (d_head, d_v))
    sinks = rng.standard_normal((bs, nheads)).astype(np.float32)
    return q, k, v, dy, sinks


def _bits(x):
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


def _api(q, k, v, dy, sinks, options):
    kw = {key: val for key, val in options.items() if key not in _API_ONLY}
    s = sinks if options.get("with_sinks") else None
    o, lse = numbafa.attention_fwd(q, k, v, s, **kw)
    return (o, lse) + tuple(numbafa.attention_bwd(q, k, v, o, dy, lse, s, **kw))


def _nb(plan, q, k, v, dy, sinks, call_fwd=nb.attention_fwd, call_bwd=nb.attention_bwd):
    q, k, v, dy = (_bits(x) for x in (q, k, v, dy))
    bs, nheads, _, seqlen = q.shape
    o, lse = np.empty_like(dy), np.empty((bs, nheads, 128, seqlen // 128), np.float32)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    if plan.sinks_shape[0]:
        dsinks = np.empty_like(sinks)
        call_fwd(plan, q, k, v, o, lse, sinks)
        call_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks)
        return o, lse, dq, dk, dv, dsinks
    call_fwd(plan, q, k, v, o, lse)
    call_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name,bs,nheads,nheads_kv,d_head,seqlen,options", CASES, ids=[c[0] for c in CASES])
def test_the_bits_of_the_python_api(name, bs, nheads, nheads_kv, d_head, seqlen, options, dtype):
    q, k, v, dy, sinks = _inputs(bs, nheads, nheads_kv, d_head, seqlen, dtype)
    plan = nb.plan(q, k, v, **options)
    with nb.single_threaded_blas():
        got = _nb(plan, q, k, v, dy, sinks)
    expected = _api(q, k, v, dy, sinks, options)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, _bits(e))


@numba.njit
def _user_fwd(plan, q, k, v, o, lse):
    numbafa.nb.attention_fwd(plan, q, k, v, o, lse)


@numba.njit
def _user_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv):
    numbafa.nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)


def test_called_from_a_users_njit_function():
    q, k, v, dy, sinks = _inputs(1, 4, 2, 32, 256, np.float32)
    plan = nb.plan(q, k, v, use_causal_mask=True)
    got = _nb(plan, q, k, v, dy, sinks, _user_fwd, _user_bwd)   # no wrap: each pass pins BLAS itself
    for a, e in zip(got, _api(q, k, v, dy, sinks, dict(use_causal_mask=True))):
        np.testing.assert_array_equal(a, e)


def test_each_pass_runs_inside_the_blas_pin_and_leaves_it(monkeypatch):
    """The passes pin BLAS to one thread around the entry, as the Python API does (a threaded
    OpenBLAS inside the kernels changes the bits: OpenBLAS 0.3.30 Haswell kernels, 42 % of o):
    the pin's two callbacks run once each per pass, in order, also when the pass raises."""
    import numbafa.compiler.runtime as runtime
    from numbafa.platform import blas
    seen = []
    monkeypatch.setattr(runtime, "pin", lambda: (seen.append("pin"), blas.pin()))
    monkeypatch.setattr(runtime, "unpin", lambda: (seen.append("unpin"), blas.unpin()))
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    seen.clear()
    _nb(plan, q, k, v, dy, sinks, _user_fwd, _user_bwd)
    assert seen == ["pin", "unpin"] * 2
    assert blas._PIN._active == 0
    seen.clear()
    bad = q.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="q must be finite"):
        _user_fwd(plan, bad, k, v, np.empty_like(q), np.empty((1, 2, 128, 1), np.float32))
    assert seen == ["pin", "unpin"] and blas._PIN._active == 0


def test_seed_offset_in_njit_code_is_another_plans_mask():
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, dropout_p=0.3, seed=11, seed_offset=0)
    moved = nb.with_seed_offset(plan, 5)
    with nb.single_threaded_blas():
        got = _nb(moved, q, k, v, dy, sinks)
    for a, e in zip(got, _api(q, k, v, dy, sinks, dict(dropout_p=0.3, seed=11, seed_offset=5))):
        np.testing.assert_array_equal(a, e)
    assert not nb.with_seed_offset(nb.plan(q, k, v), 5).fwd.dropout.active


def test_strided_and_read_only_arrays_are_taken_too():
    q, k, v, dy, sinks = _inputs(1, 2, 2, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    wide = np.zeros((1, 2, 16, 256), np.float32)
    wide[..., ::2] = q
    frozen = k.copy()
    frozen.flags.writeable = False
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 1), np.float32)
    with nb.single_threaded_blas():
        nb.attention_fwd(plan, wide[..., ::2], frozen, v, o, lse)
    o_ref, lse_ref = numbafa.attention_fwd(q, k, v)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)


def _filled(shape, dtype=np.float32):
    return np.full(shape, 7, dtype)


@pytest.mark.parametrize("bad", ["dq-shape", "k-shape", "lse-shape", "dtype", "no-sinks", "stray-sinks",
                                 "dv-head-dim", "dy-head-dim"])
def test_arrays_that_do_not_match_the_plan_raise_before_writing(bad):
    q, k, v, dy, sinks = _inputs(1, 2, 1, (16, 8), 128, np.float32)
    plan = nb.plan(q, k, v, with_sinks=bad == "stray-sinks")
    o, lse = _filled(dy.shape), _filled((1, 2, 128, 1))
    dq, dk, dv = _filled(q.shape), _filled(k.shape), _filled(v.shape)
    args = [plan, q, k, v, o, dy, lse, dq, dk, dv]
    if bad == "dq-shape":
        args[7] = dq = _filled((1, 2, 16, 256))
    elif bad == "k-shape":
        args[2] = np.zeros((1, 2, 16, 128), np.float32)
    elif bad == "lse-shape":
        args[6] = np.zeros((1, 2, 128), np.float32).reshape(1, 2, 1, 128)
    elif bad == "dtype":   # bf16 bits for a float32 plan
        args[1:6] = [x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in (q, k, v, o, dy)]
        args[7:] = [x.astype(np.uint16) for x in (dq, dk, dv)]
    elif bad == "no-sinks":
        plan = args[0] = nb.plan(q, k, v, with_sinks=True)
    elif bad == "dv-head-dim":   # k's shape: the value head dim differs
        args[9] = dv = _filled(k.shape)
    elif bad == "dy-head-dim":
        args[5] = _filled(q.shape)
    with pytest.raises(TypeError if bad == "dtype" else ValueError, match="^numbafa.nb: "):
        nb.attention_bwd(*args)
    for x in args[7:]:
        assert (x == 7).all()


def test_plan_validates_as_the_python_api():
    q, k, v, _, _ = _inputs(1, 2, 2, 16, 128, np.float32)
    with pytest.raises(ValueError, match="k must have shape"):
        nb.plan(q, k[:, :, :8], v)
    with pytest.raises(TypeError, match="q must be float32, float64, float16 or bfloat16"):
        nb.plan(q.astype(np.int32), k, v)
    with pytest.raises(ValueError, match="lse_layout='neuron' needs seqlen_q divisible by 128"):
        nb.plan(q[..., :100], k[..., :100], v[..., :100])
    assert nb.plan(q[..., :100], k[..., :100], v[..., :100], lse_layout="natural").lse_natural
    with pytest.raises(TypeError, match="bias must be float32 or the inputs' dtype \\(float32\\), got bfloat16"):
        nb.plan(q, k, v, bias=np.zeros((128, 128), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="sliding_window=8 requires use_causal_mask=True"):
        nb.plan(q, k, v, sliding_window=8)
    with pytest.raises(TypeError, match="with_sinks must be a bool"):
        nb.plan(q, k, v, with_sinks=1)
    bits = nb.plan(q.astype(ml_dtypes.bfloat16).view(np.uint16), k.astype(ml_dtypes.bfloat16),
                   v.astype(ml_dtypes.bfloat16))
    assert bits.kind == nb.BF16
    assert nb.plan(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)).kind == nb.FP16


@numba.njit
def _users_step(plan, q, k, v, o, lse, dy, sinks, dq, dk, dv, dsinks):
    nb.attention_fwd(plan, q, k, v, o, lse, sinks)
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks)


def _users_step_module():
    """The LLVM module of :func:`_users_step`, compiled for a float32 plan with sinks."""
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v, with_sinks=True)
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 1), np.float32)
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v), np.empty_like(sinks))
    _users_step(plan, q, k, v, o, lse, dy, sinks, *grads)
    (cres,) = _users_step.overloads.values()
    return cres.library._final_module


def test_nb_code_reads_no_cell():
    """A user's function cached by Numba holds numbafa.nb's code: it must find the launcher and the
    work items in the process's kernel table (numbafa.compiler.linking.KERNELS: one symbol, which
    numbafa.nb.plan defines), never through a cell only numbafa's own cache knows how to fill."""
    module = _users_step_module()
    cells = [gv.name for gv in module.global_variables if gv.name.startswith(CELL_PREFIX)]
    assert not cells, cells
    assert any(gv.name == TABLE_SYMBOL for gv in module.global_variables)


def test_a_users_function_holds_no_entry_body_and_builds_no_string():
    """The compiled entries are called through the kernel table (compiled once for the Python API
    and every njit caller), the checks' messages are formatted in Python when raised, and the
    passes' thin wrappers are inlined: a user's compile neither re-optimises the entries nor
    compiles Numba's string building, which together were most of it."""
    defined = [f.name for f in _users_step_module().functions if not f.is_declaration]
    for forbidden in ("forward_entry", "backward_entry", "forward_items", "unicode_concat", "_set_code_point",
                      "integer_str", "_empty_string"):
        assert not [name for name in defined if forbidden in name], forbidden
    # nb's public passes are inlined into the caller at Numba's IR level: one level less to compile
    assert not [name for name in defined if "2nb13attention_fwd" in name or "2nb13attention_bwd" in name], defined


def test_njit_errors_are_the_builtin_exceptions_with_a_formatted_message():
    """Raised in njit code, the errors are subclasses of the builtin exceptions whose message is
    formatted from the template and values the compiled code passes; pickled, they travel as the
    builtin exception with the same message (a Dask worker's error, for example)."""
    import pickle
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v)
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
    with pytest.raises(ValueError) as info:
        nb.attention_fwd(plan, q, k[:, :, :, :128], v, o, lse)
    assert isinstance(info.value, nb.NbValueError)
    assert str(info.value) == "numbafa.nb: k must have shape (1, 1, 16, 256) as the plan's, got (1, 1, 16, 128)"
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is ValueError and str(back) == str(info.value)
    with pytest.raises(ValueError, match="^numbafa.nb: o shares memory with lse: outputs must not overlap"):
        nb.attention_fwd(plan, q, k, v, o, o.reshape(-1)[:512].reshape(1, 2, 128, 2))


USER_CACHED = '''\
import numba, numpy as np, numbafa.nb as nb, numbafa

@numba.njit(cache=True)
def step(plan, q, k, v, o, lse, dy, dq, dk, dv):
    nb.attention_fwd(plan, q, k, v, o, lse)
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)

rng = np.random.default_rng(0)
q, k, v, dy = (rng.standard_normal((1, 2, 16, 256), dtype=np.float32) for _ in range(4))
plan = nb.plan(q, k, v, use_causal_mask=True)
o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
with nb.single_threaded_blas():
    step(plan, q, k, v, o, lse, dy, dq, dk, dv)
ref = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
print(sum(step.stats.cache_hits.values()), all(np.array_equal(a, b) for a, b in zip(ref, (dq, dk, dv))))
'''


def test_a_users_function_cached_by_numba_loads_in_a_new_process(tmp_path):
    """Numba's own cache (the user's ``cache=True``) holds nb's code with the launchers' parallel
    loops; loaded in a new process it must find the threading layer started and run."""
    script = tmp_path / "user_step.py"
    script.write_text(USER_CACHED)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
               NUMBAFA_CACHE_DIR=str(pathlib.Path(numbafa.backend_info()["cache"]["dir"] or tmp_path).parent))
    runs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert [run.stdout.split()[-2:] for run in runs] == [["0", "True"], ["1", "True"]]


def _example():
    spec = importlib.util.spec_from_file_location("train_njit", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_the_njit_training_example_takes_the_python_apis_gradients_and_learns(dtype):
    ex = _example()
    params = ex.init_params(len(set(ex.TEXT)))
    bsz, seq = 2, 128
    plan = ex.make_plan(params, seq, bsz, dtype=dtype)
    slopes, (narrow, widen) = ex.alibi_slopes(4), ex.STORAGE[dtype]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((bsz * seq, 64)).astype(np.float32)
    da = rng.standard_normal((bsz * seq, 64)).astype(np.float32)
    with nb.single_threaded_blas():
        got = ex.attention_step(plan, x, *params[1:4], da, bsz, seq, slopes, narrow, widen)
    q, k, v, o, dy, dq, dk, dv = (a.view(ml_dtypes.bfloat16) if dtype == "bf16" else a for a in got)
    kw = dict(use_causal_mask=True, alibi_slopes=slopes, mixed_precision=dtype == "bf16")
    o_ref, lse_ref = numbafa.attention_fwd(q, k, v, **kw)
    np.testing.assert_array_equal(o.view(np.uint8), o_ref.view(np.uint8))
    for a, e in zip((dq, dk, dv), numbafa.attention_bwd(q, k, v, o_ref, dy, lse_ref, **kw)):
        np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8))
    losses = ex.train(steps=30, bsz=4, log_every=0, dtype=dtype)
    assert losses[-1] < losses[0] - 0.8


def test_a_plan_back_from_njit_code_still_works():
    """Numba boxes float32 fields as Python floats: a plan returned by njit code comes back with
    float64 ones, which the calls turn back into the plan's float32."""
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.with_seed_offset(nb.plan(q, k, v, dropout_p=0.3, seed=11), 2)
    assert isinstance(plan.fwd.softmax_scale, float)
    with nb.single_threaded_blas():
        got = _nb(plan, q, k, v, dy, sinks)
    for a, e in zip(got, _api(q, k, v, dy, sinks, dict(dropout_p=0.3, seed=11, seed_offset=2))):
        np.testing.assert_array_equal(a, e)


# ---------------------------------------------------------------------------
# Every feature and dtype of the Python API, bit for bit
# ---------------------------------------------------------------------------

def _api_all(inputs, fwd_kw, bwd_kw):
    """The Python API's ``(o, lse, grads...)`` of a ``make_inputs`` dict (lse natural)."""
    q, k, v, dy = (inputs[key] for key in ("q_ref", "k_ref", "v_ref", "dy_ref"))
    o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural", **fwd_kw)
    return (o, lse) + tuple(numbafa.attention_bwd(q, k, v, o, dy, lse, **bwd_kw))


def _storage(x):
    """The bits of 16-bit floats (nb's arrays for them), other arrays as they are."""
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


def _nb_all(plan, inputs, call_kw, sinks, bias_out):
    """``numbafa.nb``'s ``(o, lse, grads...)`` of the same problem, lse natural."""
    q, k, v, dy = (_storage(inputs[key]) for key in ("q_ref", "k_ref", "v_ref", "dy_ref"))
    bs, nheads, d_v, seqlen = dy.shape
    acc = np.float64 if q.dtype == np.float64 else np.float32
    o, lse = np.empty_like(dy), np.empty((bs, nheads, seqlen), acc)
    nb.attention_fwd(plan, q, k, v, o, lse, sinks=sinks, **call_kw)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    extra = {}
    if sinks is not None:
        extra.update(sinks=sinks, dsinks=np.empty(sinks.shape, acc))
    if bias_out is not None:
        extra["dbias"] = bias_out
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, **call_kw, **extra)
    grads = (dq, dk, dv) + ((extra["dsinks"],) if sinks is not None else ()) + ((bias_out,) if bias_out is not None
                                                                              else ())
    return (o, lse) + grads


FEATURES = {
    # bias with its gradient, ALiBi and a soft cap together
    "variants": (Case(bs=2, nheads=4, nheads_kv=2, d_head=32, causal=True), np.float32,
                 dict(bias=(4, 256, 256), alibi=True, softcap=20.0)),
    "dropout-sinks": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, num_sinks=1), np.float32,
                      dict(dropout_p=0.2, seed=3, seed_offset=9)),
    "float64-sinks": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, num_sinks=2), np.float64, {}),
    "float16-window": (Case(nheads=2, nheads_kv=1, d_head=16, causal=True, window=64), np.float16,
                       dict(mixed_precision=True)),
    "bf16-variants-not-mixed": (Case(nheads=2, nheads_kv=2, d_head=32, causal=True), ml_dtypes.bfloat16,
                                dict(bias=(2, 256, 256), alibi=True)),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_and_dtype_gives_the_python_apis_bits(name):
    case, dtype, spec = FEATURES[name]
    inputs = make_inputs(case, dtype)
    rng = np.random.default_rng(5)
    acc = np.float64 if dtype == np.float64 else np.float32
    options = {key: spec[key] for key in ("dropout_p", "seed", "seed_offset", "softcap", "mixed_precision")
               if key in spec}
    options.update(case.kwargs())
    call = {}
    if "bias" in spec:
        call["bias"] = rng.standard_normal(spec["bias"]).astype(acc)
    if spec.get("alibi"):
        call["alibi_slopes"] = (2.0 ** -np.arange(1, case.nheads + 1)).astype(acc)
    sinks = inputs.get("sinks_ref")
    dbias = np.empty(call["bias"].shape, acc) if "bias" in call else None
    plan = nb.plan(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], sinks=sinks, lse_layout="natural",
                   return_dbias=dbias is not None, **options, **call)
    got = _nb_all(plan, inputs, call, sinks, dbias)
    expected = _api_all(inputs, dict(options, sinks_ref=sinks, **call),
                        dict(options, sinks_ref=sinks, return_dbias=dbias is not None, **call))
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, _storage(np.asarray(e)))


# ---------------------------------------------------------------------------
# The Python API's guarantees, in compiled code
# ---------------------------------------------------------------------------

def _small(dtype=np.float32, **options):
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, dtype)
    return q, k, v, dy, nb.plan(q, k, v, **options)


@pytest.mark.parametrize("where", ["q", "k"])
def test_a_nan_input_is_an_error_naming_it(where):
    q, k, v, dy, plan = _small(use_causal_mask=True)
    bad = {"q": q.copy(), "k": k.copy()}[where]
    bad[0, 0, 3, 5] = np.nan
    args = dict(q=q, k=k)
    args[where] = bad
    o, lse = np.full_like(q, 7), np.full((1, 2, 128, 2), 7, np.float32)
    with pytest.raises(ValueError, match=f"^numbafa.nb: {where} must be finite, got 1 NaN/inf element"):
        nb.attention_fwd(plan, args["q"], args["k"], v, o, lse)
    assert (o == 7).all() and (lse == 7).all()


def test_a_nan_sink_is_an_error_naming_it():
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, with_sinks=True)
    sinks[0, 1] = np.nan
    with pytest.raises(ValueError, match="^numbafa.nb: sinks must be finite"):
        nb.attention_fwd(plan, q, k, v, np.empty_like(q), np.empty((1, 2, 128, 2), np.float32), sinks)


def test_scores_beyond_float32_raise_and_a_large_v_is_rescaled_exactly():
    q, k, v, dy, plan = _small()
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
    with pytest.raises(FloatingPointError, match="^numbafa.nb: the attention scores"):
        nb.attention_fwd(plan, q * np.float32(1e19), k * np.float32(1e19), v, o, lse)
    big = v * np.float32(1e37)
    with nb.single_threaded_blas():
        nb.attention_fwd(plan, q, k, big, o, lse)
    o_ref, lse_ref = numbafa.attention_fwd(q, k, big)
    assert np.isfinite(o).all()
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(lse, lse_ref)


@pytest.mark.parametrize("lse_dtype", [np.int32, np.int64, np.float64])
def test_an_lse_of_another_dtype_is_a_type_error(lse_dtype):
    q, k, v, dy, plan = _small()
    o, lse = np.empty_like(q), np.zeros((1, 2, 128, 2), lse_dtype)
    with pytest.raises(TypeError, match=f"^numbafa.nb: lse must be float32 .*, got {np.dtype(lse_dtype)}"):
        nb.attention_bwd(plan, q, k, v, o, dy, lse, np.empty_like(q), np.empty_like(k), np.empty_like(v))


def test_misuse_is_a_one_line_error_naming_the_argument():
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, with_sinks=True)
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
    nb.attention_fwd(plan, q, k, v, o, lse, sinks)
    frozen = o.copy()
    frozen.flags.writeable = False
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    cases = [
        (ValueError, "^numbafa.nb: o must be writable", lambda: nb.attention_fwd(plan, q, k, v, frozen, lse, sinks)),
        (ValueError, r"^numbafa.nb: sinks must have the rank of the plan's sinks \(2\), got 1",
         lambda: nb.attention_fwd(plan, q, k, v, o, lse, sinks[0])),
        (ValueError, r"^numbafa.nb: lse must be 4-D",
         lambda: nb.attention_fwd(plan, q, k, v, o, lse.reshape(1, 2, 256), sinks)),
        (TypeError, r"^numbafa.nb: dsinks must be float32 \(q is float32\), got float64",
         lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, *grads, sinks, sinks.astype(np.float64))),
        (ValueError, r"^numbafa.nb: dsinks must have shape \(1, 2\)",
         lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, *grads, sinks, np.empty((2, 1), np.float32))),
        (ValueError, "^numbafa.nb: dk shares memory with dv: outputs must not overlap",
         lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, grads[0], grads[1], grads[1], sinks,
                                  np.empty_like(sinks))),
        (ValueError, "^numbafa.nb: dq shares memory with dy",
         lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, dy, grads[1], grads[2], sinks, np.empty_like(sinks))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_a_changed_plan_is_refused():
    """Any field the calls trust, replaced (or taken from another plan), is a ValueError, never a
    jump or an out-of-bounds access."""
    q, k, v, dy, plan = _small(use_causal_mask=True)
    other = nb.plan(q, k, v)
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
    tiling = plan.fwd.tiling._replace(k_tile=10 ** 9)
    changed = [plan._replace(fwd=other.fwd), plan._replace(dims=(1, 2, 1, 16, 256, 256, 16)[:6] + (8,)),
               plan._replace(token=plan.token + 1), plan._replace(fwd=plan.fwd._replace(tiling=tiling)),
               plan._replace(fwd=plan.fwd._replace(mask=plan.fwd.mask._replace(key_hi=plan.fwd.mask.key_hi + 10 ** 6)))]
    for bad in changed:
        with pytest.raises(ValueError, match="^numbafa.nb: this plan was not made by numbafa.nb.plan in this process"):
            nb.attention_fwd(bad, q, k, v, o, lse)


FOREIGN = r"""
import pickle, sys
import numpy as np
import numbafa.nb as nb
plan, q, k, v = pickle.load(open(sys.argv[1], "rb"))
if sys.argv[2] == "own":   # this process made a plan of the same problem: its kernels are ready
    nb.plan(q, k, v)
o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
try:
    nb.attention_fwd(plan, q, k, v, o, lse)
except ValueError as exc:
    print("refused:", exc)
"""


def _foreign(tmp_path, own, prefix=()):
    import pickle

    q, k, v, dy, plan = _small()
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps((plan, q, k, v)))
    return subprocess.run([*prefix, sys.executable, "-c", FOREIGN, str(path), own], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("own", ["own", "none"])
def test_a_plan_from_another_process_is_refused(tmp_path, own):
    """Pickled into a process that made the same plan (its kernels compiled), or none: refused."""
    out = _foreign(tmp_path, own)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: numbafa.nb:" in out.stdout, out.stdout + out.stderr[-2000:]


def _pid_namespaces() -> str | None:
    """Why ``unshare --pid --fork`` cannot run here (None: it can)."""
    import shutil
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", "echo $$"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"unshare --pid cannot run here: {probe.stderr.strip()[:200]}"
    return None if probe.stdout.strip() == "1" else f"not PID 1 in the new namespace: {probe.stdout!r}"


def test_a_plan_from_another_pid_namespace_with_the_same_pid_is_refused(tmp_path):
    """Both processes PID 1 of their own PID namespace (containers): a PID says nothing."""
    why = _pid_namespaces()
    if why is not None:
        pytest.skip(why)
    import pickle

    made = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                           "import os, pickle, sys, numpy as np, numbafa.nb as nb\n"
                           "rng = np.random.default_rng(0)\n"
                           "q, k, v = (rng.standard_normal((1, 2, 16, 256), dtype=np.float32) for _ in range(3))\n"
                           "assert os.getpid() == 1\n"
                           "pickle.dump((nb.plan(q, k, v), q, k, v), open(sys.argv[1], 'wb'))\n",
                           str(tmp_path / "plan.pkl")], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    script = "import os\nassert os.getpid() == 1\n" + FOREIGN
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script,
                          str(tmp_path / "plan.pkl"), "own"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: numbafa.nb:" in out.stdout
