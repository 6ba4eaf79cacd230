"""CuPy 13's ``cupyx.cudnn`` batch-normalization functions, on ``cudnn_bn``.

CuPy 14 removed ``cupyx.cudnn``. Code written for CuPy 13 runs unchanged after one import::

    from cudnn_bn import cupyx_compat as cudnn   # was: from cupyx import cudnn

The four functions keep CuPy 13's signatures, argument meanings and return conventions:
``batch_normalization_forward_training`` (and ``_ex``), ``batch_normalization_forward_inference``
and ``batch_normalization_backward``. They also take NumPy arrays (the CPU backend).

What CuPy 13 meant by its arguments, and how it maps onto ``cudnn_bn``'s ``(N, C, ...)``:

- ``is_for_conv2d=False``: ``x`` is seen as ``(x.size // C, C)`` with ``C = x.shape[-1]``
  (the last axis is the channel).
- ``is_for_conv2d=True``: ``x`` is ``(N, C, H, W)`` for ``d_layout=CUDNN_TENSOR_NCHW`` or
  ``(N, H, W, C)`` for ``CUDNN_TENSOR_NHWC`` (4-D only; handed over as a channels-last view,
  no copy), or ``(N, C, D, H, W)``.
- ``cudnn_mode``: ``CUDNN_BATCHNORM_SPATIAL`` normalizes per channel;
  ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` too, with cuDNN's persistent kernels
  (``persistent=True``); ``CUDNN_BATCHNORM_PER_ACTIVATION`` per element over N only, so a
  convolution input becomes ``(N, C*H*W)`` and ``gamma`` and the statistics have ``C*H*W``
  elements in cuDNN's ``(C, H, W)`` order, whatever ``d_layout``. Where x is seen as 2-D the
  three modes compute the same statistics, on the CuPy engine (as PyTorch, no 2-D input is
  sent to cuDNN).
- Per-channel arrays may have any shape with the right number of elements (``(C,)``,
  ``(1, C, 1, 1)``, ...). They are used as cuDNN's parameter dtype (float32, or float64 for
  float64 ``x``), as CuPy 13 did; running statistics are written back in place in their own
  dtype and shape; saved statistics come back in ``gamma``'s shape and that parameter dtype;
  ``ggamma``/``gbeta`` in ``gamma``'s shape and dtype.
- ``decay`` is Chainer's: the running update uses ``momentum = 1 - decay``.
- ``debug=True`` with ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` does what CuPy 13 did: after a
  cuDNN pass, wait for it (``cudnnQueryRuntimeError``, blocking) and warn if cuDNN reports
  a numerical overflow (``check_overflow=True`` of the array API).

Differences from CuPy 13:

- The reserve space of ``batch_normalization_forward_training_ex`` is ``cudnn_bn``'s
  ``TrainingOutputs.reserve``: a ``uint8`` array of ``x``'s kind, or None when cuDNN needs
  none, not a ``cupy.cuda.MemoryPointer``. Pass it on unchanged as the backward's
  ``reserve_space=``.
- Failures raise ``cudnn_bn.InfiniError`` (with the status and the offending argument)
  instead of ``cupy.cuda.cudnn.CuDNNError``.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ._cudnn.enums import BatchNormMode
from .api import (
    batch_norm_backward,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from .arrays import buffer_address

# cudnnTensorFormat_t
CUDNN_TENSOR_NCHW = 0
CUDNN_TENSOR_NHWC = 1
# cudnnBatchNormMode_t
CUDNN_BATCHNORM_PER_ACTIVATION = int(BatchNormMode.PER_ACTIVATION)
CUDNN_BATCHNORM_SPATIAL = int(BatchNormMode.SPATIAL)
CUDNN_BATCHNORM_SPATIAL_PERSISTENT = int(BatchNormMode.SPATIAL_PERSISTENT)


class _Problem(NamedTuple):
    """One CuPy 13 batch-norm problem as ``cudnn_bn`` sees it.

    ``data`` maps an array shaped like ``x`` to cudnn_bn's ``(N, C, ...)`` view and
    ``undo_data`` maps a result back to ``x``'s shape and layout; ``param`` flattens a
    per-channel array into cuDNN's order and parameter dtype, ``undo_param(flat, shape)``
    puts a result back in ``shape``.
    """

    data: Callable[[Any], Any]
    undo_data: Callable[[Any], Any]
    param: Callable[[Any], Any]
    undo_param: Callable[[Any, tuple[int, ...]], Any]
    persistent: bool | None


def _problem(x: Any, is_for_conv2d: bool, cudnn_mode: int, d_layout: int) -> _Problem:
    """Map CuPy 13's ``(x, is_for_conv2d, cudnn_mode, d_layout)`` onto cudnn_bn's view."""
    if cudnn_mode not in BatchNormMode._value2member_map_:
        raise ValueError(f"unknown cudnn_mode {cudnn_mode!r}; expected 0, 1 or 2")
    if d_layout not in (CUDNN_TENSOR_NCHW, CUDNN_TENSOR_NHWC):
        raise ValueError(f"unsupported d_layout {d_layout!r}; expected NCHW (0) or NHWC (1)")
    shape = tuple(x.shape)
    nhwc = is_for_conv2d and d_layout == CUDNN_TENSOR_NHWC
    if nhwc and len(shape) != 4:
        raise ValueError(f"d_layout=CUDNN_TENSOR_NHWC needs a 4-D x (N, H, W, C), got {shape}")
    # cuDNN's parameter dtype: float64 for float64 input, float32 otherwise.
    dtype = np.dtype(np.float64 if np.dtype(x.dtype) == np.float64 else np.float32)

    def to_shape(a: Any) -> Any:
        return a.reshape(shape)

    def param(p: Any) -> Any:
        return p.reshape(-1).astype(dtype, copy=False)

    def undo_param(p: Any, to: tuple[int, ...]) -> Any:
        return p.reshape(to)

    if not is_for_conv2d:
        channels = shape[-1] if shape else 1
        return _Problem(lambda a: a.reshape(-1, channels), to_shape, param, undo_param, None)
    if cudnn_mode != CUDNN_BATCHNORM_PER_ACTIVATION:
        persistent = cudnn_mode == CUDNN_BATCHNORM_SPATIAL_PERSISTENT
        if nhwc:  # (N, H, W, C) as an (N, C, H, W) view with channels-last strides
            return _Problem(
                lambda a: a.transpose(0, 3, 1, 2),
                lambda a: a.transpose(0, 2, 3, 1),
                param,
                undo_param,
                persistent,
            )
        return _Problem(lambda a: a, lambda a: a, param, undo_param, persistent)

    def flat(a: Any) -> Any:
        return a.reshape(shape[0], -1)

    if not nhwc:
        return _Problem(flat, to_shape, param, undo_param, None)
    # Per activation on (N, H, W, C): x's elements are in (H, W, C) order, cuDNN's parameters
    # (its derived 1xCxHxW descriptor) in (C, H, W) order.
    _, h, w, c = shape
    return _Problem(
        flat,
        to_shape,
        lambda p: param(p.reshape(c, h, w).transpose(1, 2, 0)),
        lambda p, to: p.reshape(h, w, c).transpose(2, 0, 1).reshape(to),
        None,
    )


def _overflow_check(debug: bool, cudnn_mode: int) -> bool:
    """CuPy 13's condition for its overflow check: ``debug`` on a SPATIAL_PERSISTENT pass."""
    return bool(debug) and cudnn_mode == CUDNN_BATCHNORM_SPATIAL_PERSISTENT


