"""CPU time of the first forward + backward calls: compiled cold, and loaded from the disk cache.

    python bench/cold_compile.py [--rounds 2]

Each measurement is a fresh process (``B1 H2 S256 D16``, causal) that times,
in CPU seconds (``time.process_time``), its first ``attention_fwd`` and
``attention_bwd`` calls:

* ``cold``: ``NUMBAFA_CACHE=0`` and an empty ``NUMBA_CACHE_DIR``: everything
  compiled, nothing read or written;
* ``cached``: a process compiles into an empty ``NUMBAFA_CACHE_DIR``, then a
  second process loads the kernels from it (the figure is the second's).

for float32, bf16 (``mixed_precision=True``), and float32 with dropout (a
kernel of its own); ``--dtypes`` adds float16 and float64 (kernels of their own). Also prints each process's wall time, and Numba's own
breakdown of the cold float32 compile (CPU in LLVM, number of compiles).

``--after-float32`` adds one cold process (``NUMBAFA_CACHE=0``) that runs the float32 forward
and backward, then each variant's in turn -- bf16, float16, float32 with dropout, float32 with a
bias and a soft cap -- and prints what each *adds* in that process (CPU seconds, compiles): the
variants' compile beyond float32's.

``--nb`` adds, cold, what a ``numbafa.nb`` user meets after the Python API's float32 forward and
backward in the same process: ``numbafa.nb.plan`` (with sinks), then the first call of a
``@numba.njit`` function calling ``nb.attention_fwd`` and ``nb.attention_bwd``; then the same
with the disk cache, in two processes sharing an empty one: the first compiles nb's checks for
these argument types, the next loads them (the user's function is compiled in both).

``--llvm-calls`` splits each cold compile's LLVM time by llvmlite's C function (CPU seconds and
calls: the module passes, machine-code emission, parsing, ...; :func:`time_llvm_calls`).

``--no-variants`` skips the per-variant processes above. ``--ahead`` adds a script's cold first float32 forward and backward (``B1 H4 S512 D64``, causal;
empty ``NUMBAFA_CACHE_DIR``) in wall seconds, without and with ``numbafa.compile_ahead("float32")``
(the backward compiled in a second process while the forward compiles), alternated; the CPU
seconds are the script's and its second process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
t_start = time.process_time()
args = json.loads(sys.argv[1])
llvm_calls = None
if args.get("llvm_calls"):
    sys.path.insert(0, args["bench"])
    from cold_compile import time_llvm_calls
    llvm_calls = time_llvm_calls()
from numba.core import event
llvm = [0.0]
compiles = [0]
class Listener(event.Listener):
    def on_start(self, ev):
        if ev.kind == "numba:llvm_lock":
            self.t = time.process_time()
        else:
            compiles[0] += 1
    def on_end(self, ev):
        if ev.kind == "numba:llvm_lock":
            llvm[0] += time.process_time() - self.t
listener = Listener()
event.register("numba:llvm_lock", listener)
event.register("numba:compile", listener)
import numpy as np, numbafa
dtype = {"float32": np.float32, "float16": np.float16, "float64": np.float64}.get(args["dtype"])
if args["dtype"] == "bf16":
    import ml_dtypes
    dtype = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
q, k, v, dy = (rng.standard_normal((1, 2, 16, 256)).astype(dtype) for _ in range(4))
kw = dict(use_causal_mask=True, mixed_precision=args["dtype"] in ("bf16", "float16"))
if args["dropout"]:
    kw.update(dropout_p=0.1, seed=1)
t0 = time.process_time()
o, lse = numbafa.attention_fwd(q, k, v, **kw)
t1 = time.process_time()
numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
t2 = time.process_time()
print(json.dumps(dict(fwd=t1 - t0, bwd=t2 - t1, total=t2 - t0, llvm=llvm[0], compiles=compiles[0],
                      process=t2 - t_start, llvm_calls=llvm_calls)))
"""

VARIANTS = [("float32", False), ("bf16", False), ("float32", True)]

