"""Problems with no values per channel (N = 0, or any zero dimension other than C) through
the descriptors and the C API of all three operators (issue 16, finding 14), against
PyTorch CPU float64: ``torch.nn.functional.batch_norm`` and its autograd.

PyTorch returns an empty output, leaves the running statistics unchanged, returns
``at::empty`` saved statistics (never written: so here saved_mean/saved_invstd are left as
they are) and zero grad_weight/grad_bias. The zeros respect the outputs' strides; on NVIDIA
they are queued on the call's stream (``cudaMemsetAsync``, recorded by ``FakeCupy``) with no
backend kernel built. C = 0 stays refused (torch's affine batch norm refuses it too).
"""

import ctypes
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fake_devices import FakeCupy
from helpers import ok

import cudnn_bn
from cudnn_bn import (
    BatchNormBackwardDescriptor,
    BatchNormForwardTrainingDescriptor,
    DataType,
    Device,
    Status,
    TensorDesc,
    capi,
)
from cudnn_bn.backends import cuda

EMPTY_SHAPES = [(0, 3), (0, 3, 4), (2, 3, 0), (0, 3, 2, 2), (2, 3, 1, 0, 2)]
C = 3
CAPI_DTYPE = {np.dtype(np.float32): DataType.F32, np.dtype(np.float64): DataType.F64}
ORDERS = {
    "BatchNormBackward": (
        "grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight",
        "running_mean", "running_var",
    ),
    "BatchNormForwardTraining": (
        "output", "saved_mean", "saved_invstd", "input", "weight", "bias", "running_mean",
        "running_var",
    ),
    "BatchNormForwardInference": (
        "output", "input", "weight", "bias", "running_mean", "running_var",
    ),
}  # fmt: skip
SIZES = {"BatchNormForwardTraining": 2}  # workspace and reserve; the others: workspace


def torch_empty_batch(shape, training: bool) -> dict[str, torch.Tensor]:
    """What torch gives for an empty batch, float64: output, grad_input, grad_weight,
    grad_bias (autograd of a sum), and the running statistics after the call."""
    rng = np.random.default_rng(0)
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(rng.uniform(0.5, 1.5, C), requires_grad=True)
    b = torch.tensor(rng.standard_normal(C), requires_grad=True)
    rm, rv = torch.tensor(RUNNING_MEAN), torch.tensor(RUNNING_VAR)
    y = F.batch_norm(x, rm, rv, w, b, training=training, momentum=0.1, eps=1e-5)
    y.sum().backward()
    return {
        "output": y.detach(),
        "grad_input": x.grad,
        "grad_weight": w.grad,
        "grad_bias": b.grad,
        "running_mean": rm,
        "running_var": rv,
    }


RUNNING_MEAN, RUNNING_VAR = np.array([0.5, -1.0, 2.0]), np.array([1.5, 0.25, 3.0])


class Channel:
    """A ``(C,)`` operand with stride 2 inside a NaN-filled buffer: the elements between
    must stay NaN."""

    def __init__(self, dtype, values=None) -> None:
        self.base = np.full(2 * C, np.nan, dtype)
        self.view = self.base[::2]
        if values is not None:
            self.view[...] = values


def arrays(operator: str, shape, dtype) -> dict:
    """The operator's operands by name; per-channel ones with stride 2, NaN where unset."""
    values = {
        "weight": np.array([1.0, 0.5, 2.0]),
        "bias": np.array([0.1, 0.2, 0.3]),
        "running_mean": RUNNING_MEAN,
        "running_var": RUNNING_VAR,
    }
    found = {}
    for name in ORDERS[operator]:
        if name in ("input", "grad_output", "grad_input", "output"):
            found[name] = np.zeros(shape, dtype)
        else:
            found[name] = Channel(dtype, values.get(name))
    return found


