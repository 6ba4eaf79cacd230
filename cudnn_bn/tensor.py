"""``TensorDesc``: what ``infiniopTensorDescriptor_t`` holds (dtype, shape, strides).

Strides are in elements, as in the C API. The checks here are the layout facts every
operator's validation needs: contiguity, channels-last order, and overlap.
"""

import functools
import math
from dataclasses import dataclass

from .enums import DataType, Status
from .errors import InfiniError

# Bytes per element of every infiniDtype_t (include/infinicore.h); INVALID has none.
ITEMSIZE = {
    DataType.BYTE: 1, DataType.BOOL: 1, DataType.I8: 1, DataType.I16: 2, DataType.I32: 4,
    DataType.I64: 8, DataType.U8: 1, DataType.U16: 2, DataType.U32: 4, DataType.U64: 8,
    DataType.F8: 1, DataType.F16: 2, DataType.F32: 4, DataType.F64: 8, DataType.C16: 2,
    DataType.C32: 4, DataType.C64: 8, DataType.C128: 16, DataType.BF16: 2,
}  # fmt: skip
MAX_BYTES = (1 << 63) - 1  # the largest ptrdiff_t: no buffer or byte offset exceeds it


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a packed tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorDesc:
    """A tensor's dtype, shape and strides (in elements)."""

    dtype: DataType
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def checked(cls, dtype: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> "TensorDesc":
        """A descriptor some buffer can hold, as ``infiniopCreateTensorDescriptor`` takes it:
        a real dtype (BAD_TENSOR_DTYPE), sizes whose product in bytes fits a ``ptrdiff_t``
        (BAD_TENSOR_SHAPE), strides whose farthest element does too (BAD_TENSOR_STRIDES).
        Remembered per (dtype, shape, strides): the array API's door asks on every call."""
        return _checked(dtype, tuple(shape), tuple(strides))

    @classmethod
    def contiguous(cls, dtype: DataType, shape: tuple[int, ...]) -> "TensorDesc":
        return cls(dtype, tuple(shape), contiguous_strides(tuple(shape)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        """Packed row-major; strides of size-1 axes do not matter."""
        return all(
            n == 1 or s == c
            for n, s, c in zip(
                self.shape, self.strides, contiguous_strides(self.shape), strict=True
            )
        )

    def is_channels_last(self) -> bool:
        """Packed with the channel axis (1) innermost: NHWC / NDHWC / NLC memory order."""
        if self.ndim < 3:
            return False
        order = (0, *range(2, self.ndim), 1)
        permuted = TensorDesc(
            self.dtype, tuple(self.shape[i] for i in order), tuple(self.strides[i] for i in order)
        )
        return permuted.is_contiguous()

    def packed_strides(self) -> tuple[int, ...]:
        """Strides of a packed tensor of this shape in this one's layout: row-major unless
        this one is channels-last and not row-major (a tensor can be both when C or the
        spatial size is 1). For a packed tensor they differ from ``strides`` only on size-1
        axes, which cuDNN reads to tell layouts apart."""
        if self.is_contiguous() or not self.is_channels_last():
            return contiguous_strides(self.shape)
        order = (0, *range(2, self.ndim), 1)
        strides = [0] * self.ndim
        for axis, stride in zip(
            order, contiguous_strides(tuple(self.shape[i] for i in order)), strict=True
        ):
            strides[axis] = stride
        return tuple(strides)

    def overlaps(self) -> bool:
        """Whether two different indices can address the same element.

        Sorting axes by stride, a layout is free of overlap when each stride exceeds the
        span of all smaller-stride axes; that test is exact for the layouts tensors have
        and conservative otherwise (it may call an exotic interleaving overlapping).
        """
        if self.numel == 0:
            return False
        span = 0
        for stride, size in sorted(
            (abs(s), n) for n, s in zip(self.shape, self.strides, strict=True) if n > 1
        ):
            if stride <= span:
                return True
            span += stride * (size - 1)
        return False


@functools.lru_cache(maxsize=4096)
def _checked(dtype: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> TensorDesc:
    if dtype not in ITEMSIZE:
        name = DataType(dtype).name if dtype in DataType._value2member_map_ else dtype
        raise InfiniError(Status.BAD_TENSOR_DTYPE, f"dtype {name} is not an element type")
    itemsize = ITEMSIZE[DataType(dtype)]
    if any(not 0 <= n <= MAX_BYTES for n in shape):
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"shape {shape} has a size outside [0, 2**63)")
    if any(not -MAX_BYTES - 1 <= s <= MAX_BYTES for s in strides):
        raise InfiniError(Status.BAD_TENSOR_STRIDES, f"strides {strides} do not fit ptrdiff_t")
    if math.prod(shape) * itemsize > MAX_BYTES:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"shape {shape} holds more bytes than any buffer can"
        )
    if 0 not in shape:
        reach = sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True))
        if (reach + 1) * itemsize > MAX_BYTES:
            raise InfiniError(
                Status.BAD_TENSOR_STRIDES,
                f"strides {strides} reach beyond any buffer for shape {shape}",
            )
    return TensorDesc(DataType(dtype), shape, strides)


@functools.lru_cache(maxsize=4096)
def byte_extent(desc: TensorDesc) -> tuple[int, int]:
    """``[low, high)``: the bytes a tensor of ``desc`` touches, relative to its pointer."""
    if desc.numel == 0:
        return 0, 0
    itemsize = ITEMSIZE[desc.dtype]
    low = sum(min(0, (n - 1) * s) for n, s in zip(desc.shape, desc.strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(desc.shape, desc.strides, strict=True))
    return low * itemsize, (high + 1) * itemsize


def overlap(a: TensorDesc, a_ptr: int, b: TensorDesc, b_ptr: int) -> bool:
    """Whether tensors ``a`` at ``a_ptr`` and ``b`` at ``b_ptr`` (one device) may have a byte
    in common: their byte ranges meet, except for two vectors of one stride whose elements
    interleave without touching (``buf[0::2]`` and ``buf[1::2]``). Conservative on other
    interleavings. A tensor with no elements has no byte: it overlaps nothing, wherever its
    pointer lies (as PyTorch's ``get_overlap_status``)."""
    (a_low, a_high), (b_low, b_high) = byte_extent(a), byte_extent(b)
    if a_low == a_high or b_low == b_high:
        return False
    if a_ptr + a_low >= b_ptr + b_high or b_ptr + b_low >= a_ptr + a_high:
        return False
    a_size, b_size = ITEMSIZE[a.dtype], ITEMSIZE[b.dtype]
    if a.ndim == b.ndim == 1:
        step = abs(a.strides[0]) * a_size
        if step and step == abs(b.strides[0]) * b_size:
            offset = (b_ptr - a_ptr) % step  # where b's elements start within a's steps
            return offset < a_size or step - offset < b_size
    return True
