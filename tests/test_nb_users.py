"""numbafa.nb in a user's code: what a user's compile holds and caches, the training example, the errors
of compiled code, and plans that are not this process's (the bits of every feature: tests/test_nb.py)."""

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

from _nb_cases import api_results, nb_inputs, nb_results

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_njit.py"


@numba.njit
def _users_step(plan, q, k, v, o, lse, dy, sinks, dq, dk, dv, dsinks):
    nb.attention_fwd(plan, q, k, v, o, lse, sinks)
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks)


def _users_step_module():
    """The LLVM module of :func:`_users_step`, compiled for a float32 plan with sinks."""
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 128, np.float32)
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
    and every njit caller), and so are nb's checks and conversions around them (compiled once per
    argument types), the checks' messages are formatted in Python when raised, and the passes'
    thin wrappers are inlined: a user's compile neither re-optimises the entries or the checks
    nor compiles Numba's string building, which together were most of it."""
    defined = [f.name for f in _users_step_module().functions if not f.is_declaration]
    for forbidden in ("forward_entry", "backward_entry", "forward_items", "unicode_concat", "_set_code_point",
                      "integer_str", "_empty_string", "2nb8_forward", "2nb9_backward"):
        assert not [name for name in defined if forbidden in name], forbidden
    # nb's public passes are inlined into the caller at Numba's IR level: one level less to compile
    assert not [name for name in defined if "2nb13attention_fwd" in name or "2nb13attention_bwd" in name], defined


def test_njit_errors_are_the_builtin_exceptions_with_a_formatted_message():
    """Raised in njit code, the errors are subclasses of the builtin exceptions whose message is
    formatted from the template and values the compiled code passes; pickled, they travel as the
    builtin exception with the same message (a Dask worker's error, for example)."""
    import pickle
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
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


#: A user's script: a step function calling both passes (``{options}``: its njit options), its
#: arrays and plan, float32.
USER_STEP = '''\
import numba, numpy as np, numbafa.nb as nb, numbafa

@numba.njit{options}
def step(plan, q, k, v, o, lse, dy, dq, dk, dv):
    nb.attention_fwd(plan, q, k, v, o, lse)
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)

rng = np.random.default_rng(0)
q, k, v, dy = (rng.standard_normal((1, 2, 16, 256), dtype=np.float32) for _ in range(4))
plan = nb.plan(q, k, v, use_causal_mask=True)
o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
'''

USER_CACHED = USER_STEP.format(options="(cache=True)") + '''\
with nb.single_threaded_blas():
    step(plan, q, k, v, o, lse, dy, dq, dk, dv)
ref = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
print(sum(step.stats.cache_hits.values()), all(np.array_equal(a, b) for a, b in zip(ref, (dq, dk, dv))))
'''


def test_a_users_function_cached_by_numba_loads_in_a_new_process(tmp_path):
    """Numba's own cache (the user's ``cache=True``) holds nb's code with the launchers' parallel
    loops; loaded in a new process it must find the threading layer started and run, and the
    passes' checks, which it calls by key, recorded by ``nb.plan`` from numbafa's disk cache.
    Without them (numbafa's cache off or cleared since) the call raises, naming the remedy."""
    script = tmp_path / "user_step.py"
    script.write_text(USER_CACHED)
    unregistered = ("import runpy, numbafa.nb\nnumbafa.nb._register_cached_bodies = lambda plan: None\n"
                    f"runpy.run_path({str(script)!r}, run_name='__main__')\n")   # the same file: its cache
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
               NUMBAFA_CACHE_DIR=str(pathlib.Path(numbafa.backend_info()["cache"]["dir"] or tmp_path).parent))
    runs = [subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
            for args in ([str(script)], [str(script)], ["-c", unregistered])]
    for run in runs[:2]:
        assert run.returncode == 0, run.stderr[-3000:]
    assert [run.stdout.split()[-2:] for run in runs[:2]] == [["0", "True"], ["1", "True"]]
    assert runs[2].returncode == 1
    assert runs[2].stderr.rstrip().splitlines()[-1] == f"RuntimeError: {nb._BODY_NOT_LOADED}", runs[2].stderr[-3000:]


