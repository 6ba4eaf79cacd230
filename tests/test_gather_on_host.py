"""The batched backward's device gather (``backends/gather.py``), run on the host.

Its CUDA kernel is compiled by ``g++`` and run on host memory behind the stand-in CuPy
(``cupy_on_host.py``), its table written by the stand-in's ``cudaMemcpyAsync``: each
operand's bytes must land packed where its row says, in the widest word its layout allows,
nothing else written, as NumPy's own packed copy and the CPU engine's gather of the same
table (``cpu_kernels.gather``) lay them out. What CUDA itself does with the kernel (NVRTC,
coalescing, a real stream) only the ``gpu`` tests show.
"""

import ctypes

import ml_dtypes
import numpy as np
import pytest

from cudnn_bn import DataType
from cudnn_bn.backends import gather as gather_module
from cudnn_bn.backends.gather import DeviceGather, HostGather, table_row
from cudnn_bn.ops.descriptor import Launch
from cudnn_bn.tensor import TensorDesc

DTYPES = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.bfloat16): "BF16",
}
UNTOUCHED = 0xAB  # the workspace's bytes before a gather


def desc_of(array: np.ndarray) -> TensorDesc:
    item = array.dtype.itemsize
    strides = tuple(s // item for s in array.strides)
    return TensorDesc(DataType[DTYPES[array.dtype]], array.shape, strides)


def laid_out(shape, dtype, layout: str, seed: int) -> np.ndarray:
    """Values of ``shape`` in ``layout``: packed, reversed (negative strides), padded (a
    strided view of a larger array), channels-last (axis 2 innermost) or shared (a ``(C,)``
    row seen as ``(B, C)``, stride 0)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(dtype)
    if layout == "reversed":
        return np.ascontiguousarray(values[::-1, :, ::-1])[::-1, :, ::-1]
    if layout == "padded":
        big = np.zeros((*shape[:-1], shape[-1] * 3), dtype)
        big[..., ::3] = values
        return big[..., ::3]
    if layout == "channels_last":
        order = (0, 1, *range(3, len(shape)), 2)
        return np.ascontiguousarray(values.transpose(order)).transpose(np.argsort(order))
    if layout == "shared":
        return np.broadcast_to(values[0], shape)
    return values


# (shape, layout, order the destination is packed in, bytes per word of the device's rows)
CASES = [
    ((3, 4, 5, 6), "packed", (1, 0, 2, 3), {"F16": 2, "F32": 4, "F64": 8, "BF16": 2}),
    ((3, 4, 5, 6), "reversed", (1, 0, 2, 3), {"F16": 2, "F32": 4, "F64": 8, "BF16": 2}),
    ((2, 3, 4, 5), "padded", (1, 0, 2, 3), {"F16": 2, "F32": 4, "F64": 8, "BF16": 2}),
    ((2, 3, 4, 2, 3), "channels_last", (1, 0, 2, 3, 4), {"F16": 2, "F32": 4, "F64": 8}),
    ((5, 7), "shared", (0, 1), {"F16": 2, "F32": 4, "F64": 8, "BF16": 2}),
]


@pytest.mark.parametrize("index", ["int", "long long"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_the_device_kernel_packs_each_row_as_numpy_and_the_cpu_gather_do(
    host_cupy, dtype, index, monkeypatch
):
    """One table over every layout at once (one launch, five rows): each destination holds
    its source packed in its row's order, nothing around it is written; in 32-bit index
    arithmetic, and in 64-bit (taken from 2**31 words or offsets on: here from any)."""
    if index == "long long":
        monkeypatch.setattr(gather_module, "_INT_LIMIT", 1)
    sources = {
        f"{layout}{k}": (laid_out(shape, dtype, layout, seed=k), order, words)
        for k, (shape, layout, order, words) in enumerate(CASES)
        if DTYPES[dtype] in words
    }
    rows = {n: table_row(desc_of(a), order) for n, (a, order, _) in sources.items()}
    itemsizes = dict.fromkeys(rows, dtype.itemsize)
    device = DeviceGather(rows, itemsizes, 0, True)
    assert [int(w) for w in device.table[1:].reshape(len(rows), -1)[:, 2]] == [
        words[DTYPES[dtype]] for _, _, words in sources.values()
    ]
    workspace = np.full(device.front + 256, UNTOUCHED, np.uint8)
    base = workspace.ctypes.data
    device.prepare(base, 0)
    landed: dict[str, dict[str, np.ndarray]] = {}

    def inner(engine: str):
        def call(values: tuple, scratch: int, stream: int) -> None:
            landed[engine] = {
                n: packed_at(p, sources[n][0], sources[n][1])
                for n, p in zip(rows, values, strict=True)
            }
            assert engine == "cpu" or scratch == base + device.front

        return Launch(tuple(rows), call)

    taken = list(enumerate(rows))
    pointers = tuple(a.ctypes.data for a, _, _ in sources.values())
    device.wrap(inner("device"), taken, current=False).call(pointers, base, 0)
    HostGather(rows, itemsizes, 0, True).wrap(inner("cpu"), taken, current=False).call(
        pointers, 0, 0
    )
    wide = "_wide" if index == "long long" else ""
    assert [n for n, *_ in host_cupy.launches[-1:]] == [f"cudnn_bn_gather_{len(rows)}{wide}"]
    for name, (array, order, _) in sources.items():
        want = np.ascontiguousarray(array.transpose(order))
        np.testing.assert_array_equal(landed["device"][name].view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(landed["cpu"][name], landed["device"][name])
    written = np.zeros(workspace.size, bool)
    written[: 8 * device.table.size] = True
    for name, offset in device.offsets.items():
        written[offset : offset + sources[name][0].nbytes] = True
    assert (workspace[~written] == UNTOUCHED).all(), "bytes outside the destinations"


def packed_at(ptr: int, like: np.ndarray, order: tuple) -> np.ndarray:
    """A copy of the packed array of ``like``'s dtype, shaped as ``like`` in ``order``, at
    host address ``ptr``."""
    shape = tuple(like.shape[a] for a in order)
    size = int(np.prod(shape)) * like.dtype.itemsize
    buffer = (ctypes.c_char * size).from_address(ptr)
    return np.frombuffer(buffer, like.dtype).reshape(shape).copy()


def test_64_bit_indexing_from_2_to_the_31_words_or_offsets():
    """The kernel indexes in ``int`` only where every index, offset and grid step fits."""
    big = TensorDesc(DataType.F32, (4, 1 << 29, 1), (1 << 29, 1, 1))  # 2**31 words
    small = TensorDesc(DataType.F32, (2, 3, 4), (12, 4, 1))
    far = TensorDesc(DataType.F32, (2, 3, 4), (1 << 31, 4, 1))  # an offset of 2**31
    wide = {
        name: DeviceGather({name: table_row(d, (1, 0, 2))}, {name: 4}, 0, True).wide
        for name, d in (("big", big), ("small", small), ("far", far))
    }
    assert wide == {"big": True, "small": False, "far": True}


def test_a_problem_with_no_values_launches_nothing(host_cupy):
    """N = 0 (``copies`` False): the folded problem reads none of its operands."""
    x = np.zeros((2, 0, 3, 4), np.float32)
    rows = {"input": table_row(desc_of(x), (1, 0, 2, 3))}
    device = DeviceGather(rows, {"input": 4}, 0, False)
    launches = len(host_cupy.launches)
    seen = []
    launch = Launch(("input",), lambda values, scratch, stream: seen.append(values))
    device.wrap(launch, [(0, "input")], current=True).call((x.ctypes.data,), 4096, 0)
    assert len(host_cupy.launches) == launches and seen == [(4096 + device.offsets["input"],)]
