"""The NumPy backend: every batch-norm pass on host pointers, the reference for every engine.

Each kernel reads its operands into float64 honouring their strides, computes there, and
rounds every result before writing any, so a failure leaves no output half-written and an
output may alias an input. Fused passes (``Fusion``) apply the same maths as cuDNN:
``y = relu(bn(x) [+ z])`` forward, and backward through the ReLU mask ``output > 0``.
"""

from typing import Any, NamedTuple

import numpy as np

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
    Mode,
)
from .host import from_f64, host_array, to_f64


class _HostKernel:
    """Loads operands as float64 (per-channel ones shaped to broadcast) and stores results."""

    engine = "numpy"
    workspace_size = 0
    reserve_size = 0

    def __init__(self, tensors: NamedTuple, attributes: Any, device_id: int = 0) -> None:
        self.tensors, self.attributes = tensors, attributes
        x = tensors.input
        self.axes = (0, *range(2, x.ndim))  # every axis but the channel axis
        self.channel_shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        self.count = x.numel // x.shape[1]  # values per channel

    def load(self, ptrs: NamedTuple, name: str) -> np.ndarray:
        desc = getattr(self.tensors, name)
        values = to_f64(host_array(getattr(ptrs, name), desc, readonly=True), desc.dtype)
        return values if desc.ndim > 1 else values.reshape(self.channel_shape)

    def store(self, ptrs: NamedTuple, results: dict[str, np.ndarray]) -> None:
        """Round every result to its tensor's dtype, then write them all."""
        rounded = {}
        for name, values in results.items():
            desc = getattr(self.tensors, name)
            rounded[name] = from_f64(values.reshape(desc.shape), desc.dtype)
        for name, values in rounded.items():
            host_array(getattr(ptrs, name), getattr(self.tensors, name))[...] = values

    def batch_statistics(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and biased variance."""
        return x.mean(axis=self.axes, keepdims=True), x.var(axis=self.axes, keepdims=True)


class BatchNormBackward(_HostKernel):
    """Batch-norm backward (all modes, fused or not, any output mask)."""

    tensors: BackwardTensors
    attributes: BackwardAttributes

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        """Compute the wanted gradients; ``workspace``/``stream`` are unused."""
        a = self.attributes
        x, dy, w = (self.load(ptrs, name) for name in ("input", "grad_output", "weight"))
        with np.errstate(all="ignore"):  # eps 0 on a constant channel: inf/nan, as the formula
            if a.fusion != Fusion.BN:
                dy = np.where(self.load(ptrs, "output") > 0, dy, 0.0)
            if a.mode is Mode.TRAIN:
                mean, var = self.batch_statistics(x)
            else:
                mean, var = self.load(ptrs, "running_mean"), self.load(ptrs, "running_var")
            invstd = var if a.mode is Mode.SAVED_INVSTD else 1.0 / np.sqrt(var + a.eps)
            xhat = (x - mean) * invstd
            grad_bias = dy.sum(axis=self.axes, keepdims=True)
            grad_weight = (dy * xhat).sum(axis=self.axes, keepdims=True)
            if a.mode is Mode.EVAL:
                grad_input = dy * (w * invstd)
            else:
                grad_input = (w * invstd) * (
                    dy - grad_bias / self.count - xhat * (grad_weight / self.count)
                )
        gradients = {"grad_input": grad_input, "grad_weight": grad_weight, "grad_bias": grad_bias}
        results = {
            name: value
            for (name, value), wanted in zip(gradients.items(), a.output_mask, strict=True)
            if wanted
        }
        if a.fusion == Fusion.BN_ADD_RELU:
            results["grad_z"] = dy
        self.store(ptrs, results)


class BatchNormForwardTraining(_HostKernel):
    """Training-mode forward: batch statistics, output, saved statistics, running update."""

    tensors: ForwardTrainingTensors
    attributes: ForwardTrainingAttributes

    def run(self, ptrs: ForwardTrainingPointers, workspace: int, stream: int) -> None:
        a, t = self.attributes, self.tensors
        x, w, b = (self.load(ptrs, name) for name in ("input", "weight", "bias"))
        with np.errstate(all="ignore"):
            mean, var = self.batch_statistics(x)
            invstd = 1.0 / np.sqrt(var + a.eps)
            y = (x - mean) * (invstd * w) + b
            if a.fusion == Fusion.BN_ADD_RELU:
                y = y + self.load(ptrs, "z")
            if a.fusion != Fusion.BN:
                y = np.maximum(y, 0.0)
            results = {"output": y, "saved_mean": mean, "saved_invstd": invstd}
            batch = {"running_mean": mean, "running_var": var * (self.count / (self.count - 1))}
            for name, value in batch.items():
                if getattr(t, name) is not None:
                    results[name] = (1.0 - a.momentum) * self.load(ptrs, name) + a.momentum * value
        self.store(ptrs, results)


class BatchNormForwardInference(_HostKernel):
    """Inference-mode forward with fixed statistics."""

    tensors: ForwardInferenceTensors
    attributes: ForwardInferenceAttributes

    def run(self, ptrs: ForwardInferencePointers, workspace: int, stream: int) -> None:
        x, w, b, mean, var = (
            self.load(ptrs, n) for n in ("input", "weight", "bias", "running_mean", "running_var")
        )
        with np.errstate(all="ignore"):
            y = (x - mean) * (w / np.sqrt(var + self.attributes.eps)) + b
        self.store(ptrs, {"output": y})