USER_UNCACHED = '''\
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        func = ev.data["dispatcher"].py_func
        compiled.append(f"{func.__module__}.{func.__qualname__}")
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
''' + USER_STEP.format(options="") + '''\
step(plan, q, k, v, o, lse, dy, dq, dk, dv)
print(" ".join(name for name in compiled if name.startswith("numbafa.")) or "-")
'''


def test_a_users_next_process_loads_the_passes_bodies_from_the_cache(tmp_path):
    """A user's own (uncached) function compiles nb's checks and conversions around the entries
    once per argument types: a later process loads them from numbafa's disk cache, so only the
    user's function and nb's one-line calls are compiled there."""
    script = tmp_path / "user_step.py"
    script.write_text(USER_UNCACHED)
    env = dict(os.environ, NUMBAFA_CACHE_DIR=str(pathlib.Path(numbafa.backend_info()["cache"]["dir"] or tmp_path).parent))
    runs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[1].stdout.split()[-1] == "-", runs[1].stdout


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


@numba.njit
def _moved(plan, seed_offset):
    return nb.with_seed_offset(plan, seed_offset)


def test_plan_knows_the_type_of_its_plans_back_from_njit_code():
    """``nb.plan`` records the cached checks of its plan's type and of that type once returned by
    njit code (float32 fields boxed as floats), which a user's cached function may be typed with."""
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, dropout_p=0.3, seed=11)
    back = _moved(plan, 2)
    assert numba.typeof(back) != numba.typeof(plan)
    assert numba.typeof(back) == numba.typeof(nb._as_boxed(plan))
    assert nb._as_boxed(plan)._replace(fwd=back.fwd, bwd=back.bwd) == back


def test_the_public_passes_are_typed_in_every_process():
    """Called from Python, ``nb.attention_fwd``/``attention_bwd`` are compiled in each process, never
    loaded from the disk cache: typing their call is what records nb's checks in the process's
    kernel table (a cached copy, typed with a changed plan's type in an earlier process, would find
    nothing there and raise a RuntimeError instead of the plan's ValueError)."""
    from numbafa.compiler.jit import _LazyCache
    for public in (nb.attention_fwd, nb.attention_bwd):
        assert not isinstance(public._cache, _LazyCache)
    assert isinstance(nb._with_seed_offset._cache, _LazyCache)


ANNOUNCED = """
import numba, numpy as np
import numbafa.nb as nb
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, n, 16, 256)).astype(np.float32) for n in (2, 1, 1))
plan = nb.plan(q, k, v)
real, compiled = nb.register_function, []

def register(body, argtys):
    numba.njit(lambda x: x + 1)(1.0)          # a real compile where the checks' would run
    compiled.append(body.py_func.__name__)
    return real(body, argtys)

nb.register_function = register

@numba.njit
def users(plan, q, k, v, o, lse):
    nb.attention_fwd(plan, q, k, v, o, lse)

users(plan, q, k, v, np.empty_like(q), np.empty((1, 2, 128, 2), np.float32))
print(compiled)
"""


def test_compiling_the_checks_is_announced_before_it_starts(tmp_path):
    """Typing a user's call of a pass compiles (or loads) nb's checks for its argument types inside
    ``announced_compile``: a compile there is announced, naming the pass, before it starts. (In a
    process of its own: Numba types an overload once per argument types and process.)"""
    env = dict(os.environ, NUMBAFA_CACHE_DIR=str(pathlib.Path(numbafa.backend_info()["cache"]["dir"] or tmp_path).parent))
    run = subprocess.run([sys.executable, "-c", ANNOUNCED], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[-2] == "['_forward']", run.stdout
    notices = [line for line in run.stderr.splitlines() if "numbafa.nb's checks" in line]
    assert len(notices) == 1 and notices[0].startswith("numbafa: compiling numbafa.nb's checks and conversions "
                                                       "around attention_fwd"), run.stderr[-3000:]
def test_a_plan_back_from_njit_code_still_works():
    """Numba boxes float32 fields as Python floats: a plan returned by njit code comes back with
    float64 ones, which the calls turn back into the plan's float32."""
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
    plan = _moved(nb.plan(q, k, v, dropout_p=0.3, seed=11), 2)
    assert isinstance(plan.fwd.softmax_scale, float)
    with nb.single_threaded_blas():
        got = nb_results(plan, q, k, v, dy, sinks)
    for a, e in zip(got, api_results(q, k, v, dy, sinks, dict(dropout_p=0.3, seed=11, seed_offset=2))):
        np.testing.assert_array_equal(a, e)


# ---------------------------------------------------------------------------
# The Python API's guarantees, in compiled code
# ---------------------------------------------------------------------------

def _small(dtype=np.float32, **options):
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, dtype)
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
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
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
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
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


