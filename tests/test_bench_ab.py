"""bench/ab.py: another revision's kernels imported as a second package, alternated in one process."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import ab  # noqa: E402


def _git(*args):
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    except FileNotFoundError:
        return None


def test_only_a_revision_with_its_own_kernel_table_is_taken(tmp_path):
    own = tmp_path / "own" / "compiler"
    own.mkdir(parents=True)
    (own / "linking.py").write_text('"""doc"""\nPACKAGE = __name__.partition(".")[0]\n')
    shared = tmp_path / "shared" / "compiler"
    shared.mkdir(parents=True)
    (shared / "linking.py").write_text('TABLE_SYMBOL = "numbafa.kernels$table"\n')
    assert ab.has_own_table(tmp_path / "own")
    assert not ab.has_own_table(tmp_path / "shared")
    assert not ab.has_own_table(tmp_path / "missing")
    assert ab.has_own_table(REPO / "numbafa")


def test_a_revision_from_before_its_own_table_has_its_two_symbols_renamed(tmp_path):
    old = tmp_path / "numbafa_abc" / "compiler"
    old.mkdir(parents=True)
    (old / "linking.py").write_text('CELL_PREFIX = "numbafa.apart$"\nx = "numbafa.other"\n'
                                    'TABLE_SYMBOL = "numbafa.kernels$table"\n')
    assert ab.own_symbols(tmp_path / "numbafa_abc")
    assert (old / "linking.py").read_text() == ('CELL_PREFIX = "numbafa_abc.apart$"\nx = "numbafa.other"\n'
                                                'TABLE_SYMBOL = "numbafa_abc.kernels$table"\n')
    older = tmp_path / "numbafa_def" / "compiler"
    older.mkdir(parents=True)
    (older / "linking.py").write_text('CELL_PREFIX = "numbafa.apart$"\n')   # no kernel table yet
    assert not ab.own_symbols(tmp_path / "numbafa_def")
    assert not ab.own_symbols(tmp_path / "missing")


def test_an_unknown_revision_says_so(tmp_path):
    if _git("rev-parse", "HEAD") is None or _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    with pytest.raises(SystemExit, match="is not a revision"):
        ab.extract("no-such-revision-0123", tmp_path)


def test_a_revision_is_unpacked_under_a_name_of_its_own(tmp_path):
    head = _git("rev-parse", "--short=10", "HEAD")
    if head is None or head.returncode != 0:
        pytest.skip("not a git checkout")
    name = ab.extract("HEAD", tmp_path)
    assert name == "numbafa_" + head.stdout.strip()
    assert ab.has_own_table(tmp_path / name) and (tmp_path / name / "nb.py").is_file()
    assert not (tmp_path / "numbafa").exists()


def _trees(scale_old=1.0):
    import numbafa
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((1, 1, 16, 128), dtype=np.float32) for _ in range(4))
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True)
    new = ab.Tree(numbafa, q, k, v, o, dy, lse, True)
    old = ab.Tree(numbafa, q * np.float32(scale_old), k, v, o, dy, lse, True)
    return new, old


def test_two_trees_are_timed_in_alternated_rounds_and_their_bits_compared():
    """(Both "trees" the package at hand: a revision's copy would compile every kernel again.)"""
    new, old = _trees()
    r = ab.measure(new, old, "forward", rounds=3, seconds=0.002)
    assert r["identical"] and r["calls"] >= 1 and r["new"] > 0 and r["old"] > 0
    assert r["low"] <= r["ratio"] <= r["high"]
    new, old = _trees(scale_old=2.0)     # other inputs: other bits, and the comparison says so
    assert not ab.measure(new, old, "forward", rounds=1, seconds=0.002)["identical"]


def test_the_report_names_both_trees_and_each_pass(monkeypatch, capsys):
    monkeypatch.setattr(ab, "extract", lambda rev, into: "numbafa")   # the package at hand as "old"
    rows = ab.main(["HEAD", "--shape", "1", "1", "128", "16", "--passes", "forward", "--rounds", "2",
                    "--seconds", "0.002"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("B1 H1 S128 D16 causal float32: new = ") and "old = HEAD (numbafa)" in out[0]
    assert [r["pass_"] for r in rows] == ["forward"] and rows[0]["identical"]
    assert out[1].split()[0] == "forward" and "new/old" in out[1] and out[1].endswith("bit-identical: yes")


def test_kv_heads_make_a_gqa_problem_and_must_divide_the_heads(monkeypatch, capsys):
    monkeypatch.setattr(ab, "extract", lambda rev, into: "numbafa")
    rows = ab.main(["HEAD", "--shape", "1", "4", "128", "16", "--kv-heads", "2", "--passes", "forward", "--rounds", "1",
                    "--seconds", "0.002"])
    assert capsys.readouterr().out.startswith("B1 H4/2 S128 D16 causal float32") and rows[0]["identical"]
    with pytest.raises(SystemExit):
        ab.main(["HEAD", "--shape", "1", "4", "128", "16", "--kv-heads", "3"])
    assert "--kv-heads must divide H = 4, got 3" in capsys.readouterr().err
