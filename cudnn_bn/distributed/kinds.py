"""The array kinds synchronized batch norm takes, NumPy, CuPy and torch, and what differs per kind.

The batch-norm passes themselves run through ``cudnn_bn``'s operators whatever the kind (the
CPU engine for host arrays, cuDNN or the CuPy kernels on a GPU); what is kind-specific is
here: moving per-channel values to and from host float64, new arrays, writing the running
statistics in place, and the elementwise ``grad_input`` pass with the global sums (NumPy and
torch through array operators, CuPy through one ``ElementwiseKernel``).
"""

import functools
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from ..api import resolve_stream
from ..arrays import operand
from ..enums import Status
from ..errors import InfiniError


def grad_input_terms(x: Any, dy: Any, mean: Any, k: Any, a: Any, scale: Any) -> Any:
    """``scale * (dy - a - (x - mean) * k)``: with ``scale = w*invstd``, ``a = sum(dy)/N`` and
    ``k = invstd * sum(dy*xhat)/N`` it is batch norm's training ``grad_input`` (the formula of
    ``cudnn_bn/backends/cpu.py``), for any arrays that broadcast per channel."""
    return scale * (dy - a - (x - mean) * k)


class NumpyKind:
    """NumPy arrays (bfloat16 through ml_dtypes): host memory, float64 arithmetic."""

    def scope(self, stream: Any, like: Any) -> AbstractContextManager:
        return nullcontext()

    def host(self, array: Any) -> np.ndarray:
        return np.array(array, dtype=np.float64)

    def like(self, values: np.ndarray, like: Any) -> Any:
        with np.errstate(over="ignore"):  # out of range rounds to inf, as a cast does
            return np.asarray(values).astype(like.dtype)

    def float32(self, array: Any) -> Any:
        return array.astype(np.float32)

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        return np.zeros(shape, like.dtype)

    def empty(self, like: Any) -> Any:
        return np.empty_like(like)

    def copy(self, array: Any) -> Any:
        return array.copy()

    def writable(self, array: Any) -> bool:
        return bool(array.flags.writeable)

    def assign(self, target: Any, values: np.ndarray) -> None:
        target[...] = self.like(values, target)

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        terms = (c.reshape(shape) for c in channel)
        with np.errstate(all="ignore"):  # eps 0 on a constant channel: inf/nan, as the formula
            dx = grad_input_terms(x.astype(np.float64), dy.astype(np.float64), *terms)
            return dx.astype(x.dtype)


class TorchKind:
    """torch tensors on the CPU or a CUDA device: float64 arithmetic on the CPU, float32
    (float64 for float64 tensors) on a GPU."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def scope(self, stream: Any, like: Any) -> AbstractContextManager:
        if stream is None or like.device.type != "cuda":
            return nullcontext()
        external = self.torch.cuda.ExternalStream(resolve_stream(stream, like))
        return self.torch.cuda.stream(external)

    def host(self, array: Any) -> np.ndarray:
        return array.detach().to("cpu", self.torch.float64, copy=True).numpy()

    def like(self, values: np.ndarray, like: Any) -> Any:
        return self.torch.as_tensor(values).to(device=like.device, dtype=like.dtype)

    def float32(self, array: Any) -> Any:
        return array.float()

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        return self.torch.zeros(shape, dtype=like.dtype, device=like.device)

    def empty(self, like: Any) -> Any:
        return self.torch.empty_like(like)

    def copy(self, array: Any) -> Any:
        return array.detach().clone()

    def writable(self, array: Any) -> bool:
        return True

    def assign(self, target: Any, values: np.ndarray) -> None:
        with self.torch.no_grad():
            target.copy_(self.torch.as_tensor(values, dtype=target.dtype))

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        torch = self.torch
        on_host = x.device.type == "cpu"
        compute = torch.float64 if on_host or x.dtype == torch.float64 else torch.float32
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        terms = (
            torch.as_tensor(c).to(device=x.device, dtype=compute).reshape(shape) for c in channel
        )
        dx = grad_input_terms(x.detach().to(compute), dy.detach().to(compute), *terms)
        return dx.to(x.dtype)


@functools.cache
def cupy_grad_input_kernel() -> Any:
    """The elementwise ``grad_input`` pass as one CuPy kernel: ``T`` the data dtype, ``C`` the
    compute dtype of the per-channel terms (float32, float64 for float64 data)."""
    import cupy

    return cupy.ElementwiseKernel(
        "T x, T dy, C mean, C k, C a, C scale",
        "T dx",
        "dx = (T)(scale * ((C)dy - a - ((C)x - mean) * k))",
        "cudnn_bn_sync_bn_grad_input",
    )


class CupyKind:
    """CuPy arrays on a CUDA device; every call runs on the pass's stream."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def scope(self, stream: Any, like: Any) -> AbstractContextManager:
        from ..backends.cuda import stream_scope

        return stream_scope(resolve_stream(stream, like), like.device.id)

    def host(self, array: Any) -> np.ndarray:
        return self.cupy.asnumpy(array).astype(np.float64)

    def like(self, values: np.ndarray, like: Any) -> Any:
        with like.device:
            return self.cupy.asarray(values).astype(like.dtype)

    def float32(self, array: Any) -> Any:
        return array.astype(np.float32)

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        with like.device:
            return self.cupy.zeros(shape, like.dtype)

    def empty(self, like: Any) -> Any:
        return self.cupy.empty_like(like)

    def copy(self, array: Any) -> Any:
        return array.copy()

    def writable(self, array: Any) -> bool:
        return True

    def assign(self, target: Any, values: np.ndarray) -> None:
        target[...] = self.like(values, target)

    def grad_input(self, x: Any, dy: Any, channel: tuple[np.ndarray, ...]) -> Any:
        compute = np.float64 if x.dtype == np.float64 else np.float32
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        with x.device:
            terms = [self.cupy.asarray(c.astype(compute)).reshape(shape) for c in channel]
            dx = self.cupy.empty_like(x)
            cupy_grad_input_kernel()(x, dy, *terms, dx)
        return dx


@functools.cache
def _kind(name: str) -> Any:
    return {"numpy": NumpyKind, "torch": TorchKind, "cupy": CupyKind}[name]()


def kind_of(name: str, array: Any) -> Any:
    """The kind of ``array`` (argument ``name``): NumPy, CuPy or torch; else BAD_PARAM."""
    if isinstance(array, np.ndarray):
        return _kind("numpy")
    package = type(array).__module__.partition(".")[0]
    if package in ("torch", "cupy") and hasattr(array, "shape"):
        operand(name, array)  # dtype and device checks, with the argument's name
        return _kind(package)
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name} must be a NumPy or CuPy array or a torch tensor, got {type(array).__name__}",
    )
