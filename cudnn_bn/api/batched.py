"""``batch_norm_backward_batched``: B problems as one backward call.

functorch's batching rule for batch norm (``batch_norm_batch_rule``, seed 002) folds the batch
dimension into the channels (``reshape_dim_into(bdim, 1, input)``): ``(B, N, C, ...)`` data
becomes ``(N, B*C, ...)`` (a view where the strides allow, else one copy by the arrays' own
library), per-channel operands become ``(B*C,)``, and one ``batch_norm_backward`` runs every
problem at once; the results are views of that call's outputs shaped ``(B, N, C, ...)`` and
``(B, C)``. Every operand is checked through the door first, so B = 0 validates as much as
any other batch.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import NUMPY, TORCH, Operand, common_place, operand
from ..arrays.cuda_interface import is_cupy
from ..backends.host import host_array
from ..enums import DataType, Device, Status
from ..errors import InfiniError
from ..ops.batch_norm_backward import parse_fusion, validate_tensors
from ..ops.validation import check_eps, check_output_mask
from ..problems import BackwardTensors, Fusion
from ..tensor import TensorDesc
from .backward import batch_norm_backward, statistics
from .outputs import packed_like, statistics_dtype
from .spelling import array_api
from .streams import call_stream

_DATA = ("input", "grad_output", "output")
_PER_CHANNEL = ("weight", "running_mean", "running_var", "saved_mean", "saved_invstd", "bias")


def _native(op: Operand, array: Any, kind: Any) -> Any:
    """An array over ``op``'s memory in the input's library ``kind`` where the operand is on
    the host (the copies below assign one into the other with ``[...] =``, which neither
    NumPy, from a torch tensor that requires grad, nor torch, from a NumPy array, can do),
    else in its own. torch views no negative strides: those are copied."""
    if op.device == Device.CPU and kind is NUMPY:
        return host_array(op.ptr, op.desc, readonly=bool(op.readonly))
    if op.kind is NUMPY:  # on the host, under torch data
        import torch

        view = host_array(op.ptr, op.desc)  # only read
        if any(s < 0 for s in view.strides):
            view = view.copy()
        if op.desc.dtype == DataType.BF16:
            return torch.from_numpy(view.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(view)
    if op.kind is TORCH or is_cupy(op.owner):
        return op.owner
    import cupy

    return cupy.asarray(array)


def _fold(op: Operand, array: Any, kind: Any, made: Callable[[TensorDesc], Any]) -> Any:
    """``(B, N, C, ...)`` data as ``(N, B*C, ...)``: a view where B's stride is C channel
    strides, else a copy into a new packed ``(N, B, C, ...)`` array. NumPy, CuPy and torch
    share the methods used (``swapaxes``, ``reshape``, ``[...] =``)."""
    x = op.desc
    batch, n, channels, rest = x.shape[0], x.shape[1], x.shape[2], x.shape[3:]
    swapped = _native(op, array, kind).swapaxes(0, 1)
    if x.strides[0] != channels * x.strides[2]:
        copy = made(TensorDesc.contiguous(x.dtype, (n, batch, channels, *rest)))
        copy[...] = swapped
        swapped = copy
    return swapped.reshape(n, batch * channels, *rest)


def _tile(op: Operand, array: Any, kind: Any, batch: int, made: Callable[[TensorDesc], Any]) -> Any:
    """A per-channel operand for every problem, ``(B*C,)``: rows of a ``(B, C)`` one, or a
    shared ``(C,)`` one repeated."""
    native = _native(op, array, kind)
    if op.desc.ndim == 2:
        return native.reshape(-1) if op.desc.is_contiguous() else _copy(native, op, made)
    tiled = made(TensorDesc.contiguous(op.desc.dtype, (batch, *op.desc.shape)))
    tiled[...] = native
    return tiled.reshape(-1)


def _copy(native: Any, op: Operand, made: Callable[[TensorDesc], Any]) -> Any:
    copy = made(TensorDesc.contiguous(op.desc.dtype, op.desc.shape))
    copy[...] = native
    return copy.reshape(-1)


def _check_shapes(ops: dict[str, Operand]) -> tuple[int, int]:
    """``(B, C)``: data operands ``(B, N, C, ...)`` like ``input``, per-channel ones ``(C,)``
    or ``(B, C)``."""
    x = ops["input"].desc.shape
    if len(x) < 3:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"input has shape {x}; expected (B, N, C, ...)")
    batch, channels = x[0], x[2]
    for name in _DATA[1:]:
        if name in ops and ops[name].desc.shape != x:
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {ops[name].desc.shape}; expected {x} as input",
            )
    for name in _PER_CHANNEL:
        if name in ops and ops[name].desc.shape not in ((channels,), (batch, channels)):
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {ops[name].desc.shape}; expected ({channels},) or "
                f"({batch}, {channels})",
            )
    return batch, channels


def _no_problems(
    ops: dict[str, Operand], made: Callable[[TensorDesc], Any], mask: tuple, wants_z: bool
) -> tuple[Any, ...]:
    """B = 0: the operator's own checks on one problem's layout (data ``(N, C, ...)``,
    per-channel ``(C,)``), then empty results shaped as a batch's."""
    one = {
        n: TensorDesc(op.desc.dtype, op.desc.shape[1:], op.desc.strides[1:])
        if n in _DATA or op.desc.ndim == 2
        else op.desc
        for n, op in ops.items()
    }
    x = one["input"]
    w = one.get("weight") or TensorDesc.contiguous(statistics_dtype(x), x.shape[1:2])
    per_channel = TensorDesc.contiguous(w.dtype, w.shape)
    saved = "saved_mean" in one
    validate_tensors(
        BackwardTensors(
            packed_like(x), per_channel, per_channel, x, one["grad_output"], w,
            one.get("saved_mean" if saved else "running_mean"),
            one.get("saved_invstd" if saved else "running_var"),
            one.get("output"), one.get("bias"), packed_like(x) if wants_z else None,
        )
    )  # fmt: skip
    batch_shape = ops["input"].desc.shape
    data = made(TensorDesc.contiguous(x.dtype, batch_shape))
    grads = [made(TensorDesc.contiguous(w.dtype, (0, *w.shape))) for _ in range(2)]
    wanted = (mask[0], mask[1] and "weight" in ops, mask[2])
    results = [g if m else None for g, m in zip((data, *grads), wanted, strict=True)]
    return (
        (*results, made(TensorDesc.contiguous(x.dtype, batch_shape))) if wants_z else tuple(results)
    )


