"""Helpers shared by the test modules (a test module never imports another test module).

- References: PyTorch's batch-norm backward (``torch.ops.aten.native_batch_norm_backward`` in
  float64 on the values the operator saw, inputs already rounded to their dtype), compared
  within InfiniCore's own tolerances: atol = rtol = 2e-5 for F32, 1e-2 for F16/BF16.
- Problems: the spec's argument orders, random inputs, dtype conversion, and layouts
  (strides computed here, not by ``cudnn_bn``, so that they can check it).
- The C API on the CPU device: descriptors for host arrays and the whole call cycle.
- The GPU tests' backward problems on torch CUDA tensors (CuPy and CUDA are only needed when
  these are called).
"""

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import cudnn_bn
from cudnn_bn import DataType, Status, capi

EPS = 1e-5  # PyTorch's default, and the operators'
TOL = {
    torch.float16: 1e-2,
    torch.bfloat16: 1e-2,
    torch.float32: 2e-5,
    torch.float64: 1e-10,
    np.dtype(np.float16): 1e-2,
    np.dtype(np.float32): 2e-5,
    np.dtype(np.float64): 1e-10,
}


def f64(array) -> torch.Tensor:
    """A packed float64 torch copy of a NumPy array or torch tensor (any float dtype).

    Packed: torch 2.13's CPU ``native_batch_norm_backward`` gives a wrong ``grad_input`` when
    ``input`` and ``grad_output`` have different memory layouts (found by the fuzz tests)."""
    if isinstance(array, torch.Tensor):
        return array.detach().to(torch.float64).contiguous()
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))


def reference(x, dy, w, *, mode="train", eps=1e-5, mean=None, var=None, invstd=None):
    """``(grad_input, grad_weight, grad_bias)`` in float64 from PyTorch.

    mode "train": batch statistics of ``x``; "saved": ``mean`` with ``var`` (biased batch
    variance) or ``invstd`` as saved by the forward; "eval": ``mean``/``var`` as running stats.
    """
    x, dy, w = f64(x), f64(dy), f64(w)
    if x.numel() == 0:  # F.batch_norm's autograd; the aten backward dies of SIGFPE here
        return torch.empty_like(x), torch.zeros_like(w), torch.zeros_like(w)
    mean = None if mean is None else f64(mean)
    mask = [True, True, True]
    if mode == "eval":
        return torch.ops.aten.native_batch_norm_backward(
            dy, x, w, mean, f64(var), None, None, False, eps, mask
        )
    if mode == "train":
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.0, eps)
    elif invstd is None:
        invstd = 1.0 / torch.sqrt(f64(var) + eps)
    return torch.ops.aten.native_batch_norm_backward(
        dy, x, w, None, None, mean, f64(invstd), True, eps, mask
    )


def assert_close(actual, expected: torch.Tensor, dtype) -> None:
    """``actual`` (NumPy or torch, any float dtype) within ``TOL[dtype]`` of ``expected``."""
    tol = TOL[dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)]
    torch.testing.assert_close(f64(actual), expected, atol=tol, rtol=tol)


def torch_training(p: dict, momentum: float, eps: float = EPS):
    """float64 ``(output, saved_mean, saved_invstd, running_mean, running_var)`` of
    training-mode batch norm on the problem ``p`` (arrays by name)."""
    x, w, b = f64(p["input"]), f64(p["weight"]), f64(p["bias"])
    rm, rv = f64(p["running_mean"]).clone(), f64(p["running_var"]).clone()
    if eps > 0:
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=momentum, eps=eps)
    else:  # F.batch_norm rejects eps 0 in training; the aten op it calls takes it
        y, _, _ = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, True, momentum, eps)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, momentum, eps)
    return y, mean, invstd, rm, rv


def torch_inference(p: dict, eps: float = EPS) -> torch.Tensor:
    """float64 output of evaluation-mode ``F.batch_norm``."""
    names = ("input", "weight", "bias", "running_mean", "running_var")
    x, w, b, rm, rv = (f64(p[n]) for n in names)
    return F.batch_norm(x, rm, rv, w, b, training=False, eps=eps)


