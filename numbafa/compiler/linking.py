"""Calls between separately compiled functions: compiled once, never re-optimised by a caller.

Numba links the LLVM code of every jitted callee into each caller and
optimises the whole again, level after level, and emits machine code for
every level: a kernel's call tree of ~60 small functions is optimised and
emitted several times over, and a ``prange`` loop's gufunc once more. Two
ways of calling a function whose body LLVM never sees again:

**By address** (the launchers, :mod:`numbafa.kernels.launch`). The caller
gets the callee's address as an ``int64`` argument and calls it with
:func:`call_status` (or :func:`call_or_raise`); :func:`native_address`
gives, in Python, the address of a dispatcher's native function for given
argument types (compiling it, or loading it from the disk cache, first).
Nothing of the callee is in the caller's code, so the caller is cached, and
may be inlined into a user's own ``@njit`` code, independently of it.

**By cell** (``jit(apart=True)``, :class:`Apart`). Inside a kernel's call
tree, where no argument can carry an address, the call goes through a
pointer-sized global, a *cell*, named after the callee and its argument
types. Typing a call compiles (or loads) the callee for those types and
fills the cell (``llvmlite.binding.add_symbol``); the caller's code loads
the cell and calls what it holds. A cached caller records the cells it
reads (:func:`cells_of`); loading it from the cache first loads those
callees and fills their cells (:func:`ensure_cells`), so the machine code
never meets an unresolved symbol.

Both use Numba's own calling convention (``context.call_conv``): the callee
is the very native function Numba calls internally, with its status and
exception info; no C wrapper is generated for it. Arguments are borrowed.
A returned array is a new reference from a function compiled with
reference counting and a borrowed one from a function compiled without
(``jit(refcount=False)``); a call by cell between the two increfs or
decrefs what it returns, so each side sees its own convention.

The callee must have been compiled for exactly the argument types the call
passes. :class:`Apart` guarantees it (it compiles for the types it is
typed with); a call by address relies on its caller, which computes both
from the same objects (:mod:`numbafa.kernels.launch`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import inspect
import threading

import llvmlite.binding as llvm
import llvmlite.ir as llvm_ir
from numba import types
from numba.core import cgutils
from numba.core.runtime.context import NRTContext
from numba.extending import intrinsic

__all__ = ["Apart", "apart", "native_address", "call_status", "call_or_raise", "pack", "unpack", "address_of",
           "layout_free", "cells_of", "external_symbols", "ensure_cells", "PACKAGE", "CELL_PREFIX", "KERNELS",
           "type_key", "kernel_key", "register_kernel", "register_function", "call_key", "call_value_between",
           "KERNEL_TABLE_CAPACITY"]

#: The package's name, first in the global symbols its compiled code links through (the cells, the
#: kernel table): a copy of the package imported under another name in the same process (a vendored
#: copy, the release before in an A/B measurement) defines its own, and never links to this one's.
PACKAGE = __name__.partition(".")[0]
#: Name prefix of the cells (pointer-sized globals) through which apart functions are called.
CELL_PREFIX = f"{PACKAGE}.apart$"

_lock = threading.RLock()
_cells = {}        # cell name -> (ctypes.c_void_p of the callee's address, Apart, argument types, return type)


def _native_function(dispatcher, argtys):
    """``(compile result, address)`` of ``dispatcher``'s native function for ``argtys``."""
    dispatcher.compile(argtys)
    cres = dispatcher.overloads[argtys]
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"numbafa: no native function of {dispatcher.py_func.__qualname__}{argtys}")
    return cres, address


def native_address(dispatcher, argtys) -> int:
    """Address of ``dispatcher``'s native function for the Numba types ``argtys`` (compiled, or
    loaded from the disk cache, first); valid as long as ``dispatcher`` lives."""
    return _native_function(dispatcher, tuple(argtys))[1]


