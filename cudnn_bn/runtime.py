"""``infinirtSetDevice``'s state: the device this thread works on, and ``Handle``.

An infiniop handle names a device; operators created from it run there. The current device
is per thread, like CUDA's, and starts as CPU 0.
"""

import threading
from dataclasses import dataclass

from .enums import Device, Status
from .errors import InfiniError

SUPPORTED_DEVICES = (Device.CPU, Device.NVIDIA)


@dataclass(frozen=True)
class Handle:
    """``infiniopHandle_t``: the device an operator descriptor is created for."""

    device: Device
    device_id: int


def check_device(device: int, device_id: int) -> Handle:
    """A ``Handle`` for ``(device, device_id)`` after checking that the device exists."""
    if device not in SUPPORTED_DEVICES:
        name = Device(device).name if device in Device._value2member_map_ else str(device)
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED, f"device {name} is not supported; use CPU or NVIDIA"
        )
    if device_id < 0:
        raise InfiniError(Status.DEVICE_NOT_FOUND, f"device_id must be >= 0, got {device_id}")
    if device == Device.CPU and device_id != 0:
        raise InfiniError(
            Status.DEVICE_NOT_FOUND, f"there is one CPU device (id 0), got device_id {device_id}"
        )
    if device == Device.NVIDIA:
        from .backends.cuda import device_count

        if device_id >= (count := device_count()):
            raise InfiniError(
                Status.DEVICE_NOT_FOUND, f"NVIDIA device {device_id} requested, {count} present"
            )
    return Handle(Device(device), device_id)


_current = threading.local()


def set_device(device: int, device_id: int) -> None:
    """Make ``(device, device_id)`` this thread's current device (``infinirtSetDevice``).

    On failure the thread has no usable current device until a later call succeeds:
    ``current_handle`` raises the same error rather than hand out a handle for the device
    that was current before (a caller who ignored the status must not compute elsewhere).
    """
    try:
        _current.handle = check_device(device, device_id)
    except InfiniError as exc:
        _current.handle = exc
        raise


def current_handle() -> Handle:
    """A handle for this thread's current device (``infiniopCreateHandle``); raises the
    error of the last ``set_device`` if it failed."""
    current = getattr(_current, "handle", Handle(Device.CPU, 0))
    if isinstance(current, InfiniError):
        raise InfiniError(
            current.status, f"the last infinirtSetDevice failed: {str(current).partition(': ')[2]}"
        )
    return current


def nvidia_available() -> bool:
    """Whether the NVIDIA backend can run here: CUDA sees a device and libcudnn loads."""
    from ._cudnn.library import cudnn_info

    try:
        check_device(Device.NVIDIA, 0)
        cudnn_info()
    except InfiniError:
        return False
    return True
