"""The NVIDIA backend's CuPy engines, end to end, without a GPU, against PyTorch.

``cupy_on_host.py`` stands in for CuPy: the engines' own CUDA C++ kernels, compiled by g++,
run over host memory. Here the array API's torch CPU tensors go to the NVIDIA backend (in
place of the CPU one) with every problem sent to its CuPy engine, so everything the engines
do besides launching on a GPU runs: workspace slices, views of strided operands, dtype
conversions, BF16 as bits, the order of the passes, the running-statistics update, the fused
ReLU masks, the output mask. The references are PyTorch's, in float64, on the rounded values
the engines saw; tolerances are ``helpers.TOL`` (InfiniCore's). The ``gpu`` tests run the
same engines through CUDA.
"""

import numpy as np
import pytest
import torch
from helpers import (
    SHAPES,
    assert_close,
    channels_last,
    convert,
    f64,
    fused_problem,
    padded_strides,
    random_values,
    reference,
    tolerance_dtype,
    torch_fused,
    torch_inference,
    torch_training,
)

import cudnn_bn
from cudnn_bn import (
    DataType,
    TensorDesc,
    batch_norm_backward,
    batch_norm_forward_inference,
    batch_norm_forward_training,
)
from cudnn_bn.backends import cupy_reductions, nvidia
from cudnn_bn.ops import descriptor as descriptor_module
from cudnn_bn.tensor import contiguous_strides

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = [(F16, F32), (F16, F16), (BF16, F32), (BF16, BF16), (F32, F32), (F64, F64)]
LAYOUTS = {
    "contiguous": lambda shape: torch.empty(shape).stride(),
    "channels_last": channels_last,
    "padded": padded_strides,
}
DATA = ("input", "grad_output")
MODES = ["train", "saved", "saved_invstd", "eval"]


@pytest.fixture(autouse=True)
def cupy_engines_on_host(host_cupy, monkeypatch):
    """Host arrays run through the NVIDIA backend's CuPy engines, kernels on the host."""
    monkeypatch.setattr(descriptor_module, "backend_class", lambda _, op: getattr(nvidia, op))
    monkeypatch.setattr(nvidia, "cudnn_takes", lambda *args, **kwargs: False)


def laid_out(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """``tensor``'s values in a new tensor with the strides of ``layout`` (gaps included)."""
    strides = LAYOUTS[layout](tuple(tensor.shape))
    return torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype).copy_(tensor)


