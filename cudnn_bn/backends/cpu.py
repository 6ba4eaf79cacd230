"""The NumPy backend: batch-norm backward on host pointers, the reference for every engine.

Everything is read into float64, computed there, and rounded once into each output. The
modes differ only in where the per-channel mean and invstd come from and in whether the
mean-of-dy terms are subtracted (DESIGN.md, "Semantics of batch-norm backward").
"""

import numpy as np

from ..problems import BackwardPointers, BackwardTensors, Mode
from .host import from_f64, host_array, to_f64


class BatchNormBackward:
    """Batch-norm backward for one set of tensor descriptors (already validated)."""

    engine = "numpy"
    workspace_size = 0
    reserve_size = 0

    def __init__(
        self, tensors: BackwardTensors, mode: Mode, eps: float, device_id: int = 0
    ) -> None:
        self.tensors = tensors
        self.mode = Mode(mode)
        self.eps = float(eps)
        ndim = tensors.input.ndim
        self._axes = (0, *range(2, ndim))  # every axis but the channel axis
        self._channel_shape = (1, tensors.input.shape[1]) + (1,) * (ndim - 2)

    def _load(self, ptrs: BackwardPointers, name: str) -> np.ndarray:
        desc = getattr(self.tensors, name)
        values = to_f64(host_array(getattr(ptrs, name), desc, readonly=True), desc.dtype)
        return values if desc.ndim > 1 else values.reshape(self._channel_shape)

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        """Compute grad_input, grad_weight, grad_bias; ``workspace``/``stream`` are unused."""
        t, axes, mode = self.tensors, self._axes, self.mode
        x, dy, w = (self._load(ptrs, name) for name in ("input", "grad_output", "weight"))
        with np.errstate(all="ignore"):  # eps 0 on a constant channel: inf/nan, as the formula
            if mode is Mode.TRAIN:
                mean = x.mean(axis=axes, keepdims=True)
                var = x.var(axis=axes, keepdims=True)  # biased
            else:
                mean, var = self._load(ptrs, "running_mean"), self._load(ptrs, "running_var")
            invstd = var if mode is Mode.SAVED_INVSTD else 1.0 / np.sqrt(var + self.eps)
            xhat = (x - mean) * invstd
            grad_bias = dy.sum(axis=axes, keepdims=True)
            grad_weight = (dy * xhat).sum(axis=axes, keepdims=True)
            if mode is Mode.EVAL:
                grad_input = dy * (w * invstd)
            else:
                m = x.size // x.shape[1]
                grad_input = (w * invstd) * (dy - grad_bias / m - xhat * (grad_weight / m))
        # Round everything before writing anything, so a failure leaves no output half-written.
        results = [
            (name, from_f64(values.reshape(getattr(t, name).shape), getattr(t, name).dtype))
            for name, values in (
                ("grad_input", grad_input),
                ("grad_weight", grad_weight),
                ("grad_bias", grad_bias),
            )
        ]
        for name, values in results:
            host_array(getattr(ptrs, name), getattr(t, name))[...] = values
