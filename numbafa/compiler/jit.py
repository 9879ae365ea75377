"""The JIT policy: every ``@njit`` flag of the package, and its on-disk cache.

Every ``@njit`` in the package is created through :func:`jit`, so its flags
(``fastmath``, ``error_model``, ``nogil``, the cache) come from :data:`JIT_FLAGS`
and nowhere else, and every ``@overload`` through :func:`overload`, whose
implementations get no wrappers (:data:`OVERLOAD_OPTIONS`). ``tests/test_jit.py``
greps the sources for hard-coded flags and for Numba's own ``overload``.

Importing this module only defines: the cache settings below are read, the
package sources hashed and the cache directory created on first use (the
first compile or cached load of a package function, or :func:`cache_info`),
once per process. Set the environment variables below before that.

The kernel cache
----------------
A cold first call compiles the kernels of its dtype (:data:`COMPILE_TIME`;
docs/performance.md, "Compile time"); with the on-disk cache, a later process
loads them in 0.3-0.7 s.
Compiled code is kept in::

    <cache root>/<source hash>-numba<numba version>-py<python version>/

``<source hash>`` is a SHA-256 of the package's name and every ``.py`` file of the package
(path and content, computed on first use, a few milliseconds). Numba stamps each cached
function with its own file only, so a kernel compiled against an older helper
in another module would look fresh; keying the whole directory by the package
sources means code compiled from different sources never shares a file, even
when an old process (editable install, notebook) saves its code after the
sources changed. The hash is taken on first use, so a process whose package
files were modified after it began importing them (their mtime is later)
runs without the cache, with one :class:`CacheWarning`: its code is not what
the files now say. Functions that use :func:`jit` outside the package (tests)
are cached there too, under ``external/``, stamped by their own file as well.
The user's own Numba functions are never touched. The ``<cache root>`` is the
first of:

``NUMBAFA_CACHE_DIR``
    used as is;
``NUMBA_CACHE_DIR`` (Numba's own setting)
    ``$NUMBA_CACHE_DIR/numbafa``;
the per-user cache directory
    ``$XDG_CACHE_HOME/numbafa``, else ``~/.cache/numbafa``.

It is never a shared temporary directory: compiled code is loaded and run, so
it must live somewhere only the user can write. If the chosen directory cannot
be created or written (read-only home, for example), kernels are compiled in
every process instead and one :class:`CacheWarning` says so; set
``NUMBAFA_CACHE_DIR`` to a writable directory to get the cache back. The same
happens, for want of sources to hash, in a zipped or source-less install.

When a directory for new sources is created, the oldest other source-hash
directories under the root are deleted, keeping the
:data:`KEEP_SOURCE_VERSIONS` most recently used (the new one included; only
names of that form are ever deleted). This is safe with concurrent processes: every file of a
directory was compiled from that directory's sources, writes are atomic
(temporary file, then rename), and a process whose directory disappears just
compiles again (and recreates it).

Each index and data file carries a SHA-256 of its content. A data file also
holds, under that seal, the entry it was written for: the function's
qualified name, its index key (argument types, target CPU, bytecode hash),
the package's source hash and the stamp of the function's file; it loads
only for that entry. An entry that cannot be read back (truncated, garbled,
unreadable by this Numba), or whose data file was written for another entry
(another function, signature or source version: index and data out of step,
as after a copy), is deleted and its function compiled again, with one
:class:`CacheWarning`; when a data file is at fault it goes alone, and the
function's other signatures stay cached. A failed save (disk full, for
example) never fails the computation: one :class:`CacheWarning` per process.
:func:`cache_info` (also in ``numbafa.backend_info()["cache"]``) says
whether the cache is on and where.

``NUMBAFA_CACHE=0``
    Compile kernels without the on-disk cache (nothing is read or written).
    ``0``, ``false``, ``no``, ``off`` turn it off, ``1``, ``true``, ``yes``, ``on``
    (any case) or nothing leave it on; any other value leaves it on with a
    :class:`CacheWarning`.

``NUMBAFA_CACHE_DIR``
    The cache root, see above.

Vector width: every package function is compiled with the LLVM function attribute
``"prefer-vector-width"="512"`` (:class:`_Compiler`). LLVM's own choice for Intel's AVX-512 CPUs
(Skylake-X to Sapphire Rapids) is 256-bit vectors, for Zen 4 512-bit ones; on a Xeon with AVX-512
the float32 ``exp`` loop of the softmax ran at 0.41 ns per element with 256-bit vectors and 0.28
with 512-bit ones. Elementwise loops give the same bits at either width (no float reduction
is reassociated: see ``fastmath`` below); on CPUs without AVX-512 the attribute changes nothing.
The user's own Numba functions are compiled as they were.

Optimisation rounds: Numba optimises a function's freshly lowered code three times, its
function-level passes on the new module, then the library's module passes twice (a cheap round
that gathers reference-count operations for pruning, then the full one). Package functions skip
the first round (:func:`_skip_function_passes`), whose work the module passes repeat: float32's
cold compile 0.4-2.7 s of CPU shorter on Zen 4 (of 21-24 s), every output bit-identical
(``bench/bit_identity.py`` on both GEMM paths, and compiled for Haswell); docs/performance.md,
"What was tried". A user's Numba functions keep all three.

Reference counts: while a package function is lowered, Numba's walk over a value's members
for its reference-count operations descends only into members that can hold an array
(:mod:`numbafa.compiler.refcounts`): the same operations from a third fewer LLVM instructions.

``fastmath`` is restricted to ``{"contract"}`` and not configurable: it lets
LLVM fuse ``a * b + c`` into one FMA (faster, and never less accurate), but
forbids reassociation, flush-to-zero and "no NaN/inf" assumptions, which
would make the results depend on the compiler rather than on the algorithm
(and break the bit tricks of :mod:`numbafa.kernels.fastexp`). The bf16
rounding points are unaffected: they are explicit integer operations.

Notes
-----
The cache plugs into Numba's own caching classes (``numba.core.caching``:
a cache locator, the compile-result cache, the index/data file), which are
internal to Numba: ``tests/test_cache.py`` checks the wiring end to end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import io
import os
import pathlib
import pickle
import re
import shutil
import sys
import tempfile
import threading
import warnings

import numba
import numba.extending
from numba.core import caching
from numba.core.compiler import Compiler
from numba.core.compiler_machinery import LoweringPass, register_pass
from numba.core.registry import CPUDispatcher
from numba.core.typed_passes import NativeLowering

from . import linking, refcounts

__all__ = ["JIT_FLAGS", "jit", "overload", "callable_from_python", "KernelDispatcher", "cache_info", "source_hash",
           "cached_signatures", "CacheWarning", "KEEP_SOURCE_VERSIONS", "COMPILE_TIME"]

#: What a cold compile costs, quoted by every compile notice (docs/performance.md, "Compile time",
#: measures it per CPU).
COMPILE_TIME = "20-40 s of CPU for float32's forward and backward together, less for each later dtype or variant"

#: The package directory: functions defined under it are "the package's".
PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]

#: How many source-hash directories survive pruning (the current one included).
KEEP_SOURCE_VERSIONS = 4

_HASH_DIR = re.compile(r"^[0-9a-f]{16}-numba[0-9A-Za-z.+_]+-py[0-9]+$")


class CacheWarning(UserWarning):
    """The on-disk kernel cache could not be used as intended; results are unaffected."""


_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def _env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable ``name``: ``0/false/no/off`` or ``1/true/yes/on`` (any case);
    unset or empty: ``default``; anything else: ``default``, with a :class:`CacheWarning`."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _FALSE or value in _TRUE:
        return value in _TRUE
    warnings.warn(f"numbafa: {name}={os.environ[name]!r} is not one of {'/'.join(_FALSE)} or {'/'.join(_TRUE)}; "
                  f"taken as {'on' if default else 'off'}, the default", CacheWarning, stacklevel=3)
    return default


def source_hash(package_dir=PACKAGE_DIR) -> str:
    """SHA-256 (hex) of the package's name (``package_dir``'s, the name it is imported by) and
    every ``.py`` file under ``package_dir``: relative path and content. A copy imported under
    another name compiles functions of other names (``numbafa_twin.kernels...``): it keeps a
    cache directory of its own rather than finding every entry bound to the other copy's names.

    Raises
    ------
    FileNotFoundError
        No ``.py`` file there (a zipped or source-less install): nothing to key a cache by.
    """
    package_dir = pathlib.Path(package_dir)
    sources = sorted(package_dir.rglob("*.py"))
    if not sources:
        raise FileNotFoundError(f"no Python sources under {package_dir}")
    digest = hashlib.sha256(package_dir.resolve().name.encode() + b"\0")
    for path in sources:
        digest.update(str(path.relative_to(package_dir).as_posix()).encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _changed_since_import(package_dir=PACKAGE_DIR) -> list:
    """The package's ``.py`` files modified after this process began importing the package
    (``numbafa._IMPORTED_NS``): the code in memory is not what their hash describes."""
    since = getattr(sys.modules.get(__name__.split(".")[0]), "_IMPORTED_NS", None)
    if since is None:
        return []
    changed = []
    for path in sorted(pathlib.Path(package_dir).rglob("*.py")):
        try:
            if path.stat().st_mtime_ns > since:
                changed.append(path.relative_to(package_dir).as_posix())
        except OSError:
            changed.append(path.relative_to(package_dir).as_posix())
    return changed


def _cache_root():
    """The cache root and the setting it came from, or ``(None, why)``."""
    explicit = os.environ.get("NUMBAFA_CACHE_DIR", "").strip()
    if explicit:
        return pathlib.Path(explicit).expanduser().absolute(), "NUMBAFA_CACHE_DIR"
    if numba.config.CACHE_DIR:
        return pathlib.Path(numba.config.CACHE_DIR).expanduser().absolute() / "numbafa", "NUMBA_CACHE_DIR"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):
        return pathlib.Path(xdg) / "numbafa", "XDG_CACHE_HOME"
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isabs(home):
        return None, "no home directory"
    return pathlib.Path(home) / ".cache" / "numbafa", "~/.cache"


def _prune(root: pathlib.Path, current: pathlib.Path) -> None:
    """Delete all but the most recently used source-hash directories under ``root``."""

    def last_used(path):
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    try:
        others = [p for p in root.iterdir() if p != current and _HASH_DIR.match(p.name) and p.is_dir()]
    except OSError:
        return
    others.sort(key=last_used, reverse=True)
    for old in others[KEEP_SOURCE_VERSIONS - 1:]:
        shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class _CacheConfig:
    enabled: bool
    directory: pathlib.Path | None
    reason: str
    source_hash: str | None = None


def _resolve_cache() -> _CacheConfig:
    """Decide, once per process, whether and where kernels are cached (may warn once)."""
    if not _env_flag("NUMBAFA_CACHE", True):
        return _CacheConfig(False, None, "disabled by NUMBAFA_CACHE=0")
    root, origin = _cache_root()
    how = ("set NUMBAFA_CACHE_DIR (or NUMBA_CACHE_DIR) to a writable directory to cache them, "
           "or NUMBAFA_CACHE=0 to compile without a cache silently")
    changed = []
    try:
        digest = source_hash()
        changed = _changed_since_import()
    except FileNotFoundError as exc:
        reason = f"cannot key the cache by the package sources ({exc})"
    else:
        if changed:
            reason = (f"the package's sources changed after this process imported them ({', '.join(changed[:3])}"
                      f"{', ...' if len(changed) > 3 else ''}): its code is not theirs, so this process compiles "
                      f"without the cache; a new process uses it again")
        elif root is None:
            reason = f"no cache directory ({origin}); {how}"
        else:
            version = f"numba{numba.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
            directory = root / f"{digest[:16]}-{version}"
            try:
                new = not directory.is_dir()
                directory.mkdir(parents=True, exist_ok=True)
                tempfile.TemporaryFile(dir=directory).close()
                os.utime(directory)  # last used: pruning keeps the recently used ones
            except OSError as exc:
                reason = f"cannot write the cache directory {directory} (from {origin}): {exc}; {how}"
            else:
                if new:
                    _prune(root, directory)
                return _CacheConfig(True, directory, f"from {origin}", digest)
    lead = "kernels are compiled in this process" if changed else "kernels are compiled in every process"
    warnings.warn(f"numbafa: {lead} ({COMPILE_TIME}): {reason}", CacheWarning, stacklevel=2)
    return _CacheConfig(False, None, reason)


_resolved: list = []                 # [the _CacheConfig], once resolved
_resolve_lock = threading.Lock()


def _cache_config() -> _CacheConfig:
    """The process's cache decision (:func:`_resolve_cache`), made on first use, once."""
    if not _resolved:
        with _resolve_lock:
            if not _resolved:
                _resolved.append(_resolve_cache())
    return _resolved[0]