def statistics(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch mean and biased variance of ``x`` per channel, rounded to ``dtype``."""
    axes = [0, *range(2, x.dim())]
    return f64(x).mean(axes).to(dtype), f64(x).var(axes, unbiased=False).to(dtype)


# --- which engine ran ------------------------------------------------------------------------


def test_the_problems_here_run_on_the_cupy_engine():
    p = {n: convert(v, F32) for n, v in random_values((2, 3, 4, 5)).items()}
    batch_norm_backward(p["input"], p["grad_output"], p["weight"], None, None)
    (built,) = cudnn_bn.descriptor_cache.descriptors()
    assert built.handle.device == cudnn_bn.Device.CPU  # the array API's choice for host arrays
    assert built.engine == "cupy"
    assert built.workspace_size > 0  # per-channel scratch in the caller's (NumPy) workspace


# --- backward --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_backward_against_torch(mode, data, channel, shape, layout):
    values = random_values(shape)
    x = laid_out(convert(values["input"], data), layout)
    dy = laid_out(convert(values["grad_output"], data), layout)
    w = convert(values["weight"], channel)
    running = {"running_mean": None, "running_var": None}
    saved, ref = {}, {}
    if mode == "eval":
        running = {n: convert(values[n], channel) for n in running}
        ref = {"mean": running["running_mean"], "var": running["running_var"]}
    elif mode == "saved":
        mean, var = statistics(x, channel)
        running = {"running_mean": mean, "running_var": var}
        ref = {"mean": mean, "var": var}
    elif mode == "saved_invstd":
        stats_dtype = F32 if data in (F16, BF16) else data
        mean, var = statistics(x, F64)
        saved = {"saved_mean": mean.to(stats_dtype), "saved_invstd": (var + 1e-5).rsqrt()}
        saved["saved_invstd"] = saved["saved_invstd"].to(stats_dtype)
        ref = {"mean": saved["saved_mean"], "invstd": saved["saved_invstd"]}
    got = batch_norm_backward(x, dy, w, **running, mode="saved" if saved else mode, **saved)
    want = reference(x, dy, w, mode="saved" if saved else mode, **ref)
    tol = tolerance_dtype(data)
    for name, g, r in zip(("grad_input", "grad_weight", "grad_bias"), got, want, strict=True):
        assert g.dtype == (data if name == "grad_input" else channel), name
        assert_close(g, r, tol)
    if layout != "padded":  # grad_input takes a packed input's layout
        assert got[0].stride() == x.stride()


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, True), (False, False, True)])
@pytest.mark.parametrize(("data", "channel"), [(BF16, F32), (F32, F32)], ids=str)
def test_backward_output_mask(data, channel, mask):
    values = random_values((2, 3, 4, 5))
    p = {n: convert(v, data if n in DATA else channel) for n, v in values.items()}
    got = batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], None, None, output_mask=mask
    )
    want = reference(p["input"], p["grad_output"], p["weight"])
    for wanted, g, r in zip(mask, got, want, strict=True):
        if wanted:
            assert_close(g, r, tolerance_dtype(data))
        else:
            assert g is None


# --- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("running", [True, False], ids=["running", "no-running"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_training_forward_against_torch(data, channel, shape, layout, running):
    values = random_values(shape, bias=True)
    p = {n: convert(v, channel) for n, v in values.items()}
    p["input"] = laid_out(convert(values["input"], data), layout)
    want = torch_training(p, momentum=0.25)
    stats = (p["running_mean"], p["running_var"]) if running else (None, None)
    got = batch_norm_forward_training(p["input"], p["weight"], p["bias"], *stats, momentum=0.25)
    tol = tolerance_dtype(data)
    for actual, expected in zip((*got, *stats), want, strict=False):
        if actual is not None:
            assert_close(actual, expected, tol)
    if layout != "padded":
        assert got[0].stride() == p["input"].stride()
    assert got.reserve is None  # the CuPy engine keeps nothing for the backward


@pytest.mark.parametrize(("data", "channel"), [(F16, F32), (F32, F32), (F64, F64)], ids=str)
def test_a_constant_channel_with_eps_0_has_torchs_invstd_0(data, channel):
    """Batch statistics take torch's ``InvStd``: a channel of 0 variance with eps 0 has
    invstd 0, the output the bias and grad_input, grad_weight 0, in the forward and the
    train-mode backward (the formula's 1/sqrt(0) gave inf and NaN)."""
    values = random_values((3, 2, 4, 5), bias=True)
    values["input"][:, 1] = 3.25
    p = {n: convert(v, data if n in DATA else channel) for n, v in values.items()}
    y, _, invstd = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], None, None, eps=0.0
    )
    grads = batch_norm_backward(p["input"], p["grad_output"], p["weight"], None, None, eps=0.0)
    x64, w64 = f64(p["input"]), f64(p["weight"])
    want_y, mean, want_invstd = torch.ops.aten.native_batch_norm(
        x64, w64, f64(p["bias"]), None, None, True, 0.1, 0.0
    )
    want = torch.ops.aten.native_batch_norm_backward(
        f64(p["grad_output"]), x64, w64, None, None, mean, want_invstd, True, 0.0, [True] * 3
    )
    assert want_invstd[1] == 0 and invstd[1] == 0
    assert (f64(y[:, 1]) == f64(p["bias"].to(data))[1]).all()
    assert (grads[0][:, 1] == 0).all() and grads[1][1] == 0
    tol = tolerance_dtype(data)
    for got, expected in zip((y, *grads), (want_y, *want), strict=True):
        assert_close(got, expected, tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), DTYPES, ids=str)
def test_inference_forward_against_torch(data, channel, shape, layout):
    values = random_values(shape, bias=True)
    p = {n: convert(v, channel) for n, v in values.items()}
    p["input"] = laid_out(convert(values["input"], data), layout)
    names = ("input", "weight", "bias", "running_mean", "running_var")
    got = batch_norm_forward_inference(*(p[n] for n in names), eps=0.5)
    assert_close(got, torch_inference(p, eps=0.5), tolerance_dtype(data))


