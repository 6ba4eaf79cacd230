"""The one path every array-API call takes: operands, a per-problem plan, outputs, launch.

A call reads each array's signature (everything the door checks except its address) and its
data pointer. Exact ndarrays, CuPy arrays and plain torch tensors are read from a few
attributes; every other producer goes through the door (``arrays.operand``) on every call.
The pass, its options (with their types) and the signatures key a ``Plan``, built on a miss
by the full path: the door on every operand, one device for all, the rules for arrays
written in place, the operator's validation and descriptor, output layouts, workspace and
reserve sizes, constants standing in for an absent weight or bias, and the operator's
launch with its size checks made (``OperatorDescriptor.launcher``). A hit re-checks only
what depends on addresses (each attribute-read operand's in [0, 2**64), and where it has
elements non-NULL and aligned; no written operand overlapping another; a torch tensor
written not requiring grad while grad mode is on, torch's rule), resolves the stream,
allocates the outputs (and a reserve) and launches, with the workspace its plan keeps for
that stream, then bumps the version counter of each torch tensor written, in a function
written for the problem when its plan was built (``Plan``): an operand that differs in any
checked property is a different key, so no check is skipped.

Plans live in ``descriptor_cache``, looked up without a lock; a plan's descriptor closes when
its last reference goes, so eviction by another thread never closes a descriptor that a
call is using.
"""

import itertools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from ..address_tests import Disjoint, bad_bits, compiled_test, misplaced
from ..arrays import Operand, check_written, common_place, operand, see
from ..arrays.numpy_arrays import DATA_WORDS, ndarray_data
from ..arrays.operand import refuse_overlap
from ..arrays.torch_tensors import is_plain, is_tensor, refuse_grad_write, version_bump
from ..descriptor_cache import DescriptorCache
from ..enums import Device, Status
from ..errors import InfiniError, raise_public
from ..ops.descriptor import WORKSPACE_ALIGNMENT
from ..runtime import Handle
from ..tensor import ITEMSIZE, TensorDesc
from .outputs import out_arrays
from .spelling import SPELLING
from .streams import call_place, call_stream, host_stream, read_stream

descriptor_cache = DescriptorCache()
_PER_THREAD = 2  # cudaStreamPerThread: the calling host thread's default stream


@dataclass
class Built:
    """What a pass builds for one problem: its operator descriptor; which operand fills each
    field of the operator's pointer tuple where it is not the field's namesake (None: NULL);
    the layouts of the outputs the call allocates; what it returns (operand names, None for
    a None); the constants standing in for absent operands (``name -> (value, layout)``);
    whether it fills a reserve (the call allocates one where the caller gives none); the
    size of a reserve the caller gives; the operands written in place that this problem
    leaves as they are (an empty batch's running statistics)."""

    descriptor: Any
    pointers: dict[str, str | None]
    outputs: dict[str, TensorDesc]
    returns: tuple[str | None, ...]
    constants: dict[str, tuple[float, TensorDesc]] = field(default_factory=dict)
    reserve: bool = False
    reserve_size: int | None = None
    unwritten: frozenset[str] = frozenset()


class Pass(Protocol):
    """One array-API pass: its name, its operands in the order its calls give them (the last
    ``out_names`` from its ``out=`` tuple, of which the last ``out_optional`` may be left
    out), those it writes in place (also as one flag per operand: ``writes``), how callers
    spell them, how it validates its options and builds a problem's operator, and
    ``result``, which makes its return value from the values ``Built.returns`` names, given
    as its arguments (None: the one value itself, or the tuple of several)."""

    name: str
    names: tuple[str, ...]
    out_names: tuple[str, ...]
    out_optional: int
    written: frozenset[str]
    writes: tuple[bool, ...]
    spelling: dict[str, str]

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple: ...

    def build(
        self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple
    ) -> Built: ...

    result: Callable[..., Any] | None


