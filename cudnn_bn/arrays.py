"""Arrays to (``TensorDesc``, pointer) pairs, and new arrays of the caller's kind.

NumPy arrays (anything with ``__array_interface__``) run on the CPU; CuPy arrays and any
object exposing ``__cuda_array_interface__`` or a CUDA ``__dlpack__`` run on NVIDIA, zero
copy; torch tensors run where they live. BF16 comes as torch.bfloat16, through DLPack, or as
``ml_dtypes.bfloat16`` in NumPy and CuPy 14.

Devices and streams: an array's device is its own (CuPy's ``.device``, torch's, the device
owning a CUDA-array-interface pointer, ``__dlpack_device__``), found before anything is
exported, because the stream a call uses depends on it and the protocols order the
producer's work before that stream: ``__dlpack__(stream=)`` and the interface's ``stream``.
CuPy arrays and torch tensors carry no stream of their own (CuPy's interface ``stream`` is
merely its current one), so they are read directly, as their own libraries do. Every array
a call creates is allocated inside ``allocation_scope``: on the call's device, from the
call's stream's memory pool.
"""

import ctypes
import functools
from contextlib import AbstractContextManager, nullcontext
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

    @functools.cached_property
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
    (a_low, a_end), (b_low, b_end) = a.byte_range, b.byte_range
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


def _from_ndarray(name: str, array: np.ndarray) -> Operand:
    """``_from_interface`` of a NumPy array, read from its attributes: the same descriptor
    (packed strides where NumPy calls it C-contiguous, as its interface does), without
    building the interface's dict."""
    dtype = _data_type(name, array.dtype)
    strides = (
        contiguous_strides(array.shape)
        if array.flags.c_contiguous
        else _element_strides(name, array.shape, array.strides, array.itemsize)
    )
    return Operand(
        Device.CPU,
        0,
        TensorDesc(dtype, array.shape, strides),
        array.ctypes.data,
        not array.flags.writeable,
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


def _dlpack_place(name: str, device_type: int, device_id: int) -> tuple[Device, int]:
    devices = {_DLPACK_CPU: Device.CPU, _DLPACK_CUDA: Device.NVIDIA}
    if device_type not in devices:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED,
            f"{name} is on DLPack device type {device_type}; expected CPU (1) or CUDA (2)",
        )
    return devices[device_type], device_id


def _export_dlpack(array: Any, stream: int | None) -> Any:
    """``array.__dlpack__``, asking the producer to order its pending work before the
    consumer's CUDA ``stream`` (the Python array API's DLPack protocol: 1 is the legacy
    default stream, 0 is not allowed, so CuPy's 0 goes as 1; ``cupy/_core/core.pyx`` reads
    it so). Producers older than the ``stream`` keyword are called without it."""
    if stream is None:
        return array.__dlpack__()
    try:
        return array.__dlpack__(stream=stream or 1)
    except TypeError:
        return array.__dlpack__()


def _from_dlpack(name: str, array: Any, stream: int | None) -> Operand:
    """Read a DLPack capsule without consuming it: the producer keeps ownership."""
    capsule = _export_dlpack(array, stream)
    # A DLManagedTensor starts with its DLTensor.
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    device, device_id = _dlpack_place(name, t.device.device_type, t.device.device_id)
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
        device, device_id, TensorDesc(dtype, shape, strides), (t.data or 0) + t.byte_offset
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
    device, device_id = _torch_place(name, tensor)
    desc = TensorDesc(dtypes[tensor.dtype], tuple(tensor.shape), tuple(tensor.stride()))
    return Operand(device, device_id, desc, tensor.data_ptr())


def _torch_place(name: str, tensor: Any) -> tuple[Device, int]:
    devices = {"cpu": Device.CPU, "cuda": Device.NVIDIA}
    if tensor.device.type not in devices:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED, f"{name} is on {tensor.device}; expected cpu or cuda"
        )
    return devices[tensor.device.type], tensor.device.index or 0


def _is_numpy(array: Any) -> bool:
    # isinstance first: an ndarray's __array_interface__ is a new dict at every access.
    return isinstance(array, np.ndarray) or hasattr(array, "__array_interface__")


def _is_cupy(array: Any) -> bool:
    return type(array).__module__.startswith("cupy")


def _not_an_array(name: str, array: Any) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy, CuPy or torch array, or expose __cuda_array_interface__ or "
        f"__dlpack__; got {type(array).__name__}",
    )


def _place(name: str, array: Any) -> tuple[Device, int | None]:
    """Where ``array`` lives, found without exporting it; the device id is None for a CUDA
    array interface, whose pointer's owner only CUDA can tell (``_cai_device``)."""
    if _is_numpy(array):
        return Device.CPU, 0
    if _is_torch(array):
        return _torch_place(name, array)
    if _is_cupy(array):
        return Device.NVIDIA, array.device.id
    if hasattr(array, "__cuda_array_interface__"):
        return Device.NVIDIA, None
    if hasattr(array, "__dlpack_device__"):
        return _dlpack_place(name, *array.__dlpack_device__())
    if hasattr(array, "__dlpack__"):
        found = _from_dlpack(name, array, None)
        return found.device, found.device_id
    raise _not_an_array(name, array)


def _cai_device(array: Any) -> int:
    """The device owning a CUDA array interface's memory (CuPy arrays know theirs)."""
    if _is_cupy(array):
        return array.device.id
    from .backends.cuda import pointer_device

    return pointer_device(array.__cuda_array_interface__["data"][0] or 0)