# --- fused -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("data", "channel"), [(F16, F32), (BF16, BF16), (F32, F32)], ids=str)
def test_fused_round_trip_against_torch(data, channel, shape, fusion):
    p = fused_problem(shape, data, channel)
    want_y, want = torch_fused(p, fusion)
    z = p["z"] if fusion == "add_relu" else None
    out = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], None, None, fusion=fusion, z=z
    )
    tol = tolerance_dtype(data)
    assert_close(out[0], want_y, tol)
    grads = batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], None, None,
        mode="saved", saved_mean=out[1], saved_invstd=out[2],
        fusion=fusion, output=out[0], bias=p["bias"], reserve=out.reserve,
    )  # fmt: skip
    names = ("grad_input", "grad_weight", "grad_bias", "grad_z")[: len(grads)]
    assert len(grads) == (4 if fusion == "add_relu" else 3)
    for name, got in zip(names, grads, strict=True):
        assert_close(got, want[name], tol)


def test_a_wrong_kernel_result_fails_here(monkeypatch):
    """The stand-in runs the kernels' real bodies: a wrong one gives a wrong gradient."""
    wrong = cupy_reductions.SUMS | {"dy": "g * 2"}
    monkeypatch.setattr(cupy_reductions, "SUMS", wrong)
    p = {n: convert(v, F32) for n, v in random_values((2, 3, 4)).items()}
    got = batch_norm_backward(p["input"], p["grad_output"], p["weight"], None, None)
    want = reference(p["input"], p["grad_output"], p["weight"])
    assert not np.allclose(f64(got[2]).numpy(), f64(want[2]).numpy(), rtol=1e-3)
    np.testing.assert_allclose(f64(got[2]).numpy(), 2 * f64(want[2]).numpy(), rtol=1e-5)


# --- NaN through the fused ReLU --------------------------------------------------------------


@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
@pytest.mark.parametrize(("data", "channel"), [(F32, F32), (BF16, F32)], ids=str)
def test_fused_relu_propagates_nan_as_torch(data, channel, fusion):
    """``relu(NaN)`` is NaN (torch; cuDNN with CUDNN_PROPAGATE_NAN), and its gradient passes
    ``dy`` where ``y`` is NaN (torch's threshold_backward zeroes only ``y <= 0``)."""
    p = fused_problem((2, 3, 4, 5), data, channel)
    if fusion == "relu":
        p["input"][1, 2, 3, 4] = float("nan")  # every output of channel 2 is NaN
    else:
        p["z"][1, 0, 2, 3] = float("nan")  # one output is NaN
    want_y, want = torch_fused(p, fusion)
    z = p["z"] if fusion == "add_relu" else None
    out = batch_norm_forward_training(
        p["input"], p["weight"], p["bias"], None, None, fusion=fusion, z=z
    )
    tol = {"atol": 1e-2, "rtol": 1e-2} if data == BF16 else {"atol": 2e-5, "rtol": 2e-5}
    assert want_y.isnan().any()
    torch.testing.assert_close(f64(out[0]), want_y, equal_nan=True, **tol)
    grads = batch_norm_backward(
        p["input"], p["grad_output"], p["weight"], None, None,
        mode="saved", saved_mean=out[1], saved_invstd=out[2],
        fusion=fusion, output=out[0], bias=p["bias"], reserve=out.reserve,
    )  # fmt: skip
    names = ("grad_input", "grad_weight", "grad_bias", "grad_z")[: len(grads)]
    for name, got in zip(names, grads, strict=True):
        torch.testing.assert_close(f64(got), want[name], equal_nan=True, **tol)


# --- the per-channel sums: accuracy and launch shapes ----------------------------------------

