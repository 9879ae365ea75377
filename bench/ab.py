"""This tree's kernels against another revision's, alternated in one process.

    python bench/ab.py REV [--shape B H S D] [--kv-heads HKV] [--full] [--passes forward backward]
        [--rounds 15] [--seconds 0.2]

On a shared machine a process's speed drifts by more than the changes worth measuring (on a
2-core VM, one shape's medians moved by 30 % between processes minutes apart); the calls of two
trees alternated in one process meet the same drift. The revision's ``numbafa/`` is taken from
git (``git archive``) and imported as a second package, ``numbafa_<rev>``, with its own kernel
cache (its sources hash differently) and its own kernel table
(``numbafa.compiler.linking.PACKAGE``; in a revision from before it, 2026-12-04 to -07, the
table's and the cells' symbol names are renamed after the copy, :func:`own_symbols`: otherwise
one copy's calls could run the other's work items). Both trees run ``numbafa.nb``'s passes from
``@njit`` loops on the same float32 inputs (q ``[B, H, D, S]``, k and v ``[B, HKV, D, S]``), the
``numbafa`` on ``sys.path`` as "new", the revision as "old", and the same GEMM path
(``NUMBAFA_GEMM``). Each round times a run of calls of each tree (about ``--seconds`` each), in
alternating order. Prints per pass the medians per call, the median over rounds of new / old
with its range, and whether the two trees' outputs are bit-identical.

Against the tree itself (``REV`` = ``HEAD`` with no changes) the ratio shows the resolution of
the method on the machine at hand.
"""

from __future__ import annotations

import argparse
import importlib
import io
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time

import numba
import numpy as np
from layouts import paired

REPO = pathlib.Path(__file__).resolve().parents[1]


