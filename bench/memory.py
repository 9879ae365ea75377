"""Peak extra memory of one backward call: numbafa (and torch SDPA, if installed).

    python bench/memory.py [--seqlen 16384] [--head-dim 128] [--causal]

Each measurement runs in a fresh subprocess: inputs are allocated and the
kernels compiled (on a tiny shape) first, then the kernel's peak resident
set size is reset (Linux: ``/proc/self/clear_refs``), the backward runs, and
``VmHWM - VmRSS(before)`` is its peak extra memory -- outputs included
(3 x seqlen x head_dim x 4 bytes in float32). One seqlen x seqlen float32
matrix would be ``seqlen^2 * 4`` bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

#: The children's reader of ``/proc/self/status`` (Linux): ``status("VmRSS")`` in bytes.
STATUS = r"""
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)
"""

CHILD = r"""
import json, sys
import numpy as np
""" + STATUS + r"""
spec = json.loads(sys.argv[1])
impl, s, d, dv, causal = spec["impl"], spec["seqlen"], spec["head_dim"], spec["head_dim_v"], spec["causal"]
h, hkv = spec["heads"], spec["kv_heads"]
rng = np.random.default_rng(0)
q = rng.standard_normal((1, h, d, s)).astype(np.float32)
k = rng.standard_normal((1, hkv, d, s)).astype(np.float32)
v = rng.standard_normal((1, hkv, dv, s)).astype(np.float32)
o, dy = (rng.standard_normal((1, h, dv, s)).astype(np.float32) for _ in range(2))
lse = np.full((1, h, s), 10.0, np.float32)
if impl == "numbafa":
    import numbafa
    t, tv = np.ones((1, hkv, d, 256), np.float32), np.ones((1, hkv, dv, 256), np.float32)
    tq, to = np.ones((1, h, d, 256), np.float32), np.ones((1, h, dv, 256), np.float32)
    numbafa.attention_bwd(tq, t, tv, to, to, np.zeros((1, h, 256), np.float32), use_causal_mask=causal)
    run = lambda: numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=causal)
else:
    import contextlib
    import torch, torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.set_num_threads(2)
    backend = sdpa_kernel(SDPBackend.MATH) if spec["math"] else contextlib.nullcontext()
    tq, tk, tv = (torch.from_numpy(x.transpose(0, 1, 3, 2).copy()).requires_grad_() for x in (q, k, v))
    tdy = torch.from_numpy(dy.transpose(0, 1, 3, 2).copy())
    gqa = h != hkv
    small = [x[:, :, :256].detach().clone().requires_grad_() for x in (tq, tk, tv)]
    with backend:
        F.scaled_dot_product_attention(*small, is_causal=causal, enable_gqa=gqa).backward(tdy[:, :, :256])
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)
    run = lambda: out.backward(tdy)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS")
result = run()
print(json.dumps(dict(impl=impl, extra_bytes=status("VmHWM") - before)))
"""


def measure(impl, seqlen, d_head, causal, heads=1, kv_heads=1, d_head_v=None, math=False):
    """Peak extra bytes of one float32 backward (batch 1) of ``impl`` ("numbafa" or "torch"; torch on
    its math backend with ``math``), in a fresh subprocess. The torch forward (its graph, and on the
    math backend its S x S probabilities) is built before the measured backward starts."""
    spec = dict(impl=impl, seqlen=seqlen, head_dim=d_head, head_dim_v=d_head if d_head_v is None else d_head_v,
                causal=bool(causal), heads=heads, kv_heads=kv_heads, math=bool(math))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    mib = 2.0 ** 20
    outputs = 3 * args.seqlen * args.head_dim * 4
    print(f"backward, 1 head, seqlen {args.seqlen}, head_dim {args.head_dim}, float32, "
          f"{'causal' if args.causal else 'full'}: outputs {outputs / mib:.0f} MiB, "
          f"one S x S float32 matrix {args.seqlen ** 2 * 4 / mib:.0f} MiB")
    impls = ["numbafa"]
    if not args.no_torch:
        try:
            import torch  # noqa: F401
            impls.append("torch")
        except ImportError:
            pass
    for impl in impls:
        extra = measure(impl, args.seqlen, args.head_dim, args.causal)
        print(f"  {impl:8s} peak extra memory {extra / mib:8.1f} MiB")


if __name__ == "__main__":
    main()
