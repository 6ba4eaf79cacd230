"""The CPU engine's compiled kernels: serial numba functions over raw host pointers.

A batch-norm pass reads the per-channel operands, walks the data once for the per-channel
sums (float64 accumulators; shifted by a per-channel value so that a constant channel sums
to exactly zero), derives per-channel coefficients, walks the data a second time to write
the result (one read of each operand, one write), and writes the per-channel results last.
The walks are split into work items (a block of channels and a run of rows, or a run of
rows with every channel when channels are innermost): ``item_sums``, ``item_forward`` and
``item_backward`` do one item each, and release the GIL, so that the backend's own threads
(``cpu_pool``) run items truly in parallel. A small problem is one item: ``backward``,
``forward_training`` and ``forward_inference`` do a whole pass in one call.

No kernel uses numba's parallel layer (OpenMP, TBB or workqueue): a forked child, any
``NUMBA_THREADING_LAYER`` and many calling threads are all safe, and the first call
compiles in seconds. Flags are runtime arguments, not compile-time ones: each data dtype
compiles one version of each function, and only when a call needs it (a large call:
only its layout's walk, ``item_*_along`` or ``item_*_across``). Data tensors are
walked as ``cpu_layout.Layout`` says, by index arithmetic on flat views.

F16 and BF16 have no numba type: the kernels see their bits (``uint16`` for F16, ``int16``
for BF16, so the dtype alone picks the conversion) and convert element by element: exact
reads, and one round-to-nearest-even write from float64 (BF16 through float32, as torch).
F16 goes through LLVM's ``half`` type, so it uses the CPU's conversion instructions. The
forward's elementwise pass on half data works in float32, compensated (``normalize``):
twice as fast, and within one ulp of the float64 result.
Per-channel operands may have another dtype than the data (F32 for half data); they are
read and written through a runtime dtype code, since they are small.

Compiled code is cached on disk (numba's ``cache=True``: in ``NUMBA_CACHE_DIR``, else in
``__pycache__`` beside this file, else the user's cache directory); where none is writable
the kernels compile in memory in every process, with one warning. References: numba's
"Notes on caching", "Releasing the GIL" and ``numba.extending.intrinsic``; NumPy's
``astype(float16)`` is what the F16 rounding is tested against.
"""

import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..enums import DataType

F16, F32, F64, BF16 = (int(d) for d in (DataType.F16, DataType.F32, DataType.F64, DataType.BF16))
ROW_DIMS = 4  # cpu_layout.ROW_DIMS: geometry is (C, inner, rows, channels_inner,
TILE = 4 + ROW_DIMS  # *row_dims, tile): tile = rows of channels walked as one run
SUMS = 4  # sum(x - k), sum((x - k)^2), sum(dy), sum(dy * (x - k))
PAD = 8  # zero columns past a sums table's C * tile: rows a multiple of 4 KiB apart (C = 512)
# make the CPU wait on false store-to-load dependencies (2.7x slower backward sums)
REASSOC = {"reassoc"}  # lets LLVM vectorize the float64 sums; no nnan/ninf: nan stays nan
NO_CACHE_WARNING = (
    "cudnn_bn's CPU engine found no writable cache location for its compiled kernels, so "
    "every process compiles them again on first use (seconds); set NUMBA_CACHE_DIR to a "
    "writable directory to cache them"
)
_cache = [True]  # whether numba found a cache location; one warning where it did not


def jit(function=None, **options):
    """``numba.njit`` with the engine's options (GIL released, NumPy's error model: 1/0 is
    inf, not an exception), cached on disk where numba finds a writable location."""

    def compile_lazily(f):
        settings = {"nogil": True, "error_model": "numpy", **options}
        if _cache[0]:
            try:
                return numba.njit(cache=True, **settings)(f)
            except RuntimeError as error:  # numba's "cannot cache ...: no locator available"
                if "no locator" not in str(error):
                    raise
                _cache[0] = False
                warnings.warn(NO_CACHE_WARNING, RuntimeWarning, stacklevel=3)
        return numba.njit(**settings)(f)

    return compile_lazily if function is None else compile_lazily(function)


def helper(function=None, **options):
    """``jit`` for a function only other kernels call: no wrappers for calls from Python or
    C, which is less to compile on first use."""
    return jit(function, no_cpython_wrapper=True, no_cfunc_wrapper=True, **options)


# --- memory --------------------------------------------------------------------------------


