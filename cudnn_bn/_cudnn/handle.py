"""cuDNN handles: one per (device, thread), created on first use, stream set per call."""

import ctypes
import threading

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


_per_thread = threading.local()


def thread_handle(device_id: int) -> Handle:
    """This thread's handle for ``device_id``; the caller has made that device current."""
    handles: dict[int, Handle] = _per_thread.__dict__.setdefault("handles", {})
    handle = handles.get(device_id)
    if handle is None or handle.closed:
        handle = handles[device_id] = Handle()
    return handle
