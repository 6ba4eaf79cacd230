"""``batch_norm_forward_training`` and ``batch_norm_forward_inference``: the forward passes."""

from typing import Any, ClassVar

from ..enums import Status
from ..errors import InfiniError
from ..ops.batch_norm_backward import parse_fusion
from ..ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from ..ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from ..ops.validation import check_eps, check_flag, check_fraction
from ..problems import ForwardInferenceTensors, ForwardTrainingTensors
from ..runtime import Handle
from ..tensor import TensorDesc
from .call import Built, run
from .outputs import absent_parameter, packed_like, reserve_bytes, statistics_dtype

TRAINING_OUTPUTS = ("output", "saved_mean", "saved_invstd")
_PER_CHANNEL = ("weight", "bias", "running_mean", "running_var")


class TrainingOutputs(tuple):
    """``(output, saved_mean, saved_invstd)`` of a training forward; ``.reserve`` is the
    reserve space its backward takes as ``reserve=``: the caller's ``out[3]`` where given,
    else a byte array, or None when the problem needs none."""

    reserve: Any = None  # a result without one (the CPU engine's) needs no instance dict

    def __new__(
        cls, output: Any, saved_mean: Any, saved_invstd: Any, reserve: Any
    ) -> "TrainingOutputs":
        outputs = tuple.__new__(cls, (output, saved_mean, saved_invstd))
        if reserve is not None:
            outputs.reserve = reserve
        return outputs

    def __getnewargs__(self) -> tuple:
        """``__new__``'s four arguments, for ``copy`` and ``pickle`` (a tuple's give one)."""
        return (*self, self.reserve)


def parameters(descs: dict[str, TensorDesc | None]) -> tuple[dict, dict]:
    """``(descs, constants)`` with an absent weight (ones) or bias (zeros) stood in for."""
    descs, constants = dict(descs), {}
    for name, value in (("weight", 1.0), ("bias", 0.0)):
        if descs[name] is None:
            descs[name] = absent_parameter(descs["input"], descs, _PER_CHANNEL)
            constants[name] = (value, descs[name])
    return descs, constants


def _batch_shape(x: TensorDesc) -> None:
    if x.ndim < 2:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"input has shape {x.shape}; expected (N, C, ...)"
        )


class ForwardTraining:
    """The training forward: writes the running statistics and the ``out=`` arrays."""

    name = "forward_training"
    names = ("input", *_PER_CHANNEL, "z", *TRAINING_OUTPUTS, "reserve")
    out_names, out_optional = (*TRAINING_OUTPUTS, "reserve"), 1
    written = frozenset(("running_mean", "running_var", *out_names))
    writes = tuple(map(written.__contains__, names))
    spelling: ClassVar[dict[str, str]] = {o: f"out[{i}]" for i, o in enumerate(out_names)}

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple:
        eps, momentum, fusion, persistent, check_overflow = raw
        return (
            check_eps(eps),
            check_fraction("momentum", momentum),
            parse_fusion(fusion),
            check_flag("persistent", persistent),
            check_flag("check_overflow", check_overflow) is True,
        )

    def build(self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple) -> Built:
        eps, momentum, fusion, persistent, check_overflow = options
        _batch_shape(descs["input"])
        descs, constants = parameters(descs)
        x = descs["input"]
        stats = TensorDesc.contiguous(statistics_dtype(x), (x.shape[1],))
        made = {"output": packed_like(x), "saved_mean": stats, "saved_invstd": stats}
        tensors = ForwardTrainingTensors(
            *(descs[o] or made[o] for o in TRAINING_OUTPUTS),
            x,
            *(descs[n] for n in _PER_CHANNEL),
            descs["z"],
        )
        descriptor = BatchNormForwardTrainingDescriptor(
            handle,
            *tensors[:8],
            z_desc=tensors.z,
            eps=eps,
            momentum=momentum,
            fusion=fusion,
            persistent=persistent,
            check_overflow=check_overflow,
        )
        outputs = {o: made[o] for o in TRAINING_OUTPUTS if descs[o] is None}
        returns = (*TRAINING_OUTPUTS, "reserve")
        reserve_size = reserve_bytes(descs["reserve"], descriptor.reserve_size)
        # an empty batch leaves the running statistics as they are
        unwritten = frozenset(_PER_CHANNEL[2:] if x.numel == 0 else ())
        return Built(descriptor, {}, outputs, returns, constants, True, reserve_size, unwritten)

    result = TrainingOutputs


