"""numbafa against PyTorch's CPU SDPA and the NumPy golden: each in its own process, alternated.

    pip install ".[bench]" torch==2.13.0     # torch is optional; only that CPU wheel
    python bench/compare.py --json bench/results.json --plot docs/performance.png

For every shape (bench/shapes.py), dtype and pass, numbafa and torch each run in a worker
process of their own (``python bench/compare.py --serve NAME``: this file, driven over a pipe),
at the default OpenMP wait policy of each (in one process the two OpenMP runtimes slow each
other, and ``OMP_WAIT_POLICY=PASSIVE`` slows SDPA several times at small shapes). The workers
are warmed up, then asked for one timing each in turn ``--repeats`` times (a pause of
``PAUSE_S`` before each, so that the other's spinning threads have gone to sleep); the table
gives median milliseconds, GFLOP/s (forward 4*B*Hq*S*S*D, halved when causal; backward 2.5x;
bench/shapes.py), that figure over the machine's peak measured in this run (``bench/peak.py``:
float32 FMA for float32; for bf16 AMX's ``tdpbf16ps`` where the CPU has AMX, else ``vdpbf16ps``
where it has AVX512_BF16) and numbafa's speed-up over
torch. PyTorch gets the same values in ``[batch, heads, seq, dim]`` (a transposed copy, made
outside the timing); its backward is timed alone (the forward that builds the graph is not
timed). Shapes with a sliding window or sinks have no SDPA equivalent and are skipped for
torch; shapes whose v has a head dim of its own run on SDPA's math backend (``torch_backend``
in the JSON rows). The golden (float64, materialising) runs once per shape up to
``--golden-max-seqlen``, in numbafa's worker. ``--memory`` adds the peak extra memory of one
float32 backward of each shape (bench/memory.py: a fresh process per measurement).
``--isolated`` starts a fresh worker for every timing and closes it after (:class:`IsolatedWorker`):
at a single tile, a call of tens of microseconds, even an idle worker of the other side
(its thread pools' spinning, on a 2-core machine) moved medians by 20x on Zen 4.

``--passes step`` times a training step: the forward that builds the graph, then the backward
(for numbafa's NumPy API, its forward then its backward). ``--via torch`` times numbafa through
its PyTorch adapter (``numbafa.torch.attention`` on the tensors torch gets, ``"bhsd"``; the
forward under ``no_grad``, the backward and the step through autograd as for SDPA): what a
PyTorch user's training loop pays, the adapter's per-call cost included.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from memory import measure
from peak import peak_gflops
from shapes import HEAD_DIM_SHAPES, SHAPES, TRAINING_SHAPES, flops, make_inputs

#: Seconds between two timings of different workers: a library's idle OpenMP threads spin a
#: little after its last call (libgomp's default spin count is well under a millisecond).
PAUSE_S = 0.05


def _timed(fn):
    """Seconds per call of ``fn``: one call, or the mean of a run of calls lasting >= 20 ms when
    one call is shorter (small shapes: a single call is too short to time on a shared machine).
    The run's length comes from a second call: the first after the pause before each timing
    wakes the side's sleeping threads (on a 2-core VM 2-6 ms for a call of 40 us, torch's as
    numbafa's), which made runs of a few calls whose mean was mostly that wake-up."""
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    if once >= 0.02:
        return once
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    n = max(2, int(0.02 / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


class Numbafa:
    name = "numbafa"

    def __init__(self, q, k, v, dy, kw):
        import numbafa
        self.args, self.dy, self.kw = (q, k, v), dy, dict(kw, mixed_precision=True)
        self.o, self.lse = numbafa.attention_fwd(*self.args, **self.kw)

    def forward(self):
        import numbafa
        return _timed(lambda: numbafa.attention_fwd(*self.args, **self.kw))

    def backward(self):
        import numbafa
        return _timed(lambda: numbafa.attention_bwd(*self.args, self.o, self.dy, self.lse, **self.kw))

    def step(self):
        import numbafa

        def step():
            o, lse = numbafa.attention_fwd(*self.args, **self.kw)
            numbafa.attention_bwd(*self.args, o, self.dy, lse, **self.kw)
        return _timed(step)


class Torch:
    name = "torch"

    def __init__(self, q, k, v, dy, kw):
        import torch
        dtype = torch.bfloat16 if q.dtype == ml_dtypes.bfloat16 else torch.float32

        def t(x):  # Neuron [b, h, d, s] -> SDPA [b, h, s, d], same values
            return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(0, 1, 3, 2))).to(dtype)

        self.q, self.k, self.v, self.dy = t(q), t(k), t(v), t(dy)
        self.causal = kw.get("use_causal_mask", False)
        self.gqa = self.q.shape[1] != self.k.shape[1]
        # Two head dims: SDPA's CPU flash kernel takes one, so its math backend runs them.
        self.backend = "math" if q.shape[2] != v.shape[2] else "default"

    def _sdpa(self, q, k, v):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH) if self.backend == "math" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.gqa)

    def forward(self):
        import torch
        with torch.no_grad():
            return _timed(lambda: self._sdpa(self.q, self.k, self.v))

    def backward(self):
        q, k, v = (x.detach().requires_grad_() for x in (self.q, self.k, self.v))
        out = self._sdpa(q, k, v)

        def backward():  # the graph is kept for repeated calls; the gradients are not summed
            out.backward(self.dy, retain_graph=True)
            q.grad = k.grad = v.grad = None
        return _timed(backward)

    def step(self):
        q, k, v = (x.detach().requires_grad_() for x in (self.q, self.k, self.v))

        def step():
            self._sdpa(q, k, v).backward(self.dy)
            q.grad = k.grad = v.grad = None
        return _timed(step)