#: Why the last save to the cache failed in this process (None: none failed).
_save_error: list = [None]


def cache_info() -> dict:
    """Whether the on-disk kernel cache is on, where, and why (JSON-serialisable).

    Returns
    -------
    dict
        ``enabled`` (bool), ``dir`` (the source-hash directory, or None),
        ``reason`` (where the directory setting came from, or why the cache
        is off) and ``save_error`` (why saving compiled code failed in this
        process, e.g. a full disk; None while every save succeeded).
    """
    config = _cache_config()
    return {"enabled": config.enabled,
            "dir": None if config.directory is None else str(config.directory),
            "reason": config.reason, "save_error": _save_error[0]}


#: The Numba flags shared by every jitted function of the package (the on-disk cache is the
#: package's own, decided on first use: :func:`cache_info`).
JIT_FLAGS: dict = {
    "fastmath": frozenset({"contract"}),
    # 'numpy' error model: float division by zero gives inf/nan instead of
    # raising, as in NumPy, and lets LLVM vectorise divisions.
    "error_model": "numpy",
    "nogil": True,
}


#: The LLVM function attribute every package function is compiled with (module docstring).
VECTOR_WIDTH_ATTRIBUTE = '"prefer-vector-width"="512"'


def _tag_functions(ir_module) -> None:
    """Give every function ``ir_module`` defines :data:`VECTOR_WIDTH_ATTRIBUTE`. (llvmlite's
    attribute sets accept only enum attributes by name; a string attribute is printed as given.)"""
    for function in ir_module.functions:
        if function.blocks:
            set.add(function.attributes, VECTOR_WIDTH_ATTRIBUTE)


