"""Facts about each ``DataType`` this package computes with: size, NumPy dtype, cuDNN type.

BF16 has no NumPy dtype; it is stored as ``uint16`` (or ``ml_dtypes.bfloat16``) and converted
by the engines' kernels.
"""

from dataclasses import dataclass

import numpy as np

from ._cudnn.enums import CudnnDataType
from .enums import DataType


@dataclass(frozen=True)
class FloatType:
    """One floating-point ``DataType``: its size, NumPy storage dtype and cuDNN type."""

    dtype: DataType
    itemsize: int
    storage: np.dtype
    cudnn: CudnnDataType


FLOAT_TYPES: dict[DataType, FloatType] = {
    DataType.F16: FloatType(DataType.F16, 2, np.dtype(np.float16), CudnnDataType.HALF),
    DataType.BF16: FloatType(DataType.BF16, 2, np.dtype(np.uint16), CudnnDataType.BFLOAT16),
    DataType.F32: FloatType(DataType.F32, 4, np.dtype(np.float32), CudnnDataType.FLOAT),
    DataType.F64: FloatType(DataType.F64, 8, np.dtype(np.float64), CudnnDataType.DOUBLE),
}

_FROM_NUMPY = {
    np.dtype(np.float16): DataType.F16,
    np.dtype(np.float32): DataType.F32,
    np.dtype(np.float64): DataType.F64,
}


def from_numpy(dtype: np.dtype) -> DataType | None:
    """The ``DataType`` of a NumPy (or CuPy) dtype, or None where this package has none."""
    return _FROM_NUMPY.get(np.dtype(dtype))
