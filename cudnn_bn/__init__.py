"""cuDNN batch normalization for CuPy and NumPy arrays, with an infiniop-style operator API.

``batch_norm_backward`` takes NumPy arrays (CPU backend), CuPy arrays or torch tensors
(cuDNN); ``cudnn_bn.capi`` is the C API of ``include/``; ``cudnn_info()`` says which libcudnn
was loaded. Importing the package loads nothing: cuDNN is found on first use.
"""

from . import capi
from ._cudnn.library import cudnn_info
from ._cudnn.loader import CudnnInfo
from ._cudnn.status import cudnn_status_to_infini
from .api import batch_norm_backward, descriptor_cache
from .enums import DataType, Device, Status
from .errors import InfiniError
from .ops.batch_norm_backward import BatchNormBackwardDescriptor
from .problems import Mode
from .runtime import Handle
from .tensor import TensorDesc

__all__ = [
    "BatchNormBackwardDescriptor",
    "CudnnInfo",
    "DataType",
    "Device",
    "Handle",
    "InfiniError",
    "Mode",
    "Status",
    "TensorDesc",
    "batch_norm_backward",
    "capi",
    "cudnn_info",
    "cudnn_status_to_infini",
    "descriptor_cache",
]
