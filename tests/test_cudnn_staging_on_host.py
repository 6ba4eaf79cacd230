"""The cuDNN engine's parameter staging on real memory, without a GPU.

cuDNN takes per-channel operands packed, in F32 (F64 for F64 data); any other goes through
a workspace slice (``backends/staging.py``): converted in before the call, saved-mode
variance turned into ``1/sqrt(var + eps)`` on the way, results converted out after it. Here
the stub libcudnn (``cudnn_stub.py``) stands in for cuDNN, CuPy's stand-in
(``cupy_on_host.py``) runs the conversion kernels, and every operand and the workspace are
host memory, so the test reads what cuDNN would have read at the addresses it was given, and
plants values where cuDNN would have written its results to see them reach the caller.
"""

import numpy as np
import pytest

from cudnn_bn import (
    BatchNormBackwardDescriptor,
    BatchNormForwardTrainingDescriptor,
    DataType,
    Device,
    Handle,
    TensorDesc,
)
from cudnn_bn._cudnn import library as library_module
from cudnn_bn.backends import cuda
from cudnn_bn.dtypes import FLOAT_TYPES

SHAPE = (2, 4, 3, 3)
C = SHAPE[1]
STREAM_SCOPE = cuda.stream_scope  # the real one; the stub's set-up forbids it
# (data dtype, per-channel dtype, per-channel stride): each needs staging.
STAGED = [
    (DataType.F16, DataType.F16, 1),
    (DataType.F16, DataType.F32, 2),
    (DataType.F32, DataType.F32, 3),
    (DataType.F64, DataType.F64, 2),
]
ID = lambda v: getattr(v, "name", str(v))  # noqa: E731


@pytest.fixture
def stub_with_host_cupy(stub, host_cupy, monkeypatch):
    monkeypatch.setattr(cuda, "stream_scope", STREAM_SCOPE)
    return stub


