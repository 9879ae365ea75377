"""Performance tracking (docs/performance.md, "Tracking performance"): the documented commands work.

The quick profile of the benchmark suite is run here (tiny shapes; its kernels were compiled
by the tests before this file), saved with pytest-benchmark's own ``--benchmark-autosave``,
and compared with itself and with a copy made slower on purpose by ``python -m bench.track``.
No timing is asserted: only that runs are saved, carry their figures, and that the
comparison passes and fails as it should.
"""

from __future__ import annotations

import json
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
    done = subprocess.run([sys.executable, "-m", "pytest", "bench", "--numbafa-profile=quick", "-q",
                           "--benchmark-autosave", f"--benchmark-storage=file://{storage}", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
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
    assert data["machine_info"]["numbafa"]["gemm"]["path"] in ("blas", "onednn")
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
    exit 1, both named as regressions; a 10 % slowdown stays within the 15 % threshold."""
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
    done = _track("compare", str(path), str(new))
    assert done.returncode == 1, done.stdout + done.stderr
    flagged = [line for line in done.stdout.splitlines() if line.endswith("REGRESSION")]
    assert len(flagged) == 2, done.stdout
    assert any("gemm_fraction" in line and "-50.0%" in line for line in flagged)
    assert any("median_s" in line and "-30.0%" in line for line in flagged)
    assert "2 of" in done.stdout.splitlines()[-1]


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
