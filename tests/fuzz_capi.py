"""Fuzz target: the C API on the CPU device (``test_fuzz.py`` runs it in a child process).

Each example is either a tensor-descriptor creation with drawn ``ndim``, shape, strides,
dtype code and out-parameter forms, or one operator's whole cycle (create, attributes, size
queries, compute, destroy) on a good problem that one drawn spoiler may break: a bad
dtype code, shape or stride, a NULL or wrong-kind or destroyed descriptor, a NULL data
pointer, a bad attribute or workspace size, a wrong argument count or a keyword, misuse of
the lifecycle, or attribute changes racing computes from another thread. Scalars come as
Python numbers, NumPy scalars or ctypes values; out-parameters as ``byref``, ``pointer``,
arrays, addresses, or things ctypes would refuse.

Invariants: every call returns a plain int among its function's documented statuses
(never INTERNAL_ERROR on the CPU) with a message when it fails; out-parameter storage and
every tensor's buffer, with guard zones around it, are untouched by a failed call; a
computed result equals PyTorch's float64 one within ``helpers.TOL`` (for an empty batch,
drawn now and then: zero grad_weight/grad_bias and nothing else written); inputs are never
written; after the example, no object is left registered.
"""

import ctypes
import math
import mmap
import sys
import threading

import numpy as np
import torch
from fuzzing import COUNTS, SETTINGS, child_main, problem_values, violation
from helpers import TOL, reference, torch_inference, torch_training
from hypothesis import given
from hypothesis import strategies as st

from cudnn_bn import DataType, Status, capi
from cudnn_bn.tensor import TensorDesc

S = Status
COMMON = {S.SUCCESS, S.NULL_POINTER, S.BAD_PARAM}
TENSORS = COMMON | {S.BAD_TENSOR_DTYPE, S.BAD_TENSOR_SHAPE, S.BAD_TENSOR_STRIDES}
DOCUMENTED = {  # by the function's name without "infiniop" and the operator's name
    "CreateTensorDescriptor": TENSORS,
    "Create": TENSORS,
    "Set": COMMON,
    "Get": COMMON,
    "Compute": COMMON | {S.INSUFFICIENT_WORKSPACE},
    "Destroy": COMMON,
    "CreateHandle": COMMON,
}
SENTINEL = 0x5A5A5A5A5A5A5A5A
GUARD, FILL = 3, -7.25  # guard elements around every buffer, and their value

STATS = ("running_mean", "running_var")
OPERATORS = {  # name -> (tensors in C order, how many are outputs, attributes, size queries)
    "BatchNormBackward": (
        ("grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight", *STATS),
        3,
        ("eps", "mode"),
        ("Workspace",),
    ),
    "BatchNormForwardTraining": (
        ("output", "saved_mean", "saved_invstd", "input", "weight", "bias", *STATS),
        3,
        ("eps", "momentum"),
        ("Workspace", "Reserve"),
    ),
    "BatchNormForwardInference": (
        ("output", "input", "weight", "bias", "running_mean", "running_var"),
        1,
        ("eps",),
        ("Workspace",),
    ),
}
DATA_TENSORS = {"input", "grad_output", "grad_input", "output"}
READ_AND_WRITTEN = {"BatchNormForwardTraining": {"running_mean", "running_var"}}


def call(function, *args, **kwargs) -> int:
    """Call a C-API function; check the status it returns is one it documents."""
    name = function.__name__.removeprefix("infiniop").removeprefix("infinirt")
    kind = next(
        (k for k in DOCUMENTED if name == k),
        next((k for k in ("Create", "Set", "Get", "Destroy") if name.startswith(k)), "Compute"),
    )
    COUNTS["calls"] += 1
    try:
        status = function(*args, **kwargs)
    except BaseException as exc:
        raise violation("escapes", f"{function.__name__} raised {exc!r}") from exc
    if type(status) is not int or status not in DOCUMENTED[kind]:
        raise violation(
            "undocumented_statuses", f"{function.__name__} -> {status!r}: {capi.last_error()}"
        )
    if status and not capi.last_error():
        raise violation("wrong", f"{function.__name__} failed without a message")
    COUNTS[f"status_{S(status).name}"] += 1
    return status


