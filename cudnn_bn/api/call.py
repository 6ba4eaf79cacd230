"""The one path every array-API call takes: operands, a per-problem plan, outputs, launch.

A call reads each array's signature (everything the door checks except its address) and its
data pointer. Exact ndarrays, CuPy arrays and plain torch tensors are read from a few
attributes; every other producer goes through the door (``arrays.operand``) on every call.
The pass, its options (with their types) and the signatures key a ``Plan``, built on a miss
by the full path: the door on every operand, one device for all, the rules for arrays
written in place, the operator's validation and descriptor, output layouts, workspace and
reserve sizes, constants standing in for an absent weight or bias, and the operator's
launch with its size checks made (``OperatorDescriptor.launcher``). A hit re-checks only
what depends on addresses (each attribute-read operand non-NULL and aligned, no written
operand overlapping another), resolves the stream, allocates the outputs and launches: an
operand that differs in any checked property is a different key, so no check is skipped.

Plans live in ``descriptor_cache``, looked up without a lock; a plan's descriptor closes when
its last reference goes, so eviction by another thread never closes a descriptor that a
call is using.
"""

import sys
import threading
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Protocol

import numpy as np

from ..arrays import Operand, check_written, common_place, operand
from ..arrays.kinds import Allocator
from ..arrays.numpy_arrays import ndarray_data
from ..arrays.operand import byte_extent, overlap, refuse_overlap
from ..descriptor_cache import DescriptorCache
from ..enums import Device, Status
from ..errors import InfiniError
from ..runtime import Handle
from ..tensor import ITEMSIZE, TensorDesc
from .streams import call_place, call_stream

descriptor_cache = DescriptorCache()


@dataclass
class Built:
    """What a pass builds for one problem: its operator descriptor; which operand fills each
    field of the operator's pointer tuple where it is not the field's namesake (None: NULL);
    the layouts of the outputs the call allocates; what it returns (operand names, None for
    a None); the constants standing in for absent operands (``name -> (value, layout)``);
    whether it fills a reserve; the size of a reserve the caller gives."""

    descriptor: Any
    pointers: dict[str, str | None]
    outputs: dict[str, TensorDesc]
    returns: tuple[str | None, ...]
    constants: dict[str, tuple[float, TensorDesc]] = field(default_factory=dict)
    reserve: bool = False
    reserve_size: int | None = None


class Pass(Protocol):
    """One array-API pass: its name, its operands in the order its calls give them, those it
    writes in place, how callers spell them, how it validates its options, builds a problem's
    operator, and makes its return value from the values ``Plan.returns`` picks."""

    name: str
    names: tuple[str, ...]
    written: frozenset[str]
    spelling: dict[str, str]

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple: ...

    def build(
        self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple
    ) -> Built: ...

    def result(self, returned: tuple) -> Any: ...


@dataclass(eq=False)
class Plan:
    """A problem's plan: everything its calls share, built once (the module docstring).

    A call's values are its operands' pointers (in ``Pass.names`` order), then those of
    the arrays it allocates (``outputs``, then a reserve), then ``tail`` (constants' pointers
    and a NULL); ``pick`` takes the operator's pointer tuple from them. Its objects are its
    arrays, then the allocated ones, then a None; ``returns`` picks the results from them."""

    spec: Any
    descriptor: Any
    device: Device
    device_id: int
    kind: Any
    outputs: tuple[Allocator, ...]
    reserve_size: int  # bytes of reserve the call allocates (0: none)
    workspace_size: int
    tail: tuple[int, ...]
    pick: Any
    returns: Any
    launch: Any
    aligned: "Aligned"  # the operands read by attributes
    # (written, other, low, high): the operands' bytes meet where low < written's pointer
    # - other's < high; then ``overlap`` of their descs (the last two) decides.
    overlaps: tuple[tuple[int, int, int, int, TensorDesc, TensorDesc], ...]
    used: bool = True  # descriptor_cache's CLOCK bit

    def __call__(self, arrays: tuple, ptrs: list[int], like: Any, stream: Any) -> Any:
        """Run the plan on one call's arrays and pointers; returns ``spec.result``."""
        self.aligned.check(ptrs, arrays, self.spec)
        for written, other, low, high, w_desc, o_desc in self.overlaps:
            w, o = ptrs[written], ptrs[other]
            if low < w - o < high and overlap(w_desc, w, o_desc, o):
                names, spelling = self.spec.names, self.spec.spelling
                raise refuse_overlap(
                    spelling.get(names[written], names[written]),
                    spelling.get(names[other], names[other]),
                )
        if self.device == Device.CPU:
            return self._run(arrays, ptrs, like, 0)
        call_on, scope = call_place(stream, like, self.kind, self.device, self.device_id)
        with scope:
            return self._run(arrays, ptrs, like, call_on)

    def _run(self, arrays: tuple, ptrs: list[int], like: Any, stream: int) -> Any:
        made = []
        for allocate in self.outputs:
            array, ptr = allocate()
            made.append(array)
            ptrs.append(ptr)
        if self.reserve_size:
            array, ptr = self.kind.scratch(like, self.reserve_size)
            made.append(array)
            ptrs.append(ptr)
        workspace = self.kind.scratch(like, self.workspace_size) if self.workspace_size else None
        ptrs.extend(self.tail)
        self.launch(
            tuple.__new__(self.descriptor.pointers, self.pick(ptrs)),
            0 if workspace is None else workspace[1],
            stream,
        )
        return self.spec.result(self.returns((*arrays, *made, None)))


