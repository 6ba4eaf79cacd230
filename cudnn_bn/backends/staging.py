"""Per-channel operands moved through the workspace into the form cuDNN takes.

cuDNN's batch-norm calls want scale, bias and statistics packed (stride 1) in F32 (F64 for
F64 data). Operands already in that form are passed as they are; the others get an aligned
workspace slice, converted in before the call (``read``), out after it (``write``), or both
(running statistics). Saved-mode variance becomes ``1/sqrt(var + eps)`` on the way in, and
outputs nobody asked for go to a ``scratch`` slice that is never copied out.
"""

from typing import Any, NamedTuple

from ..enums import DataType
from ..tensor import TensorDesc
from . import cuda
from .device_arrays import WorkspaceLayout, device_view


class ParameterStaging:
    """Which per-channel operands go through the workspace, and the kernels that move them."""

    def __init__(self, param_dtype: DataType, workspace_start: int, device_id: int) -> None:
        self.param_dtype, self.device_id = param_dtype, device_id
        self.layout = WorkspaceLayout(size=workspace_start)
        self.reads: list[tuple[str, TensorDesc, float | None]] = []  # (field, source, invstd eps)
        self.writes: list[tuple[str, TensorDesc]] = []

    def plan(
        self,
        field: str,
        desc: TensorDesc,
        *,
        read: bool = False,
        write: bool = False,
        invstd_eps: float | None = None,
    ) -> None:
        """Route ``field`` through the workspace unless cuDNN can take it as it is."""
        if desc.dtype == self.param_dtype and desc.strides[0] == 1 and invstd_eps is None:
            return
        self.layout.add(field, self.param_dtype, desc.shape[0])
        if read:
            self.reads.append((field, desc, invstd_eps))
        if write:
            self.writes.append((field, desc))

    def scratch(self, field: str, dtype: DataType, count: int) -> None:
        """A slice that receives an output nobody asked for."""
        self.layout.add(field, dtype, count)

    @property
    def size(self) -> int:
        return self.layout.size

    def read(self, ptrs: NamedTuple, workspace: int, stream: int) -> None:
        """Convert the staged inputs into the workspace (on ``stream``)."""
        if self.reads:
            self._move(ptrs, workspace, stream, inbound=True)

    def write(self, ptrs: NamedTuple, workspace: int, stream: int) -> None:
        """Convert the staged outputs back into the caller's tensors (on ``stream``)."""
        if self.writes:
            self._move(ptrs, workspace, stream, inbound=False)

    def _move(self, ptrs: NamedTuple, workspace: int, stream: int, inbound: bool) -> None:
        from . import cupy_kernels

        dev, p = self.device_id, self.param_dtype
        with cuda.stream_scope(stream, dev):
            for field, desc, *transform in self.reads if inbound else self.writes:
                theirs: Any = device_view(getattr(ptrs, field), desc, dev)
                ours: Any = self.layout.view(workspace, field, dev)
                if not inbound:
                    cupy_kernels.convert(ours, p, theirs, desc.dtype)
                elif transform[0] is not None:
                    cupy_kernels.invstd_from_var(
                        theirs, desc.dtype, transform[0], ours, cupy_kernels.acc_type(p)
                    )
                else:
                    cupy_kernels.convert(theirs, desc.dtype, ours, p)