# --- out-parameters -------------------------------------------------------------------------

# Pages this process may only read, and may not touch: an address in them is in the host's
# range, so only the kernel can tell that a write (or a read) there would fault.
_PAGES = {
    "read_only_page": mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ),
    "no_access_page": mmap.mmap(-1, mmap.PAGESIZE, prot=0),
}
PAGE_ADDRESSES = {name: np.frombuffer(m, np.uint8).ctypes.data for name, m in _PAGES.items()}


class Out:
    """An out-parameter form: ``arg`` is passed; ``storage`` (a ctypes object or a Python
    bytes-like) is where a write would land; ``good`` says whether ctypes would take it."""

    def __init__(self, form: str, ctype: type, handle_value: int) -> None:
        self.form, self.good = form, True
        self.storage: object = ctype(SENTINEL)
        if form == "byref":
            self.arg = ctypes.byref(self.storage)
        elif form == "pointer":
            self.arg = ctypes.pointer(self.storage)
        elif form == "array":
            self.storage = (ctype * 1)(SENTINEL)
            self.arg = self.storage
        elif form == "address":
            self.arg = ctypes.addressof(self.storage)
        elif form == "byref_offset":
            self.storage = (ctype * 2)(SENTINEL, SENTINEL)
            self.arg = ctypes.byref(self.storage, ctypes.sizeof(ctype))
        elif form == "as_parameter":
            self.arg = type("Wrapper", (), {"_as_parameter_": ctypes.byref(self.storage)})()
        else:
            self.good = False
            self.arg = {
                "null": None,
                "zero": 0,
                "str": "out-parameter",
                "bytes": b"\x00" * 16,
                "bytearray": bytearray(16),
                "float": 1.5,
                "wrong_type": ctypes.byref(ctypes.c_int(7)),
                "too_small": ctypes.byref((ctypes.c_char * 4)()),
                "past_end": ctypes.byref((ctype * 1)(SENTINEL), 4),
                "handle_value": handle_value,
                "low_address": 0x1230,
                "negative": -8,
                "huge": 1 << 70,
                "c_int": ctypes.c_int(5),
                **PAGE_ADDRESSES,
            }[form]
            if isinstance(self.arg, bytes | bytearray):
                self.storage = self.arg
        self.before = bytes(self.storage)

    def changed(self) -> bool:
        return bytes(self.storage) != self.before

    def value(self) -> int:
        if isinstance(self.storage, ctypes.Array):
            return self.storage[-1]
        return self.storage.value


GOOD_OUT = ["byref", "pointer", "array", "address", "byref_offset", "as_parameter"]
BAD_OUT = [
    "null", "zero", "str", "bytes", "bytearray", "float", "wrong_type", "too_small",
    "past_end", "handle_value", "low_address", "negative", "huge", "c_int", *PAGE_ADDRESSES,
]  # fmt: skip
out_forms = st.sampled_from(GOOD_OUT + BAD_OUT)
good_out_forms = st.sampled_from(GOOD_OUT)


def expect_out(out: Out, status: int, what: str) -> int | None:
    """Check an out-parameter after a call: written on success, untouched on failure."""
    if status == S.SUCCESS:
        if not out.good or not out.changed():
            raise violation("wrong", f"{what}: SUCCESS with out-parameter form {out.form}")
        return out.value()
    if out.changed():
        raise violation("half_writes", f"{what} failed ({status}) but wrote its {out.form}")
    return None


# --- scalars --------------------------------------------------------------------------------


def real(value: float) -> st.SearchStrategy:
    """``(argument, value the C function sees)`` for a double."""
    return st.sampled_from(
        [
            (value, value),
            (ctypes.c_double(value), value),
            (ctypes.c_float(value), float(np.float32(value))),
            (np.float64(value), value),
            (np.float32(value), float(np.float32(value))),
        ]
    )


