"""cuDNN batch normalization for CuPy and NumPy arrays, with an infiniop-style operator API.

The array API (``batch_norm_forward_training``, ``batch_norm_forward_inference``,
``batch_norm_backward``, ``batch_norm_backward_batched``) takes NumPy arrays (CPU backend),
CuPy arrays or torch tensors (cuDNN); ``cudnn_bn.capi`` is the C API of ``include/``;
``cudnn_bn.cupyx_compat`` has CuPy 13's ``cupyx.cudnn`` batch-norm functions;
``cudnn_info()`` says which libcudnn was loaded. Importing the package loads nothing:
cuDNN (and CuPy) are found on first use.
"""

from . import capi, cupyx_compat
from ._cudnn.library import cudnn_info
from ._cudnn.loader import CudnnInfo
from ._cudnn.status import cudnn_status_to_infini
from ._version import __version__
from .api import (
    TrainingOutputs,
    batch_norm_backward,
    batch_norm_backward_batched,
    batch_norm_forward_inference,
    batch_norm_forward_training,
    descriptor_cache,
)
from .enums import DataType, Device, Status
from .errors import InfiniError
from .folding import fold_conv_bn
from .ops.batch_norm_backward import BatchNormBackwardDescriptor
from .ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from .ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from .problems import Fusion, Mode
from .runtime import Handle, nvidia_available
from .tensor import TensorDesc

__all__ = [
    "BatchNormBackwardDescriptor",
    "BatchNormForwardInferenceDescriptor",
    "BatchNormForwardTrainingDescriptor",
    "CudnnInfo",
    "DataType",
    "Device",
    "Fusion",
    "Handle",
    "InfiniError",
    "Mode",
    "Status",
    "TensorDesc",
    "TrainingOutputs",
    "__version__",
    "batch_norm_backward",
    "batch_norm_backward_batched",
    "batch_norm_forward_inference",
    "batch_norm_forward_training",
    "capi",
    "cudnn_info",
    "cudnn_status_to_infini",
    "cupyx_compat",
    "descriptor_cache",
    "fold_conv_bn",
    "nvidia_available",
]
