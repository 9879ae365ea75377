"""The fixed cost of one call: the Python API's time beyond its kernel, at small shapes.

    python bench/overhead.py [--shape B H S D] [--rounds 15]

For one shape (default B1 H1 S128 D64, causal, float32) it times, alternating
in rounds (medians of each round's mean over a run of calls of >= 20 ms):

* ``kernel``: the launcher alone on prebuilt bundles, from ``@njit`` code
  (:mod:`numbafa.nb` adds its own checks: this is the kernel and its launch);
* ``numbafa``: ``numbafa.attention_fwd`` / ``attention_bwd`` (validation,
  plan, BLAS pin, allocation, launch, conversion);
* ``numbafa.torch``: the custom operator's forward (no grad) and a whole
  forward + backward through autograd, if torch is installed.

* ``python``: ``numbafa.attention_fwd`` / ``attention_bwd`` with the launch
  replaced by nothing: all the Python work of a call (validation, plan,
  BLAS pin, allocation, conversion) without the kernel.

The fixed cost is ``numbafa - kernel``, each pass; BLAS stays pinned around
the kernel-only calls, as the API pins it. It is larger than ``python``: a
kernel entered after some Python work finds the threading layer's workers
asleep and its caches colder than one entered back to back (on a 2-core Zen 3,
20 us of other work between two launches adds about 30 us to the second).
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

import numbafa
from numbafa.kernels import launch
from numbafa.blas import single_threaded_blas
from numbafa.kernels.backward import bwd_work_item, flash_attn_bwd, new_bwd_stats
from numbafa.kernels.bundles import BwdEntries, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, make_plan
from numbafa.kernels.forward import flash_attn_fwd, fwd_work_item
from numbafa.kernels.launch import work_item_address
from numbafa.options import AttentionOptions
from numbafa.validation import validate_bwd_inputs


@numba.njit
def _fwd_kernel(ins, outs, plan, item, items):
    flash_attn_fwd(ins, outs, plan, item, items)


@numba.njit
def _bwd_kernel(ins, outs, stats, plan, entries, items, units):
    flash_attn_bwd(ins, outs, stats, plan, entries, items, units)


def _per_call(fn) -> float:
    """Seconds per call: the mean over a run of calls lasting >= 20 ms."""
    fn()
    n, elapsed = 1, 0.0
    while elapsed < 0.02:
        n *= 2
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
    return elapsed / n


def _kernels(q, k, v, dy, causal):
    """Launcher-only callables of both passes, on bundles built once."""
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=causal, lse_layout="natural")
    prob = validate_bwd_inputs(q, k, v, o, dy, lse, AttentionOptions(use_causal_mask=causal))
    fplan, bplan = make_plan(prob, backward=False), make_plan(prob, backward=True)
    fins = FwdInputs(prob.q, prob.k, prob.v, prob.sinks)
    fouts = FwdOutputs(np.empty(q.shape, np.float32), np.empty(lse.shape, np.float32))
    fitem = work_item_address(fwd_work_item, (fins, fouts, fplan))
    fitems = np.arange(q.shape[0] * k.shape[1] * fplan.tiling.q_chunks)
    bins = BwdInputs(prob.q, prob.k, prob.v, prob.o, prob.dy, prob.lse, prob.sinks)
    d, sk = q.shape[2], k.shape[3]
    part = (1, 1, d, 0)
    bouts = BwdOutputs(np.empty(q.shape, np.float32), np.empty(k.shape, np.float32),
                       np.empty(k.shape, np.float32), np.empty(prob.sinks.shape, np.float32),
                       np.empty(part, np.float32), np.empty(part, np.float32))
    stats = new_bwd_stats(bins)
    assert bplan.tiling.q_chunks == 1 and prob.sinks.shape[2] == 0, "choose a shape without a finish"
    entries = BwdEntries(work_item_address(bwd_work_item, (bins, bouts, stats, bplan)), 0)
    bitems, units = np.arange(q.shape[0] * k.shape[1]), np.arange(0)
    return ((lambda: _fwd_kernel(fins, fouts, fplan, fitem, fitems)),
            (lambda: _bwd_kernel(bins, bouts, stats, bplan, entries, bitems, units)), o, lse)


def _without_kernel(fn):
    """``fn`` with the launchers replaced by nothing (:func:`numbafa.kernels.launch._launch`)."""
    def call():
        real = launch._launch
        launch._launch = lambda *args, **kwargs: None
        try:
            fn()
        finally:
            launch._launch = real
    return call


def _torch(q, k, v, dy, causal):
    try:
        import torch
        import numbafa.torch as nt
    except ImportError:
        return None, None
    t = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 1, 3, 2))) for x in (q, k, v, dy)]

    def forward():
        with torch.no_grad():
            nt.attention(t[0], t[1], t[2], causal=causal)

    leaves = [x.detach().requires_grad_() for x in t[:3]]

    def train():
        nt.attention(*leaves, causal=causal).backward(t[3])
        for x in leaves:
            x.grad = None
    return forward, train


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs=4, type=int, default=[1, 1, 128, 64], metavar=("B", "H", "S", "D"))
    p.add_argument("--full", action="store_true", help="no causal mask")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    b, h, s, d = args.shape
    causal = not args.full
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((b, h, d, s), dtype=np.float32) for _ in range(4))
    fwd_kernel, bwd_kernel, o, lse = _kernels(q, k, v, dy, causal)
    t_fwd, t_train = _torch(q, k, v, dy, causal)
    api_fwd = lambda: numbafa.attention_fwd(q, k, v, use_causal_mask=causal)  # noqa: E731
    api_bwd = lambda: numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal)  # noqa: E731
    calls = {"kernel fwd": fwd_kernel, "kernel bwd": bwd_kernel, "numbafa fwd": api_fwd, "numbafa bwd": api_bwd,
             "python fwd": _without_kernel(api_fwd), "python bwd": _without_kernel(api_bwd)}
    if t_fwd is not None:
        calls.update({"numbafa.torch fwd": t_fwd, "numbafa.torch fwd+bwd": t_train})
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            if name.startswith("kernel"):
                with single_threaded_blas():
                    times[name].append(_per_call(fn))
            else:
                times[name].append(_per_call(fn))
    med = {name: float(np.median(ts)) * 1e6 for name, ts in times.items()}
    print(f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}, float32, {numba.get_num_threads()} threads, "
          f"{numbafa.backend_info()['cpu_model']}; medians of {args.rounds} alternating rounds, us per call")
    for name, us in med.items():
        print(f"  {name:24s} {us:9.1f}")
    for pass_ in ("fwd", "bwd"):
        print(f"  fixed cost, {pass_}: {med[f'numbafa {pass_}'] - med[f'kernel {pass_}']:.1f} us "
              f"(its Python work: {med[f'python {pass_}']:.1f} us)")
    if t_fwd is not None:
        print(f"  torch adapter, fwd: {med['numbafa.torch fwd'] - med['numbafa fwd']:.1f} us beyond numbafa fwd")


if __name__ == "__main__":
    main()
