"""numbafa's modules import each other without a cycle, and each one imports on its own.

The graph is read from the sources with ``ast``: every ``import`` / ``from ... import``
of the package, at module level *and* inside functions (an import put in a function
to dodge a cycle is still a cycle). ``from . import x`` is an edge to the submodule
``x`` when there is one, else to the package itself (its ``__init__`` must have run
far enough to hold ``x``: ``from . import __version__`` in a module the package
imports is a cycle).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys

import numbafa

PACKAGE_DIR = pathlib.Path(numbafa.__file__).resolve().parent
ROOT = PACKAGE_DIR.name

#: Modules that import an optional dependency at the top, with that dependency.
OPTIONAL = {f"{ROOT}.torch": "torch", f"{ROOT}.jax": "jax", f"{ROOT}.distributed": "dask"}


def _modules() -> dict:
    """``{dotted name: path}`` of every module of the package (packages by their ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = (ROOT,) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _ancestors(name: str) -> list:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node, module: str, is_package: bool, modules) -> list:
    """The package modules an import node needs."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = package[:len(package) - (node.level - 1)]
            base = ".".join(base + (node.module.split(".") if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    targets = []
    for name in names:
        while name and name not in modules:   # "import numbafa.x.y" where y is not a module
            name = name.rpartition(".")[0]
        if not name:
            continue
        # Importing a.b.c runs a and a.b first: those the importer is not already inside count.
        needed = [parent for parent in _ancestors(name) if parent not in _ancestors(module)] + [name]
        targets += [n for n in needed if n != module and n not in targets]
    return targets


def import_graph() -> dict:
    """``{module: {imported module: "file:line" of the first such import}}`` inside the package."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.name == "__init__.py", modules):
                    edges.setdefault(target, f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}")
    return graph


def find_cycle(graph: dict):
    """A cycle ``[a, b, ..., a]`` of ``graph``, or None."""
    state = {}          # 1: on the current path, 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_kinds_of_import():
    """Relative, parent-relative, absolute and function-level imports are edges; a package
    whose submodule is imported is one too."""
    graph = import_graph()
    assert "numbafa.compiler.jit" in graph["numbafa.conventions.dtypes"]    # from ..compiler.jit import jit
    assert "numbafa.compiler.jit" in graph["numbafa.kernels.common"]        # from ..compiler.jit import jit
    assert "numbafa.pipeline.core" in graph["numbafa.pipeline.shards"]      # from . import core
    assert {"numbafa.kernels", "numbafa.kernels.launch"} <= set(graph["numbafa.pipeline.core"])
    assert "numbafa.api" in graph["numbafa"]                         # the package's own imports
    assert "numbafa.golden" in graph["numbafa"]                      # from . import golden
    assert "numbafa" not in graph["numbafa.kernels.common"]          # parents already running

    def edges(source, module="numbafa.a", package=False):
        found = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += _targets(node, module, package, {"numbafa", "numbafa.a", "numbafa.b",
                                                          "numbafa.kernels", "numbafa.kernels.c"})
        return found

    assert edges("def f():\n    from .b import x\n") == ["numbafa.b"]
    assert edges("from . import __version__") == ["numbafa"]
    assert edges("from . import b") == ["numbafa.b"]
    assert edges("import numbafa.kernels.c") == ["numbafa.kernels", "numbafa.kernels.c"]
    assert edges("from numbafa import b, x") == ["numbafa.b", "numbafa"]
    assert edges("from .. import a", module="numbafa.kernels.c") == ["numbafa.a"]
    assert edges("from . import c", module="numbafa.kernels", package=True) == ["numbafa.kernels.c"]
    assert edges("import numpy\nfrom numba import njit") == []
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ""}, "b": {}, "c": {"a": "", "b": ""}}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


#: The layers, lowest first (docs/architecture.md): a module imports its own layer's modules and
#: lower layers' only. ``numbafa.layout`` (public, at the top for its import path) is a convention:
#: it imports only ``conventions.tiling``, and the checks and the pipeline use it.
LAYERS = (("platform", ("numbafa.platform",)), ("compiler", ("numbafa.compiler",)),
          ("conventions", ("numbafa.conventions", "numbafa.layout")), ("kernels", ("numbafa.kernels",)),
          ("checks", ("numbafa.checks",)), ("pipeline", ("numbafa.pipeline",)))