def torch_fused(p: dict, fusion: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """float64 ``relu(bn(x) [+ z])`` and autograd's gradients by name (``grad_z`` too)."""
    leaves = {n: f64(p[n]).requires_grad_() for n in ("input", "weight", "bias", "z")}
    x, w, b, z = leaves.values()
    y = F.batch_norm(x, None, None, w, b, training=True, eps=EPS)
    y = torch.relu(y + z if fusion == "add_relu" else y)
    y.backward(f64(p["grad_output"]))
    grads = {f"grad_{n}": t.grad for n, t in leaves.items()}
    return y.detach(), grads


# --- problems --------------------------------------------------------------------------------

# The argument orders of the operators' C functions and ``compute``: the spec's.
BACKWARD_ORDER = (
    "grad_input",
    "grad_weight",
    "grad_bias",
    "input",
    "grad_output",
    "weight",
    "running_mean",
    "running_var",
)
OUTPUTS = BACKWARD_ORDER[:3]  # the backward's
TRAINING_ORDER = (
    "output", "saved_mean", "saved_invstd",
    "input", "weight", "bias", "running_mean", "running_var",
)  # fmt: skip
INFERENCE_ORDER = ("output", "input", "weight", "bias", "running_mean", "running_var")

SHAPES = [(6, 3), (2, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 4)]  # 2-D to 5-D, C = 3


def random_values(shape, seed=0, *, bias=False) -> dict[str, np.ndarray]:
    """float64 input, grad_output, weight, (bias,) running_mean and running_var for ``shape``
    (N, C, ...), drawn in that order; the variances are positive."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    values = {
        "input": rng.standard_normal(shape) * 2 + 0.5,
        "grad_output": rng.standard_normal(shape),
        "weight": rng.uniform(0.5, 1.5, c),
    }
    if bias:
        values["bias"] = rng.standard_normal(c) * 0.5
    values["running_mean"] = rng.standard_normal(c) * 0.3
    values["running_var"] = rng.uniform(0.5, 2.0, c)
    return values


def fused_problem(shape, data, channel, seed=0) -> dict:
    """Input, residual z, grad_output and per-channel tensors rounded to their dtypes.

    The bias is around 0 so that the ReLU cuts about half of the values."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    return {
        "input": convert(rng.standard_normal(shape) * 2 + 0.5, data),
        "z": convert(rng.standard_normal(shape), data),
        "grad_output": convert(rng.standard_normal(shape), data),
        "weight": convert(rng.uniform(0.5, 1.5, c), channel),
        "bias": convert(rng.standard_normal(c) * 0.5, channel),
    }


def convert(values: np.ndarray, dtype):
    """``values`` as a torch CPU tensor of a torch ``dtype``, else as a NumPy array."""
    if isinstance(dtype, torch.dtype):
        return torch.from_numpy(values).to(dtype)
    return values.astype(dtype)


def tolerance_dtype(data):
    """The dtype whose tolerance applies: the data dtype (half data: its 1e-2 for all)."""
    return data if isinstance(data, torch.dtype) else np.dtype(data)


# --- layouts ---------------------------------------------------------------------------------


def packed_in_order(shape, order) -> tuple[int, ...]:
    """Element strides of a packed tensor of ``shape`` whose axes lie in memory in ``order``,
    outermost first."""
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def channels_last(shape) -> tuple[int, ...]:
    """Channel axis innermost: NLC, NHWC, NDHWC; (N, C) is already that."""
    return packed_in_order(shape, (0, *range(2, len(shape)), 1))


def padded_strides(shape) -> tuple[int, ...]:
    """Row-major with 3 extra elements after each innermost row and 5 after each batch item."""
    widened = (*shape[:-1], shape[-1] + 3)
    strides = list(packed_in_order(widened, range(len(shape))))
    strides[0] += 5
    return tuple(strides)


# --- the machine -----------------------------------------------------------------------------