LONG = (1000, 2, 10_000)  # 10^7 values per channel


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_sums_over_ten_million_values_per_channel(host_cupy, layout):
    """Mean, variance and the backward's sums over 10^7 F32 values per channel, against
    PyTorch in float64: double accumulation about a shift, so a large mean (100, deviation 1)
    costs nothing (F32 accumulation of 10^7 such values is off in the third digit)."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(LONG, np.float32) + np.float32(100.0))
    dy = torch.from_numpy(rng.standard_normal(LONG, np.float32))
    if layout == "channels_last":
        x, dy = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, dy))
    w, b = torch.full((2,), 1.5), torch.full((2,), 0.25)
    out = batch_norm_forward_training(x, w, b, None, None)
    _, mean, invstd = torch.ops.aten.native_batch_norm(
        f64(x), None, None, None, None, True, 0.0, 1e-5
    )
    torch.testing.assert_close(f64(out[1]), mean, rtol=2e-7, atol=0)
    torch.testing.assert_close(f64(out[2]), invstd, rtol=3e-7, atol=0)
    grads = batch_norm_backward(x, dy, w, None, None)
    want = reference(x, dy, w)
    for got, expected in zip(grads, want, strict=True):
        assert_close(got, expected, F32)
    for got, expected in zip(grads[1:], want[1:], strict=True):  # sums of a few thousand
        torch.testing.assert_close(f64(got), expected, rtol=1e-6, atol=1e-3)


def sums_launches(launches: list) -> list[tuple]:
    """The stage-1 launches of the per-channel sums: (grid, block)."""
    return [(g, b) for name, g, b in launches if name.startswith("cudnn_bn_sums_")
            and not name.endswith("_finish")]  # fmt: skip


@pytest.mark.parametrize(
    ("small", "large", "block"),
    [
        ((2**12, 16), (2**15, 16), (16, 16, 1)),  # (N, C): channels adjacent, 16 per block
        ((2, 64, 8, 8), (16, 64, 8, 8), (32, 8, 1)),  # NHWC
        ((8, 4, 32, 32), (64, 4, 32, 32), (1, 256, 1)),  # NCHW
    ],
    ids=["NC", "NHWC", "NCHW"],
)
def test_sums_grid_grows_with_the_reduced_size(host_cupy, small, large, block):
    """Each pass reads its data once (one stage-1 launch), on a grid of (channel tiles,
    chunks) whose chunk count follows the values per channel, not the channel count."""
    grids = []
    for shape in (small, large):
        values = random_values(shape)
        x, dy = (convert(values[n], F32) for n in DATA)
        if block[0] == 32:
            x, dy = (laid_out(t, "channels_last") for t in (x, dy))
        w = convert(values["weight"], F32)
        host_cupy.launches.clear()
        batch_norm_backward(x, dy, w, None, None)
        ((grid, launched),) = sums_launches(host_cupy.launches)  # mean, var and both sums
        assert launched == block
        assert grid[0] == -(-shape[1] // block[0])
        grids.append(grid)
        host_cupy.launches.clear()
        batch_norm_forward_training(x, w, w, None, None)
        assert len(sums_launches(host_cupy.launches)) == 1
    assert grids[1][1] >= 4 * grids[0][1] > 1  # 8x the values: about 8x the chunks


ISSUE_SHAPES = {  # (shape, strides): the shapes the old one-block-per-channel grid starved
    "NHWC (64, 64, 112, 112)": ((64, 64, 112, 112), channels_last((64, 64, 112, 112))),
    "NCHW (64, 64, 112, 112)": ((64, 64, 112, 112), None),
    "(10^6, 16)": ((10**6, 16), None),
}


@pytest.mark.parametrize(("shape", "strides"), ISSUE_SHAPES.values(), ids=list(ISSUE_SHAPES))
def test_sums_plan_fills_a_gpu(shape, strides):
    """Thousands of blocks, and no thread adding more than 64 values in a row."""
    x = TensorDesc(DataType.F32, shape, strides or contiguous_strides(shape))
    plan = cupy_reductions.plan([x, x])
    assert plan.grid[0] * plan.grid[1] >= 2048
    assert -(-plan.chunk // plan.block[1]) <= 64
    assert plan.block[0] * plan.block[1] == cupy_reductions.THREADS
    assert not plan.wide


def test_sums_plan_indexes_in_64_bits_past_2_to_the_31():
    x = TensorDesc.contiguous(DataType.F16, (2**16, 2**15 + 1))
    assert cupy_reductions.plan([x]).wide


# --- the stand-in's raw kernels: CUDA's block semantics --------------------------------------


def test_raw_kernel_threads_meet_at_barriers(host_cupy):
    code = r"""extern "C" __global__ void rotate(float *out) {
        __shared__ float seen[8];
        seen[threadIdx.x] = (float)(blockIdx.x * 10 + threadIdx.x);
        __syncthreads();
        out[blockIdx.x * blockDim.x + threadIdx.x] = seen[(threadIdx.x + 1) % blockDim.x];
    }"""
    out = np.zeros(16, np.float32)
    host_cupy.RawKernel(code, "rotate")((2,), (8,), (out,))
    want = [b * 10 + (t + 1) % 8 for b in range(2) for t in range(8)]
    np.testing.assert_array_equal(out, np.array(want, np.float32))


def test_raw_kernel_divergent_barrier_is_an_error(host_cupy):
    code = r"""extern "C" __global__ void diverge(float *out) {
        if (threadIdx.x == 0) __syncthreads();
        out[threadIdx.x] = 1.0f;
    }"""
    with pytest.raises(AssertionError, match="diverged"):
        host_cupy.RawKernel(code, "diverge")((1,), (4,), (np.zeros(4, np.float32),))
