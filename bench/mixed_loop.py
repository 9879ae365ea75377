"""A training loop that mixes PyTorch and numbafa: which OpenMP setting serves it best.

    python bench/mixed_loop.py [--steps 200] [--rounds 5]

Each step runs torch's SDPA forward + backward and ``numbafa.torch.attention``'s forward +
backward on the same tensors (float32, causal), at a single-tile shape (B1 H1 S128 D64) and a
training shape (B8 H4 S256 D32). Each setting runs in its own process (the OpenMP runtimes read
their environment at start), the settings alternate over ``--rounds`` rounds, and the report
gives each part's median time per step:

* ``default``: OpenMP's default wait policy (idle threads spin a while before they sleep);
* ``PASSIVE``: ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep at once);
* ``spin 10k``: ``GOMP_SPINCOUNT=10000`` (a short spin, GNU OpenMP's own knob).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {"default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin 10k": {"GOMP_SPINCOUNT": "10000"}}
SHAPES = {"B1 H1 S128 D64": (1, 1, 128, 64), "B8 H4 S256 D32": (8, 4, 256, 32)}

CHILD = r"""
import json, sys, time
import torch
import numbafa.torch as nt
b, h, s, d = map(int, sys.argv[1:5]); steps = int(sys.argv[5])
torch.manual_seed(0)
q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

def sdpa():
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

def ours():
    nt.attention(q, k, v, causal=True).sum().backward()

for _ in range(5):
    sdpa(); ours()
times = {"sdpa": [], "numbafa": []}
for _ in range(steps):
    t0 = time.perf_counter(); sdpa(); t1 = time.perf_counter(); ours(); t2 = time.perf_counter()
    times["sdpa"].append(t1 - t0); times["numbafa"].append(t2 - t1)
print(json.dumps({key: sorted(x)[len(x) // 2] for key, x in times.items()}))
"""


def run(setting: str, shape: tuple, steps: int) -> dict:
    env = dict(os.environ)
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(key, None)
    env.update(SETTINGS[setting])
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, shape), str(steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from numbafa.info import backend_info
    cpu = backend_info().get("cpu_model", "")
    results = {(name, setting): {"sdpa": [], "numbafa": []} for name in SHAPES for setting in SETTINGS}
    for _ in range(args.rounds):
        for name, shape in SHAPES.items():
            for setting in SETTINGS:
                for key, value in run(setting, shape, args.steps).items():
                    results[name, setting][key].append(value)
    print(f"medians of {args.rounds} alternating processes x {args.steps} steps, ms per step; {cpu}")
    print(f"{'shape':16s} {'setting':10s} {'SDPA fwd+bwd':>13s} {'numbafa.torch':>14s} {'both':>8s}")
    for (name, setting), parts in results.items():
        sdpa, ours = (statistics.median(parts[key]) * 1e3 for key in ("sdpa", "numbafa"))
        print(f"{name:16s} {setting:10s} {sdpa:13.3f} {ours:14.3f} {sdpa + ours:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