def _write(target: Any, flat: Any, problem: _Problem) -> None:
    """Store ``flat`` (cuDNN's order) into ``target`` unless it already is its memory."""
    if buffer_address("target", target) != buffer_address("flat", flat):
        target[...] = problem.undo_param(flat, tuple(target.shape))


def _forward_training(
    x: Any,
    gamma: Any,
    beta: Any,
    running_mean: Any,
    running_var: Any,
    mean: Any,
    inv_std: Any,
    eps: float,
    decay: float,
    is_for_conv2d: bool,
    cudnn_mode: int,
    d_layout: int,
    debug: bool,
) -> tuple[Any, Any, Any, Any]:
    """``(reserve, y, save_mean, save_inv_std)``; the saved ones are ``mean``/``inv_std``
    when those are given (and filled)."""
    if (mean is None) != (inv_std is None):
        raise ValueError("Both mean and inv_std must be None if one is.")
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    running = [None if r is None else problem.param(r) for r in (running_mean, running_var)]
    outputs = batch_norm_forward_training(
        problem.data(x),
        problem.param(gamma),
        problem.param(beta),
        *running,
        momentum=1.0 - decay,
        eps=eps,
        persistent=problem.persistent,
        check_overflow=_overflow_check(debug, cudnn_mode),
    )
    for target, flat in zip((running_mean, running_var), running, strict=True):
        if target is not None:
            _write(target, flat, problem)
    y, save_mean, save_inv_std = outputs
    shape = tuple(gamma.shape)
    save_mean, save_inv_std = (problem.undo_param(s, shape) for s in (save_mean, save_inv_std))
    if mean is not None:
        mean[...] = save_mean
        inv_std[...] = save_inv_std
        save_mean, save_inv_std = mean, inv_std
    return outputs.reserve, problem.undo_data(y), save_mean, save_inv_std


