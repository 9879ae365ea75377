"""bench/gemm_pack.py: oneDNN's packed-A GEMM against its plain GEMM on the backward's tiles, the
figures docs/performance.md quotes ("What was tried"), and its bits."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib

import numpy as np
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
def test_every_tile_is_measured_and_the_caller_keeps_its_openmp_threads(capsys):
    gomp = ctypes.CDLL("libgomp.so.1")
    threads = gomp.omp_get_max_threads()
    rows = gemm_pack.main(["--repeats", "1", "--d-head", "64"])
    assert gomp.omp_get_max_threads() == threads      # its one OpenMP thread was only its own
    assert {row["gemm"] for row in rows if row["dtype"] == "float32"} == set(gemm_pack.gemms(64))
    for row in rows:
        assert row["plain"] > 0 and row["packed"] > 0 and row["pack_us"] > 0
        assert isinstance(row["identical"], bool)
    table = capsys.readouterr().out
    assert table.count("| float32 | 64 |") == 2


@pytest.mark.skipif(not _exported(), reason="oneDNN is not installed or does not export its packed-GEMM functions")
@pytest.mark.parametrize("shape", [(96, 80, 48, "T", "N"), (48, 80, 96, "N", "T")], ids=["S^T", "dQ"])
def test_the_plain_and_the_packed_calls_compute_the_product(shape):
    """Both calls within float32's rounding of the exact product (|error| <= k u |A||B|), whatever
    kernels oneDNN picks (their bits may differ: the script reports it)."""
    m, n, k, trans_a, trans_b = shape
    rng = np.random.default_rng(3)
    a = np.asfortranarray(rng.standard_normal((k, m) if trans_a == "T" else (m, k)).astype(np.float32))
    b = np.asfortranarray(rng.standard_normal((n, k) if trans_b == "T" else (k, n)).astype(np.float32))
    plain, pack, packed, c_plain, c_packed = gemm_pack.Packed(ctypes.CDLL(onednn.library_path()), "float32").tile(
        a, b, m, n, k, trans_a, trans_b)
    pack()
    plain()
    packed()
    op_a = (a.T if trans_a == "T" else a).astype(np.float64)
    op_b = (b.T if trans_b == "T" else b).astype(np.float64)
    exact, bound = op_a @ op_b, k * 2.0 ** -24 * (np.abs(op_a) @ np.abs(op_b))
    for c in (c_plain, c_packed):
        assert np.all(np.abs(c - exact) <= bound)
    assert not np.array_equal(c_plain, np.zeros_like(c_plain))


def test_without_onednn_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(gemm_pack.onednn, "library_path", lambda: None)
    assert gemm_pack.main(["--repeats", "1"]) == []
    assert "oneDNN is not installed" in capsys.readouterr().out
