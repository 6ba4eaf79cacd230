"""Stand-ins for CuPy and torch's CUDA side that record where everything happens.

``FakeCupy`` is a ``cupy`` module for ``sys.modules`` with two devices, a current device, a
current stream per device (CuPy's stream stack), ``Stream.from_external`` and the deprecated
``ExternalStream``, events, ``cudaPointerGetAttributes`` over the fake arrays it made, and a
memory pool that records the device and current stream of every allocation (CuPy's pool
takes memory from the current stream's arena), fills, copies from the host, kernel launches
(``RawKernel``) and stream synchronizations, and streams
marked as capturing a CUDA graph (``capturing``), which refuse to synchronize as CUDA
does. ``FakeArray`` looks like a CuPy array to the package (``__module__`` is ``cupy``,
``.device.id``, ``.data.ptr``, the CUDA array interface). ``fake_torch`` patches torch's
stream and allocation calls in the same way. Nothing is ever dereferenced: the stub
libcudnn (``cudnn_stub.py``) only records pointers.

``RecordingLibrary`` wraps the stub libcudnn and records, for each cuDNN call that matters
here, the fake current device and the calling thread.
"""

import ctypes
import dataclasses
import itertools
import math
import threading
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from cudnn_bn._cudnn.library import CudnnLibrary

DEVICES = 2
BASE = 0x7100_0000_0000  # fake device addresses, 1 MiB apart, above 2^32


class _Pointer:
    """CuPy's ``MemoryPointer``: its address and its device's id."""

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr, self.device_id = ptr, device_id


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """CuPy's ``Device``: its ``id``; hashable, as the package keys its constants by it."""

    id: int


_FAKE_DEVICES = {d: FakeDevice(d) for d in range(DEVICES)}  # one object per device, as CuPy's


class FakeArray:
    """A strided array on a fake device: what the package reads of a CuPy array."""

    def __init__(self, fake, shape, dtype, ptr, device, strides=None) -> None:
        self._fake, self.shape, self.dtype = fake, tuple(shape), np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(self.shape)
        self.strides = strides or _packed_strides(self.shape, self.itemsize)
        self.data, self.device = _Pointer(ptr, device), _FAKE_DEVICES[device]
        self.nbytes = math.prod(self.shape) * self.itemsize

    def __getitem__(self, index: int) -> "FakeArray":
        ptr = self.data.ptr + index * self.strides[0]
        return FakeArray(
            self._fake, self.shape[1:], self.dtype, ptr, self.device.id, self.strides[1:]
        )

    def transpose(self, *axes: int) -> "FakeArray":
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], tuple) else axes
        shape, strides = (tuple(values[a] for a in axes) for values in (self.shape, self.strides))
        return FakeArray(self._fake, shape, self.dtype, self.data.ptr, self.device.id, strides)

    def swapaxes(self, a: int, b: int) -> "FakeArray":
        return FakeArray(
            self._fake, _swap(self.shape, a, b), self.dtype, self.data.ptr, self.device.id,
            _swap(self.strides, a, b),
        )  # fmt: skip

    def reshape(self, *shape: int) -> "FakeArray":
        """A packed array's view in another shape (all the package reshapes): one new array,
        as its other views cost (CuPy 14.2's reshape, swapaxes and ``a[0]`` each cost 1.3 to
        1.7 us on the development machine, a ``FakeArray`` about 2 us)."""
        packed = _packed_strides(self.shape, self.itemsize)
        assert self.strides == packed, "only packed fake arrays reshape"
        shape = _resolve_shape(shape, math.prod(self.shape))
        return FakeArray(self._fake, shape, self.dtype, self.data.ptr, self.device.id)

    def __setitem__(self, index: Any, value: Any) -> None:
        """A copy on CuPy's current stream: recorded as one of the fake's events."""
        fake = self._fake
        fake.log.append(("copy", fake.device, fake.stacks[fake.device][-1]))

    @property
    def __cuda_array_interface__(self) -> dict:
        """As CuPy exports it: ``stream`` is CuPy's current stream, whatever wrote the data."""
        typestr = "<V2" if self.dtype.name == "bfloat16" else self.dtype.str
        stream = self._fake.cuda.get_current_stream(self._fake.device).ptr or 1
        return {
            "shape": self.shape,
            "typestr": typestr,
            "strides": self.strides,
            "data": (self.data.ptr, False),
            "version": 3,
            "stream": stream,
        }


