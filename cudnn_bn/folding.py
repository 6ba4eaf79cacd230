"""Folding an evaluation-mode batch norm into the convolution before it, as PyTorch folds it.

``bn(conv(x))`` with fixed statistics is one convolution with
``weight * (bn_weight / sqrt(running_var + eps))`` per output channel and a matching bias,
so inference can skip the batch norm entirely.
"""

from typing import Any

import numpy as np

from .arrays.cuda_interface import is_cupy
from .enums import Status
from .errors import InfiniError, raises_only_infini_errors
from .ops.validation import check_eps, check_flag


def _namespace(name: str, array: Any) -> Any:
    """NumPy or CuPy, whichever ``array`` belongs to; anything else is BAD_PARAM."""
    if isinstance(array, np.ndarray):
        return np
    if is_cupy(array):
        import cupy

        return cupy
    raise InfiniError(
        Status.BAD_PARAM, f"{name} must be a NumPy or CuPy array, got {type(array).__name__}"
    )


def _check_float(name: str, array: Any) -> None:
    if np.dtype(array.dtype).kind != "f":
        raise InfiniError(
            Status.BAD_TENSOR_DTYPE,
            f"{name} has dtype {array.dtype}; expected a floating dtype (it would be truncated)",
        )


@raises_only_infini_errors({})
def fold_conv_bn(
    conv_weight: Any,
    conv_bias: Any,
    bn_weight: Any,
    bn_bias: Any,
    running_mean: Any,
    running_var: Any,
    eps: float,
    transpose: bool = False,
) -> tuple[Any, Any]:
    """``(weight, bias)`` of one convolution equal to ``conv`` followed by eval-mode BN.

    Output channels are axis 0 of ``conv_weight`` (axis 1 for a transposed convolution,
    whose weight is ``(in, out, *kernel)``; grouped transposed convolutions are not
    foldable this way and are rejected by the shape check). ``conv_bias``, ``bn_weight``
    and ``bn_bias`` may be None (zero, one, zero). Arrays are NumPy or CuPy (all of one),
    of floating dtypes; results match ``conv_weight``'s dtype, computed in at least
    float32. A negative ``running_var`` entry is refused (BAD_PARAM): its square root
    would be NaN.
    """
    eps = check_eps(eps)
    xp = _namespace("conv_weight", conv_weight)
    _check_float("conv_weight", conv_weight)
    axis = 1 if check_flag("transpose", transpose) else 0
    if conv_weight.ndim < 2:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE,
            f"conv_weight has shape {conv_weight.shape}; expected 2 or more axes",
        )
    channels = conv_weight.shape[axis]
    compute = xp.promote_types(conv_weight.dtype, xp.float32)

    def per_channel(name: str, value: Any, default: float) -> Any:
        if value is None:
            return xp.full(channels, default, compute)
        if _namespace(name, value) is not xp:
            raise InfiniError(
                Status.BAD_PARAM, f"{name} and conv_weight must both be NumPy or both CuPy"
            )
        _check_float(name, value)
        if tuple(value.shape) != (channels,):
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {tuple(value.shape)}; expected ({channels},), one per "
                f"output channel of conv_weight {tuple(conv_weight.shape)}"
                + (" (axis 1, transpose=True)" if transpose else ""),
            )
        return xp.asarray(value, dtype=compute)

    mean = per_channel("running_mean", running_mean, 0.0)
    var = per_channel("running_var", running_var, 1.0)
    if bool((var < 0).any()):
        raise InfiniError(
            Status.BAD_PARAM, "running_var has negative entries; a variance is never negative"
        )
    gamma = per_channel("bn_weight", bn_weight, 1.0)
    shift = per_channel("bn_bias", bn_bias, 0.0)
    bias = per_channel("conv_bias", conv_bias, 0.0)
    shape = [1] * conv_weight.ndim
    shape[axis] = channels
    out_dtype = conv_weight.dtype
    # IEEE results as torch's fold gives them (a zero variance with eps 0: inf; an overflow:
    # inf), without NumPy's warnings, which ``python -W error`` would make INTERNAL_ERRORs.
    with np.errstate(all="ignore"):
        scale = gamma / xp.sqrt(var + eps)
        weight = xp.asarray(conv_weight, dtype=compute) * scale.reshape(shape)  # no np.matrix
        return weight.astype(out_dtype), (shift + (bias - mean) * scale).astype(out_dtype)