@intrinsic
def _pointer(typingctx, address):
    """The void pointer at integer ``address``."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@jit
def flat(address, span, like):
    """A 1-D view of ``span`` elements of ``like``'s dtype at ``address`` (no copy)."""
    return numba.carray(_pointer(address), (span,), like.dtype)


# --- element conversions -----------------------------------------------------------------


@intrinsic
def _f16_to_f64(typingctx, stored):
    """The float64 value of F16 bits (exact): LLVM's half extension, which is one
    instruction where the CPU has it (x86 F16C) and a compiler-rt call elsewhere."""

    def codegen(context, builder, signature, args):
        bits = args[0]
        if bits.type.width != 16:
            bits = builder.trunc(bits, ir.IntType(16))
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.DoubleType())

    return types.float64(stored), codegen


@intrinsic
def _f16_to_f32(typingctx, stored):
    """The float32 value of F16 bits (exact), as ``_f16_to_f64``."""

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16(typingctx, value):
    """F16 bits of a float32, rounded to nearest even (LLVM's half truncation)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@helper
def _f64_to_f16(value):
    # One rounding from float64: first to float32 rounding to odd (toward zero, then the
    # last bit set if anything was cut off), then to half by the hardware's round to
    # nearest even. float32 keeps more than two bits beyond a half's precision, so the
    # result is the correctly rounded half (Boldo and Melquiond, "When double rounding is
    # odd", 2005); NaN and inf pass through.
    single = np.float32(value)
    bits = np.int64(single.view(np.int32))
    back = np.float64(single)
    inexact = back != value and value == value
    bits = bits - 1 if inexact and abs(back) > abs(value) else bits  # one step toward zero
    bits = bits | 1 if inexact else bits
    return _f32_to_f16(np.int32(bits).view(np.float32))


@helper
def _bf16_to_f64(stored):
    return np.float64(np.uint32((np.int64(stored) & 0xFFFF) << 16).view(np.float32))


@helper
def _bf16_to_f32(stored):
    return np.uint32((np.uint32(stored) & np.uint32(0xFFFF)) << 16).view(np.float32)


@helper
def _f32_to_bf16(value):
    # 32-bit integer arithmetic throughout, so that a loop of it vectorizes 8 wide.
    bits = np.float32(value).view(np.uint32)
    half = np.uint32(bits >> 16)
    if value != value:
        return np.uint32(half | np.uint32(0x40))  # keep NaN a (quiet) NaN
    return np.uint32(np.uint32(bits + np.uint32(0x7FFF) + (half & np.uint32(1))) >> 16)


@helper
def _f64_to_bf16(value):
    return _f32_to_bf16(np.float32(value))


def decode(stored):
    """float64 value of one stored element (compiled through the overload below)."""
    raise NotImplementedError


def encode(value, dtype):
    """What to store for float64 ``value`` in an array of ``dtype`` (compiled only)."""
    raise NotImplementedError


def widen(stored):
    """The float32 value of one F16/BF16 element (exact; compiled only)."""
    raise NotImplementedError


def narrow(value, like):
    """float64 ``value`` in the type the forward's elementwise pass works in for data of
    ``like``'s dtype: float32 for F16/BF16 (as torch), float64 otherwise."""
    raise NotImplementedError


@overload(decode)
def _decode(stored):
    if isinstance(stored, types.Float):
        return lambda stored: np.float64(stored)
    if stored == types.uint16:
        return lambda stored: _f16_to_f64(np.uint16(stored))
    return lambda stored: _bf16_to_f64(stored)


@overload(widen)
def _widen(stored):
    if stored == types.uint16:
        return lambda stored: _f16_to_f32(np.uint16(stored))
    return lambda stored: _bf16_to_f32(stored)


@overload(narrow)
def _narrow(value, like):
    if isinstance(like.dtype, types.Float):
        return lambda value, like: value
    return lambda value, like: np.float32(value)


def normalize(stored, k):
    """``(x - mean)*scale + shift`` for one stored element, coefficients ``k`` from
    ``_working`` (compiled only)."""
    raise NotImplementedError


@intrinsic
def _fma(typingctx, a, b, c):
    """``a*b + c`` rounded once (LLVM's fma)."""

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return a(a, b, c), codegen


@overload(normalize)
def _normalize(stored, k):
    if isinstance(stored, types.Float):
        return lambda stored, k: _fma(np.float64(stored) - k[0][0], k[0][1], k[0][2])

    def compensated(stored, k):
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
        return hi + lo if lo == lo else hi  # x infinite (lo NaN): hi says it all

    return compensated


