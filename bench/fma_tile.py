"""One tile's float32 GEMMs on the FMA units: the GEMM libraries' calls against a micro-kernel on
operands packed once.

    python bench/fma_tile.py [--repeats 9] [--d-head 128 64] [--rows 512] [--keys 512] [--mr 4]

The float32 backward calls its five tile GEMMs through the kernels' matmul seam, and both
libraries behind it (OpenBLAS's ``sgemm``, oneDNN's ``dnnl_sgemm``) copy ("pack") both operands
into their micro-kernel's layout on every call: on Zen 3 the copies are 13 % of the long
backward's CPU samples, and OpenBLAS's micro-kernel itself runs near the FMA peak
(docs/performance.md). A work item could pack K and V once and reuse them for every Q group,
Q_s and dO once per Q group, and have the softmax step write P^T and dS^T in the layout of the
GEMMs that read them. This measures that choice on one tile, before building it: the
backward's GEMMs in the orientations the kernel calls them (:func:`gemm_paths.gemms`; a
(``--rows`` Q group, ``--keys`` K tile) block), one thread:

* ``blas`` and ``onednn``: the libraries' calls through the kernels' matmul seam, as the
  kernels call them (packing included);
* ``own``: a float32 micro-kernel built with llvmlite (BLIS's scheme: ``MR`` rows x ``NR``
  = two vectors of columns of C held in ``2 MR`` vector registers, ``MR`` = 6 with 8-lane
  vectors, 12 with AVX-512's 16, or ``--mr``; per depth step two vector loads of B, ``MR`` broadcasts of A,
  ``2 MR`` FMAs; the depth blocked by ``KC`` and the rows by ``MC`` for the caches) on op(A)
  and op(B) already packed into its panels (:func:`pack_a`, :func:`pack_b`), the packing not
  included;
* ``pack_a_us``, ``pack_b_us``: that packing, by NumPy (an upper bound of a compiled one,
  paid once per K/V section or Q group for the reused operands, once per tile for P^T and dS^T);

with each one's GFLOP/s (2 m n k / time, the median over ``--repeats`` batches of ~20 ms) and
share of one thread's FMA peak measured in the same run (:mod:`peak`), the fraction of the own
product's elements bit-identical to OpenBLAS's, and its error over the bound of ``k`` float32
roundings of ``|A| |B|`` (at most 1). Prints one JSON line per GEMM.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys

import numpy as np

import peak   # bench/peak.py (a sibling, as when run as a script): the LLVM target, the FMA peak
from gemm_paths import PATHS, _operand, _timed_gemm, gemms   # bench/gemm_paths.py: the kernels' GEMM seam

KC = 256     # depth block: a B micro-panel (KC x NR floats) stays in L1
MC = 96      # row block (a multiple of MR for both widths): an A block (MC x KC) stays in L2
UNROLL = 4   # depth steps per loop iteration (the packing pads the depth to a multiple)


def widths(lanes: int, mr: int | None = None) -> tuple[int, int]:
    """``(MR, NR)`` of the micro-kernel on vectors of ``lanes`` float32 lanes (``mr``: another
    row count, e.g. 4 or 8, which divide the kernels' 32-row blocks; ``MC`` must be a multiple)."""
    if mr is not None and (mr < 1 or MC % mr):
        raise ValueError(f"mr must be a positive divisor of MC = {MC}, got {mr}")
    return mr or (6 if lanes == 8 else 12), 2 * lanes


def _module_ir(lanes: int, mr: int | None = None) -> str:
    """IR of ``void gemm(i64 m, i64 n, i64 k, float* ap, float* bp, float* c, i64 ldc)``:
    ``C[m, n] += A[m, k] @ B[k, n]``, ``C`` row-major (``ldc`` elements), ``ap`` A packed by
    :func:`pack_a`, ``bp`` B by :func:`pack_b`; ``m`` a multiple of ``MR``, ``n`` of ``NR``,
    ``k`` of ``UNROLL``."""
    from llvmlite import ir

    mr, nr = widths(lanes, mr)
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, lanes)
    fptr, vptr = f32.as_pointer(), vec.as_pointer()
    module = ir.Module(name="fma_tile")
    fma = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), name=f"llvm.fma.v{lanes}f32")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, i64, i64, fptr, fptr, fptr, i64]), name="gemm")
    m, n, k, ap, bp, c, ldc = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    zero_splat = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

    def const(value):
        return ir.Constant(i64, value)

    def loop(lo, hi, step, name, body):
        peak.counted_loop(b, fn, lo, hi, step, name, body)

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    def micro(kc, a0, b0, c0):
        """``C[c0: MR rows, NR columns] += Ap[a0:] @ Bp[b0:]`` over ``kc`` depth steps."""
        before = b.block
        head, inside, after = (fn.append_basic_block(f"kk_{x}") for x in ("head", "body", "end"))
        b.branch(head)
        b.position_at_end(head)
        kk = b.phi(i64)
        kk.add_incoming(const(0), before)
        accs = []
        for _ in range(2 * mr):
            phi = b.phi(vec)
            phi.add_incoming(ir.Constant(vec, [0.0] * lanes), before)
            accs.append(phi)
        b.cbranch(b.icmp_signed("<", kk, kc), inside, after)
        b.position_at_end(inside)
        values = list(accs)
        for u in range(UNROLL):
            step = b.add(kk, const(u))
            b_row = b.gep(bp, [b.add(b0, b.mul(step, const(nr)))])
            bv = [b.load(b.bitcast(b.gep(b_row, [const(h * lanes)]), vptr), align=4) for h in range(2)]
            a_row = b.gep(ap, [b.add(a0, b.mul(step, const(mr)))])
            for i in range(mr):
                scalar = b.load(b.gep(a_row, [const(i)]), align=4)
                splat = b.shuffle_vector(b.insert_element(ir.Constant(vec, ir.Undefined), scalar, const(0)),
                                         ir.Constant(vec, ir.Undefined), zero_splat)
                for h in range(2):
                    values[2 * i + h] = b.call(fma, [splat, bv[h], values[2 * i + h]])
        kk.add_incoming(b.add(kk, const(UNROLL)), b.block)
        for phi, value in zip(accs, values):
            phi.add_incoming(value, b.block)
        b.branch(head)
        b.position_at_end(after)
        for i in range(mr):
            row = b.gep(c, [b.add(c0, b.mul(const(i), ldc))])
            for h in range(2):
                p = b.bitcast(b.gep(row, [const(h * lanes)]), vptr)
                b.store(b.fadd(b.load(p, align=4), accs[2 * i + h]), p, align=4)

    def depth_block(pc):
        kc = smin(const(KC), b.sub(k, pc))

        def row_block(ic):
            mc_end = smin(b.add(ic, const(MC)), m)

            def column(jr):
                b0 = b.add(b.mul(b.udiv(jr, const(nr)), b.mul(k, const(nr))), b.mul(pc, const(nr)))

                def row(ir_):
                    a0 = b.add(b.mul(b.udiv(ir_, const(mr)), b.mul(k, const(mr))), b.mul(pc, const(mr)))
                    micro(kc, a0, b0, b.add(b.mul(ir_, ldc), jr))
                loop(ic, mc_end, mr, "ir", row)
            loop(const(0), n, nr, "jr", column)
        loop(const(0), m, MC, "ic", row_block)

    loop(const(0), k, KC, "pc", depth_block)
    b.ret_void()
    return str(module)


