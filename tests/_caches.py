"""Copies of the test run's kernel cache for tests that need a process to compile one thing."""

from __future__ import annotations

import pathlib
import shutil


def cache_without(root: pathlib.Path, *functions: str) -> pathlib.Path:
    """A copy of this run's kernel cache (the one tests/conftest.py warmed; nothing if it holds
    nothing) under ``root``, without the cached code of ``functions`` (dotted paths in the package:
    ``"kernels.entry.forward_entry"``): a process using it as ``NUMBAFA_CACHE_DIR``
    compiles those and loads the rest. A wholly empty cache would cost a cold float32 compile
    (20-31 s of CPU) for the same behaviour; tests/test_float16.py keeps a deliberately cold
    compile of the kernels. Returns ``root``."""
    from numbafa.compiler.jit import cache_info

    run = cache_info()["dir"]
    if run is None:
        return root
    copy = root / pathlib.Path(run).name
    if pathlib.Path(run).is_dir():
        shutil.copytree(run, copy)
    for name in functions:
        module, function = name.rsplit(".", 1)
        sub = module.split(".")[:-1]
        for path in copy.joinpath(*sub).glob(f"{module.split('.')[-1]}.{function}-*"):
            path.unlink()
    return root
