"""The CPU engine's compiled kernels: serial numba functions over raw host pointers.

A batch-norm pass reads the per-channel operands, walks the data once for the per-channel
sums (float64 accumulators; shifted by a per-channel value so that a constant channel sums
to exactly zero), derives and writes the per-channel results, and walks the data a second
time to write the elementwise result (one read of each operand, one write). The walks are
split into work items (a block of channels and a run of rows, or a run of rows with every
channel when channels are innermost): ``item_sums_*``, ``item_forward_*`` and
``item_backward_*`` do one item each (``_along`` or ``_across`` a layout's channels), and
release the GIL, so that the backend's own threads (``cpu_pool``) run items truly in
parallel. A small problem is one item: ``whole_pass`` does a pass in one call, calling the
same compiled steps.

No kernel uses numba's parallel layer (OpenMP, TBB or workqueue): a forked child, any
``NUMBA_THREADING_LAYER`` and many calling threads are all safe, and the first call
compiles in seconds. Flags are runtime arguments, not compile-time ones: each data dtype
compiles one version of each function, and only when a call needs it (a large call:
only its layout's walk, ``item_*_along`` or ``item_*_across``). Data tensors are
walked as ``cpu_layout.Layout`` says, by index arithmetic on flat views; the per-channel
arrays a walk reads are tiled: repeated ``tile`` times (``C * tile`` values, ``cpu_layout``).

F16 and BF16 have no numba type: the kernels see their bits (``uint16`` for F16, ``int16``
for BF16, so the dtype alone picks the conversion) and convert element by element: exact
reads, and one round-to-nearest-even write from float64 (BF16 through float32, as torch).
F16 goes through LLVM's ``half`` type, so it uses the CPU's conversion instructions. The
conversions, the views of raw pointers and the element index are intrinsics (LLVM
instructions written into the kernel that uses them), not functions: each function a
kernel calls is compiled apart on first use, which cost more than its few instructions.
The forward's elementwise pass on half data, and on F32 data walked across channels, works
in float32: one fma per element from the value where the output crosses zero
(``_crossing``), within one ulp of the float64 result (half data) or 4.8e-7 relative (F32);
else compensated (``normalize``, half data) or in float64, where a channel's scale or mean
is beyond what float32 holds well (``_needs_float64``), and for F32 channels whose outputs
may be subnormal or near float32's overflow.
Per-channel operands may have another dtype than the data (F32 for half data); they are
read and written through a runtime dtype code, since they are small.

Kernels are cached on disk (numba's ``cache=True``: in ``NUMBA_CACHE_DIR``, else in
``__pycache__`` beside this file, else the user's cache directory); where none is writable
the kernels compile in memory in every process, with one warning. References: numba's
"Notes on caching", "Releasing the GIL" and ``numba.extending.intrinsic``; NumPy's
``astype(float16)`` is what the F16 rounding is tested against.
"""

import warnings
from collections.abc import Callable

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed, impl_ret_new_ref
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from ..enums import DataType
from .gather import GATHER_DIMS  # the table format (gather.table_row)

F16, F32, F64, BF16 = (int(d) for d in (DataType.F16, DataType.F32, DataType.F64, DataType.BF16))
ROW_DIMS = 4  # cpu_layout.ROW_DIMS: geometry is (C, inner, rows, channels_inner,
TILE = 4 + ROW_DIMS  # *row_dims, tile): tile = rows of channels walked as one run
DATA_SLOTS, STRIDE_COLUMNS = 5, 2 + ROW_DIMS  # cpu_layout.SLOTS, .STRIDE_COLUMNS
SUMS = 4  # sum(x - k), sum((x - k)^2), sum(dy), sum(dy * (x - k))
DY_SUMS = 2  # the first sum a backward with given statistics uses (its shift is the mean)
PAD = 8  # zero columns past a sums table's C * tile: rows a multiple of 4 KiB apart (C = 512)
# make the CPU wait on false store-to-load dependencies (2.7x slower backward sums)
REASSOC = {"reassoc"}  # lets LLVM vectorize the float64 sums; no nnan/ninf: nan stays nan
NO_CACHE_WARNING = (
    "cudnn_bn's CPU engine found no writable cache location for its compiled kernels, so "
    "every process compiles them again on first use (seconds); set NUMBA_CACHE_DIR to a "
    "writable directory to cache them"
)
_cache = [True]  # whether numba found a cache location; one warning where it did not
_unwarned = [True]  # that warning is still to come (``warn_once``)


def jit(function=None, *, cache=True, **options):
    """``numba.njit`` with the engine's options (GIL released, NumPy's error model: 1/0 is
    inf, not an exception), cached on disk (``cache``) where numba finds a writable
    location."""

    def compile_lazily(f):
        settings = {"nogil": True, "error_model": "numpy", **options}
        if cache and _cache[0]:
            try:
                cached = numba.njit(cache=True, **settings)(f)
            except RuntimeError as error:  # numba's "cannot cache ...: no locator available"
                if "no locator" not in str(error):
                    raise
            else:
                try:  # numba's locator for a zip import takes the user's cache unchecked (its
                    # first call then failed to read its index); NUMBA_DISABLE_JIT: no cache
                    if hasattr(cached, "_cache"):
                        cached._cache._impl.locator.ensure_cache_path()
                    return cached
                except OSError:
                    pass
            _cache[0] = False  # ``warn_once`` says so
        return numba.njit(**settings)(f)

    return compile_lazily if function is None else compile_lazily(function)


def warn_once() -> None:
    """The one warning that no cache location was found, from the first kernel a call
    makes, not from this module's import: a warnings filter of "error" (``python -W error``)
    then fails that call, not every import of the engine."""
    if not _cache[0] and _unwarned[0]:
        _unwarned[0] = False
        warnings.warn(NO_CACHE_WARNING, RuntimeWarning, stacklevel=2)


def helper(function=None, **options):
    """``jit`` for a function only other kernels call: no wrappers for calls from Python or
    C, which is less to compile on first use, and no cache entry of its own (its code is
    linked into each kernel that calls it, which is cached: looking up and writing a
    helper's entry cost about 15 ms each on first use, and nothing ever read it)."""
    return jit(function, cache=False, no_cpython_wrapper=True, no_cfunc_wrapper=True, **options)


def inlined(function):
    """``helper`` for a walk that one kernel alone calls (``_sums_across``...): numba writes
    its IR into that kernel's (``inline="always"``) instead of compiling it apart, then
    linking it in, where LLVM optimized it again (the across kernels' first use: 0.2-0.5 s
    less each, per dtype)."""
    return helper(function, inline="always")


# --- memory --------------------------------------------------------------------------------


def _view(context, builder, array_type, data, dims, meminfo):
    """An array value of C-contiguous ``array_type`` over pointer ``data`` with ``dims``
    (intp values), owned by ``meminfo`` (None: no owner)."""
    view = context.make_array(array_type)(context, builder)
    itemsize = context.get_constant(types.intp, context.get_abi_sizeof(data.type.pointee))
    strides, step = [], itemsize
    for dim in reversed(dims):
        strides.insert(0, step)
        step = builder.mul(step, dim)
    populate_array(view, data, dims, strides, itemsize, meminfo)
    return view._getvalue()


def _intps(context, builder, values, value_types):
    """Integer ``values`` of numba ``value_types`` as intp values."""
    pairs = zip(values, value_types, strict=True)
    return [context.cast(builder, v, t, types.intp) for v, t in pairs]


@intrinsic
def flat(typingctx, address, span, dtype):
    """A 1-D view of ``span`` elements of ``dtype`` (an array's dtype, a NumPy scalar type,
    or an array of that dtype) at integer ``address``, no copy, no owner: an intrinsic, so
    that no function is compiled for it (numba's ``carray`` compiles one per dtype)."""
    element = dtype.instance_type if isinstance(dtype, types.NumberClass) else dtype.dtype
    array_type = types.Array(element, 1, "C")

    def codegen(context, builder, signature, args):
        data = builder.inttoptr(args[0], context.get_data_type(element).as_pointer())
        count = _intps(context, builder, args[1:2], signature.args[1:2])
        return _view(context, builder, array_type, data, count, None)

    return array_type(address, span, dtype), codegen


@intrinsic
def carve(typingctx, array, start, shape):
    """The C-contiguous view of ``shape`` (a tuple) of 1-D C ``array``'s elements from
    ``start`` on, sharing its owner: slicing and ``reshape`` instead compile numba's
    implementations (``reshape`` two functions of its own, about 0.3 s of a first call)."""
    array_type = types.Array(array.dtype, len(shape), "C")

    def codegen(context, builder, signature, args):
        source = context.make_array(signature.args[0])(context, builder, args[0])
        first = _intps(context, builder, args[1:2], signature.args[1:2])
        dims = cgutils.unpack_tuple(builder, args[2], len(shape))
        dims = _intps(context, builder, dims, signature.args[2])
        data = builder.gep(source.data, first)
        view = _view(context, builder, array_type, data, dims, source.meminfo)
        return impl_ret_borrowed(context, builder, array_type, view)

    return array_type(array, start, shape), codegen


@intrinsic
def zeros(typingctx, count, dtype):
    """``np.zeros(count, dtype)`` (1-D, ``dtype`` a NumPy scalar type, or a value of the
    type wanted) in a few instructions: ``np.zeros``, ``np.empty`` and ``np.full`` compile
    numba's implementations of them (two functions for each dtype and number of dimensions;
    0.15-0.2 s each on first use)."""
    element = dtype.instance_type if isinstance(dtype, types.NumberClass) else dtype
    array_type = types.Array(element, 1, "C")

    def codegen(context, builder, signature, args):
        (n,) = _intps(context, builder, args[:1], signature.args[:1])
        data_type = context.get_data_type(element)
        size = builder.mul(n, context.get_constant(types.intp, context.get_abi_sizeof(data_type)))
        meminfo = context.nrt.meminfo_alloc_aligned(builder, size, 32)
        data = context.nrt.meminfo_data(builder, meminfo)
        cgutils.memset(builder, data, size, 0)
        data = builder.bitcast(data, data_type.as_pointer())
        view = _view(context, builder, array_type, data, [n], meminfo)
        return impl_ret_new_ref(context, builder, array_type, view)

    return array_type(count, dtype), codegen


