"""numbafa: the Neuron NKI flash-attention backward, on the CPU, with Numba.

Public API
----------
attention_fwd
    o and lse by an online-softmax kernel, in the backward's convention.
attention_bwd
    dQ, dK, dV (and dsinks) in the Neuron kernel's contract and numerics.
dropout_mask
    The attention-dropout keep mask the kernels draw, materialised.
attention
    Functional forward for training loops: ``o, ctx = attention(...)``,
    ``grads = ctx.backward(do)``.
layout
    Conversions between the Neuron layout and bshd / bhsd, lse layouts,
    cu_seqlens -> packing bounds, CTE checkpoint -> lse.
backend_info
    Which BLAS, thread count and arithmetic the kernels use on this machine.
compile_ahead
    Compile a pass's kernels in a second process while this one goes on (a cold first
    backward loads them instead of compiling): ``ahead = compile_ahead("float32")``, then
    ``ahead.wait()`` before the first backward.
forced_gemm_path
    ``with numbafa.forced_gemm_path("blas"):`` runs the calls in the block on one GEMM path.
golden
    Textbook float64 NumPy references (slow, O(S^2) memory) used by the tests.
"""

import time as _time

#: When this process started importing the package: the kernel cache, keyed by a hash of the
#: sources taken on first use, is off if a source file changed after it (numbafa.compiler.jit).
_IMPORTED_NS = _time.time_ns()

from . import golden, layout
from .api import attention_bwd, attention_fwd, dropout_mask
from .info import backend_info
from .pipeline.ahead import CompileAhead, compile_ahead
from .platform.onednn import forced_gemm_path
from .functional import AttentionContext, attention
from .version import __version__

__all__ = ["attention", "AttentionContext", "attention_fwd", "attention_bwd", "backend_info", "compile_ahead",
           "CompileAhead", "dropout_mask", "forced_gemm_path",
           "golden", "layout", "__version__"]
