"""bench/compare.py's timer: a slow first call (threads waking after the pause) does not set the
length of the run of calls that is averaged. The calls run on a simulated clock, so the machine's
load (a busy test run) cannot move the figures."""

from __future__ import annotations

import pathlib
import sys
import types

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import compare  # noqa: E402


@pytest.fixture
def clock(monkeypatch):
    """A clock that only the timed calls advance: ``advance(seconds)``."""
    now = [0.0]
    monkeypatch.setattr(compare, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def advance(seconds):
        now[0] += seconds
    return advance


def test_the_run_length_comes_from_the_second_call(clock):
    calls = []

    def fn():
        calls.append(None)
        clock(0.01 if len(calls) == 1 else 0.0005)   # a slow first call, then fast ones

    per_call = compare._timed(fn)
    # a run sized by the first call would be two calls (0.02 / 0.01); by the second, 0.02 / 0.0005
    assert 2 + 39 <= len(calls) <= 2 + 40
    assert per_call == pytest.approx(0.0005)


def test_a_long_call_is_timed_once(clock):
    calls = []

    def fn():
        calls.append(None)
        clock(0.025)

    assert compare._timed(fn) == 0.025 and len(calls) == 1
