"""``python -m numbafa`` / ``numbafa``: forward + backward on a built-in default, checked and timed.

Default: batch 1, 8 q-heads, 2 KV heads, seqlen 2048, head_dim 128, causal,
float32 and bf16 (``mixed_precision=True``). For each dtype it runs
``attention_fwd`` and ``attention_bwd`` (the first calls, which compile or
load the kernels, are reported on their own; a real compilation is announced
on stderr as it starts), times
``--repeats`` calls of each, and checks the outputs of the first KV-head
group of batch 0 (all of its q-heads, all rows) against the float64 golden,
computed in blocks of query rows so that its memory does not grow with
seqlen**2. Before running, the memory the arrays need is estimated; a size
that cannot fit is refused.

Exit code 0: all checks pass; 1: a check failed; 2: bad options, or a size
that does not fit in memory (a one-line message, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import time
from typing import Optional

import numpy as np
from numba.core import event

from . import golden
from .api import attention_bwd, attention_fwd
from .info import backend_info
from .compiler.jit import COMPILE_TIME, cache_info
from .conventions.dtypes import bf16_dtype
from .layout import MAX_BOUND, cu_seqlens_to_bounds
from .platform.onednn import gemm_path
from .checks.validation import SOFTCAP_MAX, SOFTCAP_MIN
from .pipeline import ahead
from .version import __version__

#: Acceptance rule: max|a - e| <= atol + rtol * max|e|, atol per dtype, rtol per (dtype, output);
#: the values of tests/_tolerances.py. Shown as max|a - e| / max|e| <= rtol + atol / max|e|.
ATOL = {"float32": 1e-5, "bf16": 1e-5, "float16": 1e-5, "float64": 1e-13}
RTOL = {"float32": 1e-4, "bf16": 2e-2, "float16": 2.5e-3, "float64": 1e-10}
RTOL_LSE = {"float32": 1e-5, "bf16": 2e-2, "float16": 2.5e-3, "float64": 1e-10}
#: The NumPy dtype of each --dtype name (bf16 is ml_dtypes', imported when used).
_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64}

#: Score entries (query rows x keys) the golden check materialises at once: a float64
#: block of 32 MiB, a few of them alive at a time.
CHECK_BLOCK_ENTRIES = 1 << 22

DESCRIPTION = """\
Forward + backward of numbafa's flash attention on a built-in default shape,
timed and checked against the float64 golden."""


EPILOG = "example: numbafa --seqlen 4096 --head-dim 64 --dtype bf16 --json\n\n" + textwrap.fill(
    "Exit status: 0 all checks passed, 1 a check failed, 2 bad options (NUMBAFA_GEMM included) or a "
    "size that does not fit in memory. The first call of each dtype compiles the kernels, once (they "
    f"are cached on disk): {COMPILE_TIME}.", 79) + "\n"


def _rule(dtype: str, output: str, err: float, scale: float) -> dict:
    """The acceptance rule for one output, and its relative form for display.

    ``max_rel_err = max|a - e| / max|e|`` passes when ``<= rel_bound = rtol +
    atol / max|e|``, which is the rule itself. When ``max|e| = 0`` there is no
    relative error (both are None) and the rule is ``max|a - e| <= atol``. (dq, dk and dv
    whose exact value is 0 come with the pass's largest gradient element as ``scale``:
    :func:`_check`.)
    """
    rtol = RTOL_LSE[dtype] if output == "lse" else RTOL[dtype]
    atol = ATOL[dtype]
    ok = bool(err <= atol + rtol * scale)
    if scale > 0:
        return dict(max_abs_err=err, max_rel_err=err / scale, rel_bound=rtol + atol / scale, ok=ok)
    return dict(max_abs_err=err, max_rel_err=None, rel_bound=None, ok=ok)


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


def _number(text: str, convert, ok, expected: str):
    """``convert(text)``, an ``ArgumentTypeError`` saying ``expected`` unless it converts and is ``ok``."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _dropout(text: str) -> float:
    return _number(text, float, lambda p: 0.0 <= p < 1.0, "a probability in [0, 1)")


