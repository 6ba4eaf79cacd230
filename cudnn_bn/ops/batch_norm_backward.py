"""BatchNormBackward: the operator of the spec (``seeds/004``) and ``include/infiniop/ops``.

``BatchNormBackwardDescriptor`` validates its tensors once, picks a backend for the handle's
device, and caches what that backend built (cuDNN descriptors, workspace and reserve sizes).
``compute`` checks only what changes per call (pointers, workspace size) and runs.
"""

from typing import Any, Self

from ..enums import Device, Status
from ..errors import InfiniError
from ..problems import BackwardPointers, BackwardTensors, Mode
from ..runtime import Handle
from ..tensor import TensorDesc
from .validation import (
    check_channel_tensor,
    check_data_tensor,
    check_eps,
    check_like,
    check_output,
    require,
)

DEFAULT_EPS = 1e-5
MODE_NAMES = {
    "train": Mode.TRAIN,
    "saved": Mode.SAVED,
    "eval": Mode.EVAL,
    "saved_invstd": Mode.SAVED_INVSTD,
}


def validate_tensors(tensors: BackwardTensors) -> None:
    """Every check that needs no data: shapes, dtypes, strides, missing descriptors."""
    x = require("input_desc", tensors.input)
    check_data_tensor("input_desc", x)
    for name in ("grad_output", "grad_input"):
        desc = require(f"{name}_desc", getattr(tensors, name))
        check_like(f"{name}_desc", desc, "input_desc", x)
        check_data_tensor(f"{name}_desc", desc)  # its strides: >= 0, like input's
    check_output("grad_input_desc", tensors.grad_input)
    channels = x.shape[1]
    for name in ("weight", "grad_weight", "grad_bias"):
        check_channel_tensor(
            f"{name}_desc", require(f"{name}_desc", getattr(tensors, name)), channels, x.dtype
        )
    for name in ("running_mean", "running_var"):
        if (desc := getattr(tensors, name)) is not None:
            check_channel_tensor(f"{name}_desc", desc, channels, x.dtype)


def parse_mode(mode: object) -> Mode:
    """A ``Mode`` from its name (``"train"``, ``"saved"``, ``"eval"``) or its C value."""
    if isinstance(mode, str) and mode in MODE_NAMES:
        return MODE_NAMES[mode]
    if isinstance(mode, int) and not isinstance(mode, bool) and mode in Mode._value2member_map_:
        return Mode(mode)
    raise InfiniError(
        Status.BAD_PARAM,
        f"mode must be one of {', '.join(map(repr, MODE_NAMES))} (or 0..3), got {mode!r}",
    )


def _backend(device: Device) -> Any:
    if device == Device.CPU:
        from ..backends import cpu

        return cpu.BatchNormBackward
    if device == Device.NVIDIA:
        from ..backends import nvidia

        return nvidia.BatchNormBackward
    raise InfiniError(Status.DEVICE_TYPE_NOT_SUPPORTED, f"no backend for device {device!r}")


class BatchNormBackwardDescriptor:
    """``infiniopBatchNormBackwardDescriptor_t``: validated tensors plus a built backend."""

    def __init__(
        self,
        handle: Handle,
        grad_input_desc: TensorDesc,
        grad_weight_desc: TensorDesc,
        grad_bias_desc: TensorDesc,
        input_desc: TensorDesc,
        grad_output_desc: TensorDesc,
        weight_desc: TensorDesc,
        running_mean_desc: TensorDesc | None,
        running_var_desc: TensorDesc | None,
        *,
        eps: float = DEFAULT_EPS,
        mode: Mode | str = Mode.TRAIN,
    ) -> None:
        self.handle = handle
        self.tensors = BackwardTensors(
            grad_input_desc,
            grad_weight_desc,
            grad_bias_desc,
            input_desc,
            grad_output_desc,
            weight_desc,
            running_mean_desc,
            running_var_desc,
        )
        validate_tensors(self.tensors)
        self._backend_type = _backend(handle.device)
        self._kernel: Any = None
        self._build(eps, mode)

    def set_attributes(self, eps: float, mode: Mode | str | int) -> None:
        """Set eps and mode (``infiniopSetBatchNormBackwardAttributes``) and rebuild the backend."""
        self._live()
        self._build(eps, mode)

    def _build(self, eps: float, mode: Mode | str | int) -> None:
        eps, mode = check_eps(eps), parse_mode(mode)
        if mode.reads_statistics:
            require("running_mean_desc", self.tensors.running_mean)
            require("running_var_desc", self.tensors.running_var)
        kernel = self._backend_type(self.tensors, mode, eps, self.handle.device_id)
        self._release()
        self.eps, self.mode, self._kernel = eps, mode, kernel

    @property
    def engine(self) -> str:
        """Which engine runs this problem: ``"numpy"``, ``"cudnn"`` or ``"cupy"``."""
        return self._live().engine

    @property
    def workspace_size(self) -> int:
        """Bytes of device (or host) workspace ``compute`` needs."""
        return self._live().workspace_size

    @property
    def reserve_size(self) -> int:
        """Bytes of training reserve space cuDNN asked for (0 where unused)."""
        return self._live().reserve_size

    def compute(
        self,
        workspace: int,
        workspace_size: int,
        grad_input: int,
        grad_weight: int,
        grad_bias: int,
        input: int,
        grad_output: int,
        weight: int,
        running_mean: int,
        running_var: int,
        stream: int = 0,
    ) -> None:
        """Run on raw pointers (ints; 0 is NULL). Allocates nothing, never synchronizes."""
        kernel = self._live()
        ptrs = BackwardPointers(
            grad_input,
            grad_weight,
            grad_bias,
            input,
            grad_output,
            weight,
            running_mean,
            running_var,
        )
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
        for name, ptr in zip(BackwardPointers._fields, ptrs, strict=True):
            if not ptr and (self.mode.reads_statistics or not name.startswith("running_")):
                raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
        try:
            kernel.run(ptrs, workspace, stream)
        except InfiniError as exc:
            raise InfiniError(exc.status, f"{str(exc).partition(': ')[2]}\n{self.repro()}") from exc

    def repro(self) -> str:
        """A Python snippet that rebuilds this problem with the array API, for bug reports."""
        t = self.tensors
        lines = ["To reproduce:", "import cupy, cudnn_bn"]
        for name in ("input", "grad_output", "weight", "running_mean", "running_var"):
            desc = getattr(t, name)
            if desc is not None:
                lines.append(
                    f"# {name}: dtype {desc.dtype.name}, shape {desc.shape}, strides {desc.strides}"
                )
        lines.append(
            f"cudnn_bn.batch_norm_backward(input, grad_output, weight, running_mean, running_var, "
            f"eps={self.eps!r}, mode={self.mode.name.lower()!r})  # engine {self.engine}"
        )
        return "\n".join(lines)

    def destroy(self) -> None:
        """Release the backend's resources; later use raises BAD_PARAM."""
        if self._kernel is None:
            raise InfiniError(
                Status.BAD_PARAM, "BatchNormBackward descriptor was already destroyed"
            )
        self._release()

    def _release(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None and hasattr(kernel, "close"):
            kernel.close()

    def _live(self) -> Any:
        if self._kernel is None:
            raise InfiniError(Status.BAD_PARAM, "BatchNormBackward descriptor used after destroy()")
        return self._kernel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._kernel is not None:
            self._release()
