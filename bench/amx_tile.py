"""One tile's bf16 GEMMs on AMX: oneDNN's GEMM call against a micro-kernel on a B packed once.

    python bench/amx_tile.py [--repeats 7]

On the bf16 path the kernels call oneDNN's ``dnnl_gemm_bf16bf16f32`` once per tile product,
and it packs both operands on every call (docs/performance.md, "Open"). A work item could
instead pack K and V once into AMX's layout and reuse them for every Q tile. This measures
that choice on one tile, before building it, for the forward's products on the bf16 path --
``S = Q_s^T K`` (M query rows x N = 512 keys, K = d) and ``P V`` (M rows x N = d, K = 512
keys) -- on one thread:

* ``onednn``: ``dnnl_gemm_bf16bf16f32`` through the kernels' matmul seam, as they call it
  (row-major, A and B plain, ``beta = 0``);
* ``amx``: a ``tdpbf16ps`` micro-kernel (llvmlite; four 16 x 16 float32 accumulator tiles in
  2 x 2 blocks, A row-major, B packed into AMX's pair-interleaved "VNNI" layout beforehand:
  :func:`vnni`), B's packing not included;
* ``pack``: that packing of B, by NumPy (an upper bound of a compiled one);

and checks the micro-kernel's product against oneDNN's bit for bit (``same_bits``: the
fraction of equal elements) and against the exact product (float64; within ``K`` float32
roundings of ``|A| |B|``). Prints one JSON line per shape. Needs a CPU with AMX-BF16, Linux's
permission for its tile data and oneDNN; says which is missing otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys

import numpy as np

import peak  # bench/peak.py (a sibling, as when run as a script): the LLVM target, AMX's permission
from gemm_paths import PATHS, _operand, _timed_gemm   # bench/gemm_paths.py: the kernels' GEMM seam

#: (name, M, N, K) of the forward's tile products on the bf16 path: a Q tile and a Q group.
SHAPES = [("S q-tile d128", 128, 512, 128), ("S q-group d128", 512, 512, 128),
          ("S q-tile d64", 128, 512, 64), ("PV q-tile d128", 128, 128, 512),
          ("PV q-group d128", 512, 128, 512)]


def _module_ir() -> str:
    """IR of ``void gemm(i64 m, i64 n, i64 k, i8* a, i64 lda, i8* bp, i64 ldb, i8* c, i64 ldc)``
    (leading dimensions in bytes): ``C[m, n] = A[m, k] @ B[k, n]``, float32 ``C``, bf16 ``A``
    row-major, ``bp`` B in :func:`vnni` layout; ``m``, ``n``, ``k`` multiples of 32. Tiles 0-3
    accumulate a 32 x 32 block of C, 4-5 hold A's two 16-row tiles, 6-7 B's two 16-column ones."""
    from llvmlite import ir

    i8, i64 = ir.IntType(8), ir.IntType(64)
    ptr = i8.as_pointer()
    module = ir.Module(name="amx_tile")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, i64, i64, ptr, i64, ptr, i64, ptr, i64]),
                     name="gemm")
    m, n, k, a, lda, bp, ldb, c, ldc = fn.args
    intrinsic, cfg = peak.amx_declarations(module)   # 8 tiles of 16 rows x 64 bytes
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def const(value):
        return ir.Constant(i64, value)

    def tile(t):
        return ir.Constant(i8, t)

    def loop(hi, step, name, body):
        peak.counted_loop(b, fn, 0, hi, step, name, body)

    def block(r0, c0):
        for t in range(4):
            b.call(intrinsic["tilezero"], [tile(t)])

        def depth(k0):
            for t, dr in ((4, 0), (5, 16)):
                offset = b.add(b.mul(b.add(r0, const(dr)), lda), b.mul(k0, const(2)))
                b.call(intrinsic["tileloadd64"], [tile(t), b.gep(a, [offset]), lda])
            for t, dc in ((6, 0), (7, 16)):
                offset = b.add(b.mul(b.udiv(k0, const(2)), ldb), b.mul(b.add(c0, const(dc)), const(4)))
                b.call(intrinsic["tileloadd64"], [tile(t), b.gep(bp, [offset]), ldb])
            for t in range(4):
                b.call(intrinsic["tdpbf16ps"], [tile(t), tile(4 + t // 2), tile(6 + t % 2)])

        loop(k, 32, "k", depth)
        for t in range(4):
            offset = b.add(b.mul(b.add(r0, const(16 * (t // 2))), ldc), b.mul(b.add(c0, const(16 * (t % 2))), const(4)))
            b.call(intrinsic["tilestored64"], [tile(t), b.gep(c, [offset]), ldc])

    b.call(intrinsic["ldtilecfg"], [b.bitcast(cfg, ptr)])
    loop(m, 32, "m", lambda r0: loop(n, 32, "n", lambda c0: block(r0, c0)))
    b.call(intrinsic["tilerelease"], [])
    b.ret_void()
    return str(module)


def unavailable() -> str | None:
    """Why this cannot run here, or None."""
    from numbafa.platform import onednn

    _, features = peak._engine()
    if not (features.get("amx-bf16") and features.get("amx-tile")):
        return "this CPU has no AMX-BF16"
    if not peak._amx_permitted():
        return "Linux did not grant this process AMX's tile data (arch_prctl)"
    if onednn.library_path() is None:
        return "oneDNN is not installed"
    if not onednn.bf16_units():
        return "oneDNN's bf16 GEMM does not run on this CPU's bf16 units here (ONEDNN_MAX_CPU_ISA?)"
    return None


@functools.lru_cache(maxsize=None)
def micro_kernel():
    """The compiled ``gemm`` of :func:`_module_ir` (ctypes; releases the GIL). Raises
    ``RuntimeError`` where :func:`unavailable` gives a reason (AMX's instructions would fault)."""
    import llvmlite.binding as llvm

    why = unavailable()
    if why:
        raise RuntimeError(f"the AMX micro-kernel cannot run here: {why}")
    target, _ = peak._engine()
    module = llvm.parse_assembly(_module_ir())
    module.verify()
    engine = llvm.create_mcjit_compiler(module, target)
    engine.finalize_object()
    p, i = ctypes.c_void_p, ctypes.c_int64
    gemm = ctypes.CFUNCTYPE(None, i, i, i, p, i, p, i, p, i)(engine.get_function_address("gemm"))
    gemm._engine = engine   # keep the code alive
    return gemm


def vnni(bits):
    """``B [k, n]`` bf16 bits in AMX's layout for ``tdpbf16ps``: ``[k / 2, n, 2]`` (each row holds
    the pairs ``B[2i, j], B[2i + 1, j]``), as a ``[k / 2, 2 n]`` uint16 array."""
    k, n = bits.shape
    return np.ascontiguousarray(bits.reshape(k // 2, 2, n).transpose(0, 2, 1)).reshape(k // 2, 2 * n)


def amx_product(a_bits, b_packed, n):
    """``A @ B`` (float32) by the micro-kernel, ``b_packed`` = :func:`vnni` of B."""
    m, k = a_bits.shape
    c = np.empty((m, n), np.float32)
    micro_kernel()(m, n, k, a_bits.ctypes.data, 2 * k, b_packed.ctypes.data, 4 * n, c.ctypes.data, 4 * n)
    return c


def onednn_product(a_bits, b_bits, out):
    """``out = A @ B`` by oneDNN (no transposes) through the kernels' own matmul seam
    (:func:`numbafa.kernels.matmul.gemm` on the bf16 path: one OpenMP thread, restored after)."""
    _timed_gemm(_operand(a_bits), _operand(b_bits), out, False, False, PATHS["onednn-bf16"], 1, 0.0)
    return out


def _seconds(fn, repeats):
    """Best over ``repeats`` batches of the mean time of one call (batches of ~20 ms)."""
    return min(peak.batch_times(fn, repeats))


def measure(m, n, k, repeats=7, seed=0):
    """The figures of one shape (the module docstring), as a dict."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16).view(np.uint16) for shape in ((m, k), (k, n)))
    packed = vnni(b)
    ours = amx_product(a, packed, n)
    theirs = onednn_product(a, b, np.empty((m, n), np.float32))
    wide = [x.view(ml_dtypes.bfloat16).astype(np.float64) for x in (a, b)]
    exact, magnitude = wide[0] @ wide[1], np.abs(wide[0]) @ np.abs(wide[1])
    c = np.empty((m, n), np.float32)
    times = {"onednn": _seconds(lambda: onednn_product(a, b, c), repeats),
             "amx": _seconds(lambda: micro_kernel()(m, n, k, a.ctypes.data, 2 * k, packed.ctypes.data, 4 * n,
                                                   c.ctypes.data, 4 * n), repeats),
             "pack": _seconds(lambda: vnni(b), repeats)}
    flops = 2 * m * n * k
    return {"m": m, "n": n, "k": k,
            **{f"{key}_us": round(value * 1e6, 2) for key, value in times.items()},
            "onednn_gflops": round(flops / times["onednn"] / 1e9), "amx_gflops": round(flops / times["amx"] / 1e9),
            "same_bits": float(np.mean(ours.view(np.uint32) == theirs.view(np.uint32))),
            "error_over_bound": float(np.max(np.abs(ours - exact) / (k * 2.0 ** -24 * magnitude + 1e-300)))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"amx_tile: not measured: {why}")
        return 0
    for name, m, n, k in SHAPES:
        print(json.dumps({"shape": name, **measure(m, n, k, args.repeats)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
