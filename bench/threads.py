"""The backward on 1 and on 2 threads, each in a fresh process: wall time and CPU time.

    python bench/threads.py [--dtype bf16] [--heads 8] [--kv-heads 1] [--seqlen 2048] [--head-dim 128]
                            [--causal] [--repeats 5] [--rounds 2]

Each round starts one process per thread count (alternately), which warms up
(the kernel comes from the on-disk cache after the first round), then times
``--repeats`` backward calls: wall time and the process's CPU time
(``resource.getrusage``), medians. One thread shows the loop's own rate;
the CPU time of two threads against one shows how much the cores slow each
other down, and wall x threads against CPU how long threads wait.
The calls use the API's default ``mixed_precision=False`` unless
``--mixed-precision`` (bench/gemm_share.py and bench/compare.py use True); with
bf16 inputs and ``mixed_precision=False`` an odd number of units is never
split (bf16 accumulators fix their order), so MQA at batch 1 runs on one core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _child import BACKWARD_SETUP

_CHILD = BACKWARD_SETUP + r"""
wall, cpu = [], []
for _ in range(args["repeats"]):
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
    wall.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
print(json.dumps({"wall": float(np.median(wall)), "cpu": float(np.median(cpu))}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="bf16")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads; 1: MQA)")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="mixed_precision=True (default False: bf16 accumulators, never split)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    results = {1: [], 2: []}
    for _ in range(args.rounds):
        for threads in (1, 2):
            child = dict(vars(args), threads=threads)
            out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child)],
                                 capture_output=True, text=True, check=True).stdout
            results[threads].append(json.loads(out.strip().splitlines()[-1]))
    print(f"backward, {args.dtype}, [1, {args.heads}, {args.head_dim}, {args.seqlen}], "
          f"{args.kv_heads or args.heads} KV heads, "
          f"{'causal' if args.causal else 'full'}; medians of {args.repeats} calls per process")
    print("| threads | wall ms (per round) | CPU s (per round) |")
    print("|---|---|---|")
    for threads, runs in results.items():
        print(f"| {threads} | " + ", ".join(f"{r['wall'] * 1e3:.0f}" for r in runs) + " | "
              + ", ".join(f"{r['cpu']:.3f}" for r in runs) + " |")
    speedups = [one["wall"] / two["wall"] for one, two in zip(results[1], results[2])]
    print("2-thread speed-up per round (1-thread wall / 2-thread wall): "
          + ", ".join(f"{x:.2f}x" for x in speedups))


if __name__ == "__main__":
    main()
