"""The CuPy engines: batch norm from per-channel reductions and one elementwise pass.

They serve what cuDNN has no call for (eval-mode backward) or rejects (BF16 data, 2-D input,
strides that are not one packed layout, 2^31 elements or more, fused passes outside cuDNN's
fused kernels). Every sum a pass needs comes from one two-stage reduction
(``cupy_reductions.py``) that reads the data once. Scratch lives in the caller's workspace:
one slice per per-channel quantity, and the reduction's partial sums.
"""

from typing import Any, NamedTuple

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
from . import cuda, cupy_reductions
from .device_arrays import WorkspaceLayout, device_view


class _CupyKernel:
    """Device views of a problem's operands and per-channel workspace slices."""

    engine = "cupy"
    reserve_size = 0
    scratch_names: tuple[str, ...] = ()

    def __init__(self, tensors: NamedTuple, device_id: int) -> None:
        self.tensors, self.device_id = tensors, device_id
        x = tensors.input
        self.x_dtype = x.dtype
        self.acc = DataType.F64 if x.dtype == DataType.F64 else DataType.F32
        self.acc_c = "double" if self.acc == DataType.F64 else "float"
        self.channel_shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        self.count = x.numel // x.shape[1]
        self.layout = WorkspaceLayout()
        for name in self.scratch_names:
            self.layout.add(name, self.acc, x.shape[1])
        self.workspace_size = self.layout.size

    def views(self, ptrs: NamedTuple, workspace: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Views of the caller's operands present in ``ptrs``, and of the scratch slices."""
        data = {}
        for name, desc in zip(self.tensors._fields, self.tensors, strict=True):
            if desc is not None and getattr(ptrs, name):
                data[name] = device_view(getattr(ptrs, name), desc, self.device_id)
        scratch = {n: self.layout.view(workspace, n, self.device_id) for n in self.layout.slices}
        return data, scratch

    def dtype(self, name: str) -> DataType:
        return getattr(self.tensors, name).dtype

    def plan_sums(self, kind: str, reduced: list[TensorDesc], fused: bool = False) -> None:
        """Plan the per-channel sums of ``kind`` over ``reduced`` (x, then dy and y) and
        keep workspace for their partials."""
        self.sums_kind, self.sums_fused = kind, fused
        self.sums = cupy_reductions.plan(reduced)
        self.layout.add("partials", DataType.F64, self.sums.partials(kind))
        self.workspace_size = self.layout.size

    def channel_sums(
        self, data: tuple[Any, Any, Any], mean: Any, partials: Any, outputs: tuple[Any, ...]
    ) -> None:
        """The planned sums into ``outputs`` (``cupy_reductions.RESULTS``' order)."""
        cupy_reductions.channel_sums(
            self.sums, self.sums_kind, self.x_dtype, self.sums_fused, data, mean, partials, outputs
        )


class CupyBatchNormBackward(_CupyKernel):
    """Batch-norm backward in every mode, fused or not, with any output mask."""

    scratch_names = (
        "mean",
        "invstd",
        "sum_dy",
        "sum_dy_dev",
        "k",
        "a",
        "b",
        "grad_weight",
        "grad_bias",
    )

    def __init__(
        self, tensors: BackwardTensors, attributes: BackwardAttributes, device_id: int
    ) -> None:
        super().__init__(tensors, device_id)
        self.attributes = attributes
        fused = attributes.fusion != Fusion.BN
        reduced = [tensors.input, tensors.grad_output] + ([tensors.output] if fused else [])
        self.plan_sums("both" if attributes.mode == Mode.TRAIN else "gradients", reduced, fused)

    def run(self, ptrs: BackwardPointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels as kern

        a = self.attributes
        fused = a.fusion != Fusion.BN
        with cuda.on_device(self.device_id), cuda.stream_scope(stream, self.device_id):
            v, ws = self.views(ptrs, workspace)
            data = (v["input"], v["grad_output"], v["output"] if fused else v["grad_output"])
            sums = (ws["sum_dy"], ws["sum_dy_dev"])
            if a.mode == Mode.TRAIN:
                # "k" is free until finish_channels: the variance goes there first.
                self.channel_sums(data, ws["mean"], ws["partials"], (ws["mean"], ws["k"], *sums))
                kern.invstd_from_var(ws["k"], self.acc, a.eps, ws["invstd"], self.acc_c, batch=True)
            else:
                kern.convert(v["running_mean"], self.dtype("running_mean"), ws["mean"], self.acc)
                var, var_dtype = v["running_var"], self.dtype("running_var")
                if a.mode == Mode.SAVED_INVSTD:
                    kern.convert(var, var_dtype, ws["invstd"], self.acc)
                else:
                    kern.invstd_from_var(var, var_dtype, a.eps, ws["invstd"], self.acc_c)
                self.channel_sums(data, ws["mean"], ws["partials"], sums)
            wanted = dict(
                zip(("grad_input", "grad_weight", "grad_bias"), a.output_mask, strict=True)
            )
            gw = v["grad_weight"] if wanted["grad_weight"] else ws["grad_weight"]
            gb = v["grad_bias"] if wanted["grad_bias"] else ws["grad_bias"]
            gw_dtype = self.dtype("grad_weight") if wanted["grad_weight"] else self.acc
            gb_dtype = self.dtype("grad_bias") if wanted["grad_bias"] else self.acc
            kern.finish_channels(
                v["weight"],
                (ws["invstd"], ws["sum_dy"], ws["sum_dy_dev"]),
                1.0 / self.count,
                a.mode != Mode.EVAL,
                (self.dtype("weight"), gw_dtype, gb_dtype),
                (ws["k"], ws["a"], ws["b"], gw, gb),
            )
            if wanted["grad_input"]:
                coefficients = tuple(
                    ws[n].reshape(self.channel_shape) for n in ("mean", "k", "a", "b")
                )
                kern.grad_input(data, coefficients, self.x_dtype, fused, v["grad_input"])
            if a.fusion == Fusion.BN_ADD_RELU:
                kern.masked_grad(v["grad_output"], v["output"], self.x_dtype, v["grad_z"])


class CupyBatchNormForwardTraining(_CupyKernel):
    """Training-mode forward: statistics, saved outputs, running update, normalized output."""

    scratch_names = ("mean", "var", "invstd", "k")

    def __init__(
        self, tensors: ForwardTrainingTensors, attributes: ForwardTrainingAttributes, device_id: int
    ) -> None:
        super().__init__(tensors, device_id)
        self.attributes = attributes
        self.plan_sums("statistics", [tensors.input])

    def run(self, ptrs: ForwardTrainingPointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels as kern

        a = self.attributes
        with cuda.on_device(self.device_id), cuda.stream_scope(stream, self.device_id):
            v, ws = self.views(ptrs, workspace)
            x = v["input"]
            self.channel_sums((x, x, x), ws["mean"], ws["partials"], (ws["mean"], ws["var"]))
            kern.invstd_from_var(ws["var"], self.acc, a.eps, ws["invstd"], self.acc_c, batch=True)
            kern.channel_scale(v["weight"], self.dtype("weight"), ws["invstd"], ws["k"], self.acc_c)
            kern.normalize(
                v["input"],
                v.get("z", v["input"]),
                ws["mean"].reshape(self.channel_shape),
                ws["k"].reshape(self.channel_shape),
                v["bias"].reshape(self.channel_shape),
                (self.x_dtype, self.dtype("bias")),
                a.fusion,
                v["output"],
            )
            for saved, value in (("saved_mean", ws["mean"]), ("saved_invstd", ws["invstd"])):
                kern.convert(value, self.acc, v[saved], self.dtype(saved))
            for running, value, correction in (
                ("running_mean", ws["mean"], 1.0),
                ("running_var", ws["var"], self.count / (self.count - 1)),
            ):
                if running in v:
                    kern.running_update(
                        v[running], self.dtype(running), value, a.momentum, correction
                    )


class CupyBatchNormForwardInference(_CupyKernel):
    """Inference-mode forward with fixed statistics."""

    scratch_names = ("mean", "invstd", "k")

    def __init__(
        self,
        tensors: ForwardInferenceTensors,
        attributes: ForwardInferenceAttributes,
        device_id: int,
    ) -> None:
        super().__init__(tensors, device_id)
        self.attributes = attributes

    def run(self, ptrs: ForwardInferencePointers, workspace: int, stream: int) -> None:
        from . import cupy_kernels as kern

        with cuda.on_device(self.device_id), cuda.stream_scope(stream, self.device_id):
            v, ws = self.views(ptrs, workspace)
            kern.convert(v["running_mean"], self.dtype("running_mean"), ws["mean"], self.acc)
            kern.invstd_from_var(
                v["running_var"],
                self.dtype("running_var"),
                self.attributes.eps,
                ws["invstd"],
                self.acc_c,
            )
            kern.channel_scale(v["weight"], self.dtype("weight"), ws["invstd"], ws["k"], self.acc_c)
            kern.normalize(
                v["input"],
                v["input"],
                ws["mean"].reshape(self.channel_shape),
                ws["k"].reshape(self.channel_shape),
                v["bias"].reshape(self.channel_shape),
                (self.x_dtype, self.dtype("bias")),
                Fusion.BN,
                v["output"],
            )