def gpu_present() -> bool:
    """Whether the CUDA driver is there and sees a device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    return count.value > 0


# --- the C API with host pointers ------------------------------------------------------------

CAPI_DTYPES = {
    np.dtype(np.float16): DataType.F16,
    np.dtype(np.float32): DataType.F32,
    np.dtype(np.float64): DataType.F64,
    torch.float16: DataType.F16,
    torch.bfloat16: DataType.BF16,
    torch.float32: DataType.F32,
    torch.float64: DataType.F64,
}


def ok(status) -> None:
    """A success: a plain int 0, and no message left behind."""
    assert type(status) is int
    assert status == Status.SUCCESS, capi.last_error()
    assert capi.last_error() == ""


def layout(array) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Shape, element strides and host address of a NumPy array or torch CPU tensor."""
    if isinstance(array, torch.Tensor):
        return tuple(array.shape), tuple(array.stride()), array.data_ptr()
    strides = tuple(s // array.itemsize for s in array.strides)
    return array.shape, strides, array.ctypes.data


def out_param(value: ctypes.c_void_p | ctypes.c_size_t, style: str):
    return ctypes.byref(value) if style == "byref" else ctypes.addressof(value)


def tensor_desc(array, style: str = "ctypes", out: str = "byref") -> ctypes.c_void_p:
    """An ``infiniopTensorDescriptor_t`` for ``array``; ``style`` says how shape/strides go."""
    shape, strides, _ = layout(array)
    n = len(shape)
    c_shape, c_strides = (ctypes.c_size_t * n)(*shape), (ctypes.c_ssize_t * n)(*strides)
    shape_arg, strides_arg = c_shape, c_strides
    if style == "list":
        shape_arg, strides_arg = list(shape), list(strides)
    elif style == "address":  # c_shape and c_strides keep the memory alive
        shape_arg, strides_arg = ctypes.addressof(c_shape), ctypes.addressof(c_strides)
    elif style == "null":
        contiguous = (
            torch.Tensor.is_contiguous
            if isinstance(array, torch.Tensor)
            else (lambda a: a.flags.c_contiguous)
        )
        assert contiguous(array)
        strides_arg = None
    desc = ctypes.c_void_p()
    ok(
        capi.infiniopCreateTensorDescriptor(
            out_param(desc, out), n, shape_arg, strides_arg, CAPI_DTYPES[array.dtype]
        )
    )
    assert desc.value
    return desc


def capi_cycle(
    operator: str,
    order,
    arrays: dict,
    attributes=None,
    sizes=("Workspace",),
    *,
    style: str = "ctypes",
    out: str = "byref",
) -> None:
    """Create -> set attributes -> query sizes (0 on the CPU) -> compute -> destroy.

    ``operator`` names the functions (``BatchNormForwardTraining``); ``arrays`` holds the
    arguments by name, None for a NULL descriptor and pointer; ``attributes`` are set unless
    None (the defaults then); ``sizes`` are the buffers the compute takes before its tensors
    (workspace, then reserve), all passed as NULL. ``style`` says how shapes and strides go
    in, ``out`` how out-parameters do (``ctypes.byref`` or a raw address).
    """
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(out_param(handle, out)))
    descs = [None if arrays[n] is None else tensor_desc(arrays[n], style, out) for n in order]
    ok(getattr(capi, f"infiniopCreate{operator}Descriptor")(handle, out_param(op, out), *descs))
    for desc in descs:  # not retained by the operator descriptor
        if desc is not None:
            ok(capi.infiniopDestroyTensorDescriptor(desc))
    if attributes is not None:
        ok(getattr(capi, f"infiniopSet{operator}Attributes")(op, *attributes))
    for size_name in sizes:
        size = ctypes.c_size_t(12345)
        ok(getattr(capi, f"infiniopGet{operator}{size_name}Size")(op, out_param(size, out)))
        assert size.value == 0  # the CPU backend needs no workspace and keeps no reserve
    pointers = [0 if arrays[n] is None else layout(arrays[n])[2] for n in order]
    ok(getattr(capi, f"infiniop{operator}")(op, *(None, 0) * len(sizes), *pointers, None))
    ok(getattr(capi, f"infiniopDestroy{operator}Descriptor")(op))
    ok(capi.infiniopDestroyHandle(handle))


