"""CuPy arrays and any object with ``__cuda_array_interface__`` (version 3), as operands.

A CuPy array is read from its attributes: CuPy arrays carry no stream of their own (the
interface's ``stream`` is merely CuPy's current one). Any other producer's interface is
checked key by key, its device is the one owning its pointer, and its ``stream`` is ordered
before the call's with an event (the interface's synchronization rule).
"""

import functools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ..enums import Device, Status
from ..errors import InfiniError
from .checks import (
    address_pair,
    described,
    element_strides,
    interface_layout,
    numpy_data_type,
)
from .operand import Operand


def is_cupy(array: Any) -> bool:
    """A CuPy array, a subclass of one, or an object standing in for one (module cupy)."""
    cupy = sys.modules.get("cupy")
    ndarray = getattr(cupy, "ndarray", None)
    if isinstance(ndarray, type) and isinstance(array, ndarray):
        return True
    return type(array).__module__.partition(".")[0] == "cupy"


@functools.cache
def _getters(ndarray: type, names: tuple[str, ...]) -> tuple[Callable[[Any], Any], ...]:
    """CuPy's own getters (``ndarray``'s) of the attributes ``names``."""
    return tuple(next(vars(k)[n] for k in ndarray.__mro__ if n in vars(k)).__get__ for n in names)


def cupy_attributes(array: Any, *names: str) -> tuple:
    """The attributes ``names`` of a CuPy array, a subclass's as CuPy's own getters read
    them: a subclass may define ``shape``, ``strides``, ``data`` or ``device`` as properties
    that say other than its memory holds (a larger shape would be read and written past its
    allocation); a stand-in's as it says."""
    ndarray = getattr(sys.modules.get("cupy"), "ndarray", None)
    if type(array) is not ndarray and isinstance(ndarray, type) and isinstance(array, ndarray):
        return tuple(get(array) for get in _getters(ndarray, names))
    return tuple(getattr(array, n) for n in names)


def from_cupy(name: str, array: Any, kind: Any) -> Operand:
    dtype, shape, strides, data, device = cupy_attributes(
        array, "dtype", "shape", "strides", "data", "device"
    )
    dtype = np.dtype(dtype)
    shape, ptr = tuple(shape), data.ptr
    strides = element_strides(name, shape, tuple(strides), dtype.itemsize)
    desc = described(name, numpy_data_type(name, dtype), shape, strides, ptr)
    return Operand(Device.NVIDIA, device.id, desc, ptr, "", kind, array)


def cuda_interface_device(name: str, iface: Any) -> int:
    """The device owning the memory of ``iface``, a ``__cuda_array_interface__`` value."""
    from ..backends.cuda import pointer_device

    return pointer_device(_data(name, _interface(name, iface))[0])


def _interface(name: str, iface: Any) -> dict:
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
    pair = address_pair(data)
    if pair is None:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ has data {data!r}; expected (address, read-only)",
        )
    return pair


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


def from_cuda_interface(
    name: str, array: Any, iface: Any, device_id: int | None, stream: int | None, kind: Any
) -> Operand:
    """``array``, an object whose ``__cuda_array_interface__`` (read once) is ``iface``, its
    memory on ``device_id`` (None: asked of CUDA); ``stream`` (the call's) waits for the
    producer's."""
    from ..backends import cuda

    iface = _interface(name, iface)
    data_type, shape, strides = interface_layout(name, "__cuda_array_interface__", iface, array)
    ptr, readonly = _data(name, iface)
    producer = _stream(name, iface)
    desc = described(name, data_type, shape, strides, ptr)
    if device_id is None:
        device_id = cuda.pointer_device(ptr)
    if stream is not None and producer is not None:
        cuda.wait_for(stream, producer, device_id)
    return Operand(
        Device.NVIDIA, device_id, desc, ptr, "read-only" if readonly else "", kind, array
    )
