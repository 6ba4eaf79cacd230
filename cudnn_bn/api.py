"""The array API: batch-norm passes over NumPy, CuPy and torch arrays; raises ``InfiniError``.

Each call turns its arrays into (descriptor, pointer) pairs, fetches a cached operator
descriptor for that exact problem, allocates outputs and workspace with the input's own
library, and computes on the caller's stream (or the library's current one).
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .arrays import Operand, empty_like, operand, workspace_like
from .descriptor_cache import DescriptorCache
from .enums import Device, Status
from .errors import InfiniError
from .ops.batch_norm_backward import BatchNormBackwardDescriptor, parse_mode
from .ops.validation import check_eps
from .problems import BackwardTensors, Mode
from .runtime import Handle
from .tensor import TensorDesc, contiguous_strides

descriptor_cache = DescriptorCache()


def _same_device(operands: dict[str, Operand]) -> tuple[Device, int]:
    places = {(op.device, op.device_id) for op in operands.values()}
    if len(places) > 1:
        where = ", ".join(
            f"{name} on {op.device.name}:{op.device_id}" for name, op in operands.items()
        )
        raise InfiniError(Status.BAD_PARAM, f"arrays must share one device; got {where}")
    return places.pop()


def _output_strides(desc: TensorDesc) -> tuple[int, ...]:
    """Strides for a gradient of ``desc``: its own layout if packed, else row-major."""
    if desc.is_channels_last():
        order = (0, *range(2, desc.ndim), 1)
        packed = contiguous_strides(tuple(desc.shape[i] for i in order))
        strides = [0] * desc.ndim
        for axis, stride in zip(order, packed, strict=True):
            strides[axis] = stride
        return tuple(strides)
    return contiguous_strides(desc.shape)


def _on_device(device: Device, device_id: int) -> AbstractContextManager:
    if device == Device.CPU:
        return nullcontext()
    from .backends.cuda import on_device

    return on_device(device_id)


def _stream(stream: Any, like: Any, device: Device) -> int:
    """A ``cudaStream_t`` address from an int, a CuPy or torch stream, or the current one."""
    if device == Device.CPU:
        return 0
    if stream is None:
        if type(like).__module__.startswith("torch"):
            import torch

            return torch.cuda.current_stream(like.device).cuda_stream
        from .backends.cuda import current_stream

        return current_stream()
    if isinstance(stream, int):
        return stream
    for attribute in ("ptr", "cuda_stream"):
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise InfiniError(
        Status.BAD_PARAM, f"stream must be an int, a CuPy or torch stream, or None; got {stream!r}"
    )


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
) -> tuple[Any, Any, Any]:
    """``(grad_input, grad_weight, grad_bias)`` of batch norm, as arrays of ``input``'s kind.

    ``mode`` picks the statistics (DESIGN.md): ``"train"`` recomputes the batch mean and biased
    variance from ``input`` (``running_*`` are checked, not read, and may be None);
    ``"saved"`` reads ``running_mean``/``running_var`` as the batch mean and biased variance,
    or takes ``saved_mean``/``saved_invstd`` exactly as a forward pass saved them;
    ``"eval"`` treats ``running_*`` as fixed statistics.
    """
    parsed = parse_mode(mode)
    stats = {"running_mean": running_mean, "running_var": running_var}
    if saved_mean is not None or saved_invstd is not None:
        if parsed != Mode.SAVED:
            raise InfiniError(
                Status.BAD_PARAM, f"saved_mean/saved_invstd need mode='saved', got mode={mode!r}"
            )
        if running_mean is not None or running_var is not None:
            raise InfiniError(
                Status.BAD_PARAM,
                "give running_mean/running_var or saved_mean/saved_invstd, not both",
            )
        if saved_mean is None or saved_invstd is None:
            missing = "saved_mean" if saved_mean is None else "saved_invstd"
            raise InfiniError(
                Status.NULL_POINTER, f"{missing} is None but the other saved statistic is given"
            )
        parsed, stats = Mode.SAVED_INVSTD, {"running_mean": saved_mean, "running_var": saved_invstd}
    arrays = {"input": input, "grad_output": grad_output, "weight": weight, **stats}
    ops = {name: operand(name, array) for name, array in arrays.items() if array is not None}
    for name in ("input", "grad_output", "weight"):
        if name not in ops:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
    device, device_id = _same_device(ops)

    x, w = ops["input"].desc, ops["weight"].desc
    per_channel = TensorDesc.contiguous(w.dtype, w.shape)
    tensors = BackwardTensors(
        TensorDesc(x.dtype, x.shape, _output_strides(x)),
        per_channel,
        per_channel,
        x,
        ops["grad_output"].desc,
        w,
        ops["running_mean"].desc if "running_mean" in ops else None,
        ops["running_var"].desc if "running_var" in ops else None,
    )
    key = (device, device_id, tensors, parsed, check_eps(eps))
    desc = descriptor_cache.get(
        key,
        lambda: BatchNormBackwardDescriptor(
            Handle(device, device_id), *tensors, eps=eps, mode=parsed
        ),
    )

    stream_ptr = _stream(stream, input, device)
    with _on_device(device, device_id):
        grad_input = empty_like(input, x.shape, tensors.grad_input.strides)
        grad_weight = empty_like(weight, w.shape, per_channel.strides)
        grad_bias = empty_like(weight, w.shape, per_channel.strides)
        # Held until return: the allocator may reuse it only after the queued work.
        _workspace, workspace_ptr = workspace_like(input, desc.workspace_size, stream_ptr)
        outputs = [operand("output", a).ptr for a in (grad_input, grad_weight, grad_bias)]
        inputs = [ops[name].ptr if name in ops else 0 for name in BackwardTensors._fields[3:]]
        desc.compute(workspace_ptr, desc.workspace_size, *outputs, *inputs, stream=stream_ptr)
    return grad_input, grad_weight, grad_bias
