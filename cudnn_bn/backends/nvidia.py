"""The NVIDIA backend of BatchNormBackward: cuDNN first, CuPy kernels for the rest.

The engine is chosen once, when the descriptor is built:

* ``cudnn``: ``cudnnBatchNormalizationBackwardEx`` (OPS_BN; PER_ACTIVATION for 2-D input,
  SPATIAL otherwise) for the train and saved modes on F16/F32/F64 data laid out packed
  (NCHW or channels-last) with fewer than 2^31 elements. Per-channel tensors that are not
  what cuDNN wants (F32, or F64 for F64 data, stride 1) are converted through the workspace.
* ``cupy``: per-channel reductions and one elementwise pass (``cupy_kernels``) for eval mode
  (cuDNN has no call for it), BF16 data (PyTorch never sends BF16 to cuDNN's batch norm),
  other strides, and 2^31 elements or more (cuDNN indexes with 32 bits).

Neither allocates nor synchronizes in ``run``: scratch lives in the caller's workspace.
"""

import ctypes
from typing import Any

from .._cudnn.enums import BatchNormMode, BatchNormOps, CudnnDataType
from .._cudnn.handle import thread_handle
from .._cudnn.library import cudnn
from .._cudnn.tensor import TensorDescriptor, pad_to_4d
from ..dtypes import FLOAT_TYPES
from ..enums import DataType
from ..problems import BackwardPointers, BackwardTensors, Mode
from ..tensor import TensorDesc
from . import cuda
from .device_arrays import WorkspaceLayout, device_view

CUDNN_MAX_NUMEL = 2**31 - 1
CUDNN_MODES = (Mode.TRAIN, Mode.SAVED, Mode.SAVED_INVSTD)
CUDNN_DTYPES = (DataType.F16, DataType.F32, DataType.F64)
CUDNN8_MIN_EPSILON, CUDNN9_VERSION = 1e-5, 90000

_ONE_F, _ZERO_F = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_D, _ZERO_D = ctypes.c_double(1.0), ctypes.c_double(0.0)


def _layout(desc: TensorDesc) -> str | None:
    if desc.is_contiguous():
        return "NCHW"
    return "NHWC" if desc.is_channels_last() else None


