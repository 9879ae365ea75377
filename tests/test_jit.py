"""JIT flags live in one place (numbafa.compiler.jit); its cache is keyed by the package sources.

The cache itself (location, recovery, fallbacks) is tested end to end in test_cache.py.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import sys

import ml_dtypes
import numba
import numpy as np
import pytest

from numbafa.compiler import jit as jit_policy
from numbafa.kernels.fastexp import expf

PACKAGE = pathlib.Path(jit_policy.__file__).parents[1]   # numbafa/


def _call_name(node):
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_no_hard_coded_jit_flags():
    """Every jitted function is made by numbafa.compiler.jit.jit(); nobody else calls njit/jit with flags."""
    offenders = []
    allowed = set(inspect.signature(jit_policy.jit).parameters)
    for path in PACKAGE.rglob("*.py"):
        if path.name == "jit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            keywords = {k.arg for k in node.keywords}
            if name in ("njit", "vectorize", "guvectorize") or (name == "jit" and not keywords <= allowed):
                offenders.append(f"{path.name}:{node.lineno}: {name}({', '.join(map(str, keywords))})")
            if keywords & {"fastmath", "cache", "nogil", "error_model"}:
                offenders.append(f"{path.name}:{node.lineno}: flags {keywords}")
    assert not offenders, offenders


def test_overload_implementations_get_no_wrappers():
    """Every overload of the package is made by numbafa.compiler.jit.overload, so Numba compiles its
    implementations without the CPython and C wrappers it gives an overload by default (only
    njit code calls them)."""
    import numbafa.nb as nb
    from numba.core.registry import cpu_target
    from numbafa.compiler.records import replaced
    from numbafa.kernels.fastexp import exp_of
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "jit.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "numba.extending":
                offenders += [f"{path.name}:{node.lineno}" for alias in node.names if alias.name == "overload"]
            elif isinstance(node, ast.Attribute) and node.attr == "overload" and "extending" in ast.unparse(node):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
    typing = cpu_target.typing_context
    typing.refresh()
    for stub in (nb._store, nb._fwd_stub, exp_of, replaced):
        for template in typing.resolve_value_type(stub).templates:
            assert template._jit_options["no_cpython_wrapper"] and template._jit_options["no_cfunc_wrapper"], stub


def test_fastmath_only_contracts():
    assert set(jit_policy.JIT_FLAGS["fastmath"]) == {"contract"}


def test_source_hash_changes_when_any_source_changes(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "kernels" / "b.py").write_text("y = 2\n")
    first = jit_policy.source_hash(pkg)
    assert len(first) == 64 and jit_policy.source_hash(pkg) == first
    (pkg / "kernels" / "b.nbi").write_text("not a source")       # cache files do not count
    assert jit_policy.source_hash(pkg) == first
    (pkg / "a.py").write_text("x = 2\n")                         # another module's source changed
    second = jit_policy.source_hash(pkg)
    assert second != first
    (pkg / "a.py").rename(pkg / "c.py")                           # a rename too
    third = jit_policy.source_hash(pkg)
    assert third not in (first, second)
    (pkg).rename(tmp_path / "pkg_twin")                           # the same sources under another name
    assert jit_policy.source_hash(tmp_path / "pkg_twin") not in (first, second, third)
    with pytest.raises(FileNotFoundError):                       # no sources: nothing to key by
        jit_policy.source_hash(tmp_path / "empty")


def test_the_package_uses_its_own_cache_directory():
    info = jit_policy.cache_info()
    if info["enabled"]:
        name = pathlib.Path(info["dir"]).name
        assert name.startswith(jit_policy.source_hash()[:16] + "-numba")
        from numbafa.kernels.backward import bwd_work_item
        assert bwd_work_item.stats.cache_path.startswith(info["dir"])


#: The functions whose signatures are documented API (the Neuron kernel's, the front ends', the
#: goldens', numbafa.nb's) and the torch operators registered with those signatures (their
#: schema is the operator's, and register_fake needs the same one): they may take more than
#: 10 parameters, and nothing else may.
PUBLIC_SIGNATURES = {
    "api.py": {"attention_fwd", "attention_bwd"},
    "distributed.py": {"attention_fwd", "attention_bwd"},
    "functional.py": {"attention"},
    "golden.py": {"attention_fwd", "attention_bwd", "attention_bwd_rounded"},
    "nb.py": {"plan", "attention_bwd", "_backward", "_bwd_stub"},   # (the public call's body and typing stub)
    "jax.py": {"attention"},
    # the operators' schemas, and the Function that calls the backward operator with them
    "torch.py": {"attention", "_attention_fwd", "_attention_fwd_fake", "_attention_bwd", "_attention_bwd_fake",
                 "forward"},
}


def _size(node) -> tuple:
    """(parameters, lines without the docstring) of a function definition."""
    a = node.args
    n_args = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    n_lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n_lines -= first.end_lineno - first.lineno + 1
    return n_args, n_lines


def test_functions_stay_small():
    """Every function of the package takes bundles, not dozens of loose arguments, and fits a
    screen (docs/architecture.md): at most 10 parameters and 80 lines, its docstring not
    counted; only :data:`PUBLIC_SIGNATURES` may take more parameters."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        allowed = PUBLIC_SIGNATURES.get(path.name, set()) if path.parent == PACKAGE else set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_args, n_lines = _size(node)
                if (n_args > 10 and node.name not in allowed) or n_lines > 80:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.name}: {n_args} parameters, "
                                     f"{n_lines} lines")
    assert not offenders, offenders


