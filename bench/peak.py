"""The machine's arithmetic peak, measured: a register-resident loop of vector FMAs (and of
``vdpbf16ps`` where the CPU has AVX512_BF16, of AMX's ``tdpbf16ps`` where it has AMX-BF16), one
per thread, built with llvmlite.

    python bench/peak.py [--threads N]

Each thread runs ``n`` iterations of ``ACCUMULATORS`` independent multiply-adds on vectors of
the widest float32 width the CPU has (16 lanes with AVX-512, else 8): no memory traffic, enough
independent chains to fill the FMA pipes. FLOPs are counted as 2 per lane (FMA) and 4 per lane
for ``vdpbf16ps`` (two bf16 products and their sums into each float32 lane). The AMX loop keeps
``AMX_ACCUMULATORS`` 16 x 16 float32 tiles, each gaining a 16 x 32 by 32 x 16 bf16 product per
round (16 * 16 * 32 * 2 FLOPs); Linux lets a process use AMX's tile data only after asking
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``), which this does once. The figure is the
best of a few runs of ~0.1 s: what the cores can do now (a shared VM's neighbours included), the
denominator ``bench/compare.py`` divides its GFLOP/s by.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import llvmlite.binding as llvm
import llvmlite.ir as ir

ACCUMULATORS = 12
AMX_ACCUMULATORS = 4          # tiles 0-3; tiles 4, 5 (A) and 6, 7 (B) hold the operands
_AMX_FLOPS = 16 * 16 * 32 * 2  # one tdpbf16ps on full tiles
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158          # x86-64


@functools.lru_cache(maxsize=None)
def _engine():
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    features = llvm.get_host_cpu_features()
    target = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=2)
    return target, features


def _loop_module(kind: str, lanes: int) -> str:
    """IR of ``void loop(i64 n, float* out)``: ``n`` rounds of ``ACCUMULATORS`` FMAs (``kind``
    "fma") or ``vdpbf16ps`` ("bf16"), the accumulators summed into ``out`` (keeps them live)."""
    f32 = ir.FloatType()
    vec = ir.VectorType(f32, lanes)
    module = ir.Module(name=f"peak_{kind}")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(64), f32.as_pointer()]), name="loop")
    n, out = fn.args
    entry, body, done = (fn.append_basic_block(x) for x in ("entry", "body", "done"))
    b = ir.IRBuilder(entry)
    if kind == "fma":
        op = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), name=f"llvm.fma.v{lanes}f32")
        x = ir.Constant(vec, [1.0000001] * lanes)
        y = ir.Constant(vec, [0.9999999] * lanes)
    else:
        words = ir.VectorType(ir.IntType(32), lanes)   # 2 x bf16 per 32-bit lane
        op = ir.Function(module, ir.FunctionType(vec, [vec, words, words]), name="llvm.x86.avx512bf16.dpbf16ps.512")
        x = ir.Constant(words, [0x3F803F80] * lanes)
        y = ir.Constant(words, [0x3F7F3F7F] * lanes)
    b.branch(body)
    b = ir.IRBuilder(body)
    i = b.phi(ir.IntType(64))
    i.add_incoming(ir.Constant(ir.IntType(64), 0), entry)
    accs = []
    for a in range(ACCUMULATORS):
        phi = b.phi(vec)
        phi.add_incoming(ir.Constant(vec, [float(a)] * lanes), entry)
        accs.append(phi)
    new = [b.call(op, [x, y, acc]) if kind == "fma" else b.call(op, [acc, x, y]) for acc in accs]
    i_next = b.add(i, ir.Constant(ir.IntType(64), 1))
    i.add_incoming(i_next, body)
    for phi, value in zip(accs, new):
        phi.add_incoming(value, body)
    b.cbranch(b.icmp_signed("<", i_next, n), body, done)
    b = ir.IRBuilder(done)
    total = new[0]
    for value in new[1:]:
        total = b.fadd(total, value)
    b.store(b.extract_element(total, ir.Constant(ir.IntType(32), 0)), out)
    b.ret_void()
    return str(module)


def batch_times(fn, repeats: int) -> list:
    """The mean time of one call of ``fn`` in each of ``repeats`` batches of ~20 ms (after two
    calls, the second sizing the batches): the micro-kernel benches' timer, each taking its own
    statistic (bench/amx_tile.py the best, bench/fma_tile.py the median)."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-7)))
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls)
    return means