def test_an_array_of_another_rank_is_a_value_error_naming_it():
    """Ranks are known when a call is typed: a one-line ValueError naming the array and its layout,
    not a Numba typing error."""
    q, k, v, dy, sinks = nb_inputs(1, 2, 1, 16, 256, np.float32)
    plan = nb.plan(q, k, v, with_sinks=True)
    o, lse = np.empty_like(q), np.empty((1, 2, 128, 2), np.float32)
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    cases = [
        (r"q must be 4-D \[bs, nheads, d_head, seqlen_q\], got a 3-D array",
         lambda: nb.attention_fwd(plan, q[0], k, v, o, lse, sinks)),
        (r"dv must be 4-D \[bs, nheads_kv, d_head_v, seqlen_k\], got a 5-D array",
         lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, grads[0], grads[1], grads[2][None], sinks,
                                  np.empty_like(sinks))),
        (r"lse must be 3-D .* or 4-D .*, got a 5-D array",
         lambda: nb.attention_fwd(plan, q, k, v, o, lse[None], sinks)),
        (r"sinks must have 1 to 3 dims as the plan's, got 4",
         lambda: nb.attention_fwd(plan, q, k, v, o, lse, sinks[None, None])),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match="^numbafa.nb: " + match):
            call()
    # a required array not given (None) is a TypeError naming it, in both passes
    for name, call in (("o", lambda: nb.attention_fwd(plan, q, k, v, None, lse, sinks)),
                       ("k", lambda: nb.attention_fwd(plan, q, None, v, o, lse, sinks)),
                       ("lse", lambda: nb.attention_fwd(plan, q, k, v, o, None, sinks)),
                       ("dy", lambda: nb.attention_bwd(plan, q, k, v, o, None, lse, *grads, sinks,
                                                       np.empty_like(sinks))),
                       ("dq", lambda: nb.attention_bwd(plan, q, k, v, o, dy, lse, None, grads[1], grads[2], sinks,
                                                       np.empty_like(sinks)))):
        with pytest.raises(TypeError, match=f"^numbafa.nb: {name} must be a NumPy array, got none"):
            call()
    with pytest.raises(TypeError, match="q"):
        nb.plan([1.0], k, v, with_sinks=True)


def test_every_pair_of_arrays_that_must_not_overlap_is_named():
    """Each output against each input still read and against the other outputs, in both passes:
    two arrays sharing memory (views of one buffer, the types of an ordinary call) raise naming
    both, before anything runs."""
    q, k, v, dy, plan = _small()
    shapes = dict(q=q.shape, k=k.shape, v=v.shape, o=q.shape, dy=q.shape, lse=(1, 2, 128, 2), dq=q.shape,
                  dk=k.shape, dv=v.shape)
    passes = {nb.attention_fwd: (("q", "k", "v", "o", "lse"), ("o", "lse")),                 # (the call's order)
              nb.attention_bwd: (("q", "k", "v", "o", "dy", "lse", "dq", "dk", "dv"), ("dq", "dk", "dv"))}
    for call, (names, outputs) in passes.items():
        pairs = [(a, b) for i, a in enumerate(outputs) for b in names if b not in outputs[:i + 1]]
        assert len(pairs) == (7 if call is nb.attention_fwd else 21)
        for a, b in pairs:
            arrays = {x: np.zeros(shapes[x], np.float32) for x in names}
            buffer = np.zeros(max(arrays[a].size, arrays[b].size), np.float32)
            for x in (a, b):
                arrays[x] = buffer[:arrays[x].size].reshape(shapes[x])
            with pytest.raises(ValueError, match=f"^numbafa.nb: {a} shares memory with {b}: outputs must not "):
                call(plan, *(arrays[x] for x in names))


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