def integer(value: int) -> st.SearchStrategy:
    forms = [value, ctypes.c_int(value), ctypes.c_long(value), np.int64(value), np.int32(value)]
    if value >= 0:
        forms += [ctypes.c_size_t(value), ctypes.c_uint64(value), np.uint64(value)]
    return st.sampled_from(forms)


BAD_SCALARS = ["1", b"1", None, [1], 1.5j, ctypes.c_char_p(b"x"), 10**400, -(10**400)]


# --- tensors in guarded buffers -------------------------------------------------------------


class Buffer:
    """A tensor view inside a NumPy buffer with ``GUARD`` elements of ``FILL`` around it."""

    def __init__(self, shape, strides, dtype, values=None) -> None:
        extent = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
        extent = extent if 0 not in shape else 0
        self.base = np.full(extent + 2 * GUARD, FILL, dtype)
        item = self.base.itemsize
        self.view = np.lib.stride_tricks.as_strided(
            self.base[GUARD:], shape, tuple(s * item for s in strides)
        )
        if values is not None:
            self.view[...] = values
        self.shape, self.strides = tuple(shape), tuple(strides)
        self.before = self.base.tobytes()

    def guards_intact(self) -> bool:
        return bool((self.base[:GUARD] == FILL).all() and (self.base[-GUARD:] == FILL).all())

    def unchanged(self) -> bool:
        return self.base.tobytes() == self.before

    def restore(self) -> None:
        self.base[...] = np.frombuffer(self.before, self.base.dtype)


def layout_strides(shape, layout: str, rng: np.random.Generator) -> tuple[int, ...]:
    if layout == "padded":
        padded = (*shape[:-1], shape[-1] + 2)
        return TensorDesc.contiguous(DataType.F32, padded).strides
    order = list(range(len(shape)))
    if layout == "channels_last":
        order = [0, *range(2, len(shape)), 1]
    elif layout == "permuted":
        order = list(rng.permutation(len(shape)))
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides)


def tensor_desc(shape, strides, dtype, form: int, handles: list, good: bool = True) -> int | None:
    """A descriptor for a tensor, shape and strides passed in form ``form``; a ``good`` one
    must be accepted, another may be refused (None)."""
    n = len(shape)
    shape_arg, strides_arg = [
        (list(shape), list(strides)),
        ((ctypes.c_size_t * n)(*shape), (ctypes.c_ssize_t * n)(*strides)),
        (tuple(np.uint64(v) for v in shape), tuple(np.int64(v) for v in strides)),
        ((ctypes.c_uint64 * n)(*shape), (ctypes.c_int64 * n)(*strides)),
    ][form]
    desc = ctypes.c_void_p()
    status = call(
        capi.infiniopCreateTensorDescriptor, ctypes.byref(desc), n, shape_arg, strides_arg, dtype
    )
    if status != S.SUCCESS:
        if good:
            raise violation("wrong", f"good tensor {shape} {strides} refused: {capi.last_error()}")
        return None
    handles.append(("TensorDescriptor", desc.value))
    return desc.value


# --- examples: tensor descriptors -------------------------------------------------------------

shape_entries = st.one_of(
    st.integers(0, 6),
    st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, 2**64]),
)
stride_entries = st.one_of(
    st.integers(-6, 12), st.sampled_from([2**62, -(2**62), 2**63 - 1, -(2**63), 2**63])
)


@st.composite
def tensor_creation(draw):
    ndim = draw(st.integers(0, 7))
    shape = draw(st.lists(shape_entries, min_size=ndim, max_size=ndim))
    strides = draw(st.none() | st.lists(stride_entries, min_size=ndim, max_size=ndim))
    dtype = draw(st.integers(-2, 22) | st.sampled_from(BAD_SCALARS))
    shape_form = draw(
        st.sampled_from(["list", "size_t", "int64", "int", "address", "str", "no_access_page"])
    )
    # A raw address carries no length: more entries than it has would be the caller's bug.
    counts = [ndim, max(ndim - 1, 0)] + ([] if shape_form == "address" else [ndim + 1])
    ndim_arg = draw(integer(draw(st.sampled_from(counts))))
    return ndim, ndim_arg, shape, strides, dtype, shape_form


