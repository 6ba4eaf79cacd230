"""Streams, devices, producers and handles on a real GPU (``test_streams_and_devices.py``
checks the same on stand-ins without one).

Every test is marked ``gpu`` and skipped, with the reason, where there is no usable GPU;
the multi-GPU one also where there is a single device.
"""

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import as_f64

import cudnn_bn
from cudnn_bn import DataType
from cudnn_bn.arrays import operand

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = pytest.mark.gpu

SHAPE, C, EPS = (4, 8, 6, 6), 8, 1e-5


def operands(device: int = 0) -> dict[str, torch.Tensor]:
    """A float32 inference problem on CUDA ``device``."""
    g = torch.Generator().manual_seed(0)
    cpu = {
        "input": torch.randn(SHAPE, generator=g),
        "weight": 1 + 0.5 * torch.randn(C, generator=g),
        "bias": torch.randn(C, generator=g),
        "running_mean": 0.1 * torch.randn(C, generator=g),
        "running_var": 0.5 + torch.rand(C, generator=g),
    }
    return {n: t.to(f"cuda:{device}") for n, t in cpu.items()}


def expected(p: dict[str, torch.Tensor]) -> np.ndarray:
    args = [p[n].double() for n in ("input", "running_mean", "running_var", "weight", "bias")]
    x, mean, var, w, b = args
    return as_f64(F.batch_norm(x, mean, var, w, b, training=False, eps=EPS))


def infer(p: dict, convert=lambda t: t, **options):
    names = ("input", "weight", "bias", "running_mean", "running_var")
    return cudnn_bn.batch_norm_forward_inference(*(convert(p[n]) for n in names), **options)


class _StreamRecorder(cupy.cuda.MemoryHook):
    """Records CuPy's current stream at every pool allocation: the arena it comes from."""

    name = "cudnn_bn stream recorder"

    def __init__(self) -> None:
        self.streams: list[int] = []

    def malloc_preprocess(self, **kwargs) -> None:
        self.streams.append(cupy.cuda.get_current_stream().ptr)


def test_cupy_allocations_come_from_the_call_stream():
    p = operands()
    stream = cupy.cuda.Stream(non_blocking=True)
    recorder = _StreamRecorder()
    with recorder:
        p_cupy = {n: cupy.asarray(t) for n, t in p.items()}
        recorder.streams.clear()
        names = ("input", "weight", "bias", "running_mean", "running_var")
        x, w, b, m, v = (p_cupy[n] for n in names)
        out = cudnn_bn.batch_norm_forward_training(x, w, b, m, v, stream=stream)
        cudnn_bn.batch_norm_backward(x, x, w, None, None, stream=stream)
    stream.synchronize()
    assert recorder.streams and set(recorder.streams) == {stream.ptr}
    assert out[0].shape == SHAPE


def test_a_call_without_a_stream_runs_on_the_current_one():
    """``stream=None`` on the arrays' current device: the call enters no scope of its own, so
    it allocates from, and runs on, CuPy's current stream (``kinds.CupyKind.scope``)."""
    p = {n: cupy.asarray(t) for n, t in operands().items()}
    stream = cupy.cuda.Stream(non_blocking=True)
    recorder = _StreamRecorder()
    with recorder, stream:
        recorder.streams.clear()
        y = infer(p)
        cudnn_bn.batch_norm_backward(p["input"], p["input"], p["weight"], None, None)
    stream.synchronize()
    assert recorder.streams and set(recorder.streams) == {stream.ptr}
    np.testing.assert_allclose(cupy.asnumpy(y), expected(operands()), rtol=1e-5, atol=1e-5)