@register_pass(mutates_CFG=False, analysis_only=False)
class _WideVectorLibrary(LoweringPass):
    """Before Numba's lowering: the code library the function is lowered into, made as Numba
    makes it, with its ``add_ir_module`` tagging the module's functions first. Only this
    library (this function's code) is affected, not the process's other Numba code."""

    _name = "numbafa_wide_vector_library"

    def __init__(self):
        LoweringPass.__init__(self)

    def run_pass(self, state):
        if state.library is None:
            library = state.targetctx.codegen().create_library(state.func_id.func_qualname)
            library.enable_object_caching()
            add_ir_module = library.add_ir_module

            def tagged(ir_module):
                _tag_functions(ir_module)
                add_ir_module(ir_module)

            library.add_ir_module = tagged
            _skip_function_passes(library)
            state.library = library
        return True


def _skip_function_passes(library) -> None:
    """Numba runs its function-level passes on each newly lowered module before linking it into
    the library's final module, which its module passes (a cheap round for reference-count
    pruning, then the full one) optimise again: for the package's functions the first round is
    left out, but for the data layout it sets, which the module passes need (module
    docstring, "Optimisation rounds")."""
    codegen = library._codegen

    def data_layout_only(ll_module):
        ll_module.data_layout = codegen._data_layout

    library._optimize_functions = data_layout_only


