"""A synchronized pass's arguments, checked on this rank before its first collective.

Every check that can fail runs here, on the caller's own arrays, each described through
``cudnn_bn.arrays.operand`` (the array API's one door to every array protocol): kinds,
devices (and the communicator's), the stream, shapes, dtypes, strides, arrays written in
place that are read-only, share memory with another argument or are torch tensors torch
would not write in place (``refuse_grad_write``), and the scalars. The
header exchange that follows carries this rank's verdict to every rank, so all ranks go on
or all raise; after it nothing a caller passed can fail. Messages name the arguments as
the caller spells them.
"""

import math
from dataclasses import dataclass
from typing import Any

from ..api import resolve_stream
from ..arrays import Operand, check_written, common_place, operand
from ..arrays.torch_tensors import is_tensor, refuse_grad_write
from ..enums import Device, Status
from ..errors import InfiniError
from ..ops.validation import (
    check_channel_tensor,
    check_data_tensor,
    check_eps,
    check_fraction,
    check_like,
    check_output_mask,
)
from ..tensor import TensorDesc
from .communicators import Communicator
from .kinds import kind_of


@dataclass
class Checked:
    """One rank's checked pass: the data's kind, the operands by name (those given), where
    they live, the stream the pass runs on, and the values per channel on this rank."""

    kind: Any
    ops: dict[str, Operand]
    device: Device
    device_id: int
    stream: int
    count: int

    @property
    def channels(self) -> int:
        return self.ops["input"].desc.shape[1]


def _require(arrays: dict[str, Any]) -> None:
    for name, array in arrays.items():
        if array is None:
            raise InfiniError(Status.NULL_POINTER, f"{name} is None")


def _some_sample(desc: TensorDesc) -> TensorDesc:
    """``desc`` with N = 1 where it has N = 0: a rank may bring no samples, but everything
    else about its input is checked as for one."""
    if desc.ndim and desc.shape[0] == 0:
        return TensorDesc(desc.dtype, (1, *desc.shape[1:]), desc.strides)
    return desc


def _check(
    comm: Communicator, arrays: dict[str, Any], data: tuple[str, ...], stream: Any
) -> Checked:
    """The checks both passes share, on ``arrays`` by name (None: not given); ``data`` are
    the ``(N, C, ...)`` arrays, the first the input, the others per channel."""
    present = {n: a for n, a in arrays.items() if a is not None}
    kinds = {n: kind_of(n, a) for n, a in present.items()}
    for name in data[1:]:
        if kinds[name] is not kinds["input"]:
            raise InfiniError(
                Status.BAD_PARAM,
                f"{name} is a {type(present[name]).__name__} but input is a "
                f"{type(present['input']).__name__}; both must be of one kind",
            )
    device, device_id = common_place(present)
    if comm.device is not None and (device, device_id) != comm.device:
        raise InfiniError(
            Status.BAD_PARAM,
            f"the arrays are on {device.name}:{device_id} but the {comm.engine} "
            f"communicator's device is {comm.device[0].name}:{comm.device[1]}",
        )
    pass_stream = resolve_stream(stream, present["input"])
    consumer = None if device == Device.CPU else pass_stream
    ops = {n: operand(n, a, consumer) for n, a in present.items()}
    x = ops["input"].desc
    for name in data:
        check_data_tensor(name, _some_sample(ops[name].desc))
        check_like(name, ops[name].desc, "input", x)
    for name, op in ops.items():
        if name not in data:
            check_channel_tensor(name, op.desc, x.shape[1], x.dtype)
    count = math.prod(x.shape) // x.shape[1]
    return Checked(kinds["input"], ops, device, device_id, pass_stream, count)


def check_forward(
    comm: Communicator,
    arrays: dict[str, Any],
    momentum: object,
    eps: object,
    stream: Any,
) -> tuple[Checked, float, float]:
    """The forward's arguments (``input``, ``weight``, ``bias``, ``running_mean``,
    ``running_var``; all but the input may be None), checked: ``(checked, momentum, eps)``."""
    _require({"input": arrays["input"]})
    momentum, eps = check_fraction("momentum", momentum), check_eps(eps)
    checked = _check(comm, arrays, ("input",), stream)
    ops = checked.ops
    written = {n: ops[n] for n in ("running_mean", "running_var") if n in ops}
    check_written(written, {n: op for n, op in ops.items() if n not in written})
    for name in written:  # torch's own rule for in-place writes, as the array API's
        if is_tensor(arrays[name]):
            refuse_grad_write(name, arrays[name])
    return checked, momentum, eps


def check_backward(
    comm: Communicator, arrays: dict[str, Any], output_mask: object, stream: Any
) -> tuple[Checked, tuple[bool, bool, bool]]:
    """The backward's arguments (``input``, ``grad_output``, ``weight`` which may be None,
    ``saved_mean``, ``saved_invstd``), checked: ``(checked, output_mask)``."""
    _require({n: a for n, a in arrays.items() if n != "weight"})
    mask = check_output_mask(output_mask)
    return _check(comm, arrays, ("input", "grad_output"), stream), mask