@overload(encode)
def _encode(value, dtype):
    if isinstance(dtype.dtype, types.Float):
        return lambda value, dtype: value
    if dtype.dtype == types.uint16:
        if value == types.float32:  # one rounding, the hardware's
            return lambda value, dtype: _f32_to_f16(value)
        return lambda value, dtype: _f64_to_f16(value)
    if value == types.float32:
        return lambda value, dtype: _f32_to_bf16(value)
    return lambda value, dtype: _f64_to_bf16(value)


# --- per-channel operands ------------------------------------------------------------------


@jit
def load_channels(address, stride, code, count):
    """float64 copy of a ``(count,)`` tensor of dtype ``code`` with element ``stride``."""
    out = np.empty(count, np.float64)
    span = (count - 1) * stride + 1
    if code == F64:
        v64 = numba.carray(_pointer(address), (span,), np.float64)
        for c in range(count):
            out[c] = v64[c * stride]
    elif code == F32:
        v32 = numba.carray(_pointer(address), (span,), np.float32)
        for c in range(count):
            out[c] = v32[c * stride]
    elif code == F16:
        vh = numba.carray(_pointer(address), (span,), np.uint16)
        for c in range(count):
            out[c] = decode(vh[c * stride])
    else:
        vb = numba.carray(_pointer(address), (span,), np.int16)
        for c in range(count):
            out[c] = decode(vb[c * stride])
    return out


@jit
def store_channels(values, address, stride, code):
    """Round ``values`` once to dtype ``code`` and write them with element ``stride``."""
    count = values.size
    span = (count - 1) * stride + 1
    if code == F64:
        v64 = numba.carray(_pointer(address), (span,), np.float64)
        for c in range(count):
            v64[c * stride] = values[c]
    elif code == F32:
        v32 = numba.carray(_pointer(address), (span,), np.float32)
        for c in range(count):
            v32[c * stride] = values[c]
    elif code == F16:
        vh = numba.carray(_pointer(address), (span,), np.uint16)
        for c in range(count):
            vh[c * stride] = encode(values[c], vh.dtype)
    else:
        vb = numba.carray(_pointer(address), (span,), np.int16)
        for c in range(count):
            vb[c * stride] = encode(values[c], vb.dtype)


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


@helper
def _walk(bounds, geometry, strides):
    """What an item's loops need: its ``bounds`` (first channel, end channel, first row,
    end row; ``Layout.items``), whether a run crosses channels (channels innermost) or
    stays in one, the run length, and each slot's element stride in a run."""
    c0, c1, r0, r1 = bounds
    across = geometry[3] != 0
    column = 0 if across else 1
    return c0, c1, r0, r1, across, c1 - c0 if across else geometry[1], _column(strides, column)


@helper
def _column(strides, column):
    """A column of ``Layout.strides`` as values: loops that write memory would otherwise
    reload them from the array (it might alias their output) and not vectorize."""
    return (
        strides[0, column],
        strides[1, column],
        strides[2, column],
        strides[3, column],
        strides[4, column],
    )


@helper
def _at(offset, i, stride):
    """Index of element ``i`` of a run: unsigned, so that numba adds no negative-index
    wraparound, which would keep LLVM from vectorizing the loop (60x slower)."""
    return np.uint64(offset + i * stride)


# --- pass 1: per-channel sums --------------------------------------------------------------
# A run is what the innermost loop visits: one channel's ``inner`` elements ("along"), or
# every channel of one row when channels are innermost ("across": ``tile`` rows at once
# where rows are dense, see ``cpu_layout``). Along a channel the sums are scalars (kept in
# registers); across channels they are the item's (SUMS, C * tile) table, and the across
# loops walk all the item's rows themselves (rows of few channels are short). Each case a
# pass asks for (x alone; x and dy; x and masked dy) is its own loop, with no test inside,
# so that it vectorizes.


@helper(fastmath=REASSOC)
def _sums_along(x, dy, y, ox, od, oy, sx, sd, sy, n, k, has_dy, masked):
    s0 = s1 = s2 = s3 = 0.0
    if not has_dy:
        for i in range(n):
            xv = decode(x[_at(ox, i, sx)]) - k
            s0 += xv
            s1 += xv * xv
    elif not masked:
        for i in range(n):
            xv, dv = decode(x[_at(ox, i, sx)]) - k, decode(dy[_at(od, i, sd)])
            s0 += xv
            s1 += xv * xv
            s2 += dv
            s3 += dv * xv
    else:
        for i in range(n):
            xv, dv = decode(x[_at(ox, i, sx)]) - k, decode(dy[_at(od, i, sd)])
            dv = dv if decode(y[_at(oy, i, sy)]) > 0 else 0.0
            s0 += xv
            s1 += xv * xv
            s2 += dv
            s3 += dv * xv
    return s0, s1, s2, s3


