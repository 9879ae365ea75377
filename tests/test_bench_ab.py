"""bench/ab.py: another revision's kernels imported as a second package, alternated in one process."""

from __future__ import annotations

import pathlib
import subprocess
import sys

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


def test_the_tree_against_its_own_commit_gives_the_same_bits(capsys):
    head = _git("rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        pytest.skip("not a git checkout")
    if _git("diff", "--quiet", "HEAD", "--", "numbafa").returncode != 0:
        pytest.skip("the package has changes not committed: HEAD's copy is other code")
    rows = ab.main(["HEAD", "--shape", "1", "1", "128", "16", "--passes", "forward", "--rounds", "2",
                    "--seconds", "0.005"])
    out = capsys.readouterr().out
    assert [r["pass_"] for r in rows] == ["forward"]
    assert rows[0]["identical"] and rows[0]["new"] > 0 and rows[0]["old"] > 0 and rows[0]["calls"] >= 1
    assert "bit-identical: yes" in out and "new/old" in out