def _call(context, builder, address, argtys, llargs, restype):
    """Call the native function at ``address`` with Numba's calling convention; ``(status, value)``."""
    fnty = context.call_conv.get_function_type(restype, argtys)
    fn = builder.inttoptr(address, fnty.as_pointer())
    return context.call_conv.call_function(builder, fn, restype, argtys, llargs)


@intrinsic
def address_of(typingctx, pointer):
    """``address_of(pointer)``: a :func:`pack` pointer as an int64, to hand to a function that takes
    it as an opaque word (the generic launcher, :func:`numbafa.kernels.launch.run_items`): every
    work item gets its own typed pointer back, the same machine word."""
    if not isinstance(pointer, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], llvm_ir.IntType(64))

    return types.int64(pointer), codegen


def _unpacked(builder, args_ty, tuple_value):
    return list(args_ty.types), cgutils.unpack_tuple(builder, tuple_value, len(args_ty))


@intrinsic
def call_status(typingctx, address, args):
    """``call_status(address, args)``: call the native function at ``address`` (int64) with the
    tuple ``args`` spread as its arguments; return 0 if it returned, 1 if it raised (the
    exception is dropped: use :func:`call_or_raise` to see it). The callee returns nothing."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, sig, llargs):
        argtys, values = _unpacked(builder, sig.args[1], llargs[1])
        status, _ = _call(context, builder, llargs[0], argtys, values, types.none)
        return builder.zext(status.is_error, llvm_ir.IntType(32))

    return types.int32(address, args), codegen


def _call_propagating(context, builder, sig, llargs, restype):
    """Codegen of a call by address whose callee's exception propagates to the caller."""
    argtys, values = _unpacked(builder, sig.args[1], llargs[1])
    status, value = _call(context, builder, llargs[0], argtys, values, restype)
    with cgutils.if_unlikely(builder, status.is_error):
        context.call_conv.return_status_propagate(builder, status)
    return value


