"""Copying strided operands into packed scratch by one table: the batched backward's fold.

A table has one row per operand: where it is read, where it goes, then ``GATHER_DIMS`` sizes
and as many strides of the source, in the order the destination is packed in (padded in
front with size 1), in 2-byte units (an element's units its innermost axis), each axis that
continues the next one merged into it (``table_row``). A stride may be 0 (a row repeated) or
negative. Two engines run a table (``wrap``: a launch that gathers, then runs the launch it
wraps on the gathered operands):

- ``HostGather``: the CPU engine's compiled ``cpu_kernels.gather``, into scratch of each
  call's own (so that calls from many threads run at once);
- ``DeviceGather``: one CUDA kernel launch for every row, on the call's stream, into the
  front of the plan's workspace for that stream, where its table was written once, when that
  workspace was made (``prepare``): a repeated call, or a CUDA graph captured after one call
  on its stream, allocates and uploads nothing.
"""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..enums import Status
from ..errors import InfiniError
from ..ops.descriptor import Launch
from ..tensor import ITEMSIZE, TensorDesc
from . import cuda
from .device_arrays import ALIGNMENT

GATHER_DIMS = 7  # a batch of problems' axes, (B, N, C, D, H, W), then an element's 2-byte units
_ALIGN = 64  # bytes: where each operand gathered on the host starts in its scratch


def table_row(desc: TensorDesc, order: tuple[int, ...]) -> np.ndarray:
    """The table row (addresses 0) that gathers ``desc`` packed in the axis order ``order``."""
    units = ITEMSIZE[desc.dtype] // 2  # the gather copies 2-byte units
    shape = [*(desc.shape[a] for a in order), units]
    shape, strides = _merged(shape, [*(desc.strides[a] * units for a in order), 1])
    pad = GATHER_DIMS - len(shape)
    return np.array([0, 0, *(1,) * pad, *shape, *(0,) * pad, *strides], dtype=np.int64)


def _merged(shape: list[int], strides: list[int]) -> tuple[list[int], list[int]]:
    """Axes of a gather (outermost first, packed in this order at the destination) with
    each one that continues the next in the source merged into it: longer runs to copy."""
    merged_shape, merged_strides = shape[-1:], strides[-1:]
    for size, stride in zip(shape[-2::-1], strides[-2::-1], strict=True):
        if stride == merged_strides[0] * merged_shape[0]:
            merged_shape[0] *= size
        else:
            merged_shape.insert(0, size)
            merged_strides.insert(0, stride)
    return merged_shape, merged_strides


def _bytes(entry: np.ndarray) -> int:
    """Bytes of the packed destination of a table row."""
    return 2 * int(np.prod(entry[2 : 2 + GATHER_DIMS]))


# A wrapped launch's operands: (index in the launch's fields, operand name) of each gathered.
Taken = list[tuple[int, str]]