# --- calls by address ----------------------------------------------------------------------
# A compiled function that calls another links the callee's code into its own and compiles
# it all again. The whole-pass function (small problems) instead calls the very kernels the
# threaded path runs, through their C wrappers' addresses (``entry``): a small problem's
# first call compiles only its own few lines.


def _compiled(function, args: tuple):
    """jit ``function``'s compile result for arguments of ``args``' numba types, compiled (or
    loaded from the cache) if it is not yet."""
    signature = tuple(numba.typeof(a) for a in args)
    function.compile(signature)
    return function.overloads[signature]


def entry(function, *args) -> int:
    """The address of jit ``function``'s C wrapper for arguments of ``args``' numba types:
    what ``_call`` calls."""
    result = _compiled(function, args)
    return result.library.get_pointer_to_function(result.fndesc.llvm_cfunc_wrapper_name)


def python_entry(function, *args) -> Callable:
    """jit ``function``'s Python entry point for arguments of ``args``' numba types: called
    with arguments of those very types, it skips the dispatcher's typing of each one (0.26 us
    of a small pass's 15 arguments, most of its dispatch)."""
    return _compiled(function, args).entry_point


@intrinsic
def _call(typingctx, address, args):
    """Call the function at ``address`` (``entry``) with the values of tuple ``args``, which
    must have the machine types of the arguments it was compiled for; no result."""

    def codegen(context, builder, signature, values):
        arg_types = signature.args[1].types
        function = ir.FunctionType(
            context.get_value_type(types.none), [context.get_value_type(t) for t in arg_types]
        )
        pointer = builder.inttoptr(values[0], function.as_pointer())
        builder.call(pointer, cgutils.unpack_tuple(builder, values[1], len(arg_types)))
        return context.get_dummy_value()

    return types.none(address, args), codegen


# --- element conversions -----------------------------------------------------------------
# Intrinsics: LLVM instructions written straight into the calling kernel, so that no
# conversion is a function of its own to compile (a dozen small ones, each through numba's
# whole pipeline, were a quarter of a first call's compile time).

_I16, _I32 = ir.IntType(16), ir.IntType(32)
_F16, _F32, _F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
_WIDTHS = {_F16: 16, _F32: 32, _F64: 64}


def _resized(builder, value, target):
    """Float ``value`` as LLVM float type ``target`` (exact if wider, else rounded to
    nearest even)."""
    if value.type == target:
        return value
    if _WIDTHS[value.type] < _WIDTHS[target]:
        return builder.fpext(value, target)
    return builder.fptrunc(value, target)


def _read(builder, stored, stored_type, target):
    """The value of one stored element of numba type ``stored_type`` as float type
    ``target``, exactly: a float as it is; F16 bits (``uint16``) through LLVM's half
    (one instruction where the CPU has it, x86 F16C); BF16 bits (``int16``) as the high
    half of a float32."""
    if isinstance(stored_type, types.Float):
        return _resized(builder, stored, target)
    bits = stored if stored.type.width == 16 else builder.trunc(stored, _I16)
    if stored_type == types.uint16:
        return _resized(builder, builder.bitcast(bits, _F16), target)
    high = builder.shl(builder.zext(bits, _I32), _I32(16))
    return _resized(builder, builder.bitcast(high, _F32), target)


def _rounded_to_odd(builder, value):
    """float64 ``value`` as a float32 rounded to odd (toward zero, then the last bit set if
    anything was cut off): rounding that to half by the hardware's round to nearest even
    gives the correctly rounded half, since float32 keeps more than two bits beyond a
    half's precision (Boldo and Melquiond, "When double rounding is odd", 2005); NaN and
    inf pass through."""
    single = builder.fptrunc(value, _F32)
    bits = builder.bitcast(single, _I32)
    back = builder.fpext(single, _F64)
    inexact = builder.fcmp_ordered("!=", back, value)
    fabs = builder.module.declare_intrinsic("llvm.fabs", [_F64])
    away = builder.fcmp_ordered(">", builder.call(fabs, [back]), builder.call(fabs, [value]))
    bits = builder.select(builder.and_(inexact, away), builder.sub(bits, _I32(1)), bits)
    bits = builder.select(inexact, builder.or_(bits, _I32(1)), bits)
    return builder.bitcast(bits, _F32)


def _written(builder, value, stored_type):
    """What to store for float ``value`` in an element of numba type ``stored_type``,
    rounded once to nearest even: F16 bits through LLVM's half (from float64 by way of
    ``_rounded_to_odd``), BF16 bits from float32 (as torch; NaN stays a quiet NaN) in
    32-bit integer arithmetic, so that a loop of it vectorizes 8 wide."""
    if isinstance(stored_type, types.Float):
        return _resized(builder, value, _F32 if stored_type == types.float32 else _F64)
    if stored_type == types.uint16:
        single = _rounded_to_odd(builder, value) if value.type == _F64 else value
        return builder.bitcast(builder.fptrunc(single, _F16), _I16)
    bits = builder.bitcast(_resized(builder, value, _F32), _I32)
    high = builder.lshr(bits, _I32(16))
    rounded = builder.add(builder.add(bits, _I32(0x7FFF)), builder.and_(high, _I32(1)))
    nan = builder.fcmp_unordered("uno", value, value)
    word = builder.select(nan, builder.or_(high, _I32(0x40)), builder.lshr(rounded, _I32(16)))
    return builder.trunc(word, _I16)


@intrinsic
def decode(typingctx, stored):
    """The float64 value of one stored element (exact)."""

    def codegen(context, builder, signature, args):
        return _read(builder, args[0], signature.args[0], _F64)

    return types.float64(stored), codegen


@intrinsic
def widen(typingctx, stored):
    """The float32 value of one F16/BF16 element (exact)."""

    def codegen(context, builder, signature, args):
        return _read(builder, args[0], signature.args[0], _F32)

    return types.float32(stored), codegen


@intrinsic
def narrow(typingctx, value, like):
    """Float ``value`` in the type the forward's elementwise pass works in for data of
    ``like``'s dtype: float32 for F16/BF16 (as torch), float64 otherwise."""
    result = types.float64 if isinstance(like.dtype, types.Float) else types.float32

    def codegen(context, builder, signature, args):
        return _resized(builder, args[0], context.get_value_type(result))

    return result(value, like), codegen


@intrinsic
def encode(typingctx, value, dtype):
    """What to store for float ``value`` in an array of ``dtype`` (``array.dtype``)."""

    def codegen(context, builder, signature, args):
        return _written(builder, args[0], dtype.dtype)

    return dtype.dtype(value, dtype), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    """``a*b + c`` rounded once (LLVM's fma)."""

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


def _compensated(stored, k):
    # float32 with each coefficient as hi + lo and x - mean kept exactly as d + e
    # (Knuth's two-sum): the only sizable rounding is the last one, so the result is
    # within one F16/BF16 ulp of the float64 one even where y cancels to near zero
    # (plain float32 is not: tests/test_cpu_engine.py). The mean's low part is folded
    # into b_lo and the small terms are fused multiply-adds: this loop is bound by its
    # operation count, not by memory.
    (m, a, b), (a_lo, b_lo) = k
    xv = widen(stored)
    d = xv - m
    back = d - xv
    e = (xv - (d - back)) + (-m - back)
    hi = _fma(d, a, b)
    lo = _fma(d, a_lo, _fma(e, a, b_lo))
    return hi + lo if lo - lo == 0.0 else hi  # lo NaN (x infinite) or inf (so is hi)


@intrinsic
def normalize(typingctx, stored, k):
    """``(x - mean)*scale + shift`` for one stored element, coefficients ``k`` from
    ``_working``: one fma in float64 for F32/F64 data, ``_compensated`` float32 for
    F16/BF16."""
    result = k.types[0].dtype

    def codegen(context, builder, signature, args):
        if result != types.float64:
            return context.compile_internal(builder, _compensated, signature, args)
        m, a, b = (builder.extract_value(args[1], [0, i]) for i in range(3))
        x = _read(builder, args[0], signature.args[0], _F64)
        return builder.fma(builder.fsub(x, m), a, b)

    return result(stored, k), codegen


# --- per-channel operands ------------------------------------------------------------------
# A pass's per-channel tensors are the rows of one float64 table (``CHANNEL_SLOTS``, C):
# one function reads and writes them (``copy_channels``), one computes its results
# (``channel_results``), each compiled once for every pass and dtype (a dozen small
# functions, each compiled apart and linked again into its callers, were most of a first
# call's compile time).

# Per-channel tensors of a pass, at most: the training forward's six, then the input's first
# value of each channel (``FIRST_VALUES``: the shift that makes a constant channel sum to
# exactly zero), read like the others, with the channel stride.
CHANNEL_SLOTS = 7
FIRST_VALUES = 6


@jit
def copy_channels(at, args, bits, values, shift, shift_row, store):
    """Read the per-channel tensors at addresses ``at`` whose bit is set in ``bits`` into
    their rows of ``values``, as float64, or, where ``store``, write those rows into them,
    rounded once to their dtype (``args``: each one's element stride and dtype code, F16,
    BF16, F32 or F64, a runtime choice: one compiled version serves every pass and dtype).
    Row ``shift_row`` (when not negative) also into ``shift``, tiled: x's first values
    (``FIRST_VALUES``) as 0 where not finite, since an infinite shift makes each ``x - k``
    NaN (inf - inf) and the mean NaN where torch's is inf; a statistic as it is (it is the
    backward's mean)."""
    count = values.shape[1]
    for t in range(at.size):
        if not bits >> t & 1:
            continue
        stride, code, row = args[t, 0], args[t, 1], values[t]
        a, span = at[t], (count - 1) * stride + 1  # a view of each dtype; only one not empty
        f64 = flat(a, span * (code == F64), np.float64)
        f32 = flat(a, span * (code == F32), np.float32)
        f16 = flat(a, span * (code == F16), np.uint16)
        bf16 = flat(a, span * (code == BF16), np.int16)
        for c in range(count):
            i = c * stride
            if store:
                if code == F64:
                    f64[i] = row[c]
                elif code == F32:
                    f32[i] = row[c]
                elif code == F16:
                    f16[i] = encode(row[c], f16.dtype)
                else:
                    bf16[i] = encode(row[c], bf16.dtype)
            elif code == F64:
                row[c] = f64[i]
            elif code == F32:
                row[c] = f32[i]
            elif code == F16:
                row[c] = decode(f16[i])
            else:
                row[c] = decode(bf16[i])
    if shift_row >= 0:
        tile = shift.size // count  # no division per value (2048: 15.7 us, now 10.3)
        for c in range(count):
            k = values[shift_row, c]
            k = k if k - k == 0.0 or shift_row != FIRST_VALUES else 0.0
            for t in range(tile):
                shift[c + t * count] = k


