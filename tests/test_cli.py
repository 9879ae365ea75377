"""The main command: exit codes, the table, --json, bad options."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from numba.core import event

from numbafa import cli, golden
from numbafa.layout import cu_seqlens_to_bounds
from numbafa.pipeline import ahead

from _caches import cache_without

SMALL = ["--heads", "4", "--kv-heads", "2", "--seqlen", "256", "--head-dim", "32", "--repeats", "1"]


def test_table_and_exit_code_zero(capsys):
    assert cli.main(SMALL + ["--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float32  forward" in out and "float32  backward" in out and "FAIL" not in out
    assert out.count(" ok") == 2
    # The pass rule is relative: the table shows max|a-e|/max|e| next to its bound.
    assert "max|a-e|/max|e| (bound)" in out
    assert re.search(r"dq=\d\.\de-\d\d \(<=\d\.\de-\d\d\)", out), out
    assert out.rstrip().splitlines()[-1] == "all 5 checks passed"


def test_a_value_head_dim_of_its_own(capsys):
    """--head-dim-v: v, o and dv take it; checked against the golden like any shape."""
    argv = ["--heads", "2", "--kv-heads", "1", "--seqlen", "256", "--head-dim", "48", "--head-dim-v", "24",
            "--repeats", "1", "--dtype", "float32", "--json"]
    assert cli.main(argv) == 0
    records = json.loads(capsys.readouterr().out)["results"]
    assert {r["shape"]["head_dim_v"] for r in records} == {24} and all(r["ok"] for r in records)
    assert records[1]["pass"] == "backward" and set(records[1]["max_abs_err"]) == {"dq", "dk", "dv"}


def test_float64_is_checked_to_float64_precision(capsys):
    """--dtype float64 (not in "both"): float64 sinks and outputs, the float64 acceptance rule."""
    argv = ["--heads", "2", "--kv-heads", "1", "--seqlen", "256", "--head-dim", "16", "--sinks", "1",
            "--repeats", "1", "--dtype", "float64", "--json"]
    assert cli.main(argv) == 0
    records = json.loads(capsys.readouterr().out)["results"]
    assert [r["dtype"] for r in records] == ["float64", "float64"] and all(r["ok"] for r in records)
    assert max(r["max_rel_err"][out] for r in records for out in r["max_rel_err"]) < 1e-12
    assert all(bound < 1e-9 for r in records for bound in r["rel_bound"].values())   # not float32's 1e-4


def test_json_output(capsys):
    assert cli.main(SMALL + ["--json", "--dtype", "bf16", "--sinks", "2", "--packing", "100,156",
                             "--window", "64"]) == 0
    doc = json.loads(capsys.readouterr().out)
    passes = {(r["dtype"], r["pass"]) for r in doc["results"]}
    assert passes == {("bf16", "forward"), ("bf16", "backward")}
    assert doc["ok"] is True and doc["checks"] == 6 and doc["checks_failed"] == []
    back = next(r for r in doc["results"] if r["pass"] == "backward")
    assert set(back["max_abs_err"]) == {"dq", "dk", "dv", "dsinks"} and back["ok"] is True
    assert set(back["max_rel_err"]) == set(back["rel_bound"]) == set(back["max_abs_err"])
    assert all(back["max_rel_err"][k] <= back["rel_bound"][k] for k in back["max_rel_err"])
    assert back["gflops"] > 0 and back["packing"] == [100, 156]
    fwd = next(r for r in doc["results"] if r["pass"] == "forward")
    # each pass's own first call (one figure was shown on both rows)
    assert fwd["first_call_s"] > 0 and back["first_call_s"] > 0 and fwd["first_call_s"] != back["first_call_s"]


def test_info_prints_backend_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a: pytest.fail("--info must not run kernels"))
    assert cli.main(["--info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gemm"]["path"] in ("onednn", "mixed", "blas") and info["blas"] and info["threads"] >= 1


def test_no_check_skips_golden(capsys):
    assert cli.main(SMALL + ["--no-check", "--dtype", "float32", "--mask", "full"]) == 0
    assert "not checked" in capsys.readouterr().out


def test_failed_check_gives_exit_code_one(capsys, monkeypatch):
    monkeypatch.setattr(cli, "RTOL", {"float32": -1.0, "bf16": -1.0})
    assert cli.main(SMALL + ["--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    assert out.rstrip().splitlines()[-1] == "4 of 5 checks FAILED: float32 o, dq, dk, dv"


@pytest.mark.parametrize("argv,message", [
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
    (["--seqlen", "0"], "expected a positive integer, got 0"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--mask", "full", "--window", "8"], "--window needs --mask causal"),
    (["--seqlen", "256", "--packing", "100,100"], "--packing lengths sum to 200, expected --seqlen 256"),
    (["--packing", "a,b"], "expected comma-separated lengths"),
    (["--dropout", "1"], "expected a probability in [0, 1), got 1"),
    (["--dropout", "x"], "expected a probability in [0, 1), got 'x'"),
    (["--dropout", "0.1", "--seed", "-2"], "expected an integer seed in [0, 2**64), got -2"),
    (["--softcap", "0"], "expected a soft cap in [1.1754944e-38, 8.5070592e+37], got 0"),
    (["--softcap", "nan"], "expected a soft cap in [1.1754944e-38, 8.5070592e+37], got nan"),
])
def test_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_no_check_verdict(capsys):
    assert cli.main(SMALL + ["--no-check", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "not checked (--no-check)"


def test_help_is_plain_text_with_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out
    flat = " ".join(out.split())
    for default in ("(default: 1)", "(default: 8)", "(default: 2)", "(default: 2048)", "(default: 128)",
                    "(default: both)", "(default: causal)", "(default: 5)"):
        assert default in flat, default
    assert "Exit status: 0" in flat


def one_line_error(capsys, argv, code=2):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == code
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("numbafa: error: "), captured.err
    return lines[0]


def test_impossible_size_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a: pytest.fail("an impossible size must not run"))
    line = one_line_error(capsys, ["--seqlen", "1000000000000"])
    assert "this problem needs about" in line and "bytes of memory" not in line and "available" in line


def test_size_beyond_available_memory_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_available_bytes", lambda: 10 ** 6)
    monkeypatch.setattr(cli, "run", lambda *a: pytest.fail("must not run"))
    line = one_line_error(capsys, SMALL)
    assert "only 976.6 KiB available" in line


def test_memory_message_suggests_no_check_only_when_it_helps(capsys, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda *a: pytest.fail("must not run"))
    args = cli.build_parser().parse_args(SMALL)
    unchecked = cli._estimate_bytes(cli.build_parser().parse_args(SMALL + ["--no-check"]))
    assert unchecked < cli._estimate_bytes(args)
    monkeypatch.setattr(cli, "_available_bytes", lambda: unchecked)
    assert one_line_error(capsys, SMALL).endswith("(or add --no-check)")
    monkeypatch.setattr(cli, "_available_bytes", lambda: unchecked - 1)
    assert "--no-check" not in one_line_error(capsys, SMALL)


def test_memory_error_during_run_exits_2(capsys, monkeypatch):
    def run(*args):
        raise MemoryError()
    monkeypatch.setattr(cli, "run", run)
    line = one_line_error(capsys, SMALL + ["--dtype", "float32"])
    assert "out of memory" in line


def test_estimate_counts_the_arrays():
    def estimate(seqlen, *flags):
        return cli._estimate_bytes(cli.build_parser().parse_args(["--seqlen", str(seqlen), *flags]))

    q_bytes = 8 * 128 * 8192 * 4
    assert 4 * q_bytes < estimate(8192, "--no-check") < 20 * q_bytes

    def check_bytes(seqlen):
        return estimate(seqlen) - estimate(seqlen, "--no-check")
    # The blocked golden check: measured peak 396 MiB at seqlen 8192 (the unblocked one took 2.97 GB),
    # and linear in seqlen, not quadratic.
    assert 396 * 2 ** 20 < check_bytes(8192) < 2 ** 30
    assert check_bytes(32768) < 4 * check_bytes(8192)


def test_blocked_golden_equals_the_full_golden(monkeypatch):
    rng = np.random.default_rng(1)
    n_rep, d, s = 2, 16, 200
    q, dy = (rng.standard_normal((1, n_rep, d, s)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, d, s)) for _ in range(2))
    sinks = rng.standard_normal((1, n_rep, 2))
    bmin, bmax = cu_seqlens_to_bounds(np.array([0, 90, 200]))
    opts = dict(use_causal_mask=True, sliding_window=50, bound_min=bmin, bound_max=bmax)
    o_exp, lse_exp = golden.attention_fwd(q, k, v, sinks=sinks, **opts)
    grads_exp = golden.attention_bwd(q, k, v, None, dy, None, sinks_ref=sinks, **opts)
    rows = []
    real_fwd = golden.attention_fwd
    monkeypatch.setattr(golden, "attention_fwd", lambda q, *a, **kw: rows.append(q.shape[3]) or real_fwd(q, *a, **kw))
    o, lse, grads = cli._golden_blocked(q, k, v, dy, sinks, opts, block_rows=37)
    assert max(rows) == 37 and sum(rows) == s
    np.testing.assert_allclose(o, o_exp, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, lse_exp, rtol=1e-12)
    for got, exp in zip(grads, grads_exp):
        np.testing.assert_allclose(got, exp, rtol=1e-11, atol=1e-13)


def test_check_runs_in_blocks_of_query_rows(capsys, monkeypatch):
    monkeypatch.setattr(cli, "CHECK_BLOCK_ENTRIES", 256 * 100)
    rows = []
    real_fwd = golden.attention_fwd
    monkeypatch.setattr(golden, "attention_fwd", lambda q, *a, **kw: rows.append(q.shape[3]) or real_fwd(q, *a, **kw))
    assert cli.main(SMALL + ["--dtype", "float32", "--window", "40", "--sinks", "1"]) == 0
    assert max(rows) == 100 and sum(rows) == 256


def test_compile_notice_on_stderr_when_a_compile_starts(capsys, monkeypatch):
    """The notice comes with Numba's compile event (here fired by hand), before the wait, on stderr."""
    before_first_call = []
    real_fwd = cli.attention_fwd

    def fwd(*args, **kwargs):
        if not before_first_call:
            event.start_event("numba:compile", data={})
            before_first_call.append(capsys.readouterr())
            event.end_event("numba:compile", data={})
        return real_fwd(*args, **kwargs)
    monkeypatch.setattr(cli, "attention_fwd", fwd)
    assert cli.main(SMALL + ["--dtype", "float32", "--json", "--no-check"]) == 0
    before = before_first_call[0]
    assert cli._compile_notice("float32") in before.err   # where the code goes: the cache, or why not
    assert before.out == ""
    json.loads(capsys.readouterr().out)                 # stdout: one JSON document, nothing else