def counted_loop(b, fn, lo, hi, step, name, body):
    """``for iv in range(lo, hi, step): body(iv)`` in LLVM IR at the builder ``b``'s position in
    the function ``fn`` (``lo``, ``hi``, ``step``: i64 values or ints; blocks ``name_head``,
    ``name_body``, ``name_end``). The micro-kernels' loops (bench/amx_tile.py, bench/fma_tile.py)."""
    i64 = ir.IntType(64)
    lo, hi, step = (x if isinstance(x, ir.Value) else ir.Constant(i64, x) for x in (lo, hi, step))
    before = b.block
    head, inside, after = (fn.append_basic_block(f"{name}_{x}") for x in ("head", "body", "end"))
    b.branch(head)
    b.position_at_end(head)
    iv = b.phi(i64)
    iv.add_incoming(lo, before)
    b.cbranch(b.icmp_signed("<", iv, hi), inside, after)
    b.position_at_end(inside)
    body(iv)
    iv.add_incoming(b.add(iv, step), b.block)
    b.branch(head)
    b.position_at_end(after)


def amx_declarations(module):
    """``(intrinsics, config)`` in ``module``: AMX's LLVM intrinsics by name (``ldtilecfg``,
    ``tilerelease``, ``tilezero``, ``tileloadd64``, ``tilestored64``, ``tdpbf16ps``) and the
    tile configuration ``ldtilecfg`` loads (a 64-byte global: palette 1, 8 tiles of 16 rows x 64
    bytes). Also the AMX micro-kernel's (bench/amx_tile.py)."""
    i8, i64 = ir.IntType(8), ir.IntType(64)
    ptr = i8.as_pointer()
    intrinsic = {name: ir.Function(module, ir.FunctionType(ir.VoidType(), args), name=f"llvm.x86.{name}")
                 for name, args in (("ldtilecfg", [ptr]), ("tilerelease", []), ("tilezero", [i8]),
                                    ("tileloadd64", [i8, ptr, i64]), ("tilestored64", [i8, ptr, i64]),
                                    ("tdpbf16ps", [i8, i8, i8]))}
    config = bytearray(64)
    config[0] = 1                                    # palette 1
    for t in range(8):
        config[16 + 2 * t:18 + 2 * t] = (64).to_bytes(2, "little")   # bytes per row
        config[48 + t] = 16                          # rows
    cfg = ir.GlobalVariable(module, ir.ArrayType(i8, 64), name="config")
    cfg.initializer = ir.Constant(ir.ArrayType(i8, 64), bytearray(config))
    cfg.global_constant = True
    cfg.align = 64
    return intrinsic, cfg


