"""CUDA graph capture of every operator's ``compute``, on both engines of the NVIDIA backend.

``cudnn_bn/backends/nvidia.py``: no engine "allocates nor synchronizes in ``run``", so a
compute can be captured in a CUDA graph. Each test builds a descriptor for CuPy buffers it
allocates up front (outputs, workspace, reserve), runs ``compute`` once eagerly on a
non-default, non-blocking CuPy stream, captures the same call (``stream.begin_capture()`` ...
``end_capture()``), zeroes the outputs and replays the graph. An engine that cannot be
captured makes the test fail with its error: that is a bug, not a reason to skip.

The replay runs the very kernels the eager call ran, with the same launch configuration on
the same data, so results are compared for exact equality: cuDNN's batch-norm kernels in
SPATIAL mode and the CuPy engine's reductions (a fixed tree, no atomics) are deterministic.
If a cuDNN release ever made them not so, the comparison would have to become a tolerance
of a few ulps; it is not one now because a replay that differs at all is worth seeing.
As a check that the eager call computed the right thing at all, its results are also
compared with the CPU backend in float64 on the same (rounded) values; accuracy itself is
``test_gpu.py``'s and ``test_gpu_forward.py``'s business.

Engines: F32 and F16 (with F16 per-channel tensors, staged through the workspace by CuPy
kernels around the cuDNN call) run on cuDNN; BF16 data and eval-mode backward run on the
CuPy engine. Every test is marked ``gpu`` (skipped with the reason where there is no GPU;
listed in the GPU report by ``tests/conftest.py``).
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from bf16 import bf16_bits_to_f32, f32_to_bf16_bits

from cudnn_bn import BatchNormBackwardDescriptor, DataType, Device, Handle, TensorDesc
from cudnn_bn.api import (
    batch_norm_backward,
    batch_norm_backward_batched,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from cudnn_bn.errors import InfiniError
from cudnn_bn.ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from cudnn_bn.ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = pytest.mark.gpu

EPS, MOMENTUM = 1e-5, 0.25
SHAPE = (4, 3, 5, 6)  # NCHW, packed
CHANNELS = SHAPE[1]
STORAGE = {DataType.F16: np.float16, DataType.BF16: np.uint16, DataType.F32: np.float32}
# Eager results against the CPU backend in float64: a sanity check (see the module doc).
SANITY_TOL = {DataType.F16: 1e-2, DataType.BF16: 1e-2, DataType.F32: 1e-4}
# (data dtype, per-channel dtype)
DTYPES = [
    pytest.param(DataType.F32, DataType.F32, id="F32"),
    pytest.param(DataType.F16, DataType.F16, id="F16-with-F16-parameters"),
    pytest.param(DataType.BF16, DataType.F32, id="BF16"),
]
GRADIENTS = ("grad_input", "grad_weight", "grad_bias")
BACKWARD_INPUTS = ("input", "grad_output", "weight", "running_mean", "running_var")


def engine_for(dtype: DataType, mode: str = "train") -> str:
    return "cupy" if dtype == DataType.BF16 or mode == "eval" else "cudnn"


def encode(values: np.ndarray, dtype: DataType) -> np.ndarray:
    """Host storage of ``values`` in ``dtype`` (BF16 as uint16 bits, rounded to nearest)."""
    if dtype == DataType.BF16:
        return f32_to_bf16_bits(np.asarray(values, np.float32))
    return np.asarray(values).astype(STORAGE[dtype])


def decode(stored: np.ndarray, dtype: DataType) -> np.ndarray:
    if dtype == DataType.BF16:
        return bf16_bits_to_f32(stored).astype(np.float64)
    return stored.astype(np.float64)


def rounded(values: np.ndarray, dtype: DataType) -> np.ndarray:
    """``values`` as ``dtype`` holds them, in float64."""
    return decode(encode(values, dtype), dtype)


@dataclass
class Buffer:
    """A CuPy array and the ``DataType`` it stores (CuPy has no bfloat16: uint16 bits)."""

    array: Any
    dtype: DataType

    @classmethod
    def of(cls, values: np.ndarray, dtype: DataType) -> "Buffer":
        """``values`` on the device, on the current CuPy stream."""
        return cls(cupy.asarray(encode(values, dtype)), dtype)

    @classmethod
    def nan(cls, shape: tuple[int, ...], dtype: DataType) -> "Buffer":
        return cls.of(np.full(shape, np.nan), dtype)

    @property
    def ptr(self) -> int:
        return self.array.data.ptr

    @property
    def desc(self) -> TensorDesc:
        a = self.array
        return TensorDesc(self.dtype, a.shape, tuple(s // a.itemsize for s in a.strides))

    def values(self) -> np.ndarray:
        """The stored values in float64 (after the stream has been synchronized)."""
        return decode(cupy.asnumpy(self.array), self.dtype)

    def snapshot(self) -> np.ndarray:
        """The stored bits, for exact comparisons."""
        return cupy.asnumpy(self.array).copy()


def problem(data: DataType, params: DataType, seed: int = 0) -> dict[str, np.ndarray]:
    """float64 values already rounded to the dtype each will be stored in."""
    rng = np.random.default_rng(seed)
    values = {
        "input": 2 * rng.standard_normal(SHAPE) + 0.5,
        "grad_output": rng.standard_normal(SHAPE),
        "weight": rng.uniform(0.5, 1.5, CHANNELS),
        "bias": 0.5 * rng.standard_normal(CHANNELS),
        "running_mean": 0.3 * rng.standard_normal(CHANNELS),
        "running_var": rng.uniform(0.5, 2.0, CHANNELS),
    }
    return {n: rounded(v, data if v.ndim > 1 else params) for n, v in values.items()}


def capture(stream: Any, compute: Callable[[], None]) -> Any:
    """The CUDA graph of ``compute()`` captured on ``stream``; the capture is always ended,
    and an error inside it is raised as it is."""
    stream.synchronize()
    stream.begin_capture()
    try:
        compute()
    except BaseException:
        with contextlib.suppress(Exception):  # an invalidated capture: the error says why
            stream.end_capture()
        raise
    return stream.end_capture()


def zero(stream: Any, buffers: dict[str, Buffer]) -> None:
    with stream:
        for buffer in buffers.values():
            buffer.array.fill(0)


def assert_same(buffers: dict[str, Buffer], expected: dict[str, np.ndarray], what: str) -> None:
    """Bit-for-bit equal to ``expected`` (snapshots)."""
    for name, buffer in buffers.items():
        np.testing.assert_array_equal(buffer.snapshot(), expected[name], err_msg=f"{name}: {what}")


def assert_close(buffers: dict[str, Buffer], expected: dict[str, Any], tol: float, what: str):
    for name, buffer in buffers.items():
        np.testing.assert_allclose(
            buffer.values(),
            np.asarray(expected[name]),
            rtol=tol,
            atol=tol,
            err_msg=f"{name}: {what}",
        )


# --- backward -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "saved", "eval"])
@pytest.mark.parametrize(("dtype", "param_dtype"), DTYPES)
def test_backward_graph_replays_the_eager_results(dtype, param_dtype, mode):
    host = problem(dtype, param_dtype)
    if mode == "saved":  # the batch mean and biased variance, as the spec reads them
        axes = (0, 2, 3)
        host["running_mean"] = rounded(host["input"].mean(axis=axes), param_dtype)
        host["running_var"] = rounded(host["input"].var(axis=axes), param_dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    names = BACKWARD_INPUTS if mode != "train" else BACKWARD_INPUTS[:3]
    with stream:
        inputs = {n: Buffer.of(host[n], dtype if host[n].ndim > 1 else param_dtype) for n in names}
        grads = {
            "grad_input": Buffer.nan(SHAPE, dtype),
            "grad_weight": Buffer.nan((CHANNELS,), param_dtype),
            "grad_bias": Buffer.nan((CHANNELS,), param_dtype),
        }
    stream.synchronize()
    descs = [grads[n].desc for n in GRADIENTS]
    descs += [inputs[n].desc if n in inputs else None for n in BACKWARD_INPUTS]
    handle = Handle(Device.NVIDIA, 0)
    with BatchNormBackwardDescriptor(handle, *descs, eps=EPS, mode=mode) as desc:
        assert desc.engine == engine_for(dtype, mode)
        with stream:
            workspace = cupy.empty(max(desc.workspace_size, 1), cupy.uint8)
        pointers = [grads[n].ptr for n in GRADIENTS]
        pointers += [inputs[n].ptr if n in inputs else 0 for n in BACKWARD_INPUTS]

        def compute():
            desc.compute(workspace.data.ptr, desc.workspace_size, *pointers, stream=stream.ptr)

        compute()
        stream.synchronize()
        eager = {n: b.snapshot() for n, b in grads.items()}
        graph = capture(stream, compute)
        zero(stream, grads)
        graph.launch(stream)
        stream.synchronize()
        assert_same(grads, eager, f"graph replay vs eager compute ({desc.engine}, {mode})")

    running = [host[n] if n in inputs else None for n in BACKWARD_INPUTS[3:]]
    expected = batch_norm_backward(
        host["input"], host["grad_output"], host["weight"], *running, eps=EPS, mode=mode
    )
    tol = SANITY_TOL[dtype]
    assert_close(grads, dict(zip(GRADIENTS, expected, strict=True)), tol, "vs the CPU backend")


# --- training forward ---------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "param_dtype"), DTYPES)
def test_forward_training_graph_updates_running_statistics_per_replay(dtype, param_dtype):
    """Each replay is one training step: outputs as eagerly, running statistics updated
    again (a graph holding values instead of pointers would update them once or never)."""
    host = problem(dtype, param_dtype)
    stats_dtype = DataType.F32  # saved statistics: F32 for F16/BF16 data, and F32 data
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        inputs = {
            "input": Buffer.of(host["input"], dtype),
            "weight": Buffer.of(host["weight"], param_dtype),
            "bias": Buffer.of(host["bias"], param_dtype),
        }
        outputs = {
            "output": Buffer.nan(SHAPE, dtype),
            "saved_mean": Buffer.nan((CHANNELS,), stats_dtype),
            "saved_invstd": Buffer.nan((CHANNELS,), stats_dtype),
        }
        # The eager calls and the graph each update their own copy of the running statistics.
        eager_running, graph_running = (
            {n: Buffer.of(host[n], param_dtype) for n in ("running_mean", "running_var")}
            for _ in range(2)
        )
    stream.synchronize()
    order = ("input", "weight", "bias")
    handle = Handle(Device.NVIDIA, 0)
    with BatchNormForwardTrainingDescriptor(
        handle,
        *(outputs[n].desc for n in outputs),
        *(inputs[n].desc for n in order),
        eager_running["running_mean"].desc,
        eager_running["running_var"].desc,
        eps=EPS,
        momentum=MOMENTUM,
    ) as desc:
        assert desc.engine == engine_for(dtype)
        with stream:
            workspace = cupy.empty(max(desc.workspace_size, 1), cupy.uint8)
            reserve = cupy.empty(max(desc.reserve_size, 1), cupy.uint8)

        def compute(running: dict[str, Buffer]) -> None:
            desc.compute(
                workspace.data.ptr, desc.workspace_size, reserve.data.ptr, desc.reserve_size,
                *(outputs[n].ptr for n in outputs), *(inputs[n].ptr for n in order),
                running["running_mean"].ptr, running["running_var"].ptr, stream=stream.ptr,
            )  # fmt: skip

        compute(eager_running)
        stream.synchronize()
        eager = {n: b.snapshot() for n, b in outputs.items()}
        graph = capture(stream, lambda: compute(graph_running))
        after_one = None
        for replay in (1, 2):
            if replay == 2:
                compute(eager_running)  # the eager copy takes its second step too
            zero(stream, outputs)
            graph.launch(stream)
            stream.synchronize()
            what = f"replay {replay} vs eager ({desc.engine})"
            assert_same(outputs, eager, what)
            assert_same(graph_running, {n: b.snapshot() for n, b in eager_running.items()}, what)
            if replay == 1:
                after_one = {n: b.snapshot() for n, b in graph_running.items()}
        for name, buffer in graph_running.items():
            assert not np.array_equal(buffer.snapshot(), after_one[name]), (
                f"{name} was not updated by the second replay"
            )

    running = {n: host[n].copy() for n in ("running_mean", "running_var")}
    for _ in range(2):  # two steps from the same start, on the CPU backend in float64
        expected = batch_norm_forward_training(
            host["input"], host["weight"], host["bias"], running["running_mean"],
            running["running_var"], momentum=MOMENTUM, eps=EPS,
        )  # fmt: skip
    tol = SANITY_TOL[dtype]
    assert_close(outputs, dict(zip(outputs, expected, strict=True)), tol, "vs the CPU backend")
    assert_close(graph_running, running, tol, "after two replays vs two CPU steps")


# --- inference forward --------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "param_dtype"), DTYPES)
def test_forward_inference_graph_replays_on_new_input(dtype, param_dtype):
    """A replay gives the eager output; after new values are copied into the input buffer,
    a replay normalizes those (the graph reads its buffers, it did not freeze them)."""
    host = problem(dtype, param_dtype)
    order = ("input", "weight", "bias", "running_mean", "running_var")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        inputs = {n: Buffer.of(host[n], dtype if n == "input" else param_dtype) for n in order}
        outputs = {"output": Buffer.nan(SHAPE, dtype)}
    stream.synchronize()
    handle = Handle(Device.NVIDIA, 0)
    with BatchNormForwardInferenceDescriptor(
        handle, outputs["output"].desc, *(inputs[n].desc for n in order), eps=EPS
    ) as desc:
        assert desc.engine == engine_for(dtype)
        with stream:
            workspace = cupy.empty(max(desc.workspace_size, 1), cupy.uint8)

        def compute():
            desc.compute(
                workspace.data.ptr, desc.workspace_size, outputs["output"].ptr,
                *(inputs[n].ptr for n in order), stream=stream.ptr,
            )  # fmt: skip

        compute()
        stream.synchronize()
        eager = {"output": outputs["output"].snapshot()}
        graph = capture(stream, compute)
        zero(stream, outputs)
        graph.launch(stream)
        stream.synchronize()
        assert_same(outputs, eager, f"graph replay vs eager compute ({desc.engine})")

        fresh = rounded(np.random.default_rng(1).standard_normal(SHAPE) - 1.0, dtype)
        with stream:
            inputs["input"].array[...] = cupy.asarray(encode(fresh, dtype))
        zero(stream, outputs)
        graph.launch(stream)
        stream.synchronize()

    weight_bias_stats = [host[n] for n in order[1:]]
    first = batch_norm_forward_inference(host["input"], *weight_bias_stats, eps=EPS)
    second = batch_norm_forward_inference(fresh, *weight_bias_stats, eps=EPS)
    tol = SANITY_TOL[dtype]
    np.testing.assert_allclose(
        decode(eager["output"], dtype), first, rtol=tol, atol=tol, err_msg="eager vs CPU backend"
    )
    assert_close(outputs, {"output": second}, tol, "replay on new input vs the CPU backend")


# --- the array API: constants standing in for an absent weight or bias -------------------


def test_array_api_with_weight_none_is_captured_once_an_eager_call_made_its_constants():
    """``weight=None``/``bias=None`` read ones and zeros that a problem's first call makes
    and waits for (``arrays.kinds``): made by an eager call, the same call captured replays
    the eager output; a problem whose constants do not exist yet is refused by name while
    the stream captures (the fill would only be recorded), and the capture is ended."""
    host = problem(DataType.F32, DataType.F32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, mean, var = (
            cupy.asarray(host[n].astype(np.float32))
            for n in ("input", "running_mean", "running_var")
        )
        out = cupy.full(SHAPE, cupy.nan, cupy.float32)

    def compute():
        batch_norm_forward_inference(x, None, None, mean, var, eps=EPS, stream=stream.ptr, out=out)

    compute()
    stream.synchronize()
    eager = cupy.asnumpy(out)
    graph = capture(stream, compute)
    with stream:
        out.fill(0)
    graph.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), eager)
    expected = batch_norm_forward_inference(
        host["input"], None, None, host["running_mean"], host["running_var"], eps=EPS
    )
    np.testing.assert_allclose(eager, expected, rtol=1e-5, atol=1e-5)

    channels = 11  # a layout no other test has made constants for
    with stream:
        x = cupy.ones((2, channels, 3, 3), cupy.float32)
        stats = cupy.ones(channels, cupy.float32)
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: weight is None"):
        capture(
            stream,
            lambda: batch_norm_forward_inference(x, None, None, stats, stats, stream=stream.ptr),
        )
    assert not stream.is_capturing()


class _Mallocs(cupy.cuda.MemoryHook):
    """Counts CuPy's pool allocations."""

    name = "cudnn_bn malloc counter"

    def __init__(self) -> None:
        self.count = 0

    def malloc_preprocess(self, **kwargs) -> None:
        self.count += 1