@dataclass(eq=False)
class Plan:
    """A problem's plan: everything its calls share, built once (the module docstring).

    ``call(arrays, ptrs, like, stream)`` runs it on one call's arrays (in ``Pass.names``
    order) and their pointers, and returns ``spec.result``: a function written for this
    problem by ``_plan_call`` (its ``source``), as ``dataclasses`` writes an ``__init__``,
    so that a call runs no loop over outputs, picks no values through tables and repacks
    nothing (its checks, allocations, launch and result at (8, 4), 1 thread: a training
    forward's 5.9 -> 4.8 us against the general function it replaced, an inference's 3.1 ->
    2.4 us)."""

    descriptor: Any
    call: Any
    source: str
    used: bool = True  # descriptor_cache's CLOCK bit


class Workspaces:
    """A plan's workspace for each stream it has run on, made by its first launch there from
    that stream's memory and kept: a loop (or a CUDA graph captured after one call on its
    stream) allocates none. ``lock``: one launch at a time uses them (a launch may be staging
    kernels around cuDNN's call). Keyed by the stream, and on ``cudaStreamPerThread``, which
    is each thread's own stream, by the thread's ``_thread_token``: never one an ended thread
    had (CPython reuses ``get_ident()`` at once), whose last kernels may still be writing its
    workspace. So each thread that ever ran a plan there leaves one workspace, kept as long
    as the plan. ``prepare(pointer, stream)``, where given, writes what the plan keeps in
    each new workspace (a batched plan's gather table) before it is first used."""

    def __init__(
        self, kind: Any, size: int, prepare: Callable[[int, int], None] | None = None
    ) -> None:
        self.kind, self.size, self.prepare = kind, size, prepare
        self.made: dict[Any, tuple[Any, int]] = {}
        self.lock = threading.Lock()

    def get(self, like: Any, stream: int) -> int:
        """The pointer to ``stream``'s workspace (``lock`` held)."""
        place = (stream, _thread_token()) if stream == _PER_THREAD else stream
        workspace = self.made.get(place)
        if workspace is None:
            buffer = self.kind.buffer(like, self.size)()
            address = self.kind.address(buffer)
            if self.prepare is not None:
                self.prepare(address, stream)
            workspace = self.made[place] = (buffer, address)
        return workspace[1]


_threads = threading.local()
_tokens = itertools.count()


def _thread_token() -> int:
    """A number for the calling thread, never given to another thread of this process."""
    token = getattr(_threads, "token", None)
    if token is None:
        token = _threads.token = next(_tokens)
    return token


# Constants standing in for an absent weight (ones) or bias (zeros), one per kind, device,
# value and layout, never freed: a kernel on any stream may still be reading one. Each is
# ready for every stream when made (``arrays.kinds``).
_constants: dict[tuple, tuple[Any, int]] = {}
_constants_lock = threading.Lock()


def _constant(
    kind: Any, like: Any, place: tuple[Device, int], value: float, desc: TensorDesc, name: str
) -> int:
    """The address of the constant ``value`` of layout ``desc`` for calls of ``kind`` at
    ``place`` (the door's: not ``like``'s own word for its device, which a subclass could
    make another place's)."""
    key = (kind.name, place, value, desc)
    with _constants_lock:
        if key not in _constants:
            array = kind.constant(like, value, desc, name)
            _constants[key] = (array, kind.address(array))
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


