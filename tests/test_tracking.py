"""Performance tracking (docs/performance.md, "Tracking performance"): the documented commands work.

The quick profile of the benchmark suite is run here (tiny shapes; its kernels are in the
cache the run warmed, tests/conftest.py), saved with pytest-benchmark's own ``--benchmark-autosave``,
and compared with itself and with a copy made slower on purpose by ``python -m bench.track``.
No timing is asserted: only that runs are saved, carry their figures, and that the
comparison passes and fails as it should.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("pytest_benchmark")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench_conftest():
    """bench/conftest.py, imported under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("numbafa_bench_conftest", ROOT / "bench" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One quick-profile run saved by pytest-benchmark: ``(storage, path of the saved JSON)``."""
    storage = tmp_path_factory.mktemp("benchmarks")
    # A session of its own: pytest-benchmark switches itself off in an xdist worker's environment.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "bench", "--numbafa-profile=quick", "-q",
                           "--benchmark-autosave", f"--benchmark-storage=file://{storage}", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = sorted(storage.glob("*/*.json"))
    assert len(runs) == 1, runs
    return storage, runs[0]


def _track(*args):
    return subprocess.run([sys.executable, "-m", "bench.track", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_run_is_saved_with_its_figures(saved):
    _, path = saved
    data = json.loads(path.read_text())
    assert data["machine_info"]["numbafa"]["gemm"]["path"] in ("blas", "mixed", "onednn")
    names = {b["fullname"].split("::")[-1].split("[")[0] for b in data["benchmarks"]}
    assert {"test_attention", "test_score_variants", "test_dropout", "test_compile_time",
            "test_peak_memory"} <= names
    attention = [b for b in data["benchmarks"] if "test_attention" in b["fullname"]]
    assert all(b["extra_info"]["gemm_fraction"] > 0 and b["extra_info"]["gflops"] > 0 for b in attention)
    assert all(len(b["extra_info"]["source"]) >= 12 for b in data["benchmarks"])
    memory = [b for b in data["benchmarks"] if "test_peak_memory" in b["fullname"]]
    assert memory and memory[0]["extra_info"]["peak_extra_bytes"] > 0


def test_a_run_compared_with_itself_passes(saved):
    storage, path = saved
    done = _track("compare", str(path), path.name.split("_")[0], "--storage", str(storage))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 of" in done.stdout and "REGRESSION" not in done.stdout


def test_a_slower_run_fails_with_a_readable_report(saved, tmp_path):
    """A copy of the run with one kernel at half its GEMM fraction and the compile 30 % slower:
    exit 1, both named as regressions; a 10 % slowdown stays within a 15 % threshold."""
    storage, path = saved
    data = json.loads(path.read_text())
    slowed = None
    for b in data["benchmarks"]:
        if "test_attention" in b["fullname"] and "backward" in b["fullname"] and slowed is None:
            b["extra_info"]["gemm_fraction"] *= 0.5
            slowed = b["fullname"]
        elif "test_compile_time" in b["fullname"]:
            b["stats"]["median"] *= 1.3
        elif "gemm_fraction" in b.get("extra_info", {}):
            b["extra_info"]["gemm_fraction"] *= 0.9
    new = tmp_path / "slower.json"
    new.write_text(json.dumps(data))
    # --sigmas 0: the threshold alone (the quick profile's sub-millisecond rounds scatter
    # widely; the noise band is tested on records of known spread below)
    done = _track("compare", str(path), str(new), "--threshold", "15", "--sigmas", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    flagged = [line for line in done.stdout.splitlines() if line.endswith("REGRESSION")]
    assert len(flagged) == 2, done.stdout
    assert any("gemm_fraction" in line and "-50.0%" in line for line in flagged)
    assert any("median_s" in line and "-30.0%" in line for line in flagged)
    assert "2 of" in done.stdout.splitlines()[-1]


def _track_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("numbafa_bench_track", ROOT / "bench" / "track.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(fractions=None, median=None, iqr=0.0, rounds=5):
    """A saved benchmark record judged on ``gemm_fraction`` (its per-round ``fractions``) or,
    without them, on its median time."""
    if fractions is not None:
        import statistics

        return {"extra_info": {"gemm_fraction": statistics.median(fractions), "gemm_fractions": list(fractions)},
                "stats": {"median": 1.0, "iqr": 0.0, "rounds": len(fractions)}}
    return {"extra_info": {}, "stats": {"median": median, "iqr": iqr, "rounds": rounds}}


def test_the_spread_of_a_run_is_its_rounds_robust_deviation():
    track = _track_module()
    record = _record([0.9, 0.95, 1.0, 1.05, 1.1])       # deviations 0.1 0.05 0 0.05 0.1: MAD 0.05
    assert track.spread(record, "gemm_fraction") == pytest.approx(1.4826 * 0.05)
    assert track.spread(_record([0.9, 1.1]), "gemm_fraction") == 0.0          # too few rounds
    assert track.spread(_record(median=2.0, iqr=0.2698), "median_s") == pytest.approx(0.1)
    assert track.spread(_record(median=2.0, iqr=0.5, rounds=1), "median_s") == 0.0
    old = {"extra_info": {"gemm_fraction": 0.5}, "stats": {"median": 1.0, "iqr": 0.0, "rounds": 5}}
    assert track.spread(old, "gemm_fraction") == 0.0     # saved before per-round figures


def test_a_change_is_judged_against_the_runs_own_noise():
    """20 % worse: a regression between two tight runs; noise between two runs whose rounds
    scatter by 15 % (robust deviation; band 3 x sqrt(2) x 14.8 % = 63 %); a 70 % loss is
    caught even there."""
    track = _track_module()
    tight = [0.99, 1.0, 1.0, 1.01, 1.0]
    noisy = [0.8, 0.9, 1.0, 1.1, 1.2, 1.0, 0.9]          # MAD 0.1: robust deviation 14.8 %
    scaled = lambda rounds, f: [x * f for x in rounds]   # noqa: E731
    cases = {"tight -20%": (_record(tight), _record(scaled(tight, 0.8))),
             "noisy -20%": (_record(noisy), _record(scaled(noisy, 0.8))),
             "noisy -70%": (_record(noisy), _record(scaled(noisy, 0.3))),
             "tight +20%": (_record(tight), _record(scaled(tight, 1.2))),
             "time +20%, tight": (_record(median=1.0, iqr=0.01), _record(median=1.2, iqr=0.012)),
             "time +20%, noisy": (_record(median=1.0, iqr=0.2), _record(median=1.2, iqr=0.24))}
    base = {name: pair[0] for name, pair in cases.items()}
    new = {name: pair[1] for name, pair in cases.items()}
    rows, regressions = track.compare(base, new, threshold=10.0, sigmas=3.0)
    assert sorted(regressions) == ["noisy -70%", "tight -20%", "time +20%, tight"]
    bands = {row[0]: row[5] for row in rows}
    assert bands["tight -20%"] == 10.0                   # the threshold is the smallest band
    assert bands["noisy -20%"] == pytest.approx(3 * 2 ** 0.5 * 14.826)
    text = track.report(rows, regressions, 10.0, 3.0, "a.json", "b.json")
    assert "band" in text.splitlines()[2] and "3 of 6 benchmarks worse than their band" in text
    # the threshold alone (--sigmas 0) flags the noisy 20 % changes too
    assert len(track.compare(base, new, threshold=10.0, sigmas=0.0)[1]) == 5


def test_a_missing_run_is_exit_two(saved):
    storage, _ = saved
    done = _track("compare", "9999", "0001", "--storage", str(storage))
    assert done.returncode == 2 and "no saved run '9999'" in done.stderr


def test_the_history_plot_is_drawn(saved, tmp_path):
    pytest.importorskip("matplotlib")
    storage, _ = saved
    out = tmp_path / "history.png"
    done = _track("plot", "--storage", str(storage), "--match", "backward", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 1000


def test_machine_info_does_not_change_between_runs(monkeypatch):
    """The BLAS list's order and paths, the cache directory and the CPU's current clock (the
    parts that moved between two runs of one machine) are not in ``machine_info``."""
    from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info

    import numbafa

    infos = []
    real = numbafa.backend_info()
    for order in (1, -1):
        shuffled = dict(real, blas=list(real["blas"])[::order] + [{"internal_api": "x", "filepath": "/a/libx.so"}],
                        cache={"dir": f"/tmp/{order}"})
        monkeypatch.setattr(numbafa, "backend_info", lambda shuffled=shuffled: shuffled)
        machine_info = pytest_benchmark_generate_machine_info()
        machine_info.setdefault("cpu", {})["hz_actual"] = [order, 0]
        _bench_conftest().pytest_benchmark_update_machine_info(None, machine_info)
        infos.append(json.dumps(machine_info, sort_keys=True))
    assert infos[0] == infos[1]
    assert "libx.so" in infos[0] and "/a/" not in infos[0]
