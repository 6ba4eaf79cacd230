"""The CPU backend: every batch-norm pass on host pointers, two walks over the data.

Each kernel object is built once per descriptor: it works out how to walk its tensors
(``cpu_layout.Layout``), the per-channel operands' strides and dtypes, and how many
threads a call may use; a call then only hands the pointers to one compiled pass
(``cpu_kernels``): per-channel sums in one read of the data, then the results in one more
read and one write. Fused passes (``Fusion``) apply the same maths as cuDNN:
``y = relu(bn(x) [+ z])`` forward, and backward through the ReLU mask ``output > 0``.

Aliasing: an output may be the very tensor of an input (same address and strides, e.g.
``grad_input`` over ``grad_output``): each element is read before it is written. An output
that overlaps an input any other way is computed into a scratch buffer and copied at the
end, so the result is what it would be without the overlap.
"""

import os

import numba
import numpy as np

from ..dtypes import FLOAT_TYPES
from ..enums import DataType
from ..problems import (
    BackwardAttributes,
    BackwardPointers,
    BackwardTensors,
    ForwardInferenceAttributes,
    ForwardInferencePointers,
    ForwardInferenceTensors,
    ForwardTrainingAttributes,
    ForwardTrainingPointers,
    ForwardTrainingTensors,
    Fusion,
)
from ..tensor import TensorDesc
from . import cpu_kernels
from .cpu_layout import Layout
from .host import host_array

# The kernels see F16 as uint16 and BF16 as int16 bits (cpu_kernels); a zero-length array
# of the storage dtype tells them which.
_LIKE = {
    DataType.F16: np.empty(0, np.uint16),
    DataType.BF16: np.empty(0, np.int16),
    DataType.F32: np.empty(0, np.float32),
    DataType.F64: np.empty(0, np.float64),
}
PARALLEL_MIN_VALUES = 1 << 16  # below this many values a thread start-up costs more than it saves