def read(arrays: tuple, writes: tuple[bool, ...], signatures: list) -> tuple[list, list, list]:
    """``(signatures, pointers, others)`` of ``arrays`` (``writes``: whether the call writes
    each): exact ndarrays, CuPy arrays and plain torch tensors read from their attributes (a
    signature: type, dtype, shape, strides, then device, or for an ndarray whether it is
    writable where it is written), None as None and 0; the indices of any other producers in
    ``others``, for the door (their entries None and 0 until then). Signatures are appended
    to ``signatures``."""
    count = len(arrays)  # as many as ``writes``: the pass's names
    ptrs, others = [0] * count, []
    base = len(signatures)
    signatures += [None] * count  # most of a call's operands are None (absent, out= entries)
    cupy_array, words = None, DATA_WORDS
    at = -1
    for array in arrays:
        at += 1
        if array is None:
            continue
        kind = type(array)
        if kind is np.ndarray:
            signatures[base + at] = (
                kind, array.dtype, array.shape, array.strides, writes[at] and array.flags.writeable
            )  # fmt: skip
            # ``ndarray_data``'s read, inlined: a call per operand cost 0.06 us
            ptrs[at] = words[id(array) >> 3] if words is not None else ndarray_data(array)
        elif kind is (cupy_array or (cupy_array := _cupy_array_type())):
            data = array.data  # its ``device`` would make a ``Device`` (CuPy's memory.pyx)
            signatures[base + at] = (kind, array.dtype, array.shape, array.strides, data.device_id)
            ptrs[at] = data.ptr
        elif _plain_torch(array) and (ptr := _torch_data(array)) is not None:
            signatures[base + at] = (kind, array.dtype, array.shape, array.stride(), array.device)
            ptrs[at] = ptr
        else:
            others.append(at)
    return signatures, ptrs, others


def run(spec: Pass, arrays: tuple, raw: tuple, stream: Any, out: Any = None) -> Any:
    """Run pass ``spec`` on ``arrays`` (in ``spec.names`` order, then the ``out=`` tuple
    ``out`` for a pass with ``out_names``; None for absent ones) with the caller's ``raw``
    options (hashable, each typed by ``options_key``); returns ``spec.result``. Raises what
    a public entry point raises (``errors.raise_public``)."""
    try:
        if spec.out_names:
            arrays = (*arrays, *out_arrays(out, spec.out_names, spec.out_optional))
        like = arrays[0]
        if like is None:
            raise InfiniError(Status.NULL_POINTER, "input is None")
        signatures, ptrs, others = read(arrays, spec.writes, [spec, options_key(raw)])
        described, place = {}, None
        if others:
            described, place, stream = _described(spec, arrays, stream, others, signatures, ptrs)
        key = tuple(signatures)
        try:
            plan = descriptor_cache.get(key)
        except TypeError:  # an unhashable option: its validation says which
            if _hashable(key):
                raise  # not the key's: a signal handler's, raised meanwhile
            spec.options(raw, dict(zip(spec.names, arrays, strict=True)))
            raise InfiniError(Status.BAD_PARAM, f"unhashable option among {raw!r}") from None
        if plan is None:  # the build and the call see one read of a stream object
            stream = read_stream(stream)
            plan = descriptor_cache.add(key, _build(spec, arrays, raw, described, place, stream))
        return plan.call(arrays, ptrs, like, stream)
    except Exception as exc:
        raise_public(exc, _error_spelling(spec), f"batch_norm_{spec.name}")


def _hashable(key: tuple) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _described(
    spec: Pass, arrays: tuple, stream: Any, others: list[int], signatures: list, ptrs: list[int]
) -> tuple[dict[int, Operand], tuple[Device, int], Any]:
    """The door's operands of the producers at ``others`` (``read``), their signatures (with
    the producer's type: outputs are stored as the input is, e.g. BF16 as ``ml_dtypes``' type
    or as uint16 bits, which its operand does not say) and pointers filled in, the call's
    place (one device for all), and its stream, found before any producer is asked to export:
    on a device, the address producers were ordered before, which the call then runs on;
    on the host, ``stream`` as ``read_stream`` read it. Each producer's protocol is read once
    (``arrays.see``), for its place and its operand."""
    spelling, names = spec.spelling, spec.names
    seen, given = {}, {}  # in the pass's order, as the door's errors name them
    for at, array in enumerate(arrays):
        if array is not None:
            name = spelling.get(names[at], names[at])
            if at in others:
                array = seen[at] = see(name, array, written=names[at] in spec.written)
            given[name] = array
    device, device_id = common_place(given)
    stream = read_stream(stream)
    consumer = None if device == Device.CPU else call_stream(stream, arrays[0], device, device_id)
    described = {}
    for at, s in seen.items():
        name = names[at]
        found = operand(spelling.get(name, name), s, consumer, written=name in spec.written)
        described[at], ptrs[at] = found, found.ptr
        signatures[at + 2] = (type(arrays[at]), found.signature)
    return described, (device, device_id), stream if consumer is None else consumer


