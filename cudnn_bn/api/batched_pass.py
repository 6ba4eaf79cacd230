"""The batched backward's pass (``call.Pass``): ``B`` problems as one launch over the shared
call path, on either engine, with no copy or view by the arrays' library.

``(B, N, C, ...)`` data folds into ``(N, B*C, ...)`` by no view unless the strides allow
(``N`` is 1, say), and copying it in and out around a backward, array by array, cost more
than the pass (the CPU, 64 problems ``(4, 64, 7, 7)``: 2.35x one call of that size; on a
GPU's stand-ins, 19 library operations a call, 3.4x one call). So a batch is a pass of its
own (``call.run``: one read of the operands, one plan, one launch), whose plan holds one
backward descriptor, launched on the caller's pointers in one of two ways (``in_place``):

- in place, on the CPU for problems of ``MIN_VALUES`` or more (and everywhere for B = 0,
  whose one problem's layout is validated and nothing runs): one problem's descriptor (data
  ``(N, C, ...)``, per-channel ``(C,)``: the rows of ``(B, C)`` ones or a shared one), run
  on all ``B`` at pointer offsets (``OperatorDescriptor.launcher``'s ``batch``: the CPU
  kernel's ``batched()``, one call); outputs batch outermost, each problem's block laid
  out as the backward lays out one problem's.
- folded, for smaller problems on the CPU, whose fixed cost in the kernel (about 0.7 us
  each: its per-channel steps) is more than gathering them, and always on a GPU: the folded
  problem's descriptor (functorch's ``batch_norm_batch_rule``, seed 002: the batch in the
  channels), each operand that no packed view folds gathered into packed scratch by one
  table (``backends.gather``: the CPU engine's kernel, or one CUDA kernel launch into the
  plan's per-stream workspace), its outputs allocated in the folded problem's memory order,
  so that they are the batch's results as they are.

Both are validated by the backward's own build, on the problem it runs.
"""

from typing import Any

import numpy as np

from ..backends.gather import DeviceGather, HostGather, table_row
from ..enums import Device, Status
from ..errors import InfiniError
from ..ops.descriptor import Launch
from ..problems import BackwardTensors
from ..runtime import Handle
from ..tensor import ITEMSIZE, TensorDesc
from .backward import BACKWARD
from .call import Built

DATA = ("input", "grad_output", "output")
PER_CHANNEL = ("weight", "running_mean", "running_var", "saved_mean", "saved_invstd", "bias")
# Values per problem from which a batch runs in place: 64 problems at 1 thread took
# 0.7-0.9x the fold's time from 6272 values, 1.0x at 4096, 1.1-1.4x at 512-2048.
MIN_VALUES = 4096


def one_problem(name: str, desc: TensorDesc) -> TensorDesc:
    """One problem's layout of batched operand ``name``: data ``(N, C, ...)`` and ``(B, C)``
    per-channel rows without the batch axis; a shared ``(C,)`` one as it is."""
    if name in DATA or desc.ndim == 2:
        return TensorDesc(desc.dtype, desc.shape[1:], desc.strides[1:])
    return desc


def check_shapes(descs: dict[str, TensorDesc]) -> tuple[int, int]:
    """``(B, C)`` of a batch's operands (layouts by name): data ``(B, N, C, ...)`` like
    ``input``, per-channel ones ``(C,)`` or ``(B, C)``."""
    x = descs["input"].shape
    if len(x) < 3:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"input has shape {x}; expected (B, N, C, ...)")
    batch, channels = x[0], x[2]
    for name in DATA[1:]:
        if name in descs and descs[name].shape != x:
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {descs[name].shape}; expected {x} as input",
            )
    for name in PER_CHANNEL:
        if name in descs and descs[name].shape not in ((channels,), (batch, channels)):
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"{name} has shape {descs[name].shape}; expected ({channels},) or "
                f"({batch}, {channels})",
            )
    return batch, channels


