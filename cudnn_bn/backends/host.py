"""Host memory as NumPy arrays: zero-copy views of ``(pointer, TensorDesc)`` and dtype moves.

``host_array`` is how the CPU backend sees the raw pointers the C API carries; ``to_f64``
and ``from_f64`` move values between a tensor's storage and float64.
"""

from types import SimpleNamespace

import numpy as np

from ..dtypes import FLOAT_TYPES
from ..enums import DataType, Status
from ..errors import InfiniError
from ..tensor import TensorDesc
from .bf16 import bf16_bits_to_f32, f32_to_bf16_bits


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


def to_f64(array: np.ndarray, dtype: DataType) -> np.ndarray:
    """A float64 copy of ``array``, a tensor of ``dtype`` in its storage form."""
    if _float_type(dtype).dtype is DataType.BF16:
        return bf16_bits_to_f32(array).astype(np.float64)
    return np.array(array, dtype=np.float64)


def from_f64(values: np.ndarray, dtype: DataType) -> np.ndarray:
    """``values`` rounded once to ``dtype``, in its storage form (BF16 via float32, as torch)."""
    ftype = _float_type(dtype)
    with np.errstate(over="ignore"):  # out of range rounds to inf, as a cast does
        if ftype.dtype is DataType.BF16:
            return f32_to_bf16_bits(np.asarray(values, dtype=np.float32))
        return np.asarray(values, dtype=ftype.storage)
