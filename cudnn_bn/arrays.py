"""Arrays to (``TensorDesc``, pointer) pairs, and new arrays of the caller's kind.

NumPy arrays (anything with ``__array_interface__``) run on the CPU; CuPy arrays and any
object exposing ``__cuda_array_interface__`` or a CUDA ``__dlpack__`` run on NVIDIA, zero
copy; torch tensors run where they live. BF16 comes as torch.bfloat16, through DLPack, or as
``ml_dtypes.bfloat16`` in NumPy.
"""

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import FLOAT_TYPES, from_numpy
from .enums import DataType, Device, Status
from .errors import InfiniError
from .tensor import TensorDesc, contiguous_strides

_DLPACK_CPU, _DLPACK_CUDA = 1, 2
_DLPACK_FLOAT, _DLPACK_BFLOAT = 2, 4
_DLPACK_DTYPES = {
    (_DLPACK_FLOAT, 16): DataType.F16,
    (_DLPACK_FLOAT, 32): DataType.F32,
    (_DLPACK_FLOAT, 64): DataType.F64,
    (_DLPACK_BFLOAT, 16): DataType.BF16,
}


@dataclass(frozen=True)
class Operand:
    """One array argument: where it lives, its descriptor, its data pointer, and whether its
    owner marked it read-only (NumPy's ``writeable=False``, the interfaces' read-only flag)."""

    device: Device
    device_id: int
    desc: TensorDesc
    ptr: int
    readonly: bool = False

    def byte_range(self) -> tuple[int, int]:
        """``[first, end)`` bytes its elements lie in (empty for no elements)."""
        d = self.desc
        if d.numel == 0:
            return self.ptr, self.ptr
        itemsize = FLOAT_TYPES[d.dtype].itemsize
        low = sum(min(0, (n - 1) * s) for n, s in zip(d.shape, d.strides, strict=True))
        high = sum(max(0, (n - 1) * s) for n, s in zip(d.shape, d.strides, strict=True))
        return self.ptr + low * itemsize, self.ptr + (high + 1) * itemsize


def shares_memory(a: Operand, b: Operand) -> bool:
    """Whether ``a`` and ``b`` may have a byte in common: their byte ranges meet, except
    for two vectors of one stride whose elements interleave without touching (``buf[0::2]``
    and ``buf[1::2]``). Conservative on other interleavings."""
    if (a.device, a.device_id) != (b.device, b.device_id):
        return False
    (a_low, a_end), (b_low, b_end) = a.byte_range(), b.byte_range()
    if a_low >= b_end or b_low >= a_end:
        return False
    a_size, b_size = (FLOAT_TYPES[op.desc.dtype].itemsize for op in (a, b))
    if a.desc.ndim == b.desc.ndim == 1:
        step = abs(a.desc.strides[0]) * a_size
        if step and step == abs(b.desc.strides[0]) * b_size:
            offset = (b.ptr - a.ptr) % step  # where b's elements start within a's steps
            return offset < a_size or step - offset < b_size
    return True


def check_written(written: dict[str, Operand], read: dict[str, Operand]) -> None:
    """Arrays a call writes in place: each writable, none sharing memory with another one
    written or with one the call reads; BAD_PARAM naming both, before anything is written."""
    for name, op in written.items():
        if op.readonly:
            raise InfiniError(Status.BAD_PARAM, f"{name} is read-only, but it is written in place")
    names = list(written)
    for i, name in enumerate(names):
        for other, op in [*((n, written[n]) for n in names[i + 1 :]), *read.items()]:
            if shares_memory(written[name], op):
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} and {other} share memory; {name} is written in place and must "
                    "not overlap any other argument",
                )


def _data_type(name: str, dtype: np.dtype) -> DataType:
    if (found := from_numpy(dtype)) is not None:
        return found
    if dtype.name == "bfloat16":  # ml_dtypes.bfloat16
        return DataType.BF16
    raise InfiniError(
        Status.BAD_TENSOR_DTYPE,
        f"{name} has dtype {dtype}; expected float16, bfloat16, float32 or float64",
    )


def _element_strides(
    name: str, shape: tuple, byte_strides: tuple | None, itemsize: int
) -> tuple[int, ...]:
    if byte_strides is None:
        return contiguous_strides(shape)
    if any(s % itemsize for s in byte_strides):
        raise InfiniError(
            Status.BAD_TENSOR_STRIDES,
            f"{name} has byte strides {byte_strides} that are not whole elements",
        )
    return tuple(s // itemsize for s in byte_strides)


def _from_interface(
    name: str, iface: dict, device: Device, device_id: int, dtype: np.dtype | None = None
) -> Operand:
    """An operand from an array interface; ``dtype``, where the array has one, names what a
    typestr cannot (ml_dtypes' bfloat16 is typestr ``<V2``)."""
    shape = tuple(iface["shape"])
    dtype = _data_type(name, np.dtype(iface["typestr"]) if dtype is None else np.dtype(dtype))
    strides = _element_strides(name, shape, iface.get("strides"), FLOAT_TYPES[dtype].itemsize)
    address, readonly = iface["data"]
    return Operand(
        device, device_id, TensorDesc(dtype, shape, strides), int(address or 0), bool(readonly)
    )


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


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = (
    ctypes.c_void_p,
    [ctypes.py_object, ctypes.c_char_p],
)


def _from_dlpack(name: str, array: Any) -> Operand:
    """Read a DLPack capsule without consuming it: the producer keeps ownership."""
    capsule = array.__dlpack__()
    # A DLManagedTensor starts with its DLTensor.
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    devices = {_DLPACK_CPU: Device.CPU, _DLPACK_CUDA: Device.NVIDIA}
    if t.device.device_type not in devices:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED,
            f"{name} is on DLPack device type {t.device.device_type}; expected CPU (1) or CUDA (2)",
        )
    dtype = _DLPACK_DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dtype is None:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits}, "
            f"lanes {t.dtype.lanes}); "
            "expected float16, bfloat16, float32 or float64",
        )
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = (
        tuple(t.strides[i] for i in range(t.ndim))
        if t.strides
        else TensorDesc.contiguous(dtype, shape).strides
    )
    return Operand(
        devices[t.device.device_type],
        t.device.device_id,
        TensorDesc(dtype, shape, strides),
        (t.data or 0) + t.byte_offset,
    )


