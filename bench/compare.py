"""numbafa against PyTorch's CPU SDPA and the NumPy golden, side by side in one process.

    pip install ".[bench]" torch==2.13.0     # torch is optional; only that CPU wheel
    python bench/compare.py --json bench/results.json --plot docs/performance.png

For every shape (bench/shapes.py), dtype and pass, the implementations are
warmed up, then run alternately ``--repeats`` times; the table gives median
milliseconds, GFLOP/s (forward 4*B*Hq*S*S*D, halved when causal; backward
2.5x; bench/shapes.py) and numbafa's speed-up over torch. PyTorch gets the same values in
``[batch, heads, seq, dim]`` (a transposed copy, made outside the timing);
its backward is timed alone (the forward that builds the graph is not timed).
Shapes with a sliding window or sinks have no SDPA equivalent and are
skipped for torch; shapes whose v has a head dim of its own run on SDPA's
math backend (``torch_backend`` in the JSON rows). The golden (float64,
materialising) runs once per shape up to ``--golden-max-seqlen``.
``--memory`` adds the peak extra memory of one float32 backward of each shape
(bench/memory.py: a fresh process per measurement).
"""

from __future__ import annotations

import os

# Both libraries park idle worker threads; with the default OpenMP wait policy
# torch's threads spin for a while after each call and steal the cores from
# the next numbafa call (and vice versa), which skews an alternating run.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import numbafa  # noqa: E402
from numbafa import golden  # noqa: E402

from memory import measure  # noqa: E402
from shapes import HEAD_DIM_SHAPES, SHAPES, TRAINING_SHAPES, flops, make_inputs  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # optional peer
    torch = None


def _timed(fn):
    """Seconds per call of ``fn``: one call, or the mean of a run of calls lasting >= 20 ms when
    one call is shorter (small shapes: a single call is too short to time on a shared machine)."""
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    if once >= 0.02:
        return once
    n = max(2, int(0.02 / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


class Numbafa:
    name = "numbafa"

    def __init__(self, q, k, v, dy, kw):
        self.args, self.dy, self.kw = (q, k, v), dy, dict(kw, mixed_precision=True)
        self.o, self.lse = numbafa.attention_fwd(*self.args, **self.kw)

    def forward(self):
        return _timed(lambda: numbafa.attention_fwd(*self.args, **self.kw))

    def backward(self):
        return _timed(lambda: numbafa.attention_bwd(*self.args, self.o, self.dy, self.lse, **self.kw))


class Torch:
    name = "torch"

    def __init__(self, q, k, v, dy, kw):
        dtype = torch.bfloat16 if q.dtype == ml_dtypes.bfloat16 else torch.float32

        def t(x):  # Neuron [b, h, d, s] -> SDPA [b, h, s, d], same values
            return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32).transpose(0, 1, 3, 2))).to(dtype)

        self.q, self.k, self.v, self.dy = t(q), t(k), t(v), t(dy)
        self.causal = kw.get("use_causal_mask", False)
        self.gqa = self.q.shape[1] != self.k.shape[1]
        # Two head dims: SDPA's CPU flash kernel takes one, so its math backend runs them.
        self.backend = "math" if q.shape[2] != v.shape[2] else "default"

    def _sdpa(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH) if self.backend == "math" else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.gqa)

    def forward(self):
        with torch.no_grad():
            return _timed(lambda: self._sdpa(self.q, self.k, self.v))

    def backward(self):
        q, k, v = (x.detach().requires_grad_() for x in (self.q, self.k, self.v))
        out = self._sdpa(q, k, v)

        def backward():  # the graph is kept for repeated calls; the gradients are not summed
            out.backward(self.dy, retain_graph=True)
            q.grad = k.grad = v.grad = None
        return _timed(backward)