FakeArray.__module__ = "cupy"  # how the package tells CuPy arrays apart


def _packed_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) * itemsize for i in range(len(shape)))


def _swap(values: tuple, a: int, b: int) -> tuple:
    swapped = list(values)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    return tuple(swapped)


def _resolve_shape(shape: tuple, size: int) -> tuple[int, ...]:
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape = tuple(size // known if n == -1 else n for n in shape)
    return tuple(shape)


class FakeStream:
    """CuPy's stream object; ``device_id`` -1 (unknown) takes the current device on entry."""

    def __init__(self, fake, ptr: int, device_id: int = -1) -> None:
        self._fake, self.ptr, self.device_id = fake, ptr, device_id

    def __enter__(self) -> "FakeStream":
        device = self._fake.device if self.device_id == -1 else self.device_id
        if device != self._fake.device:  # CuPy's check_stream_device_match
            raise RuntimeError(f"stream of device {device} entered on {self._fake.device}")
        self._fake.stacks[device].append(self.ptr)
        self._fake.entered.append(device)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._fake.stacks[self._fake.entered.pop()].pop()

    def wait_event(self, event: "FakeEvent") -> None:
        self._fake.log.append(("wait", self._fake.device, self.ptr, event.recorded))

    def is_capturing(self) -> bool:
        return self.ptr in self._fake.capturing

    def synchronize(self) -> None:
        if self.is_capturing():  # cudaErrorStreamCaptureUnsupported
            raise RuntimeError("operation not permitted when stream is capturing")
        self._fake.log.append(("sync", self._fake.device, self.ptr))


class FakeEvent:
    def __init__(self, fake, block: bool = False, disable_timing: bool = False) -> None:
        self._fake, self.recorded = fake, None

    def record(self, stream: FakeStream) -> None:
        self.recorded = stream.ptr
        self._fake.log.append(("record", self._fake.device, stream.ptr))


class FakeRawKernel:
    """CuPy's ``RawKernel``: a launch is recorded as ``("launch", device, stream, name, grid,
    block, args)`` (the stream given, else CuPy's current one); nothing runs. Its arguments
    are checked as CuPy converts them (``cupy/cuda/function.pyx``, ``_pointer``): as many as
    the kernel's parameters, each an array or a scalar, a Python int within an int64."""

    def __init__(self, fake: "FakeCupy", code: str, name: str, **options: Any) -> None:
        self._fake, self.code, self.name = fake, code, name
        signature = code[code.index(f"void {name}(") :]
        self.parameters = signature[: signature.index(")")].count(",") + 1

    def __call__(self, grid: tuple, block: tuple, args: tuple, **options: Any) -> None:
        if len(args) != self.parameters:
            raise TypeError(f"{self.name} takes {self.parameters} arguments, got {len(args)}")
        for arg in args:
            if isinstance(arg, int) and not -(1 << 63) <= arg < 1 << 63:
                raise OverflowError("Python int too large to convert to C long")
            if not isinstance(arg, int | np.generic | FakeArray):
                raise TypeError(f"Unsupported type {type(arg)}")
        fake, stream = self._fake, options.get("stream")
        ptr = fake.stacks[fake.device][-1] if stream is None else stream.ptr
        fake.log.append(("launch", fake.device, ptr, self.name, grid, block, tuple(args)))


class FakeCupy(types.ModuleType):
    """A ``cupy`` with ``DEVICES`` devices whose current streams are ``current[device]``."""

    uint8 = np.uint8

    def __init__(self, current: dict[int, int], *, from_external: bool = True) -> None:
        super().__init__("cupy", "tests/fake_devices.py")
        self.ndarray = FakeArray  # CuPy's array class: the package keys these by attributes
        self.device = 0
        self.stacks = {d: [current.get(d, 0)] for d in range(DEVICES)}
        self.entered: list[int] = []
        self.log: list[tuple] = []  # ("alloc", device, stream, nbytes, ptr), events, memsets
        self.owners: dict[int, int] = {}  # allocation base -> device
        self.external_streams = 0  # ExternalStream objects made (deprecated in CuPy 14)
        self.capturing: set[int] = set()  # streams capturing a CUDA graph
        self._addresses = itertools.count(BASE, 0x10_0000)
        fake = self

        def set_device(device_id: int) -> None:
            assert 0 <= device_id < DEVICES
            fake.device = device_id

        def pointer_attributes(ptr: int) -> Any:
            base = max(b for b in fake.owners if b <= ptr)
            return types.SimpleNamespace(type=2, device=fake.owners[base])

        def external_stream(ptr: int, device_id: int = -1) -> FakeStream:
            warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
            fake.external_streams += 1
            return FakeStream(fake, ptr, device_id)

        stream_class = types.SimpleNamespace(null=FakeStream(self, 0))
        if from_external:
            stream_class.from_external = lambda obj: FakeStream(self, obj.__cuda_stream__()[1])
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(
                CUDARuntimeError=RuntimeError,
                getDeviceCount=lambda: DEVICES,
                getDevice=lambda: fake.device,
                setDevice=set_device,
                pointerGetAttributes=pointer_attributes,
                runtimeGetVersion=lambda: 12080,
                memsetAsync=lambda ptr, value, size, stream: fake.log.append(
                    ("memset", fake.device, stream, ptr, value, size)
                ),
                memcpyAsync=lambda dst, src, size, kind, stream: fake.log.append(
                    ("memcpy", fake.device, stream, dst, size, kind)
                ),
            ),
            Stream=stream_class,
            ExternalStream=external_stream,
            Event=lambda **kw: FakeEvent(fake, **kw),
            get_current_stream=lambda device_id=-1: FakeStream(
                fake, fake.stacks[fake.device if device_id == -1 else device_id][-1]
            ),
        )

    def RawKernel(self, code: str, name: str, **options: Any) -> FakeRawKernel:
        return FakeRawKernel(self, code, name, **options)

    def launches(self) -> list[tuple]:
        """Every kernel launch so far."""
        return [entry for entry in self.log if entry[0] == "launch"]

    def array(self, shape, device: int = 0, dtype: Any = np.float32) -> FakeArray:
        """An input array on ``device`` (made outside any call: not logged)."""
        ptr = next(self._addresses)
        self.owners[ptr] = device
        return FakeArray(self, shape, dtype, ptr, device)

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> FakeArray:
        ptr = next(self._addresses)
        self.owners[ptr] = self.device
        shape = shape if isinstance(shape, tuple) else (shape,)
        array = FakeArray(self, shape, dtype, ptr, self.device)
        self.log.append(("alloc", self.device, self.stacks[self.device][-1], array.nbytes, ptr))
        return array

    def full(self, shape: int | tuple[int, ...], value: float, dtype: Any) -> FakeArray:
        """``empty``, then a fill kernel on the current stream (logged; nothing is written)."""
        array = self.empty(shape, dtype)
        self.log.append(("fill", self.device, self.stacks[self.device][-1], array.data.ptr, value))
        return array

    def ascontiguousarray(self, array: FakeArray) -> FakeArray:
        """``array`` where it is packed, else a packed copy: allocated, and copied, on the
        current stream (what CuPy's own does)."""
        if array.strides == _packed_strides(array.shape, array.itemsize):
            return array
        copy = self.empty(array.shape, array.dtype)
        copy[...] = array
        return copy

    def allocations(self) -> list[tuple[int, int]]:
        """``(device, stream)`` of every allocation so far."""
        return [entry[1:3] for entry in self.log if entry[0] == "alloc"]

    def events(self) -> list[tuple]:
        return [entry for entry in self.log if entry[0] != "alloc"]


