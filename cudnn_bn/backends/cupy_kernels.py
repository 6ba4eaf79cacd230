"""CUDA kernels (through CuPy) for what cuDNN has no call for or rejects: the elementwise
passes and per-channel arithmetic (the per-channel sums are ``cupy_reductions.py``'s).

Every kernel reads its operands in their own dtype and strides, computes in ``A`` (float,
or double for F64 data) and writes in the destination's dtype; BF16 travels as ``uint16``
bits, converted in the kernel (round to nearest even), so no header beyond CUDA's is needed
(the raw reduction kernels read F16 as bits too, through ``f16_load``).
Fused passes apply ReLU and read ``dy`` through its mask as torch does: ``relu(NaN)`` is NaN
(cuDNN's ``CUDNN_PROPAGATE_NAN`` too) and ``dy`` passes where ``y`` is not ``<= 0``
(``threshold_backward`` in PyTorch's aten/src/ATen/native/Activation.cpp), NaN included.
Kernels are built once per dtype combination and cached.
"""

import functools
from typing import Any

from ..enums import DataType
from ..problems import Fusion

PREAMBLE = r"""
__device__ __forceinline__ float bf16_load(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ float f16_load(unsigned short h) {
    const unsigned int sign = ((unsigned int)h & 0x8000u) << 16, bits = h & 0x7fffu;
    if (bits >= 0x7c00u) return __uint_as_float(sign | 0x7f800000u | ((bits & 0x3ffu) << 13));
    if (bits >= 0x0400u) return __uint_as_float(sign | ((bits + (112u << 10)) << 13));
    const float tiny = (float)bits * 5.9604644775390625e-08f;  /* subnormal: bits * 2^-24 */
    return sign ? -tiny : tiny;
}
__device__ __forceinline__ unsigned short bf16_store(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
template <typename T> __device__ __forceinline__ T relu(T v) { return v < (T)0 ? (T)0 : v; }
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


def relu_masked(dy: str, y: str, acc: str) -> str:
    """C expression: ``dy`` through the mask of the ReLU whose output is ``y`` (zero where
    ``y <= 0``; a NaN ``y`` passes ``dy``, as in torch)."""
    return f"({y} <= ({acc})0 ? ({acc})0 : {dy})"


def load_dy(x_dtype: DataType, acc: str, fused: bool) -> str:
    """``dy`` as the batch norm sees it: through the ReLU mask of ``y`` when fused."""
    dy = load("dy", x_dtype, acc)
    return relu_masked(dy, load("y", x_dtype, acc), acc) if fused else dy


def _elementwise(params: str, outputs: str, body: str, name: str) -> Any:
    import cupy

    return cupy.ElementwiseKernel(params, outputs, body, f"cudnn_bn_{name}", preamble=PREAMBLE)


@functools.cache
def _convert_kernel(src: DataType, dst: DataType) -> Any:
    acc = acc_type(DataType.F64 if DataType.F64 in (src, dst) else DataType.F32)
    return _elementwise(
        "S x", "D y", f"y = {store(load('x', src, acc), dst)}", f"convert_{src.name}_{dst.name}"
    )


def convert(src: Any, src_dtype: DataType, dst: Any, dst_dtype: DataType) -> None:
    """``dst[...] = src`` across dtypes (BF16 as bits), any strides."""
    _convert_kernel(src_dtype, dst_dtype)(src, dst)


@functools.cache
def _invstd_kernel(src: DataType, acc: str) -> Any:
    body = f"""double v = (double){load("var", src, acc)};
        invstd = ({acc})(batch && v == 0.0 && eps == 0.0 ? 0.0 : 1.0 / sqrt(v + eps))"""
    return _elementwise(
        "S var, float64 eps, bool batch", "A invstd", body, f"invstd_{src.name}_{acc}"
    )


def invstd_from_var(
    var: Any, var_dtype: DataType, eps: float, out: Any, acc: str, batch: bool = False
) -> None:
    """``out = 1 / sqrt(var + eps)``, computed in double, stored as ``acc``. For a ``batch``
    variance, 0 where it and eps are 0, as torch's ``InvStd`` (Normalization.cpp, and its
    CUDA kernels) gives: the output is then the bias and the gradients 0."""
    _invstd_kernel(var_dtype, acc)(var, eps, batch, out)


@functools.cache
def _finish_kernel(w_dtype: DataType, gw_dtype: DataType, gb_dtype: DataType, acc: str) -> Any:
    body = f"""
        k = {load("w", w_dtype, acc)} * invstd;
        a = centred ? ({acc})(sum_dy * inv_m) : ({acc})0;
        b = centred ? ({acc})(sum_dy_dev * invstd * invstd * inv_m) : ({acc})0;
        gw = {store("sum_dy_dev * invstd", gw_dtype)};
        gb = {store("sum_dy", gb_dtype)};
    """
    return _elementwise(
        "W w, A invstd, A sum_dy, A sum_dy_dev, float64 inv_m, bool centred",
        "A k, A a, A b, G gw, H gb",
        body,
        f"finish_{w_dtype.name}_{gw_dtype.name}_{gb_dtype.name}_{acc}",
    )


def finish_channels(
    w: Any,
    sums: tuple[Any, Any, Any],
    inv_m: float,
    centred: bool,
    dtypes: tuple[DataType, DataType, DataType],
    outputs: tuple[Any, Any, Any, Any, Any],
) -> None:
    """Per-channel ``grad_weight``, ``grad_bias`` and the coefficients of ``grad_input``.

    ``sums`` is ``(invstd, sum_dy, sum_dy_dev)``; ``outputs`` is ``(k, a, b, gw, gb)``;
    ``dtypes`` are those of ``w``, ``gw`` and ``gb``. Without ``centred`` (eval mode) the
    mean-of-dy terms ``a`` and ``b`` are zero.
    """
    acc = "double" if DataType.F64 in dtypes else "float"
    _finish_kernel(*dtypes, acc)(w, *sums, inv_m, centred, *outputs)


@functools.cache
def _grad_input_kernel(x_dtype: DataType, acc: str, fused: bool) -> Any:
    value = f"k * ({load_dy(x_dtype, acc, fused)} - a - ({load('x', x_dtype, acc)} - m) * b)"
    return _elementwise(
        "S x, S dy, S y, A m, A k, A a, A b",
        "S dx",
        f"dx = {store(value, x_dtype)}",
        f"grad_input_{x_dtype.name}_{acc}_{int(fused)}",
    )


def grad_input(
    data: tuple[Any, Any, Any],
    coefficients: tuple[Any, Any, Any, Any],
    x_dtype: DataType,
    fused: bool,
    dx: Any,
) -> None:
    """``dx = k * (dy - a - (x - m) * b)``; ``data`` is ``(x, dy, y)``, ``coefficients``
    ``(m, k, a, b)`` per channel shaped to broadcast."""
    _grad_input_kernel(x_dtype, acc_type(x_dtype), fused)(*data, *coefficients, dx)


@functools.cache
def _masked_grad_kernel(x_dtype: DataType, acc: str) -> Any:
    body = f"dz = {store(load_dy(x_dtype, acc, True), x_dtype)}"
    return _elementwise("S dy, S y", "S dz", body, f"masked_grad_{x_dtype.name}_{acc}")


def masked_grad(dy: Any, y: Any, x_dtype: DataType, dz: Any) -> None:
    """``dz = 0 where y <= 0, else dy``: the gradient through the fused ReLU (the residual's)."""
    _masked_grad_kernel(x_dtype, acc_type(x_dtype))(dy, y, dz)


@functools.cache
def _scale_kernel(w_dtype: DataType, acc: str) -> Any:
    return _elementwise(
        "W w, A invstd",
        "A k",
        f"k = {load('w', w_dtype, acc)} * invstd",
        f"scale_{w_dtype.name}_{acc}",
    )


def channel_scale(w: Any, w_dtype: DataType, invstd: Any, k: Any, acc: str) -> None:
    """``k = w * invstd`` per channel."""
    _scale_kernel(w_dtype, acc)(w, invstd, k)


@functools.cache
def _normalize_kernel(x_dtype: DataType, b_dtype: DataType, acc: str, add: bool, relu: bool) -> Any:
    value = f"k * ({load('x', x_dtype, acc)} - m) + {load('b', b_dtype, acc)}"
    if add:
        value = f"({value} + {load('z', x_dtype, acc)})"
    if relu:
        value = f"relu({value})"
    return _elementwise(
        "S x, S z, A m, A k, B b",
        "S y",
        f"y = {store(value, x_dtype)}",
        f"normalize_{x_dtype.name}_{b_dtype.name}_{acc}_{int(add)}{int(relu)}",
    )


def normalize(
    x: Any,
    z: Any,
    m: Any,
    k: Any,
    b: Any,
    dtypes: tuple[DataType, DataType],
    fusion: Fusion,
    y: Any,
) -> None:
    """``y = act(k * (x - m) + b [+ z])``; ``dtypes`` are those of ``x`` and ``b``; ``z`` is
    unused unless ``fusion`` adds it."""
    add, relu = fusion == Fusion.BN_ADD_RELU, fusion != Fusion.BN
    _normalize_kernel(*dtypes, acc_type(dtypes[0]), add, relu)(x, z, m, k, b, y)


@functools.cache
def _running_update_kernel(r_dtype: DataType, acc: str) -> Any:
    value = f"(1.0 - momentum) * {load('running', r_dtype, acc)} + momentum * correction * batch"
    return _elementwise(
        "A batch, float64 momentum, float64 correction",
        "R running",
        f"running = {store(value, r_dtype)}",
        f"running_update_{r_dtype.name}_{acc}",
    )


def running_update(
    running: Any, r_dtype: DataType, batch: Any, momentum: float, correction: float
) -> None:
    """``running = (1 - momentum) * running + momentum * correction * batch``, in place."""
    _running_update_kernel(r_dtype, "double" if r_dtype == DataType.F64 else "float")(
        batch, momentum, correction, running
    )
