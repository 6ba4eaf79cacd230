"""Where an NVIDIA call allocates, launches and finds its handle, checked without a GPU.

``fake_devices.py`` stands in for CuPy (two devices, a current stream per device, a memory
pool that records the device and stream of every allocation) and for torch's CUDA streams
and allocator; the stub libcudnn (``cudnn_stub.py``) records what cuDNN is given, and a
wrapper of it the device current at each cuDNN call. Every array a call creates must come
from the call's stream on the operands' device (both caching allocators reuse a block
without waiting only on the stream it was allocated on), the stream must be the operands'
device's, producers' streams must be ordered before the call's (DLPack's ``stream=``, the
CUDA array interface's ``stream``), and cuDNN handles are made with descriptors, never in a
compute, and never destroyed. ``test_gpu_streams.py`` runs the same on a GPU.
"""

import ctypes
import gc
import math
import re
import sys
import threading
import time
import warnings

import ml_dtypes
import numpy as np
import pytest
from cudnn_stub import POINTERS, STUB_RESERVE
from fake_devices import (
    FakeArray,
    FakeCupy,
    FakeStream,
    RecordingLibrary,
    fake_torch,
    torch_tensor,
)
from producers import DeviceTurning

import cudnn_bn
from cudnn_bn import (
    BatchNormForwardInferenceDescriptor,
    DataType,
    Device,
    Handle,
    Status,
    TensorDesc,
    batch_norm_backward,
    batch_norm_backward_batched,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from cudnn_bn import arrays as arrays_module
from cudnn_bn._cudnn import library as library_module
from cudnn_bn.api import call
from cudnn_bn.arrays import operand
from cudnn_bn.arrays.dlpack import _DLDataType, _DLDevice, _DLTensor
from cudnn_bn.backends import cuda
from cudnn_bn.errors import (
    BadParamError,
    BadTensorStridesError,
    InfiniError,
    InsufficientWorkspaceError,
)

SHAPE, C = (2, 3, 4, 5), 3
CURRENT = {0: 0xA00, 1: 0xA10}  # each fake device's current stream
CALL_STREAM = 0x5B00
PRODUCER_STREAM = 0xF00
# The real CUDA seam; the stub's set-up replaces it with a one-device stand-in.
REAL_SEAM = {
    name: getattr(cuda, name) for name in ("stream_scope", "current_device", "device_count")
}


@pytest.fixture
def fake(stub, monkeypatch):
    """``FakeCupy`` as ``cupy`` over the stub libcudnn; ``fake.cudnn`` records cuDNN calls."""
    fake = FakeCupy(CURRENT)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for name, function in REAL_SEAM.items():
        monkeypatch.setattr(cuda, name, function)
    monkeypatch.setattr(cuda, "_streams", {})
    fake.cudnn = RecordingLibrary(library_module._library, lambda: fake.device)
    monkeypatch.setattr(library_module, "_library", fake.cudnn)
    arrays_module.torch_stream.cache_clear()
    cudnn_bn.descriptor_cache.clear()  # nothing built on another test's library
    yield fake
    cudnn_bn.descriptor_cache.clear()
    arrays_module.torch_stream.cache_clear()


def problem(make, device: int) -> dict:
    """Operands of every pass, made by ``make(shape, device)``."""
    data = {n: make(SHAPE, device) for n in ("input", "grad_output")}
    return data | {n: make((C,), device) for n in ("weight", "bias", "mean", "var")}


def run_all(p: dict, **options) -> None:
    """Every array-API pass on the operands ``p``: each allocates outputs and workspace."""
    batch_norm_backward(p["input"], p["grad_output"], p["weight"], None, None, **options)
    args = (p["input"], p["weight"], p["bias"], p["mean"], p["var"])
    batch_norm_forward_training(*args, **options)
    batch_norm_forward_inference(*args, **options)


def run_batched(make, device: int, **options) -> None:
    x, w = make((2, *SHAPE), device), make((C,), device)
    batch_norm_backward_batched(x, x, w, None, None, **options)


def launched(fake) -> list[tuple]:
    """``(device, stream)`` of every kernel launch and copy from the host so far."""
    return [entry[1:3] for entry in fake.log if entry[0] in ("launch", "memcpy")]


# --- finding 1: allocations on the call's stream ------------------------------------------------


def test_every_allocation_comes_from_the_call_stream(fake, stub):
    p = problem(fake.array, 0)
    run_all(p, stream=CALL_STREAM)
    run_batched(fake.array, 0, stream=CALL_STREAM)
    assert len(fake.allocations()) >= 10  # outputs, statistics, reserve and workspaces
    assert set(fake.allocations()) == {(0, CALL_STREAM)}
    assert launched(fake) == [(0, CALL_STREAM)] * 2  # the batch's gather table and kernel
    assert stub.set_stream.stream == CALL_STREAM
    assert fake.stacks == {d: [s] for d, s in CURRENT.items()}, "current streams restored"


def test_a_batched_problem_of_an_earlier_test_launches_through_this_tests_cupy(fake, stub):
    """The previous test ran this batched problem: its plan, which binds the gather kernel
    (made by the CuPy of its test, ``gather._kernel``), is forgotten with the plans, or it
    would launch through that test's stand-in, unseen by this one's checks."""
    run_batched(fake.array, 0, stream=CALL_STREAM)
    assert [e[:4] for e in fake.launches()] == [("launch", 0, CALL_STREAM, "cudnn_bn_gather_3")]
    assert not [e for e in fake.events() if e[0] == "copy"]


def test_the_workspace_and_reserve_cudnn_is_given_are_as_large_as_it_is_told(fake, stub):
    """The buffers a plan allocates (``Kind.buffer``: the reserve per call, a workspace per
    stream) hold at least the byte counts given to cuDNN with them (review 8)."""
    run_all(problem(fake.array, 0))
    sizes = {entry[4]: entry[3] for entry in fake.log if entry[0] == "alloc"}  # ptr: bytes
    forward, backward = stub.forward_training, stub.backward
    given = [
        (forward.workspace, forward.workspace_size),
        (forward.reserve, forward.reserve_size),
        (backward.workspace, backward.workspace_size),
    ]
    assert all(size > 0 and sizes[ptr] >= size for ptr, size in given), (given, sizes)


def test_a_call_given_the_current_stream_switches_nothing(fake, stub, monkeypatch):
    """The current stream of the arrays' device, given as ``stream=`` with that device
    current, is where CuPy allocates already: a call pushes no stream and switches no device
    (``kinds.CupyKind.scope``), and still allocates from and runs on that stream."""
    switches = []
    enter = FakeStream.__enter__
    monkeypatch.setattr(FakeStream, "__enter__", lambda s: switches.append(s.ptr) or enter(s))
    set_device = fake.cuda.runtime.setDevice
    monkeypatch.setattr(
        fake.cuda.runtime, "setDevice", lambda d: switches.append(("device", d)) or set_device(d)
    )
    run_all(problem(fake.array, 0), stream=CURRENT[0])
    run_batched(fake.array, 0, stream=CURRENT[0])
    assert switches == []
    assert len(fake.allocations()) >= 10 and set(fake.allocations()) == {(0, CURRENT[0])}
    assert stub.set_stream.stream == CURRENT[0]


def test_every_torch_allocation_comes_from_the_call_stream(fake, monkeypatch):
    with fake_torch(monkeypatch, CURRENT) as allocations:
        run_all(problem(torch_tensor, 0), stream=CALL_STREAM)
        run_batched(torch_tensor, 0, stream=CALL_STREAM)
    assert len(allocations) >= 10
    assert set(allocations) == {(0, CALL_STREAM)}


# --- finding 2: everything on the operands' device ----------------------------------------------


def assert_all_on_device_1(fake, stub, batched: bool = True) -> None:
    assert fake.allocations() and set(fake.allocations()) == {(1, CURRENT[1])}
    # a batched call's gather table and kernel (the other passes launch nothing of CuPy's)
    assert launched(fake) == [(1, CURRENT[1])] * (2 if batched else 0)
    assert_cudnn_on_device_1(fake, stub)


def assert_cudnn_on_device_1(fake, stub) -> None:
    assert stub.set_stream.stream == CURRENT[1]  # device 1's current stream, not device 0's
    launches = [
        device
        for name, device, _ in fake.cudnn.calls
        if name.startswith(("cudnnCreate", "cudnnSetStream", "cudnnBatchNorm"))
    ]
    assert launches and set(launches) == {1}  # handles made and calls made on device 1
    assert fake.device == 0, "the caller's current device is restored"


def test_cupy_arrays_on_another_device(fake, stub):
    run_all(problem(fake.array, 1))
    run_batched(fake.array, 1)
    assert_all_on_device_1(fake, stub)


def test_cupy_arrays_on_another_device_given_its_current_stream(fake, stub):
    """Device 1's current stream given while device 0 is current: the call's scope still
    makes device 1 current (the stream alone matching is not enough), since a CuPy plan's
    cuDNN launch switches no device (``run_current``) and CuPy allocates on the current
    one (review 8)."""
    run_all(problem(fake.array, 1), stream=CURRENT[1])
    run_batched(fake.array, 1, stream=CURRENT[1])
    assert_all_on_device_1(fake, stub)


def test_one_problem_on_two_devices_keys_two_plans(fake, stub):
    """A CuPy array's device is part of its plan's key (``call.read``: its
    ``data.device_id``): the same layouts on device 0 after device 1 run on device 0."""
    run_all(problem(fake.array, 1))
    run_batched(fake.array, 1)
    calls, allocations = len(fake.cudnn.calls), len(fake.allocations())
    run_all(problem(fake.array, 0))
    run_batched(fake.array, 0)
    assert {device for _, device, _ in fake.cudnn.calls[calls:]} == {0}
    assert set(fake.allocations()[allocations:]) == {(0, CURRENT[0])}


def test_torch_tensors_on_another_device(fake, stub, monkeypatch):
    with fake_torch(monkeypatch, CURRENT) as allocations:
        run_all(problem(torch_tensor, 1))
        run_batched(torch_tensor, 1)
    assert allocations and set(allocations) == {(1, CURRENT[1])}
    assert launched(fake) == [(1, CURRENT[1])] * 2  # on CuPy's stream object for torch's
    # torch allocates on the tensors' device whichever is current; cuDNN's device is switched
    # by the launch (``TorchKind.current_in_scope``)
    assert_cudnn_on_device_1(fake, stub)


class Foreign:
    """A CUDA-array-interface producer that is neither CuPy nor torch (Numba, say): its
    memory is ``array``'s, ``stream`` its interface's ``stream`` entry."""

    def __init__(self, array: FakeArray, stream: int | None = None, dtype=None) -> None:
        interface = dict(array.__cuda_array_interface__, stream=stream)
        self.__cuda_array_interface__ = interface
        if dtype is not None:
            self.dtype = np.dtype(dtype)


def test_array_interface_objects_live_where_their_memory_does(fake, stub):
    run_all(problem(lambda shape, device: Foreign(fake.array(shape, device=device)), 1))
    assert_all_on_device_1(fake, stub, batched=False)


def test_a_stream_of_another_device_is_refused(fake):
    p = problem(fake.array, 0)
    other = fake.cuda.Stream.from_external(type("S", (), {"__cuda_stream__": lambda s: (0, 7)})())
    other.device_id = 1
    with pytest.raises(InfiniError, match="stream is on device 1 but the arrays are on NVIDIA:0"):
        run_all(p, stream=other)
    assert fake.allocations() == []


# --- finding 3: producers' streams --------------------------------------------------------------


def test_array_interface_stream_is_waited_for(fake):
    make = lambda shape, device: Foreign(fake.array(shape, device=device), PRODUCER_STREAM)  # noqa: E731
    batch_norm_forward_inference(*_inference_args(make, 1))
    waits = [e for e in fake.events() if e[0] == "wait"]
    assert ("record", 1, PRODUCER_STREAM) in fake.events()
    assert waits and set(waits) == {("wait", 1, CURRENT[1], PRODUCER_STREAM)}


def _inference_args(make, device: int) -> tuple:
    p = problem(make, device)
    return p["input"], p["weight"], p["bias"], p["mean"], p["var"]


@pytest.mark.parametrize(("producer", "call"), [(CALL_STREAM, CALL_STREAM), (1, 0)])
def test_no_wait_when_the_producer_stream_is_the_call_stream(fake, producer, call):
    """The same stream needs no event; 1 (cudaStreamLegacy) and 0 are one stream."""
    make = lambda shape, device: Foreign(fake.array(shape, device=device), producer)  # noqa: E731
    batch_norm_forward_inference(*_inference_args(make, 0), stream=call)
    assert fake.events() == []


def test_cupy_arrays_carry_no_stream_to_wait_for(fake):
    """CuPy's interface ``stream`` is only its current stream: waiting on it would cost an
    event per call (and break a capture on another stream), and order nothing."""
    batch_norm_forward_inference(*_inference_args(fake.array, 0), stream=CALL_STREAM)
    assert fake.events() == []


def test_array_interface_stream_zero_is_refused(fake):
    make = lambda shape, device: Foreign(fake.array(shape, device=device), 0)  # noqa: E731
    with pytest.raises(InfiniError, match="stream 0") as caught:
        batch_norm_forward_inference(*_inference_args(make, 0))
    assert caught.value.status == Status.BAD_PARAM


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class DLPackProducer:
    """Exports ``array`` through DLPack (a float32 CUDA DLTensor), recording the ``stream``
    each ``__dlpack__`` was asked for."""

    def __init__(self, array: FakeArray) -> None:
        self.device, self.streams = array.device.id, []
        self._shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self._tensor = _DLTensor(
            data=array.data.ptr,
            device=_DLDevice(2, self.device),
            ndim=array.ndim,
            dtype=_DLDataType(2, 32, 1),
            shape=self._shape,
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        return 2, self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return _new_capsule(ctypes.addressof(self._tensor), b"dltensor", None)


@pytest.mark.parametrize(("stream", "handed"), [(CALL_STREAM, CALL_STREAM), (0, 1), (None, None)])
def test_dlpack_producers_are_handed_the_call_stream(fake, stream, handed):
    """The consumer's stream goes to ``__dlpack__`` (0, CuPy's legacy default, as 1, the
    protocol's name for it); with none given, the current stream of the arrays' device."""
    producers = _inference_args(lambda shape, device: DLPackProducer(fake.array(shape, device)), 1)
    batch_norm_forward_inference(*producers, stream=stream)
    expected = CURRENT[1] if handed is None else handed
    assert [p.streams for p in producers] == [[expected]] * len(producers)
    assert set(fake.allocations()) == {(1, CURRENT[1] if stream is None else stream)}


# --- finding 4: handles -------------------------------------------------------------------------


def inference_descriptor() -> BatchNormForwardInferenceDescriptor:
    x = TensorDesc.contiguous(DataType.F32, SHAPE)
    c = TensorDesc.contiguous(DataType.F32, (C,))
    return BatchNormForwardInferenceDescriptor(Handle(Device.NVIDIA, 0), x, x, c, c, c, c)


def infer(desc) -> None:
    names = ("output", "input", "weight", "bias", "running_mean", "running_var")
    desc.compute(0, 0, *(POINTERS[n] for n in names), stream=CALL_STREAM)


def in_thread(target, *args) -> None:
    worker = threading.Thread(target=target, args=args)
    worker.start()
    worker.join()


@pytest.fixture
def recording(stub, monkeypatch) -> RecordingLibrary:
    library = RecordingLibrary(library_module._library)
    monkeypatch.setattr(library_module, "_library", library)
    return library


def test_a_compute_makes_no_handle(recording):
    """cudnnCreate cannot run while a stream captures a CUDA graph: handles come with the
    descriptor, and a thread that never built one computes on a pooled one."""
    with inference_descriptor() as desc:
        made = recording.named("cudnnCreate")
        assert made, "the descriptor made a handle"
        infer(desc)
        in_thread(infer, desc)
        in_thread(infer, desc)
    assert recording.named("cudnnCreate") == made
    assert len(recording.named("cudnnBatchNormalizationForwardInference")) == 3


def test_handles_outlive_their_threads(recording):
    """cudnnDestroy synchronizes the device, which breaks a graph capture on another thread:
    a handle is never destroyed, however its first thread ends."""

    def build_and_compute() -> None:
        with inference_descriptor() as desc:
            infer(desc)

    in_thread(build_and_compute)
    in_thread(build_and_compute)
    gc.collect()
    assert recording.named("cudnnCreate")
    assert recording.named("cudnnDestroy") == []


# --- workspaces: one per plan and stream, kept ---------------------------------------------


def test_a_problem_keeps_a_workspace_per_stream_and_allocates_none_with_out(fake, stub):
    """A repeated backward with ``out=`` allocates nothing: its workspace, made from the
    call stream's memory by the first call there, is the plan's for that stream (so a CUDA
    graph captured after one call on its stream allocates none); another stream gets its
    own, from its own memory."""
    p = problem(fake.array, 0)
    out = (fake.array(SHAPE, 0), fake.array((C,), 0), fake.array((C,), 0))
    args = (p["input"], p["grad_output"], p["weight"], None, None)
    workspaces = []
    for stream in (CALL_STREAM, CALL_STREAM, CALL_STREAM, 0xC00):
        fake.log.clear()
        batch_norm_backward(*args, stream=stream, out=out)
        workspaces.append((stub.backward.workspace, fake.allocations()))
    first, *again, other = workspaces
    assert first[1] == [(0, CALL_STREAM)] and first[0]
    assert again == [(first[0], [])] * 2, "the same workspace, nothing allocated"
    assert other[1] == [(0, 0xC00)] and other[0] != first[0]


def test_a_training_forward_given_its_reserve_in_out_allocates_nothing(fake, stub):
    """``out=(output, saved_mean, saved_invstd, reserve)``: a repeated training forward
    fills the caller's reserve (cuDNN is handed it, and the size it asked for) and returns
    it, allocating nothing once its stream has a workspace, so it can be captured in a CUDA
    graph. Before, ``out=`` took three arrays and every call allocated a reserve."""
    p = problem(fake.array, 0)
    reserve = fake.array((STUB_RESERVE + 64,), 0, np.uint8)
    out = (fake.array(SHAPE, 0), fake.array((C,), 0), fake.array((C,), 0), reserve)
    args = (p["input"], p["weight"], p["bias"], p["mean"], p["var"])
    allocated = []
    for _ in range(3):
        fake.log.clear()
        got = batch_norm_forward_training(*args, stream=CALL_STREAM, out=out)
        allocated.append(fake.allocations())
        assert (*got, got.reserve) == out
        call = stub.forward_training
        assert (call.reserve, call.reserve_size) == (reserve.data.ptr, STUB_RESERVE)
    assert allocated == [[(0, CALL_STREAM)], [], []], "the workspace once, then nothing"


def test_a_reserve_in_out_is_refused_by_name_unless_packed_large_and_aligned(fake, stub):
    """``out[3]`` too small (INSUFFICIENT_WORKSPACE), strided (BAD_TENSOR_STRIDES) or not
    16-byte aligned (BAD_PARAM), on a plan's miss and on its hit: refused naming it before
    cuDNN is called. ``reserve=`` of a backward from saved statistics likewise (before, a
    misaligned one reached cuDNN, which the stub refused: rule reserve-aligned)."""
    p = problem(fake.array, 0)
    args = (p["input"], p["weight"], p["bias"], p["mean"], p["var"])
    outputs = (fake.array(SHAPE, 0), fake.array((C,), 0), fake.array((C,), 0))
    base = fake.array((STUB_RESERVE + 64,), 0, np.uint8).data.ptr

    def buffer(size: int, offset: int = 0, step: int = 1) -> FakeArray:
        return FakeArray(fake, (size,), np.uint8, base + offset, 0, (step,))

    bad = [
        (
            buffer(STUB_RESERVE - 1),
            InsufficientWorkspaceError,
            "out[3] holds 511 bytes; this problem needs 512",
        ),
        (buffer(STUB_RESERVE, step=2), BadTensorStridesError, "out[3] must be one packed"),
        (buffer(STUB_RESERVE, offset=8), BadParamError, "out[3] at 0x"),
    ]
    for reserve, error, words in bad:
        for _ in range(2):  # a miss, then a hit of the plan it made (if any)
            with pytest.raises(error, match=re.escape(words)):
                batch_norm_forward_training(*args, out=(*outputs, reserve))
    good = batch_norm_forward_training(*args, out=(*outputs, buffer(STUB_RESERVE)))
    saved = {"mode": "saved", "saved_mean": good[1], "saved_invstd": good[2]}
    grads = (p["input"], p["grad_output"], p["weight"], None, None)
    calls = stub.backward.calls
    with pytest.raises(BadParamError, match=r"reserve at 0x[0-9a-f]+ is not 16-byte aligned"):
        batch_norm_backward(*grads, **saved, reserve=buffer(STUB_RESERVE, offset=8))
    with pytest.raises(InsufficientWorkspaceError, match="reserve holds 511 bytes; this problem"):
        batch_norm_backward(*grads, **saved, reserve=buffer(STUB_RESERVE - 1))
    assert stub.backward.calls == calls
    assert stub.forward_training.calls == 1  # the good call alone


def test_a_reserve_the_problem_does_not_use_is_not_handed_to_cudnn(fake, stub):
    """Where cuDNN's query answers 0 reserve bytes (on a GPU: SPATIAL, plain BN), a reserve
    given (``out[3]``, ``reserve=``) is unused, so any address will do, as the README says
    ("16-byte aligned where it is used"), and cuDNN is handed none (NULL, 0 bytes) on a
    plan's miss and its hit. Before, it was handed the caller's pointer with 0 bytes, and
    the stub refused a misaligned one (rule reserve-aligned)."""
    stub.reserve_bytes.value = 0
    p = problem(fake.array, 0)
    args = (p["input"], p["weight"], p["bias"], p["mean"], p["var"])
    outputs = (fake.array(SHAPE, 0), fake.array((C,), 0), fake.array((C,), 0))
    base = fake.array((64,), 0, np.uint8).data.ptr
    for offset in (0, 1, 8):  # a miss, then hits
        reserve = FakeArray(fake, (16,), np.uint8, base + offset, 0)
        got = batch_norm_forward_training(*args, out=(*outputs, reserve))
        assert got.reserve is reserve
        assert (stub.forward_training.reserve, stub.forward_training.reserve_size) == (0, 0)
    saved = {"mode": "saved", "saved_mean": got[1], "saved_invstd": got[2]}
    grads = (p["input"], p["grad_output"], p["weight"], None, None)
    for offset in (0, 1, 8):
        reserve = FakeArray(fake, (16,), np.uint8, base + offset, 0)
        batch_norm_backward(*grads, **saved, reserve=reserve)
        assert (stub.backward.reserve, stub.backward.reserve_size) == (0, 0)
    assert (stub.forward_training.calls, stub.backward.calls) == (3, 3)


def record_workspaces(monkeypatch) -> list[tuple[int, int, int]]:
    """``(thread, stream, workspace)`` of every backward launch from now on."""
    used = []
    launcher = cudnn_bn.BatchNormBackwardDescriptor.launcher

    def recording(self, *args, **kwargs):
        launch = launcher(self, *args, **kwargs)

        def call(values, workspace, stream):
            used.append((threading.get_ident(), stream, workspace))
            launch.call(values, workspace, stream)

        return launch._replace(call=call)

    monkeypatch.setattr(cudnn_bn.BatchNormBackwardDescriptor, "launcher", recording)
    return used


def test_each_thread_gets_its_own_workspace_on_the_per_thread_default_stream(fake, monkeypatch):
    """``cudaStreamPerThread`` (2: CuPy's default stream under
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) is a different stream in each host thread, whose
    kernels may run at once: one workspace kept for that address was written by two threads'
    kernels together (found in review). Each thread gets its own there."""
    used = record_workspaces(monkeypatch)
    p = problem(fake.array, 0)
    args = (p["input"], p["grad_output"], p["weight"], None, None)
    run = lambda: [batch_norm_backward(*args, stream=2) for _ in range(2)]  # noqa: E731
    run()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    (here, _, mine), _, (there, _, theirs), _ = used
    assert {stream for _, stream, _ in used} == {2} and here != there
    assert mine != theirs and used[1][2] == mine and used[3][2] == theirs


def test_a_new_thread_never_gets_an_ended_threads_per_thread_workspace(fake, monkeypatch):
    """A thread that ends leaves its last kernels running on its own per-thread stream; a
    thread started after it (CPython hands it the same ``get_ident()``) must not launch on
    the workspace those kernels may still be writing."""
    used = record_workspaces(monkeypatch)
    p = problem(fake.array, 0)
    args = (p["input"], p["grad_output"], p["weight"], None, None)
    for _ in range(200):  # until a thread gets the ident of the one before it
        thread = threading.Thread(target=batch_norm_backward, args=args, kwargs={"stream": 2})
        thread.start()
        thread.join()
        if len(used) > 1 and used[-1][0] == used[-2][0]:
            break
        # join returns before the thread's stack is back in glibc's cache, where the next
        # thread (and so its ident) comes from: 20 tries without a pause once all missed
        time.sleep(0.002)
    (ended, _, theirs), (new, _, mine) = used[-2:]
    assert ended == new, "no thread reused an ended one's ident"
    assert mine != theirs


def test_launches_on_a_plans_workspace_never_interleave(fake, monkeypatch):
    """A launch may be several kernels on one workspace (staging around cuDNN's call): two
    threads' launches on a stream's workspace must not interleave."""
    inside, overlaps = [], []
    launcher = cudnn_bn.BatchNormBackwardDescriptor.launcher

    def recording(self, *args, **kwargs):
        launch = launcher(self, *args, **kwargs)

        def call(*a):
            inside.append(threading.get_ident())
            overlaps.append(len(inside) > 1)
            time.sleep(0.001)
            launch.call(*a)
            inside.remove(threading.get_ident())

        return launch._replace(call=call)

    monkeypatch.setattr(cudnn_bn.BatchNormBackwardDescriptor, "launcher", recording)
    p = problem(fake.array, 0)
    args = (p["input"], p["grad_output"], p["weight"], None, None)
    batch_norm_backward(*args, stream=CALL_STREAM)  # the plan, built once
    threads = [
        threading.Thread(
            target=lambda: [batch_norm_backward(*args, stream=CALL_STREAM) for _ in range(10)]
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(overlaps) == 41 and not any(overlaps)


# --- constants standing in for an absent weight or bias ------------------------------------


def test_a_stand_in_parameter_is_filled_and_waited_for_before_any_call_reads_it(fake, monkeypatch):
    """The ones and zeros standing in for ``weight=None``/``bias=None`` are made once per
    layout and then read by calls on every stream: a fill only queued on the first call's
    stream could still be pending when a call on another stream reads the constant."""
    monkeypatch.setattr(call, "_constants", {})
    p = problem(fake.array, 0)
    batch_norm_forward_inference(p["input"], None, None, p["mean"], p["var"], stream=CALL_STREAM)
    steps = [entry[:3] for entry in fake.log if entry[0] in ("fill", "sync")]
    assert steps == [("fill", 0, CALL_STREAM), ("sync", 0, CALL_STREAM)] * 2
    fake.log.clear()
    batch_norm_forward_inference(p["input"], None, None, p["mean"], p["var"], stream=0xC00)
    assert not [entry for entry in fake.log if entry[0] in ("fill", "sync")], "made once"


def test_a_stand_in_parameter_is_refused_while_capturing_until_a_call_made_it(fake, monkeypatch):
    """Under CUDA graph capture the fill would only be recorded (and waiting is not
    allowed): the first call of such a problem is refused by name, writing nothing; once an
    eager call has made the constant, the problem is captured like any other."""
    monkeypatch.setattr(call, "_constants", {})
    p = problem(fake.array, 0)
    args = (p["input"], None, p["bias"], p["mean"], p["var"])
    out = fake.array(SHAPE, 0)
    fake.capturing.add(CALL_STREAM)
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: weight is None.*before the capture"):
        batch_norm_forward_inference(*args, stream=CALL_STREAM, out=out)
    assert not [entry for entry in fake.log if entry[0] in ("fill", "sync")]
    assert not fake.cudnn.named("cudnnBatchNormalizationForwardInference")
    fake.capturing.clear()
    batch_norm_forward_inference(*args, stream=CALL_STREAM, out=out)
    fake.capturing.add(CALL_STREAM)
    fake.log.clear()
    batch_norm_forward_inference(*args, stream=CALL_STREAM, out=out)
    assert not [entry for entry in fake.log if entry[0] in ("fill", "sync", "alloc")]
    assert len(fake.cudnn.named("cudnnBatchNormalizationForwardInference")) == 2


# --- finding 11: CuPy 14 --------------------------------------------------------------------


def test_cupy_14_streams_come_from_from_external(fake):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        run_all(problem(fake.array, 0), stream=CALL_STREAM)
    assert fake.external_streams == 0


def test_cupy_13_streams_come_from_external_stream(stub, monkeypatch):
    fake = FakeCupy(CURRENT, from_external=False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "_streams", {})
    monkeypatch.setattr(cuda, "stream_scope", REAL_SEAM["stream_scope"])
    monkeypatch.setattr(cuda, "current_device", REAL_SEAM["current_device"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with cuda.stream_scope(CALL_STREAM, 0):
            assert fake.cuda.get_current_stream().ptr == CALL_STREAM
    assert fake.external_streams == 1


@pytest.mark.parametrize("kind", ["cupy", "array interface"])
def test_bfloat16_arrays_through_the_array_interface(fake, kind):
    """CuPy 14's bfloat16 exports typestr "<V2", which names no float: the dtype does."""
    array = fake.array(SHAPE, dtype=ml_dtypes.bfloat16)
    assert array.__cuda_array_interface__["typestr"] == "<V2"
    if kind == "array interface":
        array = Foreign(array, dtype=ml_dtypes.bfloat16)
    assert operand("input", array).desc.dtype == DataType.BF16


def test_resolve_stream_is_the_call_stream_of_the_arrays_device(fake):
    """What code composing passes (``cudnn_bn.distributed``) runs on: the array API's stream."""
    from cudnn_bn.api import resolve_stream

    x = fake.array(SHAPE, 1)
    assert resolve_stream(None, x) == CURRENT[1]
    assert resolve_stream(CALL_STREAM, x) == CALL_STREAM
    assert resolve_stream(None, np.zeros(SHAPE)) == 0


def test_a_channels_last_output_is_one_packed_block_in_the_inputs_layout(fake, stub):
    """CuPy outputs are allocated as NumPy's are: packed in the input's memory order, then
    transposed to its axes (``kinds._in_memory_order``)."""
    n, h, w = 2, 3, 4
    item = np.dtype(np.float32).itemsize
    strides = (h * w * C * item, item, w * C * item, C * item)  # NHWC
    base = fake.array((n * C * h * w,))
    x = FakeArray(fake, (n, C, h, w), np.float32, base.data.ptr, 0, strides)
    per_channel = [fake.array((C,)) for _ in range(4)]
    y = batch_norm_forward_inference(x, *per_channel)
    assert y.shape == x.shape and y.strides == x.strides
    blocks = [entry for entry in fake.log if entry[0] == "alloc"]
    assert [(size, ptr) for *_, size, ptr in blocks] == [(base.nbytes, y.data.ptr)]


# --- finding 12: host cost of a repeated call (issue 17) ----------------------------------------


def package_calls(call) -> int:
    """Python functions of ``cudnn_bn`` entered by one ``call()`` after a first one planned it."""
    call()
    entered = [0]

    def profile(frame, event, arg) -> None:
        entered[0] += event == "call" and "/cudnn_bn/" in frame.f_code.co_filename

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered[0]


def test_a_batched_call_adds_little_to_the_backward_it_runs(fake):
    """A repeated batched call is one pass of the call path (``batched_pass``): its plan's
    launch gathers and runs the folded backward, with no second trip through the array API
    (its argument handling, options, key and error wrapper) and no folding or unfolding of
    arrays, so it enters at most 8 more of the package's functions than the one backward
    call on its folded arrays (6 today; 15 when it folded by views and copies and ran the
    backward's plan on them)."""
    x, w = fake.array((4, *SHAPE)), fake.array((4, C))
    n, c, *rest = SHAPE
    folded_x, folded_w = fake.array((n, 4 * c, *rest)), fake.array((4 * c,))
    batched = package_calls(lambda: batch_norm_backward_batched(x, x, w, None, None))
    one = package_calls(lambda: batch_norm_backward(folded_x, folded_x, folded_w, None, None))
    assert batched - one <= 8, (batched, one)


def test_a_repeated_batched_call_allocates_its_outputs_and_launches_one_gather(fake, stub):
    """Issue 17: a batched call on CuPy arrays folded by its library (per call two
    ``swapaxes`` and ``ascontiguousarray``, an allocation and a copy each, a new ``(B, C)``
    array filled from a shared weight, reshapes, a whole inner backward call, views of its
    results: 19 library operations). Now its plan gathers every operand no view folds by one
    kernel launch on the call's stream, into the front of the stream's workspace, where the
    launch's table was written once, by the first call there; a repeated call allocates
    only its outputs (in the folded problem's memory order: the batch's results as they are)
    and hands cuDNN the gathered operands and those outputs."""
    batch, (_, c, *rest) = 2, SHAPE
    x, dy, w = fake.array((batch, *SHAPE)), fake.array((batch, *SHAPE)), fake.array((C,))
    for call_number in range(3):
        fake.log.clear()
        got = batch_norm_backward_batched(x, dy, w, None, None, stream=CALL_STREAM)
        kinds = [entry[0] for entry in fake.log]
        if call_number == 0:  # the outputs, then the stream's workspace and its table
            assert kinds == ["alloc"] * 4 + ["memcpy", "launch"], kinds
            workspace, table = fake.log[3][4], fake.log[4]
            assert table[1:4] == (0, CALL_STREAM, workspace)
        else:
            assert kinds == ["alloc"] * 3 + ["launch"], kinds
        allocated = [entry[4] for entry in fake.log if entry[0] == "alloc"]
        (_, device, stream, name, _, _, args) = fake.launches()[0]
        assert (device, stream, name) == (0, CALL_STREAM, "cudnn_bn_gather_3")
        assert args == (workspace, x.data.ptr, dy.data.ptr, w.data.ptr)
        call = stub.backward
        # the gathered operands between the table and cuDNN's own workspace
        assert all(workspace < p < call.workspace for p in (call.x, call.dy, call.scale))
        assert [call.dx, call.dscale, call.dbias] == allocated[:3]
        gx, gw, gb = got
        assert [gx.data.ptr, gw.data.ptr, gb.data.ptr] == allocated[:3]
        assert gx.shape == (batch, *SHAPE) and gw.shape == gb.shape == (batch, C)
        assert gx.strides[:3] == (c * 4 * math.prod(rest), batch * c * 4 * math.prod(rest),
                                  4 * math.prod(rest))  # fmt: skip
    assert stub.backward.calls == 3


def test_batched_operands_a_packed_view_folds_are_not_gathered(fake, stub):
    """``(B, C)`` weight rows are the folded problem's ``(B*C,)`` weight as they lie, and
    data whose problems sit side by side in the channels (a ``(N, B, C, ...)`` array
    swapped) its ``(N, B*C, ...)`` data: nothing to gather, no kernel launched."""
    n, c, *rest = SHAPE
    x = fake.array((n, 2, c, *rest)).swapaxes(0, 1)
    w = fake.array((2, C))
    batch_norm_backward_batched(x, x, w, None, None, stream=CALL_STREAM)
    assert fake.launches() == [] and not [e for e in fake.log if e[0] == "memcpy"]
    assert (stub.backward.x, stub.backward.scale) == (x.data.ptr, w.data.ptr)


def test_a_batched_problems_first_call_on_a_capturing_stream_is_refused(fake, stub):
    """The gather table is written into a stream's workspace from host memory, which a
    stream capturing a CUDA graph cannot take: a problem's first call there is refused,
    saying so, launching nothing; after one call on the stream, the problem is captured like any
    other, allocating its outputs and launching the gather, uploading nothing."""
    x, w = fake.array((2, *SHAPE)), fake.array((C,))
    fake.capturing.add(CALL_STREAM)
    with pytest.raises(InfiniError, match=r"^BAD_PARAM: .*gather table.*before the capture"):
        batch_norm_backward_batched(x, x, w, None, None, stream=CALL_STREAM)
    assert fake.launches() == [] and stub.backward.calls == 0
    fake.capturing.clear()
    batch_norm_backward_batched(x, x, w, None, None, stream=CALL_STREAM)
    fake.capturing.add(CALL_STREAM)
    fake.log.clear()
    batch_norm_backward_batched(x, x, w, None, None, stream=CALL_STREAM)
    assert [entry[0] for entry in fake.log] == ["alloc"] * 3 + ["launch"]
    assert stub.backward.calls == 2


def test_each_thread_gathers_into_its_own_workspace_on_the_per_thread_stream(fake, stub):
    """On ``cudaStreamPerThread`` each thread has its own workspace (``call.Workspaces``),
    so each gets the gather table written into its own and its gather launched there."""
    x, w = fake.array((2, *SHAPE)), fake.array((C,))
    run = lambda: batch_norm_backward_batched(x, x, w, None, None, stream=2)  # noqa: E731
    run()
    in_thread(run)
    copies = [entry for entry in fake.log if entry[0] == "memcpy"]
    launches = fake.launches()
    assert [entry[2] for entry in copies + launches] == [2] * 4
    assert copies[0][3] != copies[1][3]
    assert [launch[6][0] for launch in launches] == [copies[0][3], copies[1][3]]


def test_batched_edge_cases_on_the_device(fake, stub):
    """B = 0: one problem's layout validated, empty results, nothing launched; N = 0: zero
    grad_weight/grad_bias queued on the call's stream, no gather; ``weight=None`` with an
    output mask: only grad_input comes back, the unwanted gradients land in the workspace;
    a bad operand is named as the caller passed it."""
    _, c, *rest = SHAPE
    x = fake.array((0, *SHAPE))
    gx, gw, gb = batch_norm_backward_batched(x, x, fake.array((C,)), None, None)
    assert (gx.shape, gw.shape, gb.shape) == ((0, *SHAPE), (0, C), (0, C))
    assert fake.launches() == [] and stub.backward.calls == 0
    x = fake.array((2, 0, c, *rest))
    gx, gw, gb = batch_norm_backward_batched(x, x, fake.array((C,)), None, None, stream=CALL_STREAM)
    assert gx.shape == (2, 0, c, *rest) and gw.shape == gb.shape == (2, C)
    memsets = [entry for entry in fake.log if entry[0] == "memset"]
    assert [e[1:4] for e in memsets] == [
        (0, CALL_STREAM, gw.data.ptr),
        (0, CALL_STREAM, gb.data.ptr),
    ]
    assert fake.launches() == [] and stub.backward.calls == 0
    x = fake.array((2, *SHAPE))
    fake.log.clear()
    got = batch_norm_backward_batched(x, x, None, None, None, output_mask=(True, False, False))
    assert got[1:] == (None, None) and got[0].shape == (2, *SHAPE)
    # grad_input, the ones standing in for the weight (made once) and the workspace
    assert len(fake.allocations()) == 3
    assert [entry[4] for entry in fake.log if entry[0] == "fill"] == [1.0]
    workspace = fake.launches()[0][6][0]
    # the gather's front of the workspace, then the backward's own, which holds the scratch
    # that receives the gradients nobody asked for
    assert workspace < stub.backward.workspace < stub.backward.dscale
    with pytest.raises(InfiniError, match=r"^BAD_TENSOR_SHAPE: weight has shape \(4,\)"):
        batch_norm_backward_batched(x, x, fake.array((C + 1,)), None, None)
    with pytest.raises(InfiniError, match="grad_output") as caught:
        batch_norm_backward_batched(x, fake.array((2, *SHAPE), dtype=np.float64), None, None, None)
    assert caught.value.status == Status.BAD_TENSOR_DTYPE


def test_a_batched_producer_goes_through_the_door_on_every_call(fake, stub):
    """An operand that is neither a CuPy array nor a torch tensor (here a CUDA array
    interface) is read by the door on every call, hit or miss, and gathered from where it
    says its memory is; the results are CuPy arrays (the input's kind)."""
    x, w = fake.array((2, *SHAPE)), fake.array((C,))
    dy = Foreign(fake.array((2, *SHAPE)), stream=None)
    for _ in range(2):
        fake.log.clear()
        got = batch_norm_backward_batched(x, dy, w, None, None, stream=CALL_STREAM)
        (launch,) = fake.launches()
        assert launch[6][1:] == (x.data.ptr, dy.__cuda_array_interface__["data"][0], w.data.ptr)
        assert all(type(g) is FakeArray for g in got)


# --- review 8: addresses on a plan's hit -----------------------------------------------------


@pytest.mark.parametrize("address", [-(1 << 20), 1 << 64])
@pytest.mark.parametrize("name", ["input", "weight"])
def test_a_cupy_address_that_is_no_pointer_is_refused_on_a_hit(fake, stub, name, address):
    """The door refuses an address outside [0, 2**64) ("not a pointer"); a plan's call must
    too, before it allocates or launches. CuPy's ``MemoryPointer.ptr`` is an ``intptr_t``
    (cupy/cuda/memory.pxd), so a negative one can reach us; 2**64, the stand-in's, would
    reach cuDNN as NULL through ctypes (review 8 of issue 17)."""
    good = problem(fake.array, 0)
    run_all(good)  # the plans, on good addresses
    bad = dict(good)
    bad[name] = FakeArray(fake, good[name].shape, np.float32, address, 0)
    launches = len(fake.cudnn.calls)
    allocations = len(fake.allocations())
    with pytest.raises(InfiniError, match=f"{name} has data address {address}, not a pointer"):
        run_all(bad)
    assert len(fake.cudnn.calls) == launches and len(fake.allocations()) == allocations


@pytest.mark.parametrize("address", [-(1 << 20), 1 << 64])
def test_an_empty_operands_address_is_checked_on_a_hit_too(fake, stub, address):
    """The door's range check holds for every operand, one with no elements too."""
    x, w = fake.array((0, C, 4, 5), 0), fake.array((C,), 0)
    batch_norm_backward(x, x, w, None, None)  # the plan
    bad = FakeArray(fake, x.shape, np.float32, address, 0)
    with pytest.raises(InfiniError, match=f"input has data address {address}, not a pointer"):
        batch_norm_backward(bad, x, w, None, None)


@pytest.mark.parametrize("name", ["input", "weight"])
@pytest.mark.parametrize(
    "address",
    [lambda good: good + 2, lambda good: 0, lambda good: -good],
    ids=["misaligned", "NULL", "negative"],
)
def test_a_repeated_batched_problem_checks_addresses_on_the_device_too(fake, stub, name, address):
    """A batched problem's plan gathers the data (these strides allow no view) and a shared
    weight before the backward sees them: its call checks their addresses as the door
    would (``call.Aligned``), naming the argument, before any allocation or launch."""
    good = {"input": fake.array((2, *SHAPE)), "weight": fake.array((C,))}
    batch_norm_backward_batched(good["input"], good["input"], good["weight"], None, None)
    bad = dict(good)
    bad[name] = FakeArray(fake, good[name].shape, np.float32, address(good[name].data.ptr), 0)
    log, calls = len(fake.log), len(fake.cudnn.calls)
    with pytest.raises(InfiniError, match=name):
        batch_norm_backward_batched(bad["input"], good["input"], bad["weight"], None, None)
    assert len(fake.log) == log and len(fake.cudnn.calls) == calls  # no copy, no launch


class Shifting:
    """A CUDA-array-interface producer whose interface names ``first``'s memory on its first
    ``reads`` reads (``hasattr`` reads it too) and ``then``'s after: an attacker's, or one
    racing a writer."""

    def __init__(self, first: FakeArray, then: FakeArray, reads: int) -> None:
        self.first, self.then, self.reads = first, then, reads

    @property
    def __cuda_array_interface__(self) -> dict:
        self.reads -= 1
        return (self.first if self.reads >= 0 else self.then).__cuda_array_interface__


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("reads", range(1, 8))
@pytest.mark.parametrize("moved", ["input", "weight"])
def test_an_interface_that_moves_to_another_device_between_reads(fake, stub, moved, reads, planned):
    """The door finds the call's device (``common_place``) and then describes each operand's
    memory, reading an interface several times: one that names another device's memory
    from some read on (an attacker's; found attacking the door) must not have the call run
    on one device with the other's pointer (on a GPU, an illegal address). Whatever the
    read it moves at, new problem or planned (a plan's key holds each operand's own
    device): refused, BAD_PARAM naming it, before anything is allocated or launched, or run
    with the memory of one device."""
    names = ("input", "weight", "bias", "mean", "var")
    p = problem(fake.array, 1)
    if planned:
        batch_norm_forward_inference(*(p[n] for n in names))
    elsewhere = fake.array(p[moved].shape, device=0)
    p[moved] = Shifting(p[moved], elsewhere, reads)
    before, calls = len(fake.allocations()), stub.forward_inference.calls
    try:
        batch_norm_forward_inference(*(p[n] for n in names))
    except InfiniError as error:
        assert error.status == Status.BAD_PARAM and f"{moved} on NVIDIA:0" in str(error)
        assert len(fake.allocations()) == before and stub.forward_inference.calls == calls
        return
    read = stub.forward_inference.x if moved == "input" else stub.forward_inference.scale
    assert stub.forward_inference.calls == calls + 1 and read != elsewhere.data.ptr


def _other_strides(iface: dict) -> tuple[int, ...]:
    """Another layout of an interface's shape that the stand-ins take without a view of
    CuPy's: channels-last for ``(N, C, H, W)``, a stride of 0 (refused: a written operand
    with overlapping elements) for ``(C,)``."""
    if len(iface["shape"]) == 1:
        return (0,)
    _, c, h, w = iface["shape"]
    item = iface["strides"][-1]
    return c * h * w * item, item, w * c * item, c * item


# What a turning CUDA array interface (``DeviceTurning``) over one of the problem's arrays
# says from its k-th read on (``other``: another array of its shape on its device), valid
# or not.
_DEVICE_TURNS = {
    "pointer": lambda iface, other: iface | {"data": (other.data.ptr, False)},
    "shape": lambda iface, other: iface | {"shape": (iface["shape"][0] + 1, *iface["shape"][1:])},
    "strides": lambda iface, other: iface | {"strides": _other_strides(iface)},
    "typestr": lambda iface, other: iface | {"typestr": "<f8"},
    "read_only": lambda iface, other: iface | {"data": (iface["data"][0], True)},
    "mask": lambda iface, other: iface | {"mask": 1},
    "stream": lambda iface, other: iface | {"stream": PRODUCER_STREAM},
}


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("k", range(1, 5))
@pytest.mark.parametrize("turn", _DEVICE_TURNS)
@pytest.mark.parametrize("name", ["input", "mean"])
def test_a_cuda_array_interface_is_read_once_per_call_and_the_call_runs_on_that_read(
    fake, stub, name, turn, k, planned
):
    """A CUDA array interface whose dict changes from read ``k`` on (another pointer, shape,
    strides, typestr, read-only flag, a mask, a stream) is read once per call, and the call
    does what it does for a producer that always says what that read said: refused naming
    it, or cuDNN given that read's pointer and layout, after waiting for that read's stream.
    The door read one 4 times on a plan's hit and 6 on a new problem (presence tests, the
    place, the owning device, the description)."""
    p = problem(fake.array, 1)
    first = dict(p[name].__cuda_array_interface__, stream=None)
    other = fake.array(p[name].shape, device=1)
    then = _DEVICE_TURNS[turn](first, other)
    caller = {first["data"][0], other.data.ptr}
    spelled = {"mean": "running_mean"}.get(name, name)

    def attempt(producer: DeviceTurning) -> tuple:
        """The call's error, or what cuDNN and the kernels were given of the caller's
        memory, in the cache state ``planned`` says."""
        cudnn_bn.descriptor_cache.clear()
        args = [p["input"], p["weight"], p["bias"], p["mean"], p["var"]]
        at = ["input", "weight", "bias", "mean", "var"].index(name)
        if planned:
            args[at] = DeviceTurning(first, first, 1)
            batch_norm_forward_training(*args)
        args[at], log = producer, len(fake.log)
        stub.forward_training.calls = 0
        try:
            batch_norm_forward_training(*args)
        except InfiniError as error:
            assert spelled in str(error) and stub.forward_training.calls == 0
            return type(error), str(error)
        record = stub.forward_training
        given = [getattr(record, field) for field, _ in record._fields_]
        given += [a for e in fake.log[log:] if e[0] == "launch" for a in e[6]]
        waits = [e for e in fake.log[log:] if e[0] == "wait"]
        used = {a for a in given if isinstance(a, int) and a in caller}
        return stub.tensor(record.x_desc), used, waits

    attacker = DeviceTurning(first, then, k)
    got = attempt(attacker)
    assert attacker.reads == 1
    honest = first if k > 1 else then
    assert got == attempt(DeviceTurning(honest, honest, 1))


# --- each stream= object read once per call -----------------------------------------------------


class TurningStream:
    """A ``stream=`` object whose address turns from ``CALL_STREAM`` to ``OTHER_STREAM``
    after its first read, as ``__cuda_stream__()`` (``form`` "protocol") or a ``ptr``
    property (CuPy's); ``reads`` counts the reads of each of its attributes."""

    def __init__(self, form: str) -> None:
        self.form, self.reads = form, {}

    def _address(self, what: str) -> int:
        self.reads[what] = self.reads.get(what, 0) + 1
        return CALL_STREAM if self.reads[what] == 1 else OTHER_STREAM

    def __getattr__(self, name: str):
        if (name, self.form) == ("__cuda_stream__", "protocol"):
            return lambda: (0, self._address(name))
        if (name, self.form) == ("ptr", "ptr"):
            return self._address(name)
        self.reads[name] = self.reads.get(name, 0) + 1
        raise AttributeError(name)


OTHER_STREAM = 0x6C00


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("door", [False, True], ids=["cupy", "interface"])
@pytest.mark.parametrize("form", ["protocol", "ptr"])
def test_a_stream_object_is_read_once_per_call(fake, stub, form, door, planned):
    """A ``stream=`` object is read once per call: the stream its first read names is the
    one allocations come from, the launch runs on and producers are ordered before. The
    door's path read one 2 to 3 times a call (the consumer's stream, the plan's build, the
    plan's call), each read a ``hasattr`` and a get."""
    p = problem(fake.array, 0)
    args = [p["input"], p["weight"], p["bias"], p["mean"], p["var"]]
    if door:
        args[3] = Foreign(p["mean"], PRODUCER_STREAM)
    if planned:
        batch_norm_forward_training(*args, stream=CALL_STREAM)
    log, stream = len(fake.log), TurningStream(form)
    batch_norm_forward_training(*args, stream=stream)
    wanted = "__cuda_stream__" if form == "protocol" else "ptr"
    assert stream.reads.get(wanted) == 1
    assert all(n == 1 for n in stream.reads.values()), stream.reads
    entries = fake.log[log:]
    assert {e[1:3] for e in entries if e[0] in ("alloc", "launch")} == {(0, CALL_STREAM)}
    assert {e[2] for e in entries if e[0] == "wait"} <= {CALL_STREAM}
    assert stub.set_stream.stream == CALL_STREAM


class TurningDict(dict):
    """A CUDA array interface dict holding ``first`` that answers ``then``'s value for a key
    from the key's second look on (``__getitem__``, ``get``); ``reads`` counts the looks."""

    def __init__(self, first: dict, then: dict) -> None:
        super().__init__(first)
        self.then, self.reads = then, {}

    def __getitem__(self, key):
        self.reads[key] = self.reads.get(key, 0) + 1
        return (super().__getitem__ if self.reads[key] == 1 else self.then.__getitem__)(key)

    def get(self, key, default=None):
        if key not in self:
            return default
        return self[key]


class TurningPair(tuple):
    """A ``data`` pair whose items, looked at again, name ``then``'s (``__getitem__``)."""

    def __new__(cls, first: tuple, then: tuple) -> "TurningPair":
        pair = super().__new__(cls, first)
        pair.then, pair.reads = then, 0
        return pair

    def __getitem__(self, index):
        self.reads += 1
        return tuple.__getitem__(self, index) if self.reads <= 2 else self.then[index]


class LyingAddress(int):
    """An address whose comparisons and remainders say it is an aligned pointer."""

    def __mod__(self, other):
        return 0

    def __and__(self, other):
        return 0


@pytest.mark.parametrize("planned", [False, True], ids=["new", "planned"])
@pytest.mark.parametrize("turn", [*_DEVICE_TURNS, "pair"])
def test_a_cuda_array_interface_dict_is_looked_at_once_per_call(fake, stub, turn, planned):
    """The dict a CUDA array interface returns is read as one snapshot: a dict subclass
    whose keys, or a ``data`` tuple subclass whose items, answer otherwise when looked at
    again cannot have the owning device found from one pointer and cuDNN given another (the
    door looked at ``data`` in ``common_place`` and again in the operand, and at each of its
    items twice)."""
    p = problem(fake.array, 1)
    first = dict(p["mean"].__cuda_array_interface__, stream=None)
    other = fake.array(p["mean"].shape, device=0)
    then = _DEVICE_TURNS.get(turn, _DEVICE_TURNS["pointer"])(first, other)

    def attempt(iface: dict) -> tuple:
        cudnn_bn.descriptor_cache.clear()
        args = [p["input"], p["weight"], p["bias"], Foreign(p["mean"]), p["var"]]
        if planned:
            batch_norm_forward_training(*args)
        args[3].__cuda_array_interface__, log = iface, len(fake.log)
        stub.forward_training.calls = 0
        batch_norm_forward_training(*args)
        record = stub.forward_training
        waits = [e for e in fake.log[log:] if e[0] == "wait"]
        return stub.tensor(record.x_desc), record.running_mean, fake.allocations()[-1], waits

    if turn == "pair":
        pair = TurningPair(first["data"], then["data"])
        got = attempt(dict(first, data=pair))
    else:
        got = attempt(TurningDict(first, then))
    assert got == attempt(first)


def test_an_interface_address_is_read_as_its_int_value(fake):
    """An int subclass as the address is its value, whatever its ``%`` says: misaligned."""
    p = problem(fake.array, 0)
    iface = p["mean"].__cuda_array_interface__
    bad = Foreign(p["mean"])
    bad.__cuda_array_interface__ = dict(iface, data=(LyingAddress(iface["data"][0] + 1), False))
    with pytest.raises(InfiniError, match=r"running_mean.*not aligned"):
        batch_norm_forward_training(p["input"], p["weight"], p["bias"], bad, p["var"])
    assert fake.allocations() == []
