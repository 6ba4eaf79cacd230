"""The CPU backend: every batch-norm pass on host pointers, two walks over the data.

Each kernel object is built once per descriptor: it works out how to walk its tensors
(``cpu_layout.Layout``), the per-channel operands' strides and dtypes, and whether a call is
large enough for threads; a call then only hands the pointers to the compiled pass
(``cpu_kernels``): per-channel sums in one read of the data, then the results in one more
read and one write. A small call is one kernel call in the calling thread; a large one runs
the same steps with its work items on the engine's threads (``cpu_pool``). Fused passes
(``Fusion``) apply the same maths as cuDNN: ``y = relu(bn(x) [+ z])`` forward, and backward
through the ReLU mask ``output > 0``.

Aliasing: an output may be the very tensor of an input (same address and strides, e.g.
``grad_input`` over ``grad_output``): each element is read before it is written. An output
that overlaps an input any other way is computed into a scratch buffer and copied at the
end, so the result is what it would be without the overlap.
"""

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
from . import cpu_kernels, cpu_pool
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
PARALLEL_MIN_VALUES = 1 << 16  # below this many values a thread hand-off costs more than it saves


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
        (self.whole,) = self.layout.items(1)
        self.tile = int(self.layout.geometry[cpu_kernels.TILE])
        # The item kernels of this layout's walk (the other is never compiled for it).
        walk = "across" if self.layout.geometry[3] else "along"
        self.item_sums, self.item_forward, self.item_backward = (
            getattr(cpu_kernels, f"item_{step}_{walk}") for step in ("sums", "forward", "backward")
        )
        # Output slots whose layout equals an input's: the same address is safe for those.
        self.same_layout = {
            (o, i)
            for o in self.outputs
            for i in self.inputs
            if data[o] is not None and data[i] is not None and data[o].strides == data[i].strides
        }

    def chunks(self) -> int:
        return cpu_pool.thread_count() if self.parallel else 1

    def views(self, addresses: list[int]) -> list[np.ndarray]:
        """Flat arrays over the data slots (what the item kernels take)."""
        spans = self.layout.spans
        return [cpu_kernels.flat(a, n, self.like) for a, n in zip(addresses, spans, strict=True)]

    def tiled(self, *values: np.ndarray) -> list[np.ndarray]:
        """Per-channel arrays as the walk sees them (``cpu_kernels.tiled``)."""
        return [cpu_kernels.tiled(v, self.tile) for v in values]

    def sums(self, x, dy, y, shift, items: list) -> np.ndarray:
        """The walk's ``item_sums`` of every work item on the engine's threads, added in
        item order (the same sums for the same thread count), per channel."""
        geometry, strides = self.layout.geometry, self.layout.strides
        channels = self.layout.channels
        partial = np.zeros((len(items), cpu_kernels.SUMS, channels * self.tile + cpu_kernels.PAD))
        (shift,) = self.tiled(shift)
        cpu_pool.run(
            lambda i: self.item_sums(x, dy, y, geometry, strides, shift, partial[i], items[i]),
            len(items),
        )
        return cpu_kernels.folded(partial.sum(axis=0), channels)

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
        channel = (p.weight, p.running_mean, p.running_var, p.grad_weight, p.grad_bias)
        self.run_with_scratch(addresses, lambda at: self.launch(at, channel))

    def launch(self, at: list[int], channel: tuple[int, ...]) -> None:
        k, layout, chunks = cpu_kernels, self.layout, self.chunks()
        geometry, strides, args = layout.geometry, layout.strides, self.channel_args
        if chunks == 1:
            k.backward(*at, *channel, self.like, geometry, strides, self.spans, args,
                       self.mode, self.eps, self.flags, self.whole)  # fmt: skip
            return
        write_gi, write_gw, write_gb, masked, write_gz = self.flags
        x, dy, y, gi, gz = self.views(at)
        w, shift, stat = k.backward_inputs(x, geometry, strides, *channel[:3], args, self.mode)
        items = layout.items(chunks)
        sums = self.sums(x, dy, y, shift, items)
        k_dy, k_x, k_c, gw, gb = k.backward_coefficients(
            sums, shift, stat, w, layout.count, self.mode, self.eps
        )
        if write_gi or write_gz:
            apply = (self.mode != cpu_kernels.EVAL, masked, write_gi, write_gz)
            coefficients = self.tiled(k_dy, k_x, k_c)
            cpu_pool.run(
                lambda i: self.item_backward(
                    x, dy, y, gi, gz, geometry, strides, *coefficients, apply, items[i]
                ),
                len(items),
            )
        k.backward_outputs(gw, gb, *channel[3:], args, write_gw, write_gb)


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
        self.run_with_scratch(addresses, lambda at: self.launch(at, p))

    def launch(self, at: list[int], p: ForwardTrainingPointers) -> None:
        k, layout, chunks = cpu_kernels, self.layout, self.chunks()
        geometry, strides, args = layout.geometry, layout.strides, self.channel_args
        outputs = (p.saved_mean, p.saved_invstd, p.running_mean, p.running_var)
        if chunks == 1:
            k.forward_training(*at, p.weight, p.bias, *outputs, self.like, geometry, strides,
                               self.spans, args, self.eps, self.momentum, self.flags,
                               self.whole)  # fmt: skip
            return
        add_z, relu, *updates = self.flags
        updates = tuple(updates)
        x, z, y = self.views(at)
        w, b, old_mean, old_var, shift = k.training_inputs(
            x, geometry, strides, p.weight, p.bias, p.running_mean, p.running_var, args, updates
        )
        items = layout.items(chunks)
        sums = self.sums(x, x[:0], x[:0], shift, items)
        stats = k.training_statistics(sums, shift, layout.count, self.eps)
        coefficients = self.tiled(stats[0], w * stats[2], b)
        cpu_pool.run(
            lambda i: self.item_forward(
                x, z, y, geometry, strides, *coefficients, (add_z, relu), items[i]
            ),
            len(items),
        )
        k.training_outputs(
            stats, (old_mean, old_var), outputs, args, layout.count, self.momentum, updates
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
        self.plain = (False, False)  # the forward's flags: no z, no ReLU

    def run(self, ptrs: ForwardInferencePointers, workspace: int, stream: int) -> None:
        p = ptrs
        channel = (p.weight, p.bias, p.running_mean, p.running_var)
        self.run_with_scratch([p.input, 0, p.output], lambda at: self.launch(at, channel))

    def launch(self, at: list[int], channel: tuple[int, ...]) -> None:
        k, layout, chunks = cpu_kernels, self.layout, self.chunks()
        geometry, strides, args = layout.geometry, layout.strides, self.channel_args
        if chunks == 1:
            k.forward_inference(at[0], at[2], *channel, self.like, geometry, strides,
                                self.spans, args, self.eps, self.plain, self.whole)  # fmt: skip
            return
        x, _, y = self.views(at)
        coefficients = self.tiled(
            *k.inference_coefficients(*channel, args, layout.channels, self.eps)
        )
        items = layout.items(chunks)
        cpu_pool.run(
            lambda i: self.item_forward(
                x, x, y, geometry, strides, *coefficients, self.plain, items[i]
            ),
            len(items),
        )
