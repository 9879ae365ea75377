"""Record or compare every kernel output bit for bit, across a code change.

    python bench/bit_identity.py save before.npz     # on the old commit
    python bench/bit_identity.py compare before.npz  # on the new one

Runs the forward and the backward on every test family of
``tests/_problems.py`` x {float32, bf16} x mixed_precision {True, False}
(plus the packing-bound edge cases) and stores each output's raw bits.
``compare`` lists every output that differs, with the number of differing
elements, and exits 1 if any does. A restructuring of the kernels must
leave this silent (docs/architecture.md). Results depend on the BLAS kernel
(``OPENBLAS_CORETYPE``): save and compare on the same machine and setting.
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


def _cases():
    for name, case in CASES:
        yield name, case, None
    for name, (lo, hi) in EDGE_BOUNDS.items():
        yield name, Case(seqlen_q=1024, seqlen_k=1024, packing=(1024,)), (lo, hi)


def run_all():
    """{key: uint32 bits} for every output of every configuration."""
    out = {}
    for name, case, edge in _cases():
        for dtype in (np.float32, ml_dtypes.bfloat16):
            inputs = make_inputs(case, dtype)
            if edge is not None:
                n = case.seqlen_q
                inputs["bound_min"] = np.full(n, edge[0], np.float32)
                inputs["bound_max"] = np.full(n, edge[1], np.float32)
            fwd_kw = forward_options(inputs)
            for mixed in (True, False):
                tag = f"{name}/{np.dtype(dtype).name}/{'mixed' if mixed else 'not-mixed'}"
                o, lse = numbafa.attention_fwd(inputs["q_ref"], inputs["k_ref"], inputs["v_ref"],
                                               mixed_precision=mixed, lse_layout="natural", **fwd_kw)
                grads = numbafa.attention_bwd(**inputs, mixed_precision=mixed)
                for key, x in zip(("o", "lse", "dq", "dk", "dv", "dsinks"), (o, lse) + tuple(grads)):
                    out[f"{tag}/{key}"] = np.asarray(x).astype(np.float32).view(np.uint32)
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
        elif before[key].shape != bits.shape:
            differ.append(f"{key}: shape {before[key].shape} -> {bits.shape}")
        elif (before[key] != bits).any():
            differ.append(f"{key}: {(before[key] != bits).sum()} of {bits.size} elements differ")
    for line in differ:
        print(line)
    print(f"{len(results) - len(differ)} of {len(results)} outputs bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
