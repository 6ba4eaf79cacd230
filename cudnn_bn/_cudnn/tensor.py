"""cuDNN tensor descriptors built from (dtype, shape, strides), and BN parameter descriptors.

cuDNN's batch-norm calls want 4-D or 5-D descriptors, so lower ranks are padded the way
PyTorch pads them: ``(N, C)`` becomes ``(N, C, 1, 1)`` and ``(N, C, L)`` becomes
``(N, C, L, 1)``, each new axis of size 1 and stride 1. Strides are kept as given.
"""

import ctypes
from collections.abc import Sequence

from ..enums import Status
from ..errors import InfiniError
from .enums import BatchNormMode, CudnnDataType
from .library import cudnn
from .owned import Owned
from .prototypes import cudnnTensorDescriptor_t

MIN_NDIM = 4
MAX_NDIM = 8
INT32_MAX = 2**31 - 1


def pad_to_4d(
    shape: Sequence[int], strides: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` and ``strides`` with trailing size-1, stride-1 axes up to rank 4."""
    missing = max(0, MIN_NDIM - len(shape))
    return tuple(shape) + (1,) * missing, tuple(strides) + (1,) * missing


class TensorDescriptor(Owned):
    """A ``cudnnTensorDescriptor_t``; ``read()`` gives back what cuDNN holds."""

    def __init__(self) -> None:
        lib = cudnn()
        ref = cudnnTensorDescriptor_t()
        lib.cudnnCreateTensorDescriptor(ctypes.byref(ref))
        super().__init__(ref, lib.cudnnDestroyTensorDescriptor)

    @classmethod
    def nd(
        cls, dtype: CudnnDataType, shape: Sequence[int], strides: Sequence[int]
    ) -> "TensorDescriptor":
        """A descriptor of ``shape``/``strides`` (in elements), padded to at least 4-D."""
        if len(shape) != len(strides):
            raise InfiniError(
                Status.BAD_TENSOR_STRIDES,
                f"shape {tuple(shape)} has {len(shape)} axes "
                f"but strides {tuple(strides)} has {len(strides)}",
            )
        dims, steps = pad_to_4d(shape, strides)
        if len(dims) > MAX_NDIM:
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"cuDNN takes at most {MAX_NDIM} axes, got shape {tuple(shape)}",
            )
        for what, values in (("shape", dims), ("strides", steps)):
            if any(not 0 <= v <= INT32_MAX for v in values):
                raise InfiniError(
                    Status.BAD_TENSOR_SHAPE if what == "shape" else Status.BAD_TENSOR_STRIDES,
                    f"cuDNN takes {what} entries in [0, 2^31 - 1], got {tuple(values)}",
                )
        desc = cls()
        try:
            n = len(dims)
            cudnn().cudnnSetTensorNdDescriptor(
                desc, dtype, n, (ctypes.c_int * n)(*dims), (ctypes.c_int * n)(*steps)
            )
        except BaseException:
            desc.close()
            raise
        return desc

    @classmethod
    def derive_bn(cls, x: "TensorDescriptor", mode: BatchNormMode) -> "TensorDescriptor":
        """cuDNN's descriptor for the scale/bias/mean/var of a batch norm over ``x``."""
        desc = cls()
        try:
            cudnn().cudnnDeriveBNTensorDescriptor(desc, x, mode)
        except BaseException:
            desc.close()
            raise
        return desc

    def read(self) -> tuple[CudnnDataType, tuple[int, ...], tuple[int, ...]]:
        """``(dtype, shape, strides)`` as cuDNN holds them (``cudnnGetTensorNdDescriptor``)."""
        dtype, nbdims = ctypes.c_int(), ctypes.c_int()
        dims, strides = (ctypes.c_int * MAX_NDIM)(), (ctypes.c_int * MAX_NDIM)()
        cudnn().cudnnGetTensorNdDescriptor(
            self, MAX_NDIM, ctypes.byref(dtype), ctypes.byref(nbdims), dims, strides
        )
        n = nbdims.value
        return CudnnDataType(dtype.value), tuple(dims[:n]), tuple(strides[:n])
