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
from numbafa.linking import CELL_PREFIX

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
    if plan.with_sinks:
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
    with nb.single_threaded_blas():
        got = _nb(plan, q, k, v, dy, sinks, _user_fwd, _user_bwd)
    for a, e in zip(got, _api(q, k, v, dy, sinks, dict(use_causal_mask=True))):
        np.testing.assert_array_equal(a, e)


def test_seed_offset_in_njit_code_is_another_plans_mask():
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, dropout_p=0.3, seed=11, seed_offset=0)
    moved = nb.with_seed_offset(plan, 5)
    with nb.single_threaded_blas():
        got = _nb(moved, q, k, v, dy, sinks)
    for a, e in zip(got, _api(q, k, v, dy, sinks, dict(dropout_p=0.3, seed=11, seed_offset=5))):
        np.testing.assert_array_equal(a, e)
    assert nb.with_seed_offset(nb.plan(q, k, v), 5).fwd.dropout is None


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
    elif bad == "dtype":
        args[1:6] = [x.astype(ml_dtypes.bfloat16).view(np.uint16) for x in (q, k, v, o, dy)]
        args[7:] = [x.astype(np.uint16) for x in (dq, dk, dv)]
    elif bad == "no-sinks":
        plan = args[0] = nb.plan(q, k, v, with_sinks=True)
    elif bad == "dv-head-dim":   # k's shape: the value head dim differs
        args[9] = dv = _filled(k.shape)
    elif bad == "dy-head-dim":
        args[5] = _filled(q.shape)
    with pytest.raises(ValueError, match="numbafa.nb"):
        nb.attention_bwd(*args)
    for x in args[7:]:
        assert (x == 7).all()


def test_a_plan_from_another_process_is_refused():
    q, k, v, _, _ = _inputs(1, 1, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v)._replace(pid=os.getpid() + 1)
    with pytest.raises(ValueError, match="another process"):
        nb.attention_fwd(plan, q, k, v, np.empty_like(q), np.empty((1, 1, 128, 1), np.float32))


def test_plan_validates_as_the_python_api():
    q, k, v, _, _ = _inputs(1, 2, 2, 16, 128, np.float32)
    with pytest.raises(ValueError, match="k must have shape"):
        nb.plan(q, k[:, :, :8], v)
    with pytest.raises(TypeError, match="q must be float32, float64, float16 or bfloat16"):
        nb.plan(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="^numbafa.nb takes float32 or bf16 arrays, got q of float64"):
        nb.plan(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    with pytest.raises(ValueError, match="multiple of 128"):
        nb.plan(q[..., :100], k[..., :100], v[..., :100])
    with pytest.raises(ValueError, match="sliding_window=8 requires use_causal_mask=True"):
        nb.plan(q, k, v, sliding_window=8)
    with pytest.raises(TypeError, match="with_sinks must be a bool"):
        nb.plan(q, k, v, with_sinks=1)
    bits = nb.plan(q.astype(ml_dtypes.bfloat16).view(np.uint16), k.astype(ml_dtypes.bfloat16),
                   v.astype(ml_dtypes.bfloat16))
    assert bits.bf16


def test_nb_code_reads_no_cell():
    """A user's function cached by Numba holds numbafa.nb's code: it must call the work items
    by the plan's addresses, never through a cell only numbafa's own cache knows how to fill."""
    q, k, v, dy, sinks = _inputs(1, 2, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v, with_sinks=True)
    _nb(plan, q, k, v, dy, sinks)
    for function in (nb.attention_fwd, nb.attention_bwd):
        for cres in function.overloads.values():
            cells = [gv.name for gv in cres.library._final_module.global_variables
                     if gv.name.startswith(CELL_PREFIX)]
            assert not cells, cells


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


def test_the_njit_training_example_takes_the_python_apis_gradients_and_learns():
    ex = _example()
    params = ex.init_params(len(set(ex.TEXT)))
    bsz, seq = 2, 128
    plan = ex.make_plan(params, seq, bsz)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((bsz * seq, 64)).astype(np.float32)
    da = rng.standard_normal((bsz * seq, 64)).astype(np.float32)
    with nb.single_threaded_blas():
        q, k, v, o, dy, dq, dk, dv = ex.attention_step(plan, x, *params[1:4], da, bsz, seq)
    o_ref, lse_ref = numbafa.attention_fwd(q, k, v, use_causal_mask=True)
    np.testing.assert_array_equal(o, o_ref)
    for a, e in zip((dq, dk, dv), numbafa.attention_bwd(q, k, v, o_ref, dy, lse_ref, use_causal_mask=True)):
        np.testing.assert_array_equal(a, e)
    losses = ex.train(steps=30, bsz=4, log_every=0)
    assert losses[-1] < losses[0] - 0.8


def test_a_plan_whose_types_changed_is_refused():
    """The work items' addresses hold code compiled for the plan's types: a call with other
    types would run it on wrongly laid out data, so it is refused before anything runs."""
    q, k, v, _, _ = _inputs(1, 1, 1, 16, 128, np.float32)
    plan = nb.plan(q, k, v)
    changed = plan._replace(fwd=plan.fwd._replace(mask=plan.fwd.mask._replace(
        key_lo=plan.fwd.mask.key_lo.astype(np.int64))))
    with pytest.raises(ValueError, match="other argument types"):
        nb.attention_fwd(changed, q, k, v, np.empty_like(q), np.empty((1, 1, 128, 1), np.float32))


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