def _is_torch(array: Any) -> bool:
    return type(array).__module__.startswith("torch")


@functools.cache
def _torch_dtypes() -> dict[DataType, Any]:
    import torch

    return {
        DataType.F16: torch.float16,
        DataType.BF16: torch.bfloat16,
        DataType.F32: torch.float32,
        DataType.F64: torch.float64,
    }


@functools.cache
def _from_torch_dtypes() -> dict[Any, DataType]:
    return {torch_dtype: dtype for dtype, torch_dtype in _torch_dtypes().items()}


def _from_torch(name: str, tensor: Any) -> Operand:
    """A torch tensor read through its own attributes: no DLPack stream handshake per call."""
    dtypes = _from_torch_dtypes()
    if tensor.dtype not in dtypes:
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {tensor.dtype}; expected float16, bfloat16, float32 or float64",
        )
    devices = {"cpu": Device.CPU, "cuda": Device.NVIDIA}
    if tensor.device.type not in devices:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED, f"{name} is on {tensor.device}; expected cpu or cuda"
        )
    desc = TensorDesc(dtypes[tensor.dtype], tuple(tensor.shape), tuple(tensor.stride()))
    return Operand(devices[tensor.device.type], tensor.device.index or 0, desc, tensor.data_ptr())


def _is_numpy(array: Any) -> bool:
    return hasattr(array, "__array_interface__")


def operand(name: str, array: Any) -> Operand:
    """Describe ``array``: NumPy, CuPy, torch, or any CUDA-array-interface/DLPack object."""
    if _is_numpy(array):
        dtype = getattr(array, "dtype", None)
        return _from_interface(name, array.__array_interface__, Device.CPU, 0, dtype)
    if _is_torch(array):
        return _from_torch(name, array)
    if hasattr(array, "__cuda_array_interface__"):
        device = getattr(array, "device", None)
        return _from_interface(
            name, array.__cuda_array_interface__, Device.NVIDIA, getattr(device, "id", 0)
        )
    if hasattr(array, "__dlpack__"):  # JAX and other producers
        return _from_dlpack(name, array)
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy, CuPy or torch array, or expose __cuda_array_interface__ or "
        f"__dlpack__; got {type(array).__name__}",
    )


def empty_like(like: Any, shape: tuple[int, ...], strides: tuple[int, ...], dtype: DataType) -> Any:
    """A new array of ``like``'s kind and device with ``shape``, element ``strides``, ``dtype``."""
    if _is_torch(like):
        import torch

        return torch.empty_strided(shape, strides, dtype=_torch_dtypes()[dtype], device=like.device)
    xp: Any = np
    if not _is_numpy(like):
        import cupy as xp
    storage = (
        like.dtype if dtype == DataType.BF16 and _is_numpy(like) else FLOAT_TYPES[dtype].storage
    )
    extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    base = xp.empty(extent, storage)
    byte_strides = tuple(s * base.itemsize for s in strides)
    return xp.lib.stride_tricks.as_strided(base, shape, byte_strides)


def buffer_address(name: str, buffer: Any) -> tuple[int, int]:
    """``(address, bytes)`` of a byte buffer such as a reserve space (``(0, 0)`` for None)."""
    if buffer is None:
        return 0, 0
    if _is_torch(buffer):
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if _is_numpy(buffer):
        return buffer.__array_interface__["data"][0], buffer.nbytes
    if hasattr(buffer, "__cuda_array_interface__"):
        return buffer.__cuda_array_interface__["data"][0], buffer.nbytes
    raise InfiniError(Status.BAD_PARAM, f"{name} must be an array, got {type(buffer).__name__}")


def workspace_like(like: Any, nbytes: int, stream: int) -> tuple[Any, int]:
    """``nbytes`` of scratch from ``like``'s own allocator, tied to ``stream`` so that the
    allocator does not reuse it before the work queued there is done; (None, 0) for 0 bytes."""
    if nbytes == 0:
        return None, 0
    if _is_numpy(like):
        buffer = np.empty(nbytes, np.uint8)
        return buffer, buffer.ctypes.data
    if _is_torch(like):
        import torch

        buffer = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        on_gpu = like.device.type == "cuda"
        if on_gpu and stream != torch.cuda.current_stream(like.device).cuda_stream:
            buffer.record_stream(torch.cuda.ExternalStream(stream, device=like.device))
        return buffer, buffer.data_ptr()
    import cupy

    from .backends.cuda import stream_scope

    with stream_scope(stream, operand("like", like).device_id):
        buffer = cupy.empty(nbytes, cupy.uint8)
    return buffer, buffer.data.ptr