def batch_normalization_forward_training(
    x: Any,
    gamma: Any,
    beta: Any,
    running_mean: Any,
    running_var: Any,
    mean: Any,
    inv_std: Any,
    eps: float,
    decay: float,
    is_for_conv2d: bool,
    cudnn_mode: int,
    debug: bool,
    d_layout: int = CUDNN_TENSOR_NCHW,
) -> Any:
    """Training-mode batch norm: ``y`` when ``mean``/``inv_std`` are given (and filled with
    the batch mean and ``1/sqrt(var + eps)``), else ``(y, save_mean, save_inv_std)``.
    ``running_mean``/``running_var`` are updated in place with factor ``1 - decay``;
    ``debug`` checks for an overflow (see the module's docstring)."""
    _, y, save_mean, save_inv_std = _forward_training(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, d_layout, debug,
    )  # fmt: skip
    return y if mean is not None else (y, save_mean, save_inv_std)


def batch_normalization_forward_training_ex(
    x: Any,
    gamma: Any,
    beta: Any,
    running_mean: Any,
    running_var: Any,
    mean: Any,
    inv_std: Any,
    eps: float,
    decay: float,
    is_for_conv2d: bool,
    cudnn_mode: int,
    debug: bool,
    d_layout: int = CUDNN_TENSOR_NCHW,
) -> tuple[Any, ...]:
    """As ``batch_normalization_forward_training``, with the reserve space first:
    ``(reserve_space, y)`` or ``(reserve_space, y, save_mean, save_inv_std)``."""
    reserve, y, save_mean, save_inv_std = _forward_training(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, d_layout, debug,
    )  # fmt: skip
    return (reserve, y) if mean is not None else (reserve, y, save_mean, save_inv_std)


def batch_normalization_forward_inference(
    x: Any,
    gamma: Any,
    beta: Any,
    mean: Any,
    var: Any,
    eps: float,
    is_for_conv2d: bool,
    cudnn_mode: int,
    d_layout: int = CUDNN_TENSOR_NCHW,
) -> Any:
    """Inference-mode batch norm with the fixed statistics ``mean``/``var``: ``y``."""
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    y = batch_norm_forward_inference(
        problem.data(x), *(problem.param(p) for p in (gamma, beta, mean, var)), eps=eps
    )
    return problem.undo_data(y)


def batch_normalization_backward(
    x: Any,
    gamma: Any,
    gy: Any,
    mean: Any,
    inv_std: Any,
    eps: float,
    is_for_conv2d: bool,
    cudnn_mode: int,
    debug: bool,
    d_layout: int = CUDNN_TENSOR_NCHW,
    *,
    reserve_space: Any = None,
) -> tuple[Any, Any, Any]:
    """``(gx, ggamma, gbeta)`` of training-mode batch norm from the ``mean``/``inv_std`` its
    forward saved; ``reserve_space`` is what ``_ex`` returned (None, or its array)."""
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    gx, ggamma, gbeta = batch_norm_backward(
        problem.data(x),
        problem.data(gy),
        problem.param(gamma),
        None,
        None,
        eps=eps,
        mode="saved",
        saved_mean=problem.param(mean),
        saved_invstd=problem.param(inv_std),
        reserve=reserve_space,
        persistent=problem.persistent,
        check_overflow=_overflow_check(debug, cudnn_mode),
    )
    shape = tuple(gamma.shape)
    ggamma, gbeta = (
        problem.undo_param(g, shape).astype(gamma.dtype, copy=False) for g in (ggamma, gbeta)
    )
    return problem.undo_data(gx), ggamma, gbeta


__all__ = [
    "CUDNN_BATCHNORM_PER_ACTIVATION",
    "CUDNN_BATCHNORM_SPATIAL",
    "CUDNN_BATCHNORM_SPATIAL_PERSISTENT",
    "CUDNN_TENSOR_NCHW",
    "CUDNN_TENSOR_NHWC",
    "batch_normalization_backward",
    "batch_normalization_forward_inference",
    "batch_normalization_forward_training",
    "batch_normalization_forward_training_ex",
]
