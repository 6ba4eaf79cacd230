"""The NVIDIA backend's engine choice, end to end through the array API, without a GPU.

The stub libcudnn (``cudnn_stub.py``) answers for cuDNN and the stand-in ``cupy``
(``cupy_on_host.py``) runs the CuPy engine's kernels on the host, so a problem the backend
routes to the CuPy engine is computed for real and checked against PyTorch in float64, and
one routed to cuDNN would only reach the stub. Torch CPU tensors go to the NVIDIA backend in
place of the CPU one.
"""

import gc

import numpy as np
import pytest
import torch
from helpers import assert_close, channels_last, f64, fused_problem, reference, torch_fused

import cudnn_bn
from cudnn_bn import batch_norm_backward, batch_norm_backward_batched
from cudnn_bn.api import batched_pass
from cudnn_bn.backends import cuda, nvidia
from cudnn_bn.backends.gather import DeviceGather
from cudnn_bn.ops import descriptor as descriptor_module

F16, F32 = torch.float16, torch.float32
HOST_STREAM_SCOPE = cuda.stream_scope  # the stub forbids CuPy; these tests run it on the host


@pytest.fixture(autouse=True)
def routed_on_host(stub, host_cupy, monkeypatch):
    """Host arrays go through the NVIDIA backend: cuDNN is the stub, CuPy runs on the host."""
    monkeypatch.setattr(descriptor_module, "backend_class", lambda _, op: getattr(nvidia, op))
    monkeypatch.setattr(cuda, "stream_scope", HOST_STREAM_SCOPE)
    return stub


def engines() -> list[str]:
    return [d.engine for d in cudnn_bn.descriptor_cache.descriptors()]


def channels_last_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, channels_last(tuple(t.shape)), dtype=t.dtype).copy_(t)


@pytest.mark.parametrize("gather", ["cpu", "device"])
@pytest.mark.parametrize("fusion", ["relu", "add_relu"])
def test_batched_fused_backward_runs_on_cupy(routed_on_host, fusion, gather, monkeypatch):
    """A batched fused backward has no reserve to give: cuDNN's fused kernels would refuse
    it (no ReLU mask), so it runs on the CuPy engine even where cuDNN takes the problem
    (F16 NHWC, C % 4 == 0, SPATIAL_PERSISTENT, saved statistics); its operands folded by
    either engine's gather (``backends.gather``: the device's kernel run on the host)."""
    if gather == "device":
        monkeypatch.setattr(batched_pass, "HostGather", DeviceGather)
    batch, shape = 2, (2, 8, 3, 5)
    problems = [fused_problem(shape, F16, F32, seed=b) for b in range(batch)]
    wants = [torch_fused(p, fusion) for p in problems]
    stacked = {
        n: torch.stack([channels_last_copy(p[n]) for p in problems])
        for n in ("input", "grad_output")
    }
    y = torch.stack([channels_last_copy(w[0].to(F16)) for w in wants])
    stats = [torch.ops.aten.native_batch_norm(f64(p["input"]), None, None, None, None,
                                              True, 0.0, 1e-5)[1:] for p in problems]  # fmt: skip
    mean, invstd = (torch.stack([s[i] for s in stats]).to(F32) for i in (0, 1))
    weight, bias = (torch.stack([p[n] for p in problems]) for n in ("weight", "bias"))
    got = batch_norm_backward_batched(
        stacked["input"], stacked["grad_output"], weight, None, None,
        mode="saved", saved_mean=mean, saved_invstd=invstd, fusion=fusion, output=y, bias=bias,
    )  # fmt: skip
    assert set(engines()) == {"cupy"}
    assert routed_on_host.backward.calls == 0
    names = ("grad_input", "grad_weight", "grad_bias", "grad_z")[: len(got)]
    for b, (_, want) in enumerate(wants):
        for name, g in zip(names, got, strict=True):
            assert_close(g[b], want[name], F16)


@pytest.mark.parametrize("shape", [(6, 3), (300, 4)], ids=str)
@pytest.mark.parametrize("mode", ["train", "saved"])
def test_2d_input_runs_on_cupy(routed_on_host, shape, mode):
    """PyTorch sends no 2-D input to cuDNN (PER_ACTIVATION; PR 57034): nor does cudnn_bn."""
    rng = np.random.default_rng(0)
    x, dy = (torch.from_numpy(rng.standard_normal(shape)).float() for _ in range(2))
    w = torch.from_numpy(rng.uniform(0.5, 1.5, shape[1])).float()
    running, ref = (None, None), {}
    if mode == "saved":
        mean, var = f64(x).mean(0).float(), f64(x).var(0, unbiased=False).float()
        running, ref = (mean, var), {"mean": mean, "var": var}
    got = batch_norm_backward(x, dy, w, *running, mode=mode)
    assert engines() == ["cupy"]
    assert routed_on_host.backward.calls == 0
    for g, r in zip(got, reference(x, dy, w, mode=mode, **ref), strict=True):
        assert_close(g, r, F32)


def test_closing_a_plans_descriptor_leaves_the_plan_its_cudnn_descriptors(routed_on_host):
    """A cached descriptor is public (``descriptor_cache.descriptors()``) and closes as a
    context manager (``with desc:``), which ``destroy()``'s refusal does not cover: the plan
    then ran cuDNN on destroyed descriptors (the stub refuses them). The plan holds its build
    until it is dropped, so it goes on; its descriptors close with it (found in review)."""
    rng = np.random.default_rng(0)
    x, dy = (torch.from_numpy(rng.standard_normal((2, 4, 3, 5))).float() for _ in range(2))
    w = torch.ones(4)
    cudnn_bn.descriptor_cache.clear()
    batch_norm_backward(x, dy, w, None, None)
    assert engines() == ["cudnn"]
    (desc,) = cudnn_bn.descriptor_cache.descriptors()
    with desc:
        pass
    batch_norm_backward(x, dy, w, None, None)
    assert routed_on_host.backward.calls == 2
    del desc
    cudnn_bn.descriptor_cache.clear()
    gc.collect()
    assert routed_on_host.live_tensors.value == 0
