"""cudnn_bn on a real GPU: the cuDNN and CuPy engines against PyTorch and the CPU backend.

Every test is marked ``gpu`` and is skipped, with the reason, where there is no usable GPU
(``tests/conftest.py``); ``make test-gpu`` runs them from the source tree and writes a report.

Data is made in float64, rounded to its dtype on the device by torch and laid out with the
strides under test, then handed to ``cudnn_bn`` as CuPy arrays (aliasing the torch memory
through ``__cuda_array_interface__``) or as the torch tensors themselves. The reference is
PyTorch's ``native_batch_norm_backward`` on CUDA in float64 on those same rounded values, so
the only error an engine may add is its own accumulation and the final rounding. The CPU
backend gets host copies of the same data.

Not tested here: the CuPy engine for 2^31 elements or more (tens of GiB);
``tests/test_nvidia_arguments.py`` checks that such problems are sent to it.
"""

import ctypes

import numpy as np
import pytest
import torch
from helpers import (
    OUTPUTS,
    GpuProblem,
    as_f64,
    channels_last,
    make_gpu_problem,
    padded_strides,
    run_gpu_problem,
)

import cudnn_bn
from cudnn_bn import BatchNormBackwardDescriptor, DataType, Device, Status, TensorDesc, capi
from cudnn_bn.errors import InsufficientWorkspaceError
from cudnn_bn.tensor import contiguous_strides

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DATA_TYPES = {
    np.dtype(np.float16): DataType.F16,
    np.dtype(np.float32): DataType.F32,
    np.dtype(np.float64): DataType.F64,
}
EPS = 1e-5

# atol = rtol against the float64 reference. F16/BF16: InfiniCore's 1e-2. F32: InfiniCore's
# 2e-5, relative to the float64 reference. cuDNN accumulates F32 data in F32 (the CuPy
# engine's sums in double), so each per-channel sum over M elements carries at most about
# sqrt(M) * 2^-24 of relative error (M is at most 52 here): far inside 2e-5. If a cuDNN
# release's reduction order ever made this too tight, the next step is 1e-4 relative to the
# magnitude, not a looser atol.
# F64: double accumulation against double, a different summation order only.
TOL = {F16: 1e-2, BF16: 1e-2, F32: 2e-5, F64: 1e-9}


# --- layouts -------------------------------------------------------------------------------


SHAPES = [(16, 3), (4, 3, 10), (2, 3, 4, 5), (2, 3, 2, 3, 4)]


def _layouts():
    cases = []
    for shape in SHAPES:
        cases.append(pytest.param(shape, contiguous_strides(shape), "contiguous", id=f"{shape}"))
        if len(shape) > 2:
            cases.append(pytest.param(shape, channels_last(shape), "channels_last",
                                      id=f"{shape}-channels_last"))  # fmt: skip
        cases.append(pytest.param(shape, padded_strides(shape), "padded", id=f"{shape}-padded"))
    # InfiniCore's own test case: batch items 10 elements apart instead of 8.
    cases.append(pytest.param((13, 2, 4), (10, 4, 1), "padded", id="(13, 2, 4)-(10, 4, 1)"))
    # Packed, but a broadcast size-1 axis says stride 0: cuDNN must be told the packed one.
    cases.append(pytest.param((2, 3, 1, 5), (15, 5, 0, 1), "contiguous", id="broadcast-H"))
    return cases


LAYOUTS = _layouts()


# --- problems and references ----------------------------------------------------------------


def reference(p: GpuProblem) -> tuple:
    """PyTorch's batch-norm backward on CUDA in float64, on the values the operator saw."""
    x, dy, w = p.x.double(), p.dy.double(), p.w.double()
    stats = {name: t.double() for name, t in p.stats.items()}
    backward, mask = torch.ops.aten.native_batch_norm_backward, [True, True, True]
    if p.mode == "eval":
        mean, var = stats["running_mean"], stats["running_var"]
        return backward(dy, x, w, mean, var, None, None, False, p.eps, mask)
    if "saved_mean" in stats:
        mean, invstd = stats["saved_mean"], stats["saved_invstd"]
    elif p.mode == "saved":
        mean, invstd = stats["running_mean"], torch.rsqrt(stats["running_var"] + p.eps)
    else:
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, None, None, None, True, 0.0, p.eps)
    return backward(dy, x, w, None, None, mean, invstd, True, p.eps, mask)


def to_cupy(t: torch.Tensor):
    return cupy.asarray(t)  # a view of the same device memory


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


def to_torch_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.cpu()


def assert_close(actual, expected, tol: float, what: str) -> None:
    for name, a, e in zip(OUTPUTS, actual, expected, strict=True):
        np.testing.assert_allclose(
            as_f64(a), as_f64(e), rtol=tol, atol=tol, err_msg=f"{what}: {name}"
        )


