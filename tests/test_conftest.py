"""tests/conftest.py: which runs warm the kernel cache and spread over xdist workers."""

from __future__ import annotations

import pathlib
import types

import pytest

import conftest
from numbafa.pipeline import shards

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(*args, worker=False):
    config = types.SimpleNamespace(args=list(args), rootpath=ROOT)
    if worker:
        config.workerinput = {"workerid": "gw0"}
    return config


@pytest.mark.parametrize("args,whole", [(("tests",), True), ((str(ROOT / "tests"),), True),
                                        (("tests/",), True), (("tests/test_nb.py",), False),
                                        (("tests", "tests/test_nb.py"), False), (("tests::x",), True),
                                        (("bench",), False), ((), False)])
def test_only_the_whole_directory_is_the_whole_suite(args, whole):
    assert conftest._whole_suite(_config(*args)) is whole


def test_the_warm_up_follows_the_variable_and_never_runs_on_a_worker(monkeypatch):
    monkeypatch.delenv("NUMBAFA_TEST_WARM", raising=False)
    assert conftest._warm_wanted(_config("tests"))
    assert not conftest._warm_wanted(_config("tests/test_nb.py"))
    assert not conftest._warm_wanted(_config("tests", worker=True))
    monkeypatch.setenv("NUMBAFA_TEST_WARM", "1")
    assert conftest._warm_wanted(_config("tests/test_nb.py"))
    assert not conftest._warm_wanted(_config("tests", worker=True))
    monkeypatch.setenv("NUMBAFA_TEST_WARM", "0")
    assert not conftest._warm_wanted(_config("tests"))
    monkeypatch.setenv("NUMBAFA_TEST_WARM", "yes")
    with pytest.raises(pytest.UsageError, match="NUMBAFA_TEST_WARM must be 0 or 1, got 'yes'"):
        conftest._warm_wanted(_config("tests"))


def test_the_warm_up_names_kernels_the_workers_can_warm():
    """Each entry is a call of numbafa.pipeline.shards.warm (checked without compiling: its
    pass, a dtype it takes, and the two flags)."""
    import inspect

    parameters = inspect.signature(shards.warm).parameters
    assert list(parameters)[:4] == ["kernel", "dtype_name", "dropout", "variants"]
    assert all(p.default is False for p in list(parameters.values())[4:])   # the CLI's backward_only
    entries = [entry for group in conftest.WARM_GROUPS for entry in group]
    assert len(set(entries)) == len(entries)
    for kernel, dtype, dropout, variants in entries:
        assert kernel in ("forward", "backward") and dtype in ("float32", "bfloat16", "float64")
        assert isinstance(dropout, bool) and isinstance(variants, bool)
        assert (("backward" if kernel == "forward" else "forward"), dtype, dropout, variants) in entries
