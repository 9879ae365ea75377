"""Compare saved pytest-benchmark runs on figures that survive a noisy machine; plot a history.

    python -m bench.track compare BASE NEW [--threshold 10] [--sigmas 3] [--storage .benchmarks]
    python -m bench.track plot [--storage .benchmarks] [--match "h8-s2048-d128-causal backward"] --out FILE

``BASE`` and ``NEW`` are saved runs: a path to a JSON file, or a run number or name prefix
(``0001``, ``baseline``) looked up in ``--storage`` (pytest-benchmark's layout: one folder per
machine id, ``NNNN_<name or commit>.json``; the newest match wins). Benchmarks are matched by
their full name; each is compared on the first figure both runs have of:

1. ``gemm_fraction`` (higher is better): the kernel's throughput over the GEMM's, measured in
   the same process right before (``bench/test_bench_attention.py``);
2. ``peak_extra_bytes`` (lower is better);
3. the median time (lower is better): cold compiles, anything without the figures above.

Each figure is judged against the noise the two runs themselves show. A run's spread on a
benchmark is the robust standard deviation of its rounds relative to their median (1.4826 x
the median absolute deviation of ``gemm_fractions``, the per-round figures; for times,
pytest-benchmark's interquartile range / 1.349; none for a one-round figure). The change is
a regression when the new figure is worse by more than its band::

    band = max(--threshold, --sigmas x sqrt(spread_BASE**2 + spread_NEW**2))

(defaults 10 % and 3): a change that the rounds of either run scatter over as widely is
noise, not a finding. The report lists every benchmark with its change and band, marks the
regressions, and the command exits 1 (0 when none; 2 for a bad argument). Benchmarks in one
run only are listed, not judged. Runs saved before per-round figures were recorded are
judged on ``--threshold`` alone for ``gemm_fraction``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

#: (extra_info key, higher is better) in the order the comparison prefers them.
FIGURES = (("gemm_fraction", True), ("peak_extra_bytes", False))


def find_run(spec: str, storage: pathlib.Path) -> pathlib.Path:
    """The saved run ``spec``: a JSON path, or the newest file of ``storage`` (any machine folder)
    whose name starts with ``spec`` or with ``NNNN_spec``."""
    path = pathlib.Path(spec)
    if path.suffix == ".json" and path.is_file():
        return path
    runs = sorted(storage.glob("*/*.json"), key=lambda p: p.name)
    found = [p for p in runs if p.name.startswith(spec) or p.name.split("_", 1)[-1].startswith(spec)]
    if not found:
        raise FileNotFoundError(f"no saved run {spec!r} in {storage} (saved: {[p.name for p in runs] or 'none'})")
    return found[-1]


def load(path: pathlib.Path) -> dict:
    """``{fullname: benchmark record}`` of a saved run."""
    data = json.loads(path.read_text())
    return {b["fullname"]: b for b in data["benchmarks"]}


def figure(base: dict, new: dict):
    """``(name, base value, new value, higher is better)`` of the figure two records share."""
    for key, higher in FIGURES:
        if key in base.get("extra_info", {}) and key in new.get("extra_info", {}):
            return key, base["extra_info"][key], new["extra_info"][key], higher
    return "median_s", base["stats"]["median"], new["stats"]["median"], False


def spread(record: dict, key: str) -> float:
    """The relative robust standard deviation of ``record``'s rounds on figure ``key`` (0.0
    when the run does not show one: a single round, or a run saved without per-round figures)."""
    if key == "gemm_fraction":
        rounds = record.get("extra_info", {}).get("gemm_fractions") or []
        if len(rounds) < 3:
            return 0.0
        median = statistics.median(rounds)
        return 1.4826 * statistics.median(abs(x - median) for x in rounds) / abs(median) if median else 0.0
    if key == "median_s":
        stats = record["stats"]
        if stats.get("rounds", 1) < 3 or not stats.get("median"):
            return 0.0
        return stats.get("iqr", 0.0) / 1.349 / stats["median"]
    return 0.0


def compare(base_runs: dict, new_runs: dict, threshold: float, sigmas: float = 3.0) -> tuple:
    """``(rows, regressions)``: one row ``(name, figure, base, new, change %, band %, verdict)``
    per benchmark; the names of those worse than their band (module docstring)."""
    rows, regressions = [], []
    for name in sorted(set(base_runs) | set(new_runs)):
        if name not in base_runs or name not in new_runs:
            rows.append((name, "-", None, None, None, None, "only in " + ("NEW" if name in new_runs else "BASE")))
            continue
        key, old, now, higher = figure(base_runs[name], new_runs[name])
        worse = ((old - now) if higher else (now - old)) / abs(old) * 100.0 if old else 0.0
        noise = math.hypot(spread(base_runs[name], key), spread(new_runs[name], key)) * 100.0
        band = max(threshold, sigmas * noise)
        verdict = "REGRESSION" if worse > band else "ok"
        if verdict != "ok":
            regressions.append(name)
        rows.append((name, key, old, now, -worse, band, verdict))
    return rows, regressions


def _format(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}"


def _short(name: str) -> str:
    """A benchmark's name without its file (``bench/test_bench_attention.py::``), never cut."""
    return name.split("::", 1)[-1]