def in_place(descs: dict[str, TensorDesc], device: Device) -> bool:
    """Whether a batch (its operands' layouts) runs in place: B = 0 (one problem's layout is
    validated, nothing runs), or on the CPU each problem has values, ``MIN_VALUES`` or
    more, and no stride is negative (the backward refuses those; the fold gathers them). A
    GPU folds every batch: one problem's launch per problem would be ``B`` launches."""
    x = descs["input"]
    if not x.shape[0]:
        return True
    return (
        device == Device.CPU
        and 0 < x.numel >= MIN_VALUES * x.shape[0]
        and all(s >= 0 for desc in descs.values() for s in desc.strides)
    )


class BatchedBackward:
    """The pass (``call.Pass``): the batched backward's operands, no ``out=``, the
    backward's options."""

    name = "backward_batched"
    names = (*DATA, *PER_CHANNEL)
    out_names: tuple[str, ...] = ()
    out_optional = 0
    written: frozenset[str] = frozenset()
    writes = (False,) * len(names)
    spelling: dict[str, str] = {}  # noqa: RUF012 (read only)

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple:
        return BACKWARD.options(raw, arrays)

    def build(self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple) -> Built:
        given = {n: d for n, d in descs.items() if d is not None}
        count, _ = check_shapes(given)
        if in_place(given, handle.device):
            return _in_place(handle, given, options, count)
        return _folded(handle, given, options, count)

    result = None  # the tuple of the gradients


BATCHED = BatchedBackward()


def _in_place(handle: Handle, descs: dict[str, TensorDesc], options: tuple, count: int) -> Built:
    one = dict.fromkeys(BACKWARD.names) | {n: one_problem(n, d) for n, d in descs.items()}
    built = BACKWARD.build(handle, one, options)
    outputs = {n: _stacked(d, count) for n, d in built.outputs.items()}
    steps = {n: _step(d) for n, d in (descs | outputs).items() if d.ndim > 1}
    fields = {f: built.pointers.get(f, f) for f in BackwardTensors._fields}
    by_field = {f: steps[n] for f, n in fields.items() if n in steps}
    return Built(
        _Batch(built.descriptor, count, by_field),
        built.pointers,
        outputs,
        built.returns,
        built.constants,
    )


def _stacked(desc: TensorDesc, count: int) -> TensorDesc:
    """``count`` blocks of one problem's output ``desc``, B outermost (packed when empty)."""
    shape = (count, *desc.shape)
    if not count * desc.numel:
        return TensorDesc.contiguous(desc.dtype, shape)
    return TensorDesc(desc.dtype, shape, (desc.numel, *desc.strides))


def _step(desc: TensorDesc) -> int:
    """Bytes from one problem to the next in batched ``desc``."""
    return desc.strides[0] * ITEMSIZE[desc.dtype]


class _Launched:
    """A plan's descriptor (``one``: the backward's) with a launcher of its own; everything
    else, closing included, is the descriptor's (``descriptor_cache.descriptors()`` shows
    it)."""

    one: Any

    def __getattr__(self, name: str) -> Any:
        if name == "one":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.one, name)

    def __exit__(self, *exc_info: object) -> None:
        self.one.__exit__(*exc_info)


class _Batch(_Launched):
    """One problem's descriptor launched on ``count`` of them (``steps``: bytes between
    problems, by the launch's fields)."""

    def __init__(self, one: Any, count: int, steps: dict[str | None, int]) -> None:
        self.one, self.count, self.steps = one, count, steps

    def launcher(self, *args: Any, **options: Any) -> Launch:
        """The descriptor's ``launcher`` for the whole batch."""
        return self.one.launcher(*args, **options, batch=(self.count, self.steps))


