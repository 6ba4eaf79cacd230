"""CuPy views of device memory the caller owns, and the workspace carved into typed slices.

Nothing here allocates device memory: a view wraps a raw pointer (``UnownedMemory``), and
``WorkspaceLayout`` only computes aligned offsets inside the caller's workspace.
"""

from dataclasses import dataclass, field
from typing import Any

from ..dtypes import FLOAT_TYPES
from ..enums import DataType
from ..tensor import TensorDesc

ALIGNMENT = 256


def device_view(ptr: int, desc: TensorDesc, device_id: int) -> Any:
    """A CuPy array over ``desc``'s elements at device address ``ptr`` (BF16 as uint16)."""
    import cupy

    storage = FLOAT_TYPES[desc.dtype].storage
    itemsize = storage.itemsize
    extent = (
        sum((n - 1) * s for n, s in zip(desc.shape, desc.strides, strict=True)) + 1
    ) * itemsize
    memory = cupy.cuda.UnownedMemory(ptr, extent, None, device_id)
    strides = tuple(s * itemsize for s in desc.strides)
    return cupy.ndarray(desc.shape, storage, cupy.cuda.MemoryPointer(memory, 0), strides=strides)


@dataclass
class WorkspaceLayout:
    """Aligned slices of one workspace; ``size`` is the bytes they need together.

    A layout may start at a non-zero ``size``: bytes at the front kept for someone else
    (cuDNN's own scratch).
    """

    size: int = 0
    slices: dict[str, tuple[int, TensorDesc]] = field(default_factory=dict)

    def add(self, name: str, dtype: DataType, count: int) -> None:
        """Reserve a packed ``(count,)`` array of ``dtype`` named ``name``."""
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        self.slices[name] = (offset, TensorDesc.contiguous(dtype, (count,)))
        self.size = offset + count * FLOAT_TYPES[dtype].itemsize

    def offset(self, name: str) -> int:
        return self.slices[name][0]

    def view(self, workspace: int, name: str, device_id: int) -> Any:
        offset, desc = self.slices[name]
        return device_view(workspace + offset, desc, device_id)