def used_engine() -> str:
    """The engine of the one descriptor in the cache (cleared before the call)."""
    entries = list(cudnn_bn.descriptor_cache.descriptors())
    assert len(entries) == 1
    return entries[0].engine


def expected_engine(mode: str, dtype: torch.dtype, layout: str, ndim: int) -> str:
    """The engine choice of ``cudnn_bn/backends/nvidia.py``: cuDNN for train/saved on 3-D
    to 5-D F16/F32/F64 in one packed layout, else CuPy (2-D input included: PyTorch sends none
    to cuDNN)."""
    packed = layout in ("contiguous", "channels_last")
    return "cudnn" if mode != "eval" and dtype != BF16 and packed and ndim > 2 else "cupy"


def cudnn_version() -> int:
    return cudnn_bn.cudnn_info().version


# --- every mode, dtype and layout ------------------------------------------------------------

MODES = ["train", "saved", "saved_invstd", "eval"]
# (how the arrays are handed over, input dtype, per-channel dtype); CuPy has no bfloat16.
KINDS = [
    ("cupy", F16, F32), ("cupy", F16, F16), ("cupy", F32, F32), ("cupy", F64, F64),
    ("torch", BF16, BF16), ("torch", BF16, F32), ("torch", F16, F32), ("torch", F32, F32),
]  # fmt: skip
KIND_IDS = [f"{k}-{str(d)[6:]}-{str(c)[6:]}" for k, d, c in KINDS]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "dtype", "channel_dtype"), KINDS, ids=KIND_IDS)
@pytest.mark.parametrize(("shape", "strides", "layout"), LAYOUTS)
def test_against_torch_and_cpu(shape, strides, layout, kind, dtype, channel_dtype, mode):
    p = make_gpu_problem(shape, strides, dtype, channel_dtype, mode)
    convert = to_cupy if kind == "cupy" else (lambda t: t)
    cudnn_bn.descriptor_cache.clear()
    got = run_gpu_problem(p, convert)
    assert used_engine() == expected_engine(p.mode, dtype, layout, len(shape))
    kind_type = cupy.ndarray if kind == "cupy" else torch.Tensor
    assert all(isinstance(g, kind_type) for g in got)

    cpu = run_gpu_problem(p, to_numpy if kind == "cupy" else to_torch_cpu)
    expected, tol = reference(p), TOL[dtype]
    assert_close(got, expected, tol, "GPU vs float64 reference")
    assert_close(cpu, expected, tol, "CPU backend vs float64 reference")
    assert_close(got, cpu, tol, "GPU vs CPU backend")


def test_eps_zero():
    """cuDNN 9 takes eps 0 (cuDNN 8 refuses below 1e-5, so the CuPy engine serves it)."""
    p = make_gpu_problem((2, 3, 4, 5), None, F32, F32, "train", eps=0.0)
    cudnn_bn.descriptor_cache.clear()
    got = run_gpu_problem(p, to_cupy)
    assert used_engine() == ("cudnn" if cudnn_version() >= 90000 else "cupy")
    assert_close(got, reference(p), TOL[F32], "eps 0")


@pytest.mark.parametrize(
    ("strides", "engine"), [(None, "cudnn"), (padded_strides((2, 3, 4, 5)), "cupy")]
)
def test_saved_statistics_are_used_as_given(strides, engine):
    """Saved statistics that are not the batch's give the formula's result with them."""
    p = make_gpu_problem((2, 3, 4, 5), strides, F32, F32, "saved_invstd")
    p.stats = {
        "saved_mean": p.stats["saved_mean"] + 0.25,
        "saved_invstd": p.stats["saved_invstd"] * 1.5,
    }
    cudnn_bn.descriptor_cache.clear()
    got = run_gpu_problem(p, to_cupy)
    assert used_engine() == engine
    assert_close(got, reference(p), TOL[F32], "shifted saved statistics")
    recomputed = run_gpu_problem(GpuProblem(p.x, p.dy, p.w, {}, "train"), to_cupy)
    assert not np.allclose(as_f64(got[0]), as_f64(recomputed[0]), rtol=1e-3, atol=1e-3)


# --- PyTorch's own cuDNN batch norm ----------------------------------------------------------

CUDNN_CASES = [
    pytest.param(shape, strides, dtype, channel_dtype, id=f"{shape}-{label}-{str(dtype)[6:]}")
    for dtype, channel_dtype in [(F16, F32), (F32, F32), (F64, F64)]
    for shape in SHAPES
    for label, strides in [("contiguous", None), ("channels_last", channels_last(shape))]
    if label == "contiguous" or len(shape) >= 4  # torch's memory formats: NHWC and NDHWC
]


