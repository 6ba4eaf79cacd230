"""The checks every protocol reader applies, so each producer is held to the same rules:
element type and byte order, sizes and strides a buffer can hold (``TensorDesc.checked``),
whole-element strides, an aligned, non-NULL data pointer."""

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import from_numpy
from ..enums import DataType, Status
from ..errors import InfiniError
from ..tensor import ITEMSIZE, TensorDesc, contiguous_strides

# What every reader (NumPy's, torch's, DLPack's) takes, said where it refuses a dtype (with
# no argument's name in it: the array API respells names, a reserve as ``out[3]``).
EXPECTED = "expected float16, bfloat16, float32 or float64 (uint8 or int8 for a byte buffer)"
# Element types a byte buffer (a reserve space) may come in, besides the float ones.
_BYTES = {np.dtype(np.uint8): DataType.U8, np.dtype(np.int8): DataType.I8}


def numpy_data_type(name: str, dtype: np.dtype) -> DataType:
    """The ``DataType`` of a NumPy dtype (ml_dtypes' bfloat16 included), in native byte order
    only: a byte-swapped array would be read as garbage (BAD_TENSOR_DTYPE)."""
    if not dtype.isnative:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {dtype.str} in non-native byte order; pass "
            f"{name}.astype({name}.dtype.newbyteorder('='))",
        )
    found = from_numpy(dtype) or _BYTES.get(dtype)
    if found is None and _is_bfloat16(dtype):
        found = DataType.BF16
    if found is None:
        raise InfiniError(Status.BAD_TENSOR_DTYPE, f"{name} has dtype {dtype}; {EXPECTED}")
    return found


def interface_layout(
    name: str, protocol: str, iface: dict, producer: Any
) -> tuple[DataType, tuple[int, ...], tuple[int, ...]]:
    """``(dtype, shape, element strides)`` of an array interface (NumPy's or the
    CUDA one, which share these keys). A ``"<V2"`` typestr is named by the producer's own
    dtype where it has one (ml_dtypes' bfloat16 in NumPy and CuPy 14)."""
    shape = integers(name, "shape", iface["shape"])
    dtype = typestr_dtype(name, protocol, iface["typestr"])
    own = getattr(producer, "dtype", None)
    if isinstance(own, np.dtype) and own.itemsize == dtype.itemsize and dtype.kind == "V":
        dtype = own
    data_type = numpy_data_type(name, dtype)  # before the strides are read in its items
    raw_strides = iface.get("strides")
    strides = element_strides(
        name,
        shape,
        None if raw_strides is None else integers(name, "strides", raw_strides),
        dtype.itemsize,
    )
    return data_type, shape, strides


def snapshot(iface: Any) -> Any:
    """An array interface's dict (NumPy's or the CUDA one) as one read of it: a plain dict of
    its entries, each tuple among them a plain tuple, so that no later look at a key or at a
    tuple's items (a subclass's ``__getitem__``, or a producer changing its dict meanwhile)
    answers other than the look the checks made; anything else as it is, for the reader to
    refuse."""
    if not isinstance(iface, dict):
        return iface
    return {k: tuple(v) if isinstance(v, tuple) else v for k, v in dict(iface).items()}


def address_pair(data: Any) -> tuple[int, bool] | None:
    """An interface's ``data`` as ``(address, read-only)``, the address a plain int (an int
    subclass's ``%`` or comparisons could tell the checks another); None where it is no such
    pair."""
    if not (isinstance(data, tuple) and len(data) == 2):
        return None
    address, readonly = data
    if not isinstance(address, int) or isinstance(address, bool):
        return None
    return operator.index(address), bool(readonly)


def typestr_dtype(name: str, protocol: str, typestr: Any) -> np.dtype:
    """The dtype of an array interface's ``typestr``, a string such as ``"<f4"`` (NumPy
    would read None as float64); BAD_TENSOR_DTYPE naming ``name`` otherwise."""
    try:
        if not isinstance(typestr, str):
            raise TypeError("not a string")
        return np.dtype(typestr)
    except (TypeError, ValueError) as exc:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE, f"{name}.{protocol} has typestr {typestr!r}: {exc}"
        ) from None


def _is_bfloat16(dtype: np.dtype) -> bool:
    """ml_dtypes' bfloat16 (typestr ``<V2``: only its scalar type names it)."""
    return dtype.itemsize == 2 and getattr(dtype.type, "__name__", "") == "bfloat16"


def integers(name: str, what: str, values: Any) -> tuple[int, ...]:
    """A protocol's shape or strides as a tuple of Python ints; BAD_PARAM otherwise."""
    try:
        if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
            raise TypeError
        found = tuple(values)
        if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in found):
            raise TypeError
    except TypeError:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} has {what} {values!r}; expected a tuple of integers"
        ) from None
    return tuple(int(v) for v in found)


def element_strides(
    name: str, shape: tuple[int, ...], byte_strides: tuple[int, ...] | None, itemsize: int
) -> tuple[int, ...]:
    """Strides in elements from byte strides (None: packed row-major)."""
    if byte_strides is None:
        return contiguous_strides(shape)
    if len(byte_strides) != len(shape):
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has {len(byte_strides)} strides for {len(shape)} dimensions",
        )
    if any(s % itemsize for s in byte_strides):
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has byte strides {byte_strides} that are not whole elements",
        )
    return tuple(s // itemsize for s in byte_strides)


def described(
    name: str, dtype: DataType, shape: tuple[int, ...], strides: tuple[int, ...], ptr: int
) -> TensorDesc:
    """``TensorDesc.checked`` (sizes in [0, 2**63), element counts and reach that fit a
    ``ptrdiff_t``), a data pointer that is aligned to the element and not NULL where there are
    elements; errors name ``name``."""
    if len(strides) != len(shape):
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has {len(strides)} strides for {len(shape)} dimensions",
        )
    try:
        desc = TensorDesc.checked(dtype, shape, strides)
    except InfiniError as exc:
        raise InfiniError(exc.status, f"{name}: {str(exc).partition(': ')[2]}") from None
    if not 0 <= ptr < 1 << 64:
        raise InfiniError(Status.BAD_PARAM, f"{name} has data address {ptr}, not a pointer")
    if desc.numel:
        if not ptr:
            raise InfiniError(Status.NULL_POINTER, f"{name} has {desc.numel} elements at address 0")
        if ptr % ITEMSIZE[desc.dtype]:
            raise InfiniError(
                Status.BAD_TENSOR_STRIDES,
                f"{name}'s data at {ptr:#x} is not aligned to its {ITEMSIZE[desc.dtype]}-byte "
                "elements",
            )
    return desc