def test_the_exceptions_are_real():
    """Each listed public signature exists and does take more than 10 parameters."""
    for name, functions in PUBLIC_SIGNATURES.items():
        tree = ast.parse((PACKAGE / name).read_text())
        sizes = {}
        for node in ast.walk(tree):   # (methods of different classes may share a name: the largest)
            if isinstance(node, ast.FunctionDef):
                sizes[node.name] = max(sizes.get(node.name, 0), _size(node)[0])
        for function in functions:
            assert sizes.get(function, 0) > 10, (name, function, sizes.get(function))


def _record_fields(trees) -> dict:
    """``{name: field count}`` of the package's records: ``namedtuple`` assignments,
    dataclasses and ``NamedTuple`` classes."""
    records = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and _call_name(node.value) == "namedtuple" and len(node.value.args) >= 2):
                fields = node.value.args[1]
                count = (len(fields.elts) if isinstance(fields, (ast.List, ast.Tuple))
                         else len(str(fields.value).replace(",", " ").split()))
                records.update({target.id: count for target in node.targets if isinstance(target, ast.Name)})
            elif isinstance(node, ast.ClassDef) and (
                    any("dataclass" in ast.unparse(d) for d in node.decorator_list)
                    or any("NamedTuple" in ast.unparse(b) for b in node.bases)):
                records[node.name] = sum(isinstance(s, ast.AnnAssign) for s in node.body)
    return records


def _jit_keywords(func: ast.FunctionDef) -> dict:
    """The keywords of ``func``'s ``@jit(...)`` decorator ({} without one)."""
    for d in func.decorator_list:
        if isinstance(d, ast.Call) and _call_name(d) == "jit":
            return {k.arg: ast.unparse(k.value) for k in d.keywords}
    return {}


