"""cuDNN batch normalization for CuPy and NumPy arrays, with an infiniop-style operator API."""

from ._cudnn.library import cudnn_info
from ._cudnn.loader import CudnnInfo
from ._cudnn.status import cudnn_status_to_infini
from .enums import DataType, Device, Status
from .errors import InfiniError

__all__ = [
    "CudnnInfo",
    "DataType",
    "Device",
    "InfiniError",
    "Status",
    "cudnn_info",
    "cudnn_status_to_infini",
]
