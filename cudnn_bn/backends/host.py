"""Host memory as NumPy arrays: zero-copy views of ``(pointer, TensorDesc)``.

The compiled kernels make their own views of raw pointers (``cpu_kernels.flat``);
``flat_array`` is the flat view their threaded steps take from Python, ``host_array`` the
shaped one the backend needs where NumPy does the work (copying an output out of scratch).
"""

import ctypes
from types import SimpleNamespace

import numpy as np

from ..dtypes import FLOAT_TYPES
from ..enums import DataType, Status
from ..errors import InfiniError
from ..tensor import TensorDesc


def _float_type(dtype: DataType):
    try:
        return FLOAT_TYPES[DataType(dtype)]
    except (KeyError, ValueError):
        raise InfiniError(Status.BAD_TENSOR_DTYPE, f"no host view for dtype {dtype!r}") from None


def host_array(ptr: int, desc: TensorDesc, *, readonly: bool = False) -> np.ndarray:
    """A NumPy view (no copy) of the ``desc``-shaped tensor at host address ``ptr``.

    Strides are ``desc.strides`` (elements) times the item size; BF16 is viewed as uint16.
    The caller keeps the memory alive for as long as the view is used.
    """
    storage = _float_type(desc.dtype).storage
    if desc.numel == 0:
        return np.empty(desc.shape, dtype=storage)
    if not ptr:
        raise InfiniError(Status.NULL_POINTER, f"null data pointer, tensor shape {desc.shape}")
    interface = {
        "version": 3,
        "shape": tuple(desc.shape),
        "typestr": storage.str,
        "data": (int(ptr), readonly),
        "strides": tuple(s * storage.itemsize for s in desc.strides),
    }
    return np.asarray(SimpleNamespace(__array_interface__=interface))


def flat_array(ptr: int, span: int, storage: np.dtype) -> np.ndarray:
    """A writable 1-D view (no copy) of ``span`` elements of ``storage`` at host address
    ``ptr`` (an empty array for a span of 0, whatever ``ptr``)."""
    return np.frombuffer((ctypes.c_char * (span * storage.itemsize)).from_address(ptr), storage)
