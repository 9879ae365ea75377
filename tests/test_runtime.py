"""The guard around every kernel call: threading layers, and the compile announcement."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

import numbafa

# Several Python threads calling the backward at once, checked against one call.
THREADED_CALLS = '''\
import threading
import numpy as np
import numbafa

rng = np.random.default_rng(0)
q, k, v, o, dy = (rng.standard_normal((1, 2, 64, 256), dtype=np.float32) for _ in range(5))
lse = np.abs(rng.standard_normal((1, 2, 256), dtype=np.float32)) + 5
expected = numbafa.attention_bwd(q, k, v, o, dy, lse)
errors = []

def calls():
    try:
        for _ in range(4):
            got = numbafa.attention_bwd(q, k, v, o, dy, lse)
            assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=calls) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
import numba
print(numba.threading_layer(), "calls", errors)
'''


def _run(script, **env):
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def _layer_available(layer: str) -> bool:
    """Whether Numba can load the threading layer ``layer`` here (``tbb`` needs the tbb package)."""
    probe = ("import numba, numpy as np\n@numba.njit(parallel=True)\ndef f(x):\n"
             "    for i in numba.prange(x.size):\n        x[i] = i\nf(np.zeros(4))\n"
             "print(numba.threading_layer())")
    proc = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, NUMBA_THREADING_LAYER=layer),
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0 and proc.stdout.strip() == layer


@pytest.mark.parametrize("layer", ["workqueue", "omp", "tbb"])
def test_threads_calling_at_once_get_the_single_call_result(layer):
    """Every threading layer runs concurrent calls to their single-call bits. workqueue (Numba's
    fallback when neither TBB nor OpenMP is there) aborts the process on concurrent parallel
    launches: numbafa serialises its launches under it (numbafa.kernels.launch)."""
    if not _layer_available(layer):
        pytest.skip(f"Numba's {layer} threading layer is not available here")
    assert _run(THREADED_CALLS, NUMBA_THREADING_LAYER=layer) == f"{layer} calls []"


SERIALISED = '''\
import threading, time
import numpy as np
import numbafa
from numbafa.pipeline import core

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 32, 256), dtype=np.float32) for _ in range(3))
numbafa.attention_fwd(q, k, v)
inside, overlap = [0], [0]
lock = threading.Lock()
entry = core.forward_entry

class Counting:
    """The forward entry, counting how many calls are inside it at once (launch.call_entry calls
    it, under the launch lock where there is one)."""
    overloads = {}

    def __call__(self, *args):
        with lock:
            inside[0] += 1
            overlap[0] = max(overlap[0], inside[0])
        time.sleep(0.01)
        result = entry(*args)
        with lock:
            inside[0] -= 1
        return result

core.forward_entry = Counting()
core._RECIPES = type(core._RECIPES)()   # remembered calls made again, calling the counting entry

def calls():
    for _ in range(5):
        numbafa.attention_fwd(q, k, v)

threads = [threading.Thread(target=calls) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(overlap[0])
'''


@pytest.mark.parametrize("layer", ["workqueue", "omp"])
def test_launches_are_serialised_only_under_workqueue(layer):
    if not _layer_available(layer):
        pytest.skip(f"Numba's {layer} threading layer is not available here")
    overlap = int(_run(SERIALISED, NUMBA_THREADING_LAYER=layer))
    assert overlap == 1 if layer == "workqueue" else overlap > 1


GUARDED_PROBE = '''\
import threading, time
from numbafa.compiler.runtime import kernel_call

inside, overlap = [0], [0]
lock = threading.Lock()

def calls():
    for _ in range(20):
        with kernel_call("probe", "float64"):
            with lock:
                inside[0] += 1
                overlap[0] = max(overlap[0], inside[0])
            time.sleep(0.002)
            with lock:
                inside[0] -= 1

threads = [threading.Thread(target=calls) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(overlap[0])
'''


def test_kernel_calls_are_never_serialised():
    assert int(_run(GUARDED_PROBE, NUMBA_THREADING_LAYER="workqueue")) > 1


def test_api_names_kernel_and_dtype(monkeypatch):
    from numbafa.pipeline import core
    from numbafa.compiler import runtime

    calls = []

    def recording(kernel, dtype):
        calls.append((kernel, dtype))
        return runtime.kernel_call(kernel, dtype)

    monkeypatch.setattr(core, "kernel_call", recording)   # core.py launches the kernels of every front end
    q = np.ones((1, 1, 8, 128), np.float32)
    o, lse = numbafa.attention_fwd(q, q, q)
    numbafa.attention_bwd(q, q, q, o, q, lse)
    assert calls == [("forward", "float32"), ("backward", "float32")]


def _announcements(records):
    return [r for r in records if r.name == "numbafa" and "compiling" in r.getMessage()]


def test_a_real_compile_is_announced_once_before_it_happens(caplog):
    from numbafa.compiler.runtime import kernel_call

    @numba.njit
    def fresh(x):
        return x + 1

    def logged():
        return _announcements(caplog.records)

    with caplog.at_level(logging.INFO, logger="numbafa"):
        fresh(1)                                                # compiled outside a kernel call
        assert logged() == []
        with kernel_call("announced", "float32"):
            fresh(1.0)
        (record,) = logged()
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert "announced kernel" in message and "float32" in message and "once" in message
        assert "cache" in message
        with kernel_call("announced", "float32"):
            fresh(2.0)                                          # already compiled: silent
        with kernel_call("announced", "float32"):
            fresh(np.float32(1))                                # compiles again, same kernel/dtype
        assert len(logged()) == 1
        with kernel_call("announced", "int64"):
            fresh(np.int8(1))
        assert len(logged()) == 2 and "int64" in logged()[1].getMessage()


def test_the_announcement_quotes_the_readme_compile_time(caplog):
    """The warning and the module's documentation give the README's measured figure (the README
    names its CPU and date; the notice carries neither)."""
    import pathlib

    from numbafa.compiler import jit, runtime

    readme = " ".join((pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    figure = re.search(r"\(([\d.]+-[\d.]+ s of CPU) for float32's forward and backward together", readme)
    assert figure, "README: the compile-time sentence moved"

    @numba.njit
    def fresh(x):
        return x * 2

    with caplog.at_level(logging.INFO, logger="numbafa"), runtime.kernel_call("figure", "float32"):
        fresh(1.0)
    (record,) = _announcements(caplog.records)
    for text in (record.getMessage(), " ".join(jit.COMPILE_TIME.split())):
        assert figure[1] in text and "Zen" not in text and "release" not in text, text
        assert "tens of seconds" not in text and "40-second" not in text


def test_announced_by_default_only_when_really_compiling(tmp_path):
    # No logging configuration: Python's last-resort handler prints the WARNING to
    # stderr. A later process loads the probe from the cache and stays silent.
    from test_cache import clean_env, make_site

    site = make_site(tmp_path)
    script = ("import numbafa._probe as p\nfrom numbafa.compiler.runtime import kernel_call\n"
              "with kernel_call('probe', 'int64'):\n    print(int(p.probe(41)))\n")

    def stderr():
        proc = subprocess.run([sys.executable, "-c", script], env=clean_env(tmp_path, site),
                              cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and proc.stdout.strip() == "42", proc.stderr
        return proc.stderr

    cold = stderr()
    assert "compiling the probe kernel for int64 inputs" in cold, cold
    assert str(tmp_path / "cache") in cold
    assert "compiling" not in stderr()


def test_a_compile_outside_a_kernel_call_is_announced_in_its_own_words_once(tmp_path):
    """``announced_compile`` (numbafa.nb's checks, compiled while a user's function is typed):
    its text, then where the code is cached, once per key in a process; a cache load is silent."""
    from test_cache import clean_env, make_site

    site = make_site(tmp_path)
    script = ("import numbafa._probe as p\nfrom numbafa.compiler.runtime import announced_compile\n"
              "with announced_compile('pair', 'compiling the pair probe'):\n    print(int(p.pair(2, 3)))\n"
              "with announced_compile('pair', 'compiling the pair probe'):\n    print(int(p.pair(2.0, 3.0)))\n")

    def stderr():
        proc = subprocess.run([sys.executable, "-c", script], env=clean_env(tmp_path, site),
                              cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and proc.stdout.split() == ["7", "7"], proc.stderr
        return proc.stderr

    cold = stderr()
    assert cold.count("compiling") == 1, cold
    where = f"the compiled code is cached in {tmp_path / 'cache'}"
    assert cold.startswith(f"numbafa: compiling the pair probe; {where}"), cold
    assert "compiling" not in stderr()


FORK_WHILE_HELD = '''\
import os, threading
from numbafa.platform import blas
from numbafa.compiler.runtime import kernel_call

native = blas._PIN.native()   # the native pin's OpenBLAS counts (none on threadpoolctl's path)
counts = (lambda: [fn.get() for fn in native.direct]) if native is not None else list
before = counts()
entered, release = threading.Event(), threading.Event()

def hold():
    with kernel_call("probe", "float32"):   # holds the BLAS pin's lock and count
        entered.set()
        release.wait(30)

holder = threading.Thread(target=hold)
holder.start()
entered.wait(10)
pid = os.fork()
if pid == 0:  # the child has no holder thread: its guard and pin start afresh, the counts it saved back
    fresh = blas._PIN.active == 0 and counts() == before
    done = threading.Event()

    def enter():
        with kernel_call("probe", "float32"):
            done.set()

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    entered_again = done.wait(10)
    thread.join(10)     # (out of the pin again: its counts back)
    os._exit(0 if entered_again and fresh and counts() == before else 3)
_, status = os.waitpid(pid, 0)
release.set()
holder.join()
print(os.waitstatus_to_exitcode(status))
'''


def test_a_child_forked_during_a_kernel_call_neither_deadlocks_nor_stays_pinned():
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    assert _run(FORK_WHILE_HELD, NUMBA_THREADING_LAYER="workqueue") == "0"


def _same_bundle(a, b) -> bool:
    if isinstance(a, tuple):
        return type(a) is type(b) and all(_same_bundle(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("options", [dict(use_causal_mask=True, sliding_window=40),
                                     dict(dropout_p=0.5, seed=3, seed_offset=9)])
def test_a_shared_plan_is_the_plan_of_the_call(backward, options):
    """Repeated calls share their plan (built once per shape and options); what they get is
    exactly the fresh plan of their own problem, dropout seed and offset included."""
    from numbafa.kernels.bundles import make_plan, shared_plan
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs

    q = np.ones((2, 2, 8, 300), np.float32)
    for offset in (9, 10):
        prob = validate_fwd_inputs(q, q, q, AttentionOptions(**dict(options, seed_offset=offset)
                                                             if "seed" in options else options))
        first, again = shared_plan(prob, backward), shared_plan(prob, backward)
        assert _same_bundle(first, make_plan(prob, backward)) and _same_bundle(again, first)


def test_packing_plans_are_never_shared():
    from numbafa.kernels.bundles import shared_plan
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs

    q = np.ones((1, 1, 8, 128), np.float32)
    lo, hi = np.zeros(128, np.float32), np.full(128, 64, np.float32)
    p1 = shared_plan(validate_fwd_inputs(q, q, q, AttentionOptions(bound_min=lo, bound_max=hi)), False)
    p2 = shared_plan(validate_fwd_inputs(q, q, q, AttentionOptions(bound_min=lo, bound_max=hi * 2)), False)
    assert p1.mask.key_hi.max() == 64 and p2.mask.key_hi.max() == 128


def test_repeated_calls_launch_the_remembered_overload_with_the_same_bits():
    """From the second call of a dtype on, the entries are called through the compiled overload
    the first call ran (no dispatcher typing): same results, bit for bit."""
    from numbafa.kernels import entry, launch

    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 3, 16, 200)).astype(np.float32)
    o, lse = numbafa.attention_fwd(q, q, q, lse_layout="natural")
    grads = numbafa.attention_bwd(q, q, q, o, q, lse)
    for compiled in (entry.forward_entry, entry.backward_entry):
        assert any(key[0] is compiled and key[1] == ("core", "f") for key in launch._entries)
    o2, lse2 = numbafa.attention_fwd(q, q, q, lse_layout="natural")
    grads2 = numbafa.attention_bwd(q, q, q, o, q, lse)
    for a, b in zip((o, lse) + grads, (o2, lse2) + grads2):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("units", [1, 2], ids=["one-item-on-the-calling-thread", "prange"])
def test_a_failing_work_item_raises_its_own_exception(units):
    """A work item that fails (here: a K operand whose length-1 axis has a 64-byte stride, which
    validation would have copied; K goes to the GEMM as it is) reports it, is run again alone, and its exception reaches the
    caller, whether the launcher ran it on the calling thread (one item) or in its prange."""
    from numbafa.platform.blas import single_threaded_blas
    from numbafa.compiler.jit import callable_from_python
    from numbafa.kernels import launch
    from numbafa.kernels.bundles import FwdInputs, FwdOutputs, make_plan
    from numbafa.kernels.stored import stored_fwd
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs

    good = np.ones((units, 1, 16, 1), np.float32)
    prob = validate_fwd_inputs(good, good, good, AttentionOptions())
    bad = np.ones((units, 1, 1, 16), np.float32).transpose(0, 1, 3, 2)   # strides (.., 4, 4) -> (.., 4, 64)
    assert bad.flags.c_contiguous and bad.strides[-1] != bad.itemsize
    ins = FwdInputs(prob.q, bad, prob.v, prob.sinks)
    outs = FwdOutputs(np.empty(good.shape, np.float32), np.empty((units, 1, 1), np.float32))
    plan = make_plan(prob, backward=False)
    ins = stored_fwd(ins, plan.acc)
    launch.prepare_forward(ins, outs, plan)
    with single_threaded_blas(), pytest.raises(ValueError, match="matmul: operands need a unit inner stride"):
        callable_from_python(launch.forward_items)(ins, outs, plan, np.arange(units, dtype=np.int64))
