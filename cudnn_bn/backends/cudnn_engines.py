"""The cuDNN engines: batch-norm backward, training forward and inference forward.

Each builds its cuDNN descriptors, queries its workspace and reserve sizes, plans which
per-channel operands go through the workspace (``staging.py``), and fills a template of its
cuDNN call's arguments once, when the operator descriptor is built. ``run`` copies the
template, writes the data pointers into their positions (a staged operand's position points
into the workspace), sets the stream, and makes one cuDNN call.
"""

import ctypes
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from .._cudnn import handle as handles
from .._cudnn.activation import ActivationDescriptor
from .._cudnn.enums import BatchNormMode, BatchNormOps, CudnnDataType, CudnnStatus, ErrQueryMode
from .._cudnn.library import cudnn
from .._cudnn.tensor import TensorDescriptor, pad_to_4d
from ..dtypes import FLOAT_TYPES
from ..enums import DataType
from ..problems import (
    BackwardAttributes,
    BackwardPointers,
    BackwardTensors,
    ForwardInferenceAttributes,
    ForwardInferencePointers,
    ForwardInferenceTensors,
    ForwardTrainingAttributes,
    ForwardTrainingPointers,
    ForwardTrainingTensors,
    Fusion,
    Mode,
)
from ..tensor import TensorDesc
from . import cuda
from .staging import ParameterStaging

_ONE_F, _ZERO_F = ctypes.c_float(1.0), ctypes.c_float(0.0)
_ONE_D, _ZERO_D = ctypes.c_double(1.0), ctypes.c_double(0.0)


def bn_mode(x: TensorDesc, training: bool, persistent: bool | None) -> BatchNormMode:
    """PyTorch's choice (``getCudnnBatchNormMode``) for the 3-D to 5-D input cuDNN gets:
    SPATIAL_PERSISTENT for channels-last training (4-D and 5-D), else SPATIAL.
    ``persistent`` True asks for PERSISTENT in training, False forbids it."""
    channels_last = x.ndim >= 4 and x.is_channels_last() and not x.is_contiguous()
    wanted = channels_last if persistent is None else persistent
    return BatchNormMode.SPATIAL_PERSISTENT if training and wanted else BatchNormMode.SPATIAL


def backward_bn_mode(x: TensorDesc, attributes: BackwardAttributes) -> BatchNormMode:
    """The mode of a backward: its forward's (``bn_mode``) only when it runs from that
    forward's saved statistics and reserve, as PyTorch's always does (Normalization.cpp's
    ``_batch_norm_impl_index_backward`` hands aten/src/ATen/native/cudnn/BatchNorm.cpp's
    ``cudnn_batch_norm_backward`` the forward's save_mean, save_var and reserve).

    cuDNN: "In the case of cudnnBatchNormalizationBackward(), the savedMean and
    savedInvVariance arguments should not be NULL" in SPATIAL_PERSISTENT mode, whose kernels
    also read the reserve its forward filled; SPATIAL takes both statistics NULL and computes
    them itself. So a train-mode backward (no saved statistics) runs in SPATIAL: one cuDNN
    call that reduces x in its own kernel, rather than a separate reduction of x (a CuPy
    kernel on the fast path, which touches no CuPy today) plus the persistent kernel, which
    reads x again; and the batch statistics come from cuDNN's own SPATIAL reduction, free of
    the persistent kernels' scaled-integer limits on value range."""
    saved = attributes.mode != Mode.TRAIN and attributes.reserve
    return bn_mode(x, True, attributes.persistent if saved else False)