# --- torch -----------------------------------------------------------------------------------


class FakeTensor:
    """What the package reads of a torch CUDA tensor."""

    def __init__(self, shape, strides, dtype, device, ptr) -> None:
        self.shape, self._strides, self.dtype, self.device = shape, strides, dtype, device
        self._ptr = ptr

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def data_ptr(self) -> int:
        return self._ptr

    def record_stream(self, stream: Any) -> None:
        """Marks a later reuse (what the package did before allocating on the stream)."""

    def swapaxes(self, a: int, b: int) -> "FakeTensor":
        return FakeTensor(
            _swap(self.shape, a, b), _swap(self._strides, a, b), self.dtype, self.device, self._ptr
        )

    def reshape(self, *shape: int) -> "FakeTensor":
        """A packed tensor's view in another shape (all the package reshapes)."""
        assert tuple(self._strides) == _packed(self.shape), "only packed fake tensors reshape"
        shape = _resolve_shape(shape, int(np.prod(self.shape, dtype=int)))
        return FakeTensor(shape, _packed(shape), self.dtype, self.device, self._ptr)

    def __setitem__(self, index: Any, value: Any) -> None:
        """A copy: its data is not simulated."""

    def contiguous(self) -> "FakeTensor":
        """A packed copy, from torch's allocator on the current stream (its data is not
        simulated), or the tensor itself where it is packed."""
        import torch

        if tuple(self._strides) == _packed(self.shape):
            return self
        return torch.empty_strided(self.shape, _packed(self.shape), dtype=self.dtype,
                                   device=self.device)  # fmt: skip

    def is_neg(self) -> bool:
        return False

    def is_conj(self) -> bool:
        return False

    def __getitem__(self, index: int) -> "FakeTensor":
        element = self.dtype.itemsize
        ptr = self._ptr + index * self._strides[0] * element
        return FakeTensor(self.shape[1:], self._strides[1:], self.dtype, self.device, ptr)

    @property
    def ndim(self) -> int:
        return len(self.shape)