# --- walking the data ----------------------------------------------------------------------


@helper
def row_offset(row, geometry, strides):
    """Element offset of row ``row`` in the tensor with ``strides`` (its row of
    ``Layout.strides``): row dimensions decomposed; the outermost needs no division, and
    most layouts have just that one."""
    offset = 0
    for k in range(ROW_DIMS - 1, 0, -1):
        size = geometry[4 + k]
        if row < size:
            return offset + row * strides[2 + k]
        offset += (row % size) * strides[2 + k]
        row //= size
    return offset + row * strides[2]


# Columns of ``Layout.strides``: each slot's channel stride, its stride along a run, and its
# stride between rows of the innermost row dimension. Like every constant argument of a
# helper, int64 values, not literals: numba would compile the helper once more for each
# literal argument (``_next_item``'s ``NO_ITEM`` too).
CHANNEL, RUN, ROW = np.int64(0), np.int64(1), np.int64(STRIDE_COLUMNS - 1)
# Where every row lies in the innermost row dimension (``geometry[INNER_ROWS]``, the row
# count: most layouts, every dense one), the across loops take a row's offsets as ``row *
# _column(strides, ROW)``: calling ``row_offset`` there, every few hundred values, cost
# those steps 5-20 % (a call spills the loop's values), and writing it into them (LLVM's
# alwaysinline) made their first use compile 20 % longer.
INNER_ROWS = 4 + ROW_DIMS - 1


def _loads(context, builder, array_type, array, indices):
    """The elements of ``array`` (a numba array value of ``array_type``) at each tuple of
    intp ``indices``."""
    view = context.make_array(array_type)(context, builder, array)
    return [
        builder.load(cgutils.get_item_pointer(context, builder, array_type, view, list(index)))
        for index in indices
    ]


@intrinsic
def _walk(typingctx, bounds, geometry, strides):
    """What an item's loops need: its ``bounds`` (a row of the items table: first channel,
    end channel, first row, end row; ``Layout.items``), whether a run crosses channels
    (channels innermost) or stays in one, the run length, and each slot's element stride in
    a run (``_column``). An intrinsic, as ``_column``: a helper is compiled apart on first
    use (0.06 s each)."""
    columns = types.UniTuple(types.int64, DATA_SLOTS)
    result = types.Tuple((*(types.int64,) * 4, types.boolean, types.int64, columns))

    def codegen(context, builder, signature, args):
        b, g, _ = signature.args
        index = [(context.get_constant(types.intp, i),) for i in range(4)]
        c0, c1, r0, r1 = _loads(context, builder, b, args[0], index)
        inner, innermost = _loads(context, builder, g, args[1], index[1::2])
        across = builder.icmp_signed("!=", innermost, innermost.type(0))
        n = builder.select(across, builder.sub(c1, c0), inner)
        channel, run = (context.get_constant(types.intp, int(c)) for c in (CHANNEL, RUN))
        column = builder.select(across, channel, run)
        s = _column_values(context, builder, signature.args[2], args[2], column)
        return context.make_tuple(builder, result, [c0, c1, r0, r1, across, n, s])

    return result(bounds, geometry, strides), codegen


def _column_values(context, builder, array_type, strides, column):
    """``_column``'s tuple from intp ``column``."""
    slots = [(context.get_constant(types.intp, t), column) for t in range(DATA_SLOTS)]
    values = _loads(context, builder, array_type, strides, slots)
    return context.make_tuple(builder, types.UniTuple(types.int64, DATA_SLOTS), values)


@intrinsic
def _column(typingctx, strides, column):
    """A column of ``Layout.strides`` as values: loops that write memory would otherwise
    reload them from the array (it might alias their output) and not vectorize."""

    def codegen(context, builder, signature, args):
        (column,) = _intps(context, builder, args[1:], signature.args[1:])
        return _column_values(context, builder, signature.args[0], args[0], column)

    return types.UniTuple(types.int64, DATA_SLOTS)(strides, column), codegen


@intrinsic
def _at(typingctx, offset, i, stride):
    """Index of element ``i`` of a run, ``offset + i*stride``: unsigned, so that numba adds
    no negative-index wraparound, which would keep LLVM from vectorizing the loop (60x
    slower); an intrinsic, as it is in every loop (a function's call costs compile time
    at each of them)."""

    def codegen(context, builder, signature, args):
        pairs = zip(args, signature.args, strict=True)
        o, n, s = (context.cast(builder, v, t, types.int64) for v, t in pairs)
        return builder.add(o, builder.mul(n, s))

    return types.uint64(offset, i, stride), codegen


# The channel-outer walks' main loops are written twice: with each operand's stride along a
# run, and with the stride ``PACKED`` as a constant, taken where every operand the loop reads
# or writes is packed along its runs (every dense layout). LLVM does not version a loop on
# its strides itself, and the constant stride lets it vectorize short runs better: F32
# (8, 2048, 49) backward sums 1.1x and its elementwise pass 1.2x faster (session 13).
PACKED = 1


# --- work items shared by threads ------------------------------------------------------------
# Every thread of a threaded step runs the same item kernel over one table of work items
# (``Layout.items``) and one ``state`` (int64: items handed out, items done): it claims
# items one at a time and, when none is left, waits a little until all are done, so that
# the caller's call mostly returns with the step complete, without taking the GIL per item
# or waiting on a helper thread (``cpu_pool.team``). Alone, a kernel does every item.


def _slot(context, builder, signature, args):
    """Pointer to ``array[index]`` of an intrinsic's first two arguments."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    return builder.gep(array.data, [index])


@intrinsic
def _atomic_add(typingctx, array, index, value):
    """Add ``value`` to ``array[index]`` (int64) atomically; the value before."""

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", _slot(context, builder, signature, args), value, "seq_cst")

    return types.int64(array, index, value), codegen


@intrinsic
def _atomic_read(typingctx, array, index):
    """``array[index]`` (int64), read anew each time (a loop waiting on it is not hoisted)."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot(context, builder, signature, args), "acquire", 8)

    return types.int64(array, index), codegen


SPIN = 1 << 16  # reads of the done count, at most, before a kernel returns with items in progress
NO_ITEM = np.int64(-1)  # ``_next_item``'s "none done yet" (an int64: see ``CHANNEL``)


@helper
def _next_item(state, previous, items):
    """The next work item to do (``previous`` done, -1 for none yet), or -1 when none is left:
    then returns once every item is done, or after ``SPIN`` reads of the count (tens of
    microseconds: a thread may hold an item while it waits for a CPU, and ``cpu_pool.team``
    then waits for it, blocked). Compiled once and called, not inlined into the twelve
    places that claim items: 0.1-0.15 s less to compile on first use."""
    if previous >= 0:
        _atomic_add(state, 1, 1)
    i = _atomic_add(state, 0, 1)
    if i < items.shape[0]:
        return i
    for _ in range(SPIN):
        if _atomic_read(state, 1) >= items.shape[0]:
            break
    return -1


# --- pass 1: per-channel sums --------------------------------------------------------------
# A run is what the innermost loop visits: one channel's ``inner`` elements ("along"), or
# every channel of one row when channels are innermost ("across": ``tile`` rows at once
# where rows are dense, see ``cpu_layout``). Along a channel the sums are scalars (kept in
# registers); across channels they are the item's (SUMS, C * tile) table, and the across
# loops walk all the item's rows themselves (rows of few channels are short). Each case a
# pass asks for (x alone; x and dy; x and masked dy) is its own loop, with no test inside,
# so that it vectorizes.