def extract(rev: str, into: pathlib.Path) -> str:
    """Unpack revision ``rev``'s ``numbafa/`` under ``into`` as ``numbafa_<sha>``; its name."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=10", rev], capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"bench/ab.py: {rev!r} is not a revision of {REPO}: {sha.stderr.strip()}")
    name = f"numbafa_{sha.stdout.strip()}"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "numbafa"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "numbafa").rename(into / name)
    if not (has_own_table(into / name) or own_symbols(into / name)):
        raise SystemExit(f"bench/ab.py: {rev} is older than the kernel table (numbafa.compiler.linking, "
                         f"2026-12-04): nothing to measure against")
    return name


def has_own_table(package_dir: pathlib.Path) -> bool:
    """Whether the package at ``package_dir`` names its kernel table after itself
    (``compiler/linking.py``'s ``PACKAGE``), so that a copy of it under another name keeps its own."""
    linking = package_dir / "compiler" / "linking.py"
    return linking.is_file() and "\nPACKAGE = " in linking.read_text()


#: A revision's symbol names from before ``numbafa.compiler.linking.PACKAGE`` (2026-12-04 to -07).
_FIXED_SYMBOLS = ('CELL_PREFIX = "numbafa.apart$"', 'TABLE_SYMBOL = "numbafa.kernels$table"')


def own_symbols(package_dir: pathlib.Path) -> bool:
    """Rename the two global symbols of a revision from before ``PACKAGE`` after the copy's name
    (``package_dir``'s), as ``PACKAGE`` does since: otherwise both copies define the kernel table
    under one symbol, and one copy's calls run the other's work items. Only those two string
    constants change. Whether it found them (False: a revision older than the kernel table)."""
    linking = package_dir / "compiler" / "linking.py"
    text = linking.read_text() if linking.is_file() else ""
    if not all(line in text for line in _FIXED_SYMBOLS):
        return False
    for line in _FIXED_SYMBOLS:
        text = text.replace(line, line.replace('"numbafa.', f'"{package_dir.name}.'))
    linking.write_text(text)
    return True


def loops(nb):
    """``@njit`` loops of ``n`` calls of ``nb``'s forward and backward (one set per package)."""
    @numba.njit
    def forward(n, plan, q, k, v, o, lse):
        for _ in range(n):
            nb.attention_fwd(plan, q, k, v, o, lse)

    @numba.njit
    def backward(n, plan, q, k, v, o, dy, lse, dq, dk, dv):
        for _ in range(n):
            nb.attention_bwd(plan, q, k, v, o, dy, lse, dq, dk, dv)
    return forward, backward


class Tree:
    """One package's plan, output arrays and passes (``calls(pass_, n)``)."""

    def __init__(self, package, q, k, v, o, dy, lse, causal):
        nb = importlib.import_module(package.__name__ + ".nb")
        self.plan = nb.plan(q, k, v, use_causal_mask=causal)
        self.outs = {"forward": (np.empty_like(o), np.empty_like(lse)),
                     "backward": (np.empty_like(q), np.empty_like(k), np.empty_like(v))}
        self.args = (q, k, v, o, dy, lse)
        self.forward, self.backward = loops(nb)

    def calls(self, pass_: str, n: int) -> None:
        q, k, v, o, dy, lse = self.args
        if pass_ == "forward":
            self.forward(n, self.plan, q, k, v, *self.outs["forward"])
        else:
            self.backward(n, self.plan, q, k, v, o, dy, lse, *self.outs["backward"])


def measure(new: Tree, old: Tree, pass_: str, rounds: int, seconds: float) -> dict:
    """Seconds per call of both trees over ``rounds`` alternated rounds, and the outputs' identity."""
    for tree in (new, old):
        tree.calls(pass_, 1)
    identical = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(new.outs[pass_], old.outs[pass_]))
    start = time.perf_counter()
    new.calls(pass_, 1)
    n = max(1, int(seconds / max(time.perf_counter() - start, 1e-7)))
    t_new, t_old = (t / n for t in paired(lambda: new.calls(pass_, n), lambda: old.calls(pass_, n), 0.0, rounds))
    ratio = t_new / t_old
    return dict(new=float(np.median(t_new)), old=float(np.median(t_old)), ratio=float(np.median(ratio)),
                low=float(ratio.min()), high=float(ratio.max()), calls=n, identical=identical)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the revision to measure against (a git commit, tag or branch)")
    p.add_argument("--shape", nargs=4, type=int, default=[1, 1, 128, 64], metavar=("B", "H", "S", "D"))
    p.add_argument("--kv-heads", type=int, default=None, metavar="HKV",
                   help="KV heads (GQA, MQA), a divisor of H; default H")
    p.add_argument("--full", action="store_true", help="no causal mask")
    p.add_argument("--passes", nargs="+", default=["forward", "backward"], choices=["forward", "backward"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seconds", type=float, default=0.2, help="length of one tree's run of calls in a round")
    args = p.parse_args(argv)

    import numbafa
    b, h, s, d = args.shape
    hkv = h if args.kv_heads is None else args.kv_heads
    if hkv < 1 or h % hkv:
        p.error(f"--kv-heads must divide H = {h}, got {hkv}")
    causal = not args.full
    rng = np.random.default_rng(0)
    q, dy = (rng.standard_normal((b, h, d, s), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, hkv, d, s), dtype=np.float32) for _ in range(2))
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=causal)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        name = extract(args.rev, pathlib.Path(tmp))
        sys.path.insert(0, tmp)
        try:
            old_package = importlib.import_module(name)
            new, old = (Tree(pkg, q, k, v, o, dy, lse, causal) for pkg in (numbafa, old_package))
            heads = f"H{h}" if hkv == h else f"H{h}/{hkv}"
            print(f"B{b} {heads} S{s} D{d} {'causal' if causal else 'full'} float32: new = {numbafa.__file__}, "
                  f"old = {args.rev} ({name}); {args.rounds} alternated rounds, medians")
            for pass_ in args.passes:
                r = measure(new, old, pass_, args.rounds, args.seconds)
                rows.append(dict(r, pass_=pass_))
                print(f"  {pass_:<8} new {r['new'] * 1e6:10.1f} us  old {r['old'] * 1e6:10.1f} us  new/old "
                      f"{r['ratio']:.3f} [{r['low']:.3f}-{r['high']:.3f}]  ({r['calls']} calls a run)  "
                      f"bit-identical: {'yes' if r['identical'] else 'no'}")
        finally:
            sys.path.remove(tmp)
    return rows


if __name__ == "__main__":
    main()