def test_no_notice_when_kernels_are_loaded(capsys):
    assert cli.main(SMALL + ["--dtype", "float32", "--no-check"]) == 0
    capsys.readouterr()
    assert cli.main(SMALL + ["--dtype", "float32", "--no-check"]) == 0
    assert "compiling" not in capsys.readouterr().err


def test_compile_line_only_when_the_disk_cache_is_cold(tmp_path):
    """A first process that must compile (the forward's entry, removed from a copy of the run's
    cache) says so and starts the backward's second process; the next loads the cache silently."""
    cache = cache_without(tmp_path / "cache", "kernels.entry.forward_entry")
    env = {key: value for key, value in os.environ.items() if key != "NUMBAFA_CACHE"}   # the cache on
    env["NUMBAFA_CACHE_DIR"] = str(cache)
    argv = [sys.executable, "-m", "numbafa", "--heads", "2", "--kv-heads", "1", "--seqlen", "256",
            "--head-dim", "16", "--repeats", "1", "--dtype", "float32", "--no-check"]

    def stderr():
        proc = subprocess.run(argv, env=env, cwd=pathlib.Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    cold = stderr()
    assert "first float32 calls: compiling the kernels, once (cached in " + str(cache) in cold, cold
    assert "numbafa: compiling the" not in cold, cold     # the CLI's line replaces the per-kernel warnings
    assert "the backward's kernels compile meanwhile in a second process" in cold, cold
    assert list(cache.glob("*/kernels/entry.forward_entry-*.nbi")), "the forward's entry was not saved"
    warm = stderr()
    assert "first float32 calls" not in warm and "compiling" not in warm, warm


class _Notes:
    def __init__(self):
        self.lines = []

    def note(self, text):
        self.lines.append(text)


@pytest.mark.parametrize("enabled,cores,started", [(True, 2, True), (False, 2, False), (True, 1, False),
                                                   (True, 2, OSError)])
def test_the_second_process_starts_with_the_first_compile_where_it_can_help(monkeypatch, enabled, cores, started):
    """The first real compile of the run's first calls starts the backward's compile in a second
    process, with the disk cache on (it hands the code over) and two cores or more; once. If no
    process can be started, the first calls go on without it."""
    started_with = []

    class FakeProcess:
        pid, returncode = 1, 0

        def __init__(self, argv, **kwargs):
            if started is OSError:
                raise OSError("no processes here")
            started_with.append(argv)

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(ahead.subprocess, "Popen", FakeProcess)
    cache = {"enabled": enabled, "save_error": None, "dir": "/c", "reason": "off"}
    monkeypatch.setattr(cli, "cache_info", lambda: cache)     # the notice's words
    monkeypatch.setattr(ahead, "cache_info", lambda: cache)   # whether a second process can hand code over
    monkeypatch.setattr(cli, "_cores", lambda: cores)
    notes = _Notes()
    notice = cli._CompileNotice(notes, "float32", ["float32", False, True])
    notice.on_start(None)
    notice.on_start(None)
    notice.wait()
    assert len(started_with) == (1 if started is True else 0)
    if started is True:
        assert started_with[0][1:3] == ["-c", ahead.SCRIPT]
        assert json.loads(started_with[0][3]) == ["backward", "float32", False, True]
    assert len(notes.lines) == (2 if started is True else 1)
    assert (notice.ahead is None) == (started is not True)


def test_a_second_process_that_does_not_finish_is_ended(monkeypatch):
    """The backward's first call waits for the second process at most ``_PREFETCH_WAIT`` seconds,
    then ends it and compiles the backward itself."""
    monkeypatch.setattr(cli, "_PREFETCH_WAIT", 0.2)
    notice = cli._CompileNotice(_Notes(), "float32")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    notice.ahead = ahead.CompileAhead([process], [])
    notice.wait()
    assert process.poll() is not None


def test_the_second_process_warms_the_backward_alone(monkeypatch):
    """The second process runs ``shards.warm(..., backward_only=True)``: the backward on stand-ins
    of the forward's outputs, never the forward (which the first process compiles meanwhile)."""
    from numbafa.pipeline import shards

    def no_forward(*args, **kwargs):
        raise AssertionError("the forward ran")

    calls = []
    backward = shards.attention_bwd
    monkeypatch.setattr(shards, "attention_fwd", no_forward)
    monkeypatch.setattr(shards, "attention_bwd", lambda *a, **k: calls.append(a) or backward(*a, **k))
    monkeypatch.setattr(shards, "_WARM", set())
    shards.warm("backward", "float32", backward_only=True)
    assert len(calls) == 1
    with pytest.raises(AssertionError, match="the forward ran"):
        shards.warm("backward", "float32")


def test_compile_time_is_the_readme_figure(capsys):
    """--help and the notice quote the README's measured cold compile (the README names the CPU)."""
    readme = " ".join((pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    figure = re.search(r"\(([\d.]+-[\d.]+ s of CPU) for float32's forward and backward together, "
                       r"[\d.-]+ s more for bf16 in the same process", readme)
    assert figure, "README: the compile-time sentence moved"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for text in (help_text, cli._compile_notice("float32")):
        assert figure[1] in text and "Zen" not in text, text
        assert "15-30" not in text and "tens of seconds" not in text


def test_dropout_is_checked_against_the_golden(capsys, monkeypatch):
    """--dropout runs both passes with the mask and the blocked golden draws the same mask."""
    monkeypatch.setattr(cli, "CHECK_BLOCK_ENTRIES", 256 * 100)  # blocks of 100 rows: first_row matters
    assert cli.main(SMALL + ["--dtype", "float32", "--dropout", "0.2", "--seed", "11", "--sinks", "1"]) == 0
    out = capsys.readouterr().out
    assert ", dropout 0.2" in out and out.rstrip().splitlines()[-1] == "all 6 checks passed"


def test_blocked_golden_with_dropout_equals_the_full_golden():
    rng = np.random.default_rng(2)
    q, dy = (rng.standard_normal((1, 2, 8, 90)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 8, 90)) for _ in range(2))
    drop = dict(dropout_p=0.3, seed=5)
    opts = dict(use_causal_mask=True, **drop)
    o_exp, _ = golden.attention_fwd(q, k, v, use_causal_mask=True, **drop)
    grads_exp = golden.attention_bwd(q, k, v, None, dy, None, use_causal_mask=True, **drop)
    o, _, grads = cli._golden_blocked(q, k, v, dy, None, opts, block_rows=37)
    np.testing.assert_allclose(o, o_exp, rtol=1e-12, atol=1e-14)
    for got, exp in zip(grads, grads_exp):
        np.testing.assert_allclose(got, exp, rtol=1e-11, atol=1e-13)


def test_score_variants_are_checked_against_the_golden(capsys, monkeypatch):
    """--softcap and --alibi run both passes with them; the blocked golden gets each block's ALiBi rows."""
    monkeypatch.setattr(cli, "CHECK_BLOCK_ENTRIES", 256 * 100)  # blocks of 100 rows: the distances matter
    assert cli.main(SMALL + ["--dtype", "float32", "--softcap", "5", "--alibi", "--mask", "full"]) == 0
    out = capsys.readouterr().out
    assert ", softcap 5, ALiBi" in out and out.rstrip().splitlines()[-1] == "all 5 checks passed"


def test_blocked_golden_with_score_variants_equals_the_full_golden():
    rng = np.random.default_rng(3)
    q, dy = (rng.standard_normal((1, 2, 8, 90)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 8, 130)) for _ in range(2))
    variants = dict(softcap=2.0, alibi_slopes=cli.alibi_slopes(2))
    o_exp, _ = golden.attention_fwd(q, k, v, **variants)
    grads_exp = golden.attention_bwd(q, k, v, None, dy, None, **variants)
    o, _, grads = cli._golden_blocked(q, k, v, dy, None, variants, block_rows=37)
    np.testing.assert_allclose(o, o_exp, rtol=1e-12, atol=1e-14)
    for got, exp in zip(grads, grads_exp):
        np.testing.assert_allclose(got, exp, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("shape", [
    ["--seqlen", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--window", "1"],
    ["--seqlen", "1", "--heads", "1", "--kv-heads", "1", "--head-dim", "1"],
], ids=["window-1", "seqlen-1"])
def test_an_exactly_zero_gradient_is_checked_against_the_pass(shape, capsys):
    """One visible key: P = 1 and the exact dq, dk are 0, but bf16's rounded terms do not cancel
    exactly. Their error is measured against the pass's largest gradient (docs/numerics.md), not
    by an absolute 1e-5; a wrong gradient still fails."""
    assert cli.main(shape + ["--repeats", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    back = next(r for r in doc["results"] if r["pass"] == "backward" and r["dtype"] == "bf16")
    assert back["max_abs_err"]["dq"] > 1e-5        # the old absolute rule failed this
    assert back["max_rel_err"]["dq"] <= back["rel_bound"]["dq"]


@pytest.mark.parametrize("cap", ["1e-50", "1e-45", "1e38", "0", "-3"])
def test_a_soft_cap_the_kernels_cannot_carry_is_one_line_and_exit_two(cap, capsys):
    """1e-50 is 0 in float32 (the cap was silently dropped and the golden check failed), 1e-45 a
    subnormal: refused before anything runs, with the accepted range."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(SMALL + ["--softcap", cap])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "expected a soft cap in [1.1754944e-38, 8.5070592e+37]" in err[-1], err


def test_a_gemm_path_that_cannot_run_is_one_line_and_exit_two(capsys, monkeypatch):
    from numbafa.platform import onednn

    monkeypatch.setenv("NUMBAFA_GEMM", "garbage")
    onednn.gemm_path.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main(SMALL)
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "NUMBAFA_GEMM must be one of" in err[0], err
        assert cli.main(["--info"]) == 0                 # --info reports it instead of crashing
        info = json.loads(capsys.readouterr().out)
        assert info["gemm"]["path"] is None and "NUMBAFA_GEMM" in info["gemm"]["reason"]
    finally:
        monkeypatch.delenv("NUMBAFA_GEMM")
        onednn.gemm_path.cache_clear()