def _softcap(text: str) -> float:
    return _number(text, float, lambda c: SOFTCAP_MIN <= c <= SOFTCAP_MAX,
                   f"a soft cap in [{SOFTCAP_MIN:.8g}, {SOFTCAP_MAX:.8g}]")


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's standard slopes for ``heads`` heads (Press et al.): ``2**(-8 i / heads)``, i = 1..heads."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def _seed(text: str) -> int:
    return _number(text, int, lambda s: 0 <= s < 2 ** 64, "an integer seed in [0, 2**64)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="numbafa", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=_positive_int, default=1, help="batch size (default: %(default)s)")
    p.add_argument("--heads", type=_positive_int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=_positive_int, default=2,
                   help="KV heads; --heads must be a multiple (default: %(default)s)")
    p.add_argument("--seqlen", type=_positive_int, default=2048,
                   help="sequence length of q and k (default: %(default)s)")
    p.add_argument("--head-dim", type=_positive_int, default=128,
                   help="head dimension of q and k (default: %(default)s)")
    p.add_argument("--head-dim-v", type=_positive_int, default=None,
                   help="head dimension of v, o and their gradients, e.g. 128 with --head-dim 192 as "
                        "DeepSeek's MLA (default: --head-dim)")
    p.add_argument("--dtype", choices=("float32", "bf16", "float16", "float64", "both"), default="both",
                   help="input dtype; bf16 and float16 run with mixed_precision=True; both: float32 and bf16 "
                        "(default: %(default)s)")
    p.add_argument("--mask", choices=("causal", "full"), default="causal",
                   help="causal or full attention (default: %(default)s)")
    p.add_argument("--window", type=_positive_int, default=None,
                   help="sliding window in keys, needs --mask causal (default: no window)")
    p.add_argument("--sinks", type=_positive_int, default=None,
                   help="attention sinks per head (default: no sinks)")
    p.add_argument("--packing", type=_lengths, default=None,
                   help="pack sequences of these lengths (summing to --seqlen), e.g. 1000,1048 "
                        "(default: one sequence)")
    p.add_argument("--dropout", type=_dropout, default=0.0, metavar="P",
                   help="attention dropout probability in [0, 1) (default: %(default)s)")
    p.add_argument("--softcap", type=_softcap, default=None, metavar="CAP",
                   help="logit soft cap: scores become CAP * tanh(s / CAP) (default: none)")
    p.add_argument("--alibi", action="store_true",
                   help="ALiBi with the standard slopes 2**(-8 i / heads) (default: none)")
    p.add_argument("--seed", type=_seed, default=0, metavar="S",
                   help="seed of the dropout mask (default: %(default)s)")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed calls per pass; the median is reported (default: %(default)s)")
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
    if args.packing is not None and args.seqlen > MAX_BOUND:
        p.error(f"--packing needs --seqlen <= {MAX_BOUND} (float32 bounds), got {args.seqlen}")


# ---------------------------------------------------------------------------
# Memory: estimated up front, so that an impossible size is a message, not a traceback.
# ---------------------------------------------------------------------------

def _estimate_bytes(args) -> int:
    """Peak memory of :func:`run`, roughly (one dtype at a time; float32, the larger).

    In units of a q-sized array ``Q = batch * heads * head_dim * seqlen`` and a
    k-sized one ``K``: q and dy (drawn in float64 first), k, v, o and the
    gradients kept, plus the outputs and float32 dK/dV partials of the timed
    calls; the golden check adds float64 copies of one KV group and a few
    row blocks of CHECK_BLOCK_ENTRIES scores.
    """
    d = max(args.head_dim, _head_dim_v(args))   # an upper bound with two head dims
    q = args.batch * args.heads * d * args.seqlen
    k = args.batch * args.kv_heads * d * args.seqlen
    sinks = args.batch * args.heads * (args.sinks or 0)
    total = 4 * (6 * q + 8 * k + sinks) + 8 * 2 * args.seqlen
    if not args.no_check:
        group = (args.heads // args.kv_heads) * d * args.seqlen
        total += 8 * (6 * group + 6 * d * args.seqlen + 8 * max(CHECK_BLOCK_ENTRIES, args.seqlen))
    return total


def _available_bytes() -> Optional[int]:
    """Memory available to this process: MemAvailable (Linux), else the physical memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def _human(n: float) -> str:
    """``976.6 KiB``, ``2.8 GiB``, ..."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    i = min(len(units) - 1, int(math.log(max(n, 1), 1024)))
    return f"{n / 1024 ** i:.1f} {units[i]}" if i else f"{int(n)} B"


_REDUCE = "reduce --seqlen, --heads, --kv-heads, --batch or --head-dim"


def _check_memory(p: argparse.ArgumentParser, args) -> None:
    """Exit 2 with one line if the arrays cannot fit in the available memory."""
    need, available = _estimate_bytes(args), _available_bytes()
    if available is None or need <= available:
        return
    unchecked = _estimate_bytes(argparse.Namespace(**{**vars(args), "no_check": True}))
    hint = " (or add --no-check)" if unchecked <= available else ""
    p.exit(2, f"{p.prog}: error: this problem needs about {_human(need)} of memory, only "
              f"{_human(available)} available; {_REDUCE}{hint}\n")


# ---------------------------------------------------------------------------
# Progress and the compile announcement (stderr: stdout holds the table or the JSON).
# ---------------------------------------------------------------------------

class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 24):
        self.total, self.done, self.width = total, 0, width
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def _bar_open(self) -> bool:
        """True while a terminal bar line is drawn without its newline."""
        return self.enabled and self.tty and 0 < self.done < self.total

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        end = "" if self.tty and self.done < self.total else "\n"
        prefix = "\r" if self.tty else ""
        print(f"{prefix}[{bar}] {self.done}/{self.total} {label:<40}", end=end, file=sys.stderr, flush=True)

    def end_line(self) -> None:
        """Finish a terminal bar line drawn without its newline, if any."""
        if self._bar_open():
            print(file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A message on a line of its own (always shown, also with --json)."""
        self.end_line()
        print(text, file=sys.stderr, flush=True)


#: The longest the backward's first call waits for the second process (a cold compile takes
#: 20-30 s of CPU); then it is ended and the backward compiles in this process.
_PREFETCH_WAIT = 600


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _CompileNotice(event.Listener):
    """Prints the compile notice when the first real compilation starts, once; meanwhile, as a
    logging filter, holds back :mod:`numbafa.compiler.runtime`'s per-kernel warnings, which it replaces.

    Numba's ``"numba:compile"`` event fires for a compilation, not for a load
    from the on-disk cache: with the kernels in the cache nothing is printed.
    With ``prefetch`` (``[dtype name, dropout, score variants]`` of the backward), that first
    compilation also starts a second process that compiles the backward into the disk cache
    while this one compiles the forward (:func:`numbafa.pipeline.ahead.start`, where the cache
    is on and there are two cores or more); :meth:`wait` waits for it before the backward's
    first call, which then loads it.
    """

    def __init__(self, progress: "Progress", name: str, prefetch=None):
        self.progress, self.name, self.shown = progress, name, False
        self.prefetch, self.ahead = prefetch, None

    def on_start(self, ev):
        if not self.shown:
            self.shown = True
            self.progress.note(_compile_notice(self.name))
            if self.prefetch is not None and ahead.refusal() is None and _cores() >= 2:
                try:
                    self.ahead = ahead.start([["backward", *self.prefetch]], stderr=subprocess.DEVNULL)
                except OSError:   # no process to be had: the backward compiles here, as without the cache
                    return
                self.progress.note(f"first {self.name} calls: the backward's kernels compile meanwhile in a "
                                   f"second process, then load from the cache")

    def on_end(self, ev):
        pass

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("numbafa: compiling")

    def wait(self) -> None:
        """Wait for the second process, if one runs, at most :data:`_PREFETCH_WAIT` seconds (if it
        failed or was ended, the backward compiles here)."""
        if self.ahead is not None:
            try:
                self.ahead.wait(timeout=_PREFETCH_WAIT)
            except TimeoutError:
                self.stop()

    def stop(self) -> None:
        """End the second process if it still runs (the first calls failed or were interrupted)."""
        if self.ahead is not None:
            self.ahead.cancel()


@contextlib.contextmanager
def _compile_announced(progress: "Progress", name: str, prefetch=None):
    """The first calls of dtype ``name``: one CLI line if they compile, none if they load the cache
    (and with ``prefetch``, the backward compiled in a second process meanwhile: :class:`_CompileNotice`)."""
    notice = _CompileNotice(progress, name, prefetch)
    logger = logging.getLogger("numbafa")
    logger.addFilter(notice)
    try:
        with event.install_listener("numba:compile", notice):
            yield notice
    finally:
        logger.removeFilter(notice)
        notice.stop()


def _compile_notice(name: str) -> str:
    """The line announcing that the first calls of a dtype compile the kernels."""
    cache = cache_info()
    where = f"cached in {cache['dir']}" if cache["enabled"] else f"not cached: {cache['reason']}"
    return f"first {name} calls: compiling the kernels, once ({where}); {COMPILE_TIME}"


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------

def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _errors(actual, expected) -> tuple:
    """``(max|a - e|, max|e|)``; equal infinities are no error, NaN propagates."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if not a.size:
        return 0.0, 0.0
    with np.errstate(invalid="ignore"):
        diff = np.where(a == e, 0.0, np.abs(a - e))
    finite = np.abs(e[np.isfinite(e)])
    return float(diff.max()), float(finite.max()) if finite.size else 0.0


def _head_dim_v(args) -> int:
    """``--head-dim-v``, defaulting to ``--head-dim``."""
    return args.head_dim if args.head_dim_v is None else args.head_dim_v


def run(args, progress: Progress) -> list:
    """Run every requested dtype; return one record per (dtype, pass)."""
    b, h, hkv, s, d = args.batch, args.heads, args.kv_heads, args.seqlen, args.head_dim
    dv = _head_dim_v(args)
    causal = args.mask == "causal"
    opts = dict(use_causal_mask=causal, sliding_window=args.window, mixed_precision=True)
    if args.dropout:
        opts.update(dropout_p=args.dropout, seed=args.seed)
    if args.softcap:
        opts["softcap"] = args.softcap
    if args.alibi:
        opts["alibi_slopes"] = alibi_slopes(h)
    rng = np.random.default_rng(0)
    sinks = rng.standard_normal((b, h, args.sinks)) if args.sinks else None
    if args.packing:
        opts["bound_min"], opts["bound_max"] = cu_seqlens_to_bounds(np.cumsum((0,) + args.packing))
    visible = 0.5 if causal else 1.0  # share of the score matrix computed (flash-attn convention)
    fwd_flops = 2.0 * b * h * s * s * (d + dv) * visible        # S = Q^T K, O = P V
    bwd_flops = 2.0 * b * h * s * s * (3 * d + 2 * dv) * visible  # S, dP = dO V^T, dV, dK, dQ
    records = []
    dtypes = ("float32", "bf16") if args.dtype == "both" else (args.dtype,)
    for name in dtypes:
        dtype = bf16_dtype() if name == "bf16" else np.dtype(_DTYPES[name])
        if sinks is not None:   # float32 sinks (float64 with float64 inputs: a float64 gradient)
            opts["sinks_ref"] = sinks.astype(np.float64 if name == "float64" else np.float32)
        q = rng.standard_normal((b, h, d, s)).astype(dtype)
        k = rng.standard_normal((b, hkv, d, s)).astype(dtype)
        v = rng.standard_normal((b, hkv, dv, s)).astype(dtype)
        dy = rng.standard_normal((b, h, dv, s)).astype(dtype)
        lse_layout = "neuron" if s % 128 == 0 else "natural"
        # the run's first dtype compiles the kernels (if the cache lacks them): its backward in a
        # second process meanwhile; a later dtype adds little to compile (docs/performance.md)
        prefetch = [ahead.dtype_name(name), bool(args.dropout), bool(args.softcap or args.alibi)] if name == dtypes[0] \
            else None
        with _compile_announced(progress, name, prefetch) as notice:
            t0 = time.perf_counter()
            o, lse = attention_fwd(q, k, v, lse_layout=lse_layout, **opts)
            t1 = time.perf_counter()
            notice.wait()
            grads = attention_bwd(q, k, v, o, dy, lse, **opts)
            first = {"forward": t1 - t0, "backward": time.perf_counter() - t1}
        progress.step(f"{name}: first calls")
        fwd_ms = _median_ms(lambda: attention_fwd(q, k, v, lse_layout=lse_layout, **opts), args.repeats)
        progress.step(f"{name}: forward x{args.repeats}")
        bwd_ms = _median_ms(lambda: attention_bwd(q, k, v, o, dy, lse, **opts), args.repeats)
        progress.step(f"{name}: backward x{args.repeats}")
        errors = {}
        if not args.no_check:
            errors = _check(q, k, v, o, lse, dy, grads, opts, hkv)
            progress.step(f"{name}: golden check")
        for pass_name, ms, flops, outs in (("forward", fwd_ms, fwd_flops, ("o", "lse")),
                                           ("backward", bwd_ms, bwd_flops, ("dq", "dk", "dv", "dsinks"))):
            rec = {"dtype": name, "pass": pass_name, "ms": ms, "gflops": flops / ms / 1e6,
                   "first_call_s": first[pass_name], "shape": dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d,
                                                       head_dim_v=dv),
                   "mask": args.mask, "window": args.window, "sinks": args.sinks, "dropout": args.dropout,
                   "packing": list(args.packing) if args.packing else None, "softcap": args.softcap,
                   "alibi": args.alibi}
            rec.update(_summary(name, {out: errors[out] for out in outs if out in errors}))
            records.append(rec)
    return records


def _summary(dtype: str, errors: dict) -> dict:
    """The check fields of one record (none when unchecked)."""
    if not errors:
        return {}
    rules = {out: _rule(dtype, out, err, scale) for out, (err, scale) in errors.items()}
    fields = {key: {out: r[key] for out, r in rules.items()} for key in ("max_abs_err", "max_rel_err", "rel_bound")}
    fields["failed"] = [out for out, r in rules.items() if not r["ok"]]
    fields["ok"] = not fields["failed"]
    return fields


def _row_bounds(seqlen_q: int, seqlen_k: int, opts: dict) -> tuple:
    """Key bounds ``[lo, hi)`` of each query row that equal the options' mask.

    Causal keeps ``j <= i``, a window ``w`` also ``j >= i - w + 1``, packing
    ``bound_min[i] <= j < bound_max[i]`` (clamped by the two before), as in
    :func:`numbafa.golden.allowed_mask`. As explicit bounds they stay right
    for any block of rows.
    """
    rows = np.arange(seqlen_q, dtype=np.float64)
    packing = opts.get("bound_min") is not None
    lo = np.asarray(opts["bound_min"], np.float64) if packing else np.zeros(seqlen_q)
    hi = np.asarray(opts["bound_max"], np.float64) if packing else np.full(seqlen_q, float(seqlen_k))
    window = min(opts.get("sliding_window") or 0, seqlen_k)
    if opts.get("use_causal_mask"):
        hi = np.minimum(hi, rows + 1)
        if window > 0:
            lo = np.maximum(lo, rows - window + 1)
    return lo, hi


def _golden_blocked(q, k, v, dy, sinks, opts, block_rows: int) -> tuple:
    """The float64 golden forward and backward, ``block_rows`` query rows at a time.

    Rows are independent in the forward and in dq; dk, dv and dsinks are sums
    over rows. With dropout, each block takes its rows of the keep mask
    (:func:`numbafa.golden.keep_mask` from the block's first row); with ALiBi, its rows of the
    ALiBi terms as an explicit bias (their distances count from the block's first row). So the
    blocks give the full golden's results with score
    matrices of ``block_rows x seqlen_k`` instead of ``seqlen_q x seqlen_k``.

    Returns
    -------
    o, lse (natural layout), (dq, dk, dv[, dsinks]) : float64
    """
    seqlen_q = q.shape[3]
    lo, hi = _row_bounds(seqlen_q, k.shape[3], opts)
    o, dq = np.zeros(dy.shape), np.zeros(q.shape)
    lse = np.zeros(q.shape[:2] + (seqlen_q,))
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    dsinks = None if sinks is None else np.zeros(np.shape(sinks))
    bs, nheads, seqlen_k = q.shape[0], q.shape[1], k.shape[3]
    for r0 in range(0, seqlen_q, block_rows):
        rows = slice(r0, min(r0 + block_rows, seqlen_q))
        bounds = dict(bound_min=lo[rows], bound_max=hi[rows])
        p = opts.get("dropout_p", 0.0)
        if p:
            n_rows = rows.stop - r0
            bounds.update(dropout_p=p, keep=golden.keep_mask(bs, nheads, n_rows, seqlen_k, p, opts["seed"],
                                                              first_row=r0))
        bounds["softcap"] = opts.get("softcap")
        slopes = opts.get("alibi_slopes")
        if slopes is not None:
            i = np.arange(rows.start, rows.stop)[:, None]
            dist = np.abs(i + seqlen_k - seqlen_q - np.arange(seqlen_k)[None, :])
            bounds["bias"] = -(np.asarray(slopes, np.float64)[None, :, None, None] * dist)
        o[..., rows], lse[..., rows] = golden.attention_fwd(q[..., rows], k, v, sinks=sinks, **bounds)
        grads = golden.attention_bwd(q[..., rows], k, v, None, dy[..., rows], None, sinks_ref=sinks, **bounds)
        dq[..., rows] = grads[0]
        dk += grads[1]
        dv += grads[2]
        if dsinks is not None:
            dsinks += grads[3]
    return o, lse, (dq, dk, dv) + (() if dsinks is None else (dsinks,))


def _check(q, k, v, o, lse, dy, grads, opts, hkv) -> dict:
    """Errors of batch 0, KV head 0 (all its q-heads) against the float64 golden."""
    n_rep = q.shape[1] // hkv
    heads = slice(0, n_rep)
    sub = lambda x: x[:1, heads]  # noqa: E731
    sinks = opts.get("sinks_ref")
    sinks = None if sinks is None else sinks[:1, heads]
    if opts.get("alibi_slopes") is not None:
        opts = dict(opts, alibi_slopes=opts["alibi_slopes"][heads])
    block_rows = max(1, CHECK_BLOCK_ENTRIES // max(k.shape[3], 1))
    o_exp, lse_exp, expected = _golden_blocked(sub(q), k[:1, :1], v[:1, :1], sub(dy), sinks, opts, block_rows)
    lse_nat = lse if lse.ndim == 3 else lse.transpose(0, 1, 3, 2).reshape(lse.shape[0], lse.shape[1], -1)
    errors = {"o": _errors(sub(o), o_exp), "lse": _errors(sub(lse_nat), lse_exp)}
    got = (sub(grads[0]), grads[1][:1, :1], grads[2][:1, :1]) + \
        ((grads[3][:1, heads],) if len(grads) > 3 else ())
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        errors[name] = _errors(g, e)
    # A gradient that is exactly 0 (one visible key: P = 1, dS = 0; window 1, seqlen 1) is
    # computed from rounded terms that cancel; its error is measured against the largest
    # gradient element of the pass, as docs/numerics.md states the bf16 error.
    largest = max(errors[name][1] for name in ("dq", "dk", "dv"))
    for name in ("dq", "dk", "dv"):
        err, scale = errors[name]
        errors[name] = (err, scale if scale > 0 else largest)
    return errors


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------

def _failures(records) -> tuple:
    """(number of checks, ["float32 dq", ...] of the failed ones)."""
    n = sum(len(r.get("max_abs_err", {})) for r in records)
    return n, [f"{r['dtype']} {out}" for r in records for out in r.get("failed", [])]


def _verdict(records) -> str:
    n, failed = _failures(records)
    if not n:
        return "not checked (--no-check)"
    if not failed:
        return f"all {n} checks passed"
    by_dtype = {}
    for item in failed:
        dtype, out = item.split(" ")
        by_dtype.setdefault(dtype, []).append(out)
    return f"{len(failed)} of {n} checks FAILED: " + "; ".join(f"{d} {', '.join(o)}" for d, o in by_dtype.items())


def _format_error(r: dict, out: str) -> str:
    rel, bound = r["max_rel_err"][out], r["rel_bound"][out]
    if rel is None:  # max|e| = 0: the absolute rule
        return f"{out}={r['max_abs_err'][out]:.1e} abs (<={ATOL[r['dtype']]:.1e})"
    return f"{out}={rel:.1e} (<={bound:.1e})"


def _print_table(records) -> None:
    r0 = records[0]
    sh = r0["shape"]
    kv = [sh["batch"], sh["kv_heads"], sh["head_dim"], sh["seqlen"]]
    kv_text = f"k/v {kv}" if sh["head_dim_v"] == sh["head_dim"] else \
        f"k {kv}, v {[sh['batch'], sh['kv_heads'], sh['head_dim_v'], sh['seqlen']]}"
    print(f"numbafa {__version__}: q [{sh['batch']}, {sh['heads']}, {sh['head_dim']}, {sh['seqlen']}], "
          f"{kv_text}, {r0['mask']}"
          + (f", window {r0['window']}" if r0["window"] else "") + (f", {r0['sinks']} sinks" if r0["sinks"] else "")
          + (f", packed {r0['packing']}" if r0["packing"] else "")
          + (f", dropout {r0['dropout']}" if r0["dropout"] else "")
          + (f", softcap {r0['softcap']:g}" if r0.get("softcap") else "") + (", ALiBi" if r0.get("alibi") else ""))
    print(f"{'dtype':8} {'pass':9} {'median ms':>10} {'GFLOP/s':>8} {'1st call s':>10}  "
          f"max|a-e|/max|e| (bound) vs float64 golden")
    for r in records:
        errs = ", ".join(_format_error(r, out) for out in r.get("max_abs_err", {})) or "not checked"
        status = "" if "ok" not in r else ("  ok" if r["ok"] else "  FAIL")
        print(f"{r['dtype']:8} {r['pass']:9} {r['ms']:10.1f} {r['gflops']:8.1f} {r['first_call_s']:10.2f}  "
              f"{errs}{status}")
    print(_verdict(records))


def _json_safe(x):
    """NaN and infinities -> None: JSON has no such numbers."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _print_json(records) -> None:
    n, failed = _failures(records)
    doc = {"version": __version__, "ok": not failed, "checks": n, "checks_failed": failed, "results": records}
    print(json.dumps(_json_safe(doc), indent=2, allow_nan=False))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.info:
        print(json.dumps(backend_info(), indent=2))
        return 0
    try:
        gemm_path()
    except (ValueError, RuntimeError) as exc:   # NUMBAFA_GEMM set to what cannot run here
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    _check_options(parser, args)
    _check_memory(parser, args)
    n_dtypes = 2 if args.dtype == "both" else 1
    progress = Progress(n_dtypes * (3 if args.no_check else 4), enabled=not args.json)
    try:
        records = run(args, progress)
    except MemoryError:
        progress.end_line()
        parser.exit(2, f"{parser.prog}: error: out of memory (estimated need about "
                       f"{_human(_estimate_bytes(args))}); {_REDUCE}\n")
    if args.json:
        _print_json(records)
    else:
        _print_table(records)
    return 0 if all(r.get("ok", True) for r in records) else 1