def _cudnn_shape_strides(desc: TensorDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``desc`` padded to 4-D, with every stride the one its packed layout implies.

    A size-1 axis is never stepped, so its stride may be anything in memory, but cuDNN reads
    strides literally to recognise packed NCHW/NHWC (PyTorch's ``fixSizeOneDimStride``): an
    NLC tensor padded to (N, C, L, 1) must say W stride C, not 1, and a broadcast size-1 axis
    must not say 0.
    """
    shape, _ = pad_to_4d(desc.shape, desc.strides)
    nhwc = _layout(desc) == "NHWC"
    order = (0, *range(2, len(shape)), 1) if nhwc else tuple(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return shape, tuple(strides)


def cudnn_can_run(tensors: BackwardTensors, mode: Mode, eps: float) -> bool:
    """Whether cuDNN's batch-norm backward serves this problem exactly.

    x, dy and dx must share one packed layout (NCHW or channels-last), and cuDNN 8 refuses
    eps below its CUDNN_BN_MIN_EPSILON of 1e-5 (cuDNN 9 allows 0).
    """
    x = tensors.input
    layouts = {_layout(d) for d in (x, tensors.grad_output, tensors.grad_input)}
    return (
        mode in CUDNN_MODES
        and x.dtype in CUDNN_DTYPES
        and x.numel <= CUDNN_MAX_NUMEL
        and len(layouts) == 1
        and None not in layouts
        and (eps >= CUDNN8_MIN_EPSILON or cudnn().info.version >= CUDNN9_VERSION)
    )


def BatchNormBackward(tensors: BackwardTensors, mode: Mode, eps: float, device_id: int) -> Any:
    """The engine for this problem on NVIDIA device ``device_id``, built on that device."""
    engine = CudnnBatchNormBackward if cudnn_can_run(tensors, mode, eps) else CupyBatchNormBackward
    with cuda.on_device(device_id):
        return engine(tensors, mode, eps, device_id)


class CudnnBatchNormBackward:
    """``cudnnBatchNormalizationBackwardEx`` with every descriptor and size built once.

    Workspace: cuDNN's own scratch first, then an aligned slice for each per-channel operand
    converted for cuDNN (``loads`` before the call, ``stores`` after it) and, in saved mode,
    for ``1/sqrt(running_var + eps)``.
    """

    engine = "cudnn"

    def __init__(self, tensors: BackwardTensors, mode: Mode, eps: float, device_id: int) -> None:
        self.tensors, self.mode, self.eps, self.device_id = tensors, mode, eps, device_id
        x = tensors.input
        ctype = FLOAT_TYPES[x.dtype].cudnn
        self.bn_mode = BatchNormMode.PER_ACTIVATION if x.ndim == 2 else BatchNormMode.SPATIAL
        self._descriptors: list[TensorDescriptor] = []
        try:
            x_desc, dy_desc, dx_desc = (
                self._own(TensorDescriptor.nd(ctype, *_cudnn_shape_strides(d)))
                for d in (x, tensors.grad_output, tensors.grad_input)
            )
            bn_desc = self._own(TensorDescriptor.derive_bn(x_desc, self.bn_mode))
            handle = thread_handle(device_id)
            lib = cudnn()
            size = ctypes.c_size_t()
            lib.cudnnGetBatchNormalizationBackwardExWorkspaceSize(
                handle,
                self.bn_mode,
                BatchNormOps.BN,
                x_desc,
                None,
                dy_desc,
                None,
                dx_desc,
                bn_desc,
                None,
                ctypes.byref(size),
            )
            cudnn_workspace_size = size.value
            lib.cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
                handle, self.bn_mode, BatchNormOps.BN, None, x_desc, ctypes.byref(size)
            )
            self.reserve_size = size.value
            derived = bn_desc.read()[0]
        except BaseException:
            self.close()
            raise
        self.param_dtype = DataType.F64 if derived == CudnnDataType.DOUBLE else DataType.F32
        self.layout = WorkspaceLayout(size=cudnn_workspace_size)
        self.loads: list[tuple[str, TensorDesc]] = []
        self.stores: list[tuple[str, TensorDesc]] = []
        self._plan_staging()
        self.workspace_size = self.layout.size

        one, zero = (_ONE_D, _ZERO_D) if self.param_dtype == DataType.F64 else (_ONE_F, _ZERO_F)
        alpha, beta = ctypes.addressof(one), ctypes.addressof(zero)
        # cudnnBatchNormalizationBackwardEx's arguments; run() fills the None data pointers.
        self._args = (
            None,
            self.bn_mode,
            BatchNormOps.BN,
            alpha,
            beta,
            alpha,
            beta,
            x_desc,
            None,
            None,
            None,
            dy_desc,
            None,
            None,
            None,
            dx_desc,
            None,
            bn_desc,
            None,
            None,
            None,
            None,
            eps,
            None,
            None,
            None,
            None,
            cudnn_workspace_size,
            None,
            0,
        )

    def _own(self, desc: TensorDescriptor) -> TensorDescriptor:
        self._descriptors.append(desc)
        return desc

    def _plan_staging(self) -> None:
        t, p = self.tensors, self.param_dtype
        fields = ["weight"] + ([] if self.mode == Mode.TRAIN else ["running_mean", "running_var"])
        for field in fields:
            desc = getattr(t, field)
            if (
                desc.dtype != p
                or desc.strides[0] != 1
                or (field, self.mode) == ("running_var", Mode.SAVED)
            ):
                self.layout.add(field, p, desc.shape[0])
                self.loads.append((field, desc))
        for field in ("grad_weight", "grad_bias"):
            desc = getattr(t, field)
            if desc.dtype != p or desc.strides[0] != 1:
                self.layout.add(field, p, desc.shape[0])
                self.stores.append((field, desc))

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        with cuda.on_device(self.device_id):
            self._run(ptrs, workspace, stream)

    def _run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        handle = thread_handle(self.device_id)
        handle.set_stream(stream)
        if self.loads:
            self._load(ptrs, workspace, stream)
        staged = {field: workspace + self.layout.offset(field) for field in self.layout.slices}
        args = list(self._args)
        args[0] = handle
        args[8], args[12], args[16] = ptrs.input, ptrs.grad_output, ptrs.grad_input
        args[18] = staged.get("weight", ptrs.weight)
        args[20] = staged.get("grad_weight", ptrs.grad_weight)
        args[21] = staged.get("grad_bias", ptrs.grad_bias)
        if self.mode != Mode.TRAIN:
            args[23] = staged.get("running_mean", ptrs.running_mean)
            args[24] = staged.get("running_var", ptrs.running_var)
        args[26] = workspace or None
        cudnn().cudnnBatchNormalizationBackwardEx(*args)
        if self.stores:
            self._store(ptrs, workspace, stream)

    def _load(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels

        dev, p = self.device_id, self.param_dtype
        with cuda.stream_scope(stream, dev):
            for field, desc in self.loads:
                src, dst = (
                    device_view(getattr(ptrs, field), desc, dev),
                    self.layout.view(workspace, field, dev),
                )
                if (field, self.mode) == ("running_var", Mode.SAVED):
                    cupy_kernels.invstd_from_var(
                        src, desc.dtype, self.eps, dst, cupy_kernels.acc_type(p)
                    )
                else:
                    cupy_kernels.convert(src, desc.dtype, dst, p)

    def _store(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels

        dev = self.device_id
        with cuda.stream_scope(stream, dev):
            for field, desc in self.stores:
                src, dst = (
                    self.layout.view(workspace, field, dev),
                    device_view(getattr(ptrs, field), desc, dev),
                )
                cupy_kernels.convert(src, self.param_dtype, dst, desc.dtype)

    def close(self) -> None:
        for desc in self._descriptors:
            desc.close()


class CupyBatchNormBackward:
    """Batch-norm backward from CuPy kernels, for what cuDNN cannot take or has no call for."""

    engine = "cupy"
    reserve_size = 0

    def __init__(self, tensors: BackwardTensors, mode: Mode, eps: float, device_id: int) -> None:
        self.tensors, self.mode, self.eps, self.device_id = tensors, mode, eps, device_id
        x = tensors.input
        self.channels = x.shape[1]
        self.axes = (0, *range(2, x.ndim))
        self.inv_m = self.channels / x.numel
        self.acc = DataType.F64 if x.dtype == DataType.F64 else DataType.F32
        self.layout = WorkspaceLayout()
        for name in ("mean", "invstd", "sum_dy", "sum_dy_dev", "k", "a", "b"):
            self.layout.add(name, self.acc, self.channels)
        self.workspace_size = self.layout.size

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels as kern

        t, dev = self.tensors, self.device_id
        with cuda.on_device(dev), cuda.stream_scope(stream, dev):
            ws = {name: self.layout.view(workspace, name, dev) for name in self.layout.slices}
            x = device_view(ptrs.input, t.input, dev)
            dy = device_view(ptrs.grad_output, t.grad_output, dev)
            channel_shape = (1, self.channels) + (1,) * (t.input.ndim - 2)
            mean = ws["mean"].reshape(channel_shape)
            acc_c = kern.acc_type(self.acc)
            if self.mode == Mode.TRAIN:
                # "a" and "k" are free until finish_channels: scratch for the mean and variance.
                kern.channel_sum(
                    "x", x, dy, ws["a"].reshape(channel_shape), t.input.dtype, self.axes, ws["mean"]
                )
                ws["mean"] *= self.inv_m
                kern.channel_sum(
                    "squared_deviation", x, dy, mean, t.input.dtype, self.axes, ws["k"]
                )
                ws["k"] *= self.inv_m
                kern.invstd_from_var(ws["k"], self.acc, self.eps, ws["invstd"], acc_c)
            else:
                running_mean = device_view(ptrs.running_mean, t.running_mean, dev)
                running_var = device_view(ptrs.running_var, t.running_var, dev)
                kern.convert(running_mean, t.running_mean.dtype, ws["mean"], self.acc)
                if self.mode == Mode.SAVED_INVSTD:
                    kern.convert(running_var, t.running_var.dtype, ws["invstd"], self.acc)
                else:
                    kern.invstd_from_var(
                        running_var, t.running_var.dtype, self.eps, ws["invstd"], acc_c
                    )
            kern.channel_sum("dy", x, dy, mean, t.input.dtype, self.axes, ws["sum_dy"])
            kern.channel_sum(
                "dy_deviation", x, dy, mean, t.input.dtype, self.axes, ws["sum_dy_dev"]
            )
            kern.finish_channels(
                device_view(ptrs.weight, t.weight, dev),
                ws["invstd"],
                ws["sum_dy"],
                ws["sum_dy_dev"],
                self.inv_m,
                self.mode != Mode.EVAL,
                (t.weight.dtype, t.grad_weight.dtype, t.grad_bias.dtype),
                ws["k"],
                ws["a"],
                ws["b"],
                device_view(ptrs.grad_weight, t.grad_weight, dev),
                device_view(ptrs.grad_bias, t.grad_bias, dev),
            )
            kern.grad_input(
                x,
                dy,
                mean,
                ws["k"].reshape(channel_shape),
                ws["a"].reshape(channel_shape),
                ws["b"].reshape(channel_shape),
                t.input.dtype,
                device_view(ptrs.grad_input, t.grad_input, dev),
            )
