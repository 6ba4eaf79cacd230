"""The CuPy engine's per-channel sums: two-stage reductions whose grid follows the data.

Stage 1 (``cudnn_bn_sums_*``) runs a grid of (channel tiles, chunks of the reduced extent):
each block reads its chunk of ``x`` (and ``dy``, ``y``) once, accumulates every sum the pass
needs in double, reduces them across its threads in shared memory, and writes one partial
per sum to the caller's workspace. Stage 2 (``..._finish``) adds a channel's partials in a
fixed order and writes the per-channel results. The chunk count grows with the reduced size
(``plan``), so parallelism does not come from the channel count alone: a thread adds at most
``MIN_RUN`` values in a row until the grid reaches ``MAX_BLOCKS`` blocks.

The sums are taken about a per-channel shift ``K``: the channel's first value when the mean
is being computed, else the given mean. With ``v = x - K`` and ``g`` the gradient as the
batch norm sees it, one read gives ``sum(v)``, ``sum(v^2)``, ``sum(g)`` and ``sum(g*v)``,
hence the mean ``K + sum(v)/n``, the biased variance ``sum(v^2)/n - (sum(v)/n)^2`` (no
cancellation to speak of: ``K`` is a sample, within a few deviations of the mean) and
``sum(g*(x - mean)) = sum(g*v) - (sum(v)/n)*sum(g)``. Data is read as stored (F16 and BF16
as bits), so the kernels need no header.
"""

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..enums import DataType
from ..tensor import TensorDesc
from .cupy_kernels import PREAMBLE, relu_masked

THREADS = 256  # per block; a power of two (the shared-memory tree halves it)
MIN_RUN = 16  # values a thread adds serially before the grid grows another chunk
MAX_BLOCKS = 4096  # blocks of stage 1; beyond it, each thread's run grows instead
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
TILE = 32  # channels per block when channels are adjacent in memory (one warp's width)

# Per-value terms: v = x - K, g = the gradient through the fused ReLU's mask (if any).
SUMS = {"x": "v", "x2": "v * v", "dy": "g", "dy_x": "g * v"}
KINDS = {
    "statistics": ("x", "x2"),  # mean and biased variance (training forward)
    "gradients": ("dy", "dy_x"),  # sum(g) and sum(g*(x - mean)) about a given mean
    "both": ("x", "x2", "dy", "dy_x"),  # all four: training-mode backward
}
STORAGE = {DataType.F16: "unsigned short", DataType.BF16: "unsigned short"}


@dataclass(frozen=True)
class SumsPlan:
    """How one problem's per-channel sums are launched.

    The reduced axes (all but 1) are merged where every operand allows (NHWC: one axis of
    stride C); ``extents`` are what remains, outermost first, and ``strides[k]`` operand
    ``k``'s element strides along them (operands: x, dy, y). Stage 1 runs ``grid`` blocks of
    ``block`` threads: ``block[0]`` adjacent channels (1 unless channels are adjacent in
    memory), ``block[1]`` threads along a chunk of ``chunk`` reduced values.
    """

    channels: int
    count: int
    extents: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    channel_strides: tuple[int, ...]
    block: tuple[int, int]
    grid: tuple[int, int]
    chunk: int
    wide: bool

    def partials(self, kind: str) -> int:
        """Doubles of workspace stage 1 writes for ``kind``."""
        return len(KINDS[kind]) * self.grid[1] * self.channels