def _error_spelling(spec: Pass) -> dict[str, str]:
    """How ``spec``'s errors name arguments: the operators' names as the array API's
    (``SPELLING``), and the ``out=`` entries as the caller gave them (``spec.spelling``:
    ``grad_weight`` is ``out[1]``)."""
    outs = spec.spelling
    return {name: outs.get(own, own) for name, own in SPELLING.items()} | outs


class Aligned:
    """The pointers of a call (operands at these indices) that must be addresses (in [0,
    2**64), as the door checks every operand's), and where the operand has elements,
    non-NULL and aligned to its item size: what the door checks of an address, for operands
    read by their attributes; a reserve the problem uses (at an index in ``buffers``) to
    ``WORKSPACE_ALIGNMENT``, as cuDNN's buffers, whoever read it. ``suspect`` is the source
    of a test over a call's ``ptrs`` that is true where any may be none of these
    (``address_tests.misplaced``; a CuPy pointer is signed, ``intptr_t``); a plan's call has
    it inline and calls ``check`` only then. ``door``: the indices of operands the door
    reads on every call (its checks made there), which ``check`` does not read again."""

    def __init__(
        self,
        descs: dict[int, TensorDesc],
        buffers: frozenset[int] = frozenset(),
        door: frozenset[int] = frozenset(),
    ) -> None:
        # alignment (0: no elements, any address), in the operands' order (the door's)
        sizes = {
            at: (WORKSPACE_ALIGNMENT if at in buffers else ITEMSIZE[d.dtype]) if d.numel else 0
            for at, d in sorted(descs.items())
        }
        groups: dict[int, list[int]] = {}
        for at, size in sizes.items():
            groups.setdefault(size, []).append(at)
        self.masks = {at: (size, bad_bits(size)) for at, size in sizes.items()}
        self.door = door
        self.suspect = misplaced(groups)
        self._suspect = compiled_test(self.suspect)

    def check(self, ptrs: list[int], arrays: tuple, spec: Any) -> None:
        """The door's error (BAD_PARAM, NULL_POINTER, BAD_TENSOR_STRIDES), naming the first
        operand, in the door's order, found out of range, NULL or misaligned (``spec``: its
        ``names`` and ``spelling``)."""
        if not self._suspect(ptrs):
            return
        for at, (size, mask) in self.masks.items():
            if (size and not ptrs[at]) or ptrs[at] & mask:
                name = spec.spelling.get(spec.names[at], spec.names[at])
                if at not in self.door:
                    operand(name, arrays[at])  # raises, but for a buffer's own alignment
                raise InfiniError(
                    Status.BAD_PARAM, f"{name} at {ptrs[at]:#x} is not {size}-byte aligned"
                )


def check_disjoint(disjoint: Disjoint, ptrs: list[int], spec: Any) -> None:
    """BAD_PARAM (``refuse_overlap``) naming the first pair of ``disjoint`` that overlaps
    (``spec``: its ``names`` and ``spelling``)."""
    found = disjoint.clash(ptrs)
    if found is not None:
        names, spelling = spec.names, spec.spelling
        written, other = (spelling.get(names[at], names[at]) for at in found)
        raise refuse_overlap(written, other)