@pytest.mark.parametrize(("shape", "strides", "dtype", "channel_dtype"), CUDNN_CASES)
def test_against_torch_cudnn_batch_norm_backward(shape, strides, dtype, channel_dtype):
    if not torch.backends.cudnn.is_available():
        pytest.skip("this torch has no cuDNN")
    p = make_gpu_problem(shape, strides, dtype, channel_dtype, "train")
    channels = shape[1]
    bias = torch.zeros(channels, dtype=channel_dtype, device="cuda")
    running_mean = torch.zeros(channels, dtype=channel_dtype, device="cuda")
    running_var = torch.ones(channels, dtype=channel_dtype, device="cuda")
    _, save_mean, save_invstd, reserve = torch.ops.aten.cudnn_batch_norm(
        p.x, p.w, bias, running_mean, running_var, True, 0.1, p.eps
    )
    expected = torch.ops.aten.cudnn_batch_norm_backward(
        p.x, p.dy, p.w, running_mean, running_var, save_mean, save_invstd, p.eps, reserve
    )
    saved = cudnn_bn.batch_norm_backward(
        p.x, p.dy, p.w, None, None, eps=p.eps, mode="saved",
        saved_mean=save_mean, saved_invstd=save_invstd,
    )  # fmt: skip
    recomputed = cudnn_bn.batch_norm_backward(p.x, p.dy, p.w, None, None, eps=p.eps)
    tol = TOL[dtype]
    assert_close(saved, expected, tol, "saved statistics vs aten.cudnn_batch_norm_backward")
    assert_close(recomputed, expected, tol, "train vs aten.cudnn_batch_norm_backward")


# --- torch tensors, CuPy streams -------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_torch_tensors_on_a_side_stream(layout):
    shape = (4, 8, 6, 6)
    strides = channels_last(shape) if layout == "channels_last" else None
    p = make_gpu_problem(shape, strides, F16, F32, "train")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = run_gpu_problem(p)
    stream.synchronize()
    for grad, like in zip(got, (p.x, p.w, p.w), strict=True):
        assert isinstance(grad, torch.Tensor)
        assert (grad.device, grad.dtype, grad.shape) == (like.device, like.dtype, like.shape)
    assert got[0].stride() == p.x.stride()  # the gradient keeps the input's layout
    assert_close(got, reference(p), TOL[F16], "torch tensors on a side stream")


def test_cupy_arrays_on_an_explicit_stream():
    p = make_gpu_problem((2, 3, 4, 5), None, F32, F32, "train")
    stream = cupy.cuda.Stream(non_blocking=True)
    got = run_gpu_problem(p, to_cupy, stream=stream)
    stream.synchronize()
    assert_close(got, reference(p), TOL[F32], "CuPy arrays on a non-blocking stream")


# --- the C API and the workspace ------------------------------------------------------------