@inlined
def _sums_across(x, dy, y, geometry, strides, r0, r1, n, shift, out, base, first):
    # The item's sums go to rows ``base`` to ``base + SUMS`` of ``out``. Two rows at a time,
    # added in registers before the table is updated: one read and write of the table per
    # two values, not per value (its traffic bounded the loop).
    # The rows are one from each half of the item, so that memory is read in sequential
    # streams, which the hardware prefetches (adjacent rows are not: 2x slower out of
    # cache; at C = 512 four rows from four quarters measured no faster, and software
    # prefetches or blocks of 64-256 channels walked apart 1.2-2.2x slower). The masked
    # sums (ReLU's backward) and the last row go one row at a time.
    # From ``DY_SUMS`` on, the pairs update dy's two sums alone: half the table traffic
    # (backward sums 1.3-1.5x faster at C = 64 and 512). That is a loop of its own: one loop
    # with a loop-invariant flag measured 15-20 % slower there (LLVM did not unswitch it).
    has_dy, masked = dy.size > 0, y.size > 0
    sx, sd, sy = strides[0, 0], strides[1, 0], strides[2, 0]
    h = 0 if masked else (r1 - r0) // 2
    flat, rs = geometry[INNER_ROWS] == geometry[2], _column(strides, ROW)  # see INNER_ROWS
    for r in range(r0, r0 + h):
        if flat:
            ox, ox2, od, od2 = r * rs[0], (r + h) * rs[0], r * rs[1], (r + h) * rs[1]
        else:
            ox, ox2 = row_offset(r, geometry, strides[0]), row_offset(r + h, geometry, strides[0])
            od, od2 = row_offset(r, geometry, strides[1]), row_offset(r + h, geometry, strides[1])
        if not has_dy:
            for i in range(n):
                k = shift[i]
                a, b = decode(x[_at(ox, i, sx)]) - k, decode(x[_at(ox2, i, sx)]) - k
                out[base, i] += a + b
                out[base + 1, i] += a * a + b * b
            continue
        if first == DY_SUMS:
            for i in range(n):
                k = shift[i]
                a, b = decode(x[_at(ox, i, sx)]) - k, decode(x[_at(ox2, i, sx)]) - k
                da, db = decode(dy[_at(od, i, sd)]), decode(dy[_at(od2, i, sd)])
                out[base + 2, i] += da + db
                out[base + 3, i] += da * a + db * b
            continue
        for i in range(n):
            k = shift[i]
            a, b = decode(x[_at(ox, i, sx)]) - k, decode(x[_at(ox2, i, sx)]) - k
            da, db = decode(dy[_at(od, i, sd)]), decode(dy[_at(od2, i, sd)])
            out[base, i] += a + b
            out[base + 1, i] += a * a + b * b
            out[base + 2, i] += da + db
            out[base + 3, i] += da * a + db * b
    for r in range(r0 + 2 * h, r1):
        ox, od = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
        oy = row_offset(r, geometry, strides[2])
        if not has_dy:
            for i in range(n):
                xv = decode(x[_at(ox, i, sx)]) - shift[i]
                out[base, i] += xv
                out[base + 1, i] += xv * xv
        elif not masked:
            for i in range(n):
                xv, dv = decode(x[_at(ox, i, sx)]) - shift[i], decode(dy[_at(od, i, sd)])
                out[base, i] += xv
                out[base + 1, i] += xv * xv
                out[base + 2, i] += dv
                out[base + 3, i] += dv * xv
        else:
            for i in range(n):
                xv, dv = decode(x[_at(ox, i, sx)]) - shift[i], decode(dy[_at(od, i, sd)])
                dv = dv if decode(y[_at(oy, i, sy)]) > 0 else 0.0
                out[base, i] += xv
                out[base + 1, i] += xv * xv
                out[base + 2, i] += dv
                out[base + 3, i] += dv * xv


@jit(fastmath=REASSOC)
def item_sums_along(x, dy, y, geometry, strides, shift, out, first, items, state):
    """Add the sums of each work item of ``items`` (``_next_item``) to its rows of ``out``
    (``(SUMS * items, C * tile + PAD)``, item ``i``'s from row ``SUMS * i``; ``shift`` tiled
    the same) where runs stay in one channel: ``x - k``, ``(x - k)^2``, ``dy``,
    ``dy * (x - k)`` with ``k = shift[c]``; ``dy`` zero where ``y <= 0`` if ``y`` is not
    empty; with ``dy`` empty its sums stay zero. Sums before row ``first`` (0 or
    ``DY_SUMS``) are not wanted: they may be left partial."""
    # A channel's runs in two rows at once (``ox``, ``px``): a loop over two runs pays its
    # fixed costs (entry checks, scalar tail, the vectors' final adds) once per 2n values,
    # which matters for short runs (49 values: sums 1.9x faster). A lone row is a pair with
    # itself, its sums halved (exact: every rounding of the doubled sums is the same,
    # doubled), so that each case is one loop to compile, not two. The masked sums (ReLU's
    # backward) go one row at a time. The loops are written here, not in a helper: a
    # compiled call passes each array with an atomic reference count increment and
    # decrement, which cost more than the arithmetic of a 49-value run, and numba's own
    # inlining copies the callee's IR at each call (0.1-0.2 s of a first call).
    has_dy, masked, x_sums = dy.size > 0, y.size > 0, first < DY_SUMS
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        c0, c1, r0, r1, _, n, s = _walk(items[i], geometry, strides)
        sx, sd, sy = s[0], s[1], s[2]
        unit = sx == 1 and sd == 1  # see PACKED
        h = 0 if masked else (r1 - r0) // 2
        for j in range(r0, r1 - h):
            pair = j < r0 + h  # rows r and r + h together; the last of an odd count alone
            r = j if pair else j + h
            ox, od = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
            oy = row_offset(r, geometry, strides[2])
            px = row_offset(r + h, geometry, strides[0]) if pair else ox
            pd = row_offset(r + h, geometry, strides[1]) if pair else od
            w = 1.0 if pair or masked else 0.5
            for c in range(c0, c1):
                a0, b0 = ox + c * strides[0, 0], px + c * strides[0, 0]
                a1, b1 = od + c * strides[1, 0], pd + c * strides[1, 0]
                y0, k = oy + c * strides[2, 0], shift[c]
                s0 = s1 = s2 = s3 = 0.0
                if masked:
                    for e in range(n):
                        xv, dv = decode(x[_at(a0, e, sx)]) - k, decode(dy[_at(a1, e, sd)])
                        dv = dv if decode(y[_at(y0, e, sy)]) > 0 else 0.0
                        s0 += xv
                        s1 += xv * xv
                        s2 += dv
                        s3 += dv * xv
                elif not has_dy:
                    for e in range(n):
                        a, b = decode(x[_at(a0, e, sx)]) - k, decode(x[_at(b0, e, sx)]) - k
                        s0 += a + b
                        s1 += a * a + b * b
                elif not x_sums and unit:  # given statistics: dy's two sums alone
                    for e in range(n):
                        a, b = decode(x[_at(a0, e, PACKED)]) - k, decode(x[_at(b0, e, PACKED)]) - k
                        da, db = decode(dy[_at(a1, e, PACKED)]), decode(dy[_at(b1, e, PACKED)])
                        s2 += da + db
                        s3 += da * a + db * b
                elif not x_sums:
                    for e in range(n):
                        a, da = decode(x[_at(a0, e, sx)]) - k, decode(dy[_at(a1, e, sd)])
                        b, db = decode(x[_at(b0, e, sx)]) - k, decode(dy[_at(b1, e, sd)])
                        s2 += da + db
                        s3 += da * a + db * b
                elif unit:
                    for e in range(n):
                        a, b = decode(x[_at(a0, e, PACKED)]) - k, decode(x[_at(b0, e, PACKED)]) - k
                        da, db = decode(dy[_at(a1, e, PACKED)]), decode(dy[_at(b1, e, PACKED)])
                        s0 += a + b
                        s1 += a * a + b * b
                        s2 += da + db
                        s3 += da * a + db * b
                else:
                    for e in range(n):
                        a, da = decode(x[_at(a0, e, sx)]) - k, decode(dy[_at(a1, e, sd)])
                        b, db = decode(x[_at(b0, e, sx)]) - k, decode(dy[_at(b1, e, sd)])
                        s0 += a + b
                        s1 += a * a + b * b
                        s2 += da + db
                        s3 += da * a + db * b
                sums = (s0, s1, s2, s3)
                for q in range(first, SUMS):
                    out[SUMS * i + q, c] += sums[q] * w
        i = _next_item(state, i, items)