class NumbafaTorch(Torch):
    """numbafa through its PyTorch adapter (``--via torch``), on the tensors :class:`Torch` makes."""

    name = "numbafa"

    def __init__(self, q, k, v, dy, kw):
        super().__init__(q, k, v, dy, kw)
        import numbafa.torch as nt
        sinks = kw.get("sinks_ref")
        self.kw = dict(causal=self.causal, window=kw.get("sliding_window"),
                       sinks=None if sinks is None else nt.from_numpy(sinks))
        self.backend = "numbafa.torch"

    def _sdpa(self, q, k, v):
        import numbafa.torch as nt
        return nt.attention(q, k, v, **self.kw)


IMPLS = {"numbafa": Numbafa, "numbafa-torch": NumbafaTorch, "torch": Torch}


def serve(name: str) -> None:
    """A worker: JSON requests on stdin, one JSON reply per line on stdout. ``{"shape": [...],
    "dtype": ...}`` sets up the implementation ``name`` on that shape; ``{"pass": ...}`` times one
    pass (seconds); ``{"golden": pass}`` times the golden (ms, numbafa's worker)."""
    if name in ("torch", "numbafa-torch"):
        import torch
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    impl = inputs = None
    for line in sys.stdin:
        request = json.loads(line)
        if "shape" in request:
            _, bs, h, hkv, s, d, options = request["shape"]
            dtype = ml_dtypes.bfloat16 if request["dtype"] == "bf16" else np.float32
            inputs = make_inputs(bs, h, hkv, s, d, dtype, options)
            impl = IMPLS[name](*inputs)
            reply = {"backend": getattr(impl, "backend", None)}
        elif "pass" in request:
            reply = {"seconds": getattr(impl, request["pass"])()}
        else:
            reply = {"ms": _golden_ms(*inputs, request["golden"])}
        print(json.dumps(reply), flush=True)


class Worker:
    """A worker process (:func:`serve`) for one implementation: ``impl`` (:data:`IMPLS`; default
    ``name``), reported as ``name``."""

    def __init__(self, name: str, impl: str | None = None):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", impl or name], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=os.path.dirname(__file__))

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class IsolatedWorker:
    """A :class:`Worker` whose every timing runs in a process of its own, started for it and
    closed after it (``--isolated``): only one side's process is alive while either is timed, so
    no idle thread pool of the other (OpenMP, OpenBLAS) spins on the cores. Each timing pays a
    start-up and a warm-up call first: for short calls (a single tile), where that matters."""

    def __init__(self, name: str, impl: str | None = None):
        self.name, self.impl = name, impl
        self.shape = None

    def ask(self, **request) -> dict:
        if "shape" in request:
            self.shape = request
        worker = Worker(self.name, self.impl)
        try:
            reply = worker.ask(**self.shape)
            if "shape" in request:
                return reply
            worker.ask(**request)   # warm-up: compile or cache load, allocator, thread pools
            return worker.ask(**request)
        finally:
            worker.close()

    def close(self) -> None:
        pass


