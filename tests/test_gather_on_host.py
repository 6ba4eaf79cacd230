"""The batched backward's device gather (``backends/gather.py``), run on the host.

Its CUDA kernel is compiled by ``g++`` and run on host memory behind the stand-in CuPy
(``cupy_on_host.py``), its table written by the stand-in's ``cudaMemcpyAsync``: each
operand's bytes must land packed where its row says, in the widest word its layout allows,
nothing else written, as NumPy's own packed copy and the CPU engine's gather of the same
table (``cpu_kernels.gather``) lay them out. Then the whole device pass on host memory: the
NVIDIA backend's CuPy engine (``test_nvidia_routing_on_host.py``'s routing) on operands the
device gather folded, against PyTorch in float64 per problem, and bit for bit against the
same problems folded by the CPU engine's gather. What CUDA itself does with the kernel
(NVRTC, coalescing, a real stream) only the ``gpu`` tests show.
"""

import ctypes

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_close, reference

import cudnn_bn
from cudnn_bn import DataType, batch_norm_backward_batched
from cudnn_bn.api import batched_pass
from cudnn_bn.backends import cuda, nvidia
from cudnn_bn.backends import gather as gather_module
from cudnn_bn.backends.gather import DeviceGather, HostGather, table_row
from cudnn_bn.ops import descriptor as descriptor_module
from cudnn_bn.ops.descriptor import Launch
from cudnn_bn.tensor import TensorDesc

DTYPES = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(ml_dtypes.bfloat16): "BF16",
}
UNTOUCHED = 0xAB  # the workspace's bytes before a gather
HOST_STREAM_SCOPE = cuda.stream_scope  # the stub forbids CuPy; these tests run it on the host


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


# --- the device pass end to end, on host memory ----------------------------------------------


@pytest.fixture
def on_host(stub, host_cupy, monkeypatch):
    """Host arrays through the NVIDIA backend (the stub for cuDNN, the CuPy engine on the
    host) and through its plans' device gather (``DeviceGather`` for the CPU's own)."""
    monkeypatch.setattr(descriptor_module, "backend_class", lambda _, op: getattr(nvidia, op))
    monkeypatch.setattr(cuda, "stream_scope", HOST_STREAM_SCOPE)

    def run(*args, gather=DeviceGather, **kwargs):
        cudnn_bn.descriptor_cache.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(batched_pass, "HostGather", gather)
            got = batch_norm_backward_batched(*args, **kwargs)
        engines = {d.engine for d in cudnn_bn.descriptor_cache.descriptors()}
        cudnn_bn.descriptor_cache.clear()
        return got, engines

    return run


CASES_E2E = [  # (B, N, C, ...), data dtype, mode, layouts of input / grad_output / weight
    ((3, 5, 4), np.float32, "train", ("packed", "reversed", "shared")),
    ((2, 4, 3, 5), np.float32, "eval", ("reversed", "packed", "shared")),
    ((2, 3, 4, 2, 3), ml_dtypes.bfloat16, "train", ("channels_last", "packed", "across")),
    ((2, 6, 3), np.float64, "saved", ("packed", "padded", "none")),
]


@pytest.mark.parametrize(("shape", "dtype", "mode", "layouts"), CASES_E2E, ids=str)
def test_the_device_pass_on_host_memory_against_torch(host_cupy, on_host, shape, dtype, mode,
                                                      layouts):  # fmt: skip
    """Each problem's gradients are PyTorch's in float64 (the CuPy engine computes them for
    real: eval mode, BF16 and 2-D problems are its), and bit for bit those of the CPU
    engine's gather of the same batch; the fold is one launch of the device gather."""
    b, c = shape[0], shape[2]
    tolerance = torch.bfloat16 if dtype is ml_dtypes.bfloat16 else dtype  # helpers.TOL's
    x = laid_out(shape, dtype, layouts[0], seed=1)
    dy = laid_out(shape, dtype, layouts[1], seed=2)
    rng = np.random.default_rng(3)
    if layouts[2] == "none":
        w = None
    elif layouts[2] == "across":  # (B, C) rows read across a (C, B) array: strides (1, B)
        w = rng.uniform(0.5, 1.5, (c, b)).astype(dtype).T
    else:
        w = rng.uniform(0.5, 1.5, c).astype(dtype)
    mean = (rng.standard_normal((b, c)) * 0.3).astype(dtype)
    var = rng.uniform(0.5, 2.0, (b, c)).astype(dtype)
    running, kwargs = (None, None), {}
    if mode == "eval":
        running = (mean, var)
    elif mode == "saved":
        invstd = (1 / np.sqrt(var.astype(np.float64) + 1e-5)).astype(dtype)
        kwargs = {"saved_mean": mean, "saved_invstd": invstd}
    launches = len(host_cupy.launches)
    got, engines = on_host(x, dy, w, *running, mode=mode, **kwargs)
    assert engines == {"cupy"}
    kernels = [k for k, *_ in host_cupy.launches[launches:]]
    assert len([k for k in kernels if k.startswith("cudnn_bn_gather")]) == 1
    assert [g is None for g in got] == [False, w is None, False]
    for i in range(b):
        w_i = np.ones(c) if w is None else w if w.ndim == 1 else w[i]
        options = {"eval": {"mean": mean[i], "var": var[i]}, "train": {}}.get(
            mode, {"mean": mean[i], "invstd": kwargs.get("saved_invstd", var)[i]}
        )
        want = reference(x[i], dy[i], w_i, mode=mode, **options)
        for actual, expected in zip(got, want, strict=True):
            if actual is not None:
                assert_close(actual[i], expected, tolerance)
    by_cpu_gather, _ = on_host(x, dy, w, *running, mode=mode, gather=HostGather, **kwargs)
    for actual, expected in zip(got, by_cpu_gather, strict=True):
        if actual is not None:
            np.testing.assert_array_equal(actual, expected)


def test_problems_with_no_values_launch_no_gather(host_cupy, on_host):
    """N = 0: zero grad_weight and grad_bias, an empty grad_input, and no kernel at all."""
    x = np.zeros((2, 0, 3, 4), np.float32)
    launches = len(host_cupy.launches)
    (gi, gw, gb), _ = on_host(x, x, np.ones(3, np.float32), None, None)
    assert host_cupy.launches[launches:] == []
    assert gi.shape == (2, 0, 3, 4) and gw.shape == gb.shape == (2, 3)
    assert not gw.any() and not gb.any()