@intrinsic
def call_or_raise(typingctx, address, args):
    """As :func:`call_status`, but an exception of the callee propagates to the caller."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, sig, llargs):
        _call_propagating(context, builder, sig, llargs, types.none)
        return context.get_dummy_value()

    return types.none(address, args), codegen


@intrinsic
def call_value_between(typingctx, address, args, restype, before, after):
    """``call_value_between(address, args, restype, before, after)``: as :func:`call_or_raise`,
    for a callee that returns a value of the Numba type ``restype`` (a type object, e.g.
    ``np.int64``), with the C functions ``void f(void)`` at the addresses ``before`` and ``after``
    (int64) called just before the callee and just after it returns or raises, so that what
    ``before`` takes ``after`` gives back on every path (the BLAS pin,
    :func:`numbafa.compiler.runtime.register_pin`)."""
    if not (isinstance(address, types.Integer) and isinstance(args, types.BaseTuple)
            and isinstance(restype, types.NumberClass) and isinstance(before, types.Integer)
            and isinstance(after, types.Integer)):
        return None
    value_type = restype.instance_type

    def codegen(context, builder, sig, llargs):
        void_fn = llvm_ir.FunctionType(llvm_ir.VoidType(), []).as_pointer()
        builder.call(builder.inttoptr(llargs[3], void_fn), [])
        argtys, values = _unpacked(builder, sig.args[1], llargs[1])
        status, value = _call(context, builder, llargs[0], argtys, values, value_type)
        builder.call(builder.inttoptr(llargs[4], void_fn), [])
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return value

    return value_type(address, args, restype, before, after), codegen


@intrinsic
def pack(typingctx, value):
    """``pack(value)``: a pointer (``CPointer(typeof(value))``) to a copy of ``value`` in the
    caller's stack frame, valid until the caller returns. A launcher hands its argument
    bundles to the ``prange`` body this way: Numba's parallel backend cannot pass nested
    tuples of arrays into a ``prange`` loop, and a pointer is one scalar."""
    def codegen(context, builder, sig, args):
        model = context.data_model_manager[sig.args[0]]
        return cgutils.alloca_once_value(builder, model.as_data(builder, args[0]))

    return types.CPointer(value)(value), codegen


@intrinsic
def unpack(typingctx, pointer):
    """``unpack(pointer)``: the value :func:`pack` stored, as a new reference (its arrays are
    increfed, as Numba expects of a value an intrinsic returns)."""
    if not isinstance(pointer, types.CPointer):
        return None

    def codegen(context, builder, sig, args):
        model = context.data_model_manager[sig.return_type]
        value = model.from_data(builder, builder.load(args[0]))
        if context.enable_nrt:
            context.nrt.incref(builder, sig.return_type, value)
        return value

    return pointer.dtype(pointer), codegen


def _cell_name(module: str, qualname: str, argtys) -> str:
    # Numba's mangled names carry a per-process counter; the cell's name must be the same in
    # every process that loads a cached caller, so it is built from stable parts.
    digest = hashlib.sha1(repr(tuple(str(t) for t in argtys)).encode()).hexdigest()[:16]
    return f"{CELL_PREFIX}{module}.{qualname}${digest}"


def apart(dispatcher, any_layout=False):
    """The callable that ``@njit`` code uses to call ``dispatcher`` through a cell: a Numba
    intrinsic with the attributes ``apart`` (its :class:`Apart`), ``dispatcher`` and
    ``py_func``. What ``numbafa.compiler.jit.jit(apart=True)`` returns. ``any_layout``: the
    arrays among the arguments (and in their plain tuples) are passed typed any layout
    (:func:`layout_free`), so one compile serves every layout they come in."""
    state = Apart(dispatcher, any_layout)
    call = intrinsic(state.typer())
    call.apart = state
    call.dispatcher = dispatcher
    call.py_func = dispatcher.py_func
    call.__doc__ = dispatcher.py_func.__doc__
    call.__wrapped__ = dispatcher.py_func
    return call


class Apart:
    """A jitted function compiled on its own and called through a cell (module docstring)."""

    def __init__(self, dispatcher, any_layout=False):
        self.dispatcher = dispatcher
        self.any_layout = any_layout
        self.py_func = dispatcher.py_func
        self.__name__ = dispatcher.py_func.__name__
        self.__qualname__ = dispatcher.py_func.__qualname__
        self.__module__ = dispatcher.py_func.__module__

    def ensure(self, argtys) -> str:
        """Compile (or load) the function for ``argtys`` and fill its cell; return the cell's name."""
        argtys = tuple(argtys)
        name = _cell_name(self.__module__, self.__qualname__, argtys)
        with _lock:
            if name not in _cells:
                cres, address = _native_function(self.dispatcher, argtys)
                cell = ctypes.c_void_p(address)
                llvm.add_symbol(name, ctypes.addressof(cell))
                _cells[name] = (cell, self, argtys, cres.signature.return_type)
        return name

    def typer(self):
        """The intrinsic's typing function, with the wrapped function's own parameters."""
        params = list(inspect.signature(self.py_func).parameters)
        source = (f"def {self.__name__}(typingctx, {', '.join(params)}):\n"
                  f"    return _type(({', '.join(params)},))\n")
        namespace = {"_type": self._type}
        exec(source, namespace)
        return namespace[self.__name__]

    def _type(self, args):
        argtys = tuple(types.unliteral(a) for a in args)
        if self.any_layout:
            argtys = tuple(layout_free(a) for a in argtys)
        name = self.ensure(argtys)
        restype = _cells[name][3]
        callee_counts = self.dispatcher.targetoptions.get("_nrt", True)

        def codegen(context, builder, sig, llargs):
            values = [context.cast(builder, v, a, b) for v, a, b in zip(llargs, args, argtys)]
            cell = _external_global(builder.module, name, llvm_ir.IntType(8).as_pointer())
            address = builder.ptrtoint(builder.load(cell), llvm_ir.IntType(64))
            status, value = _call(context, builder, address, argtys, values, restype)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            if callee_counts != context.enable_nrt:
                # Arrays returned by a function compiled with reference counting are new
                # references, by one compiled without, borrowed: make them what the caller expects.
                counting = NRTContext(context, True)
                (counting.decref if callee_counts else counting.incref)(builder, restype, value)
            return value

        return restype(*args), codegen