def layer_of(module: str) -> tuple:
    """``(rank, name)`` of ``module``'s layer; the package's top level is the front doors (last)."""
    for rank, (name, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return rank, name
    return len(LAYERS), "front doors"


def wrong_way(graph: dict) -> list:
    return [f"{source} ({where}) imports {target}: {layer_of(source)[1]} must not import {layer_of(target)[1]}"
            for source, edges in graph.items() for target, where in edges.items()
            if layer_of(target)[0] > layer_of(source)[0]]


def test_layers_import_downwards_only():
    assert wrong_way(import_graph()) == []
    # the check sees a wrong-way import, at module level or in a function
    assert wrong_way({"numbafa.platform.cpu": {"numbafa.pipeline.core": "cpu.py:9"}})
    assert not wrong_way({"numbafa.pipeline.core": {"numbafa.platform.cpu": "core.py:9"}})
    assert layer_of("numbafa.api")[1] == layer_of("numbafa")[1] == "front doors"


def test_the_top_level_holds_the_front_doors_and_each_layer_says_what_it_may_import():
    top = sorted(p.name for p in PACKAGE_DIR.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top
    layers = {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()}
    assert layers == {prefixes[0].split(".")[1] for _, prefixes in LAYERS}
    for name in layers:
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / name / "__init__.py").read_text())) or ""
        assert "May import" in doc or "imports nothing else" in doc.replace("Imports", "imports"), name


IMPORT_EACH_ALONE = """\
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "{root}" or m.startswith("{root}.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + ":\\n" + traceback.format_exc())
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone():
    """Each module imported first in an interpreter where no numbafa module is loaded (one
    subprocess; numbafa's modules are dropped from sys.modules before each import)."""
    names = [name for name in _modules()
             if name not in OPTIONAL or importlib.util.find_spec(OPTIONAL[name]) is not None]
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE.format(root=ROOT), *names],
                          cwd=PACKAGE_DIR.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


IMPORT_ONLY_DEFINES = """\
import json, os, sys
root = sys.argv[1]
seen = []

def audit(event, args):
    if event in ("os.mkdir", "os.rename", "os.remove", "os.utime", "shutil.rmtree", "os.chmod"):
        seen.append([event, str(args[0])])
    elif event == "open" and isinstance(args[0], str):
        path, mode = args[0], str(args[1] or "r")
        writes = any(c in mode for c in "wax+") or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR))
        if writes or (path.endswith(".py") and "b" in mode and "/{root}/" in path):
            seen.append([event, path, mode])     # a write, or a source read as bytes (the hash)

sys.addaudithook(audit)
import {root}
from {root}.platform import blas
from {root}.compiler import jit, runtime
from numba.core import event
state = dict(seen=list(seen), resolved=len(jit._resolved), listening=runtime._ANNOUNCER._listening,
             hooked=blas._PIN._hooked, listeners=[type(x).__module__ for x in event._registered["numba:compile"]],
             files=sorted(os.listdir(root)))
{root}.backend_info()                             # first use: the cache is decided now
state["after"] = dict(resolved=len(jit._resolved), files=sorted(os.listdir(root)))
print(json.dumps(state))
"""


def test_import_only_defines(tmp_path):
    """``import numbafa`` writes no file, hashes no source, registers no Numba listener or fork
    hook (all on first use); the first use (``backend_info``) then decides the cache."""
    import json

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {key: value for key, value in __import__("os").environ.items()
           if not key.startswith(("NUMBAFA_", "NUMBA_CACHE", "XDG_"))}
    env.update(NUMBAFA_CACHE_DIR=str(empty / "cache"), XDG_CACHE_HOME=str(empty / "xdg"), HOME=str(empty),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-c", IMPORT_ONLY_DEFINES.replace("{root}", ROOT), str(empty)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["seen"] == [] and state["files"] == [], state
    assert state["resolved"] == 0 and not state["listening"] and not state["hooked"], state
    assert not [m for m in state["listeners"] if m.startswith(ROOT)], state
    assert state["after"] == {"resolved": 1, "files": ["cache"]}, state
