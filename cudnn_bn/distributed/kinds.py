"""The array kinds synchronized batch norm takes, NumPy, CuPy and torch, and its arithmetic
per kind.

Every pass reads the caller's data in float64 and rounds once, to the caller's dtype: the
local statistics (mean and M2), the normalization with the global float64 statistics, the
backward's sums and its elementwise ``grad_input``. F32 data around 1000 with a spread of
0.01 thus normalizes to a few ulps; statistics rounded to F32 first would cost 3e-3.
NumPy and torch go through array operators, CuPy's elementwise passes through one
``ElementwiseKernel`` each. Per-channel values travel as host float64 arrays.
"""

import functools
import sys
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..arrays import operand
from ..enums import Status
from ..errors import InfiniError


def normalized(x: Any, mean: Any, scale: Any, shift: Any) -> Any:
    """``(x - mean) * scale + shift``: with ``scale = w*invstd`` and ``shift = b`` it is batch
    norm's output, for any arrays that broadcast per channel."""
    return (x - mean) * scale + shift


def grad_input_terms(x: Any, dy: Any, mean: Any, k: Any, a: Any, scale: Any) -> Any:
    """``scale * (dy - a - (x - mean) * k)``: with ``scale = w*invstd``, ``a = sum(dy)/N`` and
    ``k = invstd * sum(dy*xhat)/N`` it is batch norm's training ``grad_input`` (the formula of
    ``cudnn_bn/backends/cpu.py``), for any arrays that broadcast per channel."""
    return scale * (dy - a - (x - mean) * k)


def _axes(x: Any) -> tuple[int, ...]:
    """Every axis but the channel's."""
    return (0, *range(2, x.ndim))


def _per_channel(x: Any) -> tuple[int, ...]:
    """The shape a ``(C,)`` array broadcasts over ``x`` with."""
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def scope(like: Any, stream: int, device_id: int) -> AbstractContextManager:
    """Where a pass on ``like`` computes and allocates: its device current and ``stream`` its
    library's current stream, as the array API's allocation table (``arrays.kinds``) has it
    for ``like``'s kind (torch's stream object is built for the tensor's own device)."""
    return operand("input", like).kind.scope(like, stream, device_id)


