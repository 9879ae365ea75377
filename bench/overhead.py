"""The fixed cost of one call: the Python API's time beyond its kernel, at small shapes.

    python bench/overhead.py [--shape B H S D] [--rounds 15]

For one shape (default B1 H1 S128 D64, causal, float32) it times, alternating
in rounds (medians of each round's mean over a run of calls of >= 20 ms):

* ``kernel``: the same call from ``@njit`` code, ``numbafa.nb.attention_fwd`` /
  ``attention_bwd`` in a jitted loop: the compiled entry (value and range
  checks, launch, output checks) and nb's own checks, no Python; run inside
  ``single_threaded_blas()``, so each pass's own BLAS pin only counts;
* ``nb``: the same loops without that outer pin, as a user's njit loop runs
  them by default: each pass takes and gives back the BLAS pin;
* ``pin+unpin``: the BLAS pin entered and left from Python (no kernel);
* ``numbafa``: ``numbafa.attention_fwd`` / ``attention_bwd`` (validation,
  plan, BLAS pin, allocation, launch, conversion);
* ``numbafa.torch``: the custom operator's forward (no grad) and a whole
  forward + backward through autograd, if torch is installed.

* ``python``: ``numbafa.attention_fwd`` / ``attention_bwd`` with the compiled
  entry replaced by nothing: all the Python work of a call (validation, plan,
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
from ab import loops
from numbafa import nb
from numbafa.platform.blas import pin, single_threaded_blas, unpin


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


_nb_fwd_loop, _nb_bwd_loop = loops(nb)   # @njit loops of n calls of nb's passes


def _timed_loop(loop, *args) -> float:
    """Seconds per call of an njit loop of ``n`` calls, ``n`` doubled until the loop lasts >= 20 ms."""
    loop(1, *args)
    n = 1
    while True:
        t0 = time.perf_counter()
        loop(n, *args)
        elapsed = time.perf_counter() - t0
        if elapsed >= 0.02:
            return elapsed / n
        n *= 2


def _kernels(q, k, v, dy, causal):
    """The same calls from ``@njit`` code (numbafa.nb: the compiled entries, their checks and
    launch, none of the Python API's work), as callables of one run of calls each."""
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=causal)
    plan = nb.plan(q, k, v, use_causal_mask=causal)
    o_nb, lse_nb = np.empty_like(o), np.empty_like(lse)
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    return ((lambda: _timed_loop(_nb_fwd_loop, plan, q, k, v, o_nb, lse_nb)),
            (lambda: _timed_loop(_nb_bwd_loop, plan, q, k, v, o, dy, lse, *grads)), o, lse)


def _without_kernel(fn):
    """``fn`` with the compiled entries replaced by nothing: the full path's
    :func:`numbafa.pipeline.core.call_entry`, and the entry a remembered call passes to
    :func:`numbafa.kernels.launch.call_prepared` (whose BLAS pin stays in the Python work)."""
    from numbafa.kernels import launch
    from numbafa.pipeline import core

    def nothing(*args, **kwargs):
        return 0

    def prepared(call, args):
        return launch.call_prepared(nothing, args)

    def call():
        real = core.call_entry, core.call_prepared
        core.call_entry, core.call_prepared = nothing, prepared
        try:
            fn()
        finally:
            core.call_entry, core.call_prepared = real
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
    calls = {"kernel fwd": fwd_kernel, "kernel bwd": bwd_kernel, "nb fwd": fwd_kernel, "nb bwd": bwd_kernel,
             "numbafa fwd": api_fwd, "numbafa bwd": api_bwd,
             "python fwd": _without_kernel(api_fwd), "python bwd": _without_kernel(api_bwd),
             "pin+unpin": lambda: (pin(), unpin())}
    if t_fwd is not None:
        calls.update({"numbafa.torch fwd": t_fwd, "numbafa.torch fwd+bwd": t_train})
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            if name.startswith("kernel"):
                with single_threaded_blas():
                    times[name].append(fn())
            elif name.startswith("nb "):
                times[name].append(fn())
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
