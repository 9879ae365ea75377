"""``python -m numbafa`` / ``numbafa``: forward + backward on a built-in default, checked and timed.

Default: batch 1, 8 q-heads, 2 KV heads, seqlen 2048, head_dim 128, causal,
float32 and bf16 (``mixed_precision=True``). For each dtype it runs
``attention_fwd`` and ``attention_bwd`` (the first call, which compiles,
is reported on its own), times ``--repeats`` calls of each, and checks
the outputs of the first KV-head group of batch 0 (all of its q-heads, all
rows) against the float64 golden. Exit code 0: all checks pass; 1: a check
failed; 2: bad options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import __version__, golden
from .api import attention_bwd, attention_fwd
from .blas import backend_info
from .dtypes import bf16_dtype
from .layout import cu_seqlens_to_bounds

#: Acceptance rule: max|a - e| <= 1e-5 + rtol * max|e|, rtol per (dtype, output); the
#: values of tests/_tolerances.py.
RTOL = {"float32": 1e-4, "bf16": 2e-2}
RTOL_LSE = {"float32": 1e-5, "bf16": 2e-2}


def _within_rule(dtype: str, output: str, err: float, scale: float) -> bool:
    rtol = RTOL_LSE[dtype] if output == "lse" else RTOL[dtype]
    return err <= 1e-5 + rtol * scale


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _lengths(text: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths like 127,129,256, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"sequence lengths must be positive, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="numbafa", description=__doc__.splitlines()[0],
                                epilog="Example: numbafa --seqlen 4096 --head-dim 64 --dtype bf16 --json")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--heads", type=_positive_int, default=8, help="q heads (default 8)")
    p.add_argument("--kv-heads", type=_positive_int, default=2, help="KV heads (default 2)")
    p.add_argument("--seqlen", type=_positive_int, default=2048)
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--dtype", choices=("float32", "bf16", "both"), default="both")
    p.add_argument("--mask", choices=("causal", "full"), default="causal")
    p.add_argument("--window", type=_positive_int, default=None, help="sliding window (causal only)")
    p.add_argument("--sinks", type=_positive_int, default=None, help="attention sinks per head")
    p.add_argument("--packing", type=_lengths, default=None,
                   help="pack sequences of these lengths (summing to --seqlen), e.g. 1000,1048")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per pass (median)")
    p.add_argument("--no-check", action="store_true", help="skip the golden check")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--info", action="store_true",
                   help="print numbafa.backend_info() (BLAS, threads, CPU features) as JSON and exit")
    p.add_argument("--version", action="version", version=f"numbafa {__version__}")
    return p


def _check_options(p: argparse.ArgumentParser, args) -> None:
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.window is not None and args.mask != "causal":
        p.error("--window needs --mask causal")
    if args.packing is not None and sum(args.packing) != args.seqlen:
        p.error(f"--packing lengths sum to {sum(args.packing)}, expected --seqlen {args.seqlen}")


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24):
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        end = "" if self.tty and self.done < self.total else "\n"
        prefix = "\r" if self.tty else ""
        print(f"{prefix}[{bar}] {self.done}/{self.total} {label:<40}", end=end, file=sys.stderr, flush=True)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _max_rel(actual, expected) -> tuple:
    a = np.asarray(actual, np.float64)
    err = float(np.abs(a - expected).max()) if a.size else 0.0
    scale = float(np.abs(expected).max()) if a.size else 0.0
    return err, scale


def run(args, progress: Progress) -> list:
    """Run every requested dtype; return one record per (dtype, pass)."""
    b, h, hkv, s, d = args.batch, args.heads, args.kv_heads, args.seqlen, args.head_dim
    causal = args.mask == "causal"
    opts = dict(use_causal_mask=causal, sliding_window=args.window, mixed_precision=True)
    rng = np.random.default_rng(0)
    if args.sinks:
        opts["sinks_ref"] = rng.standard_normal((b, h, args.sinks)).astype(np.float32)
    if args.packing:
        opts["bound_min"], opts["bound_max"] = cu_seqlens_to_bounds(np.cumsum((0,) + args.packing))
    visible = 0.5 if causal else 1.0  # share of the score matrix computed (flash-attn convention)
    fwd_flops = 4.0 * b * h * s * s * d * visible
    records = []
    dtypes = ("float32", "bf16") if args.dtype == "both" else (args.dtype,)
    for name in dtypes:
        dtype = bf16_dtype() if name == "bf16" else np.dtype(np.float32)
        q = rng.standard_normal((b, h, d, s)).astype(dtype)
        k, v = (rng.standard_normal((b, hkv, d, s)).astype(dtype) for _ in range(2))
        dy = rng.standard_normal((b, h, d, s)).astype(dtype)
        lse_layout = "neuron" if s % 128 == 0 else "natural"
        t0 = time.perf_counter()
        o, lse = attention_fwd(q, k, v, lse_layout=lse_layout, **opts)
        grads = attention_bwd(q, k, v, o, dy, lse, **opts)
        first = time.perf_counter() - t0
        progress.step(f"{name}: first calls (JIT compile)")
        fwd_ms = _median_ms(lambda: attention_fwd(q, k, v, lse_layout=lse_layout, **opts), args.repeats)
        progress.step(f"{name}: forward x{args.repeats}")
        bwd_ms = _median_ms(lambda: attention_bwd(q, k, v, o, dy, lse, **opts), args.repeats)
        progress.step(f"{name}: backward x{args.repeats}")
        errors = {}
        if not args.no_check:
            errors = _check(q, k, v, o, lse, dy, grads, opts, hkv)
            progress.step(f"{name}: golden check")
        for pass_name, ms, flops, outs in (("forward", fwd_ms, fwd_flops, ("o", "lse")),
                                           ("backward", bwd_ms, 2.5 * fwd_flops, ("dq", "dk", "dv", "dsinks"))):
            rec = dict(dtype=name, pass_=pass_name, ms=ms, gflops=flops / ms / 1e6,
                       first_call_s=first, shape=dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d),
                       mask=args.mask, window=args.window, sinks=args.sinks,
                       packing=list(args.packing) if args.packing else None)
            checked = {k_: errors[k_] for k_ in outs if k_ in errors}
            if checked:
                rec["max_abs_err"] = {k_: e for k_, (e, _) in checked.items()}
                rec["ok"] = all(_within_rule(name, k_, e, sc) for k_, (e, sc) in checked.items())
            records.append(rec)
    return records


def _check(q, k, v, o, lse, dy, grads, opts, hkv) -> dict:
    """Errors of batch 0, KV head 0 (all its q-heads) against the float64 golden."""
    n_rep = q.shape[1] // hkv
    heads = slice(0, n_rep)
    sub = lambda x: x[:1, heads]  # noqa: E731
    sinks = opts.get("sinks_ref")
    gopts = dict(sinks=None if sinks is None else sinks[:1, heads], bound_min=opts.get("bound_min"),
                 bound_max=opts.get("bound_max"), use_causal_mask=opts["use_causal_mask"],
                 sliding_window=opts["sliding_window"])
    o_exp, lse_exp = golden.attention_fwd(sub(q), k[:1, :1], v[:1, :1], **gopts)
    lse_nat = lse if lse.ndim == 3 else lse.transpose(0, 1, 3, 2).reshape(lse.shape[0], lse.shape[1], -1)
    errors = {"o": _max_rel(sub(o), o_exp), "lse": _max_rel(sub(lse_nat), lse_exp)}
    expected = golden.attention_bwd(sub(q), k[:1, :1], v[:1, :1], None, sub(dy), None,
                                    sinks_ref=gopts.pop("sinks"), **gopts)
    got = (sub(grads[0]), grads[1][:1, :1], grads[2][:1, :1]) + \
        ((grads[3][:1, heads],) if len(grads) > 3 else ())
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        errors[name] = _max_rel(g, e)
    return errors


def _print_table(records) -> None:
    r0 = records[0]
    sh = r0["shape"]
    print(f"numbafa {__version__}: q [{sh['batch']}, {sh['heads']}, {sh['head_dim']}, {sh['seqlen']}], "
          f"k/v [{sh['batch']}, {sh['kv_heads']}, {sh['head_dim']}, {sh['seqlen']}], {r0['mask']}"
          + (f", window {r0['window']}" if r0["window"] else "") + (f", {r0['sinks']} sinks" if r0["sinks"] else "")
          + (f", packed {r0['packing']}" if r0["packing"] else ""))
    print(f"{'dtype':8} {'pass':9} {'median ms':>10} {'GFLOP/s':>8} {'1st call s':>10}  max|err| vs float64 golden")
    for r in records:
        errs = ", ".join(f"{k}={v:.1e}" for k, v in r.get("max_abs_err", {}).items()) or "not checked"
        status = "" if "ok" not in r else ("  ok" if r["ok"] else "  FAIL")
        print(f"{r['dtype']:8} {r['pass_']:9} {r['ms']:10.1f} {r['gflops']:8.1f} {r['first_call_s']:10.1f}  "
              f"{errs}{status}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.info:
        print(json.dumps(backend_info(), indent=2))
        return 0
    _check_options(parser, args)
    n_dtypes = 2 if args.dtype == "both" else 1
    progress = Progress(n_dtypes * (3 if args.no_check else 4), enabled=not args.json)
    records = run(args, progress)
    if args.json:
        print(json.dumps({"version": __version__, "results": records}, indent=2))
    else:
        _print_table(records)
    return 0 if all(r.get("ok", True) for r in records) else 1