# Constants standing in for an absent weight (ones) or bias (zeros), one per kind, device,
# value and layout, never freed: a kernel on any stream may still be reading one.
_constants: dict[tuple, tuple[Any, int]] = {}
_constants_lock = threading.Lock()


def _constant(kind: Any, like: Any, device_id: int, value: float, desc: TensorDesc) -> int:
    key = (kind.name, getattr(like, "device", None), device_id, value, desc)
    with _constants_lock:
        if key not in _constants:
            _constants[key] = kind.constant(like, value, desc)
        return _constants[key][1]


def _cupy_array_type() -> Any:
    """CuPy's ndarray class where CuPy is imported (None otherwise)."""
    cupy = sys.modules.get("cupy")
    return getattr(cupy, "ndarray", None)


def _plain_torch(array: Any) -> bool:
    """A torch tensor or parameter (not a subclass) with no lazy-view bit, strided."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(array) in (torch.Tensor, torch.nn.Parameter)
        and array.layout is torch.strided
        and not (array.is_neg() or array.is_conj() or array.is_nested)
    )


def _torch_data(tensor: Any) -> int | None:
    """A plain tensor's data pointer; None for one without storage (a functorch wrapper
    inside ``torch.vmap``), which the door then refuses by name."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


def options_key(raw: tuple) -> tuple:
    """Options as part of a key, with their types: ``True``, ``1`` and ``1.0`` are equal in
    Python but may validate differently, so they key different plans."""
    return raw, tuple(map(type, raw))


def read(arrays: tuple) -> tuple[list, list[int], list[int]]:
    """``(signatures, pointers, others)`` of ``arrays``: exact ndarrays, CuPy arrays and plain
    torch tensors read from their attributes (a signature: type, dtype, shape, strides, and
    writability or device), None as None and 0; the indices of any other producers in
    ``others``, for the door (their entries None and 0 until then)."""
    signatures, ptrs, others = [], [], []
    cupy_array = None
    for array in arrays:
        kind = type(array)
        if kind is np.ndarray:
            signatures.append(
                (kind, array.dtype, array.shape, array.strides, array.flags.writeable)
            )
            ptrs.append(ndarray_data(array))
        elif array is None:
            signatures.append(None)
            ptrs.append(0)
        elif kind is (cupy_array or (cupy_array := _cupy_array_type())):
            signatures.append((kind, array.dtype, array.shape, array.strides, array.device.id))
            ptrs.append(array.data.ptr)
        elif _plain_torch(array) and (ptr := _torch_data(array)) is not None:
            signatures.append((kind, array.dtype, array.shape, array.stride(), array.device))
            ptrs.append(ptr)
        else:
            others.append(len(ptrs))
            signatures.append(None)
            ptrs.append(0)
    return signatures, ptrs, others


def run(spec: Pass, arrays: tuple, raw: tuple, stream: Any) -> Any:
    """Run pass ``spec`` on ``arrays`` (in ``spec.names`` order; None for absent ones) with
    the caller's ``raw`` options (hashable, each typed by ``options_key``); returns
    ``spec.result``."""
    like = arrays[0]
    if like is None:
        raise InfiniError(Status.NULL_POINTER, "input is None")
    signatures, ptrs, others = read(arrays)
    signatures[:0] = (spec, options_key(raw))
    described: dict[int, Operand] = {}
    if others:  # one device for all, and the stream, before any producer is asked to export
        device, device_id = common_place(_present(spec, arrays))
        consumer = None if device == Device.CPU else call_stream(stream, like, device, device_id)
        for at in others:
            name = spec.names[at]
            found = operand(
                spec.spelling.get(name, name), arrays[at], consumer, written=name in spec.written
            )
            described[at], ptrs[at], signatures[at + 2] = found, found.ptr, found.signature
    try:
        key = tuple(signatures)
        plan = descriptor_cache.get(key)
    except TypeError:  # an unhashable option: its validation says which
        spec.options(raw, dict(zip(spec.names, arrays, strict=True)))
        raise InfiniError(Status.BAD_PARAM, f"unhashable option among {raw!r}") from None
    if plan is None:
        plan = descriptor_cache.add(key, _build(spec, arrays, raw, described, stream))
    return plan(arrays, ptrs, like, stream)


