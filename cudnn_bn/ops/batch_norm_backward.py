"""BatchNormBackward: InfiniCore's operator, as ``include/infiniop/ops/batch_norm_backward.h``.

Beyond the spec's tensors, the descriptor takes the fused forward's ``output`` and ``bias``
and a ``grad_z`` output (``Fusion`` BN_RELU / BN_ADD_RELU), and an ``output_mask`` of the
gradients wanted; a masked-off output may be NULL and is never written.
"""

from typing import Any

from ..problems import BackwardAttributes, BackwardPointers, BackwardTensors, Fusion, Mode
from ..runtime import Handle
from ..tensor import TensorDesc
from .descriptor import OperatorDescriptor
from .validation import (
    check_channel_tensors,
    check_data_tensors,
    check_eps,
    check_flag,
    check_output_mask,
    parse_enum,
    require,
)

DEFAULT_EPS = 1e-5
MODE_NAMES = {
    "train": Mode.TRAIN,
    "saved": Mode.SAVED,
    "eval": Mode.EVAL,
    "saved_invstd": Mode.SAVED_INVSTD,
}
FUSION_NAMES = {None: Fusion.BN, "relu": Fusion.BN_RELU, "add_relu": Fusion.BN_ADD_RELU}
OUTPUTS = ("grad_input", "grad_weight", "grad_bias")


def validate_tensors(tensors: BackwardTensors) -> None:
    """Every check that needs no data: shapes, dtypes, strides, missing descriptors."""
    x = check_data_tensors(
        tensors,
        required=("input", "grad_output", "grad_input"),
        optional=("output", "grad_z"),
        outputs=("grad_input", "grad_z"),
    )
    check_channel_tensors(
        tensors,
        x,
        required=("weight", "grad_weight", "grad_bias"),
        optional=("running_mean", "running_var", "bias"),
    )


def parse_mode(mode: object) -> Mode:
    """A ``Mode`` from its name (``"train"``, ``"saved"``, ``"eval"``) or its C value."""
    return parse_enum("mode", mode, MODE_NAMES, Mode)


def parse_fusion(fusion: object) -> Fusion:
    """A ``Fusion`` from None, ``"relu"``, ``"add_relu"`` or its C value."""
    return parse_enum("fusion", fusion, FUSION_NAMES, Fusion)


class BatchNormBackwardDescriptor(OperatorDescriptor):
    """``infiniopBatchNormBackwardDescriptor_t``: validated tensors plus a built backend."""

    op_name = "BatchNormBackward"
    pointers = BackwardPointers
    written = frozenset((*OUTPUTS, "grad_z"))
    zeroed_when_empty = ("grad_weight", "grad_bias")

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
        output_desc: TensorDesc | None = None,
        bias_desc: TensorDesc | None = None,
        grad_z_desc: TensorDesc | None = None,
        eps: float = DEFAULT_EPS,
        mode: Mode | str | int = Mode.TRAIN,
        fusion: Fusion | str | int | None = Fusion.BN,
        output_mask: tuple[bool, bool, bool] = (True, True, True),
        persistent: bool | None = None,
        reserve: bool = True,
        check_overflow: bool = False,
    ) -> None:
        tensors = BackwardTensors(
            grad_input_desc,
            grad_weight_desc,
            grad_bias_desc,
            input_desc,
            grad_output_desc,
            weight_desc,
            running_mean_desc,
            running_var_desc,
            output_desc,
            bias_desc,
            grad_z_desc,
        )
        validate_tensors(tensors)
        attributes = BackwardAttributes(  # type: ignore[arg-type]
            eps, mode, fusion, output_mask, persistent, reserve, check_overflow
        )
        super().__init__(handle, tensors, attributes)

    def check_attributes(self, attributes: BackwardAttributes) -> BackwardAttributes:
        checked = BackwardAttributes(
            eps=check_eps(attributes.eps),
            mode=parse_mode(attributes.mode),
            fusion=parse_fusion(attributes.fusion),
            output_mask=check_output_mask(attributes.output_mask),
            persistent=check_flag("persistent", attributes.persistent),
            reserve=check_flag("reserve", attributes.reserve) is not False,
            check_overflow=check_flag("check_overflow", attributes.check_overflow) is True,
        )
        t = self.tensors
        if checked.mode.reads_statistics:
            require("running_mean_desc", t.running_mean)
            require("running_var_desc", t.running_var)
        if checked.fusion != Fusion.BN:
            require("output_desc", t.output)
            require("bias_desc", t.bias)
        if checked.fusion == Fusion.BN_ADD_RELU:
            require("grad_z_desc", t.grad_z)
        return checked

    def set_attributes(self, eps: float, mode: Mode | str | int, **changes: Any) -> None:  # type: ignore[override]
        """``infiniopSetBatchNormBackwardAttributes``: eps and mode (and any other attribute)."""
        super().set_attributes(eps=eps, mode=mode, **changes)

    @property
    def eps(self) -> float:
        return self.attributes.eps

    @property
    def mode(self) -> Mode:
        return self.attributes.mode

    def needed_pointers(self, attributes: BackwardAttributes) -> tuple[str, ...]:
        """The pointers this problem reads or writes: each must be non-NULL."""
        a = attributes
        needed = ["input", "grad_output", "weight"]
        needed += [name for name, wanted in zip(OUTPUTS, a.output_mask, strict=True) if wanted]
        if a.mode.reads_statistics:
            needed += ["running_mean", "running_var"]
        if a.fusion != Fusion.BN:
            needed += ["output", "bias"]
        if a.fusion == Fusion.BN_ADD_RELU:
            needed.append("grad_z")
        return tuple(needed)

    def uses_reserve(self, attributes: BackwardAttributes, given: bool) -> bool:
        """A fused backward needs its forward's reserve; a plain one uses it when given."""
        return attributes.fusion != Fusion.BN or given

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
        *,
        output: int = 0,
        bias: int = 0,
        grad_z: int = 0,
        reserve: int = 0,
        reserve_size: int = 0,
    ) -> None:
        """Run on raw pointers (ints; 0 is NULL). Allocates nothing, never synchronizes.

        A fused backward needs the reserve space its forward filled (``reserve_size`` bytes
        at ``reserve``); a plain one uses it when given.
        """
        ptrs = BackwardPointers(
            grad_input,
            grad_weight,
            grad_bias,
            input,
            grad_output,
            weight,
            running_mean,
            running_var,
            output,
            bias,
            grad_z,
            reserve,
        )
        self._launch(ptrs, workspace, workspace_size, stream, reserve_size=reserve_size)
