"""DLPack producers (JAX, NumPy 2, CuPy, any ``__dlpack__``), as operands.

The producer is asked for a DLPack 1.0 capsule (``max_version=(1, 0)``; one it must copy is
refused with ``copy=False`` where the operand is written), falling back to the legacy
``dltensor`` capsule for producers older than those keywords. The capsule is read without
being consumed and is kept on the operand (``owner``): its deleter, which frees a producer's
copy, runs only once the call is done with the data. DLPack 1.0 flags mark operands
read-only (``READ_ONLY``) or not the caller's memory (``IS_COPIED``): neither may be written
in place. Layouts: ``dlpack.h`` v1.0 (``DLManagedTensorVersioned``, ``DLManagedTensor``).
"""

import ctypes
from collections.abc import Callable
from typing import Any

from ..enums import DataType, Device, Status
from ..errors import InfiniError, raised_by_caller
from ..tensor import contiguous_strides
from .checks import EXPECTED, described
from .operand import Operand

DLPACK_CPU, DLPACK_CUDA = 1, 2
_DLPACK_INT, _DLPACK_UINT, _DLPACK_FLOAT, _DLPACK_BFLOAT = 0, 1, 2, 4
_DLPACK_DTYPES = {
    (_DLPACK_FLOAT, 16): DataType.F16,
    (_DLPACK_FLOAT, 32): DataType.F32,
    (_DLPACK_FLOAT, 64): DataType.F64,
    (_DLPACK_BFLOAT, 16): DataType.BF16,
    (_DLPACK_UINT, 8): DataType.U8,
    (_DLPACK_INT, 8): DataType.I8,
}
_READ_ONLY, _IS_COPIED = 1 << 0, 1 << 1
_MAX_NDIM = 64  # no tensor has more; a larger ndim is a producer's garbage


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = (
    ctypes.c_void_p,
    [ctypes.py_object, ctypes.c_char_p],
)
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_is_capsule = ctypes.pythonapi.PyCapsule_IsValid
_is_capsule.restype, _is_capsule.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]


def dlpack_place(name: str, device_type: Any, device_id: Any) -> tuple[Device, int]:
    devices = {DLPACK_CPU: Device.CPU, DLPACK_CUDA: Device.NVIDIA}
    if device_type not in devices or not isinstance(device_id, int) or device_id < 0:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED,
            f"{name} is on DLPack device ({device_type!r}, {device_id!r}); expected CPU (1) or "
            "CUDA (2) and a device number",
        )
    return devices[device_type], device_id


def _export(name: str, export: Callable, stream: int | None, written: bool) -> Any:
    """A capsule from ``export`` (a producer's ``__dlpack__``, read once): a 1.0 capsule
    where the producer makes one, else a legacy one.
    A CUDA ``stream`` is the consumer's (the Python array API's DLPack protocol: 1 is the
    legacy default stream, 0 is not allowed, so CuPy's 0 goes as 1)."""
    kwargs = {} if stream is None else {"stream": stream or 1}
    try:
        return export(max_version=(1, 0), **kwargs, **({"copy": False} if written else {}))
    except TypeError:
        pass  # a producer older than DLPack 1.0's keywords
    except BufferError as exc:
        if not written and raised_by_caller(exc):
            raise  # no copy=False was asked: the caller's producer's own exception
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name} is written in place but its DLPack producer can only export a copy ({exc})"
            if written
            else f"{name}'s DLPack producer could not export it ({exc})",
        ) from None
    try:
        return export(**kwargs)
    except TypeError:
        if not kwargs:
            raise
        return export()  # older than the stream keyword too


def _managed(name: str, capsule: Any) -> tuple[_DLTensor, int]:
    """The capsule's DLTensor and its DLPack 1.0 flags (0 for a legacy capsule)."""
    if _is_capsule(capsule, b"dltensor_versioned"):
        managed = _DLManagedTensorVersioned.from_address(
            _capsule_pointer(capsule, b"dltensor_versioned")
        )
        if managed.major != 1:
            raise InfiniError(
                Status.BAD_PARAM,
                f"{name} came as DLPack {managed.major}.{managed.minor}; expected 1.x",
            )
        return managed.dl_tensor, managed.flags
    if _is_capsule(capsule, b"dltensor"):
        # A DLManagedTensor starts with its DLTensor.
        return _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor")), 0
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name}.__dlpack__() returned {type(capsule).__name__}, not an unconsumed DLPack capsule",
    )


def from_dlpack(
    name: str, export: Callable, stream: int | None, written: bool, kinds: dict[Device, Any]
) -> Operand:
    """Read a DLPack capsule from ``export`` (a producer's ``__dlpack__``) without consuming
    it: the producer keeps ownership, and the operand keeps the capsule (and so the
    producer's memory) alive."""
    capsule = _export(name, export, stream, written)
    managed, flags = _managed(name, capsule)
    # One copy of the DLTensor, read once: the producer's memory, which another of its
    # threads could change between two reads (an ndim checked, then another one walked).
    t = _DLTensor.from_buffer_copy(managed)
    device, device_id = dlpack_place(name, t.device.device_type, t.device.device_id)
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _DLPACK_DTYPES.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has DLPack dtype (code {code}, bits {bits}, lanes {lanes}); {EXPECTED}",
        )
    ndim = t.ndim
    if not 0 <= ndim <= _MAX_NDIM or (ndim and not t.shape):
        raise InfiniError(Status.BAD_PARAM, f"{name} has a DLPack ndim of {ndim} without shape")
    shape = tuple(t.shape[:ndim])
    strides = tuple(t.strides[:ndim]) if t.strides else contiguous_strides(shape)
    ptr = (t.data or 0) + t.byte_offset
    desc = described(name, dtype, shape, strides, ptr)
    readonly = (
        "marked read-only by its DLPack producer"
        if flags & _READ_ONLY
        else "a copy its DLPack producer made"
        if flags & _IS_COPIED
        else ""
    )
    return Operand(device, device_id, desc, ptr, readonly, kinds[device], capsule)