@helper
def _sums_across(x, dy, y, geometry, strides, r0, r1, n, shift, out):
    # Two rows at a time, added in registers before the table is updated: one read and
    # write of the table per two values, not per value (its traffic bounded the loop).
    # The rows are one from each half of the item, so that memory is read in sequential
    # streams, which the hardware prefetches (adjacent rows are not: 2x slower out of
    # cache). The masked sums (ReLU's backward) and the last row go one row at a time.
    has_dy, masked = dy.size > 0, y.size > 0
    sx, sd, sy = strides[0, 0], strides[1, 0], strides[2, 0]
    h = 0 if masked else (r1 - r0) // 2
    for r in range(r0, r0 + h):
        ox, ox2 = row_offset(r, geometry, strides[0]), row_offset(r + h, geometry, strides[0])
        if not has_dy:
            for i in range(n):
                k = shift[i]
                a, b = decode(x[_at(ox, i, sx)]) - k, decode(x[_at(ox2, i, sx)]) - k
                out[0, i] += a + b
                out[1, i] += a * a + b * b
            continue
        od, od2 = row_offset(r, geometry, strides[1]), row_offset(r + h, geometry, strides[1])
        for i in range(n):
            k = shift[i]
            a, b = decode(x[_at(ox, i, sx)]) - k, decode(x[_at(ox2, i, sx)]) - k
            da, db = decode(dy[_at(od, i, sd)]), decode(dy[_at(od2, i, sd)])
            out[0, i] += a + b
            out[1, i] += a * a + b * b
            out[2, i] += da + db
            out[3, i] += da * a + db * b
    for r in range(r0 + 2 * h, r1):
        ox, od = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
        oy = row_offset(r, geometry, strides[2])
        if not has_dy:
            for i in range(n):
                xv = decode(x[_at(ox, i, sx)]) - shift[i]
                out[0, i] += xv
                out[1, i] += xv * xv
        elif not masked:
            for i in range(n):
                xv, dv = decode(x[_at(ox, i, sx)]) - shift[i], decode(dy[_at(od, i, sd)])
                out[0, i] += xv
                out[1, i] += xv * xv
                out[2, i] += dv
                out[3, i] += dv * xv
        else:
            for i in range(n):
                xv, dv = decode(x[_at(ox, i, sx)]) - shift[i], decode(dy[_at(od, i, sd)])
                dv = dv if decode(y[_at(oy, i, sy)]) > 0 else 0.0
                out[0, i] += xv
                out[1, i] += xv * xv
                out[2, i] += dv
                out[3, i] += dv * xv


@jit
def item_sums(x, dy, y, geometry, strides, shift, out, bounds):
    """Add the sums of the work item ``bounds`` to ``out`` (``(SUMS, C * tile + PAD)``, ``shift``
    tiled the same, see ``tiled``): ``x - k``, ``(x - k)^2``, ``dy``, ``dy * (x - k)`` with
    ``k = shift[c]``; ``dy`` zero where ``y <= 0`` if ``y`` is not empty; with ``dy`` empty
    its sums stay zero."""
    if geometry[3]:
        item_sums_across(x, dy, y, geometry, strides, shift, out, bounds)
    else:
        item_sums_along(x, dy, y, geometry, strides, shift, out, bounds)


@jit
def item_sums_along(x, dy, y, geometry, strides, shift, out, bounds):
    """``item_sums`` where runs stay in one channel."""
    c0, c1, r0, r1, _, n, s = _walk(bounds, geometry, strides)
    has_dy, masked = dy.size > 0, y.size > 0
    for r in range(r0, r1):
        ox, od = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
        oy = row_offset(r, geometry, strides[2])
        for c in range(c0, c1):
            sums = _sums_along(
                x,
                dy,
                y,
                ox + c * strides[0, 0],
                od + c * strides[1, 0],
                oy + c * strides[2, 0],
                s[0],
                s[1],
                s[2],
                n,
                shift[c],
                has_dy,
                masked,
            )
            for j in range(SUMS):
                out[j, c] += sums[j]


@jit
def item_sums_across(x, dy, y, geometry, strides, shift, out, bounds):
    """``item_sums`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    _, _, r0, r1, _, n, _ = _walk(bounds, geometry, strides)
    _sums_across(x, dy, y, geometry, strides, r0, r1, n, shift, out)


@helper
def first_values(x, geometry, strides):
    """Each channel's first value: the shift that makes a constant channel sum to zero."""
    shift = np.empty(geometry[0])
    for c in range(geometry[0]):
        shift[c] = decode(x[c * strides[0, 0]])
    return shift


