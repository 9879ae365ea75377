"""Per-thread GEMM throughput of each GEMM path on the backward's tile shapes.

    python bench/gemm_paths.py [--repeats 15] [--d-head 128 64]

The GEMM path (``NUMBAFA_GEMM``, :mod:`numbafa.platform.onednn`) is chosen by CPU
class; this script measures what the choice rests on, on the CPU at hand:
the five GEMMs of one (Q group of 512 rows, K tile of 512 keys) backward step
in the orientations the kernel calls them (``[keys, queries]`` score tiles,
K and dO in the Neuron ``[d, seq]`` layout; and dQ's former orientation, for
comparison), one thread, through the kernels' own matmul seam:

* ``blas``: float32 tiles, BLAS sgemm (SciPy's OpenBLAS);
* ``onednn-f32``: float32 tiles, oneDNN's ``dnnl_sgemm``;
* ``onednn-bf16``: bf16 tiles, oneDNN's ``dnnl_gemm_bf16bf16f32`` (CPUs
  with bf16 units only: elsewhere oneDNN has no bf16 kernel).

The three variants are interleaved, 8 calls per timing, median of
``--repeats``; GFLOP/s = 2 m n k / time. oneDNN is loaded if installed
(``pip install onednn-cpu-gomp``), whatever path this process would take.
"""

from __future__ import annotations

import argparse
import time

import llvmlite.binding
import numpy as np
from numba import njit

import numbafa
from numbafa.platform import onednn
from numbafa.platform.blas import single_threaded_blas
from numbafa.platform.cpu import cpu_flags
from numbafa.conventions.dtypes import to_bf16_array
from numbafa.kernels.bundles import Gemm
from numbafa.kernels.matmul import Operand, gemm

ROWS = 512
KEYS = 512
INNER = 8


_NO_VALUES = np.empty((0, 0), np.float32)
_NO_BITS = np.empty((0, 0), np.uint16)


def _operand(x):
    """A float32 array, or bf16 bits (uint16), as the kernels' GEMM operand."""
    return Operand(_NO_VALUES, x) if x.dtype == np.uint16 else Operand(x, _NO_BITS)


@njit
def _timed_gemm(a, b, c, trans_a, trans_b, path, n, beta=1.0):
    """``n`` calls of ``c = op(a) op(b) + beta c`` through the kernels' matmul seam."""
    for _ in range(n):
        gemm(a, b, c, trans_a, trans_b, np.float32(1.0), np.float32(beta), path)


#: Each variant's path through the kernels' matmul seam (numbafa.kernels.bundles.Gemm).
PATHS = {"blas": Gemm(onednn=False, bits=False, onednn_max_mnk=-1),
         "onednn-f32": Gemm(onednn=True, bits=False, onednn_max_mnk=-1),
         "onednn-bf16": Gemm(onednn=True, bits=True, onednn_max_mnk=-1)}


def gemms(d_head, rng):
    """The backward's five GEMMs: name -> (a, b, trans_a, trans_b, m, n, k), float32 operands."""
    k = rng.standard_normal((d_head, KEYS), dtype=np.float32)     # K (and V), [d, keys]
    q = rng.standard_normal((d_head, ROWS), dtype=np.float32)     # Q_s (and dO), [d, rows]
    ds = rng.standard_normal((KEYS, ROWS), dtype=np.float32)      # P^T, dS^T, [keys, rows]
    return {
        "S^T = K^T Q_s (dP^T alike)": (k, q, True, False, KEYS, ROWS, d_head),
        "dQ = K dS^T": (k, ds, False, False, d_head, ROWS, KEYS),
        "dQ^T = dS K^T (not used: the orientation before 2026-12)": (ds, k, True, True, ROWS, d_head, KEYS),
        "dK^T += dS^T Q_s^T (dV^T alike)": (ds, q, False, True, KEYS, d_head, ROWS),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--d-head", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args(argv)

    library = onednn.library_path()
    flags = cpu_flags() or set()
    variants = ["blas"]
    if library is not None:
        llvmlite.binding.load_library_permanently(library)
        variants.append("onednn-f32")
        if flags & {"avx512_bf16", "amx_bf16"}:
            variants.append("onednn-bf16")
    info = numbafa.backend_info()
    print(f"CPU flags: {info['cpu']}; BLAS: {[(b['internal_api'], b['architecture']) for b in info['blas']]}")
    print(f"oneDNN: {library or 'not installed'}; this process's path: {info['gemm']['path']} "
          f"({info['gemm']['reason']}); 1 thread, median of {args.repeats} x {INNER} calls, GFLOP/s")
    rng = np.random.default_rng(0)
    print("| d_head | GEMM (m x n x k) | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for d_head in args.d_head:
        for name, (a, b, trans_a, trans_b, m, n, k) in gemms(d_head, rng).items():
            operands = {}
            for variant in variants:
                if variant == "onednn-bf16":
                    a_v, b_v = to_bf16_array(a).view(np.uint16), to_bf16_array(b).view(np.uint16)
                else:
                    a_v, b_v = a, b
                operands[variant] = (_operand(a_v), _operand(b_v), np.zeros((m, n), np.float32), trans_a, trans_b,
                                     PATHS[variant])
            for variant in variants:   # compile and warm up
                _timed_gemm(*operands[variant], 1)
            times = {variant: [] for variant in variants}
            with single_threaded_blas():
                for _ in range(args.repeats):
                    for variant in variants:
                        start = time.perf_counter()
                        _timed_gemm(*operands[variant], INNER)
                        times[variant].append((time.perf_counter() - start) / INNER)
            rates = [2 * m * n * k / np.median(times[v]) / 1e9 for v in variants]
            print(f"| {d_head} | {name} ({m} x {n} x {k}) | " + " | ".join(f"{r:.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
