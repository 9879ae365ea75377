"""Train a small attention language model in PyTorch on the CPU with numbafa attention.

Model (character level, two pre-norm transformer blocks)::

    x = E[tokens]                                              [B, S, C]
    per block:
        q, k, v = norm(x) Wq, Wk, Wv -> [B, S, H, D]           (GQA: fewer KV heads)
        a = numbafa.torch.attention(q, k, v, causal=True, window=W, sinks=sinks, layout="bshd")
        x = x + a Wo;  x = x + MLP(norm(x))
    logits = norm(x) Wout;  loss = mean next-token cross-entropy

``sinks`` is a ``torch.nn.Parameter`` of one logit per head (as in gpt-oss)
and trains with the rest. The same steps are then run with PyTorch's
``scaled_dot_product_attention`` (the window as a dense S x S mask, no sinks:
SDPA has none) for comparison of time per step and of the memory autograd
keeps for the backward (bytes of saved tensors, counted with
``torch.autograd.graph.saved_tensors_hooks``).

    python examples/train_torch.py              # 300 steps, batch 4 x 256 tokens (< 1 min on 2 idle cores)
    python examples/train_torch.py --long       # 1000 steps, batch 4 x 1024 tokens

OpenMP's default wait policy serves such a mixed loop best (docs/frameworks.md, "Threads").
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import numbafa.torch

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way. "
)


def numbafa_attention(q, k, v, sinks, window):
    return numbafa.torch.attention(q, k, v, causal=True, window=window, sinks=sinks, layout="bshd")


def sdpa_attention(q, k, v, sinks, window):
    """SDPA with the sliding window as a dense boolean mask (no sinks)."""
    del sinks
    s = q.shape[1]
    i = torch.arange(s)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    rep = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))                # [B, H, S, D]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self, channels, heads, kv_heads, head_dim, window, attention):
        super().__init__()
        self.shape, self.window, self.attention = (heads, kv_heads, head_dim), window, attention
        self.norm1, self.norm2 = torch.nn.RMSNorm(channels), torch.nn.RMSNorm(channels)
        self.wq = torch.nn.Linear(channels, heads * head_dim, bias=False)
        self.wkv = torch.nn.Linear(channels, 2 * kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, channels, bias=False)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(channels, 4 * channels), torch.nn.GELU(),
                                       torch.nn.Linear(4 * channels, channels))

    def forward(self, x):
        heads, kv_heads, head_dim = self.shape
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, heads, head_dim)
        k, v = self.wkv(h).view(b, s, 2, kv_heads, head_dim).unbind(2)
        a = self.attention(q, k, v, self.sinks, self.window)
        x = x + self.wo(a.reshape(b, s, heads * head_dim))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, vocab, attention, channels=64, heads=4, kv_heads=2, head_dim=16, window=64, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, channels)
        self.blocks = torch.nn.ModuleList(Block(channels, heads, kv_heads, head_dim, window, attention)
                                          for _ in range(layers))
        self.norm = torch.nn.RMSNorm(channels)
        self.out = torch.nn.Linear(channels, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def batches(data, seq, bsz, generator):
    """Random windows of the text: (tokens, next tokens), each [bsz, seq]."""
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (bsz,), generator=generator)
        idx = starts[:, None] + torch.arange(seq + 1)
        chunk = data[idx]
        yield chunk[:, :-1], chunk[:, 1:]


def saved_bytes(model, tokens, targets):
    """Bytes of the tensors autograd keeps for the backward of one step (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def train(attention, steps=300, seq=256, bsz=4, window=64, lr=3e-3, seed=0, log_every=50, log=print):
    """Train from a fixed seed; return (losses, seconds per step, saved bytes per step, model)."""
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * (1 + 4 * seq // len(TEXT))])
    torch.manual_seed(seed)
    model = Model(len(chars), attention, window=window)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    stream = batches(data, seq, bsz, torch.Generator().manual_seed(seed))
    memory = saved_bytes(model, *next(stream))   # also the warm-up step (kernel load), not timed
    losses, start = [], time.perf_counter()
    for step in range(steps):
        tokens, targets = next(stream)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"  step {step:4d}  loss {loss.item():.3f}")
    return losses, (time.perf_counter() - start) / max(steps, 1), memory, model


#: The table's "last 10 mean": the loss averaged over the last LAST steps (one step's loss is noisy).
LAST = 10


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300; 1000 with --long)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 256; 1024 with --long)")
    parser.add_argument("--window", type=int, default=64, help="sliding window, in keys (default 64)")
    parser.add_argument("--long", action="store_true", help="a longer run: 1000 steps of 1024 tokens")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the SDPA comparison")
    args = parser.parse_args(argv)
    steps = args.steps or (1000 if args.long else 300)
    seq = args.seq or (1024 if args.long else 256)
    runs = [("numbafa (window + sinks)", numbafa_attention)]
    if not args.no_sdpa:
        runs.append(("SDPA (dense window mask, no sinks)", sdpa_attention))
    results = {}
    for name, attention in runs:
        print(f"{name}: {steps} steps, batch 4, seq {seq}, window {args.window}")
        losses, per_step, memory, model = train(attention, steps=steps, seq=seq, window=args.window)
        results[name] = (losses, per_step, memory)
        if attention is numbafa_attention:
            sinks = [round(float(s), 2) for s in model.blocks[0].sinks.detach()]
            print(f"  trained sinks of block 0: {sinks}")
    print(f"\n{'attention':36s} {'first loss':>10s} {f'last {LAST} mean':>12s} {'ms/step':>8s} "
          f"{'saved MiB/step':>15s}")
    for name, (losses, per_step, memory) in results.items():
        last = sum(losses[-LAST:]) / len(losses[-LAST:])
        print(f"{name:36s} {losses[0]:10.3f} {last:12.3f} {per_step * 1e3:8.1f} {memory / 2**20:15.2f}")
    print(f"(first loss: the first step's; last {LAST} mean: the loss averaged over the last {LAST} steps)")


if __name__ == "__main__":
    main()
