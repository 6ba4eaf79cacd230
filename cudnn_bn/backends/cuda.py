"""The few CUDA runtime facts the NVIDIA backend needs, through CuPy, imported on first use.

Kept in one place so that importing ``cudnn_bn`` never imports CuPy, and so that tests
without a GPU can stand in for the device (``tests/test_nvidia_arguments.py``).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..enums import Status
from ..errors import InfiniError


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise InfiniError(
            Status.DEVICE_NOT_INITIALIZED, f"CuPy is needed on NVIDIA devices: {exc}"
        ) from exc
    return cupy


def _runtime_call(what: str, fn: Any, *args: Any) -> Any:
    cupy = _cupy()
    try:
        return fn(*args)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise InfiniError(Status.DEVICE_NOT_INITIALIZED, f"{what} failed: {exc}") from exc


def device_count() -> int:
    """How many CUDA devices there are; DEVICE_NOT_INITIALIZED where CUDA cannot start."""
    return _runtime_call("cudaGetDeviceCount", _cupy().cuda.runtime.getDeviceCount)


def current_device() -> int:
    """The CUDA device current in this thread."""
    return _runtime_call("cudaGetDevice", _cupy().cuda.runtime.getDevice)


class on_device:
    """Make ``device_id`` current for the block, switching only when it is not already
    (a class, not a generator: it runs on every compute)."""

    __slots__ = ("device_id", "previous")

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.previous != self.device_id:
            _runtime_call("cudaSetDevice", _cupy().cuda.runtime.setDevice, self.device_id)

    def __exit__(self, *exc_info: object) -> None:
        if self.previous != self.device_id:
            _cupy().cuda.runtime.setDevice(self.previous)


def current_stream() -> int:
    """CuPy's current stream on the current device, as a ``cudaStream_t`` address."""
    return _cupy().cuda.get_current_stream().ptr


_streams: dict[tuple[int, int], Any] = {}


@contextmanager
def stream_scope(stream: int, device_id: int) -> Iterator[None]:
    """Make the ``cudaStream_t`` ``stream`` (0: the legacy default) CuPy's current stream."""
    cupy = _cupy()
    key = (stream, device_id)
    if (wrapped := _streams.get(key)) is None:
        wrapped = _streams[key] = (
            cupy.cuda.Stream.null if stream == 0 else cupy.cuda.ExternalStream(stream, device_id)
        )
    with wrapped:
        yield
