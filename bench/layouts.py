"""numbafa.attention in the caller's layout against the Neuron-layout calls, side by side.

    python bench/layouts.py [--shape B H S D] [--layout bshd] [--seconds 3]

For one shape (default B8 H4 S256 D32, causal, float32) it times three pairs of calls:

* ``fwd``: ``numbafa.attention_fwd`` on C-contiguous Neuron-layout arrays (lse ``natural``)
  against the same call on views of C-contiguous arrays in ``--layout`` (the kernels read and
  write that layout in place);
* ``bwd``: ``numbafa.attention_bwd`` likewise;
* ``train``: forward then backward on the Neuron-layout arrays against
  ``numbafa.attention(..., layout=...)`` then ``ctx.backward(do)`` (what a training loop in that
  layout runs: the kernels plus the context's fingerprints).

The two calls of a pair alternate call by call (their order swapped every other time) for
``--seconds``; it prints each side's median time and the median of the per-pair ratios
``<layout> / neuron`` with their quartiles. Pairing call by call keeps a shared machine's slow
and fast periods out of the ratio (0.3 s blocks of calls, alternated, gave ratios 1.03-1.21 for
the training step in eight runs of one commit, Zen 4).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import numbafa
from numbafa.layout import to_neuron


def paired(neuron, other, seconds: float, pairs: int = 10) -> tuple:
    """Per-call times (s) of ``neuron`` and ``other``, called alternately (order swapped every
    other pair) for about ``seconds`` and at least ``pairs`` pairs, after one call of each."""
    neuron()
    other()
    t_n, t_o = [], []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(t_n) < pairs:
        order = ((neuron, t_n), (other, t_o)) if len(t_n) % 2 == 0 else ((other, t_o), (neuron, t_n))
        for call, out in order:
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
    return np.array(t_n), np.array(t_o)


def calls(b: int, h: int, s: int, d: int, layout: str) -> dict:
    rng = np.random.default_rng(0)
    shape = {"bshd": (b, s, h, d), "bhsd": (b, h, s, d)}[layout]
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    views = [to_neuron(x, layout) for x in (q, k, v, do)]
    neuron = [np.ascontiguousarray(x) for x in views]
    kw = dict(use_causal_mask=True)

    def passes(qn, kn, vn, don):
        o, lse = numbafa.attention_fwd(qn, kn, vn, **kw, lse_layout="natural")
        return (lambda: numbafa.attention_fwd(qn, kn, vn, **kw, lse_layout="natural"),
                lambda: numbafa.attention_bwd(qn, kn, vn, o, don, lse, **kw))

    def train_neuron():
        o, lse = numbafa.attention_fwd(*neuron[:3], **kw)
        numbafa.attention_bwd(*neuron[:3], o, neuron[3], lse, **kw)

    def train_attention():
        _, ctx = numbafa.attention(q, k, v, **kw, layout=layout)
        ctx.backward(do)

    fwd_n, bwd_n = passes(*neuron)
    fwd_l, bwd_l = passes(*views)
    return {"fwd": (fwd_n, fwd_l), "bwd": (bwd_n, bwd_l), "train": (train_neuron, train_attention)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(8, 4, 256, 32), metavar=("B", "H", "S", "D"))
    parser.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    parser.add_argument("--seconds", type=float, default=3.0, help="per pair of calls")
    args = parser.parse_args(argv)
    print(f"B{args.shape[0]} H{args.shape[1]} S{args.shape[2]} D{args.shape[3]} causal float32, "
          f"{args.layout} / neuron, calls paired:")
    for name, (neuron, other) in calls(*args.shape, args.layout).items():
        t_n, t_o = paired(neuron, other, args.seconds)
        q1, med, q3 = np.percentile(t_o / t_n, [25, 50, 75])
        print(f"  {name:5s} neuron {np.median(t_n) * 1e3:.3f} ms  {args.layout} {np.median(t_o) * 1e3:.3f} ms  "
              f"ratio {med:.3f} (quartiles {q1:.3f}-{q3:.3f}, {t_n.size} pairs)")


if __name__ == "__main__":
    main()
