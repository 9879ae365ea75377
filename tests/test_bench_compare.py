"""bench/compare.py's timer: a slow first call (threads waking after the pause) does not set the
length of the run of calls that is averaged."""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import compare  # noqa: E402


def test_the_run_length_comes_from_the_second_call():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.01 if len(calls) == 1 else 0.0005)   # a slow first call, then fast ones

    per_call = compare._timed(fn)
    # a run sized by the first call would be two calls (0.02 / 0.01); by the second, ~40
    assert len(calls) > 10
    assert per_call < 0.005


def test_a_long_call_is_timed_once():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.025)

    assert compare._timed(fn) >= 0.025 and len(calls) == 1