class Aligned:
    """The pointers of a call (operands at these indices, those with elements) that must be
    non-NULL and aligned to their item size: what the door checks of an address, for
    operands read by their attributes. Grouped by item size, so a call checks each group
    with a few C-level scans."""

    def __init__(self, descs: dict[int, TensorDesc]) -> None:
        sizes: dict[int, list[int]] = {}
        for at, desc in descs.items():
            if desc.numel:
                sizes.setdefault(ITEMSIZE[desc.dtype], []).append(at)
        self.groups = tuple((_picker(ats), size.__rmod__) for size, ats in sizes.items())

    def check(self, ptrs: list[int], arrays: tuple, spec: Any) -> None:
        """BAD_PARAM from the door, naming the first operand found NULL or misaligned
        (``spec``: its ``names`` and ``spelling``)."""
        for pick, modulo in self.groups:
            addresses = pick(ptrs)
            if 0 in addresses or any(map(modulo, addresses)):
                for at in pick(range(len(arrays))):
                    if not ptrs[at] or modulo(ptrs[at]):
                        name = spec.spelling.get(spec.names[at], spec.names[at])
                        operand(name, arrays[at])  # raises
                        raise InfiniError(Status.BAD_PARAM, f"{name} is misaligned or NULL")


def _picker(indices: list[int]) -> Any:
    """A function taking the items at ``indices`` of a sequence, as a tuple."""
    if len(indices) == 1:
        (index,) = indices
        return lambda values: (values[index],)
    return itemgetter(*indices)


def _present(spec: Pass, arrays: tuple) -> dict[str, Any]:
    """The arrays given, by the names their callers know them by."""
    spell = spec.spelling.get
    return {spell(n, n): a for n, a in zip(spec.names, arrays, strict=True) if a is not None}


def _build(
    spec: Pass, arrays: tuple, raw: tuple, described: dict[int, Operand], stream: Any
) -> Plan:
    """The full path for a new problem (the module docstring); raises before anything is
    cached or written."""
    names = spec.names
    by_name = dict(zip(names, arrays, strict=True))
    options = spec.options(raw, by_name)
    device, device_id = common_place(_present(spec, arrays))
    like = arrays[0]
    call_on = call_stream(stream, like, device, device_id)
    consumer = None if device == Device.CPU else call_on
    spelled = {n: spec.spelling.get(n, n) for n in names}
    ops = {
        n: described.get(at) or operand(spelled[n], a, consumer, written=n in spec.written)
        for at, (n, a) in enumerate(by_name.items())
        if a is not None
    }
    written = {spelled[n]: op for n, op in ops.items() if n in spec.written}
    check_written(written, {spelled[n]: op for n, op in ops.items() if n not in spec.written})
    kind = ops["input"].kind
    handle = Handle(device, device_id)
    built = spec.build(handle, {n: ops[n].desc if n in ops else None for n in names}, options)
    descriptor = built.descriptor
    reserve_size = descriptor.reserve_size if built.reserve else 0
    constants = {}
    if built.constants:
        with kind.scope(like, call_on, device_id):
            constants = {
                n: _constant(kind, like, device_id, value, desc)
                for n, (value, desc) in built.constants.items()
            }
    # Where each value of a call lies (the Plan docstring).
    made = [*built.outputs, *(["reserve"] if reserve_size else [])]
    at = {n: i for i, n in enumerate(names) if n in ops}
    at |= {n: len(names) + i for i, n in enumerate([*made, *constants])}
    null = len(names) + len(made) + len(constants)  # the tail's last value: 0
    pick = _picker([at.get(built.pointers.get(f, f), null) for f in descriptor.pointers._fields])
    none = len(names) + len(made)  # names with no value (None, an empty reserve) are None
    returns = _picker([at.get(n, none) for n in built.returns])
    index = {n: i for i, n in enumerate(names)}
    extents = {n: byte_extent(op.desc) for n, op in ops.items()}
    present = list(ops)
    plan = Plan(
        spec,
        descriptor,
        device,
        device_id,
        kind,
        tuple(kind.allocator(like, desc) for desc in built.outputs.values()),
        reserve_size,
        descriptor.workspace_size,
        (*constants.values(), 0),
        pick,
        returns,
        descriptor.launcher(
            "the array API's plan cache",
            descriptor.workspace_size,
            built.reserve_size,
            "reserve" in ops,
        ),
        Aligned({index[n]: op.desc for n, op in ops.items() if index[n] not in described}),
        tuple(  # each written operand against every other one (each pair once)
            (
                index[w],
                index[o],
                extents[o][0] - extents[w][1],
                extents[o][1] - extents[w][0],
                ops[w].desc,
                ops[o].desc,
            )
            for i, w in enumerate(present)
            if w in spec.written
            for o in present[i + 1 :] + [n for n in present[:i] if n not in spec.written]
        ),
    )
    return plan
