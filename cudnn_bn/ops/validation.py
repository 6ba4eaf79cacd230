"""Checks shared by every batch-norm operator: each raises ``InfiniError`` naming the argument."""

import math

from ..enums import DataType, Status
from ..errors import InfiniError
from ..tensor import TensorDesc

FLOAT_DTYPES = (DataType.F16, DataType.BF16, DataType.F32, DataType.F64)
HALF_DTYPES = (DataType.F16, DataType.BF16)
MIN_NDIM, MAX_NDIM = 2, 5


def require(name: str, desc: TensorDesc | None) -> TensorDesc:
    """``desc``, or NULL_POINTER if the caller passed no descriptor."""
    if desc is None:
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    return desc


def check_data_tensor(name: str, desc: TensorDesc) -> None:
    """An ``(N, C, *spatial)`` tensor of rank 2..5 and a floating dtype, strides >= 0."""
    if desc.dtype not in FLOAT_DTYPES:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {_name(desc.dtype)}; expected one of F16, BF16, F32, F64",
        )
    if not MIN_NDIM <= desc.ndim <= MAX_NDIM:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"{name} has shape {desc.shape}; "
            "expected (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W)",
        )
    if desc.numel == 0:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"{name} has shape {desc.shape} with no elements"
        )
    if any(s < 0 for s in desc.strides):
        raise InfiniError(Status.BAD_TENSOR_STRIDES, f"{name} has negative strides {desc.strides}")


def check_like(name: str, desc: TensorDesc, like_name: str, like: TensorDesc) -> None:
    """``desc`` has the shape and dtype of ``like``."""
    if desc.shape != like.shape:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"{name} has shape {desc.shape} but {like_name} has {like.shape}",
        )
    if desc.dtype != like.dtype:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {_name(desc.dtype)} but {like_name} has {_name(like.dtype)}",
        )


def check_output(name: str, desc: TensorDesc) -> None:
    """An output must not have two indices on one element, or results would race."""
    if desc.overlaps():
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has overlapping strides {desc.strides} for shape {desc.shape}",
        )


def check_channel_tensor(name: str, desc: TensorDesc, channels: int, data_dtype: DataType) -> None:
    """A ``(C,)`` tensor with a positive stride, in the data dtype (or F32 for F16/BF16 data)."""
    if desc.shape != (channels,):
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"{name} has shape {desc.shape}; expected ({channels},), one per channel",
        )
    if desc.strides[0] <= 0:
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has stride {desc.strides[0]}; expected a positive stride",
        )
    allowed = (data_dtype, DataType.F32) if data_dtype in HALF_DTYPES else (data_dtype,)
    if desc.dtype not in allowed:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {_name(desc.dtype)}; with {_name(data_dtype)} input expected "
            + " or ".join(_name(d) for d in allowed),
        )


def check_eps(eps: float) -> float:
    """A finite eps >= 0 (the spec's formula has none, so 0 is allowed)."""
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise InfiniError(Status.BAD_PARAM, f"eps must be a number, got {eps!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InfiniError(Status.BAD_PARAM, f"eps must be finite and >= 0, got {eps!r}")
    return value


def _name(dtype: int) -> str:
    return DataType(dtype).name if dtype in DataType._value2member_map_ else f"<invalid {dtype}>"