def run(args):
    rows = []
    pool = SETS[args.set]
    shapes = [s for s in pool if not args.shapes or s[0] in args.shapes]
    missing = set(args.shapes or ()) - {s[0] for s in shapes}
    if missing:
        raise SystemExit(f"--shapes {' '.join(sorted(missing))}: not in --set {args.set} "
                         f"(its shapes: {', '.join(s[0] for s in pool)}); --set all takes every shape")
    for name, bs, h, hkv, s, d, options in shapes:
        for dtype_name in args.dtypes:
            dtype = ml_dtypes.bfloat16 if dtype_name == "bf16" else np.float32
            q, k, v, dy, kw = make_inputs(bs, h, hkv, s, d, dtype, options)
            impls = [Numbafa(q, k, v, dy, kw)]
            if torch is not None and not args.no_torch and not (kw.get("sliding_window") or "sinks_ref" in kw):
                impls.append(Torch(q, k, v, dy, kw))
            for pass_ in args.passes:
                n_flops = flops(pass_, bs, h, s, d, options)
                times = {impl.name: [] for impl in impls}
                for impl in impls:  # warm-up (compile, allocator, thread pools)
                    getattr(impl, pass_)()
                for _ in range(args.repeats):  # alternate, so drift hits everyone alike
                    for impl in impls:
                        times[impl.name].append(getattr(impl, pass_)())
                row = dict(shape=name, dtype=dtype_name, pass_=pass_, flops=n_flops)
                for impl_name, ts in times.items():
                    row[f"{impl_name}_ms"] = float(np.median(ts)) * 1e3
                    row[f"{impl_name}_gflops"] = n_flops / float(np.median(ts)) / 1e9
                if "torch_ms" in row:
                    row["speedup_vs_torch"] = row["torch_ms"] / row["numbafa_ms"]
                    row["torch_backend"] = impls[1].backend
                if args.memory and pass_ == "backward" and dtype_name == "float32" and bs == 1:
                    row.update(_peak_memory(impls, h, hkv, s, d, options))
                if s <= args.golden_max_seqlen and dtype_name == "float32":
                    row["golden_ms"] = _golden_ms(q, k, v, dy, kw, pass_)
                    row["speedup_vs_golden"] = row["golden_ms"] / row["numbafa_ms"]
                rows.append(row)
                _print_row(row)
    return rows


def _peak_memory(impls, h, hkv, s, d, options):
    """``{impl}_peak_mib``: peak extra memory of one float32 backward (bench/memory.py)."""
    spec = dict(heads=h, kv_heads=hkv, d_head_v=options.get("head_dim_v"), causal=options.get("use_causal_mask", False))
    return {f"{impl.name}_peak_mib": measure(impl.name, s, d, math=getattr(impl, "backend", "") == "math", **spec)
            / 2.0 ** 20 for impl in impls}


def _golden_ms(q, k, v, dy, kw, pass_):
    gkw = dict(use_causal_mask=kw.get("use_causal_mask", False), sliding_window=kw.get("sliding_window"))
    sinks = kw.get("sinks_ref")
    if pass_ == "forward":
        return _timed(lambda: golden.attention_fwd(q, k, v, sinks=sinks, **gkw)) * 1e3
    return _timed(lambda: golden.attention_bwd(q, k, v, None, dy, None, sinks_ref=sinks, **gkw)) * 1e3


HEADER = (f"| {'shape':42} | dtype | pass | numbafa ms | GFLOP/s | torch ms | GFLOP/s | speed-up vs torch "
          f"| golden ms |")


SETS = {"standard": SHAPES, "training": TRAINING_SHAPES, "head-dims": HEAD_DIM_SHAPES,
        "all": SHAPES + TRAINING_SHAPES + HEAD_DIM_SHAPES}


def _print_row(r):
    if _print_row.first:
        print(HEADER)
        print("|" + "---|" * 9)
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
          f"{f('numbafa_gflops', '.0f')} | {f('torch_ms', 'ms')} | {f('torch_gflops', '.0f')} | "
          f"{f('speedup_vs_torch', '.2f')} | {f('golden_ms', 'ms')} |{memory}", flush=True)


_print_row.first = True


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plot")
        return
    labels = [f"{r['shape']}\n{r['dtype']} {r['pass_'][:3]}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(rows)), 5))
    ax.bar(x - 0.2, [r["numbafa_gflops"] for r in rows], 0.4, label="numbafa")
    ax.bar(x + 0.2, [r.get("torch_gflops", 0) for r in rows], 0.4, label="torch SDPA (CPU)")
    ax.set_xticks(x, labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("GFLOP/s (flash-attn convention)")
    ax.set_title(f"numbafa {numbafa.__version__} vs torch {torch.__version__ if torch else '-'} "
                 f"on {platform.processor() or platform.machine()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=list(SETS), default="standard",
                   help="bench/shapes.py's SHAPES (long sequences), TRAINING_SHAPES, HEAD_DIM_SHAPES (a value "
                        "head dim of its own), or all")
    p.add_argument("--shapes", nargs="*",
                   help=f"subset of: {', '.join(s[0] for s in SETS['all'])}")
    p.add_argument("--memory", action="store_true",
                   help="also the peak extra memory of one float32 backward per shape (batch 1; a process each)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bf16"], choices=["float32", "bf16"])
    p.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--golden-max-seqlen", type=int, default=2048)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    args = p.parse_args(argv)
    if torch is not None:
        torch.set_num_threads(os.cpu_count())
    rows = run(args)
    meta = dict(numbafa=numbafa.__version__, torch=torch.__version__ if torch else None,
                machine=platform.machine(), processor=platform.processor(), python=platform.python_version(),
                cpu_count=os.cpu_count(), backend=numbafa.backend_info())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=2)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