def _folded(handle: Handle, descs: dict[str, TensorDesc], options: tuple, count: int) -> Built:
    folds = {n: _fold(n, d, count) for n, d in descs.items()}
    one = dict.fromkeys(BACKWARD.names) | {n: folded for n, (folded, _) in folds.items()}
    built = BACKWARD.build(handle, one, options)
    outputs = {n: _unfolded(n, d, count) for n, d in built.outputs.items()}
    rows = {n: r for n, (_, r) in folds.items() if r is not None}
    copies = one["input"].numel > 0  # a problem with no values reads none of them
    itemsizes = {n: ITEMSIZE[descs[n].dtype] for n in rows}
    runner = HostGather if handle.device == Device.CPU else DeviceGather
    gather = runner(rows, itemsizes, handle.device_id, copies)
    descriptor = _Gathered(built.descriptor, gather, built.pointers)
    return Built(descriptor, built.pointers, outputs, built.returns, built.constants)


def _fold(name: str, desc: TensorDesc, count: int) -> tuple[TensorDesc, np.ndarray | None]:
    """Batched operand ``name`` as the folded problem takes it (packed), and the row of a
    gather table (``backends.gather.table_row``) that packs it first, or None where its own
    memory is that packed operand: data ``(B, N, C, ...)`` gathered as ``(N, B, C, ...)``,
    that is ``(N, B*C, ...)``; a per-channel operand as ``(B, C)`` (a shared ``(C,)`` one
    repeated), that is ``(B*C,)``."""
    if name in DATA:
        order = (1, 0, *range(2, desc.ndim))
        n, channels, rest = desc.shape[1], desc.shape[2], desc.shape[3:]
        shape = (n, count * channels, *rest)
    else:
        order = (0, 1)
        channels = desc.shape[-1]
        strides = (0, desc.strides[0]) if desc.ndim == 1 else desc.strides
        desc = TensorDesc(desc.dtype, (count, channels), strides)
        shape = (count * channels,)
    folded = TensorDesc.contiguous(desc.dtype, shape)
    in_order = TensorDesc(desc.dtype, tuple(desc.shape[a] for a in order),
                          tuple(desc.strides[a] for a in order))  # fmt: skip
    if in_order.is_contiguous():  # its memory is the folded problem's packed operand
        return folded, None
    return folded, table_row(desc, order)


def _unfolded(name: str, desc: TensorDesc, count: int) -> TensorDesc:
    """The batch's layout of the folded problem's output ``desc`` (``(N, B*C, ...)`` or
    ``(B*C,)``): ``(B, N, C, ...)`` or ``(B, C)`` over the same memory."""
    if name in ("grad_weight", "grad_bias"):
        (stride,) = desc.strides
        channels = desc.shape[0] // count
        return TensorDesc(desc.dtype, (count, channels), (channels * stride, stride))
    n, channels, rest = desc.shape[0], desc.shape[1] // count, desc.shape[2:]
    shape = (count, n, channels, *rest)
    if not desc.numel:
        return TensorDesc.contiguous(desc.dtype, shape)
    (n_stride, c_stride, *rest_strides) = desc.strides
    return TensorDesc(desc.dtype, shape, (channels * c_stride, n_stride, c_stride, *rest_strides))


class _Gathered(_Launched):
    """The folded problem's descriptor, launched on operands gathered first (``gather``:
    a ``backends.gather`` runner, which takes the front of the plan's workspace, ``front``
    bytes, and writes its table there where it has one, ``prepare``); ``pointers``: the
    operand each launch field takes where it is not its namesake (``call.Built``)."""

    def __init__(self, one: Any, gather: Any, pointers: dict) -> None:
        self.one, self.gather, self.pointers = one, gather, pointers
        self.prepare_workspace = gather.prepare

    @property
    def workspace_size(self) -> int:
        return self.gather.front + self.one.workspace_size

    def launcher(self, owner: str, workspace_size: int, *args: Any, **options: Any) -> Launch:
        """The descriptor's ``launcher`` after the gather's workspace, each call gathering
        its operands and launching on them."""
        inner = self.one.launcher(owner, workspace_size - self.gather.front, *args, **options)
        named = [(i, self.pointers.get(f, f)) for i, f in enumerate(inner.fields)]
        taken = [(i, n) for i, n in named if n in self.gather.rows]
        return self.gather.wrap(inner, taken, options.get("current", False))
