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

    def set_stream(self, stream: int) -> None:
        """Make cuDNN work on this handle run on ``stream`` (a ``cudaStream_t`` as an int)."""
        cudnn().cudnnSetStream(self, stream)

    def stream(self) -> int:
        """The ``cudaStream_t`` cuDNN work on this handle runs on (0: the legacy default)."""
        out = ctypes.c_void_p()
        cudnn().cudnnGetStream(self, ctypes.byref(out))
        return out.value or 0


_per_thread = threading.local()


def thread_handle(device_id: int) -> Handle:
    """This thread's handle for ``device_id``; the caller has made that device current."""
    handles: dict[int, Handle] = _per_thread.__dict__.setdefault("handles", {})
    handle = handles.get(device_id)
    if handle is None or handle.closed:
        handle = handles[device_id] = Handle()
    return handle
