"""Train a tiny causal self-attention language model whose whole step is one ``@numba.njit``.

The model of ``examples/train_numpy.py`` (one attention layer with a residual,
character level), but forward, loss, backward and the SGD update run inside
one jitted function, :func:`train_step`, which calls ``numbafa.nb``'s
kernels on arrays in the Neuron layout ``[batch, heads, head_dim, seq]``::

    x  = E[tokens]                                  [B, S, C]
    q, k, v = x Wq, x Wk, x Wv                      -> [B, H, D, S] (KV heads may be fewer)
    a  = attention(q, k, v, causal, ALiBi)          numbafa.nb.attention_fwd
    h  = x + a Wo;  logits = h Wout;  loss = mean cross-entropy(next token)
    ... gradients by hand, attention's from numbafa.nb.attention_bwd; SGD

Positions enter through ALiBi (fixed per-head slopes, ``alibi_slopes=``).
With ``--dtype bf16`` attention runs in bf16 (q, k, v, dy rounded to bf16,
float32 accumulation, mixed_precision=True), the rest of the model in
float32: ``numbafa.nb.to_bf16_bits``/``from_bf16_bits`` convert in njit code.

Run ``python examples/train_njit.py [--dtype bf16]``: the plan is made once
in Python (``numbafa.nb.plan``), then every step is one call of compiled
code; the loss falls from ln(V) ~ 3.4 to well below 2.5.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numba
import numpy as np

import numbafa.nb

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way. "
)


def init_params(vocab, channels=64, heads=4, kv_heads=2, head_dim=16, seed=0):
    """``(E, Wq, Wk, Wv, Wo, Wout)``, small random float32 weights."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return (w(vocab, channels, scale=0.5), w(channels, heads * head_dim, scale=channels ** -0.5),
            w(channels, kv_heads * head_dim, scale=channels ** -0.5),
            w(channels, kv_heads * head_dim, scale=channels ** -0.5),
            w(heads * head_dim, channels, scale=(heads * head_dim) ** -0.5),
            w(channels, vocab, scale=channels ** -0.5))


@numba.njit
def to_neuron(x, bsz, seq, heads, head_dim):
    """``[B*S, H*D]`` rows -> ``[B, H, D, S]``."""
    out = np.empty((bsz, heads, head_dim, seq), dtype=np.float32)
    for b in range(bsz):
        for s in range(seq):
            for h in range(heads):
                for d in range(head_dim):
                    out[b, h, d, s] = x[b * seq + s, h * head_dim + d]
    return out


@numba.njit
def from_neuron(x):
    """``[B, H, D, S]`` -> ``[B*S, H*D]`` rows."""
    bsz, heads, head_dim, seq = x.shape
    out = np.empty((bsz * seq, heads * head_dim), dtype=np.float32)
    for b in range(bsz):
        for s in range(seq):
            for h in range(heads):
                for d in range(head_dim):
                    out[b * seq + s, h * head_dim + d] = x[b, h, d, s]
    return out


@numba.njit
def as_float32(x):
    """float32 storage: the arrays as they are."""
    return x


#: The attention's storage: (float32 -> storage, storage -> float32), njit functions.
STORAGE = {"float32": (as_float32, as_float32),
           "bf16": (numbafa.nb.to_bf16_bits, numbafa.nb.from_bf16_bits)}