@register_pass(mutates_CFG=True, analysis_only=False)
class _PackageLowering(NativeLowering):
    """Numba's lowering, with the lean reference-count walk (:mod:`numbafa.compiler.refcounts`)."""

    _name = "numbafa_native_lowering"

    def run_pass(self, state):
        refcounts.install()
        with refcounts.lowering():
            return super().run_pass(state)


class _Compiler(Compiler):
    """Numba's compiler with :class:`_WideVectorLibrary` just before the lowering, and the
    lowering :class:`_PackageLowering`."""

    def define_pipelines(self):
        pipelines = super().define_pipelines()
        for pm in pipelines:
            names = [cls for cls, _ in pm.passes]
            if NativeLowering in names:
                i = names.index(NativeLowering)
                pm.passes[i] = (_PackageLowering, str(_PackageLowering))
                pm.passes.insert(i, (_WideVectorLibrary, str(_WideVectorLibrary)))
                pm.finalize()
        return pipelines


# -- warnings, once ---------------------------------------------------------------------------

_warned: set = set()          # keys of the CacheWarnings already given in this process
_warned_lock = threading.Lock()


def _warn_once(key, message: str) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, CacheWarning, stacklevel=2)


# -- the cache classes ------------------------------------------------------------------------

_MAGIC = b"numbafa-cache-4\n"


