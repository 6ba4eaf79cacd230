"""The CPU engine's compiled passes: numba kernels over raw host pointers.

Each batch-norm pass is one call: it reads the per-channel operands, walks the data once
for the per-channel sums (float64 accumulators; shifted by a per-channel value so that a
constant channel sums to exactly zero), derives per-channel coefficients, walks the data a
second time to write the result (one read of each operand, one write), and writes the
per-channel results last. Work is split into items (a channel and a run of rows, or a run
of rows with every channel when channels are innermost) that run in parallel when the
caller asks for more than one chunk; one chunk runs serially with no thread start-up,
which is what small problems want. Data tensors are walked as ``cpu_layout.Layout`` says.

F16 and BF16 have no numba type: the kernels see their bits (``uint16`` for F16, ``int16``
for BF16, so the dtype alone picks the conversion) and convert element by element: exact
reads, and one round-to-nearest-even write from float64 (BF16 through float32, as torch).
F16 goes through LLVM's ``half`` type, so it uses the CPU's conversion instructions.
Per-channel operands may have another dtype than the data (F32 for half data); they are
read and written through a runtime dtype code, since they are small.

Compiled with ``cache=True``: the first call of each data dtype compiles once per machine
(seconds), later processes load the machine code from numba's cache. References: numba's
"Automatic parallelization with @jit" (``prange``), "Notes on caching" and
``numba.extending.intrinsic``; NumPy's ``astype(float16)`` is what the F16 rounding is
tested against.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..enums import DataType

F16, F32, F64, BF16 = (int(d) for d in (DataType.F16, DataType.F32, DataType.F64, DataType.BF16))
ROW_DIMS = 4  # cpu_layout.ROW_DIMS: geometry is (C, inner, rows, channels_inner, *row_dims)
SUMS = 4  # sum(x - k), sum((x - k)^2), sum(dy), sum(dy * (x - k))
REASSOC = {"reassoc"}  # lets LLVM vectorize the float64 sums; no nnan/ninf: nan stays nan
OPTIONS = {"cache": True, "error_model": "numpy"}  # numpy: 1/0 is inf, not an exception
jit = numba.njit(**OPTIONS)


def prange_only() -> dict:
    """numba's parallel options with only ``prange`` on: no hidden parallel loops (a
    ``np.zeros`` turned into one would wake the threads on every small call)."""
    off = ("comprehension", "reduction", "inplace_binop", "setitem", "numpy", "stencil", "fusion")
    return dict.fromkeys(off, False)


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
def _f32_to_f16(typingctx, value):
    """F16 bits of a float32, rounded to nearest even (LLVM's half truncation)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@jit
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


@jit
def _bf16_to_f64(stored):
    return np.float64(np.uint32((np.int64(stored) & 0xFFFF) << 16).view(np.float32))


@jit
def _f64_to_bf16(value):
    single = np.float32(value)
    bits = np.int64(single.view(np.uint32))
    if single != single:
        return (bits >> 16) | 0x40  # keep NaN a (quiet) NaN
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def decode(stored):
    """float64 value of one stored element (compiled through the overload below)."""
    raise NotImplementedError


def encode(value, dtype):
    """What to store for float64 ``value`` in an array of ``dtype`` (compiled only)."""
    raise NotImplementedError


@overload(decode)
def _decode(stored):
    if isinstance(stored, types.Float):
        return lambda stored: np.float64(stored)
    if stored == types.uint16:
        return lambda stored: _f16_to_f64(np.uint16(stored))
    return lambda stored: _bf16_to_f64(stored)


@overload(encode)
def _encode(value, dtype):
    if isinstance(dtype.dtype, types.Float):
        return lambda value, dtype: value
    if dtype.dtype == types.uint16:
        return lambda value, dtype: _f64_to_f16(value)
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


@jit
def row_offset(row, geometry, strides, t):
    """Element offset of row ``row`` in tensor ``t`` (row dimensions decomposed; the
    outermost needs no division, and most layouts have just that one)."""
    offset = 0
    for k in range(ROW_DIMS - 1, 0, -1):
        size = geometry[4 + k]
        if row < size:
            return offset + row * strides[t, 2 + k]
        offset += (row % size) * strides[t, 2 + k]
        row //= size
    return offset + row * strides[t, 2]


@jit
def work_items(geometry, chunks):
    """``(items, split)``: blocks of channels times runs of rows (``split`` per block).

    Channels innermost: one block of every channel, rows split in ``chunks``. Otherwise
    ``chunks`` blocks of channels, and rows split too when there are fewer channels."""
    channels, rows = geometry[0], geometry[2]
    if geometry[3]:
        split = min(chunks, rows)
        return split, split
    blocks = min(channels, chunks)
    split = min(rows, (chunks + blocks - 1) // blocks)
    return blocks * split, split


@jit
def item_bounds(item, split, geometry, items):
    """``(first channel, end channel, first row, end row)`` of work item ``item``."""
    channels, rows = geometry[0], geometry[2]
    block, s = item // split, item % split
    blocks = items // split
    return (
        block * channels // blocks,
        (block + 1) * channels // blocks,
        s * rows // split,
        (s + 1) * rows // split,
    )


# --- runs: the innermost loops ----------------------------------------------------------------
# A run is the elements of one row that the innermost loop visits: one channel's ``inner``
# elements, or every channel when channels are innermost. The run functions below are
# compiled for contiguous runs (slices, which LLVM vectorizes) and for strided ones.


@jit
def _strided(a, offset, n, stride):
    """``n`` elements of the flat view ``a`` from ``offset``, ``stride`` apart (0 too)."""
    return np.lib.stride_tricks.as_strided(a[offset:], (n,), (stride * a.itemsize,))


@jit
def _row_bases(r, geometry, strides):
    """Offsets of row ``r`` (channel 0) in the five tensor slots."""
    return (
        row_offset(r, geometry, strides, 0),
        row_offset(r, geometry, strides, 1),
        row_offset(r, geometry, strides, 2),
        row_offset(r, geometry, strides, 3),
        row_offset(r, geometry, strides, 4),
    )


@jit
def _contiguous_runs(geometry, strides, tensors):
    """Whether the runs of the first ``tensors`` slots are all contiguous."""
    column = 0 if geometry[3] else 1
    unit = True
    for t in range(tensors):
        unit = unit and strides[t, column] == 1  # an absent tensor has the input's strides
    return unit


@jit
def _channel_runs_adjoin(geometry, strides, tensors):
    """Whether, channel after channel, the runs of the first ``tensors`` slots follow each
    other in memory (NCHW-like), so that a row's block of channels is one contiguous run."""
    adjoin = not geometry[3]
    for t in range(tensors):
        adjoin = adjoin and strides[t, 0] == geometry[1]
    return adjoin


@jit
def _run_length(geometry, c0, c1):
    return c1 - c0 if geometry[3] else geometry[1]


@jit
def _run_stride(geometry, strides, t):
    return strides[t, 0] if geometry[3] else strides[t, 1]


@numba.njit(**OPTIONS, fastmath=REASSOC)
def _accumulate(xs, ds, ys, shift, c, m, out, channels_inner, flags):
    """Add a run's sums to ``out`` (``(SUMS, C)``): column ``i`` for element ``i`` of a run
    over channels; else the run holds ``m`` channels from ``c``, one after the other.

    The three loops are the cases a pass asks for (x alone; x and dy; x and masked dy),
    written out so that each vectorizes with no test inside."""
    has_dy, masked = flags
    if channels_inner:
        if not has_dy:
            for i in range(xs.size):
                xv = decode(xs[i]) - shift[i]
                out[0, i] += xv
                out[1, i] += xv * xv
        elif not masked:
            for i in range(xs.size):
                xv, dv = decode(xs[i]) - shift[i], decode(ds[i])
                out[0, i] += xv
                out[1, i] += xv * xv
                out[2, i] += dv
                out[3, i] += dv * xv
        else:
            for i in range(xs.size):
                xv, dv = decode(xs[i]) - shift[i], decode(ds[i])
                dv = dv if decode(ys[i]) > 0 else 0.0
                out[0, i] += xv
                out[1, i] += xv * xv
                out[2, i] += dv
                out[3, i] += dv * xv
        return
    n = xs.size // m
    for j in range(m):
        xj, dj, yj = xs[j * n : j * n + n], ds[j * n : j * n + n], ys[j * n : j * n + n]
        k = shift[c + j]
        s0 = s1 = s2 = s3 = 0.0
        if not has_dy:
            for i in range(n):
                xv = decode(xj[i]) - k
                s0 += xv
                s1 += xv * xv
        elif not masked:
            for i in range(n):
                xv, dv = decode(xj[i]) - k, decode(dj[i])
                s0 += xv
                s1 += xv * xv
                s2 += dv
                s3 += dv * xv
        else:
            for i in range(n):
                xv, dv = decode(xj[i]) - k, decode(dj[i])
                dv = dv if decode(yj[i]) > 0 else 0.0
                s0 += xv
                s1 += xv * xv
                s2 += dv
                s3 += dv * xv
        out[0, c + j] += s0
        out[1, c + j] += s1
        out[2, c + j] += s2
        out[3, c + j] += s3


@jit
def _apply_backward(xs, ds, ys, gs, zs, k_dy, k_x, k_c, c, m, channels_inner, flags):
    """``gs = k_dy*ds + k_x*xs + k_c`` and ``zs = ds`` over a run (``ds`` masked); the run
    is over channels, or holds ``m`` channels from ``c`` one after the other.

    ``flags``: use x (all but eval), mask, write gi, write gz. The unfused cases have loops
    of their own, with no test inside, so that they vectorize."""
    use_x, masked, write_gi, write_gz = flags
    plain = write_gi and not (masked or write_gz)
    if channels_inner and plain and use_x:
        for i in range(xs.size):
            v = k_dy[i] * decode(ds[i]) + k_x[i] * decode(xs[i]) + k_c[i]
            gs[i] = encode(v, gs.dtype)
        return
    if channels_inner and plain:
        for i in range(xs.size):
            gs[i] = encode(k_dy[i] * decode(ds[i]) + k_c[i], gs.dtype)
        return
    n = xs.size // m
    for j in range(m if not channels_inner else 1):
        lo, hi = (j * n, j * n + n) if not channels_inner else (0, xs.size)
        xj, dj, yj, gj, zj = xs[lo:hi], ds[lo:hi], ys[lo:hi], gs[lo:hi], zs[lo:hi]
        a, b, k = k_dy[c + j], k_x[c + j], k_c[c + j]
        if plain and use_x:
            for i in range(hi - lo):
                gj[i] = encode(a * decode(dj[i]) + b * decode(xj[i]) + k, gj.dtype)
        elif plain:
            for i in range(hi - lo):
                gj[i] = encode(a * decode(dj[i]) + k, gj.dtype)
        else:
            for i in range(hi - lo):
                ch = i if channels_inner else c + j
                dv = decode(dj[i])
                if masked and not decode(yj[i]) > 0:
                    dv = 0.0
                v = k_dy[ch] * dv + k_c[ch]
                if use_x:
                    v += k_x[ch] * decode(xj[i])
                if write_gi:
                    gj[i] = encode(v, gj.dtype)
                if write_gz:
                    zj[i] = encode(dv, zj.dtype)


@jit
def _apply_forward(xs, zs, ys, mean, scale, shift, c, m, channels_inner, flags):
    """``ys = relu?((xs - mean)*scale + shift [+ zs])`` over a run (over channels, or of
    ``m`` channels from ``c``, one after the other)."""
    add_z, relu = flags
    n = xs.size // m
    for j in range(m if not channels_inner else 1):
        lo, hi = (j * n, j * n + n) if not channels_inner else (0, xs.size)
        xj, zj, yj = xs[lo:hi], zs[lo:hi], ys[lo:hi]
        for i in range(hi - lo):
            ch = i if channels_inner else c + j
            v = (decode(xj[i]) - mean[ch]) * scale[ch] + shift[ch]
            if add_z:
                v += decode(zj[i])
            if relu and v < 0:
                v = 0.0
            yj[i] = encode(v, yj.dtype)


# --- pass 1: per-channel sums --------------------------------------------------------------


@jit
def _sums_item(x, dy, y, geometry, strides, shift, item, items, split, out, flags):
    """Accumulate work item ``item``'s sums into ``out`` (``(SUMS, C)``)."""
    c0, c1, r0, r1 = item_bounds(item, split, geometry, items)
    n, inner = _run_length(geometry, c0, c1), geometry[3] != 0
    tensors = 3 if flags[1] else 2
    unit = _contiguous_runs(geometry, strides, tensors)
    block = unit and _channel_runs_adjoin(geometry, strides, tensors)
    sx, sd = _run_stride(geometry, strides, 0), _run_stride(geometry, strides, 1)
    sy = _run_stride(geometry, strides, 2)
    cx, cd, cy = strides[0, 0], strides[1, 0], strides[2, 0]
    for r in range(r0, r1):
        bx, bd, by, _, _ = _row_bases(r, geometry, strides)
        if block:  # the whole block of channels in one run
            ox, od, oy, size = bx + c0 * cx, bd + c0 * cd, by + c0 * cy, (c1 - c0) * n
            xs, ds, ys = x[ox : ox + size], dy[od : od + size], y[oy : oy + size]
            _accumulate(xs, ds, ys, shift, c0, c1 - c0, out, False, flags)
            continue
        for c in range(c0, c0 + 1 if inner else c1):
            ox, od, oy = bx + c * cx, bd + c * cd, by + c * cy
            if unit:
                xs, ds, ys = x[ox : ox + n], dy[od : od + n], y[oy : oy + n]
                _accumulate(xs, ds, ys, shift, c, 1, out, inner, flags)
            else:
                xs, ds = _strided(x, ox, n, sx), _strided(dy, od, n, sd)
                _accumulate(xs, ds, _strided(y, oy, n, sy), shift, c, 1, out, inner, flags)


@numba.njit(**OPTIONS, parallel=prange_only())
def channel_sums(x, dy, y, geometry, strides, shift, flags, chunks):
    """``(4, C)`` float64 sums over every value of each channel, ``k`` = ``shift[c]``:
    ``x - k``, ``(x - k)^2``, ``dy``, ``dy * (x - k)`` (``dy`` zero where ``y <= 0`` if
    masked). ``flags``: sum dy, mask; without dy its sums stay zero."""
    items, split = work_items(geometry, chunks)
    if split == 1:  # items cover distinct channels: they share one table
        sums = np.zeros((SUMS, geometry[0]))
        if chunks == 1:
            for item in range(items):
                _sums_item(x, dy, y, geometry, strides, shift, item, items, split, sums, flags)
        else:
            for item in prange(items):
                _sums_item(x, dy, y, geometry, strides, shift, item, items, split, sums, flags)
        return sums
    partial = np.zeros((items, SUMS, geometry[0]))
    for item in prange(items):
        _sums_item(x, dy, y, geometry, strides, shift, item, items, split, partial[item], flags)
    return partial.sum(axis=0)  # in item order: the same sums for the same split


@jit
def first_values(x, geometry, strides):
    """Each channel's first value: the shift that makes a constant channel sum to zero."""
    shift = np.empty(geometry[0])
    for c in range(geometry[0]):
        shift[c] = decode(x[c * strides[0, 0]])
    return shift


# --- pass 2: the elementwise results -------------------------------------------------------


@jit
def _backward_item(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, item, items, split, flags):
    """``_apply_backward`` over work item ``item``."""
    c0, c1, r0, r1 = item_bounds(item, split, geometry, items)
    n, inner = _run_length(geometry, c0, c1), geometry[3] != 0
    unit = _contiguous_runs(geometry, strides, 5)
    block = unit and _channel_runs_adjoin(geometry, strides, 5)
    s = [_run_stride(geometry, strides, t) for t in range(5)]
    cs = strides[:, 0]
    for r in range(r0, r1):
        b = _row_bases(r, geometry, strides)
        for c in range(c0, c0 + 1 if inner or block else c1):
            o = (
                b[0] + c * cs[0],
                b[1] + c * cs[1],
                b[2] + c * cs[2],
                b[3] + c * cs[3],
                b[4] + c * cs[4],
            )
            if unit:
                m = c1 - c0 if block else 1
                size = m * n
                xs, ds, ys = x[o[0] : o[0] + size], dy[o[1] : o[1] + size], y[o[2] : o[2] + size]
                gs, zs = gi[o[3] : o[3] + size], gz[o[4] : o[4] + size]
                _apply_backward(xs, ds, ys, gs, zs, k_dy, k_x, k_c, c, m, inner, flags)
            else:
                xs, ds = _strided(x, o[0], n, s[0]), _strided(dy, o[1], n, s[1])
                ys, gs = _strided(y, o[2], n, s[2]), _strided(gi, o[3], n, s[3])
                zs = _strided(gz, o[4], n, s[4])
                _apply_backward(xs, ds, ys, gs, zs, k_dy, k_x, k_c, c, 1, inner, flags)


@jit
def _forward_item(x, z, out, geometry, strides, mean, scale, shift, item, items, split, flags):
    """``_apply_forward`` over work item ``item``."""
    c0, c1, r0, r1 = item_bounds(item, split, geometry, items)
    n, inner = _run_length(geometry, c0, c1), geometry[3] != 0
    unit = _contiguous_runs(geometry, strides, 3)
    block = unit and _channel_runs_adjoin(geometry, strides, 3)
    sx, sz = _run_stride(geometry, strides, 0), _run_stride(geometry, strides, 1)
    so = _run_stride(geometry, strides, 2)
    cx, cz, co = strides[0, 0], strides[1, 0], strides[2, 0]
    for r in range(r0, r1):
        bx, bz, bo, _, _ = _row_bases(r, geometry, strides)
        for c in range(c0, c0 + 1 if inner or block else c1):
            ox, oz, oo = bx + c * cx, bz + c * cz, bo + c * co
            if unit:
                m = c1 - c0 if block else 1
                size = m * n
                xs, zs, ys = x[ox : ox + size], z[oz : oz + size], out[oo : oo + size]
                _apply_forward(xs, zs, ys, mean, scale, shift, c, m, inner, flags)
            else:
                xs, zs = _strided(x, ox, n, sx), _strided(z, oz, n, sz)
                ys = _strided(out, oo, n, so)
                _apply_forward(xs, zs, ys, mean, scale, shift, c, 1, inner, flags)


@numba.njit(**OPTIONS, parallel=prange_only())
def backward_elementwise(x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, flags, chunks):
    """Pass 2 of the backward: ``_backward_item`` over every work item."""
    items, split = work_items(geometry, chunks)
    if chunks == 1:
        for item in range(items):
            _backward_item(
                x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, item, items, split, flags
            )
    else:
        for item in prange(items):
            _backward_item(
                x, dy, y, gi, gz, geometry, strides, k_dy, k_x, k_c, item, items, split, flags
            )


@numba.njit(**OPTIONS, parallel=prange_only())
def forward_elementwise(x, z, out, geometry, strides, mean, scale, shift, flags, chunks):
    """Pass 2 of the forwards: ``_forward_item`` over every work item."""
    items, split = work_items(geometry, chunks)
    if chunks == 1:
        for item in range(items):
            _forward_item(
                x, z, out, geometry, strides, mean, scale, shift, item, items, split, flags
            )
    else:
        for item in prange(items):
            _forward_item(
                x, z, out, geometry, strides, mean, scale, shift, item, items, split, flags
            )


# --- the passes ----------------------------------------------------------------------------

TRAIN, SAVED, EVAL, SAVED_INVSTD = 0, 1, 2, 3  # problems.Mode


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
    chunks,
):
    """Batch-norm backward. Data tensors (x, dy, the fused forward's y, gi, gz) are walked
    with ``strides``' rows 0..4; ``channel_args`` holds (stride, dtype code) of weight,
    statistic 0, statistic 1, grad_weight, grad_bias. ``flags``: write gi, gw, gb; mask dy by
    ``y > 0``; write gz. ``grad_input = k_dy*dy + k_x*x + k_c`` per channel."""
    write_gi, write_gw, write_gb, masked, write_gz = flags
    x, dy, y = flat(x_at, spans[0], like), flat(dy_at, spans[1], like), flat(y_at, spans[2], like)
    gi, gz = flat(gi_at, spans[3], like), flat(gz_at, spans[4], like)
    channels, count = geometry[0], geometry[1] * geometry[2]
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    if mode == TRAIN:
        shift = first_values(x, geometry, strides)
        stat = shift
    else:
        shift = load_channels(m_at, channel_args[1, 0], channel_args[1, 1], channels)
        stat = load_channels(v_at, channel_args[2, 0], channel_args[2, 1], channels)
    sums = channel_sums(x, dy, y, geometry, strides, shift, (True, masked), chunks)
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
    if write_gi or write_gz:
        backward_elementwise(
            x,
            dy,
            y,
            gi,
            gz,
            geometry,
            strides,
            k_dy,
            k_x,
            k_c,
            (mode != EVAL, masked, write_gi, write_gz),
            chunks,
        )
    if write_gw:
        store_channels(gw, gw_at, channel_args[3, 0], channel_args[3, 1])
    if write_gb:
        store_channels(gb, gb_at, channel_args[4, 0], channel_args[4, 1])


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
    chunks,
):
    """Training forward: batch statistics, ``y``, saved mean and invstd, running update.
    Data tensors: x, z, y (``strides`` rows 0..2); ``channel_args``: weight, bias,
    saved_mean, saved_invstd, running_mean, running_var. ``flags``: add z, ReLU, update
    running_mean, update running_var."""
    add_z, relu, update_mean, update_var = flags
    x, z, y = flat(x_at, spans[0], like), flat(z_at, spans[1], like), flat(y_at, spans[2], like)
    channels, count = geometry[0], geometry[1] * geometry[2]
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    b = load_channels(b_at, channel_args[1, 0], channel_args[1, 1], channels)
    if update_mean:  # every per-channel input is read before anything is written
        old_mean = load_channels(rm_at, channel_args[4, 0], channel_args[4, 1], channels)
    if update_var:
        old_var = load_channels(rv_at, channel_args[5, 0], channel_args[5, 1], channels)
    shift = first_values(x, geometry, strides)
    sums = channel_sums(x, x, x, geometry, strides, shift, (False, False), chunks)
    mean, invstd, var = np.empty(channels), np.empty(channels), np.empty(channels)
    for c in range(channels):
        d = sums[0, c] / count
        mean[c] = shift[c] + d
        var[c] = sums[1, c] / count - d * d
        if var[c] < 0.0:
            var[c] = 0.0
        invstd[c] = 1.0 / np.sqrt(var[c] + eps)
    forward_elementwise(x, z, y, geometry, strides, mean, w * invstd, b, (add_z, relu), chunks)
    store_channels(mean, sm_at, channel_args[2, 0], channel_args[2, 1])
    store_channels(invstd, si_at, channel_args[3, 0], channel_args[3, 1])
    if update_mean:
        store_channels(
            (1.0 - momentum) * old_mean + momentum * mean,
            rm_at,
            channel_args[4, 0],
            channel_args[4, 1],
        )
    if update_var:
        unbiased = var * (count / (count - 1))
        store_channels(
            (1.0 - momentum) * old_var + momentum * unbiased,
            rv_at,
            channel_args[5, 0],
            channel_args[5, 1],
        )


@jit
def forward_inference(
    x_at, y_at, w_at, b_at, rm_at, rv_at, like, geometry, strides, spans, channel_args, eps, chunks
):
    """Inference forward with fixed statistics. Data tensors: x, y (``strides`` rows 0, 2);
    ``channel_args``: weight, bias, running_mean, running_var."""
    x, y = flat(x_at, spans[0], like), flat(y_at, spans[2], like)
    channels = geometry[0]
    w = load_channels(w_at, channel_args[0, 0], channel_args[0, 1], channels)
    b = load_channels(b_at, channel_args[1, 0], channel_args[1, 1], channels)
    mean = load_channels(rm_at, channel_args[2, 0], channel_args[2, 1], channels)
    var = load_channels(rv_at, channel_args[3, 0], channel_args[3, 1], channels)
    scale = w / np.sqrt(var + eps)
    forward_elementwise(x, x, y, geometry, strides, mean, scale, b, (False, False), chunks)
