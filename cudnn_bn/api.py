"""The array API: batch-norm passes over NumPy, CuPy and torch arrays; raises ``InfiniError``.

Each call turns its arrays into (descriptor, pointer) pairs, fetches a cached operator
descriptor for that exact problem, allocates outputs and workspace with the input's own
library, and computes on the caller's stream (or the library's current one on the arrays'
device). Everything follows the arrays' device, and every allocation comes from the call's
stream (``arrays.allocation_scope``).
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from .arrays import (
    Operand,
    allocation_scope,
    buffer_address,
    check_written,
    common_place,
    empty_like,
    operand,
    workspace_like,
)
from .descriptor_cache import DescriptorCache
from .enums import DataType, Device, Status
from .errors import InfiniError, raises_only_infini_errors
from .ops.batch_norm_backward import BatchNormBackwardDescriptor, parse_fusion, parse_mode
from .ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from .ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from .ops.validation import (
    HALF_DTYPES,
    check_eps,
    check_flag,
    check_fraction,
    check_output_mask,
)
from .problems import BackwardTensors, ForwardInferenceTensors, ForwardTrainingTensors, Fusion, Mode
from .runtime import Handle
from .tensor import TensorDesc

descriptor_cache = DescriptorCache()

# The operators name tensor descriptors (``input_desc is NULL``); this API's callers pass
# arrays (``input is None``).
_array_api = raises_only_infini_errors(
    {
        f"{name}_desc": name
        for tensors in (BackwardTensors, ForwardTrainingTensors, ForwardInferenceTensors)
        for name in tensors._fields
    }
    | {"NULL": "None"}
)


class TrainingOutputs(tuple):
    """``(output, saved_mean, saved_invstd)`` of a training forward; ``.reserve`` is the
    reserve space (a byte array, or None when empty) its backward takes as ``reserve=``."""

    reserve: Any

    def __new__(
        cls, output: Any, saved_mean: Any, saved_invstd: Any, reserve: Any
    ) -> "TrainingOutputs":
        outputs = super().__new__(cls, (output, saved_mean, saved_invstd))
        outputs.reserve = reserve
        return outputs


class _Call:
    """One array-API call: its operands (all on one device), its stream on that device, and
    its allocations (on that device, from that stream)."""

    def __init__(self, arrays: dict[str, Any], stream: Any) -> None:
        if arrays["input"] is None:
            raise InfiniError(Status.NULL_POINTER, "input is None")
        self.like = arrays["input"]
        present = {n: a for n, a in arrays.items() if a is not None}
        self.device, self.device_id = common_place(present)
        self.stream = _stream(stream, self.like, self.device, self.device_id)
        consumer = None if self.device == Device.CPU else self.stream
        self.ops: dict[str, Operand] = {n: operand(n, a, consumer) for n, a in present.items()}

    def desc(self, name: str) -> TensorDesc | None:
        return self.ops[name].desc if name in self.ops else None

    def ptr(self, name: str) -> int:
        return self.ops[name].ptr if name in self.ops else 0

    def descriptor(self, key: tuple, build: Callable[[Handle], Any]) -> AbstractContextManager[Any]:
        """A lease on the cached descriptor for ``key`` on this call's device, built on a
        miss: eviction by another thread cannot close it while the lease is held."""
        handle = Handle(self.device, self.device_id)
        return descriptor_cache.lease((self.device, self.device_id, *key), lambda: build(handle))

    def allocating(self) -> AbstractContextManager:
        """The block in which the call allocates and computes: its device current, its
        stream the allocating one."""
        return allocation_scope(self.like, self.stream, self.device_id)

    def empty(self, desc: TensorDesc) -> tuple[Any, int]:
        """A new array of the input's kind for ``desc``, and its data pointer."""
        array = empty_like(self.like, desc.shape, desc.strides, desc.dtype)
        return array, operand("output", array).ptr

    def scratch(self, nbytes: int) -> tuple[Any, int]:
        """``nbytes`` of scratch (kept alive by the caller)."""
        return workspace_like(self.like, nbytes)


def resolve_stream(stream: Any, like: Any) -> int:
    """The ``cudaStream_t`` address a call on ``like``'s device runs on for ``stream=``
    (0 on the CPU), as every array-API pass resolves it: for code that composes passes."""
    device, device_id = common_place({"input": like})
    return _stream(stream, like, device, device_id)