def _array_form(values, form: str, element):
    if values is None:
        return None, None
    fits = (
        all(0 <= v < 2**64 for v in values)
        if element is ctypes.c_size_t
        else all(-(2**63) <= v < 2**63 for v in values)
    )
    if form == "list" or not fits:
        return list(values), None
    if form == "str":
        return "1,2,3", None
    if form == "no_access_page":  # entries no one may read
        return PAGE_ADDRESSES[form], None
    ctype = {"size_t": element, "int64": ctypes.c_int64, "int": ctypes.c_int}[
        form if form != "address" else "size_t"
    ]
    if form == "int" and not all(-(2**31) <= v < 2**31 for v in values):
        ctype = element
    if form == "int64" and not all(-(2**63) <= v < 2**63 for v in values):
        ctype = element
    array = (ctype * len(values))(*values)
    return (ctypes.addressof(array) if form == "address" else array), array


def fuzz_tensor_descriptor(data) -> None:
    ndim, ndim_arg, shape, strides, dtype, form = data.draw(tensor_creation())
    out = Out(data.draw(out_forms), ctypes.c_void_p, 0xFFFF_8000_0000_1000)
    shape_arg, keep_shape = _array_form(shape, form, ctypes.c_size_t)
    strides_arg, keep_strides = _array_form(strides, form, ctypes.c_ssize_t)
    status = call(
        capi.infiniopCreateTensorDescriptor, out.arg, ndim_arg, shape_arg, strides_arg, dtype
    )
    del keep_shape, keep_strides
    value = expect_out(out, status, "CreateTensorDescriptor")
    if value is None:
        return
    desc = capi._objects.get(value)
    count = int(getattr(ndim_arg, "value", ndim_arg))
    listed = isinstance(shape_arg, list) and (strides is None or isinstance(strides_arg, list))
    if not isinstance(desc, TensorDesc) or (listed and count != ndim) or count > ndim:
        raise violation("wrong", f"descriptor {desc} for ndim {ndim_arg!r}, shape {shape}")
    if desc.shape != tuple(shape[:count]):
        raise violation("wrong", f"descriptor shape {desc.shape}, given {shape}")
    if strides is not None and desc.strides != tuple(strides[:count]):
        raise violation("wrong", f"descriptor strides {desc.strides}, given {strides}")
    if call(capi.infiniopDestroyTensorDescriptor, value) != S.SUCCESS:
        raise violation("wrong", "destroying a new descriptor failed")


# --- examples: an operator's cycle --------------------------------------------------------------

SPOILERS = [
    "none", "none", "none", "dtype_code", "dtype_mismatch", "shape", "channels",
    "overlapping_output", "negative_stride", "null_desc", "handle_as_tensor", "tensor_as_handle",
    "destroyed_tensor", "destroyed_handle", "null_data", "bad_eps", "bad_mode_or_momentum",
    "bad_scalar", "workspace_size", "arg_count", "keyword", "wrong_kind_op", "double_destroy",
    "use_after_destroy", "size_out", "concurrent_attributes", "misaligned_data",
    "aliased_output",
]  # fmt: skip
RACES = 100  # computes racing attribute changes in a "concurrent_attributes" example


