"""How a whole test run is set up: the kernel cache warmed once, then the tests on xdist workers.

A whole-suite run (``python -m pytest``, or ``python -m pytest tests``):

* first fills the kernel cache the tests will use -- the one ``numbafa.backend_info()["cache"]``
  names, shared with every subprocess test that does not choose its own -- with the kernels most
  tests need: each pass for float32, bf16 and float64 inputs, float32 and bf16 with dropout,
  float32 with the score variants (:func:`numbafa.pipeline.shards.warm`), compiled by one
  process per group of :data:`WARM_GROUPS`, side by side. The tests then load them instead of
  compiling them again in each worker. ``NUMBAFA_TEST_WARM=0`` skips it, ``=1`` warms for any
  selection of tests; with the cache off (``NUMBAFA_CACHE=0``) there is nothing to warm. The
  warm-up only compiles (a warm-up that failed only costs the tests their own compiles, with a
  warning); deliberately cold tests use caches of their own (``tests/test_cli.py``,
  ``tests/test_cache.py``) or none (``tests/test_float16.py``'s CPU without F16C);
* runs on ``min(4, cores)`` pytest-xdist workers with ``--dist loadfile`` (each module on one
  worker, so a costly module fixture -- a Dask cluster, the docs site, a benchmark run -- is
  made once), their OpenMP threads sleeping when idle (``OMP_WAIT_POLICY=PASSIVE`` unless set),
  unless ``-n``/``--dist`` say otherwise (``-n 0``: one process).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import warnings

import pytest

#: ``(pass, dtype name, dropout, score variants)`` per warm-up process, two processes of about
#: the same length: float32 and bf16 share their kernels (bf16 adds its plugins), float64's are its
#: own (docs/performance.md, "Compile time"); the dropout kernels, compiled after float64's in the
#: second process, load the helpers they share with float32's from the cache the first one has
#: filled by then (on Zen 4, empty cache: 35.3-40.7 s, three runs, against 36.9-45.7 s, four runs,
#: with dropout in the first).
WARM_GROUPS = (
    (("forward", "float32", False, False), ("backward", "float32", False, False),
     ("forward", "float32", False, True), ("backward", "float32", False, True),
     ("forward", "bfloat16", False, False), ("backward", "bfloat16", False, False)),
    (("forward", "float64", False, False), ("backward", "float64", False, False),
     ("forward", "float32", True, False), ("backward", "float32", True, False),
     ("forward", "bfloat16", True, False), ("backward", "bfloat16", True, False)),
)

_WARM = """
import json, sys
from numbafa.pipeline.shards import warm
for kernel, dtype, dropout, variants in json.loads(sys.argv[1]):
    warm(kernel, dtype, dropout, variants)
"""

TESTS = pathlib.Path(__file__).resolve().parent


def _whole_suite(config) -> bool:
    """The run's arguments name this directory alone (no arguments: ``testpaths``)."""
    args = [pathlib.Path(a.split("::")[0]) for a in config.args]
    root = pathlib.Path(config.rootpath)
    return bool(args) and all((root / a).resolve() == TESTS for a in args)


def _warm_wanted(config) -> bool:
    """Warm for a whole-suite run or when ``NUMBAFA_TEST_WARM=1``; never on an xdist worker."""
    if hasattr(config, "workerinput"):
        return False
    flag = os.environ.get("NUMBAFA_TEST_WARM", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    if flag:
        raise pytest.UsageError(f"NUMBAFA_TEST_WARM must be 0 or 1, got {flag!r}")
    return _whole_suite(config)


#: The most xdist workers a whole-suite run starts by itself (each kernel call runs on every core).
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A whole-suite run without ``-n`` gets ``-n min(4, cores) --dist loadfile`` (with xdist installed)."""
    if hasattr(config, "workerinput") or not (_whole_suite(config) and config.pluginmanager.hasplugin("xdist")):
        return
    if getattr(config.option, "numprocesses", None) is None and getattr(config.option, "tx", None) in (None, []):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(MAX_WORKERS, cores)
        if workers > 1:
            config.option.numprocesses = workers
            if config.option.dist == "no":
                config.option.dist = "loadfile"
            # The workers share the cores: OpenMP threads that spin after a parallel region take
            # them from the other workers (the whole run 259 -> 234 s on 2 cores, warm cache).
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_sessionstart(session):
    config = session.config
    if not _warm_wanted(config):
        return
    import numbafa

    cache = numbafa.backend_info()["cache"]
    if not cache["enabled"]:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", _WARM, json.dumps(group)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for group in WARM_GROUPS]
    failed = []
    for group, proc in zip(WARM_GROUPS, procs):
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            failed.append(f"{group}: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    if failed:
        warnings.warn("numbafa: warming the kernel cache failed; the tests compile what they need: "
                      + "; ".join(failed))
    if reporter is not None:
        reporter.write_line(f"numbafa: kernel cache {cache['dir']} warmed by {len(procs)} processes "
                            f"in {time.perf_counter() - start:.1f} s")


@pytest.fixture
def no_remembered_calls(monkeypatch):
    """An empty memo of remembered calls for the test: a call this process made before (another
    test's, the same shapes and options) would otherwise be found where the test expects the
    full path (the memo clears itself only when full, so it depends on the tests run before)."""
    from numbafa.compiler.memo import Memo
    from numbafa.pipeline import core
    monkeypatch.setattr(core, "_RECIPES", Memo())
