"""The score variants (soft cap, ALiBi, bias, bias with its gradient) against the plain kernels.

    python bench/variants.py [--repeats 7] [--seqlen 2048] [--heads 8] [--head-dim 128] [--full]
    python bench/variants.py --torch [--seqlen 2048 8192]

The first form times, per dtype (float32, bf16 with ``mixed_precision=True``) and pass, the
plain call and each variant, alternated within every repeat so that machine noise hits all
alike, and prints the medians and each variant's ratio to the plain call (the targets of the
backward: soft cap <= 1.25x, ALiBi <= 1.10x, a bias without its gradient <= 1.3x, with it
<= 1.5x). The bias is ``[1, heads, seqlen, seqlen]`` float32 (a per-head bias shared by
the batch), the slopes ``[heads]``, the soft cap 30; "shared+dbias" is a ``[1, 1, seqlen,
seqlen]`` bias shared by every head, whose gradient is summed by one work item (one thread);
"bias+dbias (prefaulted)" writes dbias into memory touched before (:func:`_prefaulted`): the
difference to "bias+dbias" is the page faults of a fresh ``seqlen x seqlen`` array.

``--torch`` runs, in a fresh subprocess each, the backward of one batch of ``--heads`` heads
(causal unless ``--full``) with a ``[1, heads, seqlen, seqlen]`` float32 bias that requires
its gradient: numbafa (``return_dbias=True``) and torch's CPU SDPA with that bias as a float
``attn_mask`` (which runs its math backend: no fused CPU kernel takes a mask with a
gradient), and prints the time of the backward, its peak extra memory (``VmHWM`` over the
resident size before it, Linux; the bias's gradient included, the bias itself not) and the
memory the forward left held for it (the resident size before the backward over that before
the forward: o and lse for numbafa, the attention weights too for torch).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from memory import STATUS

DTYPES = {"float32": np.float32, "bf16": ml_dtypes.bfloat16}


def _variants(h, s):
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((1, h, s, s)).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, h + 1)).astype(np.float32)
    return {"plain": {}, "softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=slopes),
            "bias": dict(bias=bias), "bias+dbias": dict(bias=bias, return_dbias=True),
            "shared+dbias": dict(bias=bias[:, :1], return_dbias=True)}


def _prefaulted(call, shape):
    """``call`` with numbafa's new ``dbias`` replaced by one zeroed buffer written before: the
    kernel's cost without the page faults of a fresh S x S array (a measuring device: it
    patches ``numbafa.kernels.bundles.make_scores`` for the call)."""
    from numbafa.kernels import bundles

    buffer = np.ones(shape, np.float32)
    real = bundles.make_scores

    def make_scores(prob, acc):
        mods = real(prob, acc)
        buffer.fill(0.0)
        return mods._replace(dbias=buffer)

    def run():
        bundles.make_scores = make_scores
        try:
            return call()
        finally:
            bundles.make_scores = real
    return run


def _calls(dtype, h, s, d, causal):
    import numbafa

    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((1, h, d, s)).astype(dtype) for _ in range(4))
    calls = {}
    for name, kw in _variants(h, s).items():
        fwd_kw = {key: x for key, x in kw.items() if key != "return_dbias"}
        common = dict(use_causal_mask=causal, mixed_precision=True)
        o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural", **common, **fwd_kw)
        numbafa.attention_bwd(q, k, v, o, dy, lse, **common, **kw)
        calls[name] = {
            "forward": lambda fwd_kw=fwd_kw, common=common: numbafa.attention_fwd(q, k, v, **common, **fwd_kw),
            "backward": lambda o=o, lse=lse, kw=kw, common=common: numbafa.attention_bwd(q, k, v, o, dy, lse,
                                                                                       **common, **kw)}
    calls["bias+dbias (prefaulted)"] = {"backward": _prefaulted(calls["bias+dbias"]["backward"], (1, h, s, s))}
    return calls


def speed(args) -> dict:
    import numbafa

    info = numbafa.backend_info()
    print(f"{platform.machine()} {info['cpu_model']}, GEMM path {info['gemm']['path']}, threads {info['threads']}")
    shape = f"h{args.heads}-s{args.seqlen}-d{args.head_dim}-{'full' if args.full else 'causal'}"
    out = {}
    for dtype_name, dtype in DTYPES.items():
        calls = _calls(dtype, args.heads, args.seqlen, args.head_dim, not args.full)
        for pass_ in ("forward", "backward"):
            names = [n for n in calls if pass_ in calls[n] and not (pass_ == "forward" and "dbias" in n)]
            times = {n: [] for n in names}
            for _ in range(args.repeats):
                for n in names:
                    t0 = time.perf_counter()
                    calls[n][pass_]()
                    times[n].append(time.perf_counter() - t0)
            med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
            out[f"{dtype_name}/{pass_}"] = med
            print(f"{shape} {dtype_name} {pass_}: " + ", ".join(
                f"{n} {ms:.1f} ms" + ("" if n == "plain" else f" ({ms / med['plain']:.2f}x)") for n, ms in med.items()))
    return {"shape": shape, "median_ms": out}


CHILD = r"""
import json, sys, time
import numpy as np
""" + STATUS + r"""
spec = json.loads(sys.argv[1])
impl, s, d, h, causal = spec["impl"], spec["seqlen"], spec["head_dim"], spec["heads"], spec["causal"]
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, h, d, s)).astype(np.float32) for _ in range(3))
dy = rng.standard_normal((1, h, d, s)).astype(np.float32)
bias = rng.standard_normal((1, h, s, s)).astype(np.float32)
if impl == "numbafa":
    import numbafa
    small = [np.ones((1, h, d, 256), np.float32)] * 3
    o, lse = numbafa.attention_fwd(*small, lse_layout="natural", use_causal_mask=causal, bias=bias[..., :256, :256])
    numbafa.attention_bwd(*small, o, small[0], lse, use_causal_mask=causal, bias=bias[..., :256, :256], return_dbias=True)
    start = status("VmRSS")
    o, lse = numbafa.attention_fwd(q, k, v, lse_layout="natural", use_causal_mask=causal, bias=bias)
    run = lambda: numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal, bias=bias, return_dbias=True)