@jit
def item_sums_across(x, dy, y, geometry, strides, shift, out, first, items, state):
    """``item_sums_along`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        _, _, r0, r1, _, n, _ = _walk(items[i], geometry, strides)
        _sums_across(x, dy, y, geometry, strides, r0, r1, n, shift, out, SUMS * i, first)
        i = _next_item(state, i, items)


# --- pass 2: the elementwise results -------------------------------------------------------
# The plain cases (no fusion) have loops of their own, with no test inside, so that they
# vectorize; along a channel the coefficients are scalars, across channels arrays (tiled).


@helper
def _forward_element(x, z, y, ox, oz, oy, mean, scale, shift, add_z, relu):
    v = (decode(x[ox]) - mean) * scale + shift
    if add_z:
        v += decode(z[oz])
    if relu and v < 0:
        v = 0.0
    y[oy] = encode(v, y.dtype)


@helper
def _working(mean, scale, shift, like):
    """A channel's float64 coefficients for ``normalize``: ``(mean, scale, shift)`` in the
    elementwise pass's type (``narrow``), and the low parts of scale and of ``shift -
    (mean - mean_hi) * scale`` (zero for F32/F64 data)."""
    m_hi, a_hi, b_hi = narrow(mean, like), narrow(scale, like), narrow(shift, like)
    b_low = shift - (mean - np.float64(m_hi)) * scale
    return (m_hi, a_hi, b_hi), (_low(scale, a_hi, like), _low(b_low, b_hi, like))


@helper
def _low(value, hi, like):
    """``value - hi`` in ``narrow``'s type; zero where that is not finite (an infinite or
    NaN value is all in ``hi``)."""
    lo = value - hi
    return narrow(lo if lo - lo == 0.0 else 0.0, like)


def _narrow_only(function, singles=False):
    """An intrinsic ``run(like, args)``: ``function(like, args)`` (a boolean) written into
    the calling kernel for F16/BF16 data (array ``like``), and F32 where ``singles``, the
    constant False for other data, whose kernels then compile none of it (no first-use
    cost)."""

    @intrinsic
    def run(typingctx, like, args):
        def codegen(context, builder, signature, values):
            if like.dtype == types.float64 or (like.dtype == types.float32 and not singles):
                return context.get_constant(types.boolean, False)
            return context.compile_internal(builder, function, signature, values)

        return types.boolean(like, args), codegen

    return run


@intrinsic
def _single(typingctx, like):
    """Whether array ``like`` holds F32 data (a constant)."""

    def codegen(context, builder, signature, args):
        return context.get_constant(types.boolean, like.dtype == types.float32)

    return types.boolean(like), codegen


@intrinsic
def _beyond(typingctx, value, bound):
    """1 where float32 ``value``'s magnitude exceeds float32 ``bound`` (NaN does), else 0,
    as an int32: compared as the magnitudes' bits, so that a loop OR-ing it vectorizes (a
    float or boolean one did not)."""

    def codegen(context, builder, signature, args):
        bits = [builder.and_(builder.bitcast(a, _I32), _I32(0x7FFFFFFF)) for a in args]
        return builder.zext(builder.icmp_unsigned(">", *bits), _I32)

    return types.int32(value, bound), codegen


@helper
def _crossing(mean, scale, shift, like):
    """A channel's float32 ``(t, a, c)`` for ``y = (x - t)*a + c``, with ``t`` the float32
    nearest the value where ``y`` crosses zero, whether the pass may use them, and the
    largest ``|x|`` for which ``|y|`` stays below 2**127. One float32 fma per element where
    ``normalize`` costs three and a two-sum (half data; BF16 inference 1.75x faster) or two
    conversions and float64 arithmetic (F32). Every other float32 ``x`` lies at least half
    as far from the crossing as from ``t``, so ``|x - t| <= 2|y/scale|``: the roundings of
    ``x - t`` and ``a`` cost at most 2 float32 ulps of ``y`` each and that of ``c`` (at
    most ``|y|``) one, cancellation or not (8 with the last rounding and the references',
    4.8e-7 relative; an F16/BF16 ulp is 5e-4 and 4e-3); at ``x = t`` the result is ``c``,
    the float64 pass's own ``y`` rounded once. F32 results must be normal floats for that
    (a subnormal's rounding is coarser), so an F32 channel needs ``|t*scale| >= 2**-96``
    (then ``|y| >= 2**-122`` wherever ``x != t``), and its outputs must not come near
    float32's overflow (``_by_crossing_rows``' guard). Not used (``normalize`` is) where
    the scale is not within 2**-64 to 2**64 or ``t`` beyond 2**64. A scale of 0 (a
    constant channel's, training: ``channel_results``) makes ``y`` the shift exactly for
    every finite ``x``: ``(0, 0, shift)``, where the mean is finite (else NaN)."""
    if scale == 0.0:
        return (np.float32(0.0), np.float32(0.0), np.float32(shift)), mean - mean == 0.0, np.inf
    t = mean - shift / scale
    t32 = np.float32(t) if abs(t) < 2.0**64 else np.float32(0.0)
    c = _fma(np.float64(t32) - mean, scale, shift)  # as ``normalize`` makes y at x = t
    usable = (
        2.0**-64 <= abs(scale) <= 2.0**64
        and abs(t) < 2.0**64
        and c - c == 0.0
        and (abs(t * scale) >= 2.0**-96 or not _single(like))
    )
    limit = (2.0**127 - abs(c)) / abs(scale) - abs(t)
    return (t32, np.float32(scale), np.float32(c)), usable, limit


def _by_crossing_runs(y, args):
    # ``_runs_by_crossing``: channels ``c0`` to ``c1`` of rows ``r0`` to ``r1``, runs of
    # ``n`` values along a channel (strides ``s``), if every channel may.
    x, geometry, strides, c0, c1, r0, r1, n, s, mean, scale, shift = args
    table = carve(zeros(3 * (c1 - c0), np.float32), 0, (3, c1 - c0))
    for c in range(c0, c1):
        (table[0, c - c0], table[1, c - c0], table[2, c - c0]), usable, _ = _crossing(
            mean[c], scale[c], shift[c], y
        )
        if not usable:
            return False
    for r in range(r0, r1):
        ox, oy = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[2])
        for c in range(c0, c1):
            bx, by = ox + c * strides[0, 0], oy + c * strides[2, 0]
            t, a, b = table[0, c - c0], table[1, c - c0], table[2, c - c0]
            for e in range(n):
                y[_at(by, e, s[2])] = encode(_fma(widen(x[_at(bx, e, s[0])]) - t, a, b), y.dtype)
    return True


def _by_crossing_rows(y, args):
    # ``_rows_by_crossing``: rows ``r0`` to ``r1`` of ``n`` values across channels, the
    # coefficients tiled, if every channel may; two rows per loop, as ``_forward_across``
    # (F32 out of cache 1.2-1.3x faster than one, F16/BF16 in cache 1.2-1.4x). Where an F32
    # ``|x|`` is beyond the item's ``limit`` (``_crossing``: its ``y`` may come within the
    # float32 pass's few ulps of float32's overflow, where it could round to inf as the
    # float64 result does not, or the other way), the item is done again in float64 (False;
    # an item in place is not begun); half data never comes near float32's range.
    x, geometry, strides, r0, r1, n, mean, scale, shift = args
    channels, sx, sy = geometry[0], strides[0, 0], strides[2, 0]
    table = carve(zeros(3 * n, np.float32), 0, (3, n))
    limit = np.inf
    for c in range(channels):
        (t, a, b), usable, most = _crossing(mean[c], scale[c], shift[c], y)
        if not usable:
            return False
        limit = most if most < limit else limit  # ``min``, which compiles a function
        for i in range(c, n, channels):
            table[0, i], table[1, i], table[2, i] = t, a, b
    guard = _single(y) and limit < 2.0**128
    if guard and (limit < 0.0 or x.ctypes.data == y.ctypes.data):
        return False  # no |x| keeps y below 2**127 (``_beyond`` compares magnitudes, so a
        # negative bound let |x| up to -limit through); in place, x would not be there to do
        # it again from
    bound = np.float32(limit if guard else 0.0)
    h = (r1 - r0) // 2
    flat, rs = geometry[INNER_ROWS] == geometry[2], _column(strides, ROW)  # see INNER_ROWS
    for j in range(r0, r1 - h):
        r = j if j < r0 + h else j + h
        p = r + h if j < r0 + h else r
        if flat:
            ox, oy, px, py = r * rs[0], r * rs[2], p * rs[0], p * rs[2]
        else:
            ox, oy = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[2])
            px, py = row_offset(p, geometry, strides[0]), row_offset(p, geometry, strides[2])
        beyond = np.int32(0)
        for i in range(n):
            t, a, b = table[0, i], table[1, i], table[2, i]
            xu, xv = widen(x[_at(ox, i, sx)]), widen(x[_at(px, i, sx)])
            u, v = encode(_fma(xu - t, a, b), y.dtype), encode(_fma(xv - t, a, b), y.dtype)
            y[_at(oy, i, sy)] = u
            y[_at(py, i, sy)] = v
            beyond |= _beyond(xu, bound) | _beyond(xv, bound)
        if guard and beyond:
            return False
    return True


def _beyond_float32(y, args):
    # ``_needs_float64``: whether a channel from ``c0`` to ``c1`` has a scale that is not 0
    # or from 2**-64 to 2**64, or a mean beyond 2**64 (NaN included): there a float32
    # coefficient, low part, ``x - mean`` (BF16 data) or ``c`` of ``_crossing`` may
    # overflow or keep fewer bits than a normal float32 (NaN, infinities and 1% errors).
    # Within those bounds each is a normal float32 or exact.
    mean, scale, c0, c1 = args
    for c in range(c0, c1):
        a = abs(scale[c])
        if not ((a == 0.0 or 2.0**-64 <= a <= 2.0**64) and abs(mean[c]) <= 2.0**64):
            return True
    return False


_runs_by_crossing = _narrow_only(_by_crossing_runs)
_rows_by_crossing = _narrow_only(_by_crossing_rows, singles=True)
# Whether an item of F16/BF16 data takes the float64 elementwise pass (``_forward_element``),
# as fused passes do: the float32 ones are within one ulp only inside float32's range.
_needs_float64 = _narrow_only(_beyond_float32)


@inlined
def _forward_across(x, z, y, geometry, strides, r0, r1, n, mean, scale, shift, flags):
    add_z, relu = flags
    sx, sz, sy = strides[0, 0], strides[1, 0], strides[2, 0]
    if add_z or relu or _needs_float64(y, (mean, scale, 0, geometry[0])):
        for r in range(r0, r1):
            ox, oz = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
            oy = row_offset(r, geometry, strides[2])
            for i in range(n):
                at = (_at(ox, i, sx), _at(oz, i, sz), _at(oy, i, sy))
                _forward_element(x, z, y, *at, mean[i], scale[i], shift[i], add_z, relu)
        return
    # Each channel's coefficients once per item (then repeated ``tile`` times), not once per
    # element: the half types' splitting costs more than the compensated pass itself (4x
    # on F16 NHWC).
    if _rows_by_crossing(y, (x, geometry, strides, r0, r1, n, mean, scale, shift)):
        return
    channels = geometry[0]
    table = carve(zeros(5 * n, narrow(0.0, y)), 0, (5, n))
    for c in range(channels):
        k = _working(mean[c], scale[c], shift[c], y)
        for i in range(c, n, channels):
            (table[0, i], table[1, i], table[2, i]), (table[3, i], table[4, i]) = k
    # Two rows per loop, one from each half of the item (as ``_sums_across``): each
    # coefficient is loaded once per two values, which keeps more of the data's cache
    # misses in flight (1.5-1.8x faster out of cache, C = 64 and 512). A lone last row is
    # its own pair: both values are read before either is written, so that is right in
    # place too. (The pairing is written out, not a helper: each helper is one more
    # function to compile on first use.)
    h = (r1 - r0) // 2
    flat, rs = geometry[INNER_ROWS] == geometry[2], _column(strides, ROW)  # see INNER_ROWS
    for j in range(r0, r1 - h):
        r = j if j < r0 + h else j + h
        p = r + h if j < r0 + h else r
        if flat:
            ox, oy, px, py = r * rs[0], r * rs[2], p * rs[0], p * rs[2]
        else:
            ox, oy = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[2])
            px, py = row_offset(p, geometry, strides[0]), row_offset(p, geometry, strides[2])
        for i in range(n):
            k = (table[0, i], table[1, i], table[2, i]), (table[3, i], table[4, i])
            u = encode(normalize(x[_at(ox, i, sx)], k), y.dtype)
            v = encode(normalize(x[_at(px, i, sx)], k), y.dtype)
            y[_at(oy, i, sy)] = u
            y[_at(py, i, sy)] = v


@jit
def item_forward_along(x, z, y, geometry, strides, mean, scale, shift, flags, items, state):
    """``y = relu?((x - mean)*scale + shift [+ z])`` over each work item of ``items``
    (``_next_item``; the per-channel arrays tiled) where runs stay in one channel.
    ``flags``: add z, ReLU. Data slots: x, z, y. (A run's loops are written here, as
    ``item_sums_along``'s.)"""
    add_z, relu = flags
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        c0, c1, r0, r1, _, n, s = _walk(items[i], geometry, strides)
        sx, sz, sy = s[0], s[1], s[2]
        unit = sx == 1 and sy == 1  # see PACKED
        plain = not (add_z or relu or _needs_float64(y, (mean, scale, c0, c1)))
        if plain and _runs_by_crossing(
            y, (x, geometry, strides, c0, c1, r0, r1, n, s, mean, scale, shift)
        ):
            i = _next_item(state, i, items)
            continue
        for r in range(r0, r1):
            ox, oz = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
            oy = row_offset(r, geometry, strides[2])
            for c in range(c0, c1):
                bx, bz, by = ox + c * strides[0, 0], oz + c * strides[1, 0], oy + c * strides[2, 0]
                if plain:
                    k = _working(mean[c], scale[c], shift[c], y)
                    if unit:
                        for e in range(n):
                            v = normalize(x[_at(bx, e, PACKED)], k)
                            y[_at(by, e, PACKED)] = encode(v, y.dtype)
                        continue
                    for e in range(n):
                        y[_at(by, e, sy)] = encode(normalize(x[_at(bx, e, sx)], k), y.dtype)
                    continue
                for e in range(n):
                    at = (_at(bx, e, sx), _at(bz, e, sz), _at(by, e, sy))
                    _forward_element(x, z, y, *at, mean[c], scale[c], shift[c], add_z, relu)
        i = _next_item(state, i, items)


@jit
def item_forward_across(x, z, y, geometry, strides, mean, scale, shift, flags, items, state):
    """``item_forward_along`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        _, _, r0, r1, _, n, _ = _walk(items[i], geometry, strides)
        _forward_across(x, z, y, geometry, strides, r0, r1, n, mean, scale, shift, flags)
        i = _next_item(state, i, items)


@helper
def _backward_element(x, dy, y, gi, gz, o, s, i, k_dy, k_x, k_c, flags):
    """Element ``i`` of a run (offsets ``o``, strides ``s``): ``gi = k_dy*dv + k_x*x + k_c``
    and ``gz = dv``, with ``dv`` the dy, zero where ``y <= 0`` if masked."""
    use_x, masked, write_gi, write_gz = flags
    dv = decode(dy[_at(o[1], i, s[1])])
    if masked and not decode(y[_at(o[2], i, s[2])]) > 0:
        dv = 0.0
    v = k_dy * dv + k_c
    if use_x:
        v += k_x * decode(x[_at(o[0], i, s[0])])
    if write_gi:
        gi[_at(o[3], i, s[3])] = encode(v, gi.dtype)
    if write_gz:
        gz[_at(o[4], i, s[4])] = encode(dv, gz.dtype)


@helper
def _row_offsets(r, geometry, strides):
    """Offsets of row ``r`` in the five data slots."""
    return (
        row_offset(r, geometry, strides[0]),
        row_offset(r, geometry, strides[1]),
        row_offset(r, geometry, strides[2]),
        row_offset(r, geometry, strides[3]),
        row_offset(r, geometry, strides[4]),
    )


@intrinsic
def _channel_offsets(typingctx, o, c, s):
    """Offsets ``o`` of a row's five data slots moved to channel ``c`` (``s``: the slots'
    channel strides, ``_column``): values only, no array, so that it takes and drops no
    reference; an intrinsic, as ``_column``."""
    result = types.UniTuple(types.int64, DATA_SLOTS)

    def codegen(context, builder, signature, args):
        offsets, strides = (
            _intps(context, builder, cgutils.unpack_tuple(builder, v, DATA_SLOTS), t)
            for v, t in ((args[0], signature.args[0]), (args[2], signature.args[2]))
        )
        (channel,) = _intps(context, builder, args[1:2], signature.args[1:2])
        moved = [
            builder.add(o, builder.mul(channel, t)) for o, t in zip(offsets, strides, strict=True)
        ]
        return context.make_tuple(builder, result, moved)

    return result(o, c, s), codegen


@inlined
def _backward_across(x, dy, y, gi, gz, geometry, strides, r0, r1, n, k_dy, k_x, k_c, flags):
    use_x, masked, write_gi, write_gz = flags
    s = _column(strides, CHANNEL)
    if masked or write_gz or not write_gi:
        for r in range(r0, r1):
            o = _row_offsets(r, geometry, strides)
            for i in range(n):
                _backward_element(x, dy, y, gi, gz, o, s, i, k_dy[i], k_x[i], k_c[i], flags)
        return
    # The plain grad_input two rows per loop, as ``_forward_across``, in the sums' order:
    # walked backward, from the rows the sums read last (still in cache), it measured 1.2-1.3x
    # slower after the machine idled (the hardware prefetches ascending streams better).
    h = (r1 - r0) // 2
    flat, rs = geometry[INNER_ROWS] == geometry[2], _column(strides, ROW)  # see INNER_ROWS
    for j in range(r0, r1 - h):
        r = j if j < r0 + h else j + h
        q = r + h if j < r0 + h else r
        if flat:
            o = (r * rs[0], r * rs[1], 0, r * rs[3], 0)  # the slots this loop reads and writes
            p = (q * rs[0], q * rs[1], 0, q * rs[3], 0)
        else:
            o, p = _row_offsets(r, geometry, strides), _row_offsets(q, geometry, strides)
        if use_x:
            for i in range(n):
                u = _fma(k_x[i], decode(x[_at(o[0], i, s[0])]), k_c[i])
                v = _fma(k_x[i], decode(x[_at(p[0], i, s[0])]), k_c[i])
                u = _fma(k_dy[i], decode(dy[_at(o[1], i, s[1])]), u)
                v = _fma(k_dy[i], decode(dy[_at(p[1], i, s[1])]), v)
                gi[_at(o[3], i, s[3])] = encode(u, gi.dtype)
                gi[_at(p[3], i, s[3])] = encode(v, gi.dtype)
        else:
            for i in range(n):
                u = _fma(k_dy[i], decode(dy[_at(o[1], i, s[1])]), k_c[i])
                v = _fma(k_dy[i], decode(dy[_at(p[1], i, s[1])]), k_c[i])
                gi[_at(o[3], i, s[3])] = encode(u, gi.dtype)
                gi[_at(p[3], i, s[3])] = encode(v, gi.dtype)


@jit
def item_backward_along(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, items, state):
    """``gi = k_dy*dv + k_x*x + k_c`` and ``gz = dv`` (``dv``: dy, zero where ``y <= 0`` if
    masked) over each work item of ``items`` (``_next_item``; the coefficients tiled) where
    runs stay in one channel. ``flags``: use x (all but eval), mask, write gi, write gz.
    Data slots: x, dy, y, gi, gz."""
    # One run per loop, in row order. A loop over two rows' runs at once (as
    # ``item_sums_along``'s, for the fixed costs of short runs) had six streams for LLVM's
    # vectorizer to check for overlap at run time, past its limit, and ran scalar: 4-5x
    # slower at 4096-value runs, 1.3x at 49 (F32, saved statistics, session 12).
    use_x, masked, write_gi, write_gz = flags
    plain = write_gi and not (masked or write_gz)
    cs = _column(strides, CHANNEL)
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        c0, c1, r0, r1, _, n, s = _walk(items[i], geometry, strides)
        unit = s[0] == 1 and s[1] == 1 and s[3] == 1  # see PACKED
        for r in range(r0, r1):
            o = _row_offsets(r, geometry, strides)
            for c in range(c0, c1):
                oc = _channel_offsets(o, c, cs)
                a, b, k = k_dy[c], k_x[c], k_c[c]
                if plain and unit:
                    for e in range(n):
                        u = _fma(b, decode(x[_at(oc[0], e, PACKED)]), k) if use_x else k
                        u = _fma(a, decode(dy[_at(oc[1], e, PACKED)]), u)
                        gi[_at(oc[3], e, PACKED)] = encode(u, gi.dtype)
                    continue
                if plain:
                    for e in range(n):
                        u = _fma(b, decode(x[_at(oc[0], e, s[0])]), k) if use_x else k
                        u = _fma(a, decode(dy[_at(oc[1], e, s[1])]), u)
                        gi[_at(oc[3], e, s[3])] = encode(u, gi.dtype)
                    continue
                for e in range(n):
                    _backward_element(x, dy, y, gi, gz, oc, s, e, a, b, k, flags)
        i = _next_item(state, i, items)


@jit
def item_backward_across(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, items, state):
    """``item_backward_along`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        _, _, r0, r1, _, n, _ = _walk(items[i], geometry, strides)
        _backward_across(x, dy, y, gi, gz, geometry, strides, r0, r1, n, k_dy, k_x, k_c, flags)
        i = _next_item(state, i, items)


# --- the passes ----------------------------------------------------------------------------
# Each pass reads its per-channel inputs, adds up its sums over every item, computes its
# per-channel results and writes them, then its elementwise results over every item. The
# whole-pass function below runs these as one item in one call (small problems), calling
# the steps by address (``entries``); the backend runs the same steps with items on threads.

TRAIN, SAVED, EVAL, SAVED_INVSTD = 0, 1, 2, 3  # problems.Mode
TRAINING, BACKWARD, INFERENCE = 0, 1, 2  # channel_results' kinds of pass
# Slots of ``entries``: the steps ``whole_pass`` and ``blocks_pass`` call.
COPY, ITEM_SUMS, RESULTS, ITEM_FORWARD, ITEM_BACKWARD, BLOCKS = range(6)
STEPS = 6
BLOCK_BYTES = 1 << 19  # a pass's blocks of channels (``blocks``): about this many bytes of data
# ``whole_pass``'s plan: a pass's fixed arguments in one int64 array, at these offsets (the
# dispatcher's time grows with each argument a call from Python passes: about 2.3 us for
# the 22 this took apart, 1.2 us for the 16 it takes), then its table of blocks of channels
# (``PLAN_BLOCKS`` rows of an items table). ``PLAN_SCRATCH``: its ``scratch_size``.
PLAN_KIND, PLAN_READS, PLAN_WRITES, PLAN_SHIFT_ROW, PLAN_MODE, PLAN_FIRST = range(6)
PLAN_BLOCKS, PLAN_SCRATCH, PLAN_FLAGS = range(6, 9)
PLAN_GEOMETRY = PLAN_FLAGS + 4
PLAN_SPANS = PLAN_GEOMETRY + TILE + 1
PLAN_CHANNEL_ARGS = PLAN_SPANS + DATA_SLOTS
PLAN_STRIDES = PLAN_CHANNEL_ARGS + 2 * CHANNEL_SLOTS
PLAN_STEPS = PLAN_STRIDES + DATA_SLOTS * STRIDE_COLUMNS
PLAN_SIZE = PLAN_STEPS + STEPS


def entries(like, geometry, strides, steps) -> np.ndarray:
    """The addresses (``entry``) of the steps ``whole_pass`` calls on data of
    ``like``'s dtype walked as ``geometry`` says (``COPY``...; 0 for a slot not in
    ``steps``), compiled for the very argument types the threaded path gives them."""
    walk = "across" if geometry[3] else "along"
    one, two = np.zeros(1), np.zeros((1, 1))
    items = (np.zeros((1, 4), np.int64), np.zeros(2, np.int64))  # the items table, its state
    at, args = np.zeros(CHANNEL_SLOTS, np.int64), np.zeros((CHANNEL_SLOTS, 2), np.int64)
    data = (like, like, like, geometry, strides)
    calls = {
        COPY: (copy_channels, at, args, 0, two, one, 0, False),
        ITEM_SUMS: (globals()[f"item_sums_{walk}"], *data, one, two, 0, *items),
        RESULTS: (channel_results, 0, two, one, two, 0, 0.0, 0.0, 0, False, two, 0, 0),
        ITEM_FORWARD: (globals()[f"item_forward_{walk}"], *data, one, one, one, (False,) * 2,
                       *items),
        ITEM_BACKWARD: (globals()[f"item_backward_{walk}"], like, like, *data, one, one, one,
                        (False,) * 4, *items),
        BLOCKS: (blocks_pass, items[1], 0.0, 0.0, like, *(like,) * DATA_SLOTS, one, *items),
    }  # fmt: skip
    found = np.zeros(len(calls), np.int64)
    for slot in steps:
        found[slot] = entry(*calls[slot])
    return found


def scratch_size(channels: int, tile: int, kind: int) -> int:
    """The float64 scratch a pass (``kind``) of ``channels`` (``tile``: ``geometry[TILE]``)
    takes, in this order: rows of per-channel values (``copy_channels``), the tiled shift,
    the sums table (none for inference), the elementwise pass's tiled coefficients."""
    n = channels * tile
    return CHANNEL_SLOTS * channels + n + (0 if kind == INFERENCE else SUMS * (n + PAD)) + 3 * n


@jit
def channel_results(kind, sums, shift, values, count, eps, momentum, mode, narrow, coefficients,
                    c0, c1):  # fmt: skip
    """Channels ``c0`` to ``c1`` of a pass's per-channel results, from its inputs (rows of
    ``values``, ``copy_channels``) and its data's ``sums`` (``(SUMS, C * tile + PAD)``, the
    padding zero, shifted by the tiled ``shift``; no columns for inference), written into
    ``values``' output rows, and the elementwise pass's ``coefficients`` (3, C * tile),
    tiled. ``kind``: ``TRAINING`` (rows weight, bias, saved mean, saved invstd, running
    mean, running var; ``y = (x - mean)*scale + bias``), ``BACKWARD`` (rows weight,
    statistic 0, statistic 1, grad_weight, grad_bias; ``grad_input = k_dy*dy + k_x*x +
    k_c``, ``mode`` the backward's) or ``INFERENCE`` (rows weight, bias, running mean,
    running var). ``narrow``: the data is F32/F16/BF16, whose nonzero deviations square to
    2**-298 at least, so that a zero sum of squares is a constant channel's (an F64 one's
    may underflow). No arrays are made here: each costs compile time."""
    channels = values.shape[1]
    # A channel's columns as ``c + t * channels``: a loop ``range(c, end, channels)`` divides
    # for its trip count at each channel (2048 channels of a backward: 41 us, now 34).
    tile = coefficients.shape[1] // channels
    summed = tile if sums.shape[1] else 0  # inference has no sums
    w = values[0]
    for c in range(c0, c1):
        s0 = s1 = s2 = s3 = 0.0  # the sums of the channel's ``tile`` columns
        for t in range(summed):
            i = c + t * channels
            s0, s1, s2, s3 = s0 + sums[0, i], s1 + sums[1, i], s2 + sums[2, i], s3 + sums[3, i]
        d = s0 / count
        mean = shift[c] + d
        var = s1 / count - d * d
        if var < 0.0:  # rounding; a NaN stays NaN
            var = 0.0
        # torch's ``InvStd`` (Normalization.cpp, its CUDA kernels): a batch variance of 0
        # with eps 0 has invstd 0, so that the output is the bias and the gradients 0
        invstd = 1.0 / np.sqrt(var + eps) if var != 0.0 or eps != 0.0 else 0.0
        if kind == INFERENCE:
            scale = w[c] / np.sqrt(values[3, c] + eps)
            k = (values[2, c], scale, values[1, c])
            if scale - scale != 0.0:  # var + eps = 0 (or not finite): torch CPU's
                # ``x*scale + (bias - mean*scale)``, whose NaNs (x beside the mean, or on
                # its side of 0) ``(x - mean)*scale`` would give as infinities
                k = (0.0, scale, values[1, c] - values[2, c] * scale)
        elif kind == TRAINING:  # a constant channel (every x - k is 0) has (x - mean)*0:
            # ``_crossing`` then gives the bias exactly; times 0, an infinite scale is NaN.
            # (F64 data takes no ``_crossing``: its float64 pass gives the bias as it is.)
            k = (mean, w[c] * invstd * (0.0 if narrow and s1 == 0.0 else 1.0), values[1, c])
            values[2, c], values[3, c] = mean, invstd
            values[4, c] = (1.0 - momentum) * values[4, c] + momentum * (mean * 1.0)
            unbiased = var * (count / (count - 1))
            values[5, c] = (1.0 - momentum) * values[5, c] + momentum * unbiased
        else:
            if mode == TRAIN:
                s3 -= d * s2  # sum(dy * (x - mean))
            else:
                mean = shift[c]
                stat = values[2, c]
                invstd = stat if mode == SAVED_INVSTD else 1.0 / np.sqrt(stat + eps)
            values[3, c], values[4, c] = s3 * invstd, s2  # grad_weight, grad_bias
            k_dy = w[c] * invstd
            k_x = 0.0 if mode == EVAL else -k_dy * invstd * values[3, c] / count
            k_c = 0.0 if mode == EVAL else -k_dy * s2 / count - k_x * mean
            k = (k_dy, k_x, k_c)
        for t in range(tile):
            i = c + t * channels
            coefficients[0, i], coefficients[1, i], coefficients[2, i] = k


@helper
def _fixed(plan):
    """A pass's fixed arguments from its ``plan`` (``whole_pass``): kind, mode, first sum,
    flags, geometry, strides, and the values a channel sums."""
    f = PLAN_FLAGS
    flags = (plan[f] != 0, plan[f + 1] != 0, plan[f + 2] != 0, plan[f + 3] != 0)
    geometry = carve(plan, PLAN_GEOMETRY, (TILE + 1,))
    strides = carve(plan, PLAN_STRIDES, (DATA_SLOTS, STRIDE_COLUMNS))
    count = geometry[1] * geometry[2] * geometry[TILE]
    return plan[PLAN_KIND], plan[PLAN_MODE], plan[PLAN_FIRST], flags, geometry, strides, count


@helper
def _scratch(plan, floats):
    """The views of a pass's scratch ``floats`` (``scratch_size``): per-channel values, the
    tiled shift, the sums table, the coefficients and each of their three rows."""
    channels, tile = plan[PLAN_GEOMETRY], plan[PLAN_GEOMETRY + TILE]
    n = channels * tile
    width = 0 if plan[PLAN_KIND] == INFERENCE else n + PAD
    o = CHANNEL_SLOTS * channels
    values = carve(floats, 0, (CHANNEL_SLOTS, channels))
    shift, sums = carve(floats, o, (n,)), carve(floats, o + n, (SUMS, width))
    o += n + SUMS * width
    k_0, k_1, k_2 = (
        carve(floats, o, (n,)),
        carve(floats, o + n, (n,)),
        carve(floats, o + 2 * n, (n,)),
    )
    return values, shift, sums, carve(floats, o, (3, n)), k_0, k_1, k_2


@helper
def _sums_step(plan, kind, first, x, a, y, geometry, strides, shift, out, items, state):
    """A pass's sums step over ``items`` (``item_sums_*``, by address) into ``out``: x and
    dy's (and ``y``'s mask) for a backward, x's alone for a training forward (its ``a`` is
    z), none for inference. One copy for ``blocks_pass`` and ``rows_pass``."""
    if kind == BACKWARD:
        _call(plan[PLAN_STEPS + ITEM_SUMS], (x, a, y, geometry, strides, shift, out, first,
                                             items, state))  # fmt: skip
    elif kind == TRAINING:
        empty = carve(x, 0, (0,))
        _call(plan[PLAN_STEPS + ITEM_SUMS], (x, empty, empty, geometry, strides, shift, out,
                                             first, items, state))  # fmt: skip


@helper
def _elementwise_step(plan, kind, flags, x, a, y, gi, gz, geometry, strides, k_0, k_1, k_2,
                      items, state):  # fmt: skip
    """A pass's elementwise step over ``items`` (``item_forward_*`` or ``item_backward_*``,
    by address) with coefficients ``k_0``, ``k_1``, ``k_2``; none for a backward that
    writes neither gi nor gz (``flags``, as ``blocks_pass`` takes them)."""
    if kind != BACKWARD:
        _call(plan[PLAN_STEPS + ITEM_FORWARD], (x, a, y, geometry, strides, k_0, k_1, k_2,
                                                (flags[0], flags[1]), items, state))  # fmt: skip
    elif flags[2] or flags[3]:
        _call(plan[PLAN_STEPS + ITEM_BACKWARD], (x, a, y, gi, gz, geometry, strides, k_0, k_1,
                                                 k_2, flags, items, state))  # fmt: skip


@jit
def blocks_pass(plan, eps, momentum, like, x, a, y, gi, gz, floats, blocks, state):
    """A pass (``kind``, as ``channel_results``) over ``blocks`` of channels of every row
    (an items table; one item, the whole tensor, for channels innermost), each block its
    sums, its channels' results, then its elementwise pass, so that the second walk finds
    the block in cache: 1.15-1.25x faster where the tensors outgrow it (F32 (8, 2048, 49)
    backward, session 14). Every thread that runs it claims blocks (``_next_item``) until
    none is left: a channel's sums are added in the same order whatever the blocks and
    threads, so the results are the same. ``floats``: the pass's ``scratch``, its values
    and shift made (``copy_channels``); its steps called by address, its fixed arguments
    read from ``plan`` (``whole_pass``). ``flags``: the forward's add z and ReLU, or the
    backward's use x (all modes but eval), mask dy by ``y > 0``, write gi, write gz."""
    kind, mode, first, flags, geometry, strides, count = _fixed(plan)
    values, shift, sums, k, k_0, k_1, k_2 = _scratch(plan, floats)
    narrow = like.itemsize < 8  # F32/F16/BF16 data (``channel_results``)
    ints = zeros(2 + 4, np.int64)  # this thread's: one step's item state, its item
    own, item = carve(ints, 0, (2,)), carve(ints, 2, (1, 4))
    b = _next_item(state, NO_ITEM, blocks)
    while b >= 0:
        for q in range(4):
            item[0, q] = blocks[b, q]
        own[0] = own[1] = 0
        _sums_step(plan, kind, first, x, a, y, geometry, strides, shift, sums, item, own)
        _call(plan[PLAN_STEPS + RESULTS], (kind, sums, shift, values, count, eps, momentum,
                                           mode, narrow, k, item[0, 0] // geometry[TILE],
                                           item[0, 1] // geometry[TILE]))  # fmt: skip
        own[0] = own[1] = 0
        _elementwise_step(plan, kind, flags, x, a, y, gi, gz, geometry, strides, k_0, k_1, k_2,
                          item, own)  # fmt: skip
        b = _next_item(state, b, blocks)


@jit
def rows_pass(plan, eps, momentum, like, x, a, y, gi, gz, floats, partial, items, state):
    """``blocks_pass`` where a block of channels would not do (channels innermost, or too
    few channels for the threads): work ``items`` of rows too, run by every thread that runs
    it in three steps, each waiting for the one before (``state``: each step's claim and
    done counts, ``_next_item``'s): the items' sums into their rows of ``partial``
    (``(SUMS * items, C * tile + PAD)``), then one thread adds them up in item order (the
    same sums for the same items) and makes the channels' results, then the items'
    elementwise pass. One hand-off to the helpers, no Python between steps."""
    kind, mode, first, flags, geometry, strides, count = _fixed(plan)
    values, shift, sums, k, k_0, k_1, k_2 = _scratch(plan, floats)
    total = items.shape[0]
    sums_state, elementwise_state = carve(state, 0, (2,)), carve(state, 4, (2,))
    _sums_step(plan, kind, first, x, a, y, geometry, strides, shift, partial, items, sums_state)
    if kind != INFERENCE:
        while _atomic_read(state, 1) < total:  # every item's sums
            pass
    if _atomic_add(state, 2, 1) == 0:  # the first thread here makes the results
        for i in range(total):
            for q in range(first, SUMS):
                for c in range(sums.shape[1]):
                    sums[q, c] += partial[SUMS * i + q, c]
        _call(plan[PLAN_STEPS + RESULTS], (kind, sums, shift, values, count, eps, momentum,
                                           mode, like.itemsize < 8, k, 0,
                                           geometry[0]))  # fmt: skip
        if kind == BACKWARD and not (flags[2] or flags[3]):
            _atomic_add(state, 5, total)  # no elementwise pass: its items are done
        _atomic_add(state, 3, 1)
    while _atomic_read(state, 3) < 1:
        pass
    _elementwise_step(plan, kind, flags, x, a, y, gi, gz, geometry, strides, k_0, k_1, k_2,
                      items, elementwise_state)  # fmt: skip


@jit
def whole_pass(plan, eps, momentum, like, x_at, a_at, y_at, gi_at, gz_at, c0, c1, c2, c3,
               c4, c5):  # fmt: skip
    """A pass on this thread (``blocks_pass`` over the plan's blocks), its fixed arguments
    read from ``plan`` (the ``PLAN_*`` offsets), its steps called by address (``steps``,
    ``entries``). Data tensors, walked with ``strides``' rows 0..4: x, then dy (backward)
    or z (training forward), the fused forward's y (backward) or y, then gi and gz
    (backward); an absent one's span is 0 (its address is not read). ``c0``...``c5``: the
    per-channel tensors' addresses (``channel_args``, ``reads``, ``writes`` and
    ``shift_row`` as ``copy_channels`` takes them)."""
    # Views of the plan and of the scratch by ``carve``, scratch by ``zeros``: numba's
    # slicing, ``reshape`` and ``np.empty`` compiled functions of their own (0.4-0.5 s of a
    # first small call).
    reads, writes = plan[PLAN_READS], plan[PLAN_WRITES]
    channel_args = carve(plan, PLAN_CHANNEL_ARGS, (CHANNEL_SLOTS, 2))
    spans = carve(plan, PLAN_SPANS, (DATA_SLOTS,))
    blocks = carve(plan, PLAN_SIZE, (plan[PLAN_BLOCKS], 4))
    x, a, y = flat(x_at, spans[0], like), flat(a_at, spans[1], like), flat(y_at, spans[2], like)
    gi, gz = flat(gi_at, spans[3], like), flat(gz_at, spans[4], like)
    ints = zeros(CHANNEL_SLOTS + 2, np.int64)
    at, state = carve(ints, 0, (CHANNEL_SLOTS,)), carve(ints, CHANNEL_SLOTS, (2,))
    at[0], at[1], at[2], at[3], at[4], at[5] = c0, c1, c2, c3, c4, c5
    at[FIRST_VALUES] = x_at
    floats = zeros(plan[PLAN_SCRATCH], np.float64)
    values, shift, _, _, _, _, _ = _scratch(plan, floats)
    _call(plan[PLAN_STEPS + COPY], (at, channel_args, reads, values, shift,
                                    plan[PLAN_SHIFT_ROW], False))  # fmt: skip
    _call(plan[PLAN_STEPS + BLOCKS], (plan, eps, momentum, like, x, a, y, gi, gz, floats, blocks,
                                      state))  # fmt: skip
    if writes:
        _call(plan[PLAN_STEPS + COPY], (at, channel_args, writes, values, shift, -1, True))


@jit
def batch_pass(whole, plan, eps, momentum, like, steps, items, state, x_at, a_at, y_at, gi_at,
               gz_at, c0, c1, c2, c3, c4, c5):  # fmt: skip
    """The problems of a batch of one layout, each a ``whole_pass`` (called by address,
    ``whole``: ``entry``) on the given pointers plus its index times ``steps`` (bytes, one
    per pointer): a batch's problems walked where they lie, with no copies and one call from
    Python. Work items (``_next_item``) are blocks of problems, ``items[i]`` their
    ``(first, end)``."""
    s = steps
    i = _next_item(state, NO_ITEM, items)
    while i >= 0:
        for b in range(items[i, 0], items[i, 1]):
            _call(whole, (plan, eps, momentum, like, x_at + b * s[0], a_at + b * s[1],
                          y_at + b * s[2], gi_at + b * s[3], gz_at + b * s[4], c0 + b * s[5],
                          c1 + b * s[6], c2 + b * s[7], c3 + b * s[8], c4 + b * s[9],
                          c5 + b * s[10]))  # fmt: skip
        i = _next_item(state, i, items)


# --- gathering operands --------------------------------------------------------------------


@jit
def gather(table):
    """Copy strided tensors into packed buffers, one per row of ``table``: the source's
    address, the destination's, then ``GATHER_DIMS`` sizes and as many strides of the
    source, in the order the destination is packed in (padded in front with size 1), all in
    2-byte units (an element's units its innermost axis), so that one compiled version
    serves every dtype. A stride may be 0 (a row repeated) or negative. A run of the
    innermost axis at a time: unsigned indices, and a loop of its own for unit stride, so
    that LLVM vectorizes the copy; the outer axes counted as an odometer (no division)."""
    dims = GATHER_DIMS
    for row in range(table.shape[0]):
        src_at, dst_at = table[row, 0], table[row, 1]
        shape, strides = table[row, 2 : 2 + dims], table[row, 2 + dims : 2 + 2 * dims]
        low, high, total = 0, 0, 1
        for k in range(dims):
            total *= shape[k]
            reach = (shape[k] - 1) * strides[k]
            if reach < 0:
                low += reach
            else:
                high += reach
        if total == 0:
            continue
        src = flat(src_at + 2 * low, high - low + 1, np.uint16)
        dst = flat(dst_at, total, np.uint16)
        n, step = shape[dims - 1], strides[dims - 1]
        index, o = np.zeros(dims, np.int64), -low  # the run's outer indices, source offset
        for run in range(total // n):
            i = run * n
            if step == 1:
                for f in range(n):
                    dst[_at(i, f, 1)] = src[_at(o, f, 1)]
            else:
                for f in range(n):
                    dst[_at(i, f, 1)] = src[_at(o, f, step)]
            k = dims - 2  # the next run: outer indices counted up as an odometer
            while k >= 0:
                index[k] += 1
                o += strides[k]
                if index[k] < shape[k]:
                    break
                o -= strides[k] * shape[k]
                index[k] = 0
                k -= 1