_NB_CHILD = r"""
import json, time
import numba, numpy as np, numbafa
from numbafa import nb
rng = np.random.default_rng(0)
q, dy = (rng.standard_normal((1, 4, 32, 256)).astype(np.float32) for _ in range(2))
k, v = (rng.standard_normal((1, 2, 32, 256)).astype(np.float32) for _ in range(2))
sinks = rng.standard_normal((1, 4)).astype(np.float32)
o, lse = numbafa.attention_fwd(q, k, v, sinks, use_causal_mask=True)
numbafa.attention_bwd(q, k, v, o, dy, lse, sinks, use_causal_mask=True)

@numba.njit
def step(plan, q, k, v, o, lse, dy, sinks, dq, dk, dv, dsinks):
    nb.attention_fwd(plan, q, k, v, o, lse, sinks)
    nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, sinks, dsinks)

t0 = time.process_time()
plan = nb.plan(q, k, v, use_causal_mask=True, with_sinks=True)
t1 = time.process_time()
step(plan, q, k, v, o, lse, dy, sinks, np.empty_like(q), np.empty_like(k), np.empty_like(v), np.empty_like(sinks))
t2 = time.process_time()
print(json.dumps(dict(plan=t1 - t0, step=t2 - t1)))
"""


_AFTER_CHILD = r"""
import json, time
import ml_dtypes, numpy as np, numbafa
from numba.core import event
compiles = [0]
class Listener(event.Listener):
    def on_start(self, ev):
        compiles[0] += 1
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
rng = np.random.default_rng(0)
def step(dtype, **kw):
    q, k, v, dy = (rng.standard_normal((1, 2, 16, 256)).astype(dtype) for _ in range(4))
    t0, n0 = time.process_time(), compiles[0]
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, **kw)
    numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, **kw)
    return dict(cpu=time.process_time() - t0, compiles=compiles[0] - n0)
bias = rng.standard_normal((1, 2, 256, 256)).astype(np.float32)
steps = [("float32", step(np.float32)),
         ("bf16", step(ml_dtypes.bfloat16, mixed_precision=True)),
         ("float16", step(np.float16, mixed_precision=True)),
         ("float32 + dropout", step(np.float32, dropout_p=0.1, seed=1)),
         ("float32 + bias + soft cap", step(np.float32, bias=bias, softcap=30.0))]
print(json.dumps(steps))
"""


_AHEAD_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import numpy as np
import numbafa
handle = numbafa.compile_ahead("float32") if sys.argv[1] == "ahead" else None
rng = np.random.default_rng(0)
q, k, v, dy = (rng.standard_normal((1, 4, 64, 512)).astype(np.float32) for _ in range(4))
t1 = time.perf_counter()
o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True)
t2 = time.perf_counter()
if handle is not None:
    assert handle.wait()
numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True)
t3 = time.perf_counter()
cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
          for f in ("ru_utime", "ru_stime"))
print(json.dumps(dict(forward=t2 - t1, backward=t3 - t2, script=t3 - t0, cpu=cpu)))
"""


def _ahead_child(how: str) -> dict:
    """Wall seconds of :data:`_AHEAD_CHILD` (``how``: "ahead" or "plain") in a fresh process on an
    empty cache, and the CPU seconds of it and its second process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", _AHEAD_CHILD, how], capture_output=True, text=True,
                             timeout=1800, env=dict(os.environ, NUMBAFA_CACHE_DIR=tmp, NUMBA_CACHE_DIR=tmp))
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_llvm_calls() -> dict:
    """From now on, the CPU seconds and the number of calls of each of llvmlite's C functions
    (``{name: [seconds, calls]}``, filled in as they run): where LLVM's share of a compile goes
    (its module passes, ``LLVMPY_RunNewModulePassManager``; machine-code emission,
    ``LLVMPY_FinalizeObject``; IR parsing, ...). Wraps llvmlite's private ``ffi._lib_fn_wrapper``
    for the rest of the process; ``RuntimeError`` if this llvmlite has none."""
    import time

    from llvmlite.binding import ffi
    wrapper = getattr(ffi, "_lib_fn_wrapper", None)
    if wrapper is None:
        raise RuntimeError("this llvmlite has no ffi._lib_fn_wrapper: --llvm-calls cannot time its C calls")
    calls = {}
    call = wrapper.__call__

    def timed(self, *args, **kwargs):
        t0 = time.process_time()
        try:
            return call(self, *args, **kwargs)
        finally:
            entry = calls.setdefault(self._cfn.__name__, [0.0, 0])
            entry[0] += time.process_time() - t0
            entry[1] += 1

    wrapper.__call__ = timed
    return calls


