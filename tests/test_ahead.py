"""numbafa.compile_ahead: passes compiled in a second process, handed over through the disk cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import numbafa
from numbafa.pipeline import ahead

from _caches import cache_without


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(dtype="int8"), ValueError, "dtype must be one of float32, bfloat16 (bf16), float16, float64"),
    (dict(dtype=np.int32), ValueError, "got <class 'numpy.int32'>"),
    (dict(dtype=object()), ValueError, "dtype must be"),
    (dict(passes="backward"), ValueError, "passes must be a tuple of distinct 'forward', 'backward', got 'backward'"),
    (dict(passes=()), ValueError, "passes must be"),
    (dict(passes=None), ValueError, "passes must be a tuple of distinct 'forward', 'backward', got None"),
    (dict(dtype=None), ValueError, "(a name or a NumPy dtype), got None"),   # (np.dtype(None) is float64)
    (dict(passes=("backward", "backward")), ValueError, "passes must be"),
    (dict(passes=("sideways",)), ValueError, "got ('sideways',)"),
    (dict(dropout=1), TypeError, "dropout must be True or False, got 1"),
    (dict(score_variants="yes"), TypeError, "score_variants must be True or False, got 'yes'"),
])
def test_bad_arguments_are_named(monkeypatch, kwargs, error, words):
    monkeypatch.setattr(ahead.subprocess, "Popen", None)   # nothing may start
    with pytest.raises(error) as raised:
        numbafa.compile_ahead(**kwargs)
    assert words in str(raised.value)


@pytest.mark.parametrize("cache", [dict(enabled=False, reason="NUMBAFA_CACHE=0", save_error=None),
                                   dict(enabled=True, reason="default", save_error="disk full")])
def test_without_a_writable_cache_it_is_refused(monkeypatch, cache):
    monkeypatch.setattr(ahead, "cache_info", lambda: dict(cache, dir="/c"))
    monkeypatch.setattr(ahead.subprocess, "Popen", None)
    with pytest.raises(RuntimeError, match="the on-disk kernel cache is off or not writable"):
        numbafa.compile_ahead()


@pytest.fixture
def cache_on(monkeypatch):
    """The on-disk cache as on (whatever ``NUMBAFA_CACHE`` says in this run): the processes below
    are fakes or scripts of the tests' own, which hand nothing over."""
    monkeypatch.setattr(ahead, "cache_info", lambda: dict(enabled=True, dir="/c", reason="default", save_error=None))


class _Fake:
    started: list = []
    pid, returncode = 7, 0

    def __init__(self, argv, **kwargs):
        _Fake.started.append((argv, kwargs))

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize("dtype,name", [("float32", "float32"), ("bf16", "bfloat16"), (ml_dtypes.bfloat16, "bfloat16"),
                                        (np.dtype("float16"), "float16"), (np.float64, "float64")])
def test_one_process_per_pass_with_its_spec(monkeypatch, cache_on, dtype, name):
    monkeypatch.setattr(ahead.subprocess, "Popen", _Fake)
    monkeypatch.setattr(_Fake, "started", [])
    handle = numbafa.compile_ahead(dtype, passes=("backward", "forward"), dropout=True)
    specs = [json.loads(argv[3]) for argv, _ in _Fake.started]
    assert specs == handle.specs == [["forward", name, True, False], ["backward", name, True, False]]
    assert all(argv[1:3] == ["-c", ahead.SCRIPT] for argv, _ in _Fake.started)
    assert all(kwargs["stderr"] is None for _, kwargs in _Fake.started)   # its announcements reach the user
    assert handle.pids == [7, 7] and handle.done() and handle.wait()


def test_a_failed_process_waits_false(monkeypatch, cache_on):
    monkeypatch.setattr(ahead, "SCRIPT", "import sys; sys.exit(3)")
    assert numbafa.compile_ahead().wait(timeout=60) is False


def test_a_process_still_running_times_out_and_can_be_cancelled(monkeypatch, cache_on):
    monkeypatch.setattr(ahead, "SCRIPT", "import time; time.sleep(60)")
    handle = numbafa.compile_ahead()
    with pytest.raises(TimeoutError, match="still compiles after 0.2 s"):
        handle.wait(timeout=0.2)
    assert not handle.done()
    handle.cancel()
    assert handle.done()


def test_the_timeout_is_for_all_the_processes(monkeypatch):
    """A process that ends after 0.4 s of a 0.5 s timeout leaves the next one 0.1 s."""
    clock, given = [100.0], []

    class Ends:
        pid, returncode = 1, 0

        def wait(self, timeout=None):
            clock[0] += 0.4

    class Runs:
        pid, returncode = 2, None

        def wait(self, timeout=None):
            given.append(timeout)
            raise subprocess.TimeoutExpired("python", timeout)

    monkeypatch.setattr(ahead.time, "monotonic", lambda: clock[0])
    with pytest.raises(TimeoutError, match="the second process 2 still compiles after 0.5 s"):
        ahead.CompileAhead([Ends(), Runs()], []).wait(timeout=0.5)
    assert given == [pytest.approx(0.1)]


def test_as_a_context_it_waits_or_cancels(monkeypatch, cache_on):
    monkeypatch.setattr(ahead, "SCRIPT", "import time; time.sleep(0.3)")
    with numbafa.compile_ahead() as handle:
        pass
    assert handle.done() and handle.wait()
    monkeypatch.setattr(ahead, "SCRIPT", "import time; time.sleep(60)")
    with pytest.raises(KeyError):
        with numbafa.compile_ahead() as handle:
            raise KeyError("the block failed")
    assert handle.done() and not handle.wait()


_FIRST_CALLS = r"""
import json, sys
import numpy as np
import numbafa
from numba.core import event

ahead = numbafa.compile_ahead("float32") if sys.argv[1] == "ahead" else None
rng = np.random.default_rng(0)
q, k, v, dy = (rng.standard_normal((1, 2, 16, 256)).astype(np.float32) for _ in range(4))
o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True)
if ahead is not None:
    assert ahead.wait(timeout=600)
compiled = []

class Compiled(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev):
        pass

with event.install_listener("numba:compile", Compiled()):
    grads = numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
print(json.dumps(compiled))
"""


@pytest.mark.parametrize("how", ["ahead", "not-ahead"])
def test_the_backward_compiled_ahead_is_loaded_by_its_first_call(tmp_path, how):
    """With the backward's entry missing from the cache (a copy of the run's), the first backward
    compiles it in this process, unless compile_ahead compiled it meanwhile: then it loads it."""
    env = {key: value for key, value in os.environ.items() if key != "NUMBAFA_CACHE"}   # the cache on
    env["NUMBAFA_CACHE_DIR"] = str(cache_without(tmp_path, "kernels.entry.backward_entry"))
    done = subprocess.run([sys.executable, "-c", _FIRST_CALLS, how], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    if how == "ahead":
        assert "backward_entry" not in compiled, compiled
        assert "numbafa: compiling the backward kernel" in done.stderr   # the second process announced it
    else:
        assert "backward_entry" in compiled