@st.composite
def cycle(draw):
    op = draw(st.sampled_from(sorted(OPERATORS)))
    ndim = draw(st.integers(2, 5))
    c = draw(st.integers(1, 4))
    rest = draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1))
    shape = (rest[0], c, *rest[1:])
    if math.prod(shape) // c < 2:
        shape = (shape[0] + 1, *shape[1:])
    if draw(st.integers(0, 7)) == 0:  # an empty batch: N = 0, or another size but C
        axis = draw(st.sampled_from([0, *range(2, ndim)]))
        shape = (*shape[:axis], 0, *shape[axis + 1 :])
    return dict(
        op=op,
        shape=shape,
        dtype=draw(st.sampled_from([DataType.F32, DataType.F64])),
        layout=draw(st.sampled_from(["contiguous", "padded", "channels_last", "permuted"])),
        channel_stride=draw(st.sampled_from([1, 2])),
        eps=draw(real(draw(st.sampled_from([1e-5, 1e-3, 0.1])))),
        mode=draw(st.integers(0, 3)),
        momentum=draw(real(draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])))),
        stats=draw(st.booleans()) or op != "BatchNormForwardTraining",
        spoiler=draw(st.sampled_from(SPOILERS)),
        desc_form=draw(st.integers(0, 3)),
        pointer_form=draw(st.sampled_from(["int", "c_void_p", "as_parameter"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _pointer(buffer: Buffer, form: str):
    address = buffer.view.ctypes.data
    return {
        "int": address,
        "c_void_p": ctypes.c_void_p(address),
        "as_parameter": buffer.view.ctypes,
    }[form]


def fuzz_cycle(data) -> None:
    p = data.draw(cycle())
    op, (tensors, outputs, attributes, sizes) = p["op"], OPERATORS[p["op"]]
    rng = np.random.default_rng(p["seed"])
    shape, c = p["shape"], p["shape"][1]
    storage = np.float32 if p["dtype"] == DataType.F32 else np.float64
    spoiler = p["spoiler"]
    handles = CREATED
    # The C API's saved statistics are outputs: no values of their own.
    values = {n: v for n, v in problem_values(rng, shape).items() if not n.startswith("saved_")}
    buffers = {}
    for name in tensors:
        if name in DATA_TENSORS:
            strides = layout_strides(shape, p["layout"], rng)
            buffers[name] = Buffer(shape, strides, storage, values.get(name))
        else:
            buffers[name] = Buffer((c,), (p["channel_stride"],), storage, values.get(name))
    # Packed copies: torch 2.13's CPU native_batch_norm_backward misreads grad_output whose
    # layout differs from input's (e.g. strides (6, 3, 1, 1) and (6, 1, 2, 1), shape (1, 2, 3, 1)).
    rounded = {n: np.array(b.view, np.float64, order="C") for n, b in buffers.items()}

    handle = Out(data.draw(good_out_forms), ctypes.c_void_p, 0)
    status = call(capi.infiniopCreateHandle, handle.arg)
    handle_value = expect_out(handle, status, "CreateHandle")
    handles.append(("Handle", handle_value))

    descs = {}
    for name in tensors:
        b = buffers[name]
        descs[name] = tensor_desc(b.shape, b.strides, int(p["dtype"]), p["desc_form"], handles)
    target = data.draw(st.sampled_from(tensors))
    if spoiler in ("dtype_code", "dtype_mismatch", "shape", "channels", "overlapping_output",
                   "negative_stride"):  # fmt: skip
        b = buffers[target]
        dtype, sh, st_ = int(p["dtype"]), list(b.shape), list(b.strides)
        if spoiler == "dtype_code":
            dtype = data.draw(st.sampled_from([0, 2, 5, 6, 9, 11, 15, 18, 19]))
        elif spoiler == "dtype_mismatch":
            dtype = 14 if dtype == 13 else 13
        elif spoiler == "shape":
            sh[-1] += 1
        elif spoiler == "channels":
            sh[1 if len(sh) > 1 else 0] += 1
        elif spoiler == "overlapping_output":
            target = data.draw(st.sampled_from(tensors[:outputs]))
            b = buffers[target]
            sh, st_ = list(b.shape), list(b.strides)
            axis = int(np.argmax(sh))
            if sh[axis] > 1:
                st_[axis] = 0
        else:
            st_[-1] = -abs(st_[-1])
        descs[target] = tensor_desc(tuple(sh), tuple(st_), dtype, 0, handles, good=False)
    elif spoiler == "null_desc":
        descs[target] = None
    elif spoiler == "handle_as_tensor":
        descs[target] = handle_value
    elif spoiler == "destroyed_tensor":
        call(capi.infiniopDestroyTensorDescriptor, descs[target])
        handles.remove(("TensorDescriptor", descs[target]))
    if not p["stats"]:
        for name in ("running_mean", "running_var"):
            descs[name] = None
    handle_arg = handle_value
    if spoiler == "tensor_as_handle":
        handle_arg = descs["input"]
    elif spoiler == "destroyed_handle":
        call(capi.infiniopDestroyHandle, handle_value)
        handles.remove(("Handle", handle_value))

    create = getattr(capi, f"infiniopCreate{op}Descriptor")
    out = Out(
        data.draw(good_out_forms if spoiler != "size_out" else out_forms),
        ctypes.c_void_p,
        handle_value,
    )
    status = call(create, handle_arg, out.arg, *(descs[n] for n in tensors))
    op_desc = expect_out(out, status, f"Create{op}Descriptor")
    if op_desc is not None:
        handles.append((f"{op}Descriptor", op_desc))
    computed = False
    attrs = {"eps": 1e-5, "mode": 0, "momentum": 0.1}
    if op_desc is not None:
        # attributes
        drawn = {"eps": p["eps"], "mode": (p["mode"], p["mode"]), "momentum": p["momentum"]}
        args = []
        for a in attributes:
            arg, seen = drawn[a]
            if a == "mode":
                arg = data.draw(integer(p["mode"]))
            args.append((arg, seen))
        if spoiler == "bad_eps":
            args[0] = (data.draw(st.sampled_from([-1.0, math.nan, math.inf, -math.inf])), None)
        elif spoiler == "bad_mode_or_momentum" and len(args) > 1:
            bad = [4, -1, 99] if attributes[1] == "mode" else [1.5, -0.1, math.nan]
            args[1] = (data.draw(st.sampled_from(bad)), None)
        elif spoiler == "bad_scalar":
            index = data.draw(st.integers(0, len(args) - 1))
            args[index] = (
                data.draw(
                    st.sampled_from([*BAD_SCALARS, 1.5 if attributes[index] == "mode" else "x"])
                ),
                None,
            )
        setter = getattr(capi, f"infiniopSet{op}Attributes")
        args_set = args
        status = call(setter, op_desc, *(a for a, _ in args))
        if status == S.SUCCESS:
            if any(seen is None for _, seen in args):
                raise violation("wrong", f"bad attribute accepted: {args}")
            attrs.update({a: seen for a, (_, seen) in zip(attributes, args, strict=True)})
        # sizes
        size_values = []
        for size in sizes:
            form = data.draw(out_forms if spoiler == "size_out" else good_out_forms)
            size_out = Out(form, ctypes.c_size_t, handle_value)
            status = call(getattr(capi, f"infiniopGet{op}{size}Size"), op_desc, size_out.arg)
            value = expect_out(size_out, status, f"Get{op}{size}Size")
            size_values.append(size_out.storage if value is not None and form == "byref" else 0)
        # compute
        pointers = [_pointer(buffers[n], p["pointer_form"]) for n in tensors]
        if spoiler == "null_data":
            pointers[tensors.index(target)] = data.draw(
                st.sampled_from([None, 0, ctypes.c_void_p()])
            )
        misplaced = _misplaced(data, spoiler, tensors[:outputs], buffers, pointers, shape)
        buffer_args = []
        for value in size_values:
            buffer_args += [None, value]
        if spoiler == "workspace_size":
            buffer_args[1] = data.draw(st.sampled_from([-1, 2**64, "0", 1.0, None]))
        compute = getattr(capi, f"infiniop{op}")
        desc_arg = op_desc
        if spoiler == "wrong_kind_op":
            desc_arg = data.draw(st.sampled_from([handle_value, descs["input"], 12345, 0]))
        if spoiler == "use_after_destroy":
            call(getattr(capi, f"infiniopDestroy{op}Descriptor"), op_desc)
            handles.remove((f"{op}Descriptor", op_desc))
        args = [desc_arg, *buffer_args, *pointers, None]
        kwargs = {}
        if spoiler == "arg_count":
            args = args[:-1] if data.draw(st.booleans()) else [*args, None]
        elif spoiler == "keyword":
            kwargs = {"stream": args.pop()}
        if spoiler == "concurrent_attributes":
            _race(setter, op_desc, attributes, [a for a, _ in args_set], p, compute, args)
            for b in buffers.values():  # the raced computes updated running statistics
                b.restore()
        status = call(compute, *args, **kwargs)
        computed = status == S.SUCCESS
        if misplaced and status != S.BAD_PARAM:
            raise violation("wrong", f"{misplaced} gave {S(status).name}, not BAD_PARAM")
        if spoiler == "double_destroy" and op_desc is not None:
            call(getattr(capi, f"infiniopDestroy{op}Descriptor"), op_desc)
            handles.remove((f"{op}Descriptor", op_desc))
            if call(getattr(capi, f"infiniopDestroy{op}Descriptor"), op_desc) != S.BAD_PARAM:
                raise violation("wrong", "a second destroy did not return BAD_PARAM")
    written = set(tensors[:outputs]) | {
        n for n in READ_AND_WRITTEN.get(op, ()) if descs[n] is not None
    }
    if 0 in shape:  # as torch: only zero weight and bias gradients, nothing else written
        written &= {"grad_weight", "grad_bias"}
    _check_memory(op, buffers, rounded, computed, attrs, written, storage)
    if spoiler == "none" and not computed:
        raise violation("wrong", f"a good {op} problem failed: {capi.last_error()}")
    _destroy(handles)


def _misplaced(data, spoiler: str, outputs: tuple, buffers: dict, pointers: list, shape) -> str:
    """For the "misaligned_data" and "aliased_output" spoilers, an output's pointer (one
    with elements) one byte past its start, or another output's or the input's: what the
    compute must refuse (BAD_PARAM), as said, but for a data output on the input, which the
    CPU engine takes in place (``OperatorDescriptor._in_place``); "" where nothing was
    spoiled."""
    if spoiler not in ("misaligned_data", "aliased_output"):
        return ""
    names = [*outputs, "input"]
    if 0 in shape:  # the data tensors have no elements: any address is theirs; as torch,
        # an empty problem writes only zero weight and bias gradients
        names = [n for n in names if n not in DATA_TENSORS]
        outputs = tuple(n for n in outputs if n in ("grad_weight", "grad_bias"))
    if len(names) < 2 or not outputs:
        return ""
    written = data.draw(st.sampled_from([n for n in names if n in outputs]))
    at = list(buffers).index(written)
    if spoiler == "misaligned_data":
        pointers[at] = buffers[written].view.ctypes.data + 1
        return f"{written} one byte off"
    # a data output over the (read) input is in place on the CPU engine, in any layout
    in_place = {"input"} if written in DATA_TENSORS else set()
    others = [n for n in names if n != written and n not in in_place]
    if not others:
        return ""
    other = data.draw(st.sampled_from(others))
    pointers[at] = buffers[other].view.ctypes.data
    return f"{written} at {other}'s address"


def _race(setter, op_desc: int, names: tuple, values: list, p: dict, compute, args: list) -> None:
    """Compute ``RACES`` times while another thread sets other good attributes (eps 0.1, the
    next mode, momentum 0.5) and the drawn ``values`` in turn, ending with the drawn ones,
    threads switching often: each compute succeeds (the call after this one, on restored
    buffers, checks the result)."""
    other = [{"eps": 0.1, "mode": (p["mode"] + 1) % 4, "momentum": 0.5}[n] for n in names]
    attributes = values
    stop, failures = threading.Event(), []

    def change() -> None:
        try:
            while not stop.is_set():
                for values in (other, attributes):
                    if call(setter, op_desc, *values) != S.SUCCESS:
                        raise violation("wrong", f"setting {values} failed: {capi.last_error()}")
        except BaseException as exc:  # reported by the computing thread
            failures.append(exc)

    thread, interval = threading.Thread(target=change), sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    thread.start()
    try:
        for _ in range(RACES):
            COUNTS["raced_computes"] += 1
            if call(compute, *args) != S.SUCCESS:
                raise violation("wrong", f"a raced compute failed: {capi.last_error()}")
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    if failures:
        raise failures[0]


CREATED: list = []  # (kind, value) of what the example created and has not destroyed


def _check_memory(op, buffers, rounded, computed, attrs, written, storage) -> None:
    """Guards intact; nothing written unless computed, then only outputs, equal to torch's."""
    for name, b in buffers.items():
        if not b.guards_intact():
            raise violation("half_writes", f"{op} wrote outside {name}")
        if (not computed or name not in written) and not b.unchanged():
            raise violation("half_writes", f"{op} changed {name} (computed: {computed})")
    if not computed:
        return
    tol = TOL[np.dtype(storage)]
    got = {n: buffers[n].view.astype(np.float64) for n in written}
    if rounded["input"].size == 0:
        COUNTS["empty_batches_checked"] += 1
        want = {n: torch.zeros(buffers[n].shape, dtype=torch.float64) for n in written}
    elif op == "BatchNormBackward":
        mode = ["train", "saved", "eval", "saved"][attrs["mode"]]
        stats = {"mean": rounded["running_mean"]}
        stats["invstd" if attrs["mode"] == 3 else "var"] = rounded["running_var"]
        want = reference(
            rounded["input"],
            rounded["grad_output"],
            rounded["weight"],
            mode=mode,
            eps=attrs["eps"],
            **stats,
        )
        want = dict(zip(("grad_input", "grad_weight", "grad_bias"), want, strict=True))
    elif op == "BatchNormForwardInference":
        want = {"output": torch_inference(rounded, eps=attrs["eps"])}
    else:
        y, mean, invstd, rm, rv = torch_training(rounded, attrs["momentum"], attrs["eps"])
        want = {"output": y, "saved_mean": mean, "saved_invstd": invstd}
        want |= {"running_mean": rm, "running_var": rv}
    COUNTS["results_checked"] += 1
    for name, expected in want.items():
        if name not in written:
            continue
        if not np.allclose(got[name], expected.numpy(), atol=tol, rtol=tol):
            raise violation("wrong", f"{op} {name} differs from torch: {got[name]} vs {expected}")


def _destroy(handles: list) -> None:
    while handles:
        kind, value = handles.pop()
        function = getattr(capi, f"infiniopDestroy{kind}")
        if call(function, value) != S.SUCCESS:
            raise violation("wrong", f"destroying a live {kind} failed: {capi.last_error()}")


@SETTINGS
@given(st.data())
def fuzz(data) -> None:
    live = len(capi._objects)
    COUNTS["examples"] += 1
    try:
        if data.draw(st.integers(0, 3)) == 0:
            COUNTS["tensor_examples"] += 1
            fuzz_tensor_descriptor(data)
        else:
            COUNTS["cycle_examples"] += 1
            fuzz_cycle(data)
    finally:  # hypothesis may stop an example at any draw
        while CREATED:
            kind, value = CREATED.pop()
            getattr(capi, f"infiniopDestroy{kind}")(value)
    if len(capi._objects) != live:
        raise violation("leaks", f"{len(capi._objects) - live} objects left registered")


def after_run() -> None:
    if capi._objects:
        raise violation("leaks", f"{len(capi._objects)} objects registered after a run")


if __name__ == "__main__":
    child_main(fuzz, after_run)
