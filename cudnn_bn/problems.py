"""What an operator hands its backends: its tensors, their data pointers, its attributes.

Both backends take the same thing, exactly what the C API carries: a ``TensorDesc`` per
argument and a raw pointer per argument (host addresses on the CPU, device addresses on
NVIDIA), plus the operator's attributes. Field order is the C API's argument order; fields
past it (fused operands) default to None / 0.
"""

import enum
from dataclasses import dataclass
from typing import NamedTuple

from .tensor import TensorDesc


class Mode(enum.IntEnum):
    """Which statistics batch-norm backward uses (the C API's ``mode`` attribute).

    TRAIN: batch statistics recomputed from ``input``; ``running_*`` not read.
    SAVED: ``running_mean``/``running_var`` are the batch mean and biased batch variance.
    EVAL: ``running_*`` are fixed running statistics; no mean-of-dy terms.
    SAVED_INVSTD: like SAVED, but the second tensor is ``1/sqrt(var + eps)`` as a forward
    pass saved it (PyTorch's and cuDNN's saved statistics), used as given.
    """

    TRAIN = 0
    SAVED = 1
    EVAL = 2
    SAVED_INVSTD = 3

    @property
    def reads_statistics(self) -> bool:
        return self is not Mode.TRAIN


class Fusion(enum.IntEnum):
    """What a batch-norm pass fuses, as cuDNN's ``cudnnBatchNormOps_t``: ``y = act(bn(x) [+ z])``.

    BN: batch norm alone. BN_RELU: then ReLU. BN_ADD_RELU: add ``z`` (a residual), then ReLU.
    The backward of a fused pass takes the forward's ``output`` (its ReLU mask) and, with
    BN_ADD_RELU, also writes ``grad_z``.
    """

    BN = 0
    BN_RELU = 1
    BN_ADD_RELU = 2


@dataclass(frozen=True)
class BackwardAttributes:
    """Attributes of batch-norm backward. ``output_mask`` names the gradients wanted
    (grad_input, grad_weight, grad_bias); ``persistent`` None lets the NVIDIA backend use
    SPATIAL_PERSISTENT where PyTorch does (channels-last), False forces SPATIAL. ``reserve``
    False says compute will get no reserve space (a batched backward has none to give): a
    fused backward then runs where it needs none (the NVIDIA backend's CuPy engine).
    ``check_overflow``: see ``ForwardTrainingAttributes``."""

    eps: float = 1e-5
    mode: Mode = Mode.TRAIN
    fusion: Fusion = Fusion.BN
    output_mask: tuple[bool, bool, bool] = (True, True, True)
    persistent: bool | None = None
    reserve: bool = True
    check_overflow: bool = False


@dataclass(frozen=True)
class ForwardTrainingAttributes:
    """Attributes of training-mode forward: ``momentum`` is PyTorch's (and cuDNN's
    exponential average factor): ``running = (1 - momentum) * running + momentum * batch``.
    ``check_overflow`` is a debug aid that synchronizes: after a cuDNN SPATIAL_PERSISTENT
    pass, wait for it and warn if cuDNN reports a numerical overflow (CuPy 13's ``debug``)."""

    eps: float = 1e-5
    momentum: float = 0.1
    fusion: Fusion = Fusion.BN
    persistent: bool | None = None
    check_overflow: bool = False


@dataclass(frozen=True)
class ForwardInferenceAttributes:
    """Attributes of inference-mode forward."""

    eps: float = 1e-5


class ForwardTrainingTensors(NamedTuple):
    """Descriptors of training-mode forward; running statistics are optional (None)."""

    output: TensorDesc
    saved_mean: TensorDesc
    saved_invstd: TensorDesc
    input: TensorDesc
    weight: TensorDesc
    bias: TensorDesc
    running_mean: TensorDesc | None
    running_var: TensorDesc | None
    z: TensorDesc | None = None


class ForwardTrainingPointers(NamedTuple):
    """Data pointers of training-mode forward, in ``ForwardTrainingTensors`` order, and the
    reserve space it fills for the backward."""

    output: int
    saved_mean: int
    saved_invstd: int
    input: int
    weight: int
    bias: int
    running_mean: int
    running_var: int
    z: int = 0
    reserve: int = 0


class ForwardInferenceTensors(NamedTuple):
    """Descriptors of inference-mode forward."""

    output: TensorDesc
    input: TensorDesc
    weight: TensorDesc
    bias: TensorDesc
    running_mean: TensorDesc
    running_var: TensorDesc


class ForwardInferencePointers(NamedTuple):
    """Data pointers of inference-mode forward, in ``ForwardInferenceTensors`` order."""

    output: int
    input: int
    weight: int
    bias: int
    running_mean: int
    running_var: int


class BackwardTensors(NamedTuple):
    """Descriptors of batch-norm backward's arguments; ``running_*`` may be None in TRAIN.

    Fused backward (``Fusion`` BN_RELU / BN_ADD_RELU) also reads the forward's ``output``
    and ``bias`` and, with the add, writes ``grad_z``."""

    grad_input: TensorDesc
    grad_weight: TensorDesc
    grad_bias: TensorDesc
    input: TensorDesc
    grad_output: TensorDesc
    weight: TensorDesc
    running_mean: TensorDesc | None
    running_var: TensorDesc | None
    output: TensorDesc | None = None
    bias: TensorDesc | None = None
    grad_z: TensorDesc | None = None


class BackwardPointers(NamedTuple):
    """Data pointers of batch-norm backward's arguments, in ``BackwardTensors`` order, and
    the reserve space a fused or persistent forward filled."""

    grad_input: int
    grad_weight: int
    grad_bias: int
    input: int
    grad_output: int
    weight: int
    running_mean: int
    running_var: int
    output: int = 0
    bias: int = 0
    grad_z: int = 0
    reserve: int = 0
