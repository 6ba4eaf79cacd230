"""CuPy arrays and any object with ``__cuda_array_interface__`` (version 3), as operands.

A CuPy array is read from its attributes: CuPy arrays carry no stream of their own (the
interface's ``stream`` is merely CuPy's current one). Any other producer's interface is
checked key by key, its device is the one owning its pointer, and its ``stream`` is ordered
before the call's with an event (the interface's synchronization rule).
"""

import sys
from typing import Any

import numpy as np

from ..enums import Device, Status
from ..errors import InfiniError
from .checks import described, element_strides, interface_layout, numpy_data_type
from .operand import Operand


def is_cupy(array: Any) -> bool:
    """A CuPy array, a subclass of one, or an object standing in for one (module cupy)."""
    cupy = sys.modules.get("cupy")
    ndarray = getattr(cupy, "ndarray", None)
    if isinstance(ndarray, type) and isinstance(array, ndarray):
        return True
    return type(array).__module__.partition(".")[0] == "cupy"


def from_cupy(name: str, array: Any, kind: Any) -> Operand:
    dtype = numpy_data_type(name, np.dtype(array.dtype))
    strides = element_strides(name, tuple(array.shape), tuple(array.strides), array.itemsize)
    ptr = array.data.ptr
    desc = described(name, dtype, tuple(array.shape), strides, ptr)
    return Operand(Device.NVIDIA, array.device.id, desc, ptr, "", kind, array)


def cuda_interface_device(name: str, array: Any) -> int:
    """The device owning a CUDA array interface's memory (CuPy arrays know theirs)."""
    return _owner(array, _data(name, _interface(name, array))[0])


def _owner(array: Any, ptr: int) -> int:
    if is_cupy(array):
        return array.device.id
    from ..backends.cuda import pointer_device

    return pointer_device(ptr)


def _interface(name: str, array: Any) -> dict:
    iface = array.__cuda_array_interface__
    if not isinstance(iface, dict):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ is a {type(iface).__name__}; the protocol wants "
            "a dict",
        )
    for key in ("shape", "typestr", "data"):
        if key not in iface:
            raise InfiniError(Status.BAD_PARAM, f"{name}.__cuda_array_interface__ has no {key!r}")
    if iface.get("mask") is not None:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ has a mask; masked arrays are refused",
        )
    return iface


def _data(name: str, iface: dict) -> tuple[int, bool]:
    data = iface["data"]
    if not (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[0], int)
        and not isinstance(data[0], bool)
    ):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ has data {data!r}; expected (address, read-only)",
        )
    return data[0], bool(data[1])


def _stream(name: str, iface: dict) -> int | None:
    """The producer's stream (None: nothing to order)."""
    producer = iface.get("stream")
    if producer == 0:  # the interface's specification disallows 0 as ambiguous
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ has stream 0; the protocol allows None, 1, 2 "
            "or a cudaStream_t",
        )
    if producer is not None and (not isinstance(producer, int) or isinstance(producer, bool)):
        raise InfiniError(
            Status.BAD_PARAM, f"{name}.__cuda_array_interface__ has stream {producer!r}"
        )
    return producer


def from_cuda_interface(name: str, array: Any, stream: int | None, kind: Any) -> Operand:
    """Any ``__cuda_array_interface__`` object; ``stream`` (the call's) waits for the
    producer's."""
    iface = _interface(name, array)
    data_type, shape, strides = interface_layout(name, "__cuda_array_interface__", iface, array)
    ptr, readonly = _data(name, iface)
    producer = _stream(name, iface)
    desc = described(name, data_type, shape, strides, ptr)
    device_id = _owner(array, ptr)
    if stream is not None and producer is not None:
        from ..backends.cuda import wait_for

        wait_for(stream, producer, device_id)
    return Operand(
        Device.NVIDIA, device_id, desc, ptr, "read-only" if readonly else "", kind, array
    )
