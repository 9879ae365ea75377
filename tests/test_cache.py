"""The on-disk kernel cache: location, recovery from corruption, no writable place, full disk.

Every test here works on a copy of the package in a temporary directory (with a
tiny probe module added, so nothing slow is compiled) and runs it in fresh
processes with every cache location pointed into that directory: the user's own
cache is never read or written.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

import numbafa

PACKAGE = pathlib.Path(numbafa.__file__).parent

# probe() calls a helper from another module: the case Numba's per-file source
# stamp cannot see (editing _probe_helper.py leaves _probe.py's stamp unchanged).
PROBE = '''\
from .compiler.jit import jit
from ._probe_helper import offset


@jit(entry=True)
def probe(x):
    return x + offset()


@jit(entry=True)
def pair(x, y):
    return x * y + offset()
'''

HELPER = '''\
from .compiler.jit import jit


@jit(entry=True)
def offset():
    return {value}
'''

# Prints one JSON line: probe(41), the cache hits of probe, the warnings raised.
SCRIPT = '''\
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numbafa._probe as p
    value = p.probe(41)
print(json.dumps({"value": int(value), "hits": sum(p.probe.stats.cache_hits.values()),
                  "warnings": [str(w.message) for w in caught]}))
'''

# Prints one JSON line: the values of the calls, the functions Numba compiled (its
# "numba:compile" events: a load from the cache has none), the warnings raised.
CALLS = '''\
import json, warnings
from numba.core import event

compiled = []


class Compiles(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev):
        pass


event.register("numba:compile", Compiles())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numbafa._probe as p
    values = [{calls}]
print(json.dumps({{"values": values, "compiled": compiled, "warnings": [str(w.message) for w in caught]}}))
'''


def make_site(root: pathlib.Path, offset: int = 1) -> pathlib.Path:
    """A copy of the package under ``root/site`` with the probe modules added."""
    site = root / "site"
    shutil.copytree(PACKAGE, site / "numbafa",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    (site / "numbafa" / "_probe.py").write_text(PROBE)
    set_offset(site, offset)
    return site


def set_offset(site: pathlib.Path, value: int) -> None:
    (site / "numbafa" / "_probe_helper.py").write_text(HELPER.format(value=value))


def clean_env(root: pathlib.Path, site: pathlib.Path, **extra) -> dict:
    """The environment of a probe process: every cache location inside ``root``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NUMBAFA_", "NUMBA_CACHE", "XDG_", "PYTHON"))}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", HOME=str(root / "home"),
               XDG_CACHE_HOME=str(root / "xdg"), NUMBAFA_CACHE_DIR=str(root / "cache"))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run(root, site, script=SCRIPT, **extra):
    """Run ``script`` in a fresh process; return its last stdout line parsed as JSON."""
    proc = subprocess.run([sys.executable, "-c", script], env=clean_env(root, site, **extra),
                          cwd=root, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cache_warnings(result):
    return [w for w in result["warnings"] if "cache" in w.lower()]


# -- location ---------------------------------------------------------------------------------


def test_cache_lives_in_a_directory_per_source_hash(tmp_path):
    site = make_site(tmp_path)
    first = run(tmp_path, site)
    assert first == {"value": 42, "hits": 0, "warnings": []}
    assert not list(site.rglob("*.nbi")), "kernels must not be cached inside the package"
    (hash_dir,) = (tmp_path / "cache").iterdir()
    assert {p.name.split("-")[0] for p in hash_dir.rglob("*.nbi")} == {"_probe.probe", "_probe_helper.offset"}
    info = run(tmp_path, site, "import json, numbafa; print(json.dumps(numbafa.backend_info()['cache']))")
    assert info["enabled"] is True and pathlib.Path(info["dir"]) == hash_dir
    assert run(tmp_path, site) == {"value": 42, "hits": 1, "warnings": []}


def test_cache_root_falls_back_to_numba_cache_dir_then_xdg(tmp_path):
    site = make_site(tmp_path)
    script = "import json, numbafa; print(json.dumps(numbafa.backend_info()['cache']))"
    info = run(tmp_path, site, script, NUMBAFA_CACHE_DIR=None, NUMBA_CACHE_DIR=str(tmp_path / "nb"))
    assert pathlib.Path(info["dir"]).parent == tmp_path / "nb" / "numbafa"
    info = run(tmp_path, site, script, NUMBAFA_CACHE_DIR=None)
    assert pathlib.Path(info["dir"]).parent == tmp_path / "xdg" / "numbafa"
    info = run(tmp_path, site, script, NUMBAFA_CACHE_DIR=None, XDG_CACHE_HOME=None)
    assert pathlib.Path(info["dir"]).parent == tmp_path / "home" / ".cache" / "numbafa"


def test_users_own_cached_functions_are_left_alone(tmp_path):
    site = make_site(tmp_path)
    (site / "usermod.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef g(x):\n    return x + 1\n")
    result = run(tmp_path, site, "import json, numbafa._probe as p, usermod\n"
                                 "print(json.dumps({'g': usermod.g(1), 'p': int(p.probe(41))}))")
    assert result == {"g": 2, "p": 42}
    assert [p.name.split("-")[0] for p in (site / "__pycache__").glob("*.nbi")] == ["usermod.g"]
    assert not [p for p in (tmp_path / "cache").rglob("*.nbi") if "usermod" in p.name]


def test_numbafa_cache_0_writes_nothing(tmp_path):
    site = make_site(tmp_path)
    script = SCRIPT.replace("print(json.dumps({",
                            "import numbafa\nprint(json.dumps({'cache': numbafa.backend_info()['cache'], ")
    result = run(tmp_path, site, script, NUMBAFA_CACHE="0")
    assert result["value"] == 42 and result["warnings"] == []
    assert result["cache"]["enabled"] is False and "NUMBAFA_CACHE=0" in result["cache"]["reason"]
    assert not list(tmp_path.rglob("*.nbi"))


@pytest.mark.parametrize("value, enabled", [("off", False), ("No", False), ("TRUE", True), ("maybe", True),
                                            ("2", True)])
def test_numbafa_cache_takes_the_usual_words_and_warns_on_others(tmp_path, value, enabled):
    """0/false/no/off and 1/true/yes/on, any case; another value ("maybe") leaves the default (on)
    and says so, instead of being taken as "on" without a word."""
    site = make_site(tmp_path)
    script = SCRIPT.replace("print(json.dumps({",
                            "import numbafa\nprint(json.dumps({'cache': numbafa.backend_info()['cache'], ")
    result = run(tmp_path, site, script, NUMBAFA_CACHE=value)
    assert result["value"] == 42 and result["cache"]["enabled"] is enabled
    warned = cache_warnings(result)
    if value in ("maybe", "2"):
        assert len(warned) == 1 and f"NUMBAFA_CACHE={value!r} is not one of" in warned[0], warned
    else:
        assert warned == []


def test_source_change_in_another_module_is_never_served_stale(tmp_path):
    # A process that imported the old sources saves its code after a process with
    # the new sources cleared the cache; a third process (new sources) must not load it.
    site = make_site(tmp_path, offset=1)
    env = clean_env(tmp_path, site)
    old = subprocess.Popen([sys.executable, "-c",
                            "import numbafa._probe as p\nprint('ready', flush=True)\ninput()\n"
                            "print(int(p.probe(41)), flush=True)"],
                           env=env, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert old.stdout.readline().strip() == "ready"
        set_offset(site, 2)                                   # the sources change
        assert run(tmp_path, site)["value"] == 43             # new process: new code
        old.stdin.write("\n")
        old.stdin.flush()
        assert old.stdout.readline().strip() == "42"          # old process: old code, saved
    finally:
        old.communicate(timeout=120)
    assert run(tmp_path, site)["value"] == 43                 # never the old process's code


CHANGED_AFTER_IMPORT = """\
import json, os, pathlib, warnings
import numbafa
helper = pathlib.Path(numbafa.__file__).parent / "_probe_helper.py"
os.utime(helper, None)                         # modified after this process began importing the package
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import numbafa._probe as p
    value = p.probe(41)
print(json.dumps({"value": int(value), "cache": numbafa.backend_info()["cache"],
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_sources_changed_after_the_import_began_run_without_the_cache(tmp_path):
    """The source hash is taken on first use: a file modified after the import began would make
    it describe code this process does not run, so the process compiles without the cache (one
    warning naming the file) and writes nothing; the next process caches again."""
    site = make_site(tmp_path)
    result = run(tmp_path, site, CHANGED_AFTER_IMPORT)
    assert result["value"] == 42 and result["cache"]["enabled"] is False
    assert "_probe_helper.py" in result["cache"]["reason"]
    warned = cache_warnings(result)
    assert len(warned) == 1 and "changed after this process imported them" in warned[0], warned
    assert not list(tmp_path.rglob("*.nbi"))
    assert run(tmp_path, site) == {"value": 42, "hits": 0, "warnings": []}   # a new process: cached again
    assert list(tmp_path.rglob("*.nbi"))


def test_old_hash_directories_are_pruned(tmp_path):
    site = make_site(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    old = []
    for i in range(6):                                        # six older source versions
        d = cache / f"{i:016x}-numba0.0.0-py30"
        d.mkdir()
        (d / "x.nbi").write_text("old")
        os.utime(d, (time.time() - 3600 * (i + 1),) * 2)
        old.append(d)
    unrelated = cache / "notes"
    unrelated.mkdir()
    os.utime(unrelated, (0, 0))
    run(tmp_path, site)
    kept = sorted(p.name for p in cache.iterdir())
    # the newest old versions survive next to the current one; unrelated entries are never touched
    assert [d.name for d in old[:3]] == [n for n in kept if n.endswith("py30")]
    assert "notes" in kept and len(kept) == 5


# -- corruption -------------------------------------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path):
    path.write_bytes(b"")


def _garble(path):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xA5 for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated index": (".nbi", _truncate),
    "empty index": (".nbi", _empty),
    "garbled index": (".nbi", _garble),
    "truncated data": (".nbc", _truncate),
    "empty data": (".nbc", _empty),
    "garbled data": (".nbc", _garble),
}


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """A package copy whose cache holds probe() (compiled once for all corruption modes)."""
    root = tmp_path_factory.mktemp("populated")
    site = make_site(root)
    assert run(root, site)["value"] == 42
    return root


@pytest.mark.parametrize("mode", sorted(CORRUPTIONS))
def test_corrupted_cache_entry_is_dropped_and_recompiled(populated, tmp_path, mode):
    root = tmp_path / "root"
    shutil.copytree(populated, root)
    suffix, corrupt = CORRUPTIONS[mode]
    (victim,) = root.rglob(f"_probe.probe-*{suffix}")
    corrupt(victim)
    recovered = run(root, root / "site")
    assert recovered["value"] == 42
    warned = cache_warnings(recovered)
    assert len(warned) == 1 and "corrupt" in warned[0] and "probe" in warned[0], recovered
    again = run(root, root / "site")                          # the next process loads the new entry
    assert again == {"value": 42, "hits": 1, "warnings": []}


SIGNATURES = """\
import json
from numbafa.compiler.jit import cached_signatures
import numbafa._probe as p
print(json.dumps([[[str(t) for t in sig] for sig in cached_signatures(f)] for f in (p.probe, p.pair)]))
"""


def test_cached_signatures_lists_what_the_cache_holds_and_nothing_it_cannot_read(populated, tmp_path):
    """``cached_signatures`` (what numbafa.nb.plan registers from): the argument types of the
    function's entries for these sources and this CPU; none without the cache or with an index
    that does not read back (its entries are compiled again when called)."""
    assert run(populated, populated / "site", SIGNATURES) == [[["int64"]], []]
    assert run(populated, populated / "site", SIGNATURES, NUMBAFA_CACHE="0") == [[], []]
    root = tmp_path / "root"
    shutil.copytree(populated, root)
    (index,) = root.rglob("_probe.probe-*.nbi")
    _garble(index)
    assert run(root, root / "site", SIGNATURES) == [[], []]


# -- entries bound to their function ----------------------------------------------------------


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory):
    """A package copy whose cache holds probe() for int64 (data file 1) and float64 (2) and
    pair(), for the current sources (offset 2), and probe(41) for older ones (offset 1)."""
    root = tmp_path_factory.mktemp("two_versions")
    site = make_site(root, offset=1)
    assert run(root, site, CALLS.format(calls="p.probe(41)"))["values"] == [42]
    (old,) = (root / "cache").iterdir()
    set_offset(site, 2)
    calls = CALLS.format(calls="p.probe(41), p.probe(0.5), p.pair(6, 7)")
    assert run(root, site, calls)["values"] == [43, 2.5, 44]
    (new,) = set((root / "cache").iterdir()) - {old}
    return root, old.name, new.name


# Where the data file copied over probe()'s int64 entry comes from (None: no tampering):
# an index and a data file out of step, as between two writers.
DONORS = {
    "honest cache": None,
    "another function": ("new", "_probe.pair-*.1.nbc"),
    "another signature": ("new", "_probe.probe-*.2.nbc"),
    "older sources": ("old", "_probe.probe-*.1.nbc"),
}


@pytest.mark.parametrize("donor", sorted(DONORS))
def test_a_data_file_loads_only_for_its_function_signature_and_sources(two_versions, tmp_path, donor):
    populated, old, new = two_versions
    root = tmp_path / "root"
    shutil.copytree(populated, root)
    dirs = {"old": root / "cache" / old, "new": root / "cache" / new}
    if DONORS[donor]:
        where, pattern = DONORS[donor]
        (source,) = dirs[where].glob(pattern)
        (victim,) = dirs["new"].glob("_probe.probe-*.1.nbc")
        shutil.copyfile(source, victim)
    first = run(root, root / "site", CALLS.format(calls="p.probe(41)"))
    assert first["values"] == [43], first
    if DONORS[donor]:                                         # dropped, recompiled, with one warning
        warned = cache_warnings(first)
        assert len(warned) == 1 and "corrupt" in warned[0] and "probe" in warned[0], first
        assert first["compiled"] == ["probe"], first
    else:                                                     # loaded: nothing compiled
        assert first == {"values": [43], "compiled": [], "warnings": []}
    # the next process loads the new entry, and every other entry of the cache was left in place
    again = run(root, root / "site", CALLS.format(calls="p.probe(41), p.probe(0.5), p.pair(6, 7)"))
    assert again == {"values": [43, 2.5, 44], "compiled": [], "warnings": []}


# -- nowhere to write -------------------------------------------------------------------------


def _read_only_install(root):
    """A package copy that cannot hold a __pycache__, and a HOME that cannot be created.

    Works as root too: a path under a regular file can never be created.
    """
    site = make_site(root)
    for pkg in (site / "numbafa", site / "numbafa" / "kernels"):
        (pkg / "__pycache__").write_text("not a directory")
    (root / "blocker").write_text("a file")
    return site, dict(HOME=str(root / "blocker" / "home"), XDG_CACHE_HOME=None,
                      NUMBAFA_CACHE_DIR=None, NUMBA_CACHE_DIR=None)


def test_no_writable_cache_location_falls_back_to_compiling(tmp_path):
    site, env = _read_only_install(tmp_path)
    result = run(tmp_path, site, **env)
    assert result["value"] == 42
    warned = cache_warnings(result)
    assert len(warned) == 1 and "NUMBAFA_CACHE_DIR" in warned[0], result
    proc = subprocess.run([sys.executable, "-m", "numbafa", "--info"], env=clean_env(tmp_path, site, **env),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cache = json.loads(proc.stdout)["cache"]
    assert cache["enabled"] is False and cache["dir"] is None and "NUMBAFA_CACHE_DIR" in cache["reason"]


def test_unwritable_numbafa_cache_dir_falls_back_to_compiling(tmp_path):
    site = make_site(tmp_path)
    (tmp_path / "blocker").write_text("a file")
    result = run(tmp_path, site, NUMBAFA_CACHE_DIR=str(tmp_path / "blocker" / "cache"))
    assert result["value"] == 42
    warned = cache_warnings(result)
    assert len(warned) == 1 and str(tmp_path / "blocker" / "cache") in warned[0], result


FULL_DISK = '''\
import builtins, errno, io, os

def _full(opener):
    def open_on_a_full_disk(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax") and (".nbi" in str(file) or ".nbc" in str(file)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return opener(file, mode, *args, **kwargs)
    return open_on_a_full_disk

builtins.open, io.open = _full(builtins.open), _full(io.open)
'''


def test_full_disk_does_not_fail_the_computation(tmp_path):
    site = make_site(tmp_path)
    result = run(tmp_path, site, FULL_DISK + SCRIPT)
    assert result["value"] == 42
    warned = cache_warnings(result)
    # probe() and offset() both failed to save: one warning for the process
    assert len(warned) == 1 and "No space left on device" in warned[0], result


def test_after_a_failed_save_the_compile_notice_says_so(tmp_path):
    """The announcement of a compile after a save failed (full disk) in the same process does not
    claim the code is cached for later processes."""
    site = make_site(tmp_path)
    script = FULL_DISK + """
import io, json, logging, warnings
warnings.simplefilter("ignore")
stream = io.StringIO()
logging.getLogger("numbafa").addHandler(logging.StreamHandler(stream))
import numbafa._probe as p
from numbafa.compiler.runtime import kernel_call
with kernel_call("probe", "float32"):
    p.probe(41)
with kernel_call("pair", "float32"):
    p.pair(2, 3)
print(json.dumps(stream.getvalue().splitlines()))
"""
    first, second = run(tmp_path, site, script)
    assert "compiling the probe kernel" in first and "for later processes" in first
    assert "compiling the pair kernel" in second and "for later processes" not in second
    assert "failed in this process (OSError: [Errno 28] No space left on device" in second, second