def _present(spec: Pass, arrays: tuple) -> dict[str, Any]:
    """The arrays given, by the names their callers know them by."""
    spell = spec.spelling.get
    return {spell(n, n): a for n, a in zip(spec.names, arrays, strict=True) if a is not None}


def _build(
    spec: Pass,
    arrays: tuple,
    raw: tuple,
    described: dict[int, Operand],
    place: tuple[Device, int] | None,
    stream: Any,
) -> Plan:
    """The full path for a new problem (the module docstring), on ``place``, where
    ``_described`` found it (None: every operand is read by its attributes); raises before
    anything is cached or written."""
    names = spec.names
    by_name = dict(zip(names, arrays, strict=True))
    options = spec.options(raw, by_name)
    device, device_id = place or common_place(_present(spec, arrays))
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
    # the reserve the call allocates, where it fills one and the caller gives none
    reserve_size = descriptor.reserve_size if built.reserve and "reserve" not in ops else 0
    constants = {}
    if built.constants:
        with kind.scope(like, call_on, device_id):
            constants = {
                n: _constant(kind, like, (device, device_id), value, desc, spelled[n])
                for n, (value, desc) in built.constants.items()
            }
    launch = descriptor.launcher(
        "the array API's plan cache",
        descriptor.workspace_size,
        built.reserve_size,
        "reserve" in ops,
        current=kind.current_in_scope,
    )
    index = {n: i for i, n in enumerate(names)}
    present = list(ops)
    read_only = [n for n in present if n not in spec.written]
    disjoint = Disjoint(  # each written operand against every other one (each pair once),
        # in the order of the door's ``check_written``: those written after it, then those read
        {index[n]: op.desc for n, op in ops.items()},
        [
            (index[w], index[o])
            for i, w in enumerate(present)
            if w in spec.written
            for o in [n for n in present[i + 1 :] if n in spec.written] + read_only
        ],
    )
    # the reserve the problem uses is checked for its alignment, however it was read
    buffers = frozenset([index["reserve"]] if "reserve" in ops and descriptor.reserve_size else [])
    checked = [index[n] for n in ops if index[n] not in described or index[n] in buffers]
    aligned = Aligned({at: ops[names[at]].desc for at in checked}, buffers, frozenset(described))
    # Each value's expression in a call: its operands' pointers and objects, those of the
    # arrays it allocates, the constants' pointers; a name with none is NULL (0) and None.
    values = {n: f"ptrs[{index[n]}]" for n in ops} | {n: str(p) for n, p in constants.items()}
    objects = {n: f"arrays[{index[n]}]" for n in ops}
    allocators = {}
    for k, (n, desc) in enumerate(built.outputs.items()):
        allocators[f"allocate{k}"] = kind.allocator(like, desc)
        values[n], objects[n] = f"p{k}", f"o{k}"
    if reserve_size:
        allocators["allocate_reserve"] = kind.buffer(like, reserve_size)
        values["reserve"], objects["reserve"] = "pr", "r"
    picked = [
        "0" if f is None else values.get(built.pointers.get(f, f), "0") for f in launch.fields
    ]
    # torch tensors the launch writes (not masked off, not left as they are): held to torch's
    # rule on every call (requires_grad and grad mode may change between calls of one plan),
    # their versions bumped after the launch
    versioned = [
        index[n]
        for n in present
        if n in spec.written
        and n not in built.unwritten
        and values[n] in picked
        and is_tensor(by_name[n])
    ]
    grad_tests = [f"arrays[{at}].requires_grad" for at in versioned if is_plain(arrays[at])]
    grad_test = " or ".join(grad_tests) if len(grad_tests) == len(versioned) else "True"
    source = _plan_call(
        aligned.suspect,
        disjoint.suspect,
        grad_test if versioned else "",
        versioned,
        device != Device.CPU,
        len(built.outputs),
        reserve_size,
        launch.direct,
        descriptor.workspace_size,
        picked,
        [objects.get(n, "None") for n in built.returns],
        spec.result is not None,
    )
    namespace = allocators | {
        "aligned": aligned.check,
        "disjoint": partial(check_disjoint, disjoint),
        "grad_writes": partial(_grad_writes, [(at, spelled[names[at]]) for at in versioned]),
        "bump": version_bump() if versioned else None,
        "spec": spec,
        "result": spec.result,
        "launch": launch.call,
        "call_place": call_place,
        "host_stream": host_stream,
        "place": (kind, device, device_id),
        "address": kind.address,
        "workspaces": Workspaces(
            kind, descriptor.workspace_size, getattr(descriptor, "prepare_workspace", None)
        ),
    }
    exec(compile(source, f"<plan of batch_norm_{spec.name}>", "exec"), namespace)
    # Taken out of its namespace, which would hold it in a cycle: the launch's build is let
    # go with the plan, not at the next garbage collection.
    return Plan(descriptor, namespace.pop("call"), source)