def lanes() -> int:
    """The float32 lanes of the widest vectors this CPU has (16 with AVX-512, else 8)."""
    _, features = peak._engine()
    return 16 if features.get("avx512f") else 8


@functools.lru_cache(maxsize=None)
def micro_kernel(width: int | None = None, mr: int | None = None):
    """The compiled ``gemm`` of :func:`_module_ir` for ``width`` lanes (default :func:`lanes`;
    ctypes, releases the GIL)."""
    import llvmlite.binding as llvm

    peak._engine()   # (LLVM's native target initialised)
    # A target machine of its own: the engine takes ownership of the one it is given.
    target = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    module = llvm.parse_assembly(_module_ir(width or lanes(), mr))
    module.verify()
    engine = llvm.create_mcjit_compiler(module, target)
    engine.finalize_object()
    p, i = ctypes.c_void_p, ctypes.c_int64
    gemm = ctypes.CFUNCTYPE(None, i, i, i, p, p, p, i)(engine.get_function_address("gemm"))
    gemm._engine = engine   # keep the code alive
    return gemm


def aligned(shape):
    """A zeroed float32 array of ``shape`` starting on a 64-byte boundary (a cache line)."""
    size = int(np.prod(shape))
    raw = np.zeros(size + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + size].reshape(shape)