def _stream(stream: Any, like: Any, device: Device, device_id: int) -> int:
    """A ``cudaStream_t`` address from an int, a CuPy or torch stream, a ``__cuda_stream__``
    object, or the current stream of the arrays' device (torch's for torch tensors, else
    CuPy's)."""
    if device == Device.CPU:
        return 0
    if stream is None:
        if type(like).__module__.startswith("torch"):
            import torch

            return torch.cuda.current_stream(like.device).cuda_stream
        from .backends.cuda import current_stream

        return current_stream(device_id)
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version 0, address)
        ptr = stream.__cuda_stream__()[1]
    elif hasattr(stream, "ptr") or hasattr(stream, "cuda_stream"):
        ptr = stream.ptr if hasattr(stream, "ptr") else stream.cuda_stream
    else:
        raise InfiniError(
            Status.BAD_PARAM,
            f"stream must be an int, a CuPy or torch stream, or None; got {stream!r}",
        )
    # CuPy streams know their device as .device_id (-1: unknown), torch's as .device.
    owner = getattr(stream, "device_id", getattr(getattr(stream, "device", None), "index", None))
    if isinstance(owner, int) and owner >= 0 and owner != device_id:
        raise InfiniError(
            Status.BAD_PARAM,
            f"stream is on device {owner} but the arrays are on NVIDIA:{device_id}",
        )
    return int(ptr)


def _like(desc: TensorDesc, dtype: DataType | None = None) -> TensorDesc:
    """A packed tensor of ``desc``'s shape and layout (and ``dtype``, default its own)."""
    return TensorDesc(dtype or desc.dtype, desc.shape, desc.packed_strides())


def _statistics_dtype(x: TensorDesc) -> DataType:
    """What saved statistics are stored as: F32 for F16/BF16 input (as cuDNN computes them)."""
    return DataType.F32 if x.dtype in HALF_DTYPES else x.dtype


@_array_api
def batch_norm_backward(
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    *,
    eps: float = 1e-5,
    mode: str = "train",
    saved_mean: Any = None,
    saved_invstd: Any = None,
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = (True, True, True),
    fusion: str | None = None,
    output: Any = None,
    bias: Any = None,
    reserve: Any = None,
    persistent: bool | None = None,
    check_overflow: bool = False,
) -> tuple[Any, ...]:
    """``(grad_input, grad_weight, grad_bias)`` of batch norm, as arrays of ``input``'s kind.

    ``mode`` picks the statistics: ``"train"`` recomputes the batch mean and biased
    variance from ``input`` (``running_*`` are checked, not read, and may be None);
    ``"saved"`` reads ``running_mean``/``running_var`` as the batch mean and biased variance,
    or takes ``saved_mean``/``saved_invstd`` exactly as a forward pass saved them;
    ``"eval"`` treats ``running_*`` as fixed statistics.

    ``output_mask`` asks only for some gradients: the others come back as None and are never
    written. ``fusion`` (``"relu"``, ``"add_relu"``) is the backward of a fused forward: it
    needs that forward's ``output`` and ``bias`` and takes its ``reserve`` (without one it
    runs on the CuPy engine on NVIDIA), and with ``"add_relu"`` also returns ``grad_z``, the
    residual's gradient, as a fourth result. ``persistent=False``
    forces cuDNN's SPATIAL mode where SPATIAL_PERSISTENT would be used (channels-last).
    ``check_overflow=True`` is a debug aid that synchronizes: after a cuDNN
    SPATIAL_PERSISTENT pass it waits (``cudnnQueryRuntimeError``) and warns with a
    ``RuntimeWarning`` if cuDNN reports a numerical overflow, as CuPy 13's ``debug`` did.
    """
    return _backward(
        dict(
            input=input,
            grad_output=grad_output,
            weight=weight,
            running_mean=running_mean,
            running_var=running_var,
            saved_mean=saved_mean,
            saved_invstd=saved_invstd,
            output=output,
            bias=bias,
        ),
        None,
        eps,
        mode,
        stream,
        output_mask,
        fusion,
        reserve,
        persistent,
        check_overflow,
    )


