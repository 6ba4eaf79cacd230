"""Batch-norm layers with PyTorch's module semantics over NumPy, CuPy and torch arrays.

``BatchNorm`` (``torch.nn.BatchNorm1d/2d/3d`` in one class; ``BatchNorm1d``/``2d``/``3d``
take only their torch counterpart's input dimensions) owns its parameters, running statistics
and what its backward needs; ``SyncBatchNorm`` takes its training statistics over every
process of a group (``cudnn_bn.distributed``).
"""

from .batch_norm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from .sync import SyncBatchNorm

__all__ = ["BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"]