def _merged(descs: list[TensorDesc]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Reduced extents and per-operand strides, outermost first: size-1 axes dropped, and an
    axis merged into the one before it where every operand allows (outer stride == inner
    stride * inner extent)."""
    extents: list[int] = []
    strides: list[list[int]] = [[] for _ in descs]
    for axis in (0, *range(2, descs[0].ndim)):
        n = descs[0].shape[axis]
        if n == 1:
            continue
        inner = [d.strides[axis] for d in descs]
        if extents and all(s[-1] == i * n for s, i in zip(strides, inner, strict=True)):
            extents[-1] *= n
            for s, i in zip(strides, inner, strict=True):
                s[-1] = i
            continue
        extents.append(n)
        for s, i in zip(strides, inner, strict=True):
            s.append(i)
    if not extents:
        return (1,), tuple((0,) for _ in descs)
    return tuple(extents), tuple(tuple(s) for s in strides)


def plan(descs: list[TensorDesc]) -> SumsPlan:
    """The launch of the per-channel sums over ``descs`` (x, then dy and y where read; the
    plan always carries three operands, x's strides standing in for absent ones)."""
    descs = (list(descs) + [descs[0]] * 3)[:3]
    x = descs[0]
    channels, count = x.shape[1], x.numel // x.shape[1]
    extents, strides = _merged(descs)
    adjacent = x.strides[1] == 1 and channels > 1
    width = min(TILE, 1 << (channels - 1).bit_length()) if adjacent else 1
    tiles = -(-channels // width)
    threads = THREADS // width
    limit = max(1, min(MAX_GRID_Y, MAX_BLOCKS // tiles))
    chunks = max(1, min(limit, -(-count // (threads * MIN_RUN))))
    chunk = -(-count // chunks)
    chunks = -(-count // chunk)
    reach = max(
        sum((n - 1) * s for n, s in zip(extents, st, strict=True)) + (channels - 1) * d.strides[1]
        for d, st in zip(descs, strides, strict=True)
    )
    return SumsPlan(
        channels=channels,
        count=count,
        extents=extents,
        strides=strides,
        channel_strides=tuple(d.strides[1] for d in descs),
        block=(width, threads),
        grid=(tiles, chunks),
        chunk=chunk,
        wide=max(reach, count + chunk, channels + TILE) >= 2**31,
    )


def _load(expr: str, dtype: DataType) -> str:
    """``expr`` (stored as ``dtype``, F16/BF16 as bits) as a double."""
    if dtype in STORAGE:
        return f"((double){dtype.name.lower()}_load({expr}))"
    return f"((double)({expr}))"


def _storage(dtype: DataType) -> str:
    """The C type a kernel reads ``dtype`` data as."""
    return STORAGE.get(dtype, "double" if dtype == DataType.F64 else "float")


def _sums_source(
    name: str, x_dtype: DataType, acc: str, fused: bool, kind: str, axes: int, wide: bool
) -> str:
    """Stage 1 for ``kind``: ``axes`` merged reduced axes, 64-bit indices if ``wide``."""
    xt, sums = _storage(x_dtype), KINDS[kind]
    operands = ("x", "dy", "y")
    params = [
        *(f"const {xt} *__restrict__ {o}" for o in operands),
        f"const {acc} *__restrict__ mean",
        "double *__restrict__ partials",
        "long long channels, long long count, long long chunk",
        *(f"long long c{o}" for o in operands),
        *(f"long long e{a}" for a in range(axes)),
        *(f"long long s{o}{a}" for o in operands for a in range(axes)),
    ]
    offsets = ["I rem = j, ox = c * (I)cx, ody = c * (I)cdy, oy = c * (I)cy;"]
    for a in range(axes - 1, 0, -1):
        offsets += [
            f"{{ const I q = rem / (I)e{a}, i = rem - q * (I)e{a}; rem = q;",
            *(f"  o{o} += i * (I)s{o}{a};" for o in operands),
            "}",
        ]
    offsets += [f"o{o} += rem * (I)s{o}0;" for o in operands]
    gradient = any(s.startswith("dy") for s in sums)
    dy = _load("dy[ody]", x_dtype)
    if fused:
        dy = relu_masked(dy, _load("y[oy]", x_dtype), "double")
    shift = "(double)mean[c]" if kind == "gradients" else _load("x[c * (I)cx]", x_dtype)
    lines = [
        PREAMBLE,
        f'extern "C" __global__ void {name}({", ".join(params)}) {{',
        f"typedef {'unsigned long long' if wide else 'unsigned int'} I;",
        "const I c = (I)blockIdx.x * blockDim.x + threadIdx.x;",
        "const bool live = c < (I)channels;",
        "const I begin = (I)blockIdx.y * (I)chunk;",
        "const I end = begin + (I)chunk < (I)count ? begin + (I)chunk : (I)count;",
        f"const double shift = live ? {shift} : 0.0;",
        *(f"double s{k} = 0.0;" for k in range(len(sums))),
        "if (live) {",
        "for (I j = begin + threadIdx.y; j < end; j += blockDim.y) {",
        *offsets,
        f"const double v = {_load('x[ox]', x_dtype)} - shift;",
        *([f"const double g = {dy};"] if gradient else []),
        *(f"s{k} += {SUMS[s]};" for k, s in enumerate(sums)),
        "}}",
        f"__shared__ double shared[{len(sums)}][{THREADS}];",
        "const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;",
        *(f"shared[{k}][t] = s{k};" for k in range(len(sums))),
        "__syncthreads();",
        "for (unsigned half = blockDim.y / 2; half > 0; half >>= 1) {",
        "if (threadIdx.y < half) {",
        *(f"shared[{k}][t] += shared[{k}][t + half * blockDim.x];" for k in range(len(sums))),
        "}",
        "__syncthreads();",
        "}",
        "if (threadIdx.y == 0 && live) {",
        *(
            f"partials[({k}ull * gridDim.y + blockIdx.y) * (unsigned long long)channels + c]"
            f" = shared[{k}][threadIdx.x];"
            for k in range(len(sums))
        ),
        "}",
        "}",
    ]
    return "\n".join(lines)


# What stage 2 writes per channel, from the sums ``s[name]``, ``d = s["x"] / n`` and ``K``.
RESULTS = {
    "statistics": {"mean": "shift + d", "var": "relu(s_x2 / count - d * d)"},
    "gradients": {"sum_dy": "s_dy", "sum_dy_dev": "s_dy_x"},
    "both": {
        "mean": "shift + d",
        "var": "relu(s_x2 / count - d * d)",
        "sum_dy": "s_dy",
        "sum_dy_dev": "s_dy_x - d * s_dy",
    },
}


def _finish_source(name: str, x_dtype: DataType, acc: str, kind: str) -> str:
    """Stage 2 for ``kind``: one thread per channel, ``RESULTS[kind]`` out."""
    xt, sums, results = _storage(x_dtype), KINDS[kind], RESULTS[kind]
    params = [
        "const double *__restrict__ partials",
        f"const {xt} *__restrict__ x",
        f"const {acc} *__restrict__ mean",
        "long long channels, long long chunks, long long cx, double count",
        *(f"{acc} *__restrict__ out_{r}" for r in results),
    ]
    shift = "(double)mean[c]" if kind == "gradients" else _load("x[c * cx]", x_dtype)
    lines = [
        PREAMBLE,
        f'extern "C" __global__ void {name}({", ".join(params)}) {{',
        "const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "if (c < channels) {",
        *(f"double s_{n} = 0.0;" for n in sums),
        "for (long long k = 0; k < chunks; ++k) {",
        *(f"s_{n} += partials[({i} * chunks + k) * channels + c];" for i, n in enumerate(sums)),
        "}",
        f"const double shift = {shift};",
        f"const double d = {'s_x / count' if 'x' in sums else '0.0'};",
        *(f"out_{r}[c] = ({acc})({value});" for r, value in results.items()),
        "}",
        "}",
    ]
    return "\n".join(lines)


@functools.cache
def _kernels(x_dtype: DataType, acc: str, fused: bool, kind: str, axes: int, wide: bool) -> Any:
    import cupy

    tag = f"{kind}_{x_dtype.name}_{acc}_{int(fused)}_{axes}_{int(wide)}"
    stage1, stage2 = f"cudnn_bn_sums_{tag}", f"cudnn_bn_sums_{tag}_finish"
    return (
        cupy.RawKernel(_sums_source(stage1, x_dtype, acc, fused, kind, axes, wide), stage1),
        cupy.RawKernel(_finish_source(stage2, x_dtype, acc, kind), stage2),
    )


def channel_sums(
    plan: SumsPlan,
    kind: str,
    x_dtype: DataType,
    fused: bool,
    data: tuple[Any, Any, Any],
    mean: Any,
    partials: Any,
    outputs: tuple[Any, ...],
) -> None:
    """Per-channel results of ``kind`` into ``outputs`` (``RESULTS[kind]``'s order, each a
    ``(C,)`` array of the compute type): two launches, no allocation.

    ``data`` is ``(x, dy, y)`` (any present array where one is not read), ``mean`` the given
    per-channel mean for ``"gradients"`` (else ignored), ``partials`` the workspace slice of
    ``plan.partials(kind)`` doubles.
    """
    acc = "double" if x_dtype == DataType.F64 else "float"
    mean = mean if kind == "gradients" else partials  # read only for "gradients"
    stage1, stage2 = _kernels(x_dtype, acc, fused, kind, len(plan.extents), plan.wide)
    ints = [
        plan.channels,
        plan.count,
        plan.chunk,
        *plan.channel_strides,
        *plan.extents,
        *(s for strides in plan.strides for s in strides),
    ]
    stage1(plan.grid, plan.block, (*data, mean, partials, *map(np.int64, ints)))
    channels = np.int64(plan.channels)
    scalars = (channels, np.int64(plan.grid[1]), np.int64(plan.channel_strides[0]))
    stage2(
        (-(-plan.channels // THREADS),),
        (THREADS,),
        (partials, data[0], mean, *scalars, np.float64(plan.count), *outputs),
    )