class HostGather:
    """A table run by the CPU engine (``cpu_kernels.gather``) into new scratch per call:
    ``rows`` by operand name; ``copies`` False (a problem with no values): scratch is
    handed over unwritten (``DeviceGather`` takes the same arguments)."""

    front = 0  # bytes of the plan's workspace it takes: none
    prepare = None  # nothing to write into a workspace

    def __init__(
        self, rows: dict[str, np.ndarray], itemsizes: dict[str, int], device_id: int, copies: bool
    ) -> None:
        self.rows, self.copies = rows, copies

    def wrap(self, launch: Launch, taken: Taken, current: bool) -> Launch:
        """``launch`` on the operands ``taken`` gathered first."""
        from . import cpu_kernels  # here: importing the package imports no numba

        if not taken:
            return launch
        template = np.array([self.rows[n] for _, n in taken], dtype=np.int64)
        places, nbytes = [], 0  # (row, field, its offset in the scratch)
        for at, (i, _) in enumerate(taken):
            places.append((at, i, nbytes))
            nbytes += -(-_bytes(template[at]) // _ALIGN) * _ALIGN
        gather = cpu_kernels.gather if self.copies else lambda table: None

        def call(values: tuple, workspace: int, stream: int) -> None:
            scratch = np.empty(nbytes, np.uint8)
            base, table, moved = scratch.ctypes.data, template.copy(), list(values)
            for at, i, offset in places:
                table[at, 0], table[at, 1] = values[i], base + offset
                moved[i] = base + offset
            gather(table)
            launch.run(tuple(moved), workspace, stream)

        return Launch(launch.fields, call)


# The device's table: a header (the words to copy in all), then per row its operand's slot
# among the kernel's pointers, its destination's offset in the workspace, the bytes of a
# word, its count of words, then sizes and strides in words.
_HEADER, _ROW = 1, 4 + 2 * GATHER_DIMS
_THREADS, _MAX_BLOCKS = 256, 4096
_INT_LIMIT = 1 << 31


def _source(name: str, count: int, index: str) -> str:
    """The CUDA kernel that runs a device table of rows over ``count`` operand pointers:
    each thread copies words of the rows laid end to end (a grid-stride loop), finding its
    row and then its source offset from the sizes, innermost first, stopping once the index
    left is 0; negative offsets are strides < 0. Index arithmetic in ``index`` (``int``
    where every index and offset fits: 32-bit division, as CuPy's own copies use)."""
    pointers = ", ".join(f"long long p{k}" for k in range(count))
    return rf"""
extern "C" __global__ void {name}(char *workspace, {pointers}) {{
    const long long sources[{count}] = {{{", ".join(f"p{k}" for k in range(count))}}};
    const long long *table = (const long long *)workspace;
    const {index} total = ({index})table[0], step = ({index})(gridDim.x * blockDim.x);
    for ({index} i = ({index})(blockIdx.x * blockDim.x + threadIdx.x); i < total; i += step) {{
        const long long *row = table + {_HEADER};
        {index} at = i;
        while (at >= ({index})row[3]) {{
            at -= ({index})row[3];
            row += {_ROW};
        }}
        const {index} word = at;
        {index} offset = 0;
        for (int d = {GATHER_DIMS - 1}; d >= 0 && at; --d) {{
            const {index} size = ({index})row[4 + d];
            offset += at % size * ({index})row[{4 + GATHER_DIMS} + d];
            at /= size;
        }}
        const char *src = (const char *)sources[row[0]];
        char *dst = workspace + row[1];
        if (row[2] == 8) {{
            ((unsigned long long *)dst)[word] = ((const unsigned long long *)src)[offset];
        }} else if (row[2] == 4) {{
            ((unsigned int *)dst)[word] = ((const unsigned int *)src)[offset];
        }} else {{
            ((unsigned short *)dst)[word] = ((const unsigned short *)src)[offset];
        }}
    }}
}}
"""


@functools.cache
def _kernel(cupy: Any, count: int, wide: bool) -> Any:
    """The gather kernel over ``count`` pointers, in 64-bit index arithmetic where ``wide``,
    made by ``cupy`` (CuPy, or a stand-in)."""
    name = f"cudnn_bn_gather_{count}{'_wide' if wide else ''}"
    return cupy.RawKernel(_source(name, count, "long long" if wide else "int"), name)


def _words(entry: np.ndarray, itemsize: int) -> tuple[int, list[int], list[int]]:
    """``(bytes per word, sizes, strides)`` of a row in the widest word (2, 4 or 8 bytes,
    at most an element: operands are aligned to their item size) that the innermost run
    (stride 1: an element's units, or a run of them) and every other stride divide."""
    shape = [int(n) for n in entry[2 : 2 + GATHER_DIMS]]
    strides = [int(s) for s in entry[2 + GATHER_DIMS : 1 + 2 * GATHER_DIMS]]
    units = next(
        u
        for u in (4, 2, 1)
        if 2 * u <= itemsize and shape[-1] % u == 0 and all(s % u == 0 for s in strides)
    )
    return 2 * units, [*shape[:-1], shape[-1] // units], [*(s // units for s in strides), 1]


class DeviceGather:
    """A table run by one CUDA kernel launch on the call's stream (the module docstring):
    ``rows`` by operand name (their order is the kernel's pointers'), each operand's
    ``itemsize``; ``copies`` False (a problem with no values): nothing is launched."""

    def __init__(
        self,
        rows: dict[str, np.ndarray],
        itemsizes: dict[str, int],
        device_id: int,
        copies: bool,
    ) -> None:
        self.rows, self.names, self.device_id, self.copies = rows, list(rows), device_id, copies
        self.offsets: dict[str, int] = {}
        offset = _aligned(8 * (_HEADER + _ROW * len(rows)))  # the table, then the operands
        table, total, reach = [], 0, 0
        for slot, (name, entry) in enumerate(rows.items()):
            word, shape, strides = _words(entry, itemsizes[name])
            count = int(np.prod(shape))
            table += [slot, offset, word, count, *shape, *strides]
            self.offsets[name] = offset
            offset = _aligned(offset + _bytes(entry))
            total += count
            reach = max(reach, sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True)))
        self.table = np.array([total, *table], dtype=np.int64)
        self.front = offset if rows else 0  # bytes of the plan's workspace it takes
        self.blocks = max(1, min(-(-total // _THREADS), _MAX_BLOCKS))
        # an int holds every index, source offset and grid-stride step (the grid's threads)
        self.wide = max(total + _THREADS * _MAX_BLOCKS, reach) >= _INT_LIMIT

    def prepare(self, workspace: int, stream: int) -> None:
        """Write the table into a new ``workspace`` of ``stream`` (a plan's ``Workspaces``
        calls it once per workspace): refused on a stream capturing a CUDA graph, which
        cannot take a copy from host memory."""
        if not (self.names and self.copies):
            return
        if cuda.capturing(stream, self.device_id):
            raise InfiniError(
                Status.BAD_PARAM,
                "this batched problem's first call on this stream writes its gather table "
                "into the stream's workspace, which a stream capturing a CUDA graph cannot "
                "do: make one call of the problem on this stream before the capture",
            )
        cuda.copy_to_device(workspace, self.table, stream, self.device_id)

    def wrap(self, launch: Launch, taken: Taken, current: bool) -> Launch:
        """``launch`` on the operands ``taken`` gathered first, its workspace after the
        gather's ``front`` (``current``: the caller launches with the device current)."""
        if not self.names:
            return launch
        kernel = _kernel(cuda.cupy_module(), len(self.names), self.wide)
        fields = {n: i for i, n in taken}
        slots = [fields[n] for n in self.names]  # each pointer's index in the values
        moves = [(fields[n], self.offsets[n]) for n in self.names]
        copy = _gathering(kernel, self.blocks, slots, self.device_id) if self.copies else None
        if copy is not None and not current:
            copy = _on_device(copy, self.device_id)
        front = self.front

        def call(values: tuple, workspace: int, stream: int) -> None:
            if copy is not None:
                copy(values, workspace, stream)
            moved = list(values)
            for i, offset in moves:
                moved[i] = workspace + offset
            launch.run(tuple(moved), workspace + front, stream)

        return Launch(launch.fields, call)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


_SIGNED = 1 << 63  # CuPy passes an int argument as an int64: an address at or above wraps


def _gathering(
    kernel: Any, blocks: int, slots: list[int], device_id: int
) -> Callable[[tuple, int, int], None]:
    """One launch of ``kernel`` on a call's workspace and the pointers at ``slots`` of its
    values, on its stream (the device current)."""
    grid, block = (blocks,), (_THREADS,)

    def copy(values: tuple, workspace: int, stream: int) -> None:
        pointers = [values[i] for i in slots]
        if max(pointers) >= _SIGNED:  # as the int64 CuPy makes of it, the same bits
            pointers = [p - 2 * _SIGNED if p >= _SIGNED else p for p in pointers]
        kernel(grid, block, (workspace, *pointers), stream=cuda.cupy_stream(stream, device_id))

    return copy


def _on_device(copy: Callable, device_id: int) -> Callable[[tuple, int, int], None]:
    """``copy`` with ``device_id`` made current around it."""

    def on_device(values: tuple, workspace: int, stream: int) -> None:
        with cuda.on_device(device_id):
            copy(values, workspace, stream)

    return on_device