def _peaks() -> dict:
    """The machine's peak GFLOP/s for each dtype's arithmetic, measured now (bench/peak.py): for
    bf16 AMX's ``tdpbf16ps`` where the CPU has it (oneDNN runs the bf16 GEMMs there), else
    ``vdpbf16ps`` (``bf16_unit`` says which)."""
    amx = peak_gflops("amx")
    return {"float32": peak_gflops("fma"), "bf16": amx or peak_gflops("bf16"),
            "bf16_unit": "amx" if amx else "vdpbf16ps"}


def run(args):
    rows = []
    pool = SETS[args.set]
    shapes = [s for s in pool if not args.shapes or s[0] in args.shapes]
    missing = set(args.shapes or ()) - {s[0] for s in shapes}
    if missing:
        raise SystemExit(f"--shapes {' '.join(sorted(missing))}: not in --set {args.set} "
                         f"(its shapes: {', '.join(s[0] for s in pool)}); --set all takes every shape")
    with_torch = not args.no_torch and importlib.util.find_spec("torch") is not None
    worker = IsolatedWorker if args.isolated else Worker
    if args.via == "torch" and not with_torch:
        raise SystemExit("--via torch needs torch (pip install torch==2.13.0)")
    workers = [worker("numbafa", "numbafa-torch" if args.via == "torch" else None)] + (
        [worker("torch")] if with_torch else [])
    peaks = None
    try:
        for shape in shapes:
            name, bs, h, hkv, s, d, options = shape
            for dtype_name in args.dtypes:
                impls = [w for w in workers if w.name == "numbafa" or not (options.get("sliding_window")
                                                                            or options.get("sinks"))]
                backends = {w.name: w.ask(shape=shape, dtype=dtype_name)["backend"] for w in impls}
                if peaks is None:   # once the workers are up (their start-up would take cores)
                    peaks = _peaks()
                for pass_ in args.passes:
                    rows.append(_measure(args, impls, shape, dtype_name, pass_, backends, peaks))
                    _print_row(rows[-1])
    finally:
        for worker in workers:
            worker.close()
    return rows, peaks


def _measure(args, impls, shape, dtype_name, pass_, backends, peaks) -> dict:
    """One row: each worker warmed up, then timed in turn ``args.repeats`` times."""
    name, bs, h, hkv, s, d, options = shape
    n_flops = flops(pass_, bs, h, s, d, options)
    times = {w.name: [] for w in impls}
    for w in impls:   # warm-up (compile, allocator, thread pools)
        w.ask(**{"pass": pass_})
    for _ in range(args.repeats):   # alternate, so drift hits everyone alike
        for w in impls:
            time.sleep(PAUSE_S)
            times[w.name].append(w.ask(**{"pass": pass_})["seconds"])
    row = dict(shape=name, dtype=dtype_name, pass_=pass_, flops=n_flops)
    peak = peaks.get(dtype_name)
    for impl_name, ts in times.items():
        row[f"{impl_name}_ms"] = float(np.median(ts)) * 1e3
        row[f"{impl_name}_gflops"] = n_flops / float(np.median(ts)) / 1e9
        if peak:
            row[f"{impl_name}_of_peak"] = row[f"{impl_name}_gflops"] / peak
    if "torch_ms" in row:
        row["speedup_vs_torch"] = row["torch_ms"] / row["numbafa_ms"]
        row["torch_backend"] = backends["torch"]
    if backends["numbafa"]:
        row["numbafa_via"] = backends["numbafa"]
    if args.memory and pass_ == "backward" and dtype_name == "float32" and bs == 1:
        row.update(_peak_memory(backends, h, hkv, s, d, options))
    if s <= args.golden_max_seqlen and dtype_name == "float32" and pass_ != "step":
        row["golden_ms"] = impls[0].ask(golden=pass_)["ms"]
        row["speedup_vs_golden"] = row["golden_ms"] / row["numbafa_ms"]
    return row


def _peak_memory(backends, h, hkv, s, d, options):
    """``{impl}_peak_mib``: peak extra memory of one float32 backward (bench/memory.py)."""
    spec = dict(heads=h, kv_heads=hkv, d_head_v=options.get("head_dim_v"), causal=options.get("use_causal_mask", False))
    return {f"{name}_peak_mib": measure(name, s, d, math=backend == "math", **spec) / 2.0 ** 20
            for name, backend in backends.items()}


def _golden_ms(q, k, v, dy, kw, pass_):
    from numbafa import golden
    gkw = dict(use_causal_mask=kw.get("use_causal_mask", False), sliding_window=kw.get("sliding_window"))
    sinks = kw.get("sinks_ref")
    if pass_ == "forward":
        return _timed(lambda: golden.attention_fwd(q, k, v, sinks=sinks, **gkw)) * 1e3
    return _timed(lambda: golden.attention_bwd(q, k, v, None, dy, None, sinks_ref=sinks, **gkw)) * 1e3


