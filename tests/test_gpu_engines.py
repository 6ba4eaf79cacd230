"""The NVIDIA backend's engine choices, the CuPy engine's sums, NaN and the overflow check,
on a real GPU.

Every test is marked ``gpu`` and skipped, with the reason, where there is no usable GPU
(``tests/conftest.py``). Each confirms on the device what a host test shows on stand-ins:
``test_nvidia_routing_on_host.py`` (batched fused backward, 2-D input),
``test_nvidia_arguments.py`` (the backward's workspace query, its mode with and without
saved statistics and reserve), ``test_cupy_engines_on_host.py``
(the per-channel sums, NaN through the fused ReLU) and ``test_overflow_check.py``.

References are PyTorch on CUDA in float64 on the very values the engines saw, with cuDNN
switched off so that PyTorch's own kernels are the judge.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cudnn_bn
from cudnn_bn import (
    batch_norm_backward,
    batch_norm_backward_batched,
    batch_norm_forward_training,
    cupyx_compat,
)

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
EPS = 1e-5
TOL = {F16: 1e-2, BF16: 1e-2, F32: 2e-5}  # InfiniCore's, as in test_gpu.py
PERSISTENT_F32_TOL = 1e-4  # cuDNN's SPATIAL_PERSISTENT kernels (see test_gpu_forward.py)


def engines() -> list[str]:
    """The engines of the cached descriptors, oldest first (clear the cache before)."""
    return [d.engine for d in cudnn_bn.descriptor_cache.descriptors()]


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def close(actual, expected: torch.Tensor, tol: float, what: str, equal_nan=False) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual).double(), expected, rtol=tol, atol=tol, equal_nan=equal_nan,
        msg=lambda m: f"{what}: {m}",
    )  # fmt: skip


def autograd(x, w, b, dy, fusion=None, z=None):
    """float64 ``y = act(bn(x) [+ z])`` in training mode and its gradients by name."""
    leaves = {"input": x, "weight": w, "bias": b} | ({"z": z} if z is not None else {})
    leaves = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    with torch.backends.cudnn.flags(enabled=False):
        y = F.batch_norm(leaves["input"], None, None, leaves["weight"], leaves["bias"],
                         training=True, eps=EPS)  # fmt: skip
        if fusion is not None:
            y = torch.relu(y + leaves["z"] if z is not None else y)
        y.backward(dy.double())
    return y.detach(), {f"grad_{n}": t.grad for n, t in leaves.items()}


def saved_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 batch mean and 1/sqrt(biased var + eps) per channel."""
    axes = [0, *range(2, x.ndim)]
    x64 = x.double()
    return x64.mean(axes), torch.rsqrt(x64.var(axes, correction=0) + EPS)


# --- routing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
def test_batched_fused_backward_of_a_cudnn_problem(fusion):
    """F16 NHWC with C % 4 == 0 is cuDNN's fused problem, but a batched backward has no
    reserve (cuDNN's ReLU mask) to give: it runs on the CuPy engine and matches autograd."""
    torch.manual_seed(0)
    batch, shape = 3, (4, 8, 6, 6)
    x = (torch.randn(batch, *shape, device="cuda", dtype=F64) * 2 + 0.5).to(F16)
    dy = torch.randn(batch, *shape, device="cuda", dtype=F64).to(F16)
    z = torch.randn(batch, *shape, device="cuda", dtype=F64).to(F16)
    w = torch.rand(batch, shape[1], device="cuda") + 0.5
    b = torch.randn(batch, shape[1], device="cuda") * 0.5
    references = [
        autograd(x[i], w[i], b[i], dy[i], fusion, z[i] if fusion == "add_relu" else None)
        for i in range(batch)
    ]

    def nhwc(t: torch.Tensor) -> torch.Tensor:  # each problem channels-last
        return t.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)

    y = nhwc(torch.stack([r[0] for r in references]).to(F16))
    stats = [saved_statistics(x[i]) for i in range(batch)]
    mean, invstd = (torch.stack([s[k] for s in stats]).float() for k in (0, 1))
    cudnn_bn.descriptor_cache.clear()
    got = batch_norm_backward_batched(
        nhwc(x), nhwc(dy), w, None, None, mode="saved", saved_mean=mean, saved_invstd=invstd,
        fusion=fusion, output=y, bias=b,
    )  # fmt: skip
    assert set(engines()) == {"cupy"}
    names = ("grad_input", "grad_weight", "grad_bias", "grad_z")[: len(got)]
    for i, (_, want) in enumerate(references):
        for name, g in zip(names, got, strict=True):
            close(g[i], want[name], TOL[F16], f"problem {i} {name}")