def capi_tensor(a) -> ctypes.c_void_p:
    """An infiniop tensor descriptor for the CuPy array ``a``."""
    out, n = ctypes.c_void_p(), a.ndim
    shape = (ctypes.c_size_t * n)(*a.shape)
    strides = (ctypes.c_ssize_t * n)(*(s // a.itemsize for s in a.strides))
    status = capi.infiniopCreateTensorDescriptor(
        ctypes.byref(out), n, shape, strides, DATA_TYPES[a.dtype]
    )
    assert status == Status.SUCCESS, capi.last_error()
    return out


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in_place"])
def test_capi_with_device_pointers(in_place):
    """``in_place``: grad_input at grad_output's address, as InfiniCore's own tests run the
    backward (the C API takes that; cuDNN's result in place is proven only on a GPU)."""
    shape = (2, 3, 4, 5)
    p = make_gpu_problem(shape, None, F32, F32, "saved")
    inputs = [cupy.asarray(t) for t in (p.x, p.dy, p.w, *p.stats.values())]
    grad_input = inputs[1] if in_place else cupy.full(shape, cupy.nan, cupy.float32)
    grads = [grad_input, cupy.full(3, cupy.nan, cupy.float32), cupy.full(3, cupy.nan, cupy.float32)]
    cupy.cuda.Device().synchronize()  # the compute stream below does not wait for the default

    assert capi.infinirtSetDevice(Device.NVIDIA, 0) == Status.SUCCESS
    handle, desc, size = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
    assert capi.infiniopCreateHandle(ctypes.byref(handle)) == Status.SUCCESS
    tensors = [capi_tensor(a) for a in grads + inputs]
    status = capi.infiniopCreateBatchNormBackwardDescriptor(handle, ctypes.byref(desc), *tensors)
    assert status == Status.SUCCESS, capi.last_error()
    assert capi.infiniopSetBatchNormBackwardAttributes(desc, EPS, 1) == Status.SUCCESS
    status = capi.infiniopGetBatchNormBackwardWorkspaceSize(desc, ctypes.byref(size))
    assert status == Status.SUCCESS
    workspace = cupy.empty(max(size.value, 1), cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    pointers = [a.data.ptr for a in grads + inputs]

    status = capi.infiniopBatchNormBackward(
        desc, workspace.data.ptr, size.value, *pointers, stream.ptr
    )
    assert status == Status.SUCCESS, capi.last_error()
    stream.synchronize()
    assert_close(grads, reference(p), TOL[F32], "C API")

    for t in tensors:
        assert capi.infiniopDestroyTensorDescriptor(t) == Status.SUCCESS
    assert capi.infiniopDestroyBatchNormBackwardDescriptor(desc) == Status.SUCCESS
    assert capi.infiniopDestroyHandle(handle) == Status.SUCCESS


@pytest.mark.parametrize(
    ("mode", "channel_dtype", "engine"),
    [("train", F16, "cudnn"), ("eval", F32, "cupy")],  # both need workspace: staging, scratch
)
def test_small_workspace_leaves_outputs_untouched(mode, channel_dtype, engine):
    shape = (2, 3, 4, 5)
    p = make_gpu_problem(shape, None, F16, channel_dtype, mode)
    inputs = [cupy.asarray(t) for t in (p.x, p.dy, p.w, *p.stats.values())]
    w = inputs[2]
    grads = [cupy.full(shape, 7, cupy.float16), cupy.full(3, 7, w.dtype), cupy.full(3, 7, w.dtype)]
    arrays = grads + inputs
    descs = [TensorDesc(DATA_TYPES[a.dtype], a.shape, contiguous_strides(a.shape)) for a in arrays]
    pointers = [a.data.ptr for a in arrays]
    handle = cudnn_bn.Handle(Device.NVIDIA, 0)
    with BatchNormBackwardDescriptor(handle, *descs, eps=EPS, mode=mode) as desc:
        assert desc.engine == engine
        assert desc.workspace_size > 0
        workspace = cupy.zeros(desc.workspace_size, cupy.uint8)
        cupy.cuda.Device().synchronize()
        with pytest.raises(InsufficientWorkspaceError):
            desc.compute(workspace.data.ptr, desc.workspace_size - 1, *pointers, stream=0)
        cupy.cuda.Device().synchronize()
        for name, grad in zip(OUTPUTS, grads, strict=True):
            assert bool((grad == 7).all()), f"{name} was written"
        desc.compute(workspace.data.ptr, desc.workspace_size, *pointers, stream=0)
        cupy.cuda.Device().synchronize()
    assert_close(grads, reference(p), TOL[F16], "after a refused call")


@pytest.mark.parametrize("position", [0, 2, 5, -1])  # workspace, grad_input, input, stream
@pytest.mark.parametrize("bad", ["7", 1.5, True, -5, 1 << 64])
def test_compute_refuses_what_is_not_an_int_on_the_gpu(position, bad):
    """A device compute's address, size or stream that is not an int from 0 to 2**64 - 1 is
    BAD_PARAM naming it, before cuDNN or CuPy is called, outputs untouched (the host check
    of ``test_bad_inputs``, on both NVIDIA engines' descriptors)."""
    shape = (2, 3, 4, 5)
    p = make_gpu_problem(shape, None, F32, F32, "train")
    inputs = [cupy.asarray(t) for t in (p.x, p.dy, p.w, *p.stats.values())]
    grads = [cupy.full(shape, 7, cupy.float32), cupy.full(3, 7, cupy.float32)]
    grads.append(cupy.full(3, 7, cupy.float32))
    arrays = grads + inputs
    descs = [TensorDesc(DATA_TYPES[a.dtype], a.shape, contiguous_strides(a.shape)) for a in arrays]
    with BatchNormBackwardDescriptor(cudnn_bn.Handle(Device.NVIDIA, 0), *descs, eps=EPS) as desc:
        workspace = cupy.zeros(max(desc.workspace_size, 16), cupy.uint8)
        values = [workspace.data.ptr, desc.workspace_size, *(a.data.ptr for a in arrays), 0]
        values[position] = bad
        with pytest.raises(cudnn_bn.InfiniError) as caught:
            desc.compute(*values)
    cupy.cuda.Device().synchronize()
    assert caught.value.status == Status.BAD_PARAM
    assert all(bool((g == 7).all()) for g in grads), "an output was written"
