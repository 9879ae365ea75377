"""Array intrinsics for the package's njit code: compiled into their callers, no compile unit of
their own.

Numba compiles ``np.empty``, ``np.zeros``, ``np.ones``, ``np.empty_like`` and an array's or a
scalar's ``.view(dtype)`` as overloads: each shape type, dtype and set of flags is a function of
its own, with Numba's fixed cost per compiled function (~40 ms on Zen 4; the float32 forward and
backward met 28 of them). These intrinsics emit the same code in the caller:

``bitcast(x, to)``
    the bits of ``x`` read as ``to``, a NumPy scalar type of the same width (``np.int32``,
    ``np.float32``, ...): a scalar reinterpreted, or a 1-D C-contiguous array viewed as an
    array of ``to`` (no copy), as ``x.view(to)``;
``empty(shape, dtype)``, ``zeros(shape, dtype)``, ``ones(shape, dtype)``
    a new C-contiguous array, as NumPy's (``shape`` an int or a tuple of ints; ``dtype`` a
    NumPy scalar type or an array's ``.dtype``, never omitted); Numba's allocator, so the
    arrays are reference-counted like ``np.empty``'s;
``empty_like(x)``
    ``empty(x.shape, x.dtype)``;
``fetch_add(counter, value)``
    ``counter[0] += value`` as one atomic operation (``counter`` a 1-D int64 array), returning
    the value before: a counter the threads of a parallel region share.

They use Numba's array construction (``numba.np.arrayobj``: ``_empty_nd_impl``, the one
function every Numba array constructor lowers to), so an allocation raises what ``np.empty``
raises in njit code (a too large array: ``ValueError``).
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import (_empty_nd_impl, _parse_shape, make_array, populate_array, ty_parse_dtype,
                               ty_parse_shape)

__all__ = ["bitcast", "empty", "zeros", "ones", "empty_like", "fetch_add", "vector_view"]


@intrinsic
def bitcast(typingctx, x, to):
    """``bitcast(x, to)``: the bits of ``x`` read as ``to`` (module docstring)."""
    if not isinstance(to, types.NumberClass):
        return None
    target = to.instance_type
    if isinstance(x, (types.Integer, types.Float)) and x.bitwidth == target.bitwidth:
        def scalar(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(target))
        return target(x, to), scalar
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C"
            and isinstance(x.dtype, (types.Integer, types.Float)) and x.dtype.bitwidth == target.bitwidth):
        return None
    retty = x.copy(dtype=target)

    def view(context, builder, sig, args):
        src = make_array(sig.args[0])(context, builder, value=args[0])
        data = builder.bitcast(src.data, context.get_data_type(target).as_pointer())
        return vector_view(context, builder, src, retty, data, src.nitems)

    return retty(x, to), view


def vector_view(context, builder, src, retty, data, n):
    """Codegen: the contiguous 1-D array ``retty`` of ``n`` elements from ``data``, a view of the
    array ``src`` (its memory, counted where reference counting is on; elements of ``src``'s
    size). For intrinsics that return views (``bitcast`` here, ``numbafa.kernels.matmul``'s)."""
    dst = make_array(retty)(context, builder)
    populate_array(dst, data=data, shape=cgutils.pack_array(builder, [n]),
                   strides=cgutils.pack_array(builder, [src.itemsize]), itemsize=src.itemsize,
                   meminfo=src.meminfo, parent=src.parent)
    value = dst._getvalue()
    if context.enable_nrt:
        context.nrt.incref(builder, retty, value)
    return value


def _allocation(shape, dtype, fill):
    """The signature and codegen of a new C array of ``shape`` and ``dtype`` (Numba types), its
    elements left as they are (``fill`` None) or set to ``fill`` (0: one ``memset``)."""
    ndim = ty_parse_shape(shape)
    nb_dtype = ty_parse_dtype(dtype)
    if ndim is None or nb_dtype is None:
        return None
    retty = types.Array(nb_dtype, ndim, "C")

    def codegen(context, builder, sig, args):
        ary = _empty_nd_impl(context, builder, retty, _parse_shape(context, builder, sig.args[0], args[0]))
        if fill == 0:
            cgutils.memset(builder, ary.data, builder.mul(ary.itemsize, ary.nitems), 0)
        elif fill is not None:
            value = context.get_constant(nb_dtype, fill)
            with cgutils.for_range(builder, ary.nitems) as loop:
                builder.store(value, builder.gep(ary.data, [loop.index]))
        return ary._getvalue()

    return retty(shape, dtype), codegen


@intrinsic
def empty(typingctx, shape, dtype):
    """``empty(shape, dtype)``: ``np.empty`` (module docstring)."""
    return _allocation(shape, dtype, None)


@intrinsic
def zeros(typingctx, shape, dtype):
    """``zeros(shape, dtype)``: ``np.zeros`` (module docstring)."""
    return _allocation(shape, dtype, 0)


@intrinsic
def ones(typingctx, shape, dtype):
    """``ones(shape, dtype)``: ``np.ones`` (module docstring)."""
    return _allocation(shape, dtype, 1)


@intrinsic
def empty_like(typingctx, x):
    """``empty_like(x)``: a new C array of ``x``'s shape and dtype, as ``np.empty_like`` (module
    docstring)."""
    if not isinstance(x, types.Array):
        return None
    retty = types.Array(x.dtype, x.ndim, "C")

    def codegen(context, builder, sig, args):
        src = make_array(sig.args[0])(context, builder, value=args[0])
        shapes = cgutils.unpack_tuple(builder, src.shape, count=x.ndim)
        return _empty_nd_impl(context, builder, retty, shapes)._getvalue()

    return retty(x), codegen


@intrinsic
def fetch_add(typingctx, counter, value):
    """``fetch_add(counter, value)``: ``counter[0] += value`` atomically (sequentially consistent),
    the value before returned (module docstring)."""
    if not (isinstance(counter, types.Array) and counter.ndim == 1 and counter.dtype == types.int64
            and isinstance(value, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        array = make_array(sig.args[0])(context, builder, value=args[0])
        add = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.atomic_rmw("add", array.data, add, "seq_cst")

    return types.int64(counter, value), codegen