def _backward(
    arrays: dict[str, Any],
    out: dict[str, Any] | None,
    eps: float,
    mode: str,
    stream: Any,
    output_mask: tuple[bool, bool, bool],
    fusion_name: str | None,
    reserve: Any,
    persistent: bool | None,
    check_overflow: bool = False,
) -> tuple[Any, ...]:
    """Batch-norm backward writing into ``out`` (arrays by name) or into new arrays."""
    parsed, fusion = parse_mode(mode), parse_fusion(fusion_name)
    saved_mean, saved_invstd = arrays.pop("saved_mean"), arrays.pop("saved_invstd")
    if saved_mean is not None or saved_invstd is not None:
        if parsed != Mode.SAVED:
            raise InfiniError(
                Status.BAD_PARAM, f"saved_mean/saved_invstd need mode='saved', got mode={mode!r}"
            )
        if arrays["running_mean"] is not None or arrays["running_var"] is not None:
            raise InfiniError(
                Status.BAD_PARAM,
                "give running_mean/running_var or saved_mean/saved_invstd, not both",
            )
        if saved_mean is None or saved_invstd is None:
            missing = "saved_mean" if saved_mean is None else "saved_invstd"
            raise InfiniError(
                Status.NULL_POINTER, f"{missing} is None but the other saved statistic is given"
            )
        parsed = Mode.SAVED_INVSTD
        arrays.update(running_mean=saved_mean, running_var=saved_invstd)
    for name in ("input", "grad_output", "weight"):
        if arrays[name] is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
    call = _Call(arrays, stream)
    x, w = call.desc("input"), call.desc("weight")
    per_channel = TensorDesc.contiguous(w.dtype, w.shape)
    wants_z = fusion == Fusion.BN_ADD_RELU
    tensors = BackwardTensors(
        _like(x),
        per_channel,
        per_channel,
        x,
        call.desc("grad_output"),
        w,
        call.desc("running_mean"),
        call.desc("running_var"),
        call.desc("output"),
        call.desc("bias"),
        _like(x) if wants_z else None,
    )
    # Validated values in the key: (1, 1, 1) == (True, True, True) must not hit the cache.
    output_mask = check_output_mask(output_mask)
    persistent = check_flag("persistent", persistent)
    # A fused backward given no reserve runs where it needs none (the CuPy engine).
    flags = (persistent, reserve is not None, check_flag("check_overflow", check_overflow) is True)
    key = ("backward", tensors, parsed, check_eps(eps), fusion, output_mask, *flags)
    with (
        call.descriptor(
            key,
            lambda handle: BatchNormBackwardDescriptor(
                handle,
                *tensors[:8],
                output_desc=tensors.output,
                bias_desc=tensors.bias,
                grad_z_desc=tensors.grad_z,
                eps=eps,
                mode=parsed,
                fusion=fusion,
                output_mask=output_mask,
                persistent=persistent,
                reserve=flags[1],
                check_overflow=flags[2],
            ),
        ) as descriptor,
        call.allocating(),
    ):
        names = ("grad_input", "grad_weight", "grad_bias") + (("grad_z",) if wants_z else ())
        wanted = (*descriptor.attributes.output_mask, wants_z)
        reserve_ptr, reserve_size = buffer_address("reserve", reserve)
        results, pointers = {}, {}
        for name, needed in zip(names, wanted, strict=False):
            if needed and out is not None:
                results[name], pointers[name] = out[name], operand(name, out[name]).ptr
            elif needed:
                results[name], pointers[name] = call.empty(getattr(tensors, name))
        _workspace, workspace_ptr = call.scratch(descriptor.workspace_size)
        descriptor.compute(
            workspace_ptr,
            descriptor.workspace_size,
            *(pointers.get(n, 0) for n in ("grad_input", "grad_weight", "grad_bias")),
            *(
                call.ptr(n)
                for n in ("input", "grad_output", "weight", "running_mean", "running_var")
            ),
            call.stream,
            output=call.ptr("output"),
            bias=call.ptr("bias"),
            grad_z=pointers.get("grad_z", 0),
            reserve=reserve_ptr,
            reserve_size=reserve_size,
        )
    return tuple(results.get(name) for name in names)