def capi_backward(
    arrays: dict,
    *,
    mode: int | None = 0,
    eps: float = 1e-5,
    style: str = "ctypes",
    out: str = "byref",
) -> None:
    """The backward's whole cycle; results are written into ``arrays``' grad_* (None: a NULL
    tensor); ``mode`` None leaves the attributes at their defaults."""
    attributes = None if mode is None else (eps, mode)
    capi_cycle("BatchNormBackward", BACKWARD_ORDER, arrays, attributes, style=style, out=out)


# --- backward problems on the GPU ------------------------------------------------------------


@dataclass
class GpuProblem:
    """One batch-norm backward: torch CUDA tensors and the array API's keyword arguments."""

    x: torch.Tensor
    dy: torch.Tensor
    w: torch.Tensor
    stats: dict  # running_mean/running_var, or saved_mean/saved_invstd
    mode: str  # the array API's mode: "train", "saved" or "eval"
    eps: float = 1e-5


def on_device(values: np.ndarray, dtype: torch.dtype, strides=None) -> torch.Tensor:
    """``values`` rounded to ``dtype`` on the GPU, laid out with ``strides`` (elements)."""
    tensor = torch.from_numpy(values).to(device="cuda", dtype=dtype)
    if strides is None:
        return tensor
    laid_out = torch.empty_strided(tensor.shape, strides, dtype=dtype, device="cuda")
    return laid_out.copy_(tensor)


def make_gpu_problem(shape, strides, dtype, channel_dtype, mode, eps=1e-5, seed=0) -> GpuProblem:
    """``mode``: "train", "saved" (running_* are the batch mean and biased variance),
    "saved_invstd" (saved_mean/saved_invstd as a forward saves them) or "eval"."""
    rng = np.random.default_rng(seed)
    channels = shape[1]
    x = on_device(2 * rng.standard_normal(shape) + 0.5, dtype, strides)
    dy = on_device(rng.standard_normal(shape), dtype, strides)
    w = on_device(1 + 0.5 * rng.standard_normal(channels), channel_dtype)
    x64 = x.double()
    axes = [0, *range(2, x.ndim)]
    mean, var = x64.mean(dim=axes), x64.var(dim=axes, correction=0)
    if mode in ("train", "eval"):  # train: random running statistics, never read
        stats = {
            "running_mean": on_device(0.1 * rng.standard_normal(channels), channel_dtype),
            "running_var": on_device(0.5 + rng.random(channels), channel_dtype),
        }
    elif mode == "saved":
        stats = {"running_mean": mean.to(channel_dtype), "running_var": var.to(channel_dtype)}
    else:
        invstd = torch.rsqrt(var + eps)
        stats = {"saved_mean": mean.to(channel_dtype), "saved_invstd": invstd.to(channel_dtype)}
    torch.cuda.synchronize()
    return GpuProblem(x, dy, w, stats, "saved" if mode == "saved_invstd" else mode, eps)


def run_gpu_problem(p: GpuProblem, convert=lambda t: t, **kwargs) -> tuple:
    """``cudnn_bn.batch_norm_backward`` on ``convert``-ed copies or views of the problem."""
    stats = {name: convert(t) for name, t in p.stats.items()}
    return cudnn_bn.batch_norm_backward(
        convert(p.x), convert(p.dy), convert(p.w),
        stats.get("running_mean"), stats.get("running_var"),
        eps=p.eps, mode=p.mode, saved_mean=stats.get("saved_mean"),
        saved_invstd=stats.get("saved_invstd"), **kwargs,
    )  # fmt: skip


def as_f64(a) -> np.ndarray:
    """A float64 NumPy copy of a torch tensor (any device), NumPy array or CuPy array."""
    if isinstance(a, torch.Tensor):
        return a.detach().double().cpu().numpy()
    if isinstance(a, np.ndarray):
        return a.astype(np.float64)
    import cupy

    return cupy.asnumpy(a).astype(np.float64)