class _CorruptCacheFile(Exception):
    """A cache file (``path``) whose checksum does not match its content, or written for another entry."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def _seal(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _unseal(raw: bytes, path) -> bytes:
    head = len(_MAGIC) + 32
    payload = raw[head:]
    if raw[:len(_MAGIC)] != _MAGIC or hashlib.sha256(payload).digest() != raw[len(_MAGIC):head]:
        raise _CorruptCacheFile(f"{os.path.basename(path)}: checksum mismatch ({len(raw)} bytes)", path)
    return payload


def _cache_path_for(py_file: str) -> str:
    """The directory caching the functions of ``py_file``."""
    parent = pathlib.Path(py_file).resolve().parent
    try:
        sub = parent.relative_to(PACKAGE_DIR)
    except ValueError:  # jit() used outside the package (tests): keyed by the folder's path
        sub = pathlib.Path("external", f"{parent.name}_{hashlib.sha1(str(parent).encode()).hexdigest()[:12]}")
    return str(_cache_config().directory / sub)


class _Locator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator: the source-hash directory, stamped by the function's own file."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = _cache_path_for(py_file)

    def get_cache_path(self):
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):
        return cls(py_func, py_file)


_CompileResultCacheImpl = getattr(caching, "CompileResultCacheImpl", None) or caching._CompileResultCacheImpl


class _CacheImpl(_CompileResultCacheImpl):
    """Numba's compile-result serialisation with :class:`_Locator` (no locator search).

    A compile result is stored with the cells of the apart functions its code calls
    (:func:`numbafa.compiler.linking.cells_of`) and the oneDNN and libgomp functions it calls
    (:func:`numbafa.compiler.linking.external_symbols`); loading it first makes those resolvable
    (:func:`numbafa.platform.onednn.ensure_symbols`), loads the apart functions and fills their cells
    (:func:`numbafa.compiler.linking.ensure_cells`), so its machine code finds every symbol.
    """

    def __init__(self, py_func):
        self._lineno = py_func.__code__.co_firstlineno
        qualname = getattr(py_func, "__qualname__", py_func.__name__)
        source_path = inspect.getfile(py_func)
        self._locator = _Locator.from_function(py_func, source_path)
        modname = os.path.splitext(os.path.basename(source_path))[0]
        self._filename_base = self.get_filename_base(f"{modname}.{qualname}", getattr(sys, "abiflags", ""))

    def reduce(self, cres):
        return (linking.cells_of(cres.library), linking.external_symbols(cres.library, ("dnnl_", "omp_")),
                super().reduce(cres))

    def rebuild(self, target_context, payload):
        cells, gemm_symbols, reduced = payload
        if gemm_symbols:
            # Machine code of the GEMM seam calls oneDNN's and libgomp's symbols: they must exist
            # before it is linked, in any process, whatever it ran before, or LLVM aborts it.
            from ..platform.onednn import ensure_symbols
            ensure_symbols()
        linking.KERNELS.define()   # the kernel table an entry reads (one symbol, defined once)
        linking.ensure_cells(cells)
        cres = super().rebuild(target_context, reduced)
        # Numba runs a loaded entry's reload hooks (a parallel function's: start the threading
        # layer) but leaves its library without them, so a caller compiled later against that
        # library would not inherit them: put them back.
        cres.library._reload_init.update(cres.reload_init)
        return cres


_ENTRY_FIELDS = ("function", "index key (argument types, target, bytecode)", "package sources", "file stamp")


def _mismatch(name: str, entry, expected) -> str:
    """Why the data file ``name``, written for ``entry``, cannot serve ``expected``."""

    def called(entry):
        return f"{entry[0]}({', '.join(map(str, entry[1][0]))})"

    differ = [field for field, mine, theirs in zip(_ENTRY_FIELDS, entry, expected) if mine != theirs]
    return f"{name} was written for {called(entry)}, not {called(expected)} (another {', '.join(differ)})"


class _CheckedFiles(caching.IndexDataCacheFile):
    """Numba's index + data files, each sealed with a SHA-256 of its content.

    A data file starts with its entry, ``(qualified name, index key, source hash, source
    stamp)``, inside the seal: :meth:`load` compares it with the entry the index lookup was
    for, before unpickling the compiled code, and raises :class:`_CorruptCacheFile` if they
    differ (a data file copied over another's, or an index and a data file out of step).
    """

    def __init__(self, cache_path, filename_base, source_stamp, owner):
        super().__init__(cache_path=cache_path, filename_base=filename_base, source_stamp=source_stamp)
        self._owner = owner  # (qualified name, package source hash)

    def _entry(self, key):
        name, sources = self._owner
        return name, key, sources, self._source_stamp

    def save(self, key, data):
        super().save(key, (self._entry(key), data))  # Numba picks the file name, _save_data writes

    def _save_index(self, overloads):
        payload = pickle.dumps(self._version, protocol=-1) + self._dump((self._source_stamp, overloads))
        with self._open_for_write(self._index_path) as f:
            f.write(_seal(payload))

    def _load_index(self):
        try:
            with open(self._index_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        stream = io.BytesIO(_unseal(raw, self._index_path))
        if pickle.load(stream) != self._version:
            return {}  # another Numba's entry: overwritten by the next save
        stamp, overloads = pickle.loads(stream.read())
        return overloads if stamp == self._source_stamp else {}

    def _save_data(self, name, data):
        entry, compiled = data
        with self._open_for_write(self._data_path(name)) as f:
            f.write(_seal(self._dump(entry) + self._dump(compiled)))

    def load(self, key):
        name = self._load_index().get(key)
        if name is None:
            return None
        path = self._data_path(name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:  # removed since the index was read: compiled again
            return None
        payload = _unseal(raw, path)
        stream = io.BytesIO(payload)
        entry, expected = pickle.load(stream), self._entry(key)
        if entry != expected:
            raise _CorruptCacheFile(_mismatch(name, entry, expected), path)
        return pickle.loads(memoryview(payload)[stream.tell():])


class _Cache(caching.FunctionCache):
    """A Numba function cache that recovers from bad entries and never fails a call.

    * a cached entry that cannot be loaded (checksum mismatch, a data file
      written for another entry, unpickling or LLVM error) is deleted, with one
      :class:`CacheWarning` (a bad data file alone; else the function's index and
      data files); Numba then compiles the function and saves it afresh;
    * a save that fails (disk full, directory removed, ...) warns once per
      process and is otherwise ignored: the compiled code is already in use.
    """

    _impl_class = _CacheImpl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _CheckedFiles(cache_path=self._cache_path,
                                         filename_base=self._impl.filename_base,
                                         source_stamp=self._impl.locator.get_source_stamp(),
                                         owner=(f"{py_func.__module__}.{py_func.__qualname__}",
                                                _cache_config().source_hash))

    def _load_overload(self, sig, target_context):
        try:
            return super()._load_overload(sig, target_context)
        except Exception as exc:  # any unreadable entry: drop it and compile
            bad = exc.path if isinstance(exc, _CorruptCacheFile) else None
            removed = self._drop_entries(bad if bad and bad.endswith(".nbc") else None)
            _warn_once(("corrupt", self._cache_path, self._impl.filename_base),
                       f"numbafa: the kernel cache entry of {self._py_func.__qualname__} in "
                       f"{self._cache_path} was corrupt or unreadable ({type(exc).__name__}: {exc}); "
                       f"deleted {removed} file(s), compiling it again")
            return None

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except Exception as exc:  # the compiled code is in memory already: only the cache misses out
            _save_error[0] = f"{type(exc).__name__}: {exc}"
            _warn_once("save", f"numbafa: could not save compiled code to the kernel cache in "
                               f"{_cache_config().directory} ({exc}); results are unaffected, but later "
                               f"processes compile again")

    def _drop_entries(self, data_file=None) -> int:
        """Delete ``data_file``, else all this function's index and data files; return how many went.

        A data file that fails its own seal, or holds another entry, goes alone: the index still
        names it for its key, so the next save rewrites it, and the function's other entries
        (other signatures), each checked against its own entry when loaded, stay.
        """
        if data_file is not None:
            try:
                os.unlink(data_file)
            except OSError:
                return 0
            return 1
        base = self._impl.filename_base
        data = re.compile(re.escape(base) + r"\.[0-9]+\.nbc$")
        removed = 0
        try:
            names = os.listdir(self._cache_path)
        except OSError:
            return 0
        for name in names:
            if name == base + ".nbi" or data.match(name):
                try:
                    os.unlink(os.path.join(self._cache_path, name))
                    removed += 1
                except OSError:
                    pass
        return removed


class _LazyCache(caching.NullCache):
    """A dispatcher's cache that becomes the package's disk cache (:class:`_Cache`) or none on
    its first use, when Numba first tries to load or save one of the function's signatures
    (always before it compiles one): the cache is decided then (:func:`_cache_config`), not at
    import."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._cache = None
        self._lock = threading.Lock()

    def _real(self):
        if self._cache is None:
            with self._lock:
                if self._cache is None:
                    self._cache = _Cache(self._py_func) if _cache_config().enabled else caching.NullCache()
        return self._cache

    @property
    def cache_path(self):
        return self._real().cache_path

    def load_overload(self, sig, target_context):
        return self._real().load_overload(sig, target_context)

    def save_overload(self, sig, cres):
        return self._real().save_overload(sig, cres)

    def flush(self):
        if self._cache is not None:
            self._cache.flush()


def _enable_cache(dispatcher) -> None:
    """Give ``dispatcher`` the package's disk cache (what ``cache=True`` does with Numba's),
    decided on its first use (:class:`_LazyCache`)."""
    try:
        source = inspect.getfile(dispatcher.py_func)
    except TypeError:
        return
    if os.path.exists(source):  # not for "<stdin>", "<string>", ...
        dispatcher._cache = _LazyCache(dispatcher.py_func)


def cached_signatures(dispatcher) -> list:
    """The argument types of every signature of ``dispatcher`` (a :func:`jit` function) that the
    disk cache holds for this process's sources, Numba and CPU ([] without the cache, or with an
    index that cannot be read: those signatures are compiled when a call is typed)."""
    cache = getattr(dispatcher, "_cache", None)
    real = cache._real() if isinstance(cache, _LazyCache) else None
    if not isinstance(real, _Cache):
        return []
    try:
        index = real._cache_file._load_index()
    except Exception:  # unreadable: the next load of one of its entries drops it (_Cache)
        return []
    codegen = dispatcher.targetctx.codegen()
    return [key[0] for key in index if real._index_key(key[0], codegen) == key]


class KernelDispatcher(CPUDispatcher):
    """The dispatcher of a function compiled for ``@njit`` callers only (``jit(entry=False)``).

    It has no CPython wrapper, so calling it from Python would jump into nothing; it raises a
    ``TypeError`` instead. Tests reach such a function through :func:`callable_from_python`.
    """

    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.py_func.__qualname__} is compiled for @njit callers only (no Python "
                        f"wrapper); call it from @njit code, or through numbafa.compiler.jit.callable_from_python")