@pytest.mark.parametrize("n", [16, 131071, 880801])
def test_2d_input_runs_on_the_cupy_engine(n):
    """PyTorch sends no 2-D input to cuDNN (PER_ACTIVATION: slow, and refused by older cuDNN
    above N = 131070); neither does cudnn_bn, up to PyTorch's old limit and past it."""
    torch.manual_seed(1)
    x = (torch.randn(n, 4, device="cuda", dtype=F64) * 2 + 0.5).float()
    dy = torch.randn(n, 4, device="cuda", dtype=F64).float()
    w, b = torch.rand(4, device="cuda") + 0.5, torch.randn(4, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    y, _, _ = batch_norm_forward_training(x, w, b, None, None)
    grads = batch_norm_backward(x, dy, w, None, None)
    assert engines() == ["cupy", "cupy"]
    want_y, want = autograd(x, w, b, dy)
    close(y, want_y, TOL[F32], "output")
    for name, g in zip(("grad_input", "grad_weight", "grad_bias"), grads, strict=True):
        close(g, want[name], TOL[F32], name)


def test_cupy_engine_gives_a_constant_channel_with_eps_0_torchs_invstd_0():
    """The CuPy engine's batch statistics take torch's ``InvStd`` on the device, as
    ``test_cupy_engines_on_host.py`` shows on the host: a channel of zero variance with eps
    0 has invstd 0, its output the bias, its grad_input and grad_weight 0, as torch's own
    CUDA kernels give (cuDNN off)."""
    x = torch.randn(64, 3, device="cuda", dtype=F64).float()
    x[:, 1] = 3.25
    dy = torch.randn(64, 3, device="cuda", dtype=F64).float()
    w, b = torch.rand(3, device="cuda") + 0.5, torch.randn(3, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    y, _, invstd = batch_norm_forward_training(x, w, b, None, None, eps=0.0)
    gi, gw, gb = batch_norm_backward(x, dy, w, None, None, eps=0.0)
    assert engines() == ["cupy", "cupy"]
    with torch.backends.cudnn.flags(enabled=False):
        want_y, _, want_invstd = torch.ops.aten.native_batch_norm(
            x.double(), w.double(), b.double(), None, None, True, 0.1, 0.0
        )
    assert float(want_invstd[1]) == 0 and float(torch.as_tensor(invstd)[1]) == 0
    close(y, want_y, TOL[F32], "output")
    assert (torch.as_tensor(gi)[:, 1] == 0).all() and float(torch.as_tensor(gw)[1]) == 0
    close(gb, dy.double().sum(0), TOL[F32], "grad_bias")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_cudnn_backward_sized_with_x_as_y(layout, dtype):
    """The backward's workspace query gets x's descriptor as yDesc (PyTorch's and CuPy 13's
    call); real cuDNN sizes and runs it (SPATIAL and SPATIAL_PERSISTENT)."""
    torch.manual_seed(2)
    shape = (4, 8, 6, 6)
    x = (torch.randn(shape, device="cuda", dtype=F64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=F64).to(dtype)
    if layout == "channels_last":
        x, dy = channels_last(x), channels_last(dy)
    w, b = torch.rand(8, device="cuda") + 0.5, torch.zeros(8, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    grads = batch_norm_backward(x, dy, w, None, None)
    assert engines() == ["cudnn"]
    _, want = autograd(x, w, b, dy)
    for name, g in zip(("grad_input", "grad_weight", "grad_bias"), grads, strict=True):
        close(g, want[name], TOL[dtype], name)  # train mode: SPATIAL, even channels-last


@pytest.mark.parametrize("shape", [(4, 8, 6, 6), (2, 8, 3, 4, 5)], ids=["NHWC", "NDHWC"])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_persistent_backward_only_from_saved_statistics_and_reserve(shape, dtype):
    """Findings 1 and 2 on real cuDNN: the README's channels-last train-mode backward (no
    saved statistics) runs in SPATIAL, and so does one from saved statistics given no
    reserve; with the forward's reserve it runs in SPATIAL_PERSISTENT. All match PyTorch."""
    torch.manual_seed(7)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = (torch.randn(shape, device="cuda", dtype=F64) * 2 + 0.5).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=F64).to(dtype)
    x, dy = x.contiguous(memory_format=fmt), dy.contiguous(memory_format=fmt)
    w, b = torch.rand(8, device="cuda") + 0.5, torch.zeros(8, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    out = batch_norm_forward_training(x, w, b, None, None)
    saved = {"mode": "saved", "saved_mean": out[1], "saved_invstd": out[2]}
    _, want = autograd(x, w, b, dy)
    calls = {
        "train": (batch_norm_backward(x, dy, w, None, None), TOL[dtype]),
        "saved, no reserve": (batch_norm_backward(x, dy, w, None, None, **saved), TOL[dtype]),
        "saved, reserve": (
            batch_norm_backward(x, dy, w, None, None, **saved, reserve=out.reserve),
            PERSISTENT_F32_TOL if dtype == F32 else TOL[dtype],
        ),
    }
    assert engines() == ["cudnn"] * 4
    modes = [d._kernel.bn_mode for d in cudnn_bn.descriptor_cache._entries.values()][1:]
    assert [m.name for m in modes] == ["SPATIAL", "SPATIAL", "SPATIAL_PERSISTENT"]
    for how, (grads, tol) in calls.items():
        for name, g in zip(("grad_input", "grad_weight", "grad_bias"), grads, strict=True):
            close(g, want[name], tol, f"{how}: {name}")


# --- the CuPy engine's per-channel sums ------------------------------------------------------


def test_cupy_engine_sums_over_ten_million_values_per_channel():
    """10^7 F32 values per channel, mean 100: the two-stage sums in double match float64."""
    torch.manual_seed(3)
    shape = (1000, 2, 10_000)
    padded = torch.empty(1000, 2, 10_001, device="cuda")  # not packed: the CuPy engine
    x, dy = padded[..., :10_000], torch.empty_like(padded)[..., :10_000]
    x.copy_(torch.randn(shape, device="cuda") + 100)
    dy.copy_(torch.randn(shape, device="cuda"))
    w, b = torch.full((2,), 1.5, device="cuda"), torch.full((2,), 0.25, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    out = batch_norm_forward_training(x, w, b, None, None)
    grads = batch_norm_backward(x, dy, w, None, None)
    assert engines() == ["cupy", "cupy"]
    mean, invstd = saved_statistics(x)
    torch.testing.assert_close(out[1].double(), mean, rtol=2e-7, atol=0)
    torch.testing.assert_close(out[2].double(), invstd, rtol=3e-7, atol=0)
    _, want = autograd(x, w, b, dy)
    close(grads[0], want["grad_input"], TOL[F32], "grad_input")
    for name, g in zip(("grad_weight", "grad_bias"), grads[1:], strict=True):
        torch.testing.assert_close(g.double(), want[name], rtol=1e-6, atol=1e-3)


def test_cupy_engine_keeps_up_with_torch_on_nhwc_bf16():
    """BF16 NHWC (128, 64, 112, 112), all on the CuPy engine: within 8x of PyTorch's own
    kernels per training forward (the old one-block-per-channel sums took far longer)."""
    x = channels_last(torch.randn(128, 64, 112, 112, device="cuda", dtype=BF16))
    w, b = torch.ones(64, device="cuda"), torch.zeros(64, device="cuda")

    def ours():
        batch_norm_forward_training(x, w, b, None, None)

    def theirs():
        F.batch_norm(x, None, None, w, b, training=True, eps=EPS)

    def time(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10

    cudnn_bn.descriptor_cache.clear()
    mine, torch_ms = time(ours), time(theirs)
    assert engines() == ["cupy"]
    assert mine < 8 * torch_ms, f"cudnn_bn {mine:.3f} ms, torch {torch_ms:.3f} ms"


# --- NaN through the fused ReLU ---------------------------------------------------------------

NAN_CASES = [  # (dtype, layout, engine)
    pytest.param(F16, "channels_last", "cudnn", id="F16-NHWC-cudnn"),
    pytest.param(F32, "channels_last", "cupy", id="F32-NHWC-cupy"),
    pytest.param(BF16, "contiguous", "cupy", id="BF16-NCHW-cupy"),
]


@pytest.mark.parametrize(("dtype", "layout", "engine"), NAN_CASES)
def test_fused_relu_propagates_nan(dtype, layout, engine):
    """relu(NaN) is NaN in torch, in cuDNN (CUDNN_PROPAGATE_NAN) and in the CuPy engine; the
    CuPy engine's backward passes dy where y is NaN, as torch's threshold_backward does."""
    torch.manual_seed(4)
    shape = (4, 8, 6, 6)
    x = (torch.randn(shape, device="cuda", dtype=F64) * 2 + 0.5).to(dtype)
    z = torch.randn(shape, device="cuda", dtype=F64).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=F64).to(dtype)
    z[1, 2, 3, 4] = float("nan")
    if layout == "channels_last":
        x, z, dy = channels_last(x), channels_last(z), channels_last(dy)
    w, b = torch.rand(8, device="cuda") + 0.5, torch.randn(8, device="cuda") * 0.5
    want_y, want = autograd(x, w, b, dy, "add_relu", z)
    cudnn_bn.descriptor_cache.clear()
    out = batch_norm_forward_training(x, w, b, None, None, fusion="add_relu", z=z)
    assert engines() == [engine]
    assert torch.isnan(out[0][1, 2, 3, 4]) and int(torch.isnan(out[0]).sum()) == 1
    tol = TOL[dtype]
    close(out[0], want_y, tol, "output", equal_nan=True)
    if engine == "cupy":
        grads = batch_norm_backward(
            x, dy, w, None, None, mode="saved", saved_mean=out[1], saved_invstd=out[2],
            fusion="add_relu", output=out[0], bias=b, reserve=out.reserve,
        )  # fmt: skip
        names = ("grad_input", "grad_weight", "grad_bias", "grad_z")
        for name, g in zip(names, grads, strict=True):
            close(g, want[name], tol, name, equal_nan=True)


# --- the overflow check -----------------------------------------------------------------------


def test_check_overflow_on_persistent_passes():
    """Real cuDNN answers cudnnQueryRuntimeError after SPATIAL_PERSISTENT passes; ordinary
    data raises no overflow warning, and the results are unchanged."""
    torch.manual_seed(5)
    shape = (4, 8, 6, 6)
    x = channels_last((torch.randn(shape, device="cuda", dtype=F64) * 2 + 0.5).to(F16))
    dy = channels_last(torch.randn(shape, device="cuda", dtype=F64).to(F16))
    w, b = torch.rand(8, device="cuda") + 0.5, torch.zeros(8, device="cuda")
    cudnn_bn.descriptor_cache.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = batch_norm_forward_training(x, w, b, None, None, check_overflow=True)
        grads = batch_norm_backward(
            x, dy, w, None, None, mode="saved", saved_mean=out[1], saved_invstd=out[2],
            reserve=out.reserve, check_overflow=True,
        )  # fmt: skip
    assert engines() == ["cudnn", "cudnn"]
    want_y, want = autograd(x, w, b, dy)
    close(out[0], want_y, TOL[F16], "output")
    for name, g in zip(("grad_input", "grad_weight", "grad_bias"), grads, strict=True):
        close(g, want[name], TOL[F16], name)


def test_cupyx_compat_debug_on_a_persistent_pass():
    """CuPy 13's debug=True with SPATIAL_PERSISTENT: the query runs, no warning for ordinary
    data, and the results are those without debug."""
    rng = np.random.default_rng(6)
    x = cupy.asarray(rng.standard_normal((4, 6, 6, 8)).astype(np.float16))  # NHWC
    gamma, beta = cupy.ones(8, cupy.float32), cupy.zeros(8, cupy.float32)
    mode, nhwc = cupyx_compat.CUDNN_BATCHNORM_SPATIAL_PERSISTENT, cupyx_compat.CUDNN_TENSOR_NHWC
    results = []
    for debug in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            results.append(
                cupyx_compat.batch_normalization_forward_training(
                    x, gamma, beta, None, None, None, None, EPS, 0.9, True, mode, debug, nhwc
                )
            )
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(a), cupy.asnumpy(b), rtol=1e-3, atol=1e-3)


def test_cupyx_compat_reads_cupy_views_of_any_strides_and_returns_c_contiguous():
    """On CuPy arrays, as ``test_cupyx_compat.py`` shows on NumPy ones: a reversed x, a
    broadcast gamma and a (1, C) mean/inv_std are taken as CuPy 13 took them, the results
    equal those of packed copies, and y and gx are C-contiguous for an NCHW-shaped x with
    channels-last strides (cuDNN's own results, copied)."""
    rng = np.random.default_rng(7)
    packed = cupy.asarray(rng.standard_normal((4, 8, 5, 6)).astype(np.float32))
    gy = cupy.asarray(rng.standard_normal(packed.shape).astype(np.float32))
    gamma, beta = cupy.ones(8, cupy.float32), cupy.zeros(8, cupy.float32)
    spatial = cupyx_compat.CUDNN_BATCHNORM_SPATIAL
    tail = (EPS, 0.9, True, spatial, False)
    y_want, mean, inv_std = cupyx_compat.batch_normalization_forward_training(
        packed, gamma, beta, None, None, None, None, *tail
    )
    gx_want = cupyx_compat.batch_normalization_backward(
        packed, gamma, gy, mean, inv_std, EPS, True, spatial, False
    )[0]
    reversed_x = cupy.ascontiguousarray(packed[::-1])[::-1]  # the same values, stride < 0
    broadcast = cupy.broadcast_to(cupy.float32(1), (8,))
    mean2, inv_std2 = cupy.empty((1, 8), cupy.float32), cupy.empty((1, 8), cupy.float32)
    y = cupyx_compat.batch_normalization_forward_training(
        reversed_x, broadcast, beta, None, None, mean2, inv_std2, *tail
    )  # y alone where mean/inv_std are given, as CuPy 13
    close = np.testing.assert_allclose
    close(cupy.asnumpy(y), cupy.asnumpy(y_want), rtol=1e-6, atol=1e-6)
    close(cupy.asnumpy(mean2).ravel(), cupy.asnumpy(mean), rtol=1e-6, atol=1e-6)
    channels_last = cupy.ascontiguousarray(packed.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    y = cupyx_compat.batch_normalization_forward_training(
        channels_last, gamma, beta, None, None, None, None, *tail
    )[0]
    gx = cupyx_compat.batch_normalization_backward(
        channels_last, gamma, gy, mean, inv_std, EPS, True, spatial, False
    )[0]
    assert y.flags.c_contiguous and gx.flags.c_contiguous
    close(cupy.asnumpy(y), cupy.asnumpy(y_want), rtol=1e-5, atol=1e-5)
    close(cupy.asnumpy(gx), cupy.asnumpy(gx_want), rtol=1e-4, atol=1e-4)