def _grad_writes(written: list[tuple[int, str]], arrays: tuple) -> None:
    """``refuse_grad_write`` on each torch tensor written (at, as the caller names it)."""
    for at, name in written:
        refuse_grad_write(name, arrays[at])


def _plan_call(
    aligned: str,
    disjoint: str,
    grad_test: str,
    bumped: list[int],
    on_device: bool,
    outputs: int,
    reserve_size: int,
    direct: bool,
    workspace_size: int,
    picked: list[str],
    returned: list[str],
    result: bool,
) -> str:
    """The source of a plan's ``call`` (``Plan``), in the names ``_build`` gives it
    (``aligned``, ``launch``...): its checks (the tests ``aligned``, ``disjoint`` and
    ``grad_test``, each empty where there is nothing to test, and the closer looks they call
    for: ``grad_test`` is true where a torch tensor written may require grad), the stream
    and allocation scope on a device (on the host, a check of a stream given), one line per
    allocated array, the launch on the values
    ``picked`` (expressions), the version bump of the torch tensors written (at the indices
    ``bumped``), and the objects ``returned``, through the pass's ``result`` if it has
    one."""
    body = [f"if {aligned}:", "    aligned(ptrs, arrays, spec)"] if aligned else []
    body += [f"if {disjoint}:", "    disjoint(ptrs, spec)"] if disjoint else []
    body += [f"if {grad_test}:", "    grad_writes(arrays)"] if grad_test else []
    indent = ""
    if on_device:
        body += ["stream, scope = call_place(stream, like, *place)", "with scope:"]
        indent = "    "
    else:  # host memory runs on no stream; one given must still be a stream
        body += ["if stream is not None:", "    host_stream(stream)"]
        body += [] if direct else ["stream = 0"]
    launch = [
        line for k in range(outputs) for line in (f"o{k} = allocate{k}()", f"p{k} = address(o{k})")
    ]
    launch += ["r = allocate_reserve()", "pr = address(r)"] if reserve_size else []
    if direct:
        launch += [f"launch({', '.join(picked)})"]
    elif not workspace_size:
        launch += [f"launch({_tuple(picked)}, 0, stream)"]
    else:  # one launch (staging kernels and cuDNN's) at a time on a stream's workspace
        launch += [
            "with workspaces.lock:",
            f"    launch({_tuple(picked)}, workspaces.get(like, stream), stream)",
        ]
    launch += [f"bump({_tuple([f'arrays[{at}]' for at in bumped])})"] if bumped else []
    if not result:
        launch += [f"return {returned[0] if len(returned) == 1 else _tuple(returned)}"]
    else:
        launch += [f"return result({', '.join(returned)})"]
    body += [indent + line for line in launch]
    return "def call(arrays, ptrs, like, stream):\n" + "".join(f"    {b}\n" for b in body)


def _tuple(items: list[str]) -> str:
    """The source of a tuple of the expressions ``items``."""
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