def _amx_module() -> str:
    """IR of ``void loop(i64 n, float* out)``: the tiles configured (``ldtilecfg``: 8 tiles of
    16 rows x 64 bytes), A tiles of bf16 1.0 and B tiles of bf16 0.99609375 loaded, ``n`` rounds of
    ``AMX_ACCUMULATORS`` ``tdpbf16ps`` (accumulator ``t`` += A[t // 2] B[t % 2]), then the sum of
    the accumulators' element [0, 0] into ``out`` and the tiles released."""
    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    ptr = i8.as_pointer()
    module = ir.Module(name="peak_amx")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, f32.as_pointer()]), name="loop")
    n, out = fn.args
    intrinsic, cfg = amx_declarations(module)
    data = {}
    for name, bits in (("a", 0x3F80), ("b", 0x3F7F)):   # bf16 1.0 and 0.99609375
        g = ir.GlobalVariable(module, ir.ArrayType(i16, 512), name=name)
        g.initializer = ir.Constant(ir.ArrayType(i16, 512), [bits] * 512)
        g.global_constant = True
        g.align = 64
        data[name] = g
    entry, body, done = (fn.append_basic_block(x) for x in ("entry", "body", "done"))
    b = ir.IRBuilder(entry)
    stride = ir.Constant(i64, 64)
    b.call(intrinsic["ldtilecfg"], [b.bitcast(cfg, ptr)])
    for t in range(AMX_ACCUMULATORS):
        b.call(intrinsic["tilezero"], [ir.Constant(i8, t)])
    for t, name in ((4, "a"), (5, "a"), (6, "b"), (7, "b")):
        b.call(intrinsic["tileloadd64"], [ir.Constant(i8, t), b.bitcast(data[name], ptr), stride])
    b.branch(body)
    b = ir.IRBuilder(body)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    for t in range(AMX_ACCUMULATORS):
        b.call(intrinsic["tdpbf16ps"], [ir.Constant(i8, t), ir.Constant(i8, 4 + t // 2), ir.Constant(i8, 6 + t % 2)])
    i_next = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(i_next, body)
    b.cbranch(b.icmp_signed("<", i_next, n), body, done)
    b = ir.IRBuilder(done)
    tile = b.alloca(ir.ArrayType(f32, 256))
    tile.align = 64
    total = ir.Constant(f32, 0.0)
    for t in range(AMX_ACCUMULATORS):
        b.call(intrinsic["tilestored64"], [ir.Constant(i8, t), b.bitcast(tile, ptr), stride])
        total = b.fadd(total, b.load(b.gep(tile, [ir.Constant(i32, 0), ir.Constant(i32, 0)])))
    b.call(intrinsic["tilerelease"], [])
    b.store(total, out)
    b.ret_void()
    return str(module)


def _amx_permitted() -> bool:
    """Ask Linux for AMX's tile data for this process (once; harmless if already granted)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def flops_per_round(kind: str, lanes: int) -> int:
    """FLOPs of one round of the loop of ``kind`` (``lanes``: its float32 vector width)."""
    if kind == "amx":
        return AMX_ACCUMULATORS * _AMX_FLOPS
    return ACCUMULATORS * lanes * (2 if kind == "fma" else 4)


@functools.lru_cache(maxsize=None)
def _compiled(kind: str):
    """``(loop, lanes)``: the compiled ``loop(n, out)`` of ``kind``, or ``(None, 0)`` when this CPU
    has no such instruction (``vdpbf16ps`` needs AVX512_BF16; ``tdpbf16ps`` AMX-BF16 and Linux's
    permission for AMX's tile data)."""
    target, features = _engine()
    if kind == "bf16" and not features.get("avx512bf16"):
        return None, 0
    if kind == "amx" and not (features.get("amx-bf16") and features.get("amx-tile") and _amx_permitted()):
        return None, 0
    lanes = 16 if features.get("avx512f") else 8
    module = llvm.parse_assembly(_amx_module() if kind == "amx" else _loop_module(kind, lanes))
    module.verify()
    engine = llvm.create_mcjit_compiler(module, target)
    engine.finalize_object()
    address = engine.get_function_address("loop")
    loop = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.POINTER(ctypes.c_float))(address)   # releases the GIL
    loop._engine = engine   # keep the code alive
    return loop, lanes


def peak_gflops(kind: str = "fma", threads: int | None = None, seconds: float = 0.1, runs: int = 3):
    """GFLOP/s of ``threads`` threads (default: the CPUs this process may use) each running the
    loop of ``kind`` ("fma": float32 FMA; "bf16": ``vdpbf16ps``; "amx": ``tdpbf16ps``) for
    ~``seconds``: the best of ``runs``. None when the CPU has no such instruction."""
    loop, lanes = _compiled(kind)
    if loop is None:
        return None
    threads = threads or len(os.sched_getaffinity(0))
    flops_per_iter = flops_per_round(kind, lanes)
    sink = (ctypes.c_float * threads)()
    n = 1000
    while True:   # size the run to ~seconds on one thread
        t0 = time.perf_counter()
        loop(n, ctypes.cast(sink, ctypes.POINTER(ctypes.c_float)))
        elapsed = time.perf_counter() - t0
        if elapsed > seconds / 10:
            n = int(n * seconds / elapsed)
            break
        n *= 10
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(runs):
            t0 = time.perf_counter()
            list(pool.map(lambda t: loop(n, ctypes.cast(ctypes.byref(sink, 4 * t), ctypes.POINTER(ctypes.c_float))),
                          range(threads)))
            best = max(best, threads * n * flops_per_iter / (time.perf_counter() - t0) / 1e9)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    for kind, what in (("fma", "float32 FMA"), ("bf16", "vdpbf16ps"), ("amx", "AMX tdpbf16ps")):
        value = peak_gflops(kind, args.threads)
        print(f"{what}: " + ("not on this CPU" if value is None else f"{value:.0f} GFLOP/s"))


if __name__ == "__main__":
    main()
