"""NumPy arrays and any object with ``__array_interface__``, as operands on the CPU.

An ndarray is read from its attributes. Any other ``__array_interface__`` (NumPy's array
interface protocol, version 3) is checked key by key, then viewed as an ndarray by NumPy: its
``data`` may be an ``(address, read-only)`` pair, a buffer-protocol object, or None (the
object's own buffer); a buffer must hold every element the shape and strides reach, which
NumPy itself does not check. A ``mask`` is refused: the masked values would be read.
"""

import ctypes
import sys
from typing import Any

import numpy as np

from ..enums import Device, Status
from ..errors import InfiniError, integer
from ..tensor import contiguous_strides
from .checks import (
    address_pair,
    described,
    element_strides,
    interface_layout,
    numpy_data_type,
)
from .operand import Operand, byte_extent

# PyArrayObject's data pointer is the first field after the object header
# (``PyArrayObject_fields`` in numpy/ndarraytypes.h): read directly, as one word of a
# memoryview over the address space, it costs 0.05 us, against 0.16 us through a ctypes
# object and 1 us for ``.ctypes.data``; checked below against ``.ctypes.data`` before it is
# trusted. ``DATA_WORDS[id(array) >> 3]`` is that word (objects are 16-byte aligned, the
# view starts one header in); None where the check failed.
_HEADER = object.__basicsize__


def _data_words() -> memoryview | None:
    """The address space as 8-byte words from one object header in, if it holds an
    ndarray's data pointer where ``DATA_WORDS`` says; None where it does not, or where an
    object lies beyond its reach (tagged pointers)."""
    try:
        memory = (ctypes.c_char * (sys.maxsize >> 4 << 3)).from_address(_HEADER)
        words = memoryview(memory).cast("B").cast("Q")
        probe = np.arange(3.0)[1:]
        if _HEADER % 8 == 0 and words[id(probe) >> 3] == probe.ctypes.data:
            return words
    except (IndexError, ValueError, TypeError):
        pass
    return None


DATA_WORDS = _data_words()


def ndarray_data(array: np.ndarray) -> int:
    """The address of ``array``'s first element (an ndarray or a subclass)."""
    if DATA_WORDS is not None:
        return DATA_WORDS[id(array) >> 3]
    return array.ctypes.data


def from_ndarray(name: str, array: np.ndarray, kind: Any) -> Operand:
    """An ndarray (or subclass) from its attributes: a subclass's through a plain ndarray
    view of it, since a subclass may define ``shape``, ``strides``, ``dtype`` or ``flags``
    as properties that say other than its memory holds (a larger shape would be read and
    written past its buffer)."""
    if isinstance(array, np.ma.MaskedArray):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name} is a masked array; batch norm would read its masked values: pass "
            f"{name}.filled(...) or {name}.data",
        )
    if type(array) is not np.ndarray:
        array = np.ndarray.view(array, np.ndarray)  # NumPy's own method, not the subclass's
    dtype = numpy_data_type(name, array.dtype)
    strides = (
        contiguous_strides(array.shape)
        if array.flags.c_contiguous
        else element_strides(name, array.shape, array.strides, array.itemsize)
    )
    ptr = ndarray_data(array)
    desc = described(name, dtype, array.shape, strides, ptr)
    readonly = "" if array.flags.writeable else "read-only"
    return Operand(Device.CPU, 0, desc, ptr, readonly, kind)


def _interface(name: str, iface: Any) -> dict:
    if not isinstance(iface, dict):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__array_interface__ is a {type(iface).__name__}; the protocol wants a dict",
        )
    for key in ("shape", "typestr"):
        if key not in iface:
            raise InfiniError(Status.BAD_PARAM, f"{name}.__array_interface__ has no {key!r}")
    if iface.get("mask") is not None:
        raise InfiniError(
            Status.BAD_PARAM, f"{name}.__array_interface__ has a mask; masked arrays are refused"
        )
    return iface


def _buffer_view(name: str, owner: Any, iface: dict) -> np.ndarray:
    """The bytes of the buffer ``owner`` exports, from the interface's ``offset``."""
    try:
        raw = np.frombuffer(memoryview(owner).cast("B"), np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__array_interface__ 'data' is no usable buffer ({exc})",
        ) from None
    given = iface.get("offset", 0)
    offset = integer(f"{name}.__array_interface__ offset", given)
    if offset is None:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__array_interface__ has offset {given!r}, not an integer",
        )
    if not 0 <= offset <= raw.size:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__array_interface__ has offset {offset!r} outside its {raw.size}-byte buffer",
        )
    return raw[offset:]


def from_array_interface(name: str, obj: Any, iface: Any, kind: Any) -> Operand:
    """``obj`` (not an ndarray), whose ``__array_interface__`` (read once) is ``iface``."""
    iface = _interface(name, iface)
    data_type, shape, strides = interface_layout(name, "__array_interface__", iface, obj)
    data = iface.get("data")
    buffer = None
    if data is None or not isinstance(data, tuple):
        buffer = _buffer_view(name, obj if data is None else data, iface)
        ptr, readonly = ndarray_data(buffer), not buffer.flags.writeable
    elif pair := address_pair(data):
        ptr, readonly = pair
    else:
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__array_interface__ has data {data!r}; expected (address, read-only), "
            "a buffer, or None",
        )
    desc = described(name, data_type, shape, strides, ptr)
    if buffer is not None:
        low, high = byte_extent(desc)
        if low < 0 or high > buffer.size:
            raise InfiniError(
                Status.BAD_TENSOR_STRIDES,
                f"{name}'s shape {shape} and strides reach bytes [{low}, {high}) of a "
                f"{buffer.size}-byte buffer",
            )
    # The interface (a NumPy scalar's holds its data in "__ref") and the buffer's view (which
    # holds its exporter) keep the data alive while the operand is used.
    owner = (obj, iface, buffer)
    return Operand(Device.CPU, 0, desc, ptr, "read-only" if readonly else "", kind, owner)
