"""The one path every array-API call takes: operands, a per-problem plan, outputs, launch.

A call reads each array's signature (everything the door checks except its address) and its
data pointer. Exact ndarrays, CuPy arrays and plain torch tensors are read from a few
attributes; every other producer goes through the door (``arrays.operand``) on every call.
The pass, its validated options and the signatures key a ``Plan``, built on a miss by the
full path: the door on every operand, one device for all, the rules for arrays written in place, the
operator's validation and descriptor, output layouts, workspace and reserve sizes, constants
standing in for an absent weight or bias. A hit re-checks only what depends on addresses
(alignment, overlap of written operands), allocates the outputs and launches; so an operand
that differs in any checked property is a different key, and no check is skipped.

Plans live in ``descriptor_cache`` and are used under a lease: eviction by another thread
never closes a descriptor a call is using.
"""

import sys
import threading
from dataclasses import dataclass, field
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
from .streams import call_stream

descriptor_cache = DescriptorCache()


@dataclass
class Built:
    """What a pass builds for one problem: its operator descriptor; the argument template
    of its ``compute`` (operand names, whose pointers a call fills in, and sizes) after the
    workspace and before the stream, and as keywords; the layouts of the outputs the call
    allocates; the constants standing in for absent operands (``name -> (value, layout)``);
    whether it fills a reserve; what it returns (operand names, None for a None)."""

    descriptor: Any
    arguments: tuple[str | int, ...]
    keywords: dict[str, str | int]
    outputs: dict[str, TensorDesc]
    returns: tuple[str | None, ...]
    constants: dict[str, tuple[float, TensorDesc]] = field(default_factory=dict)
    reserve: bool = False


class Pass(Protocol):
    """One array-API pass: its name, the operands it writes in place, how callers spell its
    operands, how it validates its options, builds a problem's operator (with the argument
    template ``Plan.launch`` fills), and makes its return value."""

    name: str
    written: frozenset[str]
    spelling: dict[str, str]

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple: ...

    def build(
        self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple
    ) -> Built: ...

    def result(self, plan: "Plan", arrays: dict[str, Any], made: dict[str, Any]) -> Any: ...


@dataclass
class Plan:
    """A problem's plan: everything its calls share, built once (``call``'s docstring)."""

    descriptor: Any
    kind: Any
    allocators: dict[str, Allocator]
    constants: dict[str, int]
    # (name, item size) of operands read by attributes: their alignment is re-checked.
    aligned: tuple[tuple[str, int], ...]
    # (written, other, written's byte extent, other's, their descs): re-checked for overlap.
    overlaps: tuple[tuple[str, str, int, int, int, int, TensorDesc, TensorDesc], ...]
    arguments: tuple[str | int, ...]
    keywords: dict[str, str | int]
    returns: tuple[str | None, ...]
    workspace_size: int

    def check(self, ptrs: dict[str, int], arrays: dict[str, Any], spelling: dict[str, str]) -> None:
        """What depends on addresses: alignment, and no written operand overlapping another."""
        for name, itemsize in self.aligned:
            if ptrs[name] % itemsize:
                operand(spelling.get(name, name), arrays[name])  # raises, naming it
        for written, other, w_low, w_high, o_low, o_high, w_desc, o_desc in self.overlaps:
            w, o = ptrs[written], ptrs[other]
            meet = w + w_low < o + o_high and o + o_low < w + w_high
            if meet and overlap(w_desc, w, o_desc, o):
                raise refuse_overlap(spelling.get(written, written), spelling.get(other, other))

    def launch(self, ptrs: dict[str, int], workspace: int, stream: int) -> None:
        """The operator's ``compute`` on this call's pointers, by the argument template."""
        fill = ptrs.get
        self.descriptor.compute(
            workspace,
            self.workspace_size,
            *[fill(a, 0) if a.__class__ is str else a for a in self.arguments],
            stream,
            **{k: fill(a, 0) if a.__class__ is str else a for k, a in self.keywords.items()},
        )

    def returned(self, arrays: dict[str, Any], made: dict[str, Any]) -> tuple:
        """What the pass returns: the arrays the call made, or was given, by name."""
        return tuple(None if n is None else made.get(n, arrays.get(n)) for n in self.returns)

    def __exit__(self, *exc_info: object) -> None:
        self.descriptor.__exit__(*exc_info)


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


_PLAIN = frozenset((float, str, type(None)))
_SEQUENCES = frozenset((tuple, list))


def typed(values: tuple | list) -> tuple:
    """Options as part of a key: values of any type but float, str and None tagged with it,
    so that ``True``, ``1`` and ``1.0`` (equal in Python) key different plans; tuples and
    lists (an ``output_mask``) as tuples of their typed items."""
    return tuple(
        v if type(v) in _PLAIN else (type(v), typed(v) if type(v) in _SEQUENCES else v)
        for v in values
    )


class Key:
    """A plan's key, hashed once: a call's cache look-up and its move to the front would each
    hash the nested tuple again (tuples do not keep their hash)."""

    __slots__ = ("hashed", "values")

    def __init__(self, values: tuple) -> None:
        self.values, self.hashed = values, hash(values)

    def __hash__(self) -> int:
        return self.hashed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and self.values == other.values


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