else:
    import torch, torch.nn.functional as F
    torch.set_num_threads(2)
    tq, tk, tv = (torch.from_numpy(x.transpose(0, 1, 3, 2).copy()).requires_grad_() for x in (q, k, v))
    tdy = torch.from_numpy(dy.transpose(0, 1, 3, 2).copy())
    mask = torch.from_numpy(bias)
    if causal:
        mask = mask + torch.triu(torch.full((s, s), float("-inf")), 1)
    mask.requires_grad_()
    start = status("VmRSS")
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
    run = lambda: out.backward(tdy)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
t0 = time.perf_counter()
run()
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "peak_extra_bytes": status("VmHWM") - before, "held_bytes": before - start}))
"""


def versus_torch(args) -> list:
    rows = []
    for s in args.seqlen_list:
        row = {"seqlen": s, "heads": args.heads, "head_dim": args.head_dim, "causal": not args.full}
        for impl in ("numbafa", "torch"):
            spec = dict(impl=impl, seqlen=s, head_dim=args.head_dim, heads=args.heads, causal=not args.full)
            done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{impl} at seqlen {s} failed:\n{done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            row[impl] = result
            print(f"S{s} h{args.heads} d{args.head_dim} {'full' if args.full else 'causal'} {impl}: backward "
                  f"{result['seconds'] * 1e3:.0f} ms, peak extra {result['peak_extra_bytes'] / 2 ** 20:.0f} MiB, "
                  f"held from the forward {result['held_bytes'] / 2 ** 20:.0f} MiB")
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seqlen", type=int, nargs="+", default=None, dest="seqlen_list")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--full", action="store_true", help="no causal mask")
    parser.add_argument("--torch", action="store_true", help="numbafa vs torch's SDPA with a float mask")
    args = parser.parse_args(argv)
    if args.torch:
        args.seqlen_list = args.seqlen_list or [2048, 8192]
        print(json.dumps(versus_torch(args)))
    else:
        args.seqlen = (args.seqlen_list or [2048])[0]
        print(json.dumps(speed(args)))


if __name__ == "__main__":
    main()