FakeTensor.__module__ = "torch"


def _packed(shape: tuple) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[i + 1 :], dtype=int)) for i in range(len(shape)))


@contextmanager
def fake_torch(monkeypatch, current: dict[int, int]) -> Iterator[list[tuple]]:
    """torch's CUDA streams and allocations stood in for: ``current[device]`` is each
    device's current stream; yields the log of ``(device index, stream)`` per allocation."""
    import torch

    log: list[tuple] = []
    stacks = {d: [current.get(d, 0)] for d in range(DEVICES)}
    addresses = itertools.count(BASE + 0x1000_0000, 0x10_0000)

    class Stream:
        def __init__(self, stream_ptr: int, device: Any = None) -> None:
            self.cuda_stream, self.device_index = stream_ptr, device

    @contextmanager
    def stream(s: Stream) -> Iterator[None]:
        stacks[s.device_index].append(s.cuda_stream)
        yield
        stacks[s.device_index].pop()

    def allocate(shape, strides, device) -> int:
        log.append((device.index, stacks[device.index][-1]))
        return next(addresses)

    def empty_strided(shape, strides, *, dtype, device):
        return FakeTensor(shape, strides, dtype, device, allocate(shape, strides, device))

    def empty(size, *, dtype, device):
        return FakeTensor((size,), (1,), dtype, device, allocate((size,), (1,), device))

    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device=None: types.SimpleNamespace(cuda_stream=stacks[device.index][-1]),
    )
    monkeypatch.setattr(torch.cuda, "ExternalStream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "empty_strided", empty_strided)
    monkeypatch.setattr(torch, "empty", empty)
    yield log


# Distinct addresses for the fake tensors: the array API refuses outputs that share memory.
_TENSORS = itertools.count(BASE + 0x2000_0000, 0x10_0000)


def torch_tensor(shape, device: int, dtype: Any = None) -> FakeTensor:
    """A contiguous fake torch CUDA tensor on ``device`` (float32 by default)."""
    import torch

    strides = tuple(int(np.prod(shape[i + 1 :], dtype=int)) for i in range(len(shape)))
    where = types.SimpleNamespace(type="cuda", index=device)
    return FakeTensor(tuple(shape), strides, dtype or torch.float32, where, next(_TENSORS))


# --- cuDNN -----------------------------------------------------------------------------------

RECORDED = (
    "cudnnCreate",
    "cudnnDestroy",
    "cudnnSetStream",
    "cudnnBatchNormalizationBackwardEx",
    "cudnnBatchNormalizationForwardTrainingEx",
    "cudnnBatchNormalizationForwardInference",
)


class RecordingLibrary(CudnnLibrary):
    """The stub libcudnn, recording ``(function, current device, thread)`` per call of
    ``RECORDED``; ``device`` reads the fake current device (0 where there is none), which
    every call tells the stub (it refuses a handle used off the device it was made on)."""

    def __init__(self, library: CudnnLibrary, device=lambda: 0) -> None:
        super().__init__(library._cdll, library.info)
        self.calls: list[tuple[str, int, str]] = []
        self._device = device
        self._stub_device = ctypes.c_int64.in_dll(library._cdll, "stub_device")

    def __getattr__(self, name: str) -> Any:
        func = super().__getattr__(name)

        def recorded(*args: Any) -> Any:
            device = self._device()
            self._stub_device.value = device
            if name in RECORDED:
                self.calls.append((name, device, threading.current_thread().name))
            return func(*args)

        recorded.__name__ = name
        setattr(self, name, recorded)
        return recorded

    def named(self, name: str) -> list[tuple[int, str]]:
        return [(device, thread) for function, device, thread in self.calls if function == name]
