"""The overhead of numbafa.torch: its backward against numbafa called directly, and against SDPA's.

    pip install ".[bench,torch]"     # here: torch==2.13.0, the CPU wheel
    python bench/torch_adapter.py --json bench/results_torch_adapter.json

For every shape of bench/shapes.py (float32 by default), three backward
passes on the same values, run alternately ``--repeats`` times after a
warm-up, medians reported:

* ``numbafa``: :func:`numbafa.attention_bwd` on NumPy views of the tensors'
  memory in the Neuron layout (exactly the arrays the operator hands to the
  kernel), outputs converted to the inputs' dtype as the API does;
* ``op``: ``torch.autograd.grad`` through ``numbafa.torch.attention``
  (layout ``"bhsd"``): the custom operator's backward, the permutes and the
  autograd engine; the graph is built once, outside the timing
  (``retain_graph=True``);
* ``sdpa``: ``torch.autograd.grad`` through
  ``torch.nn.functional.scaled_dot_product_attention`` (is_causal,
  enable_gqa); shapes with a window or sinks have no SDPA equivalent and are
  skipped for it.

``overhead`` is ``op / numbafa - 1`` (the target is within 5 %). The
forward is timed the same way with ``--passes forward backward``.
"""

from __future__ import annotations

import os

# As in compare.py: torch's OpenMP threads would spin after each op and take the
# cores from the numbafa call that follows.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import numbafa  # noqa: E402
import numbafa.torch as nt  # noqa: E402
from numbafa.layout import to_neuron  # noqa: E402

from shapes import SHAPES, forward_flops, make_inputs  # noqa: E402


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Case:
    """One shape: SDPA-layout leaf tensors and the three implementations."""

    def __init__(self, bs, h, hkv, s, d, options, dtype):
        qn, kn, vn, dyn, kw = make_inputs(bs, h, hkv, s, d, np.float32, options)
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32

        def bhsd(x):  # Neuron [b, h, d, s] -> a contiguous [b, h, s, d] tensor
            return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 1, 3, 2))).to(tdtype)

        self.q, self.k, self.v, self.do = (bhsd(x) for x in (qn, kn, vn, dyn))
        self.causal = bool(kw.get("use_causal_mask"))
        self.window = kw.get("sliding_window")
        self.sinks = None if "sinks_ref" not in kw else torch.from_numpy(kw["sinks_ref"])
        self.sdpa_ok = self.window is None and self.sinks is None
        # numbafa direct: the arrays the operator passes to the kernels.
        self.np_args = [to_neuron(nt.to_numpy(x), "bhsd") for x in (self.q, self.k, self.v)]
        self.np_kw = dict(sinks_ref=None if self.sinks is None else self.sinks.numpy(), use_causal_mask=self.causal,
                          sliding_window=self.window, mixed_precision=True)
        self.np_do = to_neuron(nt.to_numpy(self.do), "bhsd")
        self.np_o, self.np_lse = numbafa.attention_fwd(*self.np_args, lse_layout="natural", **self.np_kw)
        # The operator's graph, built once.
        leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
        if self.sinks is not None:
            leaves.append(self.sinks.detach().requires_grad_())
        self.op_leaves = leaves
        self.op_out = self._op(*leaves)
        if self.sdpa_ok:
            self.sdpa_leaves = [x.detach().requires_grad_() for x in (self.q, self.k, self.v)]
            self.sdpa_out = self._sdpa(*self.sdpa_leaves)

    def _op(self, q, k, v, sinks=None):
        return nt.attention(q, k, v, causal=self.causal, window=self.window, sinks=sinks)

    def _sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=q.shape[1] != k.shape[1])

    def run(self, impl, pass_):
        if pass_ == "forward":
            with torch.no_grad():
                if impl == "numbafa":
                    return _timed(lambda: numbafa.attention_fwd(*self.np_args, lse_layout="natural", **self.np_kw))
                if impl == "op":
                    return _timed(lambda: self._op(self.q, self.k, self.v, self.sinks))
                return _timed(lambda: self._sdpa(self.q, self.k, self.v))
        if impl == "numbafa":
            return _timed(lambda: numbafa.attention_bwd(*self.np_args, self.np_o, self.np_do, self.np_lse,
                                                        **self.np_kw))
        if impl == "op":
            return _timed(lambda: torch.autograd.grad(self.op_out, self.op_leaves, self.do, retain_graph=True))
        return _timed(lambda: torch.autograd.grad(self.sdpa_out, self.sdpa_leaves, self.do, retain_graph=True))


