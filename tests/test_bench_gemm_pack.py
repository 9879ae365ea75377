"""bench/gemm_pack.py: oneDNN's packed-A GEMM against its plain GEMM on the backward's tiles, the
figures docs/performance.md quotes ("What was tried"), and its bits."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib

import pytest

from numbafa.platform import onednn

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gemm_pack.py"
_spec = importlib.util.spec_from_file_location("gemm_pack", _PATH)
gemm_pack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemm_pack)


def _exported() -> bool:
    path = onednn.library_path()
    return path is not None and all(hasattr(ctypes.CDLL(path), name) for name in gemm_pack.SYMBOLS["float32"])


@pytest.mark.skipif(not _exported(), reason="oneDNN is not installed or does not export its packed-GEMM functions")
def test_packed_a_gives_the_plain_gemms_bits_on_every_tile(capsys):
    gomp = ctypes.CDLL("libgomp.so.1")
    threads = gomp.omp_get_max_threads()
    rows = gemm_pack.main(["--repeats", "1", "--d-head", "64"])
    assert gomp.omp_get_max_threads() == threads      # its one OpenMP thread was only its own
    assert {row["gemm"] for row in rows} == set(gemm_pack.gemms(64))
    for row in rows:
        assert row["identical"], row
        assert row["plain"] > 0 and row["packed"] > 0 and row["pack_us"] > 0
    table = capsys.readouterr().out
    assert table.count("| float32 | 64 |") == 2


def test_without_onednn_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(gemm_pack.onednn, "library_path", lambda: None)
    assert gemm_pack.main(["--repeats", "1"]) == []
    assert "oneDNN is not installed" in capsys.readouterr().out
