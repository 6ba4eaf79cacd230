"""``TensorDesc``: what ``infiniopTensorDescriptor_t`` holds (dtype, shape, strides).

Strides are in elements, as in the C API. The checks here are the layout facts every
operator's validation needs: contiguity, channels-last order, and overlap.
"""

import math
from dataclasses import dataclass

from .enums import DataType


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