def _thread_limit() -> int | None:
    """``OMP_NUM_THREADS`` as a cap on numba's thread count (unset or invalid: no cap)."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"].split(",")[0]))
    except (KeyError, ValueError):
        return None


_THREAD_LIMIT = _thread_limit()


def thread_count() -> int:
    """Threads a call may use: numba's count for this thread (``NUMBA_NUM_THREADS``,
    ``numba.set_num_threads``), capped by ``OMP_NUM_THREADS`` where that is set."""
    threads = numba.get_num_threads()
    return threads if _THREAD_LIMIT is None else min(threads, _THREAD_LIMIT)


def _channel_args(descs: list[TensorDesc | None]) -> np.ndarray:
    """(stride, dtype code) of each per-channel tensor, (1, F64) for an absent one."""
    return np.array(
        [(1, int(DataType.F64)) if d is None else (d.strides[0], int(d.dtype)) for d in descs],
        dtype=np.int64,
    )


class _HostKernel:
    """What the three passes share: the walk, the overlap rule, the thread count."""

    engine = "numpy"
    workspace_size = 0
    reserve_size = 0
    # Slots of ``data`` (the layout's tensors) that are outputs, and those that are inputs.
    outputs: tuple[int, ...]
    inputs: tuple[int, ...]

    def __init__(self, data: list[TensorDesc | None], channel: list[TensorDesc | None]) -> None:
        self.data = data
        self.layout = Layout.of(data)
        self.spans = np.array(self.layout.spans, dtype=np.int64)
        self.channel_args = _channel_args(channel)
        self.like = _LIKE[data[0].dtype]
        itemsize = FLOAT_TYPES[data[0].dtype].itemsize
        self.nbytes = [span * itemsize for span in self.layout.spans]
        self.parallel = self.layout.count * self.layout.channels >= PARALLEL_MIN_VALUES
        # Output slots whose layout equals an input's: the same address is safe for those.
        self.same_layout = {
            (o, i)
            for o in self.outputs
            for i in self.inputs
            if data[o] is not None and data[i] is not None and data[o].strides == data[i].strides
        }

    def chunks(self) -> int:
        return thread_count() if self.parallel else 1

    def overlapping(self, addresses: list[int]) -> list[int]:
        """Output slots that overlap an input other than element for element."""
        found = []
        for o in self.outputs:
            start, end = addresses[o], addresses[o] + self.nbytes[o]
            if not start:
                continue
            for i in self.inputs:
                other = addresses[i]
                if (other and other < end and start < other + self.nbytes[i]) and not (
                    other == start and (o, i) in self.same_layout
                ):
                    found.append(o)
                    break
        return found

    def run_with_scratch(self, addresses: list[int], launch) -> None:
        """``launch(addresses)``, outputs that overlap an input written through scratch."""
        clashes = self.overlapping(addresses)
        if not clashes:
            launch(addresses)
            return
        storage = FLOAT_TYPES[self.data[0].dtype].storage
        scratch = {o: np.empty(self.layout.spans[o], dtype=storage) for o in clashes}
        launch([scratch[s].ctypes.data if s in scratch else a for s, a in enumerate(addresses)])
        for o, buffer in scratch.items():
            desc = self.data[o]
            host_array(addresses[o], desc)[...] = host_array(buffer.ctypes.data, desc)


class BatchNormBackward(_HostKernel):
    """Batch-norm backward (all modes, fused or not, any output mask).

    Data slots: input, grad_output, output (fused), grad_input, grad_z."""

    outputs, inputs = (3, 4), (0, 1, 2)

    def __init__(
        self, tensors: BackwardTensors, attributes: BackwardAttributes, device_id: int = 0
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        a, t = attributes, tensors
        fused = a.fusion != Fusion.BN
        with_z = a.fusion == Fusion.BN_ADD_RELU
        data = [t.input, t.grad_output, t.output if fused else None]
        data += [t.grad_input if a.output_mask[0] else None, t.grad_z if with_z else None]
        reads_stats = a.mode.reads_statistics
        channel = [t.weight, t.running_mean if reads_stats else None]
        channel += [t.running_var if reads_stats else None, t.grad_weight, t.grad_bias]
        super().__init__(data, channel)
        self.flags = (*a.output_mask, fused, with_z)
        self.mode, self.eps = int(a.mode), float(a.eps)

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        """Compute the wanted gradients; ``workspace``/``stream`` are unused."""
        p = ptrs
        addresses = [p.input, p.grad_output, p.output, p.grad_input, p.grad_z]
        addresses = [a if d is not None else 0 for a, d in zip(addresses, self.data, strict=True)]
        self.run_with_scratch(
            addresses,
            lambda at: cpu_kernels.backward(
                *at,
                p.weight,
                p.running_mean,
                p.running_var,
                p.grad_weight,
                p.grad_bias,
                self.like,
                self.layout.geometry,
                self.layout.strides,
                self.spans,
                self.channel_args,
                self.mode,
                self.eps,
                self.flags,
                self.chunks(),
            ),
        )


class BatchNormForwardTraining(_HostKernel):
    """Training-mode forward: batch statistics, output, saved statistics, running update.

    Data slots: input, z (fused add), output."""

    outputs, inputs = (2,), (0, 1)

    def __init__(
        self,
        tensors: ForwardTrainingTensors,
        attributes: ForwardTrainingAttributes,
        device_id: int = 0,
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        t, a = tensors, attributes
        with_z = a.fusion == Fusion.BN_ADD_RELU
        super().__init__(
            [t.input, t.z if with_z else None, t.output],
            [t.weight, t.bias, t.saved_mean, t.saved_invstd, t.running_mean, t.running_var],
        )
        flags = (with_z, a.fusion != Fusion.BN)
        self.flags = (*flags, t.running_mean is not None, t.running_var is not None)
        self.eps, self.momentum = float(a.eps), float(a.momentum)

    def run(self, ptrs: ForwardTrainingPointers, workspace: int, stream: int) -> None:
        p = ptrs
        addresses = [p.input, p.z if self.data[1] is not None else 0, p.output]
        self.run_with_scratch(
            addresses,
            lambda at: cpu_kernels.forward_training(
                *at,
                p.weight,
                p.bias,
                p.saved_mean,
                p.saved_invstd,
                p.running_mean,
                p.running_var,
                self.like,
                self.layout.geometry,
                self.layout.strides,
                self.spans,
                self.channel_args,
                self.eps,
                self.momentum,
                self.flags,
                self.chunks(),
            ),
        )


class BatchNormForwardInference(_HostKernel):
    """Inference-mode forward with fixed statistics. Data slots: input, (none), output."""

    outputs, inputs = (2,), (0,)

    def __init__(
        self,
        tensors: ForwardInferenceTensors,
        attributes: ForwardInferenceAttributes,
        device_id: int = 0,
    ) -> None:
        self.tensors, self.attributes = tensors, attributes
        t = tensors
        super().__init__(
            [t.input, None, t.output], [t.weight, t.bias, t.running_mean, t.running_var]
        )
        self.eps = float(attributes.eps)

    def run(self, ptrs: ForwardInferencePointers, workspace: int, stream: int) -> None:
        p = ptrs
        self.run_with_scratch(
            [p.input, 0, p.output],
            lambda at: cpu_kernels.forward_inference(
                at[0],
                at[2],
                p.weight,
                p.bias,
                p.running_mean,
                p.running_var,
                self.like,
                self.layout.geometry,
                self.layout.strides,
                self.spans,
                self.channel_args,
                self.eps,
                self.chunks(),
            ),
        )