def run(spec: Pass, arrays: dict[str, Any], raw: tuple, stream: Any) -> Any:
    """Run pass ``spec`` on ``arrays`` (by operand name; None for absent ones) with the
    caller's ``raw`` options; returns ``spec.result``."""
    like = arrays["input"]
    if like is None:
        raise InfiniError(Status.NULL_POINTER, "input is None")
    spell = spec.spelling.get
    placed = False  # every array's place found (device types first: no CUDA for host arrays)
    if type(like) is np.ndarray:
        device, device_id, call_on = Device.CPU, 0, 0
    else:
        # A producer's place may take CUDA to find (a CUDA array interface's pointer): all
        # arrays' places are compared first, so that host arrays among them ask CUDA nothing.
        placed = not _plain_torch(like)
        present = {spell(n, n): a for n, a in arrays.items() if a is not None}
        device, device_id = common_place(present if placed else {"input": like})
        call_on = call_stream(stream, like, device, device_id)
    signatures, ptrs, others = [spec.name, typed(raw)], {}, []
    for name, array in arrays.items():
        if array is None:
            signatures.append(None)
            continue
        kind = type(array)
        if kind is np.ndarray:
            signatures.append(
                (kind, array.dtype, array.shape, array.strides, array.flags.writeable)
            )
            ptrs[name] = ndarray_data(array)
        elif _plain_torch(array):
            signatures.append((kind, array.dtype, array.shape, array.stride(), array.device))
            ptrs[name] = array.data_ptr()
        elif kind is _cupy_array_type():
            signatures.append((kind, array.dtype, array.shape, array.strides, array.device.id))
            ptrs[name] = array.data.ptr
        else:
            others.append((len(signatures), name))
            signatures.append(None)
    described = {}
    if others:  # one device for all before any producer is asked to export
        if not placed:
            common_place({spell(n, n): a for n, a in arrays.items() if a is not None})
        consumer = None if device == Device.CPU else call_on
        for at, name in others:
            found = operand(spell(name, name), arrays[name], consumer, written=name in spec.written)
            described[name], ptrs[name], signatures[at] = found, found.ptr, found.signature
    try:
        key = Key(tuple(signatures))
    except TypeError:  # an unhashable option: its validation says which
        spec.options(raw, arrays)
        raise InfiniError(Status.BAD_PARAM, f"unhashable option among {raw!r}") from None

    def build() -> Plan:
        return _build(spec, arrays, spec.options(raw, arrays), described, like, call_on)

    with descriptor_cache.lease(key, build) as plan:
        plan.check(ptrs, arrays, spec.spelling)
        with plan.kind.scope(like, call_on, device_id):
            made = {}
            for name, allocate in plan.allocators.items():
                made[name], ptrs[name] = allocate()
            ptrs.update(plan.constants)
            _workspace, workspace = plan.kind.scratch(like, plan.workspace_size)
            plan.launch(ptrs, workspace, call_on)
    return spec.result(plan, arrays, made)


def _build(
    spec: Pass,
    arrays: dict[str, Any],
    options: tuple,
    described: dict[str, Operand],
    like: Any,
    call_on: int,
) -> Plan:
    """The full path for a new problem (``call``'s docstring); raises before anything is
    cached or written."""
    spelled = {n: spec.spelling.get(n, n) for n in arrays}
    present = {spelled[n]: a for n, a in arrays.items() if a is not None}
    device, device_id = common_place(present)
    consumer = None if device == Device.CPU else call_on
    ops = {
        n: described.get(n) or operand(spelled[n], a, consumer, written=n in spec.written)
        for n, a in arrays.items()
        if a is not None
    }
    written = {spelled[n]: op for n, op in ops.items() if n in spec.written}
    check_written(written, {spelled[n]: op for n, op in ops.items() if n not in spec.written})
    kind = ops["input"].kind
    built = spec.build(
        Handle(device, device_id), {n: ops[n].desc if n in ops else None for n in arrays}, options
    )
    allocators = {n: kind.allocator(like, desc) for n, desc in built.outputs.items()}
    if built.reserve:
        size = built.descriptor.reserve_size
        allocators["reserve"] = lambda: kind.scratch(like, size)
    constants = {}
    if built.constants:
        with kind.scope(like, call_on, device_id):
            constants = {
                n: _constant(kind, like, device_id, value, desc)
                for n, (value, desc) in built.constants.items()
            }
    extents = {n: byte_extent(op.desc) for n, op in ops.items()}
    names = list(ops)
    return Plan(
        built.descriptor,
        kind,
        allocators,
        constants,
        tuple((n, ITEMSIZE[op.desc.dtype]) for n, op in ops.items() if n not in described),
        tuple(  # each written operand against every other one (each pair once)
            (w, o, *extents[w], *extents[o], ops[w].desc, ops[o].desc)
            for i, w in enumerate(names)
            if w in spec.written
            for o in names[i + 1 :] + [n for n in names[:i] if n not in spec.written]
        ),
        built.arguments,
        built.keywords,
        built.returns,
        built.descriptor.workspace_size,
    )
