"""Where the backward's CPU time goes, by code: the GEMM library's micro-kernels, its packing
(operand copies), and everything else (numbafa's own Numba code, the API, the OS kernel).

    python bench/gemm_share.py [--dtype bf16] [--threads 1] [--heads 8] [--seqlen 2048]
                               [--head-dim 128] [--causal] [--calls 20] [--top N]

Needs Linux ``perf`` (``perf record`` allowed for this user). The backward runs
in a child process under ``perf record``, which samples only the timed calls
(the warm-up, compile and imports are outside: the child switches sampling on
and off through perf's control FIFO). oneDNN names its JIT kernels for perf
(``ONEDNN_JIT_PROFILE=2``, a ``/tmp/perf-PID.map``); Numba's code has no names
and is counted under "other". The GFLOP/s of the micro-kernels is the
backward's FLOPs in the flash-attention convention (2.5 x the forward's
4 * B * H * S^2 * D, halved when causal: its five GEMMs) over the CPU time their samples stand for: the rate the GEMMs
run at while they run (a lower bound when causal: the diagonal blocks compute
some masked products too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from _child import BACKWARD_SETUP

_CHILD = BACKWARD_SETUP + r"""
ctl = open(args["ctl"], "w")
ack = open(args["ack"], "r")
def command(word):
    ctl.write(word + "\n")
    ctl.flush()
    ack.readline()
command("enable")
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
for _ in range(args["calls"]):
    numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
wall = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
command("disable")
cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
print(json.dumps({"wall": wall / args["calls"], "cpu": cpu / args["calls"],
                  "gemm": numbafa.backend_info()["gemm"]["path"]}))
"""

#: Symbol patterns of GEMM packing routines (operand copies): oneDNN's ``jit_*copy*`` kernels,
#: OpenBLAS's ``*copy*`` / ``*_oncopy`` / ``*_itcopy``.
_PACKING = re.compile(r"copy", re.IGNORECASE)
#: GEMM compute kernels: oneDNN's ``jit_*_kern`` and ``jit_*_xbyak_gemm`` (its float32 GEMM may
#: run AVX2 kernels on an AVX-512 CPU), OpenBLAS's ``*gemm_kernel*``. The library's entry points
#: (``dnnl_gemm_bf16bf16f32``), drivers and threads are "other GEMM library".
_KERNEL = re.compile(r"kern|xbyak_gemm", re.IGNORECASE)


def backward_flops(heads, seqlen, head_dim, causal):
    """Flash-attention convention: 2.5 x ``4 * H * S^2 * D``, halved when causal."""
    fwd = 4.0 * heads * seqlen * seqlen * head_dim
    return 2.5 * fwd * (0.5 if causal else 1.0)


def classify(dso, sym):
    """``"kernel"``, ``"packing"``, ``"other GEMM library"`` or ``"other"`` for one perf row."""
    named_jit = sym.startswith("jit_")  # oneDNN names its JIT code; Numba's has no names
    if named_jit or ("openblas" in dso.lower() or "dnnl" in dso.lower()):
        if _PACKING.search(sym):
            return "packing"
        if _KERNEL.search(sym):
            return "kernel"
        return "other GEMM library"
    return "other"


def parse_report(text):
    """Sum perf's ``--sort dso,sym`` percentages by :func:`classify`."""
    shares = {"kernel": 0.0, "packing": 0.0, "other GEMM library": 0.0, "other": 0.0}
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S.*?)\s+\[[.k]\]\s+(.*)$", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2).strip(), m.group(3).strip()
        shares[classify(dso, sym)] += pct
    return shares


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=0, help="also print the N hottest symbols")
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        sys.exit("gemm_share.py needs Linux perf (package linux-perf / linux-tools); not found")
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack, data = (os.path.join(tmp, n) for n in ("ctl", "ack", "perf.data"))
        os.mkfifo(ctl)
        os.mkfifo(ack)
        child = dict(vars(args), ctl=ctl, ack=ack, mixed_precision=True)
        env = dict(os.environ, ONEDNN_JIT_PROFILE="2")
        run = subprocess.run(["perf", "record", "-q", "-F", "1999", "-D", "-1", f"--control=fifo:{ctl},{ack}",
                              "-o", data, "--", sys.executable, "-c", _CHILD, json.dumps(child)],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"perf record failed ({run.returncode}):\n{run.stderr[-2000:]}")
        timing = json.loads(run.stdout.strip().splitlines()[-1])
        report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym",
                                 "--stdio"], capture_output=True, text=True, check=True).stdout
    shares = parse_report(report)
    if args.top:
        rows = [line for line in report.splitlines() if re.match(r"\s*[\d.]+%", line)]
        print("\n".join(rows[:args.top]))
    total = sum(shares.values()) or 1.0
    flops = backward_flops(args.heads, args.seqlen, args.head_dim, args.causal)
    kernel_s = timing["cpu"] * shares["kernel"] / total
    print(f"backward, {args.dtype}, [1, {args.heads}, {args.head_dim}, {args.seqlen}]"
          f"{' causal' if args.causal else ''}, {args.threads} thread(s), GEMM path {timing['gemm']}: "
          f"{timing['wall'] * 1e3:.1f} ms wall, {timing['cpu'] * 1e3:.1f} ms CPU per call")
    for name, pct in shares.items():
        print(f"  {name:20s} {pct / total * 100:5.1f} % of CPU samples")
    if kernel_s > 0:
        print(f"  GEMM micro-kernels run at {flops / kernel_s / 1e9:.0f} GFLOP/s per thread "
              f"while they run ({flops / 1e9:.1f} GFLOP per call)")


if __name__ == "__main__":
    main()
