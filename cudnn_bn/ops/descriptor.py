"""What every operator descriptor shares: a backend kernel built once for validated tensors.

A descriptor holds its handle, its tensors (validated by the operator module before it is
built) and its attributes; the backend kernel built from them caches everything that does
not depend on data (cuDNN descriptors, workspace and reserve sizes). ``_launch`` does the
per-call checks every operator needs and runs the kernel; a cuDNN failure comes back with a
snippet that reproduces the problem.
"""

import dataclasses
import enum
from typing import Any, ClassVar, NamedTuple, Self

from ..enums import Device, Status
from ..errors import InfiniError
from ..runtime import Handle

# The workspace holds F64 scratch, cuDNN's own and staged per-channel slices at 256-byte
# offsets: refused unless 16-byte aligned (every CUDA and host allocator gives at least that).
WORKSPACE_ALIGNMENT = 16


def backend_class(device: Device, op_name: str) -> Any:
    """The class implementing operator ``op_name`` on ``device``'s backend."""
    if device == Device.CPU:
        from ..backends import cpu as backend
    elif device == Device.NVIDIA:
        from ..backends import nvidia as backend
    else:
        raise InfiniError(Status.DEVICE_TYPE_NOT_SUPPORTED, f"no backend for device {device!r}")
    return getattr(backend, op_name)


def _show(value: Any) -> str:
    """An attribute as the array API spells it (enums by lowercase name)."""
    return repr(value.name.lower()) if isinstance(value, enum.Enum) else repr(value)


class OperatorDescriptor:
    """Base of the operator descriptors: lifecycle, cached sizes, per-call checks."""

    op_name: ClassVar[str]

    def __init__(self, handle: Handle, tensors: NamedTuple, attributes: Any) -> None:
        self.handle = handle
        self.tensors = tensors
        self._backend_type = backend_class(handle.device, self.op_name)
        self._kernel: Any = None
        self._build(attributes)

    def check_attributes(self, attributes: Any) -> Any:
        """The attributes, validated against the tensors (operators override this)."""
        return attributes

    def set_attributes(self, **changes: Any) -> None:
        """Change some attributes and rebuild the backend kernel for them."""
        self._live()
        self._build(dataclasses.replace(self.attributes, **changes))

    def _build(self, attributes: Any) -> None:
        attributes = self.check_attributes(attributes)
        kernel = self._backend_type(self.tensors, attributes, self.handle.device_id)
        self._release()
        self.attributes, self._kernel = attributes, kernel
        self._needed = self.needed_pointers()

    def needed_pointers(self) -> tuple[str, ...]:
        """The pointers a compute reads or writes, each required to be non-NULL: by default
        those of every tensor present (operators with optional operands override this)."""
        return tuple(
            name
            for name, desc in zip(self.tensors._fields, self.tensors, strict=True)
            if desc is not None
        )

    @property
    def engine(self) -> str:
        """Which engine runs this problem: ``"numpy"``, ``"cudnn"`` or ``"cupy"``."""
        return self._live().engine

    @property
    def workspace_size(self) -> int:
        """Bytes of workspace each compute needs."""
        return self._live().workspace_size

    @property
    def reserve_size(self) -> int:
        """Bytes of reserve space a training forward fills for its backward (0: none)."""
        return self._live().reserve_size

    def _launch(
        self,
        ptrs: NamedTuple,
        workspace: int,
        workspace_size: int,
        stream: int,
        reserve_size: int | None = None,
    ) -> None:
        """Check sizes and the needed pointers, then run; writes nothing on error.

        ``reserve_size`` is the caller's reserve buffer size where the operator takes one.
        """
        kernel = self._live()
        if workspace_size < kernel.workspace_size:
            raise InfiniError(
                Status.INSUFFICIENT_WORKSPACE,
                f"workspace_size is {workspace_size} bytes; "
                f"this descriptor needs {kernel.workspace_size}",
            )
        if kernel.workspace_size and not workspace:
            raise InfiniError(
                Status.NULL_POINTER,
                f"workspace is NULL but {kernel.workspace_size} bytes are needed",
            )
        if kernel.workspace_size and workspace % WORKSPACE_ALIGNMENT:
            raise InfiniError(
                Status.BAD_PARAM,
                f"workspace {workspace:#x} is not {WORKSPACE_ALIGNMENT}-byte aligned",
            )
        if reserve_size is not None and kernel.reserve_size:
            if reserve_size < kernel.reserve_size:
                raise InfiniError(
                    Status.INSUFFICIENT_WORKSPACE,
                    f"reserve_size is {reserve_size} bytes; "
                    f"this descriptor needs {kernel.reserve_size}",
                )
            needed = (*self._needed, "reserve")
        else:
            needed = self._needed
        for name in needed:
            if not getattr(ptrs, name):
                raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
        try:
            kernel.run(ptrs, workspace, stream)
        except InfiniError as exc:
            raise InfiniError(exc.status, f"{str(exc).partition(': ')[2]}\n{self.repro()}") from exc

    def repro(self) -> str:
        """A description of this problem precise enough to rebuild it, for bug reports."""
        lines = [
            f"To reproduce: {self.op_name} on {self.handle.device.name}:{self.handle.device_id}"
        ]
        for name, desc in zip(self.tensors._fields, self.tensors, strict=True):
            if desc is not None:
                lines.append(
                    f"  {name}: {desc.dtype.name} shape {desc.shape} strides {desc.strides}"
                )
        shown = ", ".join(
            f"{f.name}={_show(getattr(self.attributes, f.name))}"
            for f in dataclasses.fields(self.attributes)
        )
        lines.append(f"  attributes: {shown}  (engine {self._kernel.engine})")
        return "\n".join(lines)

    def destroy(self) -> None:
        """Release the backend's resources; later use raises BAD_PARAM."""
        self._live()
        self._release()

    def _release(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None and hasattr(kernel, "close"):
            kernel.close()

    def _live(self) -> Any:
        if self._kernel is None:
            raise InfiniError(Status.BAD_PARAM, f"{self.op_name} descriptor used after destroy()")
        return self._kernel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release()
