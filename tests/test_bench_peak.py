"""bench/peak.py: the loops it times compute what they claim (the FLOPs counted are done)."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib

import numpy as np
import pytest

from numbafa.platform.cpu import cpu_flags

_spec = importlib.util.spec_from_file_location(
    "peak", pathlib.Path(__file__).resolve().parents[1] / "bench" / "peak.py")
peak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peak)


def _run(kind, n):
    loop, lanes = peak._compiled(kind)
    out = ctypes.c_float(0.0)
    loop(n, ctypes.byref(out))
    return out.value, lanes


@pytest.mark.parametrize("n", [1, 3])
def test_the_fma_loop_does_its_multiply_adds(n):
    """Accumulator ``a`` starts at ``a`` and gains ``x * y`` each round: lane 0 of their sum."""
    got, lanes = _run("fma", n)
    assert lanes in (8, 16)
    x, y = np.float32(1.0000001), np.float32(0.9999999)
    accs = np.arange(peak.ACCUMULATORS, dtype=np.float32)
    for _ in range(n):
        accs = (x.astype(np.float64) * y + accs).astype(np.float32)   # one rounding: a fused multiply-add
    assert got == pytest.approx(float(accs.sum()), rel=1e-6)


def test_the_bf16_loop_runs_where_the_cpu_has_vdpbf16ps():
    """Built where LLVM's host features (what bench/peak.py compiles for) have AVX512_BF16; the
    Linux flags (numbafa's CPU probe) say the same on a real CPU."""
    has_bf16 = bool(peak._engine()[1].get("avx512bf16"))
    if has_bf16 != ("avx512_bf16" in (cpu_flags() or set())):
        pytest.skip("numbafa's CPU flags are patched (an emulated CPU): LLVM's host features decide here")
    if not has_bf16:
        assert peak._compiled("bf16") == (None, 0) and peak.peak_gflops("bf16") is None
        pytest.skip("no AVX512_BF16 here: the loop is not built (checked)")
    got, _ = _run("bf16", 2)
    # each round adds the two products of the lanes' bf16 pairs (1.0 * 0.99609375 each) to every lane
    product = 1.0 * 0.99609375
    assert got == pytest.approx(sum(a + 2 * 2 * product for a in range(peak.ACCUMULATORS)), rel=1e-5)


def test_peak_is_positive_and_counts_every_thread():
    one = peak.peak_gflops("fma", threads=1, seconds=0.02, runs=1)
    assert one > 1.0


def test_the_amx_loop_runs_where_the_cpu_has_amx():
    """Built where LLVM's host features have AMX-BF16 and Linux grants AMX's tile data; each round
    adds, to element [0, 0] of each accumulator tile, a row of 32 bf16 1.0 times a column of 32
    bf16 0.99609375."""
    features = peak._engine()[1]
    has_amx = bool(features.get("amx-bf16") and features.get("amx-tile"))
    if has_amx != ("amx_bf16" in (cpu_flags() or set())):
        pytest.skip("numbafa's CPU flags are patched (an emulated CPU): LLVM's host features decide here")
    if not has_amx:
        assert peak._compiled("amx") == (None, 0) and peak.peak_gflops("amx") is None
        pytest.skip("no AMX-BF16 here: the loop is not built (checked)")
    for n in (1, 3):
        got, _ = _run("amx", n)
        assert got == pytest.approx(peak.AMX_ACCUMULATORS * n * 32 * 0.99609375, rel=1e-6)
    assert peak.flops_per_round("amx", 16) == peak.AMX_ACCUMULATORS * 16 * 16 * 32 * 2