def jit(*, parallel: bool = False, inline: bool = False, contract: bool = True, entry: bool = False,
        apart: bool = False, refcount: bool = True, disk_cache: bool = True, any_layout: bool = False):
    """Return a decorator like ``numba.njit``, configured with :data:`JIT_FLAGS`.

    Parameters
    ----------
    parallel : bool
        For the launchers, whose ``prange`` loop runs the work items (:mod:`numbafa.kernels.launch`).
    inline : bool
        Inline at the Numba IR level (``inline="always"``): for helpers that return
        views into refcount-free steps (see ``refcount``), for tiny scalar functions that
        must not count references, and for ``numbafa.nb``'s one-line public passes (a
        user's function then compiles one level of nb's code less). Each call site pays
        a copy of the helper's IR and its untyped passes; a pure helper called at many
        sites (``fastexp.expf``, ``stored.stored_dims``) is cheaper as a plain function,
        compiled once, which LLVM inlines into its callers.
    contract : bool
        ``False`` turns ``fastmath`` off entirely, so ``a * b + c`` is two
        roundings, never one fused multiply-add: for functions that emulate a
        two-operator instruction of the Neuron kernel (``scalar_tensor_tensor``
        applies its operators in sequence, each result an fp32 value), where
        a fused rounding could flip a bf16 rounding point (docs/numerics.md).
    entry : bool
        Callable from Python: Numba generates its CPython wrapper. Functions
        only ``@njit`` code calls (the default) get no wrapper -- and no C
        wrapper -- which saves about a fifth of the kernels' cold compile; their
        dispatcher (:class:`KernelDispatcher`) refuses a call from Python.
    apart : bool
        Compiled on its own, once, and called through a cell, so its callers'
        compilation never links, re-optimises or re-emits its body
        (:mod:`numbafa.compiler.linking`): for the large steps of a kernel, each called
        at most once per tile. Returns the intrinsic ``@njit`` code calls.
    refcount : bool
        ``False`` compiles the function without Numba's reference counting (``_nrt=False``):
        no atomic increment and decrement of the arrays in its arguments and of every view
        it takes, which at a single tile cost the kernels 5-9 % of their time. For the
        steps that take the caller's arrays and scratch and allocate nothing (Numba refuses
        an allocation there at compile time); only with ``apart``, whose call site gives
        the arrays a step returns the reference count its caller expects
        (:mod:`numbafa.compiler.linking`). What such a step calls that returns arrays is
        inlined or apart as well: a counted view handed to it would never be released
        (``tests/test_jit.py`` checks the balance of the kernels' variants).
    any_layout : bool
        Only with ``apart``: its array arguments are typed any layout (``"A"``), so a step called
        with C-contiguous arrays and with slices of them compiles once
        (:func:`numbafa.compiler.linking.layout_free`); for steps whose loops do not gain from a
        known unit stride (``heads.gather_head``: vector loads of its own).
    disk_cache : bool
        ``False`` keeps the function off the disk cache: compiled in every process, so that its
        typing runs in every process (``numbafa.nb``'s public passes, whose typing records the
        checks they call in the process's kernel table).
    """
    if not (refcount or apart):
        raise ValueError("jit(refcount=False) needs apart=True: its call site balances returned references")
    if any_layout and not apart:
        raise ValueError("jit(any_layout=True) needs apart=True: its call site casts the arrays")
    flags = dict(JIT_FLAGS)
    flags["fastmath"] = set(flags["fastmath"]) if contract else False
    wrappers = entry and not apart
    flags["_nrt"] = refcount   # explicit either way: a function that does not set it inherits its caller's
    njit = numba.njit(parallel=parallel, inline="always" if inline else "never",
                      no_cpython_wrapper=not wrappers, no_cfunc_wrapper=True, pipeline_class=_Compiler, **flags)

    def decorate(func):
        dispatcher = njit(func)
        if not wrappers:
            dispatcher.__class__ = KernelDispatcher
        if disk_cache:
            _enable_cache(dispatcher)
        return linking.apart(dispatcher, any_layout) if apart else dispatcher

    return decorate


