"""BatchNormForwardTraining: batch statistics, normalized output, running-statistics update.

Writes ``output``, the batch mean and ``1/sqrt(var + eps)`` (``saved_mean``/``saved_invstd``,
what the backward's saved mode takes as they are), updates ``running_mean``/``running_var``
in place with PyTorch's momentum and unbiased variance when they are given, and fills the
reserve space a fused or persistent backward needs (``reserve_size`` bytes).
"""

from ..enums import Status
from ..errors import InfiniError
from ..problems import (
    ForwardTrainingAttributes,
    ForwardTrainingPointers,
    ForwardTrainingTensors,
    Fusion,
)
from ..runtime import Handle
from ..tensor import TensorDesc
from .batch_norm_backward import DEFAULT_EPS, parse_fusion
from .descriptor import OperatorDescriptor
from .validation import (
    check_channel_tensors,
    check_data_tensors,
    check_eps,
    check_flag,
    check_fraction,
    require,
)

DEFAULT_MOMENTUM = 0.1


def validate_tensors(tensors: ForwardTrainingTensors) -> None:
    """Every check that needs no data: shapes, dtypes, strides, missing descriptors."""
    x = check_data_tensors(
        tensors, required=("input", "output"), optional=("z",), outputs=("output",)
    )
    check_channel_tensors(
        tensors,
        x,
        required=("weight", "bias", "saved_mean", "saved_invstd"),
        optional=("running_mean", "running_var"),
    )
    if x.numel == x.shape[1]:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"input_desc has shape {x.shape}: training needs more than one value per channel",
        )


class BatchNormForwardTrainingDescriptor(OperatorDescriptor):
    """``infiniopBatchNormForwardTrainingDescriptor_t``."""

    op_name = "BatchNormForwardTraining"
    pointers = ForwardTrainingPointers
    written = frozenset(("output", "saved_mean", "saved_invstd", "running_mean", "running_var"))

    def __init__(
        self,
        handle: Handle,
        output_desc: TensorDesc,
        saved_mean_desc: TensorDesc,
        saved_invstd_desc: TensorDesc,
        input_desc: TensorDesc,
        weight_desc: TensorDesc,
        bias_desc: TensorDesc,
        running_mean_desc: TensorDesc | None,
        running_var_desc: TensorDesc | None,
        *,
        z_desc: TensorDesc | None = None,
        eps: float = DEFAULT_EPS,
        momentum: float = DEFAULT_MOMENTUM,
        fusion: Fusion | str | int | None = Fusion.BN,
        persistent: bool | None = None,
        check_overflow: bool = False,
    ) -> None:
        tensors = ForwardTrainingTensors(
            output_desc,
            saved_mean_desc,
            saved_invstd_desc,
            input_desc,
            weight_desc,
            bias_desc,
            running_mean_desc,
            running_var_desc,
            z_desc,
        )
        validate_tensors(tensors)
        attributes = ForwardTrainingAttributes(eps, momentum, fusion, persistent, check_overflow)  # type: ignore[arg-type]
        super().__init__(handle, tensors, attributes)

    def check_attributes(self, attributes: ForwardTrainingAttributes) -> ForwardTrainingAttributes:
        checked = ForwardTrainingAttributes(
            eps=check_eps(attributes.eps),
            momentum=check_fraction("momentum", attributes.momentum),
            fusion=parse_fusion(attributes.fusion),
            persistent=check_flag("persistent", attributes.persistent),
            check_overflow=check_flag("check_overflow", attributes.check_overflow) is True,
        )
        if checked.fusion == Fusion.BN_ADD_RELU:
            require("z_desc", self.tensors.z)
        return checked

    def needed_pointers(self, attributes: ForwardTrainingAttributes) -> tuple[str, ...]:
        """The pointers this problem reads or writes: each must be non-NULL."""
        t = self.tensors
        needed = ["output", "saved_mean", "saved_invstd", "input", "weight", "bias"]
        needed += [name for name in ("running_mean", "running_var") if getattr(t, name) is not None]
        if attributes.fusion == Fusion.BN_ADD_RELU:
            needed.append("z")
        return tuple(needed)

    def compute(
        self,
        workspace: int,
        workspace_size: int,
        reserve: int,
        reserve_size: int,
        output: int,
        saved_mean: int,
        saved_invstd: int,
        input: int,
        weight: int,
        bias: int,
        running_mean: int,
        running_var: int,
        stream: int = 0,
        *,
        z: int = 0,
    ) -> None:
        """Run on raw pointers (ints; 0 is NULL). Allocates nothing, never synchronizes."""
        ptrs = ForwardTrainingPointers(
            output,
            saved_mean,
            saved_invstd,
            input,
            weight,
            bias,
            running_mean,
            running_var,
            z,
            reserve,
        )
        self._launch(
            ptrs,
            workspace,
            workspace_size,
            stream,
            reserve_size=reserve_size,
        )