def desc(array) -> ctypes.c_void_p:
    view = array.view if isinstance(array, Channel) else array
    strides = [s // view.itemsize for s in view.strides]
    out = ctypes.c_void_p()
    ok(
        capi.infiniopCreateTensorDescriptor(
            ctypes.byref(out), view.ndim, list(view.shape), strides, CAPI_DTYPE[view.dtype]
        )
    )
    return out


def capi_run(operator: str, found: dict, attributes: tuple, *, null_data: bool) -> None:
    """The whole C-API cycle; empty data operands passed as NULL when ``null_data``."""
    handle, op = ctypes.c_void_p(), ctypes.c_void_p()
    ok(capi.infiniopCreateHandle(ctypes.byref(handle)))
    order = ORDERS[operator]
    descs = [desc(found[n]) for n in order]
    ok(getattr(capi, f"infiniopCreate{operator}Descriptor")(handle, ctypes.byref(op), *descs))
    for d in descs:
        ok(capi.infiniopDestroyTensorDescriptor(d))
    ok(getattr(capi, f"infiniopSet{operator}Attributes")(op, *attributes))
    size = ctypes.c_size_t(7)
    ok(getattr(capi, f"infiniopGet{operator}WorkspaceSize")(op, ctypes.byref(size)))
    assert size.value == 0
    pointers = []
    for name in order:
        a = found[name]
        if isinstance(a, Channel):
            pointers.append(a.view.ctypes.data)
        else:
            pointers.append(0 if null_data else a.ctypes.data)
    buffers = (None, 0) * SIZES.get(operator, 1)
    ok(getattr(capi, f"infiniop{operator}")(op, *buffers, *pointers, None))
    ok(getattr(capi, f"infiniopDestroy{operator}Descriptor")(op))
    ok(capi.infiniopDestroyHandle(handle))


def unchanged_between(channel: Channel) -> bool:
    return bool(np.isnan(channel.base[1::2]).all())


@pytest.mark.parametrize("null_data", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_backward_of_an_empty_batch_is_zero_weight_and_bias_gradients(
    shape, mode, dtype, null_data
):
    found = arrays("BatchNormBackward", shape, dtype)
    capi_run("BatchNormBackward", found, (1e-5, mode), null_data=null_data)
    want = torch_empty_batch(shape, training=mode != 2)
    for name in ("grad_weight", "grad_bias"):
        np.testing.assert_array_equal(found[name].view, want[name].numpy())
        assert unchanged_between(found[name]), name
    assert found["grad_input"].shape == tuple(want["grad_input"].shape)
    for name in ("weight", "running_mean", "running_var"):
        assert unchanged_between(found[name])


@pytest.mark.parametrize("null_data", [False, True])
@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_training_forward_of_an_empty_batch_writes_nothing(shape, null_data):
    """Empty output; running statistics as torch leaves them (unchanged); the saved
    statistics are torch's ``at::empty``: not written."""
    found = arrays("BatchNormForwardTraining", shape, np.float64)
    capi_run("BatchNormForwardTraining", found, (1e-5, 0.1), null_data=null_data)
    want = torch_empty_batch(shape, training=True)
    assert found["output"].shape == tuple(want["output"].shape)
    for name in ("running_mean", "running_var"):
        np.testing.assert_array_equal(found[name].view, want[name].numpy())
    for name in ("saved_mean", "saved_invstd"):
        assert np.isnan(found[name].base).all(), name


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_inference_forward_of_an_empty_batch(shape):
    found = arrays("BatchNormForwardInference", shape, np.float32)
    capi_run("BatchNormForwardInference", found, (1e-5,), null_data=False)
    want = torch_empty_batch(shape, training=False)
    assert found["output"].shape == tuple(want["output"].shape)
    for name in ("running_mean", "running_var"):
        np.testing.assert_array_equal(found[name].view, want[name].numpy())


def test_masked_off_gradients_of_an_empty_batch_are_not_written():
    shape, f64 = (0, C, 4), DataType.F64
    x, channel = TensorDesc.contiguous(f64, shape), TensorDesc(f64, (C,), (2,))
    descriptor = BatchNormBackwardDescriptor(
        cudnn_bn.Handle(Device.CPU, 0), x, channel, channel, x, x, channel, None, None,
        output_mask=(True, False, True),
    )  # fmt: skip
    assert descriptor.engine == "empty"
    grad_bias = Channel(np.float64)
    weight = Channel(np.float64, 1.0)
    descriptor.compute(0, 0, 0, 0, grad_bias.view.ctypes.data, 0, 0, weight.view.ctypes.data, 0, 0)
    np.testing.assert_array_equal(grad_bias.view, np.zeros(C))
    assert unchanged_between(grad_bias)


@pytest.mark.parametrize(
    ("stride", "memsets"), [(1, [(0, 3 * 4)]), (3, [(0, 4), (12, 4), (24, 4)])]
)
def test_nvidia_zeros_are_queued_on_the_calls_stream(monkeypatch, stride, memsets):
    """On NVIDIA: no backend kernel is built, and grad_weight/grad_bias are zeroed by
    ``cudaMemsetAsync`` on the call's stream and device (one call when packed, one per
    element when strided), nothing else."""
    fake = FakeCupy({})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda, "current_device", lambda: fake.device)
    shape, f32 = (0, C, 5), DataType.F32
    x, channel = TensorDesc.contiguous(f32, shape), TensorDesc(f32, (C,), (stride,))
    descriptor = BatchNormBackwardDescriptor(
        cudnn_bn.Handle(Device.NVIDIA, 1), x, channel, channel, x, x, channel, channel, channel
    )
    assert (descriptor.engine, descriptor.workspace_size) == ("empty", 0)
    gw, gb, w, stream = 0x7100_0000_0000, 0x7100_0010_0000, 0x7100_0020_0000, 0x5000
    descriptor.compute(0, 0, 0, gw, gb, 0, 0, w, w, w, stream)
    want = [
        ("memset", 1, stream, base + offset, 0, size)
        for base in (gw, gb)
        for offset, size in memsets
    ]
    assert fake.log == want
    assert fake.device == 0  # switched back


def test_training_forward_of_an_empty_batch_on_nvidia_writes_nothing(monkeypatch):
    fake = FakeCupy({})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    f32 = DataType.F32
    x, channel = TensorDesc.contiguous(f32, (0, C)), TensorDesc.contiguous(f32, (C,))
    descriptor = BatchNormForwardTrainingDescriptor(
        cudnn_bn.Handle(Device.NVIDIA, 0), x, channel, channel, x, channel, channel, channel,
        channel,
    )  # fmt: skip
    assert (descriptor.engine, descriptor.reserve_size) == ("empty", 0)
    p = 0x7100_0000_0000
    descriptor.compute(0, 0, 0, 0, 0, p, p, 0, p, p, p, p, 0x5000)
    assert fake.log == []


@pytest.mark.parametrize("shape", [(2, 0, 3), (0, 0)])
def test_no_channels_stays_refused(shape):
    """C = 0: torch's affine batch norm refuses it (it indexes weight[0])."""
    f32 = DataType.F32
    x, channel = TensorDesc.contiguous(f32, shape), TensorDesc.contiguous(f32, (0,))
    with pytest.raises(cudnn_bn.InfiniError, match="no channels") as info:
        BatchNormBackwardDescriptor(
            cudnn_bn.Handle(Device.CPU, 0), x, channel, channel, x, x, channel, None, None
        )
    assert info.value.status == Status.BAD_TENSOR_SHAPE
