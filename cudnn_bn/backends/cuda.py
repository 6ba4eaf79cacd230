"""The few CUDA runtime facts the NVIDIA backend needs, through CuPy, imported on first use.

Kept in one place so that importing ``cudnn_bn`` never imports CuPy, and so that tests
without a GPU can stand in for the device (``tests/test_nvidia_arguments.py``).
"""

import sys
from typing import Any

from .._cudnn.loader import INSTALL_HINT
from ..enums import Status
from ..errors import InfiniError


def cupy_module() -> Any:
    """CuPy, imported on first use (DEVICE_NOT_INITIALIZED where it cannot be)."""
    cupy = sys.modules.get("cupy")  # imported already: no import statement on each call
    if cupy is not None:
        return cupy
    try:
        import cupy
    except ImportError as exc:
        raise InfiniError(
            Status.DEVICE_NOT_INITIALIZED,
            f"CuPy is needed for arrays on NVIDIA devices ({exc}): {INSTALL_HINT}",
        ) from exc
    return cupy


def _runtime_call(what: str, fn: Any, *args: Any) -> Any:
    cupy = cupy_module()
    try:
        return fn(*args)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise _failed(what, exc) from exc


def _failed(what: str, exc: Exception) -> InfiniError:
    return InfiniError(Status.DEVICE_NOT_INITIALIZED, f"{what} failed: {exc}")


def device_count() -> int:
    """How many CUDA devices there are; DEVICE_NOT_INITIALIZED where CUDA cannot start."""
    return _runtime_call("cudaGetDeviceCount", cupy_module().cuda.runtime.getDeviceCount)


def current_device() -> int:
    """The CUDA device current in this thread (asked on every compute, so with no
    ``_runtime_call`` in between)."""
    runtime = cupy_module().cuda.runtime
    try:
        return runtime.getDevice()
    except runtime.CUDARuntimeError as exc:
        raise _failed("cudaGetDevice", exc) from exc


class on_device:
    """Make ``device_id`` current for the block, switching only when it is not already
    (a class, not a generator: it runs on every compute)."""

    __slots__ = ("device_id", "previous")

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.previous != self.device_id:
            _runtime_call("cudaSetDevice", cupy_module().cuda.runtime.setDevice, self.device_id)

    def __exit__(self, *exc_info: object) -> None:
        if self.previous != self.device_id:
            cupy_module().cuda.runtime.setDevice(self.previous)


def current_place(device_id: int) -> tuple[int, int]:
    """``(current device, stream)``: the CUDA device current in this thread, and CuPy's
    current stream on ``device_id`` (each device has its own) as a ``cudaStream_t`` address;
    what a call given no stream asks every time, in one step."""
    cuda = cupy_module().cuda
    try:
        return cuda.runtime.getDevice(), cuda.get_current_stream(device_id).ptr
    except cuda.runtime.CUDARuntimeError as exc:
        raise _failed("cudaGetDevice", exc) from exc


def pointer_device(ptr: int) -> int:
    """The device owning device address ``ptr`` (``cudaPointerGetAttributes``); the current
    device for NULL (an empty array has no memory)."""
    if not ptr:
        return current_device()
    cupy = cupy_module()
    attributes = _runtime_call(
        "cudaPointerGetAttributes", cupy.cuda.runtime.pointerGetAttributes, ptr
    )
    if attributes.type == _UNREGISTERED_HOST_MEMORY:
        raise InfiniError(Status.BAD_PARAM, f"address {ptr:#x} is not CUDA memory")
    return attributes.device


_UNREGISTERED_HOST_MEMORY = 0  # cudaMemoryTypeUnregistered
# The CUDA runtime's default-stream handles: 0 and cudaStreamLegacy (1) are both the legacy
# default stream (the CUDA Array Interface and DLPack write it as 1, CuPy as 0).
_LEGACY_DEFAULT = {0, 1}


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (``__cuda_stream__``), which CuPy
    14's ``Stream.from_external`` takes (``cupy/cuda/stream.pyx``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr


