"""The Dask overhead on one machine: numbafa.distributed against the in-process call.

    pip install ".[dask]"
    python bench/dask_overhead.py                 # batch 4, 8 heads, seq 2048, head_dim 128
    python bench/dask_overhead.py --repeats 11 --json out.json

The backward (float32) of one shape, full and causal, three ways, run
alternately ``--repeats`` times after a warm-up (no compilation is timed):

* ``in-process``: ``numbafa.attention_bwd`` on ``numba.get_num_threads()`` threads;
* ``dask, numpy in/out``: ``numbafa.distributed.attention_bwd(client, ...)``
  with NumPy arrays, on a ``LocalCluster`` of ``--workers`` worker processes
  of one thread each: validation, scattering every share, the tasks,
  gathering and placing the results, all timed;
* ``dask, arrays on the cluster``: the same with Dask arrays already held by
  the workers (persisted, one chunk per (batch, KV head)), the result
  persisted on the workers (nothing comes back to the client): the overhead
  inside a Dask pipeline.

Prints medians side by side, the speed of each as a fraction of the
in-process speed, the CPU time each mode takes in the client's process (with
a ``LocalCluster`` the scheduler and the nannies run there too) and in every
worker (medians; on a shared machine the CPU time is steadier than the
wall time), the tasks of a NumPy call (units are grouped into blocks
per task, ``numbafa.distributed.MIN_TASK_WORK``) and the bytes shipped per
task (the NumPy payload of a share's inputs and of its result; pickling adds
a few hundred bytes). The machine may be shared: read the ratios of one run,
not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
import warnings

import numba
import numpy as np


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _bytes_per_unit(bs, nheads, nheads_kv, d_head, seqlen):
    """NumPy bytes of one work unit (not split): inputs and result, float32."""
    n_rep = nheads // nheads_kv
    rows = n_rep * d_head * seqlen * 4        # one [1, n_rep, d, S] array
    kv = d_head * seqlen * 4                  # one [1, 1, d, S] array
    inputs = 3 * rows + 2 * kv + n_rep * seqlen * 4   # q, o, dy; k, v; lse
    result = rows + 2 * kv                   # dq; dk, dv
    return inputs, result


def _cpu_seconds(client) -> np.ndarray:
    """CPU seconds used so far by this process (with a LocalCluster: the client, the scheduler
    and the nannies) and by each worker process, in worker order."""
    workers = client.run(time.process_time)
    return np.array([time.process_time()] + [workers[w] for w in sorted(workers)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the medians to this file")
    args = parser.parse_args(argv)

    import dask.array as da
    from dask.distributed import Client, LocalCluster, wait

    import numbafa
    import numbafa.distributed as nd
    from numbafa.kernels.bundles import make_plan
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_bwd_inputs

    bs, h, h_kv, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seqlen
    rng = np.random.default_rng(0)
    q, dy = (rng.standard_normal((bs, h, d, s), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((bs, h_kv, d, s), dtype=np.float32) for _ in range(2))
    info = numbafa.backend_info()
    print(f"CPU: {_cpu_name()}; numbafa {info['numbafa']}, numba {info['numba']}, "
          f"threads {numba.get_num_threads()}, gemm {info['gemm']['path']}")
    print(f"shape: batch {bs}, heads {h}, kv heads {h_kv}, seq {s}, head_dim {d}, float32; "
          f"{args.workers} workers x 1 thread; {args.repeats} alternating repeats, medians")
    n_in, n_out = _bytes_per_unit(bs, h, h_kv, d, s)
    n_units = bs * h_kv
    print(f"per unit: {n_in / 2**20:.2f} MiB in, {n_out / 2**20:.2f} MiB out; {n_units} units "
          f"({n_units * n_in / 2**20:.0f} MiB in, {n_units * n_out / 2**20:.0f} MiB out per call)")

    # Persisting the NumPy inputs as Dask arrays (set-up, not timed) sends a "large graph".
    warnings.filterwarnings("ignore", message="Sending large graph", category=UserWarning)
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           dashboard_address=None)
    client = Client(cluster)
    results = {}
    try:
        for causal in (False, True):
            o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=causal)
            inputs = dict(q_ref=q, k_ref=k, v_ref=v, o_ref=o, dy_ref=dy, lse_ref=lse,
                          use_causal_mask=causal)
            prob = validate_bwd_inputs(q, k, v, o, dy, lse, AttentionOptions(use_causal_mask=causal))
            per_task = nd._units_per_task(make_plan(prob, backward=True), prob,
                                          sum(client.nthreads().values()))
            print(f"\n{'causal' if causal else 'full'}: NumPy inputs: {per_task} units per task, "
                  f"{-(-n_units // per_task)} tasks of {per_task * n_in / 2**20:.1f} MiB in, "
                  f"{per_task * n_out / 2**20:.1f} MiB out")
            chunks = {name: (1, 1 if name in ("k_ref", "v_ref") else h // h_kv) + x.shape[2:]
                      for name, x in inputs.items() if isinstance(x, np.ndarray)}
            on_cluster = dict(inputs, **{name: client.persist(da.from_array(inputs[name], chunks=c))
                                         for name, c in chunks.items()})
            wait([x for x in on_cluster.values() if isinstance(x, da.Array)])

            def in_process():
                numbafa.attention_bwd(**inputs)

            def dask_numpy():
                nd.attention_bwd(client, **inputs)

            def dask_arrays():
                out = client.persist(list(nd.attention_bwd(client, **on_cluster)))
                wait(out)
                del out

            modes = {"in-process": in_process, "dask, numpy in/out": dask_numpy,
                     "dask, arrays on the cluster": dask_arrays}
            times = {name: [] for name in modes}
            cpu = {name: [] for name in modes}
            for fn in modes.values():  # warm-up: compile/load everywhere, first scatter
                fn()
            for _ in range(args.repeats):
                for name, fn in modes.items():
                    before = _cpu_seconds(client)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(_cpu_seconds(client) - before)
            label = "causal" if causal else "full"
            medians = {name: float(np.median(t)) for name, t in times.items()}
            cpu_medians = {name: np.median(c, axis=0).tolist() for name, c in cpu.items()}
            base = medians["in-process"]
            print(f"{label}:")
            print("| mode | median ms | min ms | speed vs in-process | CPU ms: client process, "
                  "workers |")
            print("|---|---|---|---|---|")
            for name, t in times.items():
                main_cpu, *workers_cpu = cpu_medians[name]
                print(f"| {name} | {1e3 * medians[name]:.0f} | {1e3 * min(t):.0f} | "
                      f"{base / medians[name]:.2f}x | {1e3 * main_cpu:.0f}, "
                      f"{' + '.join(f'{1e3 * w:.0f}' for w in workers_cpu)} |")
            results[label] = {"median_s": medians, "all_s": times, "cpu_median_s": cpu_medians}
            del on_cluster
    finally:
        client.close()
        cluster.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu_name(), "shape": vars(args), "bytes_per_task": [n_in, n_out],
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
