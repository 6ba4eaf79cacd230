"""CUDA kernels (through CuPy) for what cuDNN has no call for or rejects.

Every kernel reads its operands in their own dtype and strides, computes in ``A`` (float,
or double for F64 data) and writes in the destination's dtype; BF16 travels as ``uint16``
bits, converted in the kernel (round to nearest even), so no header beyond CUDA's is needed.
Kernels are built once per dtype combination and cached.
"""

import functools
from typing import Any

from ..enums import DataType

PREAMBLE = r"""
__device__ __forceinline__ float bf16_load(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short bf16_store(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""


def acc_type(dtype: DataType) -> str:
    """The C type kernels compute in for data of ``dtype``."""
    return "double" if dtype == DataType.F64 else "float"


def load(expr: str, dtype: DataType, acc: str) -> str:
    """C expression reading ``expr`` (stored as ``dtype``) as ``acc``."""
    return f"(({acc})bf16_load({expr}))" if dtype == DataType.BF16 else f"(({acc})({expr}))"


def store(expr: str, dtype: DataType) -> str:
    """C expression converting ``expr`` to the storage of ``dtype``."""
    return f"bf16_store((float)({expr}))" if dtype == DataType.BF16 else f"({expr})"


@functools.cache
def _convert_kernel(src: DataType, dst: DataType) -> Any:
    import cupy

    acc = acc_type(DataType.F64 if DataType.F64 in (src, dst) else DataType.F32)
    return cupy.ElementwiseKernel(
        "S x",
        "D y",
        f"y = {store(load('x', src, acc), dst)}",
        f"cudnn_bn_convert_{src.name}_{dst.name}",
        preamble=PREAMBLE,
    )


def convert(src: Any, src_dtype: DataType, dst: Any, dst_dtype: DataType) -> None:
    """``dst[...] = src`` across dtypes (BF16 as bits), any strides."""
    _convert_kernel(src_dtype, dst_dtype)(src, dst)


@functools.cache
def _rsqrt_kernel(src: DataType, acc: str) -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "S var, float64 eps",
        "A invstd",
        f"invstd = ({acc})(1.0 / sqrt((double){load('var', src, acc)} + eps))",
        f"cudnn_bn_invstd_{src.name}_{acc}",
        preamble=PREAMBLE,
    )


def invstd_from_var(var: Any, var_dtype: DataType, eps: float, out: Any, acc: str) -> None:
    """``out = 1 / sqrt(var + eps)``, computed in double, stored as ``acc``."""
    _rsqrt_kernel(var_dtype, acc)(var, eps, out)


# Per-channel sums: X and DY are the data read as the compute type, m the channel's mean.
SUMS = {
    "x": "X",
    "squared_deviation": "(X - m) * (X - m)",
    "dy": "DY",
    "dy_deviation": "DY * (X - m)",
}


@functools.cache
def _channel_sum_kernel(name: str, x_dtype: DataType, acc: str) -> Any:
    import cupy

    body = SUMS[name].replace("DY", load("dy", x_dtype, acc)).replace("X", load("x", x_dtype, acc))
    return cupy.ReductionKernel(
        "S x, S dy, A m",
        "A out",
        body,
        "a + b",
        "out = a",
        "0",
        f"cudnn_bn_sum_{name}_{x_dtype.name}_{acc}",
        reduce_type=acc,
        preamble=PREAMBLE,
    )


def channel_sum(
    name: str, x: Any, dy: Any, m: Any, x_dtype: DataType, axes: tuple[int, ...], out: Any
) -> None:
    """``out[c]`` = the sum of ``SUMS[name]`` over ``axes``; ``m`` is shaped ``(1, C, 1, ...)``."""
    _channel_sum_kernel(name, x_dtype, acc_type(x_dtype))(x, dy, m, axis=axes, out=out)


@functools.cache
def _finish_kernel(w_dtype: DataType, gw_dtype: DataType, gb_dtype: DataType, acc: str) -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "W w, A invstd, A sum_dy, A sum_dy_dev, float64 inv_m, bool centred",
        "A k, A a, A b, G gw, H gb",
        f"""
        k = {load("w", w_dtype, acc)} * invstd;
        a = centred ? ({acc})(sum_dy * inv_m) : ({acc})0;
        b = centred ? ({acc})(sum_dy_dev * invstd * invstd * inv_m) : ({acc})0;
        gw = {store("sum_dy_dev * invstd", gw_dtype)};
        gb = {store("sum_dy", gb_dtype)};
        """,
        f"cudnn_bn_finish_{w_dtype.name}_{gw_dtype.name}_{gb_dtype.name}_{acc}",
        preamble=PREAMBLE,
    )


def finish_channels(
    w: Any,
    invstd: Any,
    sum_dy: Any,
    sum_dy_dev: Any,
    inv_m: float,
    centred: bool,
    dtypes: tuple[DataType, DataType, DataType],
    k: Any,
    a: Any,
    b: Any,
    gw: Any,
    gb: Any,
) -> None:
    """Per-channel ``grad_weight``, ``grad_bias`` and the coefficients of ``grad_input``.

    ``dtypes`` are those of ``w``, ``gw`` and ``gb``; without ``centred`` (eval mode) the
    mean-of-dy terms ``a`` and ``b`` are zero.
    """
    acc = "double" if DataType.F64 in dtypes else "float"
    _finish_kernel(*dtypes, acc)(w, invstd, sum_dy, sum_dy_dev, inv_m, centred, k, a, b, gw, gb)


@functools.cache
def _grad_input_kernel(x_dtype: DataType, acc: str) -> Any:
    import cupy

    value = f"k * ({load('dy', x_dtype, acc)} - a - ({load('x', x_dtype, acc)} - m) * b)"
    return cupy.ElementwiseKernel(
        "S x, S dy, A m, A k, A a, A b",
        "S dx",
        f"dx = {store(value, x_dtype)}",
        f"cudnn_bn_grad_input_{x_dtype.name}_{acc}",
        preamble=PREAMBLE,
    )


def grad_input(x: Any, dy: Any, m: Any, k: Any, a: Any, b: Any, x_dtype: DataType, dx: Any) -> None:
    """``dx = k * (dy - a - (x - m) * b)`` with per-channel ``m, k, a, b`` broadcast."""
    _grad_input_kernel(x_dtype, acc_type(x_dtype))(x, dy, m, k, a, b, dx)
