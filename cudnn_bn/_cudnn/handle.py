"""cuDNN handles: a pool per device that lives as long as the process.

A compute borrows a handle, sets its stream, makes its cuDNN call and gives it back, so
threads share the pool the way PyTorch's ``DeviceThreadHandlePool`` lets them. Handles are
made when a descriptor is built (``reserve``), never by a compute unless more computes run
at once on a device than ever before: ``cudnnCreate`` cannot run while a stream is capturing
a CUDA graph. Handles are never destroyed: ``cudnnDestroy`` synchronizes the device, which
would break a graph capture on another thread (and at exit the CUDA context may be gone).
``list.append``/``list.pop`` are atomic, so borrowing takes no lock.
"""

import ctypes

from .library import cudnn
from .owned import Owned
from .prototypes import cudnnHandle_t


class Handle(Owned):
    """A ``cudnnHandle_t`` for the CUDA device current when it was created."""

    def __init__(self) -> None:
        lib = cudnn()
        ref = cudnnHandle_t()
        lib.cudnnCreate(ctypes.byref(ref))
        super().__init__(ref, lib.cudnnDestroy)


_free: dict[int, list[Handle]] = {}


def reserve(device_id: int) -> None:
    """Make sure a free handle for ``device_id`` is pooled; the caller has made that device
    current. Descriptor creation calls this, so that computes find one."""
    free = _free.setdefault(device_id, [])
    if not free:
        free.append(Handle())


def borrow(device_id: int) -> Handle:
    """A handle for ``device_id`` no one else is using; ``give_back`` it when done. The
    caller has made that device current."""
    try:
        return _free[device_id].pop()
    except (KeyError, IndexError):
        return Handle()


def give_back(device_id: int, handle: Handle) -> None:
    """Return a borrowed handle to the pool (it stays alive for the process)."""
    _free.setdefault(device_id, []).append(handle)