class _CudnnKernel:
    """One cuDNN batch-norm call: its descriptors, its staging, its argument template."""

    engine = "cudnn"
    function: str
    pointers: type[NamedTuple]
    reserve_size = 0

    def __init__(
        self,
        x: TensorDesc,
        training: bool,
        persistent: bool | None,
        fusion: Fusion,
        device_id: int,
        check_overflow: bool = False,
    ) -> None:
        self.device_id = device_id
        self.bn_mode = bn_mode(x, training, persistent)
        # SPATIAL_PERSISTENT reduces through scaled atomic integers, "with limits on value
        # range" (cudnn_ops.h): the mode that may overflow, the one CuPy 13 checked.
        persistent_mode = self.bn_mode == BatchNormMode.SPATIAL_PERSISTENT
        self.check_overflow = check_overflow and persistent_mode
        self.ops = BatchNormOps(fusion)
        self.ctype = FLOAT_TYPES[x.dtype].cudnn
        self.channels = x.shape[1]
        self._owned: list[Any] = []
        handles.reserve(device_id)  # here, not in compute: a compute may be graph-captured
        with self.closed_on_error():
            self.activation = self._own(ActivationDescriptor()).ref if fusion != Fusion.BN else None
            self.x_desc = self.data_descriptor(x)
            bn_desc = self._own(TensorDescriptor.derive_bn(self.x_desc, self.bn_mode))
            derived = bn_desc.read()[0]
        self.bn_desc = bn_desc.ref
        self.param_dtype = DataType.F64 if derived == CudnnDataType.DOUBLE else DataType.F32
        one, zero = (_ONE_D, _ZERO_D) if self.param_dtype == DataType.F64 else (_ONE_F, _ZERO_F)
        self.one, self.zero = ctypes.addressof(one), ctypes.addressof(zero)

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Destroy the descriptors made so far if building fails: nothing leaks half-built."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _own(self, desc: Any) -> Any:
        self._owned.append(desc)
        return desc

    def data_descriptor(self, desc: TensorDesc) -> Any:
        """A cuDNN descriptor of ``desc`` padded to 4-D, with the packed strides of its layout:
        cuDNN reads strides literally to recognise NCHW/NHWC (PyTorch's fixSizeOneDimStride),
        so a size-1 axis must carry its packed stride, not a stray or broadcast one."""
        shape, strides = pad_to_4d(desc.shape, desc.strides)
        packed = TensorDesc(desc.dtype, shape, strides).packed_strides()
        return self._own(TensorDescriptor.nd(self.ctype, shape, packed)).ref

    def query(self, function: str, *args: Any) -> int:
        """A size from one of cuDNN's ``cudnnGet...Size`` calls, on a pooled handle."""
        size = ctypes.c_size_t()
        handle = handles.borrow(self.device_id)
        try:
            getattr(cudnn(), function)(handle, *args, ctypes.byref(size))
        finally:
            handles.give_back(self.device_id, handle)
        return size.value

    def reserve_query(self) -> int:
        return self.query(
            "cudnnGetBatchNormalizationTrainingExReserveSpaceSize",
            self.bn_mode,
            self.ops,
            self.activation,
            self.x_desc,
        )

    def bind(self, template: list[Any], slots: dict[int, str]) -> None:
        """The call's arguments with data pointers left out, and which operand (a pointer
        field, or ``"workspace"``) fills each left-out position: resolved here, once, into
        positions in the pointer tuple and offsets into the workspace (a staged operand's
        slice, or cuDNN's own scratch at offset 0)."""
        offsets = {field: offset for field, (offset, _) in self.staging.layout.slices.items()}
        offsets["workspace"] = 0
        fields = self.pointers._fields
        self._template = template
        self._pointer_slots = tuple(
            (index, fields.index(field)) for index, field in slots.items() if field not in offsets
        )
        self._workspace_slots = tuple(
            (index, offsets[field]) for index, field in slots.items() if field in offsets
        )
        self._call = getattr(cudnn(), self.function)
        self._set_stream = cudnn().cudnnSetStream

    def bind_reserve(self, args: list[Any], ptrs: NamedTuple) -> None:
        """Fill what depends on whether a reserve was given (engines that take one)."""

    def run(self, ptrs: NamedTuple, workspace: int, stream: int) -> None:
        with cuda.on_device(self.device_id):
            self.run_current(ptrs, workspace, stream)

    def run_current(self, ptrs: NamedTuple, workspace: int, stream: int) -> None:
        """``run`` with this engine's device current already (the caller made it so)."""
        args = self._template.copy()
        for index, field in self._pointer_slots:
            args[index] = ptrs[field]
        for index, offset in self._workspace_slots:
            args[index] = workspace + offset
        self.bind_reserve(args, ptrs)
        handle = handles.borrow(self.device_id)
        try:
            args[0] = ref = handle.ref
            self._set_stream(ref, stream)
            self.staging.read(ptrs, workspace, stream)
            self._call(*args)
            self.staging.write(ptrs, workspace, stream)
            if self.check_overflow:
                self.warn_on_overflow(ref)
        finally:
            handles.give_back(self.device_id, handle)

    def warn_on_overflow(self, handle: Any) -> None:
        """CuPy 13's ``debug`` check (cupyx/cudnn.pyx): wait for this handle's work
        (``cudnnQueryRuntimeError``, blocking: it synchronizes) and warn, as CuPy 13 did, if
        cuDNN flagged a possible numerical overflow in its SPATIAL_PERSISTENT kernels."""
        rstatus = ctypes.c_int()
        cudnn().cudnnQueryRuntimeError(handle, ctypes.byref(rstatus), ErrQueryMode.BLOCKING, None)
        if rstatus.value != CudnnStatus.SUCCESS:
            name = cudnn().cudnnGetErrorString(rstatus.value).decode(errors="replace")
            warnings.warn(
                f"{self.function}: cuDNN reports {name} ({rstatus.value}): a numerical "
                "overflow may have happened in SPATIAL_PERSISTENT batch normalization",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        for desc in self._owned:
            desc.close()

    staging: ParameterStaging


class CudnnBatchNormBackward(_CudnnKernel):
    """``cudnnBatchNormalizationBackwardEx``, fused or not, with any output mask."""

    function = "cudnnBatchNormalizationBackwardEx"
    pointers = BackwardPointers

    def __init__(
        self, tensors: BackwardTensors, attributes: BackwardAttributes, device_id: int
    ) -> None:
        a, t = attributes, tensors
        persistent = backward_bn_mode(t.input, a) == BatchNormMode.SPATIAL_PERSISTENT
        super().__init__(t.input, True, persistent, a.fusion, device_id, a.check_overflow)
        self.tensors, self.attributes = t, a
        fused, add = a.fusion != Fusion.BN, a.fusion == Fusion.BN_ADD_RELU
        with self.closed_on_error():
            dy_desc, dx_desc = (
                self.data_descriptor(t.grad_output),
                self.data_descriptor(t.grad_input),
            )
            y_desc = self.data_descriptor(t.output) if fused else None
            dz_desc = self.data_descriptor(t.grad_z) if add else None
            # A plain backward's call has no y, but its size query is given x's descriptor
            # there, as PyTorch (aten/src/ATen/native/cudnn/BatchNorm.cpp,
            # cudnn_batch_norm_backward) and CuPy 13 do: cuDNN may size scratch by it.
            descs = (self.x_desc, y_desc or self.x_desc, dy_desc, dz_desc, dx_desc)
            # A persistent plain backward given no reserve at compute (the C API has no
            # operand for it) runs in SPATIAL instead (``bind_reserve``): sized here too.
            self._without_reserve: dict[int, Any] = {}
            if self.bn_mode == BatchNormMode.SPATIAL_PERSISTENT and not fused:
                spatial = BatchNormMode.SPATIAL
                spatial_bn = self._own(TensorDescriptor.derive_bn(self.x_desc, spatial)).ref
                spatial_workspace = self.workspace_query(spatial, descs, spatial_bn)
                self._without_reserve = {1: spatial, 17: spatial_bn, 27: spatial_workspace}
            cudnn_workspace = self.workspace_query(self.bn_mode, descs, self.bn_desc)
            # Only a backward from saved statistics reads its forward's reserve.
            self.reserve_size = self.reserve_query() if a.mode != Mode.TRAIN else 0
        scratch = max(cudnn_workspace, self._without_reserve.get(27, 0))
        self.staging = ParameterStaging(self.param_dtype, scratch, device_id)
        self._plan_staging()
        self.workspace_size = self.staging.size
        slots = {
            8: "input",
            12: "grad_output",
            16: "grad_input",
            18: "weight",
            20: "grad_weight",
            21: "grad_bias",
            26: "workspace",
        }
        if fused:
            slots |= {10: "output", 19: "bias"}
        if add:
            slots[14] = "grad_z"
        if a.mode != Mode.TRAIN:
            slots |= {23: "running_mean", 24: "running_var"}
        if self.reserve_size:  # else cuDNN gets none (NULL), whatever the caller gives
            slots[28] = "reserve"
        self.bind(
            [
                None,
                self.bn_mode,
                self.ops,
                self.one,
                self.zero,
                self.one,
                self.zero,
                self.x_desc,
                None,
                y_desc,
                None,
                dy_desc,
                None,
                dz_desc,
                None,
                dx_desc,
                None,
                self.bn_desc,
                None,
                None,
                None,
                None,
                a.eps,
                None,
                None,
                self.activation,
                None,
                cudnn_workspace,
                None,
                0,
            ],
            slots,
        )

    def _plan_staging(self) -> None:
        a, t, s = self.attributes, self.tensors, self.staging
        s.plan("weight", t.weight, read=True)
        if a.fusion != Fusion.BN:
            s.plan("bias", t.bias, read=True)
        if a.mode != Mode.TRAIN:
            s.plan("running_mean", t.running_mean, read=True)
            eps = a.eps if a.mode == Mode.SAVED else None
            s.plan("running_var", t.running_var, read=True, invstd_eps=eps)
        wanted_dx, wanted_dw, wanted_db = a.output_mask
        if not wanted_dx:
            s.scratch("grad_input", t.input.dtype, t.input.numel)
        for field, wanted in (("grad_weight", wanted_dw), ("grad_bias", wanted_db)):
            if wanted:
                s.plan(field, getattr(t, field), write=True)
            else:
                s.scratch(field, self.param_dtype, self.channels)

    def workspace_query(self, mode: BatchNormMode, descs: tuple, bn_desc: Any) -> int:
        """cuDNN's workspace for this backward's descriptors (x, y, dy, dz, dx) in ``mode``."""
        return self.query(
            "cudnnGetBatchNormalizationBackwardExWorkspaceSize",
            mode,
            self.ops,
            *descs,
            bn_desc,
            self.activation,
        )

    def bind_reserve(self, args: list[Any], ptrs: BackwardPointers) -> None:
        """A backward from saved statistics passes the forward's reserve when given (a fused
        one always has one); a persistent plain one given none runs in SPATIAL, which needs
        none. A train-mode backward runs in SPATIAL and passes none."""
        if ptrs.reserve:
            args[29] = self.reserve_size
        elif self.reserve_size:
            for index, value in self._without_reserve.items():
                args[index] = value


class CudnnBatchNormForwardTraining(_CudnnKernel):
    """``cudnnBatchNormalizationForwardTrainingEx``, fused or not."""

    function = "cudnnBatchNormalizationForwardTrainingEx"
    pointers = ForwardTrainingPointers

    def __init__(
        self, tensors: ForwardTrainingTensors, attributes: ForwardTrainingAttributes, device_id: int
    ) -> None:
        a, t = attributes, tensors
        super().__init__(t.input, True, a.persistent, a.fusion, device_id, a.check_overflow)
        self.tensors, self.attributes = t, a
        add = a.fusion == Fusion.BN_ADD_RELU
        with self.closed_on_error():
            y_desc = self.data_descriptor(t.output)
            z_desc = self.data_descriptor(t.z) if add else None
            cudnn_workspace = self.query(
                "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize",
                self.bn_mode,
                self.ops,
                self.x_desc,
                z_desc,
                y_desc,
                self.bn_desc,
                self.activation,
            )
            self.reserve_size = self.reserve_query()
        s = self.staging = ParameterStaging(self.param_dtype, cudnn_workspace, device_id)
        for field in ("weight", "bias"):
            s.plan(field, getattr(t, field), read=True)
        # cuDNN updates both running statistics or neither (one NULL pointer is BAD_PARAM):
        # a missing one of the two gets a scratch slice; with neither, cuDNN gets NULLs.
        running = t.running_mean is not None or t.running_var is not None
        for field in ("running_mean", "running_var"):
            if getattr(t, field) is not None:
                s.plan(field, getattr(t, field), read=True, write=True)
            elif running:
                s.scratch(field, self.param_dtype, self.channels)
        for field in ("saved_mean", "saved_invstd"):
            s.plan(field, getattr(t, field), write=True)
        self.workspace_size = s.size
        slots = {
            6: "input",
            10: "output",
            12: "weight",
            13: "bias",
            18: "saved_mean",
            19: "saved_invstd",
            21: "workspace",
        }
        if self.reserve_size:  # else cuDNN gets none (NULL), whatever the caller gives
            slots[23] = "reserve"
        if add:
            slots[8] = "z"
        if running:
            slots |= {15: "running_mean", 16: "running_var"}
        self.bind(
            [
                None,
                self.bn_mode,
                self.ops,
                self.one,
                self.zero,
                self.x_desc,
                None,
                z_desc,
                None,
                y_desc,
                None,
                self.bn_desc,
                None,
                None,
                a.momentum,
                None,
                None,
                a.eps,
                None,
                None,
                self.activation,
                None,
                cudnn_workspace,
                None,
                self.reserve_size,
            ],
            slots,
        )


class CudnnBatchNormForwardInference(_CudnnKernel):
    """``cudnnBatchNormalizationForwardInference``."""

    function = "cudnnBatchNormalizationForwardInference"
    pointers = ForwardInferencePointers

    def __init__(
        self,
        tensors: ForwardInferenceTensors,
        attributes: ForwardInferenceAttributes,
        device_id: int,
    ) -> None:
        super().__init__(tensors.input, False, False, Fusion.BN, device_id)
        self.tensors = tensors
        with self.closed_on_error():
            y_desc = self.data_descriptor(tensors.output)
        s = self.staging = ParameterStaging(self.param_dtype, 0, device_id)
        for field in ("weight", "bias", "running_mean", "running_var"):
            s.plan(field, getattr(tensors, field), read=True)
        self.workspace_size = s.size
        self.bind(
            [
                None,
                self.bn_mode,
                self.one,
                self.zero,
                self.x_desc,
                None,
                y_desc,
                None,
                self.bn_desc,
                None,
                None,
                None,
                None,
                attributes.eps,
            ],
            {
                5: "input",
                7: "output",
                9: "weight",
                10: "bias",
                11: "running_mean",
                12: "running_var",
            },
        )