def pack_a(a, mr):
    """``A [m, k]`` in the micro-kernel's A panels: ``[ceil(m / mr), k', mr]``, rows padded with
    zeros to a multiple of ``mr`` and the depth to ``k'``, a multiple of ``UNROLL`` (a zero
    product adds nothing)."""
    m, k = a.shape
    padded = np.zeros((-(-m // mr) * mr, -(-k // UNROLL) * UNROLL), np.float32)
    padded[:m, :k] = a
    out = aligned((padded.shape[0] // mr, padded.shape[1], mr))
    out[...] = padded.reshape(-1, mr, padded.shape[1]).transpose(0, 2, 1)
    return out


def pack_b(b, nr):
    """``B [k, n]`` in the micro-kernel's B panels: ``[ceil(n / nr), k', nr]``, columns padded
    with zeros to a multiple of ``nr``, the depth as in :func:`pack_a`."""
    k, n = b.shape
    padded = np.zeros((-(-k // UNROLL) * UNROLL, -(-n // nr) * nr), np.float32)
    padded[:k, :n] = b
    out = aligned((padded.shape[1] // nr, padded.shape[0], nr))
    out[...] = padded.reshape(padded.shape[0], -1, nr).transpose(1, 0, 2)
    return out


def _own_call(a, b, width=None, mr=None):
    """``(call, c)``: the micro-kernel for ``width`` lanes on ``A [m, k]`` and ``B [k, n]`` (float32)
    packed once, adding ``A @ B`` to ``c`` (zeroed; padded to whole panels) at each call."""
    mr, nr = widths(width or lanes(), mr)
    ap, bp = pack_a(a, mr), pack_b(b, nr)
    c = np.zeros((ap.shape[0] * mr, bp.shape[0] * nr), np.float32)
    kernel = micro_kernel(width, mr)

    def call():
        kernel(c.shape[0], c.shape[1], ap.shape[1], ap.ctypes.data, bp.ctypes.data, c.ctypes.data, c.shape[1])
    return call, c


def own_product(a, b, width=None, mr=None):
    """``A @ B`` (float32 ``[m, k]`` and ``[k, n]``) by the micro-kernel for ``width`` lanes."""
    call, c = _own_call(a, b, width, mr)
    call()
    return c[:a.shape[0], :b.shape[1]]


def _seconds(fn, repeats):
    """Median over ``repeats`` batches (of ~20 ms) of the mean time of one call."""
    return float(np.median(peak.batch_times(fn, repeats)))


def measure(name, a, b, trans_a, trans_b, m, n, k, repeats, peak_gflops, with_onednn, mr=None):
    """The figures of one GEMM (the module docstring), as a dict."""
    op_a = np.ascontiguousarray(a.T if trans_a else a)
    op_b = np.ascontiguousarray(b.T if trans_b else b)
    mr, nr = widths(lanes(), mr)
    own_call, c_own = _own_call(op_a, op_b, None, mr)
    own_call()   # C += A B on a zeroed C: the product, before the timing accumulates more
    ours = c_own[:m, :n].copy()
    theirs = np.empty((m, n), np.float32)
    _timed_gemm(_operand(a), _operand(b), theirs, trans_a, trans_b, PATHS["blas"], 1, 0.0)
    wide_a, wide_b = op_a.astype(np.float64), op_b.astype(np.float64)
    exact, bound = wide_a @ wide_b, k * 2.0 ** -24 * (np.abs(wide_a) @ np.abs(wide_b))
    c = np.zeros((m, n), np.float32)
    times = {path: _seconds(lambda: _timed_gemm(_operand(a), _operand(b), c, trans_a, trans_b, PATHS[key], 1),
                            repeats)
             for path, key in (("blas", "blas"), ("onednn", "onednn-f32")) if path == "blas" or with_onednn}
    times["own"] = _seconds(own_call, repeats)
    flops = 2 * m * n * k
    row = {"gemm": name, "m": m, "n": n, "k": k}
    for path, seconds in times.items():
        gflops = flops / seconds / 1e9
        row[f"{path}_gflops"] = round(gflops, 1)
        row[f"{path}_of_peak"] = round(gflops / peak_gflops, 3)
    row["pack_a_us"] = round(_seconds(lambda: pack_a(op_a, mr), repeats) * 1e6, 1)
    row["pack_b_us"] = round(_seconds(lambda: pack_b(op_b, nr), repeats) * 1e6, 1)
    row["same_bits_as_blas"] = float(np.mean(ours.view(np.uint32) == theirs.view(np.uint32)))
    row["error_over_bound"] = float(np.max(np.abs(ours - exact) / (bound + 1e-300)))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--d-head", type=int, nargs="+", default=[128, 64])
    p.add_argument("--rows", type=int, default=512, help="query rows of the block (default 512)")
    p.add_argument("--keys", type=int, default=512, help="keys of the block (default 512)")
    p.add_argument("--mr", type=int, default=None,
                   help=f"rows of C per micro-kernel call (a divisor of MC = {MC}; default 6 with 8 lanes, 12 with 16)")
    args = p.parse_args(argv)
    from numbafa import backend_info
    from numbafa.platform import onednn
    from numbafa.platform.blas import single_threaded_blas

    with_onednn = onednn.load_library() is not None
    peak_gflops = peak.peak_gflops("fma", threads=1)
    try:
        mr, nr = widths(lanes(), args.mr)
    except ValueError as error:
        p.error(str(error))
    print(json.dumps({"cpu": backend_info()["cpu_model"], "lanes": lanes(), "mr": mr, "nr": nr, "kc": KC, "mc": MC,
                      "peak_gflops_one_thread": round(peak_gflops, 1), "onednn": with_onednn}))
    rng = np.random.default_rng(0)
    with single_threaded_blas():
        for d_head in args.d_head:
            for name, (a, b, trans_a, trans_b, m, n, k) in gemms(d_head, rng, args.rows, args.keys).items():
                if name.startswith("dQ^T"):
                    continue   # (an orientation the kernel does not call)
                print(json.dumps({"d_head": d_head, **measure(name, a, b, trans_a, trans_b, m, n, k, args.repeats,
                                                              peak_gflops, with_onednn, mr)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