def layout_free(ty):
    """``ty`` with its arrays, and those of its plain tuples, typed any layout (``"A"``; a call
    casts to it, the same pointer, shape and strides)."""
    if isinstance(ty, types.Array):
        return ty.copy(layout="A")
    if isinstance(ty, types.BaseTuple) and not isinstance(ty, types.BaseNamedTuple):
        return types.Tuple([layout_free(t) for t in ty])
    return ty


def cells_of(library) -> list:
    """The apart callees a finalized code library reads cells of: ``[(module, qualname,
    argument types)]``, to be stored with its cached code (:func:`ensure_cells`)."""
    module = getattr(library, "_final_module", None)
    if module is None:
        return []
    found = []
    with _lock:
        for gv in module.global_variables:
            if gv.name.startswith(CELL_PREFIX) and gv.name in _cells:
                apart, argtys = _cells[gv.name][1:3]
                found.append((apart.__module__, apart.__qualname__, argtys))
    return found


def external_symbols(library, prefix) -> list:
    """The names, starting with ``prefix`` (a string or a tuple of them), of the external
    functions a finalized code library calls (declared, not defined in it): e.g. oneDNN's
    ``dnnl_sgemm``, which must be resolvable before the library's machine code is linked
    (:mod:`numbafa.compiler.jit`)."""
    module = getattr(library, "_final_module", None)
    if module is None:
        return []
    return sorted(f.name for f in module.functions if f.is_declaration and f.name.startswith(prefix))


def ensure_cells(cells) -> None:
    """Load every callee of :func:`cells_of`'s list and fill its cell (before loading the caller)."""
    for module_name, qualname, argtys in cells:
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        state = getattr(target, "apart", None)
        if not isinstance(state, Apart):
            raise TypeError(f"numbafa: {module_name}.{qualname} is not an apart function")
        state.ensure(argtys)


# -- the process-local table of compiled kernels -------------------------------------------------

def type_key(qualname: str, argtys) -> int:
    """A nonzero 63-bit key of a function compiled for Numba types ``argtys``: the same in Python
    and at njit typing time (both spell the types with ``str``)."""
    text = qualname + "(" + ", ".join(str(t) for t in argtys) + ")"
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) | 1


#: Entries of the kernel table (:data:`KERNELS`).
KERNEL_TABLE_CAPACITY = 4096


class _KernelTable:
    """Addresses of compiled work items, by :func:`type_key`, in C memory that njit code reads
    through one symbol, :data:`TABLE_SYMBOL` (:func:`kernel_address`).

    The kernels' entries look their work items up here instead of taking addresses as arguments
    or from a plan: a plan (or anything a caller passes) never holds an address, and an entry
    whose work item was not compiled or loaded in this process finds nothing and raises. Open
    addressing over a fixed capacity; an entry is written address first, key last (x86 keeps
    the order of stores), so a reader that finds a key finds its address. Never shrinks.
    """

    CAPACITY = KERNEL_TABLE_CAPACITY

    def __init__(self):
        self._words = (ctypes.c_int64 * (2 * self.CAPACITY))()
        self._cell = ctypes.c_void_p(ctypes.addressof(self._words))
        self._defined = False
        self._lock = threading.Lock()
        self._known: dict = {}

    def define(self) -> None:
        """Make :data:`TABLE_SYMBOL` resolvable (before any code that reads it is linked)."""
        if not self._defined:
            with self._lock:
                if not self._defined:
                    llvm.add_symbol(TABLE_SYMBOL, ctypes.addressof(self._cell))
                    self._defined = True

    def register(self, key: int, address: int) -> None:
        """Record ``address`` under ``key`` (idempotent)."""
        self.define()
        with self._lock:
            if self._known.get(key) == address:
                return
            i = key % self.CAPACITY
            for _ in range(self.CAPACITY):
                if self._words[2 * i] in (0, key):
                    self._words[2 * i + 1] = address
                    self._words[2 * i] = key
                    self._known[key] = address
                    return
                i = (i + 1) % self.CAPACITY
        raise RuntimeError("numbafa: the table of compiled kernels is full")

    def get(self, key: int) -> int:
        return self._known.get(key, 0)


