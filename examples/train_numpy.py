"""Train a tiny causal self-attention language model with NumPy and numbafa.

Model (character level, one attention layer with a residual)::

    x  = E[tokens]                                  [B, S, C]
    q, k, v = x Wq, x Wk, x Wv  -> [B, S, H, D]     (layout "bshd"; KV heads may be fewer: GQA)
    a  = numbafa.attention(q, k, v, causal)         [B, S, H, D]
    h  = x + a.reshape(B, S, H*D) Wo                [B, S, C]
    logits = h Wout                                 [B, S, V];  loss = mean cross-entropy(next token)

Gradients are chained by hand; attention's come from ``ctx.backward``.
Adam is written in NumPy. Run ``python examples/train_numpy.py`` (about
half a minute on 2 cores, JIT compile included): the loss falls from
ln(V) ~ 3.4 to well below 2.5.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import numbafa

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way. "
)


def init_params(vocab, channels=64, heads=4, kv_heads=2, head_dim=16, seed=0):
    """Small random float32 parameters."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "E": w(vocab, channels, scale=0.5),
        "Wq": w(channels, heads * head_dim, scale=channels ** -0.5),
        "Wk": w(channels, kv_heads * head_dim, scale=channels ** -0.5),
        "Wv": w(channels, kv_heads * head_dim, scale=channels ** -0.5),
        "Wo": w(heads * head_dim, channels, scale=(heads * head_dim) ** -0.5),
        "Wout": w(channels, vocab, scale=channels ** -0.5),
        "shape": (heads, kv_heads, head_dim),
    }


def loss_and_grads(params, tokens, targets):
    """Mean next-token cross-entropy and its gradient for every weight."""
    heads, kv_heads, head_dim = params["shape"]
    bsz, seq = tokens.shape
    x = params["E"][tokens]                                             # [B, S, C]
    q = (x @ params["Wq"]).reshape(bsz, seq, heads, head_dim)
    k = (x @ params["Wk"]).reshape(bsz, seq, kv_heads, head_dim)
    v = (x @ params["Wv"]).reshape(bsz, seq, kv_heads, head_dim)
    a, ctx = numbafa.attention(q, k, v, use_causal_mask=True, layout="bshd")
    a2 = a.reshape(bsz, seq, heads * head_dim)
    h = x + a2 @ params["Wo"]
    logits = h @ params["Wout"]                                         # [B, S, V]
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    n = bsz * seq
    loss = float(-np.log(p.reshape(n, -1)[np.arange(n), targets.reshape(n)] + 1e-30).mean())

    dlogits = p
    dlogits.reshape(n, -1)[np.arange(n), targets.reshape(n)] -= 1.0
    dlogits /= n
    grads = {"Wout": np.einsum("bsc,bsv->cv", h, dlogits)}
    dh = dlogits @ params["Wout"].T
    grads["Wo"] = np.einsum("bsa,bsc->ac", a2, dh)
    da = (dh @ params["Wo"].T).reshape(bsz, seq, heads, head_dim).astype(np.float32)
    dq, dk, dv = ctx.backward(da)
    dq, dk, dv = (g.reshape(bsz, seq, -1) for g in (dq, dk, dv))
    grads["Wq"] = np.einsum("bsc,bsa->ca", x, dq)
    grads["Wk"] = np.einsum("bsc,bsa->ca", x, dk)
    grads["Wv"] = np.einsum("bsc,bsa->ca", x, dv)
    dx = dh + dq @ params["Wq"].T + dk @ params["Wk"].T + dv @ params["Wv"].T
    grads["E"] = np.zeros_like(params["E"])
    np.add.at(grads["E"], tokens, dx)
    return loss, grads


class Adam:
    """Adam (Kingma & Ba) on a dict of arrays."""

    def __init__(self, params, lr=3e-3, betas=(0.9, 0.99), eps=1e-8):
        self.lr, self.b1, self.b2, self.eps = lr, betas[0], betas[1], eps
        self.m = {k: np.zeros_like(v) for k, v in params.items() if isinstance(v, np.ndarray)}
        self.v = {k: np.zeros_like(v) for k, v in self.m.items()}
        self.t = 0

    def step(self, params, grads):
        self.t += 1
        for key, g in grads.items():
            self.m[key] = self.b1 * self.m[key] + (1 - self.b1) * g
            self.v[key] = self.b2 * self.v[key] + (1 - self.b2) * g * g
            m_hat = self.m[key] / (1 - self.b1 ** self.t)
            v_hat = self.v[key] / (1 - self.b2 ** self.t)
            params[key] = (params[key] - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(np.float32)


def batches(text, seq, bsz, rng):
    """Random windows of the text as (tokens, next tokens)."""
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], dtype=np.int64)
    while True:
        starts = rng.integers(0, ids.size - seq - 1, bsz)
        window = np.stack([ids[s:s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def train(steps=150, seq=128, bsz=8, seed=0, log_every=25, lr=3e-3):
    """Train; return the list of losses."""
    vocab = len(set(TEXT))
    params = init_params(vocab, seed=seed)
    opt = Adam(params, lr=lr)
    data = batches(TEXT, seq, bsz, np.random.default_rng(seed))
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        tokens, targets = next(data)
        loss, grads = loss_and_grads(params, tokens, targets)
        opt.step(params, grads)
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss:.3f}  ({time.perf_counter() - t0:.1f} s)")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    losses = train(args.steps)
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