@jit
def tiled(values, tile):
    """``values`` repeated ``tile`` times (itself for 1): per-channel values for a run of
    ``tile`` rows of channels."""
    if tile == 1:
        return values
    n = values.size
    out = np.empty(n * tile)
    for i in range(n * tile):  # a loop: numba's slice assignment costs seconds to compile
        out[i] = values[i % n]
    return out


@jit
def folded(sums, channels):
    """``(SUMS, C * tile + PAD)`` sums added up per channel: ``(SUMS, C)``."""
    out = np.zeros((SUMS, channels))
    for j in range(SUMS):
        for i in range(sums.shape[1] - PAD):
            out[j, i % channels] += sums[j, i]
    return out


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


@helper
def _forward_along(x, z, y, ox, oz, oy, sx, sz, sy, n, mean, scale, shift, flags):
    add_z, relu = flags
    if not (add_z or relu):
        k = _working(mean, scale, shift, y)
        for i in range(n):
            y[_at(oy, i, sy)] = encode(normalize(x[_at(ox, i, sx)], k), y.dtype)
        return
    for i in range(n):
        at = (_at(ox, i, sx), _at(oz, i, sz), _at(oy, i, sy))
        _forward_element(x, z, y, *at, mean, scale, shift, add_z, relu)


@helper
def _forward_across(x, z, y, geometry, strides, r0, r1, n, mean, scale, shift, flags):
    add_z, relu = flags
    sx, sz, sy = strides[0, 0], strides[1, 0], strides[2, 0]
    for r in range(r0, r1):
        ox, oz = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
        oy = row_offset(r, geometry, strides[2])
        if not (add_z or relu):
            for i in range(n):
                k = _working(mean[i], scale[i], shift[i], y)
                y[_at(oy, i, sy)] = encode(normalize(x[_at(ox, i, sx)], k), y.dtype)
            continue
        for i in range(n):
            at = (_at(ox, i, sx), _at(oz, i, sz), _at(oy, i, sy))
            _forward_element(x, z, y, *at, mean[i], scale[i], shift[i], add_z, relu)


@jit
def item_forward(x, z, y, geometry, strides, mean, scale, shift, flags, bounds):
    """``y = relu?((x - mean)*scale + shift [+ z])`` over the work item ``bounds`` (the
    per-channel arrays tiled as ``tiled`` does). ``flags``: add z, ReLU. Data slots: x, z,
    y."""
    if geometry[3]:
        item_forward_across(x, z, y, geometry, strides, mean, scale, shift, flags, bounds)
    else:
        item_forward_along(x, z, y, geometry, strides, mean, scale, shift, flags, bounds)


@jit
def item_forward_along(x, z, y, geometry, strides, mean, scale, shift, flags, bounds):
    """``item_forward`` where runs stay in one channel."""
    c0, c1, r0, r1, _, n, s = _walk(bounds, geometry, strides)
    for r in range(r0, r1):
        ox, oz = row_offset(r, geometry, strides[0]), row_offset(r, geometry, strides[1])
        oy = row_offset(r, geometry, strides[2])
        for c in range(c0, c1):
            _forward_along(
                x,
                z,
                y,
                ox + c * strides[0, 0],
                oz + c * strides[1, 0],
                oy + c * strides[2, 0],
                s[0],
                s[1],
                s[2],
                n,
                mean[c],
                scale[c],
                shift[c],
                flags,
            )