def _check_batch(batch: int, batched: dict[str, Any], shared: dict[str, Any]) -> None:
    """``batched`` arrays are ``(B, ...)`` and ``shared`` ones ``(C,)`` or ``(B, C)``."""
    for name, array in batched.items():
        shape = None if array is None else operand(name, array).desc.shape
        if shape is not None and shape[:1] != (batch,):
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {shape}; expected ({batch}, N, C, ...) as input",
            )
    for name, array in shared.items():
        shape = None if array is None else operand(name, array).desc.shape
        if shape is not None and not (len(shape) == 1 or (len(shape) == 2 and shape[0] == batch)):
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE, f"{name} has shape {shape}; expected (C,) or ({batch}, C)"
            )


@_array_api
def batch_norm_backward_batched(
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    *,
    saved_mean: Any = None,
    saved_invstd: Any = None,
    output: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    mode: str = "train",
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = (True, True, True),
    fusion: str | None = None,
    persistent: bool | None = None,
) -> tuple[Any, ...]:
    """Batch-norm backward of ``B`` independent problems in one call (functorch's vmap rule).

    ``input``, ``grad_output`` (and a fused ``output``) are ``(B, N, C, ...)``; ``weight``,
    ``bias`` and the statistics are ``(C,)``, shared, or ``(B, C)``, one row per problem.
    Returns ``grad_input`` shaped like ``input`` and ``grad_weight``/``grad_bias`` shaped
    ``(B, C)``, written in place problem by problem through one cached descriptor; the other
    options are ``batch_norm_backward``'s (a fused one takes no reserve, each problem's would
    differ, so it runs where it needs none: the CuPy engine on NVIDIA).
    """
    for name, array in (("input", input), ("grad_output", grad_output), ("weight", weight)):
        if array is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
    call = _Call({"input": input}, stream)  # the batch's device and stream
    x = call.desc("input")
    if x.ndim < 3:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"input has shape {x.shape}; expected (B, N, C, ...)"
        )
    w = operand("weight", weight).desc
    batch, channels = x.shape[0], x.shape[2]
    batched = {"input": input, "grad_output": grad_output, "output": output}
    shared = dict(
        weight=weight,
        running_mean=running_mean,
        running_var=running_var,
        saved_mean=saved_mean,
        saved_invstd=saved_invstd,
        bias=bias,
    )
    _check_batch(batch, batched, shared)
    inner = TensorDesc(x.dtype, x.shape[1:], x.strides[1:])
    data = TensorDesc(x.dtype, x.shape, (inner.numel, *_like(inner).strides))
    per_channel = TensorDesc.contiguous(w.dtype, (batch, channels))
    wants_z = parse_fusion(fusion) == Fusion.BN_ADD_RELU
    output_mask = check_output_mask(output_mask)
    shapes = {
        "grad_input": data,
        "grad_weight": per_channel,
        "grad_bias": per_channel,
        "grad_z": data,
    }
    wanted = dict(
        zip(("grad_input", "grad_weight", "grad_bias"), output_mask, strict=True), grad_z=wants_z
    )
    with call.allocating():
        out = {n: call.empty(d)[0] for n, d in shapes.items() if wanted[n]}
    for b in range(batch):
        arrays = {n: (a[b] if a is not None else None) for n, a in batched.items()}
        arrays.update(
            {n: (a[b] if a is not None and len(a.shape) == 2 else a) for n, a in shared.items()}
        )
        _backward(
            arrays,
            {n: a[b] for n, a in out.items()},
            eps,
            mode,
            stream,
            output_mask,
            fusion,
            None,
            persistent,
        )
    names = ("grad_input", "grad_weight", "grad_bias") + (("grad_z",) if wants_z else ())
    return tuple(out.get(n) for n in names)