def fixed_cost(repeats):
    """Median microseconds per call of each implementation on a tiny problem (1 head, 128 x 64).

    There the kernel takes little time, so the difference op - numbafa is
    the adapter's own cost per call (checks, permutes, the NumPy views, the
    autograd engine), which the large shapes cannot resolve under noise.
    """
    case = Case(1, 1, 1, 128, 64, dict(use_causal_mask=True), "float32")
    out = {}
    for pass_ in ("forward", "backward"):
        for impl in ("numbafa", "op", "sdpa"):
            case.run(impl, pass_)
        times = {impl: [] for impl in ("numbafa", "op", "sdpa")}
        for _ in range(repeats):
            for impl in times:
                times[impl].append(case.run(impl, pass_))
        out[pass_] = {impl: float(np.median(ts)) * 1e6 for impl, ts in times.items()}
    return out


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="*", help=f"subset of: {', '.join(s[0] for s in SHAPES)}")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bf16"])
    p.add_argument("--passes", nargs="+", default=["backward"], choices=["forward", "backward"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--fixed-cost-repeats", type=int, default=300,
                   help="calls of the tiny problem that measures the per-call cost (0: skip)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, numbafa "
          f"{numbafa.__version__}; median of {args.repeats} alternating runs")
    print("| shape | dtype | pass | numbafa ms | op ms | overhead | SDPA ms | op GFLOP/s | op vs SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, bs, h, hkv, s, d, options in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        for dtype in args.dtypes:
            case = Case(bs, h, hkv, s, d, options, dtype)
            impls = ["numbafa", "op"] + (["sdpa"] if case.sdpa_ok else [])
            for pass_ in args.passes:
                for impl in impls:  # warm-up: kernel load, allocator, thread pools
                    case.run(impl, pass_)
                times = {impl: [] for impl in impls}
                for _ in range(args.repeats):
                    for impl in impls:
                        times[impl].append(case.run(impl, pass_))
                med = {impl: float(np.median(ts)) * 1e3 for impl, ts in times.items()}
                flops = forward_flops(bs, h, s, d, options) * (2.5 if pass_ == "backward" else 1.0)
                row = dict(shape=name, dtype=dtype, pass_=pass_, **{f"{k}_ms": v for k, v in med.items()},
                           overhead=med["op"] / med["numbafa"] - 1.0, op_gflops=flops / med["op"] / 1e6,
                           times_ms={k: [t * 1e3 for t in v] for k, v in times.items()})
                sdpa = f"{med['sdpa']:.0f}" if "sdpa" in med else "-"
                ratio = f"{med['sdpa'] / med['op']:.2f}x" if "sdpa" in med else "-"
                print(f"| {name} | {dtype} | {pass_} | {med['numbafa']:.0f} | {med['op']:.0f} | "
                      f"{row['overhead']:+.1%} | {sdpa} | {row['op_gflops']:.0f} | {ratio} |", flush=True)
                rows.append(row)
    fixed = fixed_cost(args.fixed_cost_repeats) if args.fixed_cost_repeats else {}
    for pass_, med in fixed.items():
        print(f"per-call cost, {pass_} of 1 head x 128 x 64 (median of {args.fixed_cost_repeats}): numbafa "
              f"{med['numbafa']:.0f} us, op {med['op']:.0f} us (+{med['op'] - med['numbafa']:.0f} us), "
              f"SDPA {med['sdpa']:.0f} us")
    if args.json:
        meta = dict(cpu=cpu_name(), cpu_count=os.cpu_count(), torch=torch.__version__, numbafa=numbafa.__version__,
                    backend=numbafa.backend_info(), repeats=args.repeats)
        with open(args.json, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, fixed_cost_us=fixed), fh, indent=2)


if __name__ == "__main__":
    main()