@jit
def item_forward_across(x, z, y, geometry, strides, mean, scale, shift, flags, bounds):
    """``item_forward`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    _, _, r0, r1, _, n, _ = _walk(bounds, geometry, strides)
    _forward_across(x, z, y, geometry, strides, r0, r1, n, mean, scale, shift, flags)


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
def _backward_along(x, dy, y, gi, gz, o, s, n, a, b, k, flags):
    use_x, masked, write_gi, write_gz = flags
    if write_gi and not (masked or write_gz):
        if use_x:
            for i in range(n):
                v = _fma(b, decode(x[_at(o[0], i, s[0])]), k)
                gi[_at(o[3], i, s[3])] = encode(
                    _fma(a, decode(dy[_at(o[1], i, s[1])]), v), gi.dtype
                )
        else:
            for i in range(n):
                gi[_at(o[3], i, s[3])] = encode(
                    _fma(a, decode(dy[_at(o[1], i, s[1])]), k), gi.dtype
                )
        return
    for i in range(n):
        _backward_element(x, dy, y, gi, gz, o, s, i, a, b, k, flags)


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


@helper
def _backward_across(x, dy, y, gi, gz, geometry, strides, r0, r1, n, k_dy, k_x, k_c, flags):
    use_x, masked, write_gi, write_gz = flags
    plain = write_gi and not (masked or write_gz)
    s = _column(strides, 0)
    for r in range(r0, r1):
        o = _row_offsets(r, geometry, strides)
        if plain and use_x:
            for i in range(n):
                v = _fma(k_x[i], decode(x[_at(o[0], i, s[0])]), k_c[i])
                v = _fma(k_dy[i], decode(dy[_at(o[1], i, s[1])]), v)
                gi[_at(o[3], i, s[3])] = encode(v, gi.dtype)
        elif plain:
            for i in range(n):
                v = _fma(k_dy[i], decode(dy[_at(o[1], i, s[1])]), k_c[i])
                gi[_at(o[3], i, s[3])] = encode(v, gi.dtype)
        else:
            for i in range(n):
                _backward_element(x, dy, y, gi, gz, o, s, i, k_dy[i], k_x[i], k_c[i], flags)


@jit
def item_backward(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, bounds):
    """``gi = k_dy*dv + k_x*x + k_c`` and ``gz = dv`` (``dv``: dy, zero where ``y <= 0`` if
    masked) over the work item ``bounds`` (the coefficients tiled as ``tiled`` does).
    ``flags``: use x (all but eval), mask, write gi, write gz. Data slots: x, dy, y, gi,
    gz."""
    if geometry[3]:
        item_backward_across(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, bounds)
    else:
        item_backward_along(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, bounds)


@jit
def item_backward_along(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, bounds):
    """``item_backward`` where runs stay in one channel."""
    c0, c1, r0, r1, _, n, s = _walk(bounds, geometry, strides)
    for r in range(r0, r1):
        o = _row_offsets(r, geometry, strides)
        for c in range(c0, c1):
            oc = (
                o[0] + c * strides[0, 0],
                o[1] + c * strides[1, 0],
                o[2] + c * strides[2, 0],
                o[3] + c * strides[3, 0],
                o[4] + c * strides[4, 0],
            )
            _backward_along(x, dy, y, gi, gz, oc, s, n, k_dy[c], k_x[c], k_c[c], flags)


@jit
def item_backward_across(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, bounds):
    """``item_backward`` where runs cross channels (channels innermost): each walk is
    compiled apart, so that a layout compiles only its own."""
    _, _, r0, r1, _, n, _ = _walk(bounds, geometry, strides)
    _backward_across(x, dy, y, gi, gz, geometry, strides, r0, r1, n, k_dy, k_x, k_c, flags)


# --- the passes ----------------------------------------------------------------------------
# Each pass is its inputs, its sums over every item, its coefficients, its results over
# every item and its per-channel outputs. The whole-pass functions below run them as one
# item in one call (small problems); the backend runs the same steps with items on threads.

TRAIN, SAVED, EVAL, SAVED_INVSTD = 0, 1, 2, 3  # problems.Mode


@jit
def backward_inputs(x, geometry, strides, w_at, m_at, v_at, channel_args, mode):
    """``(weight, shift, statistic)`` in float64: the shift is the batch's first values
    (train) or the saved/running mean; the statistic is the saved invstd or a variance."""
    channels = geometry[0]
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    if mode == TRAIN:
        shift = first_values(x, geometry, strides)
        return w, shift, shift
    shift = load_channels(m_at, channel_args[1, 0], channel_args[1, 1], channels)
    stat = load_channels(v_at, channel_args[2, 0], channel_args[2, 1], channels)
    return w, shift, stat


@jit
def backward_coefficients(sums, shift, stat, w, count, mode, eps):
    """``(k_dy, k_x, k_c, grad_weight, grad_bias)``: ``grad_input = k_dy*dy + k_x*x + k_c``
    per channel."""
    channels = w.size
    k_dy, k_x, k_c = np.empty(channels), np.zeros(channels), np.zeros(channels)
    gw, gb = np.empty(channels), np.empty(channels)
    for c in range(channels):
        sum_dy, sum_dyx = sums[2, c], sums[3, c]
        mean = shift[c]
        if mode == TRAIN:
            d = sums[0, c] / count
            mean += d
            var = sums[1, c] / count - d * d
            if var < 0.0:  # rounding; a NaN stays NaN
                var = 0.0
            invstd = 1.0 / np.sqrt(var + eps)
            sum_dyx -= d * sum_dy  # sum(dy * (x - mean))
        elif mode == SAVED_INVSTD:
            invstd = stat[c]
        else:
            invstd = 1.0 / np.sqrt(stat[c] + eps)
        gb[c] = sum_dy
        gw[c] = sum_dyx * invstd
        k_dy[c] = w[c] * invstd
        if mode != EVAL:
            k_x[c] = -k_dy[c] * invstd * gw[c] / count
            k_c[c] = -k_dy[c] * sum_dy / count - k_x[c] * mean
    return k_dy, k_x, k_c, gw, gb


@jit
def backward_outputs(gw, gb, gw_at, gb_at, channel_args, write_gw, write_gb):
    if write_gw:
        store_channels(gw, gw_at, channel_args[3, 0], channel_args[3, 1])
    if write_gb:
        store_channels(gb, gb_at, channel_args[4, 0], channel_args[4, 1])


@jit
def backward(
    x_at,
    dy_at,
    y_at,
    gi_at,
    gz_at,
    w_at,
    m_at,
    v_at,
    gw_at,
    gb_at,
    like,
    geometry,
    strides,
    spans,
    channel_args,
    mode,
    eps,
    flags,
    whole,
):
    """Batch-norm backward as one item (``whole``: every channel and row). Data tensors
    (x, dy, the fused forward's y, gi, gz) are walked with ``strides``' rows 0..4;
    ``channel_args`` holds (stride, dtype code) of weight, statistic 0, statistic 1,
    grad_weight, grad_bias. ``flags``: write gi, gw, gb;
    mask dy by ``y > 0``; write gz."""
    write_gi, write_gw, write_gb, masked, write_gz = flags
    x, dy, y = flat(x_at, spans[0], like), flat(dy_at, spans[1], like), flat(y_at, spans[2], like)
    gi, gz = flat(gi_at, spans[3], like), flat(gz_at, spans[4], like)
    w, shift, stat = backward_inputs(x, geometry, strides, w_at, m_at, v_at, channel_args, mode)
    channels, tile = geometry[0], geometry[TILE]
    sums = np.zeros((SUMS, channels * tile + PAD))
    item_sums(x, dy, y, geometry, strides, tiled(shift, tile), sums, whole)
    count = geometry[1] * geometry[2] * tile
    k_dy, k_x, k_c, gw, gb = backward_coefficients(
        folded(sums, channels), shift, stat, w, count, mode, eps
    )
    if write_gi or write_gz:
        apply = (mode != EVAL, masked, write_gi, write_gz)
        k_dy, k_x, k_c = tiled(k_dy, tile), tiled(k_x, tile), tiled(k_c, tile)
        item_backward(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, apply, whole)
    backward_outputs(gw, gb, gw_at, gb_at, channel_args, write_gw, write_gb)


@jit
def training_inputs(x, geometry, strides, w_at, b_at, rm_at, rv_at, channel_args, updates):
    """``(weight, bias, old running mean, old running var, shift)`` in float64; a running
    statistic that ``updates`` says is not updated is empty. Every per-channel input is
    read before anything is written."""
    channels = geometry[0]
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    b = load_channels(b_at, channel_args[1, 0], channel_args[1, 1], channels)
    old_mean = old_var = np.zeros(0)
    if updates[0]:
        old_mean = load_channels(rm_at, channel_args[4, 0], channel_args[4, 1], channels)
    if updates[1]:
        old_var = load_channels(rv_at, channel_args[5, 0], channel_args[5, 1], channels)
    return w, b, old_mean, old_var, first_values(x, geometry, strides)


@jit
def training_statistics(sums, shift, count, eps):
    """The batch's ``(mean, biased variance, invstd)`` from its shifted sums."""
    channels = shift.size
    mean, var, invstd = np.empty(channels), np.empty(channels), np.empty(channels)
    for c in range(channels):
        d = sums[0, c] / count
        mean[c] = shift[c] + d
        var[c] = sums[1, c] / count - d * d
        if var[c] < 0.0:  # rounding; a NaN stays NaN
            var[c] = 0.0
        invstd[c] = 1.0 / np.sqrt(var[c] + eps)
    return mean, var, invstd


@jit
def training_outputs(stats, old, at, channel_args, count, momentum, updates):
    """Write the saved mean and invstd, and the running statistics ``updates`` names.
    ``stats``: mean, var, invstd; ``old``: the old running mean and var; ``at``: the
    addresses of saved_mean, saved_invstd, running_mean, running_var."""
    mean, var, invstd = stats
    store_channels(mean, at[0], channel_args[2, 0], channel_args[2, 1])
    store_channels(invstd, at[1], channel_args[3, 0], channel_args[3, 1])
    if updates[0]:
        running = _blend(old[0], mean, 1.0, momentum)
        store_channels(running, at[2], channel_args[4, 0], channel_args[4, 1])
    if updates[1]:
        running = _blend(old[1], var, count / (count - 1), momentum)
        store_channels(running, at[3], channel_args[5, 0], channel_args[5, 1])


@helper
def _blend(old, new, factor, momentum):
    """``(1 - momentum)*old + momentum*factor*new``, a loop (array expressions cost
    seconds to compile on first use)."""
    out = np.empty(old.size)
    for c in range(old.size):
        out[c] = (1.0 - momentum) * old[c] + momentum * (new[c] * factor)
    return out


@helper
def _product(a, b):
    """``a * b`` elementwise, a loop (see ``_blend``)."""
    out = np.empty(a.size)
    for c in range(a.size):
        out[c] = a[c] * b[c]
    return out


@jit
def forward_training(
    x_at,
    z_at,
    y_at,
    w_at,
    b_at,
    sm_at,
    si_at,
    rm_at,
    rv_at,
    like,
    geometry,
    strides,
    spans,
    channel_args,
    eps,
    momentum,
    flags,
    whole,
):
    """Training forward as one item (``whole``: every channel and row): batch statistics,
    ``y``, saved mean and invstd, running update. Data tensors: x, z, y (``strides`` rows
    0..2); ``channel_args``: weight, bias, saved_mean, saved_invstd, running_mean,
    running_var. ``flags``: add z, ReLU, update running_mean, update running_var."""
    add_z, relu, update_mean, update_var = flags
    updates = (update_mean, update_var)
    x, z, y = flat(x_at, spans[0], like), flat(z_at, spans[1], like), flat(y_at, spans[2], like)
    w, b, old_mean, old_var, shift = training_inputs(
        x, geometry, strides, w_at, b_at, rm_at, rv_at, channel_args, updates
    )
    channels, tile = geometry[0], geometry[TILE]
    sums = np.zeros((SUMS, channels * tile + PAD))
    item_sums(x, x[:0], x[:0], geometry, strides, tiled(shift, tile), sums, whole)
    count = geometry[1] * geometry[2] * tile
    mean, var, invstd = training_statistics(folded(sums, channels), shift, count, eps)
    coefficients = tiled(mean, tile), tiled(_product(w, invstd), tile), tiled(b, tile)
    item_forward(x, z, y, geometry, strides, *coefficients, (add_z, relu), whole)
    at = (sm_at, si_at, rm_at, rv_at)
    old = (old_mean, old_var)
    training_outputs((mean, var, invstd), old, at, channel_args, count, momentum, updates)


@jit
def inference_coefficients(w_at, b_at, rm_at, rv_at, channel_args, channels, eps):
    """``(mean, scale, shift)``: ``y = (x - mean)*scale + shift`` per channel."""
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    b = load_channels(b_at, channel_args[1, 0], channel_args[1, 1], channels)
    mean = load_channels(rm_at, channel_args[2, 0], channel_args[2, 1], channels)
    var = load_channels(rv_at, channel_args[3, 0], channel_args[3, 1], channels)
    scale = np.empty(channels)
    for c in range(channels):
        scale[c] = w[c] / np.sqrt(var[c] + eps)
    return mean, scale, b


@jit
def forward_inference(
    x_at,
    y_at,
    w_at,
    b_at,
    rm_at,
    rv_at,
    like,
    geometry,
    strides,
    spans,
    channel_args,
    eps,
    plain,
    whole,
):
    """Inference forward as one item (``whole``: every channel and row). Data tensors: x, y
    (``strides`` rows 0, 2); ``channel_args``: weight, bias, running_mean, running_var;
    ``plain``: the forward's flags, none set."""
    x, y = flat(x_at, spans[0], like), flat(y_at, spans[2], like)
    channel = (w_at, b_at, rm_at, rv_at)
    mean, scale, b = inference_coefficients(*channel, channel_args, geometry[0], eps)
    tile = geometry[TILE]
    mean, scale, b = tiled(mean, tile), tiled(scale, tile), tiled(b, tile)
    item_forward(x, x, y, geometry, strides, mean, scale, b, plain, whole)
