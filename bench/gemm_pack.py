"""What packing a K/V operand once would save: oneDNN's packed-A GEMM against its plain GEMM, per tile.

    python bench/gemm_pack.py [--repeats 15] [--d-head 128 64]

The backward multiplies each K/V section by every Q group: three of its five tile GEMMs
(``S^T = K^T Q_s``, ``dP^T = V^T dO``, ``dQ = K dS^T``) have the section's K or V as their A
operand, which oneDNN packs again on every call. oneDNN's library exports its packed-GEMM
functions (``sgemm_pack`` / ``sgemm_compute`` and the bf16 pair, C++ symbols of its
implementation, not of its public API): this script packs A once and times the compute call
against the plain call (``dnnl_sgemm`` / ``dnnl_gemm_bf16bf16f32``, the kernels' GEMMs) on
those tile shapes, one thread, interleaved, ``INNER`` calls per timing, median of
``--repeats``; GFLOP/s = 2 m n k / time, and whether the two results are bit-identical. It
also times the packing itself (paid once per section and operand). Both calls go through
ctypes (about half a microsecond each, under 1 % of a call here).

Needs oneDNN (``pip install onednn-cpu-gomp``); the bf16 rows need oneDNN's bf16 GEMM to run
(bf16 units, oneDNN not held below them). Prints why it measures nothing otherwise. Whether the
packed call gives the plain call's bits depends on the kernels oneDNN picks: on Zen 4 they do;
with oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) the packed ``S^T`` differs.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from numbafa.conventions.dtypes import to_bf16_array
from numbafa.platform import onednn

ROWS = 512    # a Q group
KEYS = 512    # a K tile
INNER = 8

_L = ctypes.c_int64
_P = ctypes.c_void_p
_C = ctypes.c_char_p

#: The packed-GEMM functions of oneDNN's implementation (C++ names): get_size, pack, compute.
SYMBOLS = {
    "float32": ("_ZN4dnnl4impl3cpu19sgemm_pack_get_sizeEPKcS3_S3_PKlS5_S5_S5_S5_PmPb",
                "_ZN4dnnl4impl3cpu10sgemm_packEPKcS3_S3_PKlS5_S5_S5_S5_PKfPf",
                "_ZN4dnnl4impl3cpu13sgemm_computeEPKcS3_PKlS5_S5_PKfS5_S7_S5_S7_PfS5_"),
    "bf16": ("_ZN4dnnl4impl3cpu30gemm_bf16bf16f32_pack_get_sizeEPKcS3_S3_PKlS5_S5_S5_S5_PmPb",
             "_ZN4dnnl4impl3cpu21gemm_bf16bf16f32_packEPKcS3_S3_PKlS5_S5_S5_S5_PKNS0_10bfloat16_tEPS6_",
             "_ZN4dnnl4impl3cpu24gemm_bf16bf16f32_computeEPKcS3_PKlS5_S5_PKNS0_10bfloat16_tES5_S8_S5_PKfPfS5_"),
}
PLAIN = {"float32": "dnnl_sgemm", "bf16": "dnnl_gemm_bf16bf16f32"}


def gemms(d_head):
    """The tile GEMMs whose A operand is the section's K or V: name -> (m, n, k, trans_a, trans_b),
    column-major (BLAS) terms, as the compute API takes them."""
    return {"S^T = K^T Q_s (dP^T alike)": (KEYS, ROWS, d_head, "T", "N"),
            "dQ = K dS^T": (d_head, ROWS, KEYS, "N", "T")}


class Packed:
    """One dtype's plain and packed-A GEMMs of oneDNN's library ``lib``."""

    def __init__(self, lib, dtype):
        self.get_size, self.pack, self.compute = (getattr(lib, name) for name in SYMBOLS[dtype])
        self.plain = getattr(lib, PLAIN[dtype])
        self.plain.argtypes = [ctypes.c_char, ctypes.c_char, _L, _L, _L, ctypes.c_float, _P, _L, _P, _L,
                               ctypes.c_float, _P, _L]

    def tile(self, a, b, m, n, k, trans_a, trans_b):
        """``(plain, pack, packed, c_plain, c_packed)``: calls computing ``op(a) op(b)`` (column-major
        ``a``, ``b``) into ``c_plain`` and, from the packed ``a``, into ``c_packed``, and the call
        packing ``a``; their arguments built once, outside the timed calls."""
        lda, ldb = a.shape[0], b.shape[0]
        letter_a, letter_p, ta, tb = (_C(x) for x in (b"A", b"P", trans_a.encode(), trans_b.encode()))
        refs = [ctypes.byref(_L(x)) for x in (m, n, k, lda, ldb)]
        size, wanted = ctypes.c_size_t(0), ctypes.c_bool(False)
        status = self.get_size(letter_a, ta, tb, *refs, ctypes.byref(size), ctypes.byref(wanted))
        if status != 0:
            raise RuntimeError(f"pack_get_size: status {status}")
        buffer = np.empty(size.value // 4 + 16, np.float32)
        c_plain = np.zeros((m, n), np.float32, order="F")
        c_packed = np.zeros_like(c_plain)
        # (pointers made by data_as hold their arrays: the packed buffer lives as long as the calls)
        a_p, b_p, buffer_p, c_plain_p, c_packed_p = (x.ctypes.data_as(_P) for x in (a, b, buffer, c_plain, c_packed))
        # dnnl_sgemm is row-major: C^T = op(b)^T op(a)^T computes the column-major C
        plain_args = (trans_b.encode(), trans_a.encode(), n, m, k, 1.0, b_p, ldb, a_p, lda, 0.0, c_plain_p, m)
        pack_args = (letter_a, ta, tb, *refs, a_p, buffer_p)
        packed_args = (letter_p, tb, *refs[:3], buffer_p, refs[3], b_p, refs[4], ctypes.byref(ctypes.c_float(0.0)),
                       c_packed_p, ctypes.byref(_L(m)))

        def plain():
            if self.plain(*plain_args) != 0:
                raise RuntimeError("plain GEMM failed")

        def pack():
            if self.pack(*pack_args) != 0:
                raise RuntimeError("pack failed")

        def packed():
            if self.compute(*packed_args) != 0:
                raise RuntimeError("packed GEMM failed")

        return plain, pack, packed, c_plain, c_packed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--d-head", type=int, nargs="+", default=[128, 64])
    args = parser.parse_args(argv)

    path = onednn.library_path()
    if path is None:
        print("oneDNN is not installed (pip install onednn-cpu-gomp): nothing to measure")
        return []
    lib = ctypes.CDLL(path)
    dtypes = ["float32"] + (["bf16"] if onednn._bf16_gemm_runs() else [])
    missing = [name for dtype in dtypes for name in SYMBOLS[dtype] if not hasattr(lib, name)]
    if missing:
        print(f"this oneDNN ({path}) does not export its packed-GEMM functions ({missing[0]}): nothing to measure")
        return []
    gomp = ctypes.CDLL("libgomp.so.1")    # oneDNN's OpenMP: one thread here, the caller's count restored after
    threads = gomp.omp_get_max_threads()
    gomp.omp_set_num_threads(1)
    try:
        return _measure(lib, dtypes, args)
    finally:
        gomp.omp_set_num_threads(threads)


def _measure(lib, dtypes, args):
    """The table's rows (module docstring), printed as they are measured."""
    print(f"oneDNN: {lib._name}; 1 thread, median of {args.repeats} x {INNER} calls, GFLOP/s"
          + ("" if "bf16" in dtypes else "; oneDNN's bf16 GEMM does not run here: float32 only"))
    print("| dtype | d_head | GEMM (m x n x k) | plain | packed A | packing A once (us) | bits |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    rows = []
    for dtype in dtypes:
        packed_gemm = Packed(lib, dtype)
        for d_head in args.d_head:
            for name, (m, n, k, trans_a, trans_b) in gemms(d_head).items():
                a = rng.standard_normal((k, m) if trans_a == "T" else (m, k)).astype(np.float32)
                b = rng.standard_normal((n, k) if trans_b == "T" else (k, n)).astype(np.float32)
                if dtype == "bf16":
                    a, b = to_bf16_array(a).view(np.uint16), to_bf16_array(b).view(np.uint16)
                a, b = np.asfortranarray(a), np.asfortranarray(b)
                try:
                    plain, pack, packed, c_plain, c_packed = packed_gemm.tile(a, b, m, n, k, trans_a, trans_b)
                except RuntimeError as error:     # e.g. oneDNN held below the ISA its packing needs
                    print(f"| {dtype} | {d_head} | {name} ({m} x {n} x {k}) | - | - | - | {error} |")
                    continue
                pack()
                plain()
                packed()
                same = bool(np.array_equal(c_plain.view(np.uint32), c_packed.view(np.uint32)))
                times = {plain: [], packed: [], pack: []}
                for _ in range(args.repeats):
                    for fn in times:
                        start = time.perf_counter()
                        for _ in range(INNER):
                            fn()
                        times[fn].append((time.perf_counter() - start) / INNER)
                flops = 2 * m * n * k
                median = {fn: float(np.median(t)) for fn, t in times.items()}
                row = dict(dtype=dtype, d_head=d_head, gemm=name, plain=flops / median[plain] / 1e9,
                           packed=flops / median[packed] / 1e9, pack_us=median[pack] * 1e6, identical=same)
                rows.append(row)
                print(f"| {dtype} | {d_head} | {name} ({m} x {n} x {k}) | {row['plain']:.0f} | {row['packed']:.0f} | "
                      f"{row['pack_us']:.1f} | {'identical' if same else 'differ'} |")
    return rows


if __name__ == "__main__":
    main()
