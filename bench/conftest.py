"""pytest-benchmark: record numbafa's backend (BLAS, threads, CPU flags) with every saved run."""

from __future__ import annotations


def pytest_benchmark_update_machine_info(config, machine_info):
    import numbafa

    machine_info["numbafa"] = numbafa.backend_info()
