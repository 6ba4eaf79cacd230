"""BatchNormForwardInference: ``output = weight * (input - mean) / sqrt(var + eps) + bias``
with fixed (running) statistics."""

from ..problems import ForwardInferenceAttributes, ForwardInferencePointers, ForwardInferenceTensors
from ..runtime import Handle
from ..tensor import TensorDesc
from .batch_norm_backward import DEFAULT_EPS
from .descriptor import OperatorDescriptor
from .validation import check_channel_tensors, check_data_tensors, check_eps

CHANNEL_TENSORS = ("weight", "bias", "running_mean", "running_var")


def validate_tensors(tensors: ForwardInferenceTensors) -> None:
    """Every check that needs no data: shapes, dtypes, strides, missing descriptors."""
    x = check_data_tensors(tensors, required=("input", "output"), outputs=("output",))
    check_channel_tensors(tensors, x, required=CHANNEL_TENSORS)


class BatchNormForwardInferenceDescriptor(OperatorDescriptor):
    """``infiniopBatchNormForwardInferenceDescriptor_t``."""

    op_name = "BatchNormForwardInference"
    pointers = ForwardInferencePointers
    written = frozenset(("output",))

    def __init__(
        self,
        handle: Handle,
        output_desc: TensorDesc,
        input_desc: TensorDesc,
        weight_desc: TensorDesc,
        bias_desc: TensorDesc,
        running_mean_desc: TensorDesc,
        running_var_desc: TensorDesc,
        *,
        eps: float = DEFAULT_EPS,
    ) -> None:
        tensors = ForwardInferenceTensors(
            output_desc, input_desc, weight_desc, bias_desc, running_mean_desc, running_var_desc
        )
        validate_tensors(tensors)
        super().__init__(handle, tensors, ForwardInferenceAttributes(eps))

    def check_attributes(
        self, attributes: ForwardInferenceAttributes
    ) -> ForwardInferenceAttributes:
        return ForwardInferenceAttributes(eps=check_eps(attributes.eps))

    def compute(
        self,
        workspace: int,
        workspace_size: int,
        output: int,
        input: int,
        weight: int,
        bias: int,
        running_mean: int,
        running_var: int,
        stream: int = 0,
    ) -> None:
        """Run on raw pointers (ints; 0 is NULL). Allocates nothing, never synchronizes."""
        ptrs = ForwardInferencePointers(output, input, weight, bias, running_mean, running_var)
        self._launch(ptrs, workspace, workspace_size, stream)