def _child(variant, env, llvm_calls=False):
    dtype, dropout = variant
    spec = dict(dtype=dtype, dropout=dropout, llvm_calls=llvm_calls, bench=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)],
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _nb_child(env) -> dict:
    """``{"plan", "step"}`` CPU seconds of :data:`_NB_CHILD` in a fresh process with ``env``."""
    out = subprocess.run([sys.executable, "-c", _NB_CHILD], capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=[], choices=["float16", "float64"],
                   help="also these input dtypes, without dropout")
    p.add_argument("--after-float32", action="store_true",
                   help="also one cold process: float32, then what each variant adds in it")
    p.add_argument("--nb", action="store_true", help="also numbafa.nb's plan and a user's first njit call, cold")
    p.add_argument("--no-variants", action="store_true", help="skip the per-variant cold and cached processes")
    p.add_argument("--llvm-calls", action="store_true",
                   help="also split each cold compile's LLVM time by llvmlite's C functions")
    p.add_argument("--ahead", action="store_true",
                   help="also a script's cold first forward + backward without and with numbafa.compile_ahead")
    args = p.parse_args(argv)
    import numbafa
    print(f"CPU: {numbafa.backend_info()['cpu_model']}; GEMM path {numbafa.backend_info()['gemm']['path']}; "
          f"numbafa {numbafa.__version__}")
    for round_ in range(args.rounds):
        for variant in [] if args.no_variants else VARIANTS + [(dtype, False) for dtype in args.dtypes]:
            name = variant[0] + (" + dropout" if variant[1] else "")
            with tempfile.TemporaryDirectory() as tmp:
                cold = _child(variant, dict(os.environ, NUMBAFA_CACHE="0", NUMBA_CACHE_DIR=tmp), args.llvm_calls)
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, NUMBAFA_CACHE_DIR=tmp, NUMBA_CACHE_DIR=tmp)
                _child(variant, env)
                cached = _child(variant, env)
            print(f"round {round_ + 1}, {name:18s} cold: fwd {cold['fwd']:5.2f} s + bwd {cold['bwd']:5.2f} s "
                  f"= {cold['total']:5.2f} s CPU (LLVM {cold['llvm']:5.2f} s, {cold['compiles']} compiles); "
                  f"cached: {cached['total']:.2f} s (whole process {cached['process']:.2f} s)", flush=True)
            if cold["llvm_calls"]:
                top = sorted(cold["llvm_calls"].items(), key=lambda kv: -kv[1][0])
                print(f"    in llvmlite's C calls {sum(t for t, _ in cold['llvm_calls'].values()):.2f} s: "
                      + ", ".join(f"{name} {t:.2f} s ({n})" for name, (t, n) in top[:4]), flush=True)
        if args.after_float32:
            with tempfile.TemporaryDirectory() as tmp:
                out = subprocess.run([sys.executable, "-c", _AFTER_CHILD], capture_output=True, text=True,
                                     timeout=1800, env=dict(os.environ, NUMBAFA_CACHE="0", NUMBA_CACHE_DIR=tmp))
            if out.returncode:
                raise RuntimeError(out.stderr[-3000:])
            for i, (name, cost) in enumerate(json.loads(out.stdout.strip().splitlines()[-1])):
                what = "cold" if i == 0 else "adds"
                print(f"round {round_ + 1}, one process: {name:26s} {what} {cost['cpu']:5.2f} s CPU "
                      f"({cost['compiles']} compiles)", flush=True)
        if args.nb:
            with tempfile.TemporaryDirectory() as tmp:
                nb_ = _nb_child(dict(os.environ, NUMBAFA_CACHE="0", NUMBA_CACHE_DIR=tmp))
            print(f"round {round_ + 1}, numbafa.nb after float32, cold: plan {nb_['plan']:.2f} s, a user's first "
                  f"njit forward + backward {nb_['step']:.2f} s CPU", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, NUMBAFA_CACHE_DIR=tmp, NUMBA_CACHE_DIR=tmp)
                first, later = (_nb_child(env) for _ in range(2))
            print(f"round {round_ + 1}, numbafa.nb, a user's first njit forward + backward with the disk cache: "
                  f"first process {first['step']:.2f} s CPU, the next {later['step']:.2f} s (its plan "
                  f"{later['plan']:.2f} s)", flush=True)
        if args.ahead:
            for how in (("plain", "ahead") if round_ % 2 == 0 else ("ahead", "plain")):
                r = _ahead_child(how)
                print(f"round {round_ + 1}, a script's cold first calls, {how:5s}: forward {r['forward']:5.1f} s + "
                      f"backward {r['backward']:5.1f} s, the script {r['script']:5.1f} s of wall time "
                      f"({r['cpu']:.1f} s CPU with its second process)", flush=True)


if __name__ == "__main__":
    main()