_streams: dict[tuple[int, int], Any] = {}


def cupy_stream(stream: int, device_id: int) -> Any:
    """CuPy's object for the ``cudaStream_t`` ``stream`` of ``device_id`` (0: the legacy
    default), made once: ``Stream.from_external`` where CuPy has it (14, which deprecates
    ``ExternalStream``), else ``ExternalStream``. Enter it with ``device_id`` current
    (``stream_scope``): ``from_external`` records no device and takes the current one."""
    key = (stream, device_id)
    if (wrapped := _streams.get(key)) is None:
        cuda = cupy_module().cuda
        if stream == 0:
            wrapped = cuda.Stream.null
        elif hasattr(cuda.Stream, "from_external"):
            wrapped = cuda.Stream.from_external(_StreamHandle(stream))
        else:
            wrapped = cuda.ExternalStream(stream, device_id)
        _streams[key] = wrapped
    return wrapped


class stream_scope:
    """Make ``device_id`` current and the ``cudaStream_t`` ``stream`` CuPy's current stream
    on it: CuPy launches there, and its memory pool serves allocations from that stream's
    own arena (``cupy/cuda/memory.pyx`` keys arenas by the current stream), so memory the
    block allocates is never handed out while another stream may still be using it. (A
    class, not a generator: it runs on every array-API call on CuPy arrays.)"""

    __slots__ = ("device", "stream")

    def __init__(self, stream: int, device_id: int) -> None:
        self.device, self.stream = on_device(device_id), (stream, device_id)

    def __enter__(self) -> None:
        self.device.__enter__()
        try:
            self.stream = cupy_stream(*self.stream)
            self.stream.__enter__()
        except BaseException:
            self.device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.stream.__exit__(*exc_info)
        finally:
            self.device.__exit__(*exc_info)


def wait_for(stream: int, producer: int, device_id: int) -> None:
    """Make ``stream`` wait for the work queued on ``producer`` so far, with an event: the
    host does not block, and ``stream`` may be capturing a CUDA graph."""
    if producer == stream or {producer, stream} <= _LEGACY_DEFAULT:
        return
    cuda = cupy_module().cuda
    with on_device(device_id):
        event = cuda.Event(block=False, disable_timing=True)
        event.record(cupy_stream(producer, device_id))
        cupy_stream(stream, device_id).wait_event(event)


def zero_rows_async(
    ptr: int, pitch: int, width: int, height: int, stream: int, device_id: int
) -> None:
    """Zero ``height`` rows of ``width`` bytes, ``pitch`` bytes apart, at device address
    ``ptr``, queued on ``stream`` (no sync): ``cudaMemset2DAsync``'s contract, on CuPy's
    ``memsetAsync`` (CuPy binds no 2-D memset): one call for packed rows, else one a row."""
    runtime = cupy_module().cuda.runtime
    rows = (
        [(ptr, width * height)]
        if pitch == width or height == 1
        else [(ptr + row * pitch, width) for row in range(height)]
    )
    with on_device(device_id):
        for start, size in rows:
            _runtime_call("cudaMemsetAsync", runtime.memsetAsync, start, 0, size, stream)


def capturing(stream: int, device_id: int) -> bool:
    """Whether the ``cudaStream_t`` ``stream`` of ``device_id`` is capturing a CUDA graph."""
    return bool(cupy_stream(stream, device_id).is_capturing())


_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def copy_to_device(ptr: int, host: Any, stream: int, device_id: int) -> None:
    """Copy the bytes of the packed NumPy array ``host`` to device address ``ptr`` on
    ``stream`` (``cudaMemcpyAsync`` from pageable memory, which returns once they are
    staged: ``host`` may go at once)."""
    runtime = cupy_module().cuda.runtime
    with on_device(device_id):
        _runtime_call(
            "cudaMemcpyAsync",
            runtime.memcpyAsync,
            ptr,
            host.ctypes.data,
            host.nbytes,
            _HOST_TO_DEVICE,
            stream,
        )
