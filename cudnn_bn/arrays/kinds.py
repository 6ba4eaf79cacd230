"""The one table of where a call's new arrays come from: the library of its input operand.

The door (``door.operand``) gives every operand a ``Kind``: NumPy for host memory (ndarrays,
array interfaces, CPU DLPack), torch for torch tensors wherever they live, CuPy for device
memory that is not torch's (CuPy arrays, CUDA array interfaces, CUDA DLPack). A call allocates
its outputs, scratch and constants with its input's kind, on its device and, on a GPU,
inside ``scope``: its device current and its stream the allocating one. Both caching
allocators hand a freed block back only to allocations from the stream it was allocated on
(CuPy: one arena per stream; torch: "the caching allocator is aware of only the stream where
a tensor was allocated", the ``Tensor.record_stream`` documentation), so memory written on
the call's stream must come from it.

``current`` is the place of a call given no stream: the current stream of the operands'
device, with the scope that only makes that device current where it is not (one device
query and one stream query). ``scope`` enters nothing where its device and stream are
current already, so a call costs its library no stream or device switch it does not need.

A constant (``constant``: the ones or zeros standing in for an absent weight or bias) is
made once per layout and then read by calls on any stream, so on a GPU it is filled and
waited for before it is handed out, which a stream capturing a CUDA graph cannot do (its
fill would only be recorded): there it is refused, naming the argument, until a call made
before the capture has made it."""

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import numpy as np

from ..backends import cuda
from ..dtypes import FLOAT_TYPES
from ..enums import DataType, Status
from ..errors import InfiniError
from ..tensor import TensorDesc, contiguous_strides
from .numpy_arrays import ndarray_data
from .torch_tensors import torch_device, torch_dtypes, torch_stream

# Makes one new array of a planned layout or byte size (its kind's ``address`` gives its
# data pointer).
Allocator = Callable[[], Any]
_ANYWHERE = nullcontext()  # no device to enter, no stream to allocate from