@_array_api
def batch_norm_forward_training(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stream: Any = None,
    fusion: str | None = None,
    z: Any = None,
    persistent: bool | None = None,
    check_overflow: bool = False,
) -> TrainingOutputs:
    """Training-mode batch norm: ``(output, saved_mean, saved_invstd)`` with ``.reserve``.

    Statistics are per channel (axis 1) over every other axis; ``running_mean`` and
    ``running_var`` (either may be None) are updated in place with PyTorch's semantics:
    ``running = (1 - momentum) * running + momentum * batch``, the batch variance unbiased.
    ``saved_invstd`` is ``1/sqrt(biased var + eps)``; both saved statistics are F32 for
    F16/BF16 input and go straight into ``batch_norm_backward(..., mode="saved",
    saved_mean=..., saved_invstd=..., reserve=outputs.reserve)``. ``fusion`` ``"relu"`` or
    ``"add_relu"`` (with the residual ``z``) gives ``relu(bn(x) [+ z])``.
    ``check_overflow=True`` is ``batch_norm_backward``'s synchronizing debug aid.
    """
    fused = parse_fusion(fusion)
    call = _Call(
        dict(
            input=input,
            weight=weight,
            bias=bias,
            running_mean=running_mean,
            running_var=running_var,
            z=z,
        ),
        stream,
    )
    check_written(
        {n: call.ops[n] for n in ("running_mean", "running_var") if n in call.ops},
        {n: call.ops[n] for n in ("input", "weight", "bias", "z") if n in call.ops},
    )
    x, w = call.desc("input"), call.desc("weight")
    if x.ndim < 2:
        raise InfiniError(
            Status.BAD_TENSOR_SHAPE, f"input has shape {x.shape}; expected (N, C, ...)"
        )
    stats = TensorDesc.contiguous(_statistics_dtype(x), (x.shape[1],))
    tensors = ForwardTrainingTensors(
        _like(x),
        stats,
        stats,
        x,
        w,
        call.desc("bias"),
        call.desc("running_mean"),
        call.desc("running_var"),
        call.desc("z"),
    )
    momentum = check_fraction("momentum", momentum)
    persistent = check_flag("persistent", persistent)
    check = check_flag("check_overflow", check_overflow) is True
    key = ("forward_training", tensors, check_eps(eps), momentum, fused, persistent, check)
    with (
        call.descriptor(
            key,
            lambda handle: BatchNormForwardTrainingDescriptor(
                handle,
                *tensors[:8],
                z_desc=tensors.z,
                eps=eps,
                momentum=momentum,
                fusion=fused,
                persistent=persistent,
                check_overflow=check,
            ),
        ) as descriptor,
        call.allocating(),
    ):
        (output, output_ptr), (mean, mean_ptr), (invstd, invstd_ptr) = (
            call.empty(tensors.output),
            call.empty(stats),
            call.empty(stats),
        )
        reserve, reserve_ptr = call.scratch(descriptor.reserve_size)
        _workspace, workspace_ptr = call.scratch(descriptor.workspace_size)
        descriptor.compute(
            workspace_ptr,
            descriptor.workspace_size,
            reserve_ptr,
            descriptor.reserve_size,
            output_ptr,
            mean_ptr,
            invstd_ptr,
            *(call.ptr(n) for n in ("input", "weight", "bias", "running_mean", "running_var")),
            call.stream,
            z=call.ptr("z"),
        )
    return TrainingOutputs(output, mean, invstd, reserve)


@_array_api
def batch_norm_forward_inference(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    *,
    eps: float = 1e-5,
    stream: Any = None,
) -> Any:
    """Inference-mode batch norm with fixed statistics, as an array of ``input``'s kind."""
    call = _Call(
        dict(
            input=input,
            weight=weight,
            bias=bias,
            running_mean=running_mean,
            running_var=running_var,
        ),
        stream,
    )
    names = ("input", "weight", "bias", "running_mean", "running_var")
    x = call.desc("input")
    tensors = ForwardInferenceTensors(_like(x), *(call.desc(n) for n in names))
    with (
        call.descriptor(
            ("forward_inference", tensors, check_eps(eps)),
            lambda handle: BatchNormForwardInferenceDescriptor(handle, *tensors, eps=eps),
        ) as descriptor,
        call.allocating(),
    ):
        output, output_ptr = call.empty(tensors.output)
        _workspace, workspace_ptr = call.scratch(descriptor.workspace_size)
        descriptor.compute(
            workspace_ptr,
            descriptor.workspace_size,
            output_ptr,
            *(call.ptr(n) for n in names),
            call.stream,
        )
    return output


__all__ = [
    "TrainingOutputs",
    "batch_norm_backward",
    "batch_norm_backward_batched",
    "batch_norm_forward_inference",
    "batch_norm_forward_training",
    "descriptor_cache",
]
