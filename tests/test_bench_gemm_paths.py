"""bench/gemm_paths.py: the per-GEMM table of each path (with the library the mixed path takes) and
``--passes``, whole passes on each path alternated in one process."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np

from numbafa.platform import onednn

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(_BENCH))   # (the script imports bench/overhead.py as its neighbour)
_spec = importlib.util.spec_from_file_location("gemm_paths", _BENCH / "gemm_paths.py")
gemm_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemm_paths)


def test_the_table_names_the_library_the_mixed_path_takes(capsys):
    # every GEMM of a block is rows x keys x d_head multiply-adds: d 64 at the bound, d 128 beyond it
    gemm_paths.main(["--repeats", "1", "--d-head", "128", "64", "--rows", "128", "--keys", "256"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 128 |", "| 64 |"))]
    assert len(rows) == 8
    for row in rows:
        m, n, k = (int(x) for x in row.split("(")[-1].split(")")[0].split(" x "))
        assert row.rstrip(" |").endswith("oneDNN" if m * n * k <= onednn.SMALL_SGEMM else "BLAS"), row
    assert {row.rstrip(" |").rsplit("| ", 1)[-1] for row in rows} == {"oneDNN", "BLAS"}   # both sides of the bound


def test_passes_time_every_path_that_runs_here_alternated(capsys):
    times = gemm_paths.passes((1, 1, 128, 32), causal=True, repeats=2)
    paths = ["blas"] + (["mixed", "onednn"] if onednn.load_library() else [])
    assert set(times) == {(p, name) for p in paths for name in ("forward", "backward")}
    assert all(len(t) == 2 and min(t) > 0 for t in times.values())
    gemm_paths._print_passes(times)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| pass | " + " | ".join(f"{p} us" for p in paths) + " | " + " | ".join(
        f"{p} / blas" for p in paths[1:]) + " |"
    ratio = np.median(np.array(times[paths[-1], "forward"]) / np.array(times["blas", "forward"]))
    assert out[2].startswith("| forward |") and out[2].rstrip(" |").endswith(f"{ratio:.3f}")
