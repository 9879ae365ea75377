"""Record or compare every kernel output bit for bit, across a code change.

    python bench/bit_identity.py save before.npz     # on the old commit
    python bench/bit_identity.py compare before.npz  # on the new one

Runs the forward and the backward on every test family of
``tests/_problems.py`` x {float32, bf16} x mixed_precision {True, False}
(plus the packing-bound edge cases), then a smaller set of families with
the other features: float16 (both mixed_precision settings), float64,
attention dropout, and the score variants (bias with its gradient, ALiBi,
soft cap), and stores each output's raw bits. ``compare`` lists every
output that differs, with the number of differing elements, and exits 1 if
any does. A restructuring of the kernels must leave this silent
(docs/architecture.md). Results depend on the GEMM path and the BLAS kernel
(``NUMBAFA_GEMM``, ``OPENBLAS_CORETYPE``): save and compare on the same
machine and setting.
"""

from __future__ import annotations

import pathlib
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import numbafa  # noqa: E402
from _problems import CASES, Case, forward_options, make_inputs  # noqa: E402


#: Packing bounds beyond the float -> int range (the forward got them wrong before 2026-12).
EDGE_BOUNDS = {
    "bound-max-inf": (0.0, np.inf),
    "bound-max-1e19": (0.0, 1e19),
    "bound-min-neg-inf": (-np.inf, 1e30),
}

#: The families the other features run on (a subset of CASES: every loop shape once).
FEATURE_FAMILIES = ("mha-causal", "batch2-causal", "gqa4-causal", "mqa-causal", "window64", "packing-causal",
                    "sinks2-causal", "d256", "dv-narrower-gqa-sinks", "ragged200", "2-sections")


def _cases():
    for name, case in CASES:
        yield name, case, None
    for name, (lo, hi) in EDGE_BOUNDS.items():
        yield name, Case(seqlen_q=1024, seqlen_k=1024, packing=(1024,)), (lo, hi)


def _variants(case: Case, rng) -> dict:
    """Score variants for ``case``: a per-head bias shared by the batch, ALiBi and a soft cap."""
    bias = rng.standard_normal((case.nheads, case.seqlen_q, case.seqlen_k)).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, case.nheads + 1)).astype(np.float32)
    return dict(bias=bias, alibi_slopes=slopes, softcap=20.0)


def _record(out: dict, tag: str, inputs: dict, mixed: bool, extra: dict) -> None:
    """Run both passes of one configuration; store each output's bits under ``tag``."""
    fwd_kw = forward_options(inputs)
    o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"], mixed_precision=mixed,
                                   lse_layout="natural", **fwd_kw, **extra)
    bwd_extra = dict(extra, return_dbias=True) if "bias" in extra else extra
    grads = numbafa.attention_bwd(**inputs, mixed_precision=mixed, **bwd_extra)
    names = ("o", "lse", "dq", "dk", "dv") + (("dsinks",) if "sinks_ref" in inputs else ()) + \
        (("dbias",) if "bias" in extra else ())
    for key, x in zip(names, (o, lse) + tuple(grads)):
        x = np.asarray(x)
        bits = x.view(np.uint64) if x.dtype == np.float64 else x.astype(np.float32).view(np.uint32)
        out[f"{tag}/{key}"] = bits


def run_all():
    """{key: bits} for every output of every configuration."""
    out = {}
    for name, case, edge in _cases():
        for dtype in (np.float32, ml_dtypes.bfloat16):
            inputs = make_inputs(case, dtype)
            if edge is not None:
                n = case.seqlen_q
                inputs["bound_min"] = np.full(n, edge[0], np.float32)
                inputs["bound_max"] = np.full(n, edge[1], np.float32)
            for mixed in (True, False):
                _record(out, f"{name}/{np.dtype(dtype).name}/{'mixed' if mixed else 'not-mixed'}", inputs, mixed, {})
    families = dict(CASES)
    for name in FEATURE_FAMILIES:
        case = families[name]
        for dtype, mixed in ((np.float16, True), (np.float16, False), (np.float64, False)):
            tag = f"{name}/{np.dtype(dtype).name}/{'mixed' if mixed else 'not-mixed'}"
            _record(out, tag, make_inputs(case, dtype), mixed, {})
        for dtype in (np.float32, ml_dtypes.bfloat16):
            inputs = make_inputs(case, dtype)
            dt = np.dtype(dtype).name
            _record(out, f"{name}/{dt}/mixed/dropout", inputs, True, dict(dropout_p=0.2, seed=7, seed_offset=3))
            variants = _variants(case, np.random.default_rng(11))
            _record(out, f"{name}/{dt}/mixed/variants", inputs, True, variants)
    return out


def main(argv):
    if len(argv) != 2 or argv[0] not in ("save", "compare"):
        print(__doc__)
        return 2
    results = run_all()
    if argv[0] == "save":
        np.savez_compressed(argv[1], **results)
        print(f"saved {len(results)} outputs to {argv[1]}")
        return 0
    before = np.load(argv[1])
    differ = []
    for key, bits in results.items():
        if key not in before.files:
            differ.append(f"{key}: new")
        elif before[key].shape != bits.shape or before[key].dtype != bits.dtype:
            differ.append(f"{key}: shape {before[key].shape} -> {bits.shape}")
        elif (before[key] != bits).any():
            differ.append(f"{key}: {(before[key] != bits).sum()} of {bits.size} elements differ")
    missing = [key for key in before.files if key not in results]
    for line in differ + [f"{key}: missing" for key in missing]:
        print(line)
    print(f"{len(results) - len(differ)} of {len(results)} outputs bit-identical")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
