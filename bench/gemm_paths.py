"""Per-thread GEMM throughput of each GEMM path on the backward's tile shapes.

    python bench/gemm_paths.py [--repeats 15] [--d-head 128 64] [--rows 512] [--keys 512]
    python bench/gemm_paths.py --passes B H S D [--full] [--repeats 15]

The GEMM path (``NUMBAFA_GEMM``, :mod:`numbafa.platform.onednn`) is chosen by CPU
class; this script measures what the choice rests on, on the CPU at hand:
the five GEMMs of one (Q group of 512 rows, K tile of 512 keys) backward step
(``--rows``/``--keys``: smaller blocks, as short sequences and diagonal tiles
call them) in the orientations the kernel calls them (``[keys, queries]`` score tiles,
K and dO in the Neuron ``[d, seq]`` layout; and dQ's former orientation, for
comparison), one thread, through the kernels' own matmul seam:

* ``blas``: float32 tiles, BLAS sgemm (SciPy's OpenBLAS);
* ``onednn-f32``: float32 tiles, oneDNN's ``dnnl_sgemm``;
* ``onednn-bf16``: bf16 tiles, oneDNN's ``dnnl_gemm_bf16bf16f32`` (CPUs
  with bf16 units only: elsewhere oneDNN has no bf16 kernel).

The three variants are interleaved, 8 calls per timing, median of
``--repeats``; GFLOP/s = 2 m n k / time. The last column says which library
the ``mixed`` path (CPUs without bf16 units) gives the GEMM: oneDNN up to
``SMALL_SGEMM`` multiply-adds, BLAS beyond. oneDNN is loaded if installed
(``pip install onednn-cpu-gomp``), whatever path this process would take.

``--passes``: whole passes instead, float32 ``[B, H, D, S]`` (causal unless
``--full``), on every path that runs here (``blas``, and where oneDNN loads
``mixed`` and ``onednn``): ``numbafa.nb`` plans made on each path
(:func:`numbafa.forced_gemm_path`) in one process, their forward and backward
loops from ``@njit`` code alternated path by path, ``--repeats`` rounds; the
median per call, and the median over rounds of each path's time over BLAS's.
"""

from __future__ import annotations

import argparse
import time

import llvmlite.binding
import numba
import numpy as np
from numba import njit

import numbafa
from numbafa.platform import onednn
from numbafa.platform.blas import single_threaded_blas
from numbafa.platform.cpu import cpu_flags
from numbafa.conventions.dtypes import to_bf16_array
from numbafa.kernels.bundles import Gemm
from numbafa.kernels.matmul import Operand, gemm

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


def gemms(d_head, rng, rows=512, keys=512):
    """The backward's five GEMMs: name -> (a, b, trans_a, trans_b, m, n, k), float32 operands."""
    k = rng.standard_normal((d_head, keys), dtype=np.float32)     # K (and V), [d, keys]
    q = rng.standard_normal((d_head, rows), dtype=np.float32)     # Q_s (and dO), [d, rows]
    ds = rng.standard_normal((keys, rows), dtype=np.float32)      # P^T, dS^T, [keys, rows]
    return {
        "S^T = K^T Q_s (dP^T alike)": (k, q, True, False, keys, rows, d_head),
        "dQ = K dS^T": (k, ds, False, False, d_head, rows, keys),
        "dQ^T = dS K^T (not used: the orientation before 2026-12)": (ds, k, True, True, rows, d_head, keys),
        "dK^T += dS^T Q_s^T (dV^T alike)": (ds, q, False, True, keys, d_head, rows),
    }


def passes(shape, causal, repeats):
    """``--passes`` (module docstring): ``{(path, pass): [seconds per call, per round]}``."""
    from numbafa import nb
    from overhead import _nb_bwd_loop, _nb_fwd_loop, _timed_loop

    b, h, s, d = shape
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((b, h, d, s), dtype=np.float32) for _ in range(4))
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=causal)
    paths = ["blas"] + (["mixed", "onednn"] if onednn.load_library() else [])
    plans = {}
    for path in paths:
        with numbafa.forced_gemm_path(path):
            plans[path] = nb.plan(q, k, v, use_causal_mask=causal)
    outs = (np.empty_like(o), np.empty_like(lse)), tuple(np.empty_like(x) for x in (q, k, v))
    times = {(path, name): [] for path in paths for name in ("forward", "backward")}
    for r in range(repeats):
        for path in (paths if r % 2 == 0 else paths[::-1]):
            times[path, "forward"].append(_timed_loop(_nb_fwd_loop, plans[path], q, k, v, *outs[0]))
            times[path, "backward"].append(_timed_loop(_nb_bwd_loop, plans[path], q, k, v, o, dy, lse, *outs[1]))
    return times


def _print_passes(times):
    paths = list(dict.fromkeys(path for path, _ in times))
    print("| pass | " + " | ".join(f"{p} us" for p in paths) + " | " + " | ".join(f"{p} / blas" for p in paths[1:])
          + " |")
    print("|---|" + "---|" * (2 * len(paths) - 1))
    for name in ("forward", "backward"):
        base = np.array(times["blas", name])
        cells = [f"{np.median(times[p, name]) * 1e6:.1f}" for p in paths]
        cells += [f"{np.median(np.array(times[p, name]) / base):.3f}" for p in paths[1:]]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--d-head", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--rows", type=int, default=512, help="query rows of the block (default 512)")
    parser.add_argument("--keys", type=int, default=512, help="keys of the block (default 512)")
    parser.add_argument("--passes", type=int, nargs=4, metavar=("B", "H", "S", "D"),
                        help="time whole passes of this shape on each path instead")
    parser.add_argument("--full", action="store_true", help="--passes without the causal mask")
    args = parser.parse_args(argv)
    if args.passes:
        print(f"{numbafa.backend_info()['cpu_model']}; B H S D {args.passes}, float32, "
              f"{'full' if args.full else 'causal'}, {numba.get_num_threads()} threads; medians of {args.repeats} "
              f"alternated rounds")
        _print_passes(passes(args.passes, not args.full, args.repeats))
        return

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
    print("| d_head | GEMM (m x n x k) | " + " | ".join(variants) + " | mixed path |")
    print("|---|---|" + "---|" * len(variants) + "---|")
    for d_head in args.d_head:
        for name, (a, b, trans_a, trans_b, m, n, k) in gemms(d_head, rng, args.rows, args.keys).items():
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
            mixed = "oneDNN" if m * n * k <= onednn.SMALL_SGEMM else "BLAS"
            print(f"| {d_head} | {name} ({m} x {n} x {k}) | " + " | ".join(f"{r:.0f}" for r in rates)
                  + f" | {mixed} |")


if __name__ == "__main__":
    main()
