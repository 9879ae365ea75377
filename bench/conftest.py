"""pytest-benchmark for numbafa: a stable ``machine_info``, the profiles, the reference figures.

``machine_info`` is what pytest-benchmark compares between two saved runs ("machine_info is
different" otherwise): it keeps the machine's description (pytest-benchmark's own, without
the clock frequency the CPU happened to run at) and numbafa's backend (:func:`numbafa.backend_info`)
without what changes from run to run on one machine: the order of the BLAS libraries loaded
(sorted here), their install paths, and the kernel cache's directory (named by the source hash,
which goes to each benchmark's ``extra_info`` instead, with the other per-run facts).

``--numbafa-profile``: ``full`` (default, the standard shapes: minutes) or ``quick`` (tiny
shapes, three rounds each: the whole suite in well under a minute once compiled; CI runs it to
keep the tracking workflow working, ``tests/test_tracking.py``).
"""

from __future__ import annotations

import os

import pytest

#: pytest-benchmark's machine_info keys that move between runs of one machine.
_VOLATILE_CPU = ("hz_actual", "hz_actual_friendly")


def pytest_addoption(parser):
    parser.addoption("--numbafa-profile", choices=("full", "quick"), default="full",
                     help="numbafa's benchmark profile: the standard shapes (full) or tiny ones (quick)")


def stable_backend_info() -> dict:
    """:func:`numbafa.backend_info` without what differs between runs of one machine."""
    import numbafa

    info = dict(numbafa.backend_info())
    info.pop("cache", None)
    blas = [{key: (os.path.basename(value) if key == "filepath" else value) for key, value in lib.items()}
            for lib in info.get("blas", [])]
    info["blas"] = sorted(blas, key=lambda lib: (lib.get("internal_api", ""), lib.get("filepath", "")))
    return info


def pytest_benchmark_update_machine_info(config, machine_info):
    cpu = machine_info.get("cpu")
    if isinstance(cpu, dict):
        for key in _VOLATILE_CPU:
            cpu.pop(key, None)
    machine_info["numbafa"] = stable_backend_info()


@pytest.fixture(scope="session")
def profile(request) -> str:
    return request.config.getoption("--numbafa-profile")