def test_a_call_given_the_current_stream_runs_on_it():
    """``stream=`` the current stream of the arrays' current device: the call enters no
    scope (``kinds.CupyKind.scope``) and still allocates from, and runs on, that stream."""
    p = {n: cupy.asarray(t) for n, t in operands().items()}
    stream = cupy.cuda.Stream(non_blocking=True)
    recorder = _StreamRecorder()
    with recorder, stream:
        recorder.streams.clear()
        y = infer(p, stream=stream)
        cudnn_bn.batch_norm_backward(
            p["input"], p["input"], p["weight"], None, None, stream=stream.ptr
        )
    stream.synchronize()
    assert recorder.streams and set(recorder.streams) == {stream.ptr}
    np.testing.assert_allclose(cupy.asnumpy(y), expected(operands()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight", ["rows", "shared"])
def test_a_batched_call_allocates_and_gathers_on_the_call_stream(weight):
    """The batched backward's outputs and workspace come from the call's stream, where its
    gather kernel runs (``backends.gather``), and each problem's results are the unbatched
    call's; a weight shared by the problems is gathered into rows by the same kernel."""
    p = operands()
    x = cupy.stack([cupy.asarray(p["input"]), cupy.asarray(p["input"]) * 2])
    one = cupy.asarray(p["weight"])
    w = cupy.stack([one, one * 2]) if weight == "rows" else one
    stream = cupy.cuda.Stream(non_blocking=True)
    recorder = _StreamRecorder()
    with recorder:
        got = cudnn_bn.batch_norm_backward_batched(x, x, w, None, None, stream=stream)
    stream.synchronize()
    assert recorder.streams and set(recorder.streams) == {stream.ptr}
    for b in range(2):
        want = cudnn_bn.batch_norm_backward(x[b], x[b], w[b] if w.ndim == 2 else w, None, None)
        for g, h in zip(got, want, strict=True):
            np.testing.assert_allclose(cupy.asnumpy(g[b]), cupy.asnumpy(h), rtol=1e-5, atol=1e-5)


def test_a_channels_last_cupy_output_has_the_inputs_layout():
    """CuPy outputs are allocated packed in the input's memory order, then transposed
    (``kinds._in_memory_order``): a channels-last input gets a channels-last output."""
    p = {n: cupy.asarray(t) for n, t in operands().items()}
    x = cupy.ascontiguousarray(p["input"].transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    y = cudnn_bn.batch_norm_forward_inference(
        x, p["weight"], p["bias"], p["running_mean"], p["running_var"]
    )
    assert y.strides == x.strides
    np.testing.assert_allclose(cupy.asnumpy(y), expected(operands()), rtol=1e-5, atol=1e-5)


def _segment_stream(tensor: torch.Tensor) -> int:
    ptr = tensor.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return segment["stream"]
    raise AssertionError("no segment holds the tensor")


def test_torch_allocations_come_from_the_call_stream():
    p = operands()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out = infer(p, stream=stream.cuda_stream)
    stream.synchronize()
    assert _segment_stream(out) == stream.cuda_stream
    np.testing.assert_allclose(as_f64(out), expected(p), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_operands_on_another_device(kind):
    p = operands(device=1)
    convert = cupy.asarray if kind == "cupy" else (lambda t: t)
    x, w = convert(p["input"]), convert(p["weight"])
    with cupy.cuda.Device(0), torch.cuda.device(0):  # device 0 current, operands on 1
        out = infer(p, convert)
        grads = cudnn_bn.batch_norm_backward(x, x, w, None, None)
        assert cupy.cuda.runtime.getDevice() == 0
    assert all((g.device.id if kind == "cupy" else g.device.index) == 1 for g in grads)
    assert (out.device.id if kind == "cupy" else out.device.index) == 1
    torch.cuda.synchronize(1)
    np.testing.assert_allclose(as_f64(out), expected(p), rtol=1e-5, atol=1e-5)


class _Producer:
    """A CUDA-array-interface v3 producer whose data is written on ``stream``."""

    def __init__(self, tensor: torch.Tensor, stream: int) -> None:
        self._tensor = tensor
        self.__cuda_array_interface__ = dict(tensor.__cuda_array_interface__, stream=stream)


def test_a_producer_stream_is_waited_for():
    p = operands()
    late = torch.empty_like(p["input"])
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # the producer's write lands well after the call
        late.copy_(p["input"])
    q = dict(p, input=_Producer(late, producer.cuda_stream))
    names = ("weight", "bias", "running_mean", "running_var")
    q.update({n: _Producer(p[n], torch.cuda.current_stream().cuda_stream) for n in names})
    out = infer(q, stream=consumer.cuda_stream)
    torch.cuda.synchronize()
    np.testing.assert_allclose(as_f64(out), expected(p), rtol=1e-5, atol=1e-5)


def test_capture_on_a_thread_that_never_built_a_descriptor():
    """Handles are made with descriptors, so a new thread's first compute can be captured."""
    p = operands()
    infer(p)  # builds the descriptor (and its handle) on this thread
    torch.cuda.synchronize()
    failures: list[BaseException] = []

    def capture() -> None:
        try:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.stream(side), torch.cuda.graph(graph):
                out = infer(p)
            graph.replay()
            torch.cuda.synchronize()
            np.testing.assert_allclose(as_f64(out), expected(p), rtol=1e-5, atol=1e-5)
        except BaseException as exc:  # reported on the main thread
            failures.append(exc)

    worker = threading.Thread(target=capture)
    worker.start()
    worker.join()
    assert not failures, failures


def test_cudnn_and_cupy_share_a_cuda_major():
    info = cudnn_bn.cudnn_info()
    assert info.cupy_cudart_version is not None
    assert info.cudart_version // 1000 == info.cupy_cudart_version // 1000, info


def test_cupy_bfloat16_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    try:
        array = cupy.zeros(SHAPE, dtype=ml_dtypes.bfloat16)
    except (TypeError, ValueError) as exc:
        pytest.skip(f"this CuPy has no bfloat16 arrays: {exc}")
    assert operand("input", array).desc.dtype == DataType.BF16
