"""bench/cold_compile.py's split of LLVM's time by llvmlite's C functions (``--llvm-calls``)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

# in a process of its own: the timing wraps llvmlite's calls for the rest of the process
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from cold_compile import time_llvm_calls
calls = time_llvm_calls()
import llvmlite.binding as llvm
module = llvm.parse_assembly("define i32 @f() {\\n  ret i32 7\\n}")
module.verify()
print(json.dumps(dict(calls=calls, text=str(module))))
"""


def test_llvm_calls_are_counted_by_name_and_still_return_their_results():
    run = subprocess.run([sys.executable, "-c", _CHILD, str(_BENCH)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    seconds, count = out["calls"]["LLVMPY_ParseAssembly"]
    assert count == 1 and 0 <= seconds < 60
    assert out["calls"]["LLVMPY_VerifyModule"][1] == 1
    assert "ret i32 7" in out["text"]          # the wrapped calls' results are the real ones
