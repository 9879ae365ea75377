"""bench/profile_bwd_tile.py runs against the kernels as they are: it calls their steps with their
own signatures (a script left behind by a change of a step's arguments fails here)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_bwd_tile.py"


def test_times_every_step_of_a_small_head():
    # bf16: its steps' plugins registered as a call registers them, besides every float32 step
    run = subprocess.run([sys.executable, str(SCRIPT), "--dtype", "bf16", "--d-head", "128", "--seqlen", "1024",
                          "--repeats", "1", "--n", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\s*(\S.*?)\s+(\d+\.\d+) ms$", run.stdout, re.M)
    assert [name.split(",")[0] for name, _ in rows] == [
        "core", "core", "S + dP GEMMs", "recompute_p_ds (Steps 2-4)", "update_gradients (Steps 5.1",
        "whole backward / 4 tiles (full)", "whole backward / 3 tiles (causal)"], run.stdout
    assert all(float(ms) > 0 for _, ms in rows)
    assert "core, diagonal tile (k0=512)" in run.stdout


def test_refuses_a_length_without_an_unmasked_tile():
    run = subprocess.run([sys.executable, str(SCRIPT), "--seqlen", "512"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--seqlen must be a multiple of 512 from 1024, got 512" in run.stderr
