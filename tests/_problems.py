"""Test problems: random inputs plus o/lse from the float64 golden forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from numbafa import golden


def bounds_from_lengths(lengths):
    """Packing bounds for back-to-back sequences of the given lengths."""
    bmin, bmax = [], []
    start = 0
    for n in lengths:
        bmin += [start] * n
        bmax += [start + n] * n
        start += n
    return np.array(bmin, dtype=np.float32), np.array(bmax, dtype=np.float32)


@dataclass
class Case:
    """One backward test case: shapes and options."""

    bs: int = 1
    nheads: int = 2
    nheads_kv: int = 2
    d_head: int = 64
    d_head_v: int | None = None        # the value head dim; None: d_head
    seqlen_q: int = 256
    seqlen_k: int = 256
    causal: bool = False
    window: int | None = None
    packing: tuple | None = None       # sequence lengths summing to seqlen_q
    num_sinks: int = 0                 # 0: none; 1: sinks [bs, nheads]; n > 1: [bs, nheads, n]
    softmax_scale: float | None = None
    seed: int = 0
    options: dict = field(default_factory=dict)

    def kwargs(self):
        """Options shared by the golden and the kernel (no arrays but bounds/sinks)."""
        kw = dict(use_causal_mask=self.causal, softmax_scale=self.softmax_scale,
                  sliding_window=self.window)
        if self.packing is not None:
            kw["bound_min"], kw["bound_max"] = bounds_from_lengths(self.packing)
        return kw


def make_inputs(case: Case, dtype=np.float32):
    """Inputs of ``attention_bwd`` for ``case``: a dict of keyword arguments.

    q/k/v/dy are standard normal, rounded to ``dtype``; o and lse come from the
    float64 golden forward of the rounded q/k/v, o rounded to ``dtype`` and
    lse to float32 (natural layout). float64 problems keep lse and the sinks in float64.
    """
    wide = np.dtype(dtype) == np.float64
    rng = np.random.default_rng(case.seed)
    d_v = case.d_head if case.d_head_v is None else case.d_head_v
    q = rng.standard_normal((case.bs, case.nheads, case.d_head, case.seqlen_q)).astype(dtype)
    k = rng.standard_normal((case.bs, case.nheads_kv, case.d_head, case.seqlen_k)).astype(dtype)
    v = rng.standard_normal((case.bs, case.nheads_kv, d_v, case.seqlen_k)).astype(dtype)
    dy = rng.standard_normal((case.bs, case.nheads, d_v, case.seqlen_q)).astype(dtype)
    kw = case.kwargs()
    if case.num_sinks:
        shape = (case.bs, case.nheads) + ((case.num_sinks,) if case.num_sinks > 1 else ())
        kw["sinks_ref"] = rng.standard_normal(shape).astype(np.float64 if wide else np.float32)
    o, lse = golden.attention_fwd(q, k, v, sinks=kw.get("sinks_ref"), bound_min=kw.get("bound_min"),
                                  bound_max=kw.get("bound_max"), use_causal_mask=case.causal,
                                  softmax_scale=case.softmax_scale, sliding_window=case.window)
    return dict(q_ref=q, k_ref=k, v_ref=v, o_ref=o.astype(dtype), dy_ref=dy,
                lse_ref=lse.astype(np.float64 if wide else np.float32), **kw)


#: Keys of ``make_inputs``' dict that ``attention_fwd`` takes too, besides q, k, v.
FWD_OPTIONS = ("sinks_ref", "bound_min", "bound_max", "use_causal_mask", "softmax_scale", "sliding_window")


def forward_options(inputs):
    """The forward's options (no q, k, v) of a ``make_inputs`` dict."""
    return {key: inputs[key] for key in FWD_OPTIONS if key in inputs}


#: The backward's arrays in a ``make_inputs`` dict, in ``attention_bwd``'s order.
BWD_ARRAYS = ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref")


def validated(inputs, backward=True, **options):
    """The kernels' :class:`numbafa.checks.validation.Problem` of a ``make_inputs`` dict (plus ``options``,
    keyword arguments of ``attention_bwd``), through numbafa's own validation."""
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_bwd_inputs, validate_fwd_inputs

    kw = {**{key: x for key, x in inputs.items() if key not in BWD_ARRAYS}, **options}
    kw["sinks"] = kw.pop("sinks_ref", None)
    arrays = [inputs[key] for key in BWD_ARRAYS[:6 if backward else 3]]
    return (validate_bwd_inputs if backward else validate_fwd_inputs)(*arrays, AttentionOptions(**kw))


