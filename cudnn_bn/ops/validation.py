"""Checks shared by every batch-norm operator: each raises ``InfiniError`` naming the argument."""

import enum
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ..enums import DataType, Status
from ..errors import InfiniError, converted, shown
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
    """An ``(N, C, *spatial)`` tensor of rank 2..5 and a floating dtype, strides >= 0, with
    C > 0 (any other size may be 0: a problem with no values per channel)."""
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
    if desc.shape[1] == 0:  # as torch, whose affine batch norm indexes weight[0] then
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"{name} has shape {desc.shape}: no channels")
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


def _number(name: str, value: object) -> float:
    """``value`` as a float if it is a real number (not a string or a bool), else BAD_PARAM."""
    if isinstance(value, str | bytes | bool) or not isinstance(value, numbers.Real):
        raise InfiniError(Status.BAD_PARAM, f"{name} must be a number, got {value!r}")
    try:
        return converted(name, float, value)
    except OverflowError:  # an int (or Fraction) beyond any double
        raise InfiniError(
            Status.BAD_PARAM, f"{name} is {shown(value)}, outside the range of double"
        ) from None


def check_eps(eps: object) -> float:
    """A finite eps >= 0 (the spec's formula has none, so 0 is allowed)."""
    value = _number("eps", eps)
    if not math.isfinite(value) or value < 0:
        raise InfiniError(Status.BAD_PARAM, f"eps must be finite and >= 0, got {eps!r}")
    return value


def _name(dtype: int) -> str:
    return DataType(dtype).name if dtype in DataType._value2member_map_ else f"<invalid {dtype}>"


def check_data_tensors(
    tensors: NamedTuple,
    required: tuple[str, ...],
    optional: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
) -> TensorDesc:
    """Check the ``(N, C, ...)`` operands of ``tensors``; the first is the one others match.

    ``required`` must be present, ``optional`` may be None; all share the first's shape and
    dtype, and those in ``outputs`` must not overlap. Returns the first (the input).
    """
    first = required[0]
    x = require(f"{first}_desc", getattr(tensors, first))
    for name in required + optional:
        desc = getattr(tensors, name)
        if desc is None and name in optional:
            continue
        desc = require(f"{name}_desc", desc)
        check_data_tensor(f"{name}_desc", desc)
        check_like(f"{name}_desc", desc, f"{first}_desc", x)
        if name in outputs:
            check_output(f"{name}_desc", desc)
    return x


def check_channel_tensors(
    tensors: NamedTuple, x: TensorDesc, required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    """Check the per-channel ``(C,)`` operands of ``tensors`` against the input ``x``."""
    for name in required + optional:
        desc = getattr(tensors, name)
        if desc is None and name in optional:
            continue
        check_channel_tensor(f"{name}_desc", require(f"{name}_desc", desc), x.shape[1], x.dtype)


E = TypeVar("E", bound=enum.IntEnum)


def parse_enum(name: str, value: object, names: Mapping[Any, E], enum_type: type[E]) -> E:
    """An ``enum_type`` member from one of its ``names`` or its C value; else BAD_PARAM."""
    if isinstance(value, enum_type):
        return value
    if (isinstance(value, str) or value is None) and value in names:
        return names[value]
    if _is_integer(value) and operator.index(value) in enum_type._value2member_map_:
        return enum_type(operator.index(value))
    choices = ", ".join(map(repr, names))
    raise InfiniError(
        Status.BAD_PARAM, f"{name} must be one of {choices} (or its C value), got {value!r}"
    )


def _is_integer(value: object) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _as_bool(value: object) -> bool | None:
    """``value`` as a Python bool if it is a Python or NumPy bool, else None."""
    return bool(value) if isinstance(value, bool | np.bool_) else None


def check_flag(name: str, value: object) -> bool | None:
    """True, False (Python or NumPy) or None (automatic); anything else is BAD_PARAM."""
    if value is None:
        return None
    if (flag := _as_bool(value)) is not None:
        return flag
    raise InfiniError(Status.BAD_PARAM, f"{name} must be True, False or None, got {value!r}")


def check_output_mask(mask: object) -> tuple[bool, bool, bool]:
    """Three booleans: which of (grad_input, grad_weight, grad_bias) to compute."""
    values = tuple(_as_bool(v) for v in mask) if isinstance(mask, list | tuple) else ()
    if len(values) != 3 or None in values:
        raise InfiniError(
            Status.BAD_PARAM,
            "output_mask must be three booleans (whether to compute the input's, the weight's "
            f"and the bias's gradients), got {mask!r}",
        )
    return values  # type: ignore[return-value]


def check_fraction(name: str, value: object) -> float:
    """A number in [0, 1] (momentum)."""
    number = _number(name, value)
    if not 0.0 <= number <= 1.0:
        raise InfiniError(Status.BAD_PARAM, f"{name} must be in [0, 1], got {value!r}")
    return number