@array_api
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
    ``bias`` and the statistics are ``(C,)``, shared, or ``(B, C)``, one row per problem
    (``weight=None``: ones, no grad_weight). Returns ``grad_input`` shaped like ``input`` and
    ``grad_weight``/``grad_bias`` shaped ``(B, C)``; the other options are
    ``batch_norm_backward``'s (a fused one takes no reserve, each problem's would differ, so
    it runs where it needs none: the CuPy engine on NVIDIA).
    """
    statistics(mode, running_mean, running_var, saved_mean, saved_invstd)
    check_eps(eps)
    check_output_mask(output_mask)
    wants_z = parse_fusion(fusion) == Fusion.BN_ADD_RELU
    arrays = dict(
        input=input,
        grad_output=grad_output,
        output=output,
        weight=weight,
        running_mean=running_mean,
        running_var=running_var,
        saved_mean=saved_mean,
        saved_invstd=saved_invstd,
        bias=bias,
    )
    for name in ("input", "grad_output"):
        if arrays[name] is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")
    present = {n: a for n, a in arrays.items() if a is not None}
    device, device_id = common_place(present)
    call_on = call_stream(stream, input, device, device_id)
    consumer = None if device.name == "CPU" else call_on
    ops = {n: operand(n, a, consumer) for n, a in present.items()}
    batch, channels = _check_shapes(ops)
    kind = ops["input"].kind

    def made(desc: TensorDesc) -> Any:
        return kind.allocator(input, desc)()[0]

    if batch == 0:  # nothing to compute: checked as one problem, empty results
        with kind.scope(input, call_on, device_id):
            return _no_problems(ops, made, check_output_mask(output_mask), wants_z)
    with kind.scope(input, call_on, device_id):
        folded = {n: _fold(ops[n], present[n], kind, made) for n in _DATA if n in ops}
        folded |= {
            n: _tile(ops[n], present[n], kind, batch, made) for n in _PER_CHANNEL if n in ops
        }
        grads = batch_norm_backward(
            folded["input"],
            folded["grad_output"],
            folded.get("weight"),
            folded.get("running_mean"),
            folded.get("running_var"),
            saved_mean=folded.get("saved_mean"),
            saved_invstd=folded.get("saved_invstd"),
            output=folded.get("output"),
            bias=folded.get("bias"),
            eps=eps,
            mode=mode,
            stream=call_on if consumer is not None else None,
            output_mask=output_mask,
            fusion=fusion,
            persistent=persistent,
        )
    x = ops["input"].desc.shape
    data_shape = (x[1], batch, channels, *x[3:])
    unfolded = [
        None if g is None else g.reshape(data_shape).swapaxes(0, 1) for g in (grads[0], *grads[3:])
    ]
    per_channel = [None if g is None else g.reshape(batch, channels) for g in grads[1:3]]
    return (unfolded[0], *per_channel, *unfolded[1:]) if wants_z else (unfolded[0], *per_channel)
