"""bench/layouts.py's pairing: the two calls of a pair alternate call by call, order swapped."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import layouts  # noqa: E402


def test_paired_calls_alternate_and_swap_their_order():
    calls = []
    t_n, t_o = layouts.paired(lambda: calls.append("n"), lambda: calls.append("o"), seconds=0.0)
    assert calls[:2] == ["n", "o"]                     # one warm-up call each
    timed = calls[2:]
    assert t_n.size == t_o.size == 10 and len(timed) == 20   # at least ten pairs, even with no time
    pairs = [timed[i:i + 2] for i in range(0, len(timed), 2)]
    assert pairs == [["n", "o"], ["o", "n"]] * 5
    assert (t_n >= 0).all() and (t_o >= 0).all()


def test_a_small_shape_prints_three_paired_ratios(capsys):
    layouts.main(["--shape", "1", "2", "128", "16", "--seconds", "0.01"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("B1 H2 S128 D16 causal float32, bshd / neuron")
    assert [line.split()[0] for line in lines[1:]] == ["fwd", "bwd", "train"]
    assert all("ratio" in line and "pairs)" in line for line in lines[1:])