#: The options of every overload implementation of the package: compiled for njit callers only, as
#: :func:`jit`'s functions are (Numba gives an implementation both wrappers by default: 8 % of
#: :mod:`numbafa.nb`'s compile for new argument types; docs/performance.md, "What was tried").
OVERLOAD_OPTIONS = {"no_cpython_wrapper": True, "no_cfunc_wrapper": True}


def overload(func, **kwargs):
    """``numba.extending.overload`` with :data:`OVERLOAD_OPTIONS` (``jit_options`` given add to them)."""
    return numba.extending.overload(func, jit_options={**OVERLOAD_OPTIONS, **kwargs.pop("jit_options", {})},
                                    **kwargs)


_python_twins: dict = {}
_python_twins_lock = threading.Lock()


def callable_from_python(function):
    """A twin of a ``jit()`` function (or an apart one) that Python can call: the same source and
    flags compiled with a CPython wrapper (tests and benchmarks use it to reach kernel helpers)."""
    py_func = function.py_func
    with _python_twins_lock:
        twin = _python_twins.get(py_func)
        if twin is None:
            dispatcher = getattr(function, "dispatcher", function)
            options = {k: v for k, v in dispatcher.targetoptions.items()
                       if k not in ("no_cpython_wrapper", "no_cfunc_wrapper", "nopython")}
            twin = _python_twins[py_func] = numba.njit(pipeline_class=_Compiler, **options)(py_func)
    return twin
