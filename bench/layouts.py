"""numbafa.attention in the caller's layout against the Neuron-layout calls, side by side.

    python bench/layouts.py [--shape B H S D] [--layout bshd] [--rounds 7]

For one shape (default B8 H4 S256 D32, causal, float32) it times, alternating in rounds
(medians of each round's mean over >= 0.3 s of calls):

* ``fwd neuron`` / ``bwd neuron``: ``numbafa.attention_fwd`` / ``attention_bwd`` on
  C-contiguous Neuron-layout arrays (lse ``natural``);
* ``fwd <layout>`` / ``bwd <layout>``: the same calls on views of C-contiguous arrays in
  ``--layout`` (the kernels read and write that layout in place);
* ``train neuron``: forward then backward on the Neuron-layout arrays;
* ``train attention``: ``numbafa.attention(..., layout=...)`` then ``ctx.backward(do)``
  (what a training loop in that layout runs: the kernels plus the context's fingerprints).

and prints the ratios ``<layout> / neuron`` of each pass and of the training step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import numbafa
from numbafa.layout import to_neuron


def per_call_ms(call, seconds: float = 0.3) -> float:
    call()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        call()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


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
    return {"fwd neuron": fwd_n, f"fwd {layout}": fwd_l, "bwd neuron": bwd_n, f"bwd {layout}": bwd_l,
            "train neuron": train_neuron, "train attention": train_attention}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(8, 4, 256, 32), metavar=("B", "H", "S", "D"))
    parser.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    timed = calls(*args.shape, args.layout)
    times = {name: [] for name in timed}
    for _ in range(args.rounds):
        for name, call in timed.items():
            times[name].append(per_call_ms(call))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"B{args.shape[0]} H{args.shape[1]} S{args.shape[2]} D{args.shape[3]} causal float32, "
          f"{args.rounds} rounds: " + "  ".join(f"{n} {m:.3f} ms" for n, m in med.items()))
    lay = args.layout
    print(f"{lay} / neuron: forward {med[f'fwd {lay}'] / med['fwd neuron']:.3f}, backward "
          f"{med[f'bwd {lay}'] / med['bwd neuron']:.3f}, attention + ctx.backward "
          f"{med['train attention'] / med['train neuron']:.3f}")


if __name__ == "__main__":
    main()
