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
from cudnn_bn import batch_norm_backward, batch_norm_forward_inference, batch_norm_forward_training
from cudnn_bn.backends import cupy_kernels, nvidia
from cudnn_bn.ops import descriptor as descriptor_module

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
    (built,) = cudnn_bn.descriptor_cache._entries.values()
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
    wrong = cupy_kernels.SUMS | {"dy": "DY * 2"}
    monkeypatch.setattr(cupy_kernels, "SUMS", wrong)
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
