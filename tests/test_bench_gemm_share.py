"""bench/gemm_share.py's attribution of perf samples: the split docs/performance.md quotes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
_PATH = _BENCH / "gemm_share.py"
if str(_BENCH) not in sys.path:  # its sibling bench/_child.py, as when run as a script
    sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("gemm_share", _PATH)
gemm_share = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemm_share)

# Rows as `perf report --no-children --sort dso,sym --stdio` prints them (names seen on Zen 4).
REPORT = """\
# Overhead  Shared Object      Symbol
# ........  .................  ......
#
    31.89%  [JIT] tid 2491     [.] jit_avx512_core_gemm_bf16bf16f32_kern
    20.00%  [JIT] tid 2491     [.] jit_avx2_kernel_sgemm_kern
    10.00%  [JIT] tid 2491     [.] jit_avx512_common_gemm_f32_xbyak_gemm
     3.46%  [JIT] tid 2491     [.] jit_avx512_core_s16_48x8_copy_bt_kern
     1.50%  [JIT] tid 2491     [.] jit_avx512_core_f32_copy_an_kern
     5.00%  libscipy_openblas-6cdc3b4a.so  [.] sgemm_kernel_SKYLAKEX
     4.00%  libscipy_openblas-6cdc3b4a.so  [.] sgemm_oncopy_SKYLAKEX
     1.00%  libscipy_openblas-6cdc3b4a.so  [.] blas_thread_server
     0.50%  libdnnl.so         [.] dnnl_gemm_bf16bf16f32
    12.00%  [JIT] tid 2491     [.] 0x00007f49565a5c2d
     0.65%  [kernel.kallsyms]  [k] clear_page_erms
    10.00%  libpython3.11.so.1.0  [.] gc_collect_main
"""


def test_perf_rows_are_split_into_kernels_packing_and_the_rest():
    shares = gemm_share.parse_report(REPORT)
    assert shares["kernel"] == pytest.approx(31.89 + 20.0 + 10.0 + 5.0)
    assert shares["packing"] == pytest.approx(3.46 + 1.50 + 4.00)
    assert shares["other GEMM library"] == pytest.approx(1.0 + 0.5)
    # Numba's unnamed JIT code, the kernel, Python: ours, not the GEMM library's.
    assert shares["other"] == pytest.approx(12.0 + 0.65 + 10.0)


def test_backward_flops_follow_the_flash_attention_convention():
    full = gemm_share.backward_flops(8, 2048, 128, causal=False)
    assert full == 2.5 * 4 * 8 * 2048 ** 2 * 128
    assert gemm_share.backward_flops(8, 2048, 128, causal=True) == full / 2