def report(rows, regressions, threshold, sigmas, base_path, new_path) -> str:
    width = max([len(_short(r[0])) for r in rows] + [len("benchmark")])
    lines = [f"BASE {base_path}", f"NEW  {new_path}",
             f"{'benchmark':{width}s} {'figure':16s} {'BASE':>10s} {'NEW':>10s} {'change':>8s} {'band':>7s}  verdict"]
    for name, key, old, now, change, band, verdict in rows:
        change_text = "-" if change is None else f"{change:+.1f}%"
        band_text = "-" if band is None else f"{band:.1f}%"
        lines.append(f"{_short(name):{width}s} {key:16s} {_format(old):>10s} {_format(now):>10s} {change_text:>8s} "
                     f"{band_text:>7s}  {verdict}")
    judged = sum(1 for r in rows if r[4] is not None)
    lines.append(f"{len(regressions)} of {judged} benchmarks worse than their band (max of {threshold:g}% and "
                 f"{sigmas:g} x the runs' spread)" + (": " + ", ".join(regressions) if regressions else ""))
    return "\n".join(lines)


def plot(storage: pathlib.Path, match: str, out: pathlib.Path) -> int:
    """Plot the figure of every benchmark whose name contains ``match`` across the saved runs of
    ``storage`` (in run order); returns the number of runs plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(storage.glob("*/*.json"), key=lambda p: p.name)
    series = {}
    for i, path in enumerate(runs):
        for name, record in load(path).items():
            if match in name or match in record.get("group", ""):
                key, value, _, _ = figure(record, record)
                series.setdefault((name, key), []).append((i, value))
    if not series:
        raise ValueError(f"no benchmark matching {match!r} in {storage}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (name, key), points in sorted(series.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=f"{name.split('::')[-1]} ({key})")
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([" ".join(p.stem.split("_")[:2])[:20] for p in runs], rotation=30, fontsize=7)
    ax.set_xlabel("saved run")
    ax.set_ylabel("figure (gemm_fraction: higher is better)")
    ax.set_title(f"numbafa benchmarks matching {match!r}")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return len(runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.track", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare two saved runs; exit 1 on a regression")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--threshold", type=float, default=10.0,
                   help="the smallest band, percent (default: %(default)s)")
    c.add_argument("--sigmas", type=float, default=3.0,
                   help="the band in the runs' combined spreads, where wider (default: %(default)s)")
    c.add_argument("--storage", type=pathlib.Path, default=pathlib.Path(".benchmarks"))
    p = sub.add_parser("plot", help="plot a history of saved runs")
    p.add_argument("--storage", type=pathlib.Path, default=pathlib.Path(".benchmarks"))
    p.add_argument("--match", default="backward")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "plot":
            print(f"{plot(args.storage, args.match, args.out)} runs plotted to {args.out}")
            return 0
        base_path, new_path = find_run(args.base, args.storage), find_run(args.new, args.storage)
        rows, regressions = compare(load(base_path), load(new_path), args.threshold, args.sigmas)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(rows, regressions, args.threshold, args.sigmas, base_path, new_path))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
