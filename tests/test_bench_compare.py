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


def test_flops_count_the_pairs_the_mask_leaves_visible():
    """flash-attention's convention (causal: half of S x S), and a causal window's exact pairs
    counted against a brute-force count of the visible (query, key) pairs."""
    import numpy as np
    from shapes import flops, visible_fraction

    full = flops("forward", 1, 8, 2048, 128, {})
    assert full == 4.0 * 8 * 2048 * 2048 * 128
    assert flops("backward", 1, 8, 2048, 128, {}) == 2.5 * full
    assert flops("forward", 1, 8, 2048, 128, dict(use_causal_mask=True)) == full / 2
    for seqlen, window in ((2048, 512), (300, 7), (128, 1)):
        i, j = np.indices((seqlen, seqlen))
        pairs = np.count_nonzero((j <= i) & (j > i - window))
        assert visible_fraction(seqlen, dict(use_causal_mask=True, sliding_window=window)) == pairs / seqlen ** 2
    for window in (None, -1, 0, 2048, 4096):   # no window, or one that hides nothing: the causal half
        assert visible_fraction(2048, dict(use_causal_mask=True, sliding_window=window)) == 0.5


def test_a_step_counts_a_forward_and_a_backward():
    from shapes import flops

    for options in ({}, {"use_causal_mask": True}, {"head_dim_v": 64}):
        assert flops("step", 2, 4, 256, 32, options) == (flops("forward", 2, 4, 256, 32, options)
                                                         + flops("backward", 2, 4, 256, 32, options))


@pytest.mark.parametrize("impl", ["numbafa", "numbafa-torch", "torch"])
def test_every_side_times_every_pass(impl):
    """The workers' implementations (numbafa's NumPy API, numbafa through numbafa.torch for
    ``--via torch``, SDPA) each time a forward, a backward and a training step, on real calls."""
    import numpy as np
    from shapes import make_inputs

    if impl != "numbafa":
        pytest.importorskip("torch")
    side = compare.IMPLS[impl](*make_inputs(1, 2, 1, 128, 32, np.float32, {"use_causal_mask": True}))
    for pass_ in ("forward", "backward", "step"):
        assert 0 < getattr(side, pass_)() < 10, pass_


def test_the_footer_names_the_cpu_and_the_peaks_the_table_divides_by():
    cpu = "AMD EPYC (AuthenticAMD, family 25, model 1)"
    assert compare.footer(cpu, {"float32": 203.4, "bf16": None, "bf16_unit": "vdpbf16ps"}) == (
        f"CPU: {cpu}; peak measured in this run: float32 FMA 203 GFLOP/s, bf16 no bf16 unit")
    assert compare.footer(cpu, {"float32": 422.0, "bf16": 6100.0, "bf16_unit": "amx"}).endswith(
        "float32 FMA 422 GFLOP/s, bf16 6100 GFLOP/s (amx)")
    assert compare.footer(cpu, None) == f"CPU: {cpu}; no row measured"