class Operand:
    """A host tensor with its descriptor, made of float64 ``values`` rounded to ``dtype``."""

    def __init__(self, values: np.ndarray, dtype: DataType, stride: int = 1) -> None:
        storage = FLOAT_TYPES[dtype].storage
        self.flat, self.stride = np.zeros(values.size * stride, storage), stride
        self.array = self.flat[::stride].reshape(values.shape)
        self.array[...] = values
        strides = tuple(s // storage.itemsize for s in self.array.strides)
        self.desc = TensorDesc(dtype, values.shape, strides)
        self.ptr = self.array.ctypes.data

    def gaps(self) -> np.ndarray:
        """The elements between a strided tensor's, which nothing may write."""
        return np.delete(self.flat, np.s_[:: self.stride])


def param_view(workspace: np.ndarray, address: int, dtype: np.dtype) -> np.ndarray:
    """The ``(C,)`` array of ``dtype`` at ``address``, which must lie inside ``workspace``."""
    offset = address - workspace.ctypes.data
    assert offset >= 0 and offset + C * dtype.itemsize <= workspace.nbytes, "not in workspace"
    return workspace[offset : offset + C * dtype.itemsize].view(dtype)


@pytest.mark.parametrize(("data", "channel", "stride"), STAGED, ids=ID)
def test_backward_stages_parameters_in_and_gradients_out(
    stub_with_host_cupy, data, channel, stride
):
    rng = np.random.default_rng(0)
    x, dy, dx = (Operand(rng.standard_normal(SHAPE), data) for _ in range(3))
    w, mean = (Operand(rng.uniform(-2, 2, C), channel, stride) for _ in range(2))
    var = Operand(rng.uniform(0.5, 2, C), channel, stride)
    dw, db = (Operand(np.zeros(C), channel, stride) for _ in range(2))
    eps = 1e-3
    desc = BatchNormBackwardDescriptor(
        Handle(Device.NVIDIA, 0), dx.desc, dw.desc, db.desc, x.desc, dy.desc, w.desc,
        mean.desc, var.desc, eps=eps, mode="saved",
    )  # fmt: skip
    assert desc.engine == "cudnn"
    workspace = np.zeros(desc.workspace_size, np.uint8)
    operands = (dx, dw, db, x, dy, w, mean, var)

    def compute() -> None:
        ptrs = (o.ptr for o in operands)
        desc.compute(workspace.ctypes.data, workspace.nbytes, *ptrs)

    compute()
    call = stub_with_host_cupy.backward
    param = np.dtype(np.float64 if data == DataType.F64 else np.float32)
    # In: what cuDNN read, packed in its parameter type.
    np.testing.assert_array_equal(param_view(workspace, call.scale, param), w.array)
    np.testing.assert_array_equal(param_view(workspace, call.saved_mean, param), mean.array)
    invstd = 1 / np.sqrt(var.array.astype(np.float64) + eps)
    np.testing.assert_array_equal(
        param_view(workspace, call.saved_inv_variance, param), invstd.astype(param)
    )
    # Out: what cuDNN writes reaches the caller's tensors, converted, strides kept.
    planted = {"dscale": rng.uniform(-3, 3, C), "dbias": rng.uniform(-3, 3, C)}
    for name, values in planted.items():
        param_view(workspace, getattr(call, name), param)[...] = values
    compute()
    storage = FLOAT_TYPES[channel].storage
    for name, out in (("dscale", dw), ("dbias", db)):
        expected = planted[name].astype(param).astype(storage)
        np.testing.assert_array_equal(out.array, expected, err_msg=name)
        assert not out.gaps().any(), f"{name}: written between the elements"


@pytest.mark.parametrize(("data", "channel", "stride"), STAGED, ids=ID)
def test_training_forward_stages_running_statistics_both_ways(
    stub_with_host_cupy, data, channel, stride, monkeypatch
):
    rng = np.random.default_rng(1)
    x, y = (Operand(rng.standard_normal(SHAPE), data) for _ in range(2))
    w, b, mean = (Operand(rng.uniform(-2, 2, C), channel, stride) for _ in range(3))
    var = Operand(rng.uniform(0.5, 2, C), channel, stride)
    stats = DataType.F32 if data == DataType.F16 else data
    saved_mean, saved_invstd = (Operand(np.zeros(C), stats) for _ in range(2))
    call = stub_with_host_cupy.forward_training
    param = np.dtype(np.float64 if data == DataType.F64 else np.float32)
    read, updated = {}, {"running_mean": rng.uniform(-2, 2, C), "running_var": rng.uniform(1, 3, C)}
    staged = {"scale": w, "bias": b, "running_mean": mean, "running_var": var}

    def cudnn_updates_running_statistics(*args):
        """The stub's call, then what cuDNN does to the running statistics it was given."""
        status = stub_call(*args)
        for name in staged:
            read[name] = param_view(workspace, getattr(call, name), param).copy()
        for name, values in updated.items():
            param_view(workspace, getattr(call, name), param)[...] = values
        return status

    library = library_module.cudnn()
    stub_call = library.cudnnBatchNormalizationForwardTrainingEx
    monkeypatch.setattr(
        library, "cudnnBatchNormalizationForwardTrainingEx", cudnn_updates_running_statistics
    )
    desc = BatchNormForwardTrainingDescriptor(
        Handle(Device.NVIDIA, 0), y.desc, saved_mean.desc, saved_invstd.desc, x.desc, w.desc,
        b.desc, mean.desc, var.desc,
    )  # fmt: skip
    assert desc.engine == "cudnn"
    workspace = np.zeros(desc.workspace_size, np.uint8)
    reserve = np.zeros(desc.reserve_size, np.uint8)
    operands = (y, saved_mean, saved_invstd, x, w, b, mean, var)
    before = {name: operand.array.copy() for name, operand in staged.items()}
    desc.compute(
        workspace.ctypes.data, workspace.nbytes, reserve.ctypes.data, reserve.nbytes,
        *(o.ptr for o in operands),
    )  # fmt: skip
    for name, values in before.items():  # in: what cuDNN read
        np.testing.assert_array_equal(read[name], values, err_msg=name)
    storage = FLOAT_TYPES[channel].storage
    for name, operand in (("running_mean", mean), ("running_var", var)):  # out: its update
        expected = updated[name].astype(param).astype(storage)
        np.testing.assert_array_equal(operand.array, expected, err_msg=name)
        assert not operand.gaps().any(), f"{name}: written between the elements"
    # The saved statistics are F32 (F64) and packed already: cuDNN writes them directly.
    assert (call.save_mean, call.save_inv_variance) == (saved_mean.ptr, saved_invstd.ptr)