def _memory_order(desc: TensorDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(order, inverse)``: the axes from outermost to innermost in memory, and the
    permutation that brings an array allocated in that order back to ``desc``'s axes."""
    order = tuple(sorted(range(desc.ndim), key=lambda a: (-desc.strides[a], a)))
    inverse = tuple(order.index(a) for a in range(desc.ndim))
    return order, inverse


def _in_memory_order(desc: TensorDesc) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``(shape, inverse)``: a packed layout of ``desc`` as the shape of an array allocated
    in its memory order, and the transposition back to ``desc``'s axes (None: none needed).
    So a channels-last output costs what a row-major one does, with no ``as_strided``."""
    order, inverse = _memory_order(desc)
    shape = tuple(desc.shape[a] for a in order)
    packed = contiguous_strides(shape)
    if not all(
        desc.shape[a] == 1 or desc.strides[a] == s for a, s in zip(order, packed, strict=True)
    ):
        raise ValueError(f"no packed layout has strides {desc.strides}")  # a caller's bug
    return shape, None if order == tuple(range(desc.ndim)) else inverse


def _packed(empty: Callable, desc: TensorDesc, storage: Any) -> Allocator:
    """New arrays of ``desc`` from a library's ``empty(shape, dtype)``, in memory order
    (``_in_memory_order``) and transposed back: ``empty`` itself, bound to the shape, where
    no transposition is needed (no Python frame of ours per output)."""
    shape, inverse = _in_memory_order(desc)
    allocate = partial(empty, shape, storage)
    return allocate if inverse is None else lambda: allocate().transpose(inverse)


class NumpyKind:
    """Host arrays: NumPy allocates (BF16 as ml_dtypes' bfloat16 where the input has it,
    else as its uint16 bits)."""

    name = "numpy"
    current_in_scope = False  # no device

    def scope(self, like: Any, stream: int, device_id: int) -> AbstractContextManager:
        return _ANYWHERE

    def storage(self, like: Any, dtype: DataType) -> np.dtype:
        own = (
            dtype == DataType.BF16
            and getattr(getattr(like, "dtype", None), "name", "") == "bfloat16"
        )
        return like.dtype if own else FLOAT_TYPES[dtype].storage

    def allocator(self, like: Any, desc: TensorDesc) -> Allocator:
        return _packed(np.empty, desc, self.storage(like, desc.dtype))

    address = staticmethod(ndarray_data)

    def buffer(self, like: Any, nbytes: int) -> Allocator:
        return partial(np.empty, nbytes, np.uint8)

    def constant(self, like: Any, value: float, desc: TensorDesc, name: str) -> Any:
        storage = self.storage(like, desc.dtype)
        return np.full(desc.shape, _stored(value, storage, desc.dtype), storage)


def _stored(value: float, storage: np.dtype, dtype: DataType) -> Any:
    """``value`` as an element of ``storage``: BF16 held as uint16 takes the value's bits
    (the high half of its float32, exact for the ones and zeros of ``constant``)."""
    if dtype == DataType.BF16 and storage == np.uint16:
        return int(np.float32(value).view(np.uint32)) >> 16
    return value


class TorchKind:
    """torch tensors, on the input's device, from torch's allocator on the call's stream."""

    name = "torch"
    current_in_scope = False  # torch allocates on the tensor's device, whichever is current

    def current(self, like: Any, device_id: int) -> tuple[int, AbstractContextManager]:
        """torch's current stream on ``like``'s device, where torch allocates for it."""
        return sys.modules["torch"].cuda.current_stream(torch_device(like)).cuda_stream, _ANYWHERE

    def scope(self, like: Any, stream: int, device_id: int) -> AbstractContextManager:
        device = torch_device(like)
        if device.type != "cuda":  # allocations go to like's device
            return _ANYWHERE
        torch = sys.modules["torch"]
        if stream == torch.cuda.current_stream(device).cuda_stream:
            return _ANYWHERE
        return torch.cuda.stream(torch_stream(stream, device.index or 0))

    def allocator(self, like: Any, desc: TensorDesc) -> Allocator:
        import torch

        dtype, device = torch_dtypes()[desc.dtype], torch_device(like)
        shape, strides = desc.shape, desc.strides

        return partial(torch.empty_strided, shape, strides, dtype=dtype, device=device)

    @staticmethod
    def address(array: Any) -> int:
        return array.data_ptr()

    def buffer(self, like: Any, nbytes: int) -> Allocator:
        torch = sys.modules["torch"]  # imported: like is a tensor
        return partial(torch.empty, nbytes, dtype=torch.uint8, device=torch_device(like))

    def constant(self, like: Any, value: float, desc: TensorDesc, name: str) -> Any:
        import torch

        device = torch_device(like)
        on_gpu = device.type == "cuda"
        if on_gpu and torch.cuda.is_current_stream_capturing():
            raise _captured(name)
        array = torch.full(desc.shape, value, dtype=torch_dtypes()[desc.dtype], device=device)
        if on_gpu:
            torch.cuda.current_stream(device).synchronize()
        return array


class CupyKind:
    """CuPy arrays on the operands' device, from CuPy's pool on the call's stream."""

    name = "cupy"
    current_in_scope = True  # its scope makes the operands' device current (``current``)

    def current(self, like: Any, device_id: int) -> tuple[int, AbstractContextManager]:
        """CuPy's current stream on ``device_id``; CuPy allocates from it once that device
        is current."""
        here, stream = cuda.current_place(device_id)
        return stream, _ANYWHERE if here == device_id else cuda.on_device(device_id)

    def scope(self, like: Any, stream: int, device_id: int) -> AbstractContextManager:
        if cuda.current_place(device_id) == (device_id, stream):
            return _ANYWHERE
        return cuda.stream_scope(stream, device_id)

    def allocator(self, like: Any, desc: TensorDesc) -> Allocator:
        return _packed(cuda.cupy_module().empty, desc, NUMPY.storage(like, desc.dtype))

    @staticmethod
    def address(array: Any) -> int:
        return array.data.ptr

    def buffer(self, like: Any, nbytes: int) -> Allocator:
        return partial(cuda.cupy_module().empty, nbytes, np.uint8)

    def constant(self, like: Any, value: float, desc: TensorDesc, name: str) -> Any:
        cupy = cuda.cupy_module()
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            raise _captured(name)
        storage = NUMPY.storage(like, desc.dtype)
        array = cupy.full(desc.shape, _stored(value, storage, desc.dtype), storage)
        stream.synchronize()
        return array


def _captured(name: str) -> InfiniError:
    return InfiniError(
        Status.BAD_PARAM,
        f"{name} is None, whose stand-in this problem's first call makes and waits for, "
        "which a stream capturing a CUDA graph cannot do: make one call of the problem "
        "before the capture",
    )


NUMPY, TORCH, CUPY = NumpyKind(), TorchKind(), CupyKind()
