"""The common start of the child processes that bench/threads.py and bench/gemm_share.py run.

:data:`BACKWARD_SETUP` is Python source: it reads a JSON dict from
``sys.argv[1]`` into ``args`` (``threads``, ``dtype`` "bf16" or "float32",
``heads``, ``kv_heads`` (optional, default ``heads``), ``head_dim``, ``seqlen``, ``causal``,
``mixed_precision``), sets
Numba's thread count, makes ``q, k, v, dy`` ``[1, heads, head_dim, seqlen]``
(``k, v`` with ``kv_heads``; seeded), ``o, lse`` from the forward, and ``kw`` (the keyword arguments of
both calls), and warms the backward up (compile or cache load). A script
appends its own timing code.
"""

BACKWARD_SETUP = r"""
import json, resource, sys, time
import numba, numpy as np
import numbafa
args = json.loads(sys.argv[1])
numba.set_num_threads(args["threads"])
if args["dtype"] == "bf16":
    import ml_dtypes
    dtype = ml_dtypes.bfloat16
else:
    dtype = np.float32
rng = np.random.default_rng(0)
shape = (1, args["heads"], args["head_dim"], args["seqlen"])
kv_shape = (1, args.get("kv_heads") or args["heads"], args["head_dim"], args["seqlen"])
q, k, v, dy = (rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in (shape, kv_shape, kv_shape, shape))
kw = dict(use_causal_mask=args["causal"], mixed_precision=args["mixed_precision"])
o, lse = numbafa.attention_fwd(q, k, v, **kw)
numbafa.attention_bwd(q, k, v, o, dy, lse, **kw)
"""
