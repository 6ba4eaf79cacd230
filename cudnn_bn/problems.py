"""What an operator hands its backends: its tensors, their data pointers, and its mode.

Both backends take the same thing, exactly what the C API carries: a ``TensorDesc`` per
argument and a raw pointer per argument (host addresses on the CPU, device addresses on
NVIDIA). Field order is the spec's argument order.
"""

import enum
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


class BackwardTensors(NamedTuple):
    """Descriptors of batch-norm backward's arguments; ``running_*`` may be None in TRAIN."""

    grad_input: TensorDesc
    grad_weight: TensorDesc
    grad_bias: TensorDesc
    input: TensorDesc
    grad_output: TensorDesc
    weight: TensorDesc
    running_mean: TensorDesc | None
    running_var: TensorDesc | None


class BackwardPointers(NamedTuple):
    """Data pointers of batch-norm backward's arguments, in ``BackwardTensors`` order."""

    grad_input: int
    grad_weight: int
    grad_bias: int
    input: int
    grad_output: int
    weight: int
    running_mean: int
    running_var: int