#: Shape families shared by the float32 and bf16 tests: (id, Case).
CASES = [
    # --- attention variants -------------------------------------------------
    ("mha", Case()),
    ("mha-causal", Case(causal=True)),
    ("batch2-causal", Case(bs=2, nheads=2, nheads_kv=1, causal=True, seqlen_q=384, seqlen_k=384)),
    ("gqa2", Case(nheads=4, nheads_kv=2)),
    ("gqa4-causal", Case(nheads=8, nheads_kv=2, causal=True)),
    ("gqa8", Case(nheads=16, nheads_kv=2, seqlen_q=128, seqlen_k=256)),   # e.g. llama-70b TP=8 ratio
    ("mqa-causal", Case(nheads=4, nheads_kv=1, causal=True)),
    # --- sliding window (causal only) -----------------------------------------
    ("window64", Case(nheads=3, nheads_kv=3, causal=True, window=64, seqlen_q=640, seqlen_k=640)),
    ("window128-gqa", Case(nheads=4, nheads_kv=1, causal=True, window=128, seqlen_q=1024,
                           seqlen_k=1024)),
    ("window-longer-than-seq", Case(causal=True, window=5000, seqlen_q=300, seqlen_k=300)),
    # --- sequence packing -----------------------------------------------------
    ("packing", Case(packing=(127, 129, 255, 513), seqlen_q=1024, seqlen_k=1024)),
    ("packing-causal", Case(packing=(127, 129, 255, 513), seqlen_q=1024, seqlen_k=1024, causal=True)),
    ("packing-causal-window", Case(packing=(127, 129, 255, 513), seqlen_q=1024, seqlen_k=1024,
                                   causal=True, window=100)),
    # --- attention sinks ------------------------------------------------------
    ("sinks1", Case(num_sinks=1)),
    ("sinks2-causal", Case(num_sinks=2, causal=True)),
    ("sinks1-gqa-packing", Case(nheads=4, nheads_kv=1, num_sinks=1, packing=(129, 255),
                                seqlen_q=384, seqlen_k=384, causal=True)),
    ("sinks2-window", Case(num_sinks=2, causal=True, window=64, seqlen_q=512, seqlen_k=512)),
    # --- head dims (d > 128 is split into equal tiles) -----------------------
    ("d64", Case(d_head=64)),
    ("d96", Case(d_head=96, causal=True)),
    ("d128", Case(d_head=128)),
    ("d256", Case(d_head=256, causal=True)),
    ("d512", Case(d_head=512, nheads=1, nheads_kv=1)),
    ("d40-odd", Case(d_head=40, causal=True)),
    # --- a value head dim of its own (o, dy, dv carry it; DeepSeek's MLA: 192 / 128) ---
    ("dv-narrower-gqa-sinks", Case(nheads=4, nheads_kv=2, d_head=96, d_head_v=64, causal=True, num_sinks=1)),
    ("dv-wider-packing", Case(d_head=32, d_head_v=160, packing=(127, 129))),    # D: two 80-wide tiles
    ("mla-192-128-window", Case(nheads=2, nheads_kv=1, d_head=192, d_head_v=128, causal=True, window=200,
                                seqlen_q=640, seqlen_k=640)),
    # sections follow the wider head dim: d_head_v 256 -> 4096-key sections -> two here
    ("dv-2-sections", Case(nheads=1, nheads_kv=1, d_head=64, d_head_v=256, seqlen_q=200, seqlen_k=5120)),
    # --- lengths --------------------------------------------------------------
    ("sq<sk", Case(seqlen_q=200, seqlen_k=700)),
    ("sq>sk", Case(seqlen_q=700, seqlen_k=200)),
    ("ragged97", Case(seqlen_q=97, seqlen_k=97, causal=True)),
    ("ragged200", Case(seqlen_q=200, seqlen_k=200, causal=True)),
    ("ragged1025", Case(nheads=1, nheads_kv=1, seqlen_q=1025, seqlen_k=1025, causal=True)),
    ("tiny", Case(nheads=1, nheads_kv=1, d_head=1, seqlen_q=2, seqlen_k=3)),
    # --- several KV sections: d 256 -> 2 head-dim tiles -> 4096-key sections --
    ("2-sections", Case(nheads=2, nheads_kv=1, d_head=256, seqlen_q=200, seqlen_k=5120)),
    ("2-sections-causal", Case(nheads=1, nheads_kv=1, d_head=256, seqlen_q=5120, seqlen_k=5120,
                               causal=True, window=1500)),
    # --- scale ----------------------------------------------------------------
    ("scale", Case(softmax_scale=0.3)),
    ("scale-causal-sinks", Case(softmax_scale=0.2, causal=True, num_sinks=1)),
]