def common_place(arrays: dict[str, Any]) -> tuple[Device, int]:
    """The ``(device, device_id)`` every array of ``arrays`` (by name) lives on; BAD_PARAM
    naming each array's place otherwise. Device types are compared first, so host arrays
    among device ones are refused without asking CUDA anything."""
    places = {n: _place(n, a) for n, a in arrays.items()}
    if len({device for device, _ in places.values()}) == 1:
        places = {
            n: (device, _cai_device(arrays[n]) if device_id is None else device_id)
            for n, (device, device_id) in places.items()
        }
    if len(set(places.values())) > 1:
        where = ", ".join(
            f"{n} on {device.name}" + ("" if device_id is None else f":{device_id}")
            for n, (device, device_id) in places.items()
        )
        raise InfiniError(Status.BAD_PARAM, f"arrays must share one device; got {where}")
    device, device_id = next(iter(places.values()))
    return device, device_id or 0


def _cai_stream(name: str, iface: dict) -> int | None:
    """The producer's stream in a CUDA Array Interface v3 dict (None: nothing to order)."""
    producer = iface.get("stream")
    if producer == 0:  # the interface's specification disallows 0 as ambiguous
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name}.__cuda_array_interface__ has stream 0; the protocol allows None, 1, 2 "
            "or a cudaStream_t",
        )
    return producer


def operand(name: str, array: Any, stream: int | None = None) -> Operand:
    """Describe ``array``: NumPy, CuPy, torch, or any CUDA-array-interface/DLPack object.

    ``stream`` is the CUDA stream the call uses ``array`` on (None: on the CPU, or only
    described): a DLPack producer is handed it, and it waits for a CUDA Array Interface
    producer's ``stream``."""
    if isinstance(array, np.ndarray):
        return _from_ndarray(name, array)
    if _is_numpy(array):
        dtype = getattr(array, "dtype", None)
        return _from_interface(name, array.__array_interface__, Device.CPU, 0, dtype)
    if _is_torch(array):
        return _from_torch(name, array)
    if hasattr(array, "__cuda_array_interface__"):
        # CuPy 14's bfloat16 has typestr "<V2": the array's own dtype names it.
        dtype = getattr(array, "dtype", None)
        dtype = dtype if isinstance(dtype, np.dtype) else None
        iface = array.__cuda_array_interface__
        device_id = _cai_device(array)
        found = _from_interface(name, iface, Device.NVIDIA, device_id, dtype)
        producer = None if _is_cupy(array) else _cai_stream(name, iface)
        if stream is not None and producer is not None:
            from .backends.cuda import wait_for

            wait_for(stream, producer, device_id)
        return found
    if hasattr(array, "__dlpack__"):  # JAX and other producers
        return _from_dlpack(name, array, stream)
    raise _not_an_array(name, array)


def allocation_scope(like: Any, stream: int, device_id: int) -> AbstractContextManager:
    """Where a call allocates: ``device_id`` current and ``stream`` the allocating stream of
    ``like``'s library. Both caching allocators hand a freed block back only to allocations
    from the stream it was allocated on (CuPy: one arena per stream; torch: "the caching
    allocator is aware of only the stream where a tensor was allocated", the
    ``Tensor.record_stream`` documentation), so memory written on ``stream`` must come from
    ``stream``, or a block another stream is still using could be handed out."""
    if _is_numpy(like) or (_is_torch(like) and like.device.type != "cuda"):
        return nullcontext()
    if _is_torch(like):
        import torch

        if stream == torch.cuda.current_stream(like.device).cuda_stream:
            return nullcontext()
        return torch.cuda.stream(_torch_stream(stream, like.device.index))
    from .backends.cuda import stream_scope

    return stream_scope(stream, device_id)


@functools.cache
def _torch_stream(stream: int, device_index: int) -> Any:
    """torch's object for ``cudaStream_t`` ``stream`` (0: the device's default stream)."""
    import torch

    if stream == 0:
        return torch.cuda.default_stream(device_index)
    return torch.cuda.ExternalStream(stream, device=device_index)


def empty_like(like: Any, shape: tuple[int, ...], strides: tuple[int, ...], dtype: DataType) -> Any:
    """A new array of ``like``'s kind and device with ``shape``, element ``strides``, ``dtype``
    (on the GPU: inside ``allocation_scope``)."""
    if _is_torch(like):
        import torch

        return torch.empty_strided(shape, strides, dtype=_torch_dtypes()[dtype], device=like.device)
    xp: Any = np
    if not _is_numpy(like):
        import cupy as xp
    # BF16 in ml_dtypes' bfloat16 where ``like`` has it (NumPy, CuPy 14), else as its bits.
    own = dtype == DataType.BF16 and getattr(like.dtype, "name", None) == "bfloat16"
    storage = like.dtype if own else FLOAT_TYPES[dtype].storage
    if tuple(strides) == contiguous_strides(shape):
        return xp.empty(shape, storage)
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


def workspace_like(like: Any, nbytes: int) -> tuple[Any, int]:
    """``nbytes`` of scratch from ``like``'s own allocator (on the GPU: inside
    ``allocation_scope``, so that it is not reused before the work queued on the call's
    stream is done); (None, 0) for 0 bytes."""
    if nbytes == 0:
        return None, 0
    if _is_numpy(like):
        buffer = np.empty(nbytes, np.uint8)
        return buffer, buffer.ctypes.data
    if _is_torch(like):
        import torch

        buffer = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return buffer, buffer.data_ptr()
    import cupy

    buffer = cupy.empty(nbytes, cupy.uint8)
    return buffer, buffer.data.ptr