def test_array_api_backward_with_out_is_captured_allocating_nothing():
    """A backward with ``out=`` whose plan ran once on the stream allocates nothing when
    captured (its workspace is the plan's for that stream: ``api.call.Plan``), and the
    replay gives the eager gradients."""
    host = problem(DataType.F32, DataType.F32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, dy, w = (
            cupy.asarray(host[n].astype(np.float32)) for n in ("input", "grad_output", "weight")
        )
        out = tuple(
            cupy.full(shape, cupy.nan, cupy.float32) for shape in (SHAPE, CHANNELS, CHANNELS)
        )

    def compute():
        batch_norm_backward(x, dy, w, None, None, eps=EPS, stream=stream.ptr, out=out)

    compute()
    stream.synchronize()
    eager = [cupy.asnumpy(o) for o in out]
    mallocs = _Mallocs()
    with mallocs:
        graph = capture(stream, compute)
    assert mallocs.count == 0
    with stream:
        for o in out:
            o.fill(0)
    graph.launch(stream)
    stream.synchronize()
    for got, want in zip(out, eager, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_array_api_training_forward_with_out_and_its_reserve_is_captured_allocating_nothing():
    """A training forward given ``out=(output, saved_mean, saved_invstd, reserve)``, its
    reserve the first call's ``.reserve`` (a buffer of the caller's where this problem needs
    none: cuDNN's SPATIAL may answer 0 bytes, and out[3] None would test no given reserve),
    returns that reserve and allocates nothing when captured, and each replay gives the
    eager output and saved statistics (the running ones move on per replay)."""
    host = problem(DataType.F32, DataType.F32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, w, b, mean, var = (
            cupy.asarray(host[n].astype(np.float32))
            for n in ("input", "weight", "bias", "running_mean", "running_var")
        )
        first = batch_norm_forward_training(x, w, b, mean, var, stream=stream.ptr)
        reserve = cupy.empty(16, cupy.uint8) if first.reserve is None else first.reserve
        out = (*(cupy.full_like(o, cupy.nan) for o in first), reserve)

    def compute():
        got = batch_norm_forward_training(x, w, b, mean, var, stream=stream.ptr, out=out)
        assert got.reserve is reserve

    compute()
    stream.synchronize()
    eager = [cupy.asnumpy(o) for o in out[:3]]
    mallocs = _Mallocs()
    with mallocs:
        graph = capture(stream, compute)
    assert mallocs.count == 0
    with stream:
        for o in out[:3]:
            o.fill(0)
    graph.launch(stream)
    stream.synchronize()
    for got, want in zip(out[:3], eager, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_array_api_batched_backward_is_captured_allocating_only_its_outputs():
    """A batched backward's plan gathers its operands by one kernel into the stream's
    workspace, whose table its first call there wrote (``backends.gather``): captured after
    one eager call on the stream, a call allocates only its three outputs, and the replay
    fills them with the eager gradients; a batched problem's first call on a capturing
    stream is refused (its table would be a copy from host memory) and the capture ended."""
    host = problem(DataType.F32, DataType.F32)
    batch = 3
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x, dy = (
            cupy.stack([cupy.asarray(host[n].astype(np.float32)) * (b + 1) for b in range(batch)])
            for n in ("input", "grad_output")
        )
        w = cupy.asarray(host["weight"].astype(np.float32))  # shared: gathered into rows
    results = []

    def compute():
        results.append(batch_norm_backward_batched(x, dy, w, None, None, stream=stream.ptr))

    compute()
    compute()  # freed below: blocks of the outputs' sizes in the stream's arena, for the
    stream.synchronize()  # capture's allocations to reuse rather than cudaMalloc
    eager = [cupy.asnumpy(g) for g in results[0]]
    results.clear()
    mallocs = _Mallocs()
    with mallocs:
        graph = capture(stream, compute)
    assert mallocs.count == 3
    with stream:
        for g in results[0]:
            g.fill(0)
    graph.launch(stream)
    stream.synchronize()
    for got, want in zip(results[0], eager, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
    for b in range(batch):
        one = batch_norm_backward(x[b], dy[b], w, None, None, stream=stream.ptr)
        stream.synchronize()
        for got, want in zip(eager, one, strict=True):
            np.testing.assert_allclose(got[b], cupy.asnumpy(want), rtol=1e-5, atol=1e-5)

    with stream:
        other = cupy.ones((2, 4, CHANNELS, 7), cupy.float32)  # a problem with no plan yet
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: .*gather table.*before the capture"):
        capture(
            stream,
            lambda: batch_norm_backward_batched(other, other, w, None, None, stream=stream.ptr),
        )
    assert not stream.is_capturing()