#: The symbol of the kernel table's base pointer.
TABLE_SYMBOL = f"{PACKAGE}.kernels$table"
#: The process's table of compiled work items.
KERNELS = _KernelTable()


def _external_global(module, name: str, value_type):
    """``module``'s declaration of the global ``name`` (a ``value_type`` defined in another module,
    resolved at link time), declared on its first use in the module."""
    try:
        return module.get_global(name)
    except KeyError:
        cell = llvm_ir.GlobalVariable(module, value_type, name=name)
        cell.linkage = "external"
        return cell


@intrinsic
def _table_words(typingctx):
    """The kernel table's words (int64), read through :data:`TABLE_SYMBOL`."""
    def codegen(context, builder, sig, args):
        return builder.load(_external_global(builder.module, TABLE_SYMBOL, llvm_ir.IntType(64).as_pointer()))

    KERNELS.define()
    return types.CPointer(types.int64)(), codegen


@intrinsic
def _key_of(typingctx, qualname, args):
    if not isinstance(qualname, types.StringLiteral):
        return None
    key = type_key(qualname.literal_value, (types.CPointer(args), types.int64))

    def codegen(context, builder, sig, llargs):
        return context.get_constant(types.int64, key)

    return types.int64(qualname, args), codegen


@intrinsic
def call_key(typingctx, qualname, args):
    """``call_key("name", args)``: the kernel-table key (:func:`type_key`) of the function of that
    qualified name compiled for the types of the tuple ``args`` (:func:`register_function`), a
    constant of the calling code."""
    if not isinstance(qualname, types.StringLiteral) or not isinstance(args, types.BaseTuple):
        return None
    key = type_key(qualname.literal_value, tuple(args.types))

    def codegen(context, builder, sig, llargs):
        return context.get_constant(types.int64, key)

    return types.int64(qualname, args), codegen


@intrinsic
def _plugin_key(typingctx, function, args):
    if not isinstance(function, types.Dispatcher):
        return None
    key = type_key(function.dispatcher.py_func.__qualname__, (types.CPointer(args), types.int64))

    def codegen(context, builder, sig, llargs):
        return context.get_constant(types.int64, key)

    return types.int64(function, args), codegen


def kernel_key(dispatcher, args_type) -> int:
    """:func:`type_key` of a work item ``dispatcher`` for a pointer to ``args_type``."""
    return type_key(dispatcher.py_func.__qualname__, (types.CPointer(args_type), types.int64))


def register_function(dispatcher, argtys) -> int:
    """Compile (or load) ``dispatcher`` for the Numba types ``argtys`` and record its native
    function in :data:`KERNELS` under :func:`call_key`'s key; return the key. Code that calls it
    by that key (:func:`call_value_between`) holds none of its body."""
    argtys = tuple(argtys)
    key = type_key(dispatcher.py_func.__qualname__, argtys)
    if not KERNELS.get(key):
        KERNELS.register(key, native_address(dispatcher, argtys))
    return key


def register_kernel(dispatcher, args_type) -> int:
    """Compile (or load) the work item ``dispatcher`` for a pointer to ``args_type`` and an int64,
    record it in :data:`KERNELS`; return its key."""
    key = kernel_key(dispatcher, args_type)
    if not KERNELS.get(key):
        KERNELS.register(key, native_address(dispatcher, (types.CPointer(args_type), types.int64)))
    return key