def test_no_step_compiled_without_contraction_takes_the_kernels_exp():
    """``fastexp.expf`` and ``tanhf`` are functions of their own, compiled with the package's flags
    (contraction on) and inlined by LLVM: a ``contract=False`` step calling them, directly or
    through a helper inlined into it, would get contracted polynomials where the helper inlined
    at Numba's IR level used to take the step's flags. Such a step takes its exp through a
    helper of its own (``backward._sink_probability``)."""
    kernel_math = {"expf", "tanhf", "exp_of", "tanh_of"}
    funcs = {}
    for path in (PACKAGE / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                funcs[node.name] = (path.name, node)

    def calls(node):
        return {_call_name(c) for c in ast.walk(node) if isinstance(c, ast.Call)}

    inlined_math = {name for name, (_, node) in funcs.items()
                    if _jit_keywords(node).get("inline") == "True" and calls(node) & kernel_math}
    assert "_softmax_backward_row" in inlined_math                        # the scan sees them
    offenders = [f"{file}: {name}" for name, (file, node) in funcs.items()
                 if _jit_keywords(node).get("contract") == "False" and calls(node) & (kernel_math | inlined_math)]
    assert not offenders, offenders


def test_records_are_built_by_name():
    """No record of five or more fields is built positionally (``Record(a, b, ...)``,
    ``Record(*values)``, ``Record._make(values)``) anywhere in the package, kernels included:
    a swapped pair of same-typed fields would pass silently."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    records = _record_fields(trees)
    assert records["AttentionOptions"] == 14 and records["BwdInputs"] == 7       # the scan sees them
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            made = (isinstance(node.func, ast.Attribute) and node.func.attr == "_make"
                    and _call_name(ast.Call(node.func.value, [], [])) in records)
            record = _call_name(ast.Call(node.func.value, [], [])) if made else name
            if records.get(record, 0) >= 5 and (node.args or made):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, offenders


#: The (batch, head, query position, key position) family of parameter names, in the one order
#: every function takes them (numbafa.kernels.mask.TilePos bundles all four for the plugins).
_POSITION_FAMILY = (("batch", r"^(batch|batch0|b)$"), ("head", r"^(q_head|kv_head|head|head0|h)$"),
                    ("query", r"^q(_abs)?(0|_start|_first|_last|_grp0)?$"),
                    ("key", r"^k(_abs)?(0|_first|_last|_tile0)?$"))


def test_positions_come_in_one_order():
    """No function of the package takes a key position before a query position, a head before a
    batch, ...: same-typed integers in a changing order are a swap that compiles silently."""
    import re

    family = [(rank, re.compile(pattern)) for rank, (_, pattern) in enumerate(_POSITION_FAMILY)]
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                ranks = [(rank, arg.arg) for arg in node.args.args for rank, rx in family if rx.match(arg.arg)]
                if [r for r, _ in ranks] != sorted(r for r, _ in ranks):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                                     f"({', '.join(name for _, name in ranks)})")
    assert not offenders, offenders


@pytest.fixture
def nrt_stats():
    """Numba's allocation counters, on for the test (``(allocations, meminfos)`` still alive)."""
    from numba.core.runtime import _nrt_python, rtsys
    _nrt_python.memsys_enable_stats()

    def alive():
        s = rtsys.get_allocation_stats()
        return s.alloc - s.free, s.mi_alloc - s.mi_free
    yield alive
    _nrt_python.memsys_disable_stats()


# Each case runs the steps compiled without reference counting (jit(refcount=False)) with the
# arrays they are handed and return: a split unit (three q-heads on one KV head, S 384: two
# items, partial dK/dV), the bf16 operands' bits, an s-major layout's rows, dropout, a bias.
_REFERENCE_CASES = {
    "float32-split-gqa-causal": (np.float32, "neuron", dict(use_causal_mask=True)),
    "bf16-dropout-softcap": (ml_dtypes.bfloat16, "neuron", dict(dropout_p=0.25, seed=3, softcap=4.0)),
    "bshd-bias": (np.float32, "bshd", dict(bias=True)),
}


@pytest.mark.parametrize("case", list(_REFERENCE_CASES))
def test_kernels_release_every_reference(case, nrt_stats):
    """Steps compiled without reference counting neither keep an array alive nor release one
    twice: over repeated forward and backward calls, no allocation or meminfo outlives its call
    and the inputs' reference counts are unchanged (a counted view handed to such a step, or a
    borrowed one released, shows here as a growing count, or a crash)."""
    import numbafa
    dtype, layout, options = _REFERENCE_CASES[case]
    rng = np.random.default_rng(0)
    shape = {"neuron": lambda h: (1, h, 64, 384), "bshd": lambda h: (1, 384, h, 64)}[layout]
    q, dy = (rng.standard_normal(shape(3)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(shape(1)).astype(dtype) for _ in range(2))
    if options.pop("bias", False):
        options["bias"] = rng.standard_normal((1, 3, 384, 384)).astype(np.float32)

    def step():
        o, ctx = numbafa.attention(q, k, v, layout=layout, **options)
        return ctx.backward(dy)

    step()                                  # compiled (or loaded) before counting
    before, refs = nrt_stats(), [sys.getrefcount(x) for x in (q, k, v, dy)]
    for _ in range(3):
        grads = step()
    del grads
    assert nrt_stats() == before
    assert [sys.getrefcount(x) for x in (q, k, v, dy)] == refs


def test_refcount_free_steps_are_apart():
    """Only a call by cell balances the references a step without counting returns."""
    with pytest.raises(ValueError, match="refcount=False\\) needs apart=True"):
        jit_policy.jit(refcount=False)


def test_any_layout_steps_are_apart():
    """Only a call by cell casts its arrays to any layout."""
    with pytest.raises(ValueError, match="any_layout=True\\) needs apart=True"):
        jit_policy.jit(any_layout=True)


def test_layout_free_steps_compile_once():
    """A step made with ``any_layout=True`` (``heads.gather_head``) is compiled once for
    C-contiguous arrays and for slices of them, and gives the same copy through either."""
    from numbafa.kernels.heads import gather_head

    @numba.njit
    def gather_both(rows, out, wide):
        n, d = rows.shape
        gather_head((rows, 0, d), 0, n, out, False)                          # C arrays
        gather_head((rows[:, :], 0, d), 0, n, wide[:, 3:3 + n], True)        # a slice of a wider one

    rows = np.arange(13 * 9, dtype=np.float64).reshape(13, 9)   # 8-row blocks and a remainder each way
    out, wide = np.zeros((9, 13)), np.zeros((9, 20))
    gather_both(rows, out, wide)
    np.testing.assert_array_equal(out, rows.T)
    np.testing.assert_array_equal(wide[:, 3:16], rows.T)
    assert not wide[:, :3].any() and not wide[:, 16:].any()
    signatures = [sig for sig in gather_head.dispatcher.overloads if sig[3].dtype == numba.float64]
    assert len(signatures) == 1
    assert all(ty.layout == "A" for sig in gather_head.dispatcher.overloads for ty in (sig[0][0], sig[3]))


def _exp_loop():
    """A fresh elementwise loop, defined from a string: no source file, so never cached (Numba
    inspects only code it compiled in this process)."""
    namespace = {"expf": expf}
    exec("def exp_loop(x, shift):\n"
         "    for j in range(x.size):\n"
         "        x[j] = expf(x[j] - shift)\n", namespace)
    return namespace["exp_loop"]


def test_package_functions_prefer_512_bit_vectors():
    """Package functions are compiled with the vector-width attribute, a user's Numba function in
    the same process as Numba compiles it; with the same fastmath flags both give the same bits
    (an elementwise loop does not depend on the vector width)."""
    package = jit_policy.jit(entry=True)(_exp_loop())
    user = numba.njit(fastmath={"contract"})(_exp_loop())
    x = np.linspace(-90.0, 3.0, 1001, dtype=np.float32)
    a, b = x.copy(), x.copy()
    package(a, np.float32(0.25))
    user(b, np.float32(0.25))
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert jit_policy.VECTOR_WIDTH_ATTRIBUTE in "".join(package.inspect_llvm().values())
    assert jit_policy.VECTOR_WIDTH_ATTRIBUTE not in "".join(user.inspect_llvm().values())


def test_package_functions_skip_the_function_passes_a_users_keep(monkeypatch):
    """Package functions go straight to Numba's module passes (``jit._skip_function_passes``);
    a user's Numba function in the same process gets Numba's function passes as before; both
    give the same bits."""
    from numba.core import codegen

    runs = []
    original = codegen.CPUCodeLibrary._optimize_functions

    def counted(self, ll_module):
        runs.append(ll_module.name)
        return original(self, ll_module)

    x = np.linspace(-90.0, 3.0, 1001, dtype=np.float32)
    # Numba's own helpers the loop uses (a scalar's view, ...) compiled first, as any earlier
    # compile in the process would have: then the counted compile is the package function's.
    jit_policy.jit(entry=True)(_exp_loop())(x.copy(), np.float32(0.25))
    monkeypatch.setattr(codegen.CPUCodeLibrary, "_optimize_functions", counted)
    package = jit_policy.jit(entry=True)(_exp_loop())
    a, b = x.copy(), x.copy()
    package(a, np.float32(0.25))
    assert runs == []
    user = numba.njit(fastmath={"contract"})(_exp_loop())
    user(b, np.float32(0.25))
    assert runs
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_package_loops_use_512_bit_vectors_on_avx512():
    features = getattr(numba.core.registry.cpu_target.target_context.codegen(), "_tm_features", "")
    if "+avx512f" not in features.split(","):
        pytest.skip(f"Numba's target has no AVX-512 here ({numba.core.config.CPU_NAME or 'host'} CPU): "
                    "the attribute changes nothing")
    package = jit_policy.jit(entry=True)(_exp_loop())
    package(np.zeros(64, np.float32), np.float32(0.0))
    assert "zmm" in "".join(package.inspect_asm().values())


_SHARED_KERNELS = r"""
import json, ml_dtypes, numpy as np, numbafa
from numbafa.kernels import backward, entry, forward
rng = np.random.default_rng(0)
for dtype in (np.float32, ml_dtypes.bfloat16):
    q, k, v, dy = (rng.standard_normal((1, 2, 16, 256)).astype(dtype) for _ in range(4))
    o, lse = numbafa.attention_fwd(q, k, v, use_causal_mask=True, mixed_precision=True)
    numbafa.attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, mixed_precision=True)
kernels = (entry.forward_entry, entry.backward_entry, forward.fwd_work_item, backward.bwd_work_item)
print(json.dumps([len(k.signatures) for k in kernels]))
"""


def test_bf16_inputs_run_the_kernels_compiled_for_float32():
    """bf16 inputs reach the entries and the work items as the same records as float32 ones
    (``numbafa.kernels.stored``): in a new process, a float32 then a bf16 forward and backward
    compile (or load) one entry and one work item per pass; only the bf16 plugins are added."""
    import json
    import subprocess

    run = subprocess.run([sys.executable, "-c", _SHARED_KERNELS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [1] * 4


_TWIN = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import llvmlite.binding as llvm
import numbafa.compiler.linking as own, numbafa_twin.compiler.linking as twin
import numbafa.platform.blas as own_blas, numbafa_twin.platform.blas as twin_blas
own.KERNELS.define()
twin.KERNELS.define()
for m in (own, twin):   # each copy's compiled code reads its own table
    assert llvm.address_of_symbol(m.TABLE_SYMBOL) == ctypes.addressof(m.KERNELS._cell), m.__name__
pins = [own_blas._NativePin([]), twin_blas._NativePin([])]
pins[1].pin()           # each copy's native pin counts in its own words
pins[1].unpin()
assert [p.words[own_blas._PINS] for p in pins] == [0, 1], [p.words[own_blas._PINS] for p in pins]
print("ok")
"""


def test_a_copy_of_the_package_under_another_name_keeps_its_own_symbols(tmp_path):
    """Two copies of the package in one process (a vendored copy, or the release before imported
    under another name to measure against) each define their own kernel table and native BLAS pin:
    neither copy's compiled code links to the other's (it did: both defined the kernel table under
    one global symbol, and code linked after the second copy's definition read that copy's table)."""
    import shutil
    import subprocess
    import numbafa

    shutil.copytree(pathlib.Path(numbafa.__file__).parent, tmp_path / "numbafa_twin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-c", _TWIN, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


# -- the lean reference-count walk (numbafa.compiler.refcounts) ---------------------------------

def _walk(walker, ty):
    """``walker``'s meminfos of an argument of type ``ty``: each as (its type, the path of member
    indices from the argument), and the number of instructions the walk emitted."""
    from llvmlite import ir
    from numba.core.registry import cpu_target

    # a subtarget, as Numba lowers in: the base context's `nrt` is a cached property, and an NRT
    # context made there (NRT off) would be copied into every later compile's subtarget
    ctx = cpu_target.target_context.subtarget(enable_nrt=True)
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [ctx.get_value_type(ty)]), "f")
    builder = ir.IRBuilder(fn.append_basic_block())
    found = []
    for t, value in walker(ctx.nrt, builder, ty, fn.args[0]):
        path = []
        while isinstance(value, ir.instructions.ExtractValue):
            path[:0] = value.indices
            value = value.aggregate
        assert value is fn.args[0]
        found.append((t, tuple(path)))
    return found, len(builder.block.instructions)


def _kernel_types():
    """Numba types of the kernels' own bundles: a plan (sinks, dropout: every option's arrays) and
    the Stored inputs of the forward, besides small tuples and plain arrays."""
    from numba.core import types
    from numbafa.checks.options import AttentionOptions
    from numbafa.checks.validation import validate_fwd_inputs
    from numbafa.kernels.bundles import FwdInputs, make_plan
    from numbafa.kernels.stored import stored_fwd

    q = np.zeros((1, 2, 16, 128), np.float32)
    prob = validate_fwd_inputs(q, q[:, :1], q[:, :1], AttentionOptions(use_causal_mask=True, dropout_p=0.1, seed=1,
                                                                       sinks=np.zeros(2, np.float32)))
    plan = make_plan(prob, backward=True)
    ins = stored_fwd(FwdInputs(prob.q, prob.k, prob.v, prob.sinks), plan.acc)
    return [types.float32[:, ::1], types.float64, types.UniTuple(types.int64, 3),
            types.Tuple((types.int64, types.float32[::1], types.UniTuple(types.int64, 2), types.uint16[:, :, :, ::1])),
            numba.typeof(ins), numba.typeof(plan)]


def test_the_lean_reference_count_walk_finds_numbas_meminfos_from_less_code():
    from numbafa.compiler import refcounts

    for ty in _kernel_types():
        theirs, their_code = _walk(refcounts.numba_meminfos, ty)
        ours, our_code = _walk(refcounts.lean_meminfos, ty)
        assert ours == theirs                        # the same meminfos, in Numba's order
        assert our_code <= their_code
    assert our_code < their_code / 3                 # the plan: mostly values without meminfos


def test_only_a_package_lowering_takes_the_lean_walk():
    from numba.core.runtime.context import NRTContext

    from numbafa.compiler import refcounts

    refcounts.install()
    plan_type = _kernel_types()[-1]
    numbas, numbas_code = _walk(refcounts.numba_meminfos, plan_type)
    outside, outside_code = _walk(NRTContext.get_meminfos, plan_type)
    with refcounts.lowering():
        inside, inside_code = _walk(NRTContext.get_meminfos, plan_type)
    assert outside == inside == numbas
    assert outside_code == numbas_code > inside_code