def alibi_slopes(heads):
    """ALiBi's per-head slopes, ``2**(-8 h / heads)`` for h = 1..heads (float32)."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


@numba.njit
def attention_step(plan, x, wq, wk, wv, da_rows, bsz, seq, slopes, narrow, widen):
    """q, k, v of ``x``; the attention output ``a``; with ``da_rows`` (dL/da), dL/dq, dL/dk, dL/dv.
    Returns the Neuron-layout arrays in the attention's storage (``narrow`` of float32: the
    plan's dtype; tests compare them with the Python API's)."""
    _, heads, kv_heads, head_dim, _, _, _ = plan.dims
    q = narrow(to_neuron(x @ wq, bsz, seq, heads, head_dim))
    k = narrow(to_neuron(x @ wk, bsz, seq, kv_heads, head_dim))
    v = narrow(to_neuron(x @ wv, bsz, seq, kv_heads, head_dim))
    o = np.empty_like(q)
    lse = np.empty((bsz, heads, 128, seq // 128), dtype=np.float32)
    numbafa.nb.attention_fwd(plan, q, k, v, o, lse, alibi_slopes=slopes)
    dy = narrow(to_neuron(da_rows, bsz, seq, heads, head_dim)) if da_rows.size else np.zeros_like(o)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    if da_rows.size:
        numbafa.nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv, alibi_slopes=slopes)
    return q, k, v, o, dy, dq, dk, dv


@numba.njit
def train_step(plan, params, tokens, targets, lr, slopes, narrow, widen):
    """One SGD step of the whole model; returns ``(loss, params)`` (new weight arrays)."""
    emb, wq, wk, wv, wo, wout = params
    bsz, seq = tokens.shape
    n = bsz * seq
    x = np.empty((n, emb.shape[1]), dtype=np.float32)
    for i in range(n):
        x[i] = emb[tokens.flat[i]]
    o = attention_step(plan, x, wq, wk, wv, np.empty((0, 0), np.float32), bsz, seq, slopes, narrow, widen)[3]
    a = from_neuron(widen(o))
    h = x + a @ wo
    logits = h @ wout
    dlogits = np.empty_like(logits)
    loss = 0.0
    for i in range(n):
        row = logits[i] - logits[i].max()
        p = np.exp(row)
        p /= p.sum()
        t = targets.flat[i]
        loss -= np.log(p[t] + 1e-30)
        p[t] -= 1.0
        dlogits[i] = p / n
    dh = dlogits @ wout.T
    da = dh @ wo.T
    _, _, _, _, _, dq, dk, dv = attention_step(plan, x, wq, wk, wv, da.astype(np.float32), bsz, seq, slopes,
                                               narrow, widen)
    dq, dk, dv = from_neuron(widen(dq)), from_neuron(widen(dk)), from_neuron(widen(dv))
    dx = dh + dq @ wq.T + dk @ wk.T + dv @ wv.T
    demb = np.zeros_like(emb)
    for i in range(n):
        demb[tokens.flat[i]] += dx[i]
    grads = (demb, x.T @ dq, x.T @ dk, x.T @ dv, a.T @ dh, h.T @ dlogits)
    new = (emb - lr * grads[0], wq - lr * grads[1], wk - lr * grads[2], wv - lr * grads[3],
           wo - lr * grads[4], wout - lr * grads[5])
    return loss / n, new


def batches(text, seq, bsz, rng):
    """Random windows of the text as (tokens, next tokens)."""
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int64)
    while True:
        starts = rng.integers(0, ids.size - seq - 1, bsz)
        window = np.stack([ids[s:s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def make_plan(params, seq, bsz, heads=4, kv_heads=2, head_dim=16, dtype="float32"):
    """The ``numbafa.nb`` plan of the model's attention (validated once, in Python): causal,
    ALiBi, in ``dtype`` ("float32" or "bf16", with float32 accumulation)."""
    storage = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    q = np.zeros((bsz, heads, head_dim, seq), storage)
    k = np.zeros((bsz, kv_heads, head_dim, seq), storage)
    return numbafa.nb.plan(q, k, k, use_causal_mask=True, alibi_slopes=alibi_slopes(heads),
                           mixed_precision=dtype != "float32")


def train(steps=150, seq=128, bsz=8, seed=0, lr=0.5, log_every=25, dtype="float32"):
    """Train; return the list of losses."""
    params = init_params(len(set(TEXT)), seed=seed)
    plan = make_plan(params, seq, bsz, dtype=dtype)
    slopes, (narrow, widen) = alibi_slopes(plan.dims[1]), STORAGE[dtype]
    data = batches(TEXT, seq, bsz, np.random.default_rng(seed))
    losses = []
    t0 = time.perf_counter()
    with numbafa.nb.single_threaded_blas():   # BLAS at one thread for the whole loop (each pass pins it too)
        for step in range(steps):
            tokens, targets = next(data)
            loss, params = train_step(plan, params, tokens, targets, np.float32(lr), slopes, narrow, widen)
            losses.append(float(loss))
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:4d}  loss {loss:.3f}  ({time.perf_counter() - t0:.1f} s)")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dtype", choices=sorted(STORAGE), default="float32",
                        help="the attention's dtype (the rest of the model is float32)")
    args = parser.parse_args(argv)
    losses = train(args.steps, dtype=args.dtype)
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
