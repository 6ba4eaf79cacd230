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
- Any strides are read, negative and broadcast ones too (copied where cudnn_bn cannot read
  them; CuPy 13 read every input C-contiguous).
- Per-channel arrays may have any shape with the right number of elements (``(C,)``,
  ``(1, C, 1, 1)``, ...). They are used as cuDNN's parameter dtype (float32, or float64 for
  float64 ``x``), as CuPy 13 did; running statistics are written back in place in their own
  dtype and shape; saved statistics come back in ``gamma``'s shape and that parameter dtype;
  ``ggamma``/``gbeta`` in ``gamma``'s shape and that parameter dtype, or x's dtype where
  gamma's is not the parameter dtype (CuPy 13 casts them back).
- An empty batch (N = 0, or any size of x but its channels 0) gives what torch gives: an
  empty ``y``/``gx``, zero ``ggamma``/``gbeta``, the running statistics unchanged, and
  ``mean``/``inv_std`` not written (torch's saved statistics are uninitialized there).
- ``decay`` is Chainer's: the running update uses ``momentum = 1 - decay``. ``eps`` and
  ``decay`` take what CuPy 13's ``double`` took (anything with ``__float__`` or
  ``__index__``: a 0-d array, True as 1.0).
- ``debug=True`` with ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` does what CuPy 13 did: after a
  cuDNN pass, wait for it (``cudnnQueryRuntimeError``, blocking) and warn if cuDNN reports
  a numerical overflow (``check_overflow=True`` of the array API).

Differences from CuPy 13:

- The reserve space of ``batch_normalization_forward_training_ex`` is ``cudnn_bn``'s
  ``TrainingOutputs.reserve``: a ``uint8`` array of ``x``'s kind, or None when cuDNN needs
  none, not a ``cupy.cuda.MemoryPointer``. Pass it on unchanged as the backward's
  ``reserve_space=``.
- Failures raise ``cudnn_bn.InfiniError`` (with the status and the offending argument,
  named as here: ``gamma``, ``decay``) instead of ``cupy.cuda.cudnn.CuDNNError``; the
  BAD_PARAM and shape ones are also ``ValueError``, as CuPy 13's argument errors were, and
  an argument of a type CuPy 13's signature refused (``gamma=[...]``, ``eps=None``) is a
  BAD_PARAM ``BadParamTypeError``, also a ``TypeError`` as there.
  Every argument is checked before anything is written: the arrays written in place
  (``running_mean``, ``running_var``, ``mean``, ``inv_std``) must be writable, on ``x``'s
  device, and share no memory with each other or with ``x``, ``gamma``, ``beta``.
"""

import ctypes
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import numpy as np

from ._cudnn.enums import BatchNormMode
from .api import (
    batch_norm_backward,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from .arrays import TORCH, Operand, check_written, common_place, operand, see
from .enums import Status
from .errors import (
    BadParamError,
    InfiniError,
    raised_by_caller,
    raises_only_infini_errors,
    shown,
)
from .ops.validation import check_fraction, check_output

# cudnnTensorFormat_t
CUDNN_TENSOR_NCHW = 0
CUDNN_TENSOR_NHWC = 1
# cudnnBatchNormMode_t
CUDNN_BATCHNORM_PER_ACTIVATION = int(BatchNormMode.PER_ACTIVATION)
CUDNN_BATCHNORM_SPATIAL = int(BatchNormMode.SPATIAL)
CUDNN_BATCHNORM_SPATIAL_PERSISTENT = int(BatchNormMode.SPATIAL_PERSISTENT)


class BadParamTypeError(BadParamError, TypeError):
    """BAD_PARAM for an argument of a type that CuPy 13's typed signature refused with
    ``TypeError`` (an array that is none, a ``double`` or ``int`` that is no number)."""


def _number(name: str, value: Any, kind: str) -> None:
    """Refuse ``value`` unless it is a real number (``kind`` says which the argument takes)."""
    if not isinstance(value, numbers.Real):
        raise BadParamTypeError(Status.BAD_PARAM, f"{name} must be {kind}, got {shown(value)}")


def _flag(name: str, value: Any) -> bool:
    """``value`` as CuPy 13's Cython ``bint`` took it: its truth. An object with none (a
    NumPy array of several elements) is a BAD_PARAM naming the flag; an exception of the
    caller's own ``__bool__`` passes through."""
    try:
        return bool(value)
    except (TypeError, ValueError) as exc:
        if raised_by_caller(exc):
            raise
        error = BadParamTypeError if isinstance(exc, TypeError) else BadParamError
        raise error(Status.BAD_PARAM, f"{name} has no truth value: {exc}") from None


def _double(name: str, value: Any) -> float:
    """``value`` as CuPy 13's Cython ``double`` argument took it: ``PyFloat_AsDouble``,
    which ``ctypes.c_double`` calls too (``__float__``, else ``__index__``: True is 1.0, a
    0-d array its value); what it refuses is refused here (TypeError, OverflowError)."""
    try:
        return ctypes.c_double(value).value
    except TypeError as exc:
        if raised_by_caller(exc):  # the caller's own __float__ or __index__
            raise
        raise BadParamTypeError(
            Status.BAD_PARAM, f"{name} must be a number, got {shown(value)}"
        ) from None
    except OverflowError:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} is {shown(value)}, outside the range of double"
        ) from None


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
    count: int  # elements of every per-channel array
    shape: tuple[int, ...]  # x's
    param_dtype: np.dtype  # cuDNN's parameter dtype: float64 for float64 x, else float32

    def input(self, a: Any) -> Any:
        """``data(a)`` of an input, copied C-contiguous first where it has a negative stride:
        CuPy 13 read its inputs C-contiguous, and cudnn_bn reads no array backwards."""
        return self.data(a.copy() if any(s < 0 for s in a.strides) else a)

    def result(self, a: Any) -> Any:
        """``undo_data(a)``, C-contiguous as CuPy 13 made its results (a copy only where x's
        memory order is not its shape's)."""
        out = self.undo_data(a)
        return out if out.flags.c_contiguous else out.copy()

    @property
    def empty(self) -> bool:
        """No values per channel (N = 0, or another size but C is 0)."""
        return math.prod(self.shape) == 0

    def check_counts(self, **arrays: Any) -> None:
        """Refuse a per-channel array (None is skipped) that has not ``count`` elements."""
        for name, array in arrays.items():
            if array is not None and math.prod(array.shape) != self.count:
                raise InfiniError(
                    Status.BAD_TENSOR_SHAPE,
                    f"{name} has shape {tuple(array.shape)}; expected {self.count} elements "
                    f"for x of shape {self.shape}",
                )

    def params(self, **arrays: Any) -> list[Any]:
        """The per-channel ``arrays`` (None stays None) in cuDNN's order and dtype, after
        checking that each has ``count`` elements."""
        self.check_counts(**arrays)
        return [None if a is None else self.param(a) for a in arrays.values()]


def _arrays(optional: tuple[str, ...] = (), **arrays: Any) -> dict[str, Operand]:
    """Operands of the NumPy or CuPy ``arrays``, on one device; only ``optional`` ones may
    be None (and are skipped)."""
    for name, array in arrays.items():
        if array is None and name not in optional:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
        if array is not None and not hasattr(array, "astype"):
            _not_an_array(name, array)
    present = {n: see(n, a) for n, a in arrays.items() if a is not None}  # each read once
    common_place(present)  # device types first: host arrays among device ones ask CUDA nothing
    found = {}
    for name, seen in present.items():
        found[name] = operand(name, seen)
        if found[name].kind is TORCH:
            _not_an_array(name, seen.array)
    places = {(op.device, op.device_id) for op in found.values()}
    if len(places) > 1:
        where = ", ".join(f"{n} on {op.device.name}:{op.device_id}" for n, op in found.items())
        raise InfiniError(Status.BAD_PARAM, f"arrays must share one device; got {where}")
    return found


def _not_an_array(name: str, array: Any) -> NoReturn:
    """Refuse ``array``, no NumPy or CuPy array, as CuPy 13's ``_ndarray_base`` did."""
    raise BadParamTypeError(
        Status.BAD_PARAM, f"{name} must be a NumPy or CuPy array, got {type(array).__name__}"
    )


def _problem(x: Any, is_for_conv2d: bool, cudnn_mode: int, d_layout: int) -> _Problem:
    """Map CuPy 13's ``(x, is_for_conv2d, cudnn_mode, d_layout)`` onto cudnn_bn's view; any
    size of x but its channels may be 0."""
    problem = _view(x, is_for_conv2d, cudnn_mode, d_layout)
    if problem.count == 0:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"x has shape {problem.shape}: no channels")
    return problem


def _view(x: Any, is_for_conv2d: bool, cudnn_mode: int, d_layout: int) -> _Problem:
    is_for_conv2d = _flag("is_for_conv2d", is_for_conv2d)
    _number("cudnn_mode", cudnn_mode, "an integer")
    _number("d_layout", d_layout, "an integer")
    if isinstance(cudnn_mode, bool) or cudnn_mode not in BatchNormMode._value2member_map_:
        raise InfiniError(
            Status.BAD_PARAM, f"unknown cudnn_mode {cudnn_mode!r}; expected 0, 1 or 2"
        )
    if isinstance(d_layout, bool) or d_layout not in (CUDNN_TENSOR_NCHW, CUDNN_TENSOR_NHWC):
        raise InfiniError(
            Status.BAD_PARAM, f"unsupported d_layout {d_layout!r}; expected NCHW (0) or NHWC (1)"
        )
    shape = tuple(x.shape)
    nhwc = is_for_conv2d and d_layout == CUDNN_TENSOR_NHWC
    if nhwc and len(shape) != 4:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"d_layout=CUDNN_TENSOR_NHWC needs a 4-D x (N, H, W, C), got {shape}",
        )
    if not shape or (is_for_conv2d and len(shape) < 2):
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"x has shape {shape}; expected (N, C, ...)")
    # cuDNN's parameter dtype: float64 for float64 input, float32 otherwise.
    dtype = np.dtype(np.float64 if np.dtype(x.dtype) == np.float64 else np.float32)
    info = (shape, dtype)

    def to_shape(a: Any) -> Any:
        return a.reshape(shape)

    def param(p: Any) -> Any:
        flat = p.reshape(-1).astype(dtype, copy=False)
        return flat if flat.strides[0] > 0 else flat.copy()  # CuPy 13 read them packed

    def undo_param(p: Any, to: tuple[int, ...]) -> Any:
        return p.reshape(to)

    if not is_for_conv2d:
        channels = shape[-1]
        return _Problem(
            lambda a: a.reshape(-1, channels), to_shape, param, undo_param, None, channels, *info
        )
    if cudnn_mode != CUDNN_BATCHNORM_PER_ACTIVATION:
        persistent = cudnn_mode == CUDNN_BATCHNORM_SPATIAL_PERSISTENT
        if nhwc:  # (N, H, W, C) as an (N, C, H, W) view with channels-last strides
            return _Problem(
                lambda a: a.transpose(0, 3, 1, 2),
                lambda a: a.transpose(0, 2, 3, 1),
                param,
                undo_param,
                persistent,
                shape[3],
                *info,
            )
        return _Problem(lambda a: a, lambda a: a, param, undo_param, persistent, shape[1], *info)

    count = math.prod(shape[1:])

    def flat(a: Any) -> Any:
        return a.reshape(shape[0], count)

    if not nhwc:
        return _Problem(flat, to_shape, param, undo_param, None, count, *info)
    # Per activation on (N, H, W, C): x's elements are in (H, W, C) order, cuDNN's parameters
    # (its derived 1xCxHxW descriptor) in (C, H, W) order.
    _, h, w, c = shape
    return _Problem(
        flat,
        to_shape,
        lambda p: param(p.reshape(c, h, w).transpose(1, 2, 0)),
        lambda p, to: p.reshape(h, w, c).transpose(2, 0, 1).reshape(to),
        None,
        count,
        *info,
    )


def _overflow_check(debug: bool, cudnn_mode: int) -> bool:
    """CuPy 13's condition for its overflow check: ``debug`` on a SPATIAL_PERSISTENT pass."""
    return _flag("debug", debug) and cudnn_mode == CUDNN_BATCHNORM_SPATIAL_PERSISTENT


_training_api = raises_only_infini_errors(
    {"input": "x", "weight": "gamma", "bias": "beta", "momentum": "decay"}
)
_inference_api = raises_only_infini_errors(
    {"input": "x", "weight": "gamma", "bias": "beta", "running_mean": "mean", "running_var": "var"}
)
_backward_api = raises_only_infini_errors(
    {"input": "x", "grad_output": "gy", "weight": "gamma"}
    | {"saved_mean": "mean", "saved_invstd": "inv_std", "running_mean": "mean"}
    | {"running_var": "inv_std", "reserve": "reserve_space"}
)


def _write(target: Any, flat: Any, problem: _Problem) -> None:
    """Store ``flat`` (cuDNN's order) into ``target`` (of any strides) unless it already is
    its memory."""
    if operand("target", target).byte_range != operand("flat", flat).byte_range:
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
    when those are given (and filled). Everything is checked before anything is written."""
    if (mean is None) != (inv_std is None):
        raise InfiniError(Status.BAD_PARAM, "Both mean and inv_std must be None if one is.")
    eps = _double("eps", eps)
    momentum = 1.0 - check_fraction("decay", _double("decay", decay))
    ops = _arrays(
        ("running_mean", "running_var", "mean", "inv_std"),
        x=x, gamma=gamma, beta=beta, running_mean=running_mean, running_var=running_var,
        mean=mean, inv_std=inv_std,
    )  # fmt: skip
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    problem.check_counts(mean=mean, inv_std=inv_std)
    written = {n: ops[n] for n in ("running_mean", "running_var", "mean", "inv_std") if n in ops}
    for name, op in written.items():  # of any shape with C elements: none on another's bytes
        check_output(name, op.desc)
    check_written(written, {n: ops[n] for n in ("x", "gamma", "beta")})
    weight, bias, *running = problem.params(
        gamma=gamma, beta=beta, running_mean=running_mean, running_var=running_var
    )
    outputs = batch_norm_forward_training(
        problem.input(x),
        weight,
        bias,
        *running,
        momentum=momentum,
        eps=eps,
        persistent=problem.persistent,
        check_overflow=_overflow_check(debug, cudnn_mode),
    )
    y, flat_mean, flat_inv_std = outputs
    if not problem.empty:  # else, as torch, running statistics unchanged, saved ones unset
        for target, flat in zip((running_mean, running_var), running, strict=True):
            if target is not None:
                _write(target, flat, problem)
        if mean is not None:
            mean[...] = problem.undo_param(flat_mean, tuple(mean.shape))
            inv_std[...] = problem.undo_param(flat_inv_std, tuple(inv_std.shape))
    if mean is not None:
        return outputs.reserve, problem.result(y), mean, inv_std
    shape = tuple(gamma.shape)
    saved = (problem.undo_param(s, shape) for s in (flat_mean, flat_inv_std))
    return outputs.reserve, problem.result(y), *saved


@_training_api
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


@_training_api
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


@_inference_api
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
    eps = _double("eps", eps)
    _arrays(x=x, gamma=gamma, beta=beta, mean=mean, var=var)
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    y = batch_norm_forward_inference(
        problem.input(x),
        *problem.params(gamma=gamma, beta=beta, mean=mean, var=var),
        eps=eps,
    )
    return problem.result(y)


@_backward_api
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
    eps = _double("eps", eps)
    _arrays(x=x, gamma=gamma, gy=gy, mean=mean, inv_std=inv_std)
    problem = _problem(x, is_for_conv2d, cudnn_mode, d_layout)
    if tuple(gy.shape) != tuple(x.shape):
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"gy has shape {tuple(gy.shape)}; expected x's {x.shape}"
        )
    if np.dtype(gy.dtype) != np.dtype(x.dtype):
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE, f"gy has dtype {gy.dtype}; expected x's {x.dtype}"
        )
    weight, saved_mean, saved_invstd = problem.params(gamma=gamma, mean=mean, inv_std=inv_std)
    gx, ggamma, gbeta = batch_norm_backward(
        problem.input(x),
        problem.input(gy),
        weight,
        None,
        None,
        eps=eps,
        mode="saved",
        saved_mean=saved_mean,
        saved_invstd=saved_invstd,
        reserve=reserve_space,
        persistent=problem.persistent,
        check_overflow=_overflow_check(debug, cudnn_mode),
    )
    # CuPy 13: made in the parameter dtype; cast to x's where gamma had to be cast.
    dtype = problem.param_dtype if np.dtype(gamma.dtype) == problem.param_dtype else x.dtype
    shape = tuple(gamma.shape)
    ggamma, gbeta = (
        problem.undo_param(g, shape).astype(dtype, copy=False) for g in (ggamma, gbeta)
    )
    return problem.result(gx), ggamma, gbeta


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