HEADER = (f"| {'shape':42} | dtype | pass | numbafa ms | GFLOP/s | of peak | torch ms | GFLOP/s | of peak "
          f"| speed-up vs torch | golden ms |")


SETS = {"standard": SHAPES, "training": TRAINING_SHAPES, "head-dims": HEAD_DIM_SHAPES,
        "all": SHAPES + TRAINING_SHAPES + HEAD_DIM_SHAPES}


def _print_row(r):
    if _print_row.first:
        print(HEADER)
        print("|" + "---|" * 11)
        _print_row.first = False

    def f(key, fmt):
        if key not in r:
            return "-"
        if fmt == "ms":   # 3 significant digits below 100 ms (small shapes), whole ms above
            return format(r[key], ".3g" if r[key] < 100 else ".0f")
        return format(r[key], fmt)

    memory = f" peak MiB: numbafa {f('numbafa_peak_mib', '.0f')}, torch {f('torch_peak_mib', '.0f')}" \
        if "numbafa_peak_mib" in r else ""
    print(f"| {r['shape']:42} | {r['dtype']} | {r['pass_']} | {f('numbafa_ms', 'ms')} | "
          f"{f('numbafa_gflops', '.0f')} | {f('numbafa_of_peak', '.0%')} | {f('torch_ms', 'ms')} | "
          f"{f('torch_gflops', '.0f')} | {f('torch_of_peak', '.0%')} | {f('speedup_vs_torch', '.2f')} | "
          f"{f('golden_ms', 'ms')} |{memory}", flush=True)


_print_row.first = True


def footer(cpu: str, peaks: dict | None) -> str:
    """The line under the table: the CPU and the peaks its "of peak" columns divide by."""
    if not peaks:
        return f"CPU: {cpu}; no row measured"
    bf16 = f"{peaks['bf16']:.0f} GFLOP/s ({peaks['bf16_unit']})" if peaks.get("bf16") else "no bf16 unit"
    return f"CPU: {cpu}; peak measured in this run: float32 FMA {peaks['float32']:.0f} GFLOP/s, bf16 {bf16}"


def plot(rows, path, torch_version):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plot")
        return
    import numbafa
    labels = [f"{r['shape']}\n{r['dtype']} {r['pass_'][:3]}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 5))
    ax.bar(x - 0.2, [r["numbafa_gflops"] for r in rows], 0.4, label="numbafa")
    ax.bar(x + 0.2, [r.get("torch_gflops", 0) for r in rows], 0.4, label="torch SDPA (CPU)")
    ax.set_xticks(x, labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s (flash-attn convention)")
    ax.set_title(f"numbafa {numbafa.__version__} vs torch {torch_version or '-'} "
                 f"on {platform.processor() or platform.machine()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def _torch_version():
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    from importlib.metadata import version
    return version("torch")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", choices=list(IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--set", choices=list(SETS), default="standard",
                   help="bench/shapes.py's SHAPES (long sequences), TRAINING_SHAPES, HEAD_DIM_SHAPES (a value "
                        "head dim of its own), or all")
    p.add_argument("--shapes", nargs="*",
                   help=f"subset of: {', '.join(s[0] for s in SETS['all'])}")
    p.add_argument("--memory", action="store_true",
                   help="also the peak extra memory of one float32 backward per shape (batch 1; a process each)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"])
    p.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward", "step"],
                   help="step: a training step, the forward with its graph then the backward")
    p.add_argument("--via", choices=["numpy", "torch"], default="numpy",
                   help="numbafa through its NumPy API (default) or its PyTorch adapter, numbafa.torch")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isolated", action="store_true",
                   help="a fresh process per timing, the other side's closed meanwhile (single tiles)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--golden-max-seqlen", type=int, default=2048)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    rows, peaks = run(args)
    import numbafa
    print(footer(numbafa.backend_info()["cpu_model"], peaks))
    meta = dict(numbafa=numbafa.__version__, torch=_torch_version(), machine=platform.machine(),
                processor=platform.processor(), python=platform.python_version(), cpu_count=os.cpu_count(),
                backend=numbafa.backend_info(), peak_gflops=peaks,
                processes="one per timing" if args.isolated else "one per implementation", via=args.via)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=2)
    if args.plot:
        plot(rows, args.plot, meta["torch"])


if __name__ == "__main__":
    main()
