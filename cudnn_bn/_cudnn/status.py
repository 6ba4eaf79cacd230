"""``cudnnStatus_t`` to ``infiniStatus_t``, for cuDNN 9 and cuDNN 8 codes alike.

cuDNN 9 codes are a category (1000s) plus a sub-code; cuDNN 8 codes are 1..14. The two
ranges do not overlap, so one function serves both: a cuDNN 8 code is first renamed to its
cuDNN 9 counterpart (the renames cuDNN 9's own header lists as deprecated aliases).
"""

from ..enums import Status
from .enums import Cudnn8Status, CudnnStatus

_CUDNN8_AS_CUDNN9: dict[int, CudnnStatus] = {
    Cudnn8Status.SUCCESS: CudnnStatus.SUCCESS,
    Cudnn8Status.NOT_INITIALIZED: CudnnStatus.NOT_INITIALIZED,
    Cudnn8Status.ALLOC_FAILED: CudnnStatus.INTERNAL_ERROR_HOST_ALLOCATION_FAILED,
    Cudnn8Status.BAD_PARAM: CudnnStatus.BAD_PARAM,
    Cudnn8Status.INTERNAL_ERROR: CudnnStatus.INTERNAL_ERROR,
    Cudnn8Status.INVALID_VALUE: CudnnStatus.INVALID_VALUE,
    Cudnn8Status.ARCH_MISMATCH: CudnnStatus.NOT_SUPPORTED_ARCH_MISMATCH,
    Cudnn8Status.MAPPING_ERROR: CudnnStatus.INTERNAL_ERROR_TEXTURE_CREATION_FAILED,
    Cudnn8Status.EXECUTION_FAILED: CudnnStatus.EXECUTION_FAILED,
    Cudnn8Status.NOT_SUPPORTED: CudnnStatus.NOT_SUPPORTED,
    Cudnn8Status.LICENSE_ERROR: CudnnStatus.LICENSE_ERROR,
    Cudnn8Status.RUNTIME_PREREQUISITE_MISSING: (
        CudnnStatus.NOT_SUPPORTED_RUNTIME_PREREQUISITE_MISSING
    ),
    Cudnn8Status.RUNTIME_IN_PROGRESS: CudnnStatus.RUNTIME_IN_PROGRESS,
    Cudnn8Status.RUNTIME_FP_OVERFLOW: CudnnStatus.RUNTIME_FP_OVERFLOW,
    Cudnn8Status.VERSION_MISMATCH: CudnnStatus.SUBLIBRARY_VERSION_MISMATCH,
}

# Sub-codes that say more than their category does.
_EXACT: dict[int, Status] = {
    CudnnStatus.SUCCESS: Status.SUCCESS,
    CudnnStatus.NOT_INITIALIZED: Status.DEVICE_NOT_INITIALIZED,
    CudnnStatus.BAD_PARAM_NULL_POINTER: Status.NULL_POINTER,
    CudnnStatus.BAD_PARAM_MISALIGNED_POINTER: Status.BAD_TENSOR_STRIDES,
    CudnnStatus.BAD_PARAM_SIZE_INSUFFICIENT: Status.INSUFFICIENT_WORKSPACE,
    CudnnStatus.BAD_PARAM_SHAPE_MISMATCH: Status.BAD_TENSOR_SHAPE,
    CudnnStatus.NOT_SUPPORTED_SHAPE: Status.BAD_TENSOR_SHAPE,
    CudnnStatus.NOT_SUPPORTED_DATA_TYPE: Status.BAD_TENSOR_DTYPE,
    CudnnStatus.NOT_SUPPORTED_LAYOUT: Status.BAD_TENSOR_STRIDES,
    CudnnStatus.NOT_SUPPORTED_PADDING: Status.BAD_TENSOR_STRIDES,
    CudnnStatus.NOT_SUPPORTED_INCOMPATIBLE_CUDA_DRIVER: Status.DEVICE_NOT_INITIALIZED,
    CudnnStatus.NOT_SUPPORTED_INCOMPATIBLE_CUDART: Status.DEVICE_NOT_INITIALIZED,
    CudnnStatus.NOT_SUPPORTED_ARCH_MISMATCH: Status.DEVICE_ARCHITECTURE_NOT_SUPPORTED,
}

_BY_CATEGORY: dict[int, Status] = {
    1000: Status.INTERNAL_ERROR,
    2000: Status.BAD_PARAM,
    3000: Status.NOT_IMPLEMENTED,
    4000: Status.INTERNAL_ERROR,
    5000: Status.INTERNAL_ERROR,
}


def cudnn_status_to_infini(code: int) -> Status:
    """The ``Status`` for a cuDNN 9 or cuDNN 8 status code; unknown codes are INTERNAL_ERROR."""
    code = int(_CUDNN8_AS_CUDNN9.get(code, code))
    if code in _EXACT:
        return _EXACT[code]
    if code > 0:
        return _BY_CATEGORY.get(code // 1000 * 1000, Status.INTERNAL_ERROR)
    return Status.INTERNAL_ERROR