class ForwardInference:
    """The inference forward: writes only the ``out=`` array, if given."""

    name = "forward_inference"
    names = ("input", *_PER_CHANNEL, "output")
    out_names, out_optional = (), 0  # its out= is one array, an operand
    written = frozenset(("output",))
    writes = tuple(map(written.__contains__, names))
    spelling: ClassVar[dict[str, str]] = {"output": "out"}

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple:
        return (check_eps(raw[0]),)

    def build(self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple) -> Built:
        (eps,) = options
        _batch_shape(descs["input"])
        descs, constants = parameters(descs)
        x = descs["input"]
        tensors = ForwardInferenceTensors(
            descs["output"] or packed_like(x), x, *(descs[n] for n in _PER_CHANNEL)
        )
        descriptor = BatchNormForwardInferenceDescriptor(handle, *tensors, eps=eps)
        outputs = {} if descs["output"] is not None else {"output": tensors.output}
        return Built(descriptor, {}, outputs, ("output",), constants)

    result = None  # the output itself


FORWARD_TRAINING, FORWARD_INFERENCE = ForwardTraining(), ForwardInference()


def batch_norm_forward_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stream: Any = None,
    fusion: str | None = None,
    z: Any = None,
    persistent: bool | None = None,
    check_overflow: bool = False,
    out: tuple[Any, ...] | None = None,
) -> TrainingOutputs:
    """Training-mode batch norm: ``(output, saved_mean, saved_invstd)`` with ``.reserve``.

    Statistics are per channel (axis 1) over every other axis; ``running_mean`` and
    ``running_var`` (either may be None) are updated in place with PyTorch's semantics:
    ``running = (1 - momentum) * running + momentum * batch``, the batch variance unbiased.
    ``weight=None``/``bias=None`` stand for 1/0 (``affine=False``). ``saved_invstd`` is
    ``1/sqrt(biased var + eps)``; both saved statistics are F32 for F16/BF16 input and go
    straight into ``batch_norm_backward(..., mode="saved", saved_mean=..., saved_invstd=...,
    reserve=outputs.reserve)``. ``fusion`` ``"relu"`` or ``"add_relu"`` (with the residual
    ``z``) gives ``relu(bn(x) [+ z])``. ``out=(output, saved_mean, saved_invstd[,
    reserve])`` gives preallocated outputs (None entries are allocated): ``reserve``, one
    packed buffer of at least the problem's reserve size (16-byte aligned), is the reserve
    the call fills and returns, so that a loop (or a CUDA graph) allocates nothing.
    ``check_overflow=True`` is ``batch_norm_backward``'s synchronizing debug aid.
    """
    arrays = (input, weight, bias, running_mean, running_var, z)
    raw = (eps, momentum, fusion, persistent, check_overflow)
    return run(FORWARD_TRAINING, arrays, raw, stream, out)


def batch_norm_forward_inference(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    eps: float = 1e-5,
    stream: Any = None,
    out: Any = None,
) -> Any:
    """Inference-mode batch norm with fixed statistics, as an array of ``input``'s kind
    (``out``, if given); ``weight=None``/``bias=None`` stand for 1/0."""
    arrays = (input, weight, bias, running_mean, running_var, out)
    return run(FORWARD_INFERENCE, arrays, (eps,), stream)