class NumpyKind:
    """NumPy arrays (bfloat16 through ml_dtypes), and, through ``xp``, what CuPy shares."""

    xp: Any = np

    def host(self, array: Any) -> np.ndarray:
        return np.array(array, dtype=np.float64)

    def like(self, values: np.ndarray, like: Any, dtype: Any = None) -> Any:
        """``values`` as a new array of ``like``'s kind, device and dtype (or ``dtype``)."""
        with np.errstate(over="ignore"):  # out of range rounds to inf, as a cast does
            return np.asarray(values).astype(dtype or like.dtype)

    def statistics(self, values: np.ndarray, like: Any) -> Any:
        """Saved statistics for data ``like``: F32 for 16-bit data, else its dtype."""
        return self.like(values, like, np.float32 if like.dtype.itemsize == 2 else None)

    def assign(self, target: Any, values: np.ndarray) -> None:
        target[...] = self.like(values, target)

    def moments(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel mean and M2 (sum of squared deviations) of ``x``, in float64."""
        data = x.astype(np.float64)
        mean = data.mean(axis=_axes(x))
        centered = data - mean.reshape(_per_channel(x))
        return self.to_host(mean), self.to_host((centered * centered).sum(axis=_axes(x)))

    def sums(self, x: Any, dy: Any, mean: np.ndarray, invstd: np.ndarray) -> tuple[Any, Any]:
        """Per-channel ``sum(dy)`` and ``sum(dy * xhat)`` in float64."""
        xp, shape = self.xp, _per_channel(x)
        grad = dy.astype(np.float64)
        centered = x.astype(np.float64) - xp.asarray(mean).reshape(shape)
        with np.errstate(all="ignore"):  # eps 0 on a constant channel: inf/nan, as the formula
            dot = (grad * centered).sum(axis=_axes(x))
            return self.to_host(grad.sum(axis=_axes(x))), self.to_host(dot) * invstd

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float64)

    def normalize(self, x: Any, channel: tuple[np.ndarray, ...]) -> Any:
        terms = (c.reshape(_per_channel(x)) for c in channel)
        with np.errstate(all="ignore"):
            return normalized(x.astype(np.float64), *terms).astype(x.dtype)

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        terms = (c.reshape(_per_channel(x)) for c in channel)
        with np.errstate(all="ignore"):
            dx = grad_input_terms(x.astype(np.float64), dy.astype(np.float64), *terms)
            return dx.astype(x.dtype)


class TorchKind:
    """torch tensors on the CPU or a CUDA device."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def host(self, array: Any) -> np.ndarray:
        return array.detach().to("cpu", self.torch.float64, copy=True).numpy()

    def like(self, values: np.ndarray, like: Any, dtype: Any = None) -> Any:
        return self.torch.as_tensor(values).to(device=like.device, dtype=dtype or like.dtype)

    def statistics(self, values: np.ndarray, like: Any) -> Any:
        return self.like(values, like, self.torch.float32 if like.dtype.itemsize == 2 else None)

    def assign(self, target: Any, values: np.ndarray) -> None:
        """Write ``values`` into ``target`` whatever its inference state (a tensor made under
        ``inference_mode``), as the array API writes it: outside inference mode torch refuses
        an inference tensor's in-place update, and only once it has written it, after the
        collectives. One that requires grad with grad mode on was refused before them
        (``check_forward``); torch's ``copy_`` bumps the version counter."""
        with self.torch.inference_mode():
            target.copy_(self.torch.as_tensor(values, dtype=target.dtype))

    def _float64(self, array: Any) -> Any:
        return array.detach().to(self.torch.float64)

    def _channel(self, values: np.ndarray, x: Any) -> Any:
        tensor = self.torch.as_tensor(values, dtype=self.torch.float64)
        return tensor.to(x.device).reshape(_per_channel(x))

    def moments(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        data = self._float64(x)
        mean = data.mean(dim=_axes(x), keepdim=True)
        m2 = ((data - mean) ** 2).sum(dim=_axes(x))
        return self.host(mean.reshape(-1)), self.host(m2)

    def sums(self, x: Any, dy: Any, mean: np.ndarray, invstd: np.ndarray) -> tuple[Any, Any]:
        grad = self._float64(dy)
        dot = (grad * (self._float64(x) - self._channel(mean, x))).sum(dim=_axes(x))
        with np.errstate(all="ignore"):
            return self.host(grad.sum(dim=_axes(x))), self.host(dot) * invstd

    def normalize(self, x: Any, channel: tuple[np.ndarray, ...]) -> Any:
        terms = (self._channel(c, x) for c in channel)
        return normalized(self._float64(x), *terms).to(x.dtype)

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        terms = (self._channel(c, x) for c in channel)
        return grad_input_terms(self._float64(x), self._float64(dy), *terms).to(x.dtype)


@functools.cache
def cupy_normalize_kernel() -> Any:
    """The elementwise normalization as one CuPy kernel: float64 arithmetic, ``T`` the data
    dtype."""
    import cupy

    return cupy.ElementwiseKernel(
        "T x, float64 mean, float64 scale, float64 shift",
        "T y",
        "y = (T)(((double)x - mean) * scale + shift)",
        "cudnn_bn_sync_bn_normalize",
    )


@functools.cache
def cupy_grad_input_kernel() -> Any:
    """The elementwise ``grad_input`` pass as one CuPy kernel: float64 arithmetic, ``T`` the
    data dtype."""
    import cupy

    return cupy.ElementwiseKernel(
        "T x, T dy, float64 mean, float64 k, float64 a, float64 scale",
        "T dx",
        "dx = (T)(scale * ((double)dy - a - ((double)x - mean) * k))",
        "cudnn_bn_sync_bn_grad_input",
    )


class CupyKind(NumpyKind):
    """CuPy arrays on a CUDA device; every call runs inside the pass's ``scope``."""

    def __init__(self) -> None:
        import cupy

        self.xp = cupy

    def host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array).astype(np.float64)

    def to_host(self, array: Any) -> np.ndarray:
        return self.host(array)

    def like(self, values: np.ndarray, like: Any, dtype: Any = None) -> Any:
        with like.device:
            return self.xp.asarray(values).astype(dtype or like.dtype)

    def _run(self, kernel: Any, x: Any, arrays: tuple, channel: tuple[np.ndarray, ...]) -> Any:
        with x.device:
            terms = [self.xp.asarray(c).reshape(_per_channel(x)) for c in channel]
            out = self.xp.empty_like(x)
            kernel(*arrays, *terms, out)
        return out

    def normalize(self, x: Any, channel: tuple[np.ndarray, ...]) -> Any:
        return self._run(cupy_normalize_kernel(), x, (x,), channel)

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        return self._run(cupy_grad_input_kernel(), x, (x, dy), channel)


@functools.cache
def _kind(name: str) -> Any:
    return {"numpy": NumpyKind, "torch": TorchKind, "cupy": CupyKind}[name]()


def kind_of(name: str, array: Any) -> Any:
    """The kind of ``array`` (argument ``name``): NumPy, CuPy or torch; else BAD_PARAM.
    What the array holds is checked where every argument is (``arguments.py``)."""
    if isinstance(array, np.ndarray):
        return _kind("numpy")
    for package, type_name in (("torch", "Tensor"), ("cupy", "ndarray")):
        module = sys.modules.get(package)  # imported already, if array is one of its arrays
        if module is not None and isinstance(array, getattr(module, type_name, ())):
            return _kind(package)
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy or CuPy array or a torch tensor, got {type(array).__name__}",
    )
