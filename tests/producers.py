"""Array producers for ``fuzz_arrays.py``: one operand's values exposed honestly or with one lie.

``produce`` wraps a typed NumPy array (its bytes are the caller's memory) in a drawn form:
NumPy's array interface (v3; ``data`` as ``(address, read-only)``, a buffer, exactly the
bytes reached, or None for the object's own buffer), the CUDA array interface (v3, here over
host memory), DLPack (1.0 versioned and legacy capsules laid out as ``dlpack.h`` v1.0 says,
producers with and without the 1.0 keywords), byte-swapped dtypes, ml_dtypes' bfloat16,
torch views with the negative or conjugate bit, torch and NumPy subclasses (a memmap, a
matrix, ones whose shape and strides properties lie), masked arrays, NumPy 2's own
``__dlpack__`` wrapped in another object.

Every form comes with ``Marks``, what a correct reader must do with it: ``truth``, the float64
values it holds (None: it lies detectably, or its memory is no host call's, so it must be
refused; ``numpy_truth``: what NumPy's own arithmetic reads where that differs, e.g. a
big-endian array, for the functions computed by NumPy); ``writable``, whether writing it in
place reaches ``backing`` (the memory whose bytes must not change when a call fails);
``host``, whether it claims host memory (a call holding one must not touch CUDA);
``raised``, the exception its own method raises (the caller's own, which may pass through
the call unchanged); ``lie``, what it does; ``itemsize``, for the tolerance.
"""

import ctypes
import json
import tempfile
import textwrap
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch
from hypothesis import strategies as st


class ProducerError(Exception):
    """Raised by a producer's own method: the caller's exception, not the package's."""


# Where a raising producer's exception comes from: its own method, or a library that method
# calls, whose frame is then the innermost (the standard library's, NumPy's in site-packages,
# or a builtin's, which has none). Each passes through a call unchanged
# (``errors.raised_by_caller``); most are the ValueError or TypeError a careless ``except``
# in the package would swallow.
LIBRARY_CALLS = {
    "json": lambda: json.loads("{"),  # JSONDecodeError (a ValueError), in json.decoder
    "textwrap": lambda: textwrap.dedent(5),  # TypeError, in textwrap
    "numpy": lambda: np.broadcast_shapes((2,), (3,)),  # ValueError, in NumPy's Python
    "builtin": lambda: int("x"),  # ValueError, from C: the producer's frame is innermost
}
RAISED_BY = ("own", "own", *LIBRARY_CALLS)


@st.composite
def raised_error(draw, lie: str) -> BaseException:
    """The exception a producer telling ``lie`` raises from its method, from a drawn origin
    (``RAISED_BY``): made once, with a library's frames in its traceback."""
    origin = draw(st.sampled_from(RAISED_BY))
    if origin == "own":
        return ProducerError(lie)
    try:
        LIBRARY_CALLS[origin]()
    except Exception as exc:
        return exc
    raise AssertionError(f"{origin} raised nothing")


@dataclass
class Marks:
    """What a correct reader must do with a drawn form (the module's docstring)."""

    backing: Any
    truth: np.ndarray | None
    lie: str = "none"
    writable: bool = True
    host: bool = True
    raised: BaseException | None = None
    numpy_truth: np.ndarray | None = None  # what NumPy's own arithmetic reads, if not truth
    itemsize: int = 8  # of the element type the values are held in (for the tolerance)
    view: Any = None  # the operand's values as they are now, as NumPy or torch sees them

    def now(self) -> np.ndarray:
        """The operand's values now (after a call wrote it), in float64."""
        if isinstance(self.view, torch.Tensor):
            return _f64(self.view.detach().resolve_neg().resolve_conj().numpy())
        return _f64(np.ma.getdata(self.view))


def mark(obj, backing, truth, lie="none", *, view=None, itemsize=None, **marks):
    """``(obj, its Marks)`` (``view``: ``obj`` where NumPy or torch reads it, else
    ``backing``); a producer of ours raises ``raised`` from its own methods."""
    if marks.get("raised") is not None:
        obj.raised = marks["raised"]
    if view is None:
        view = obj if isinstance(obj, np.ndarray | torch.Tensor) else backing
    itemsize = itemsize or getattr(getattr(view, "dtype", None), "itemsize", 8)
    return obj, Marks(backing, truth, lie, **marks, itemsize=itemsize, view=view)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _extent(a: np.ndarray) -> tuple[int, int]:
    """``[low, high)``: the bytes ``a`` reaches relative to its first element."""
    if a.size == 0:
        return 0, 0
    low = sum(min(0, (n - 1) * s) for n, s in zip(a.shape, a.strides, strict=True))
    high = sum(max(0, (n - 1) * s) for n, s in zip(a.shape, a.strides, strict=True))
    return low, high + a.itemsize


def _f64(a: np.ndarray) -> np.ndarray:
    return np.array(a, np.float64, order="C")


# --- the array interfaces ---------------------------------------------------------------------


class Interface:
    """An object whose ``__array_interface__`` is the dict as drawn (or raises)."""

    raised = None

    def __init__(self, iface):
        self.iface = iface

    @property
    def __array_interface__(self):
        if self.raised is not None:
            raise self.raised
        return self.iface


class OwnBuffer(bytearray):
    """A buffer-protocol object whose interface's ``data`` is None: its own bytes."""

    raised = None

    @property
    def __array_interface__(self):
        if self.raised is not None:
            raise self.raised
        return self.iface


class CudaInterface:
    """An object claiming device memory (``__cuda_array_interface__``) at a host address."""

    raised = None

    def __init__(self, iface):
        self.iface = iface

    @property
    def __cuda_array_interface__(self):
        if self.raised is not None:
            raise self.raised
        return self.iface


class Turning:
    """An array interface that turns: ``first`` on its first ``k - 1`` reads, ``then`` from
    read ``k`` on (an attacker's, or a producer racing a writer); ``reads`` counts them.
    ``HostTurning`` exposes it as ``__array_interface__``, ``DeviceTurning`` as
    ``__cuda_array_interface__``."""

    def __init__(self, first: dict, then: dict, k: int) -> None:
        self.first, self.then, self.k, self.reads = first, then, k, 0

    def _read(self) -> dict:
        self.reads += 1
        return self.first if self.reads < self.k else self.then


class HostTurning(Turning):
    __array_interface__ = property(Turning._read)


class DeviceTurning(Turning):
    __cuda_array_interface__ = property(Turning._read)


# Lies a reader may take (the interface stays valid) and lies it must refuse.
ALLOWED = ("none", "no_version", "list_shape", "read_only_pair")
REFUSED = (
    "no_shape", "no_typestr", "no_data", "not_dict", "raises", "shape_negative",
    "shape_huge", "shape_overflow", "shape_float", "shape_str", "shape_bool",
    "typestr_garbage", "typestr_int", "typestr_none", "typestr_swapped", "typestr_int_kind",
    "typestr_complex", "strides_short", "strides_partial", "strides_str", "strides_float",
    "strides_beyond", "data_short_tuple", "data_float_address", "data_negative", "data_huge",
    "data_null", "data_misaligned", "data_str", "data_int", "data_small", "mask",
    "offset_negative", "offset_beyond", "offset_float",
)  # fmt: skip
CUDA_LIES = ("none", "no_shape", "no_data", "typestr_garbage", "stream_zero", "stream_str",
             "mask", "strides_short", "raises")  # fmt: skip


def _first_long_axis(shape) -> int | None:
    return next((i for i, n in enumerate(shape) if n > 1), None)


def _interface_lie(lie: str, iface: dict, form: str, size: int) -> str:
    """Tell ``iface`` ``lie``: "valid" (a reader may take it), "read-only" or "refused"."""
    shape, itemsize = tuple(iface["shape"]), np.dtype(iface["typestr"]).itemsize
    numel, buffered = int(np.prod(shape)), form != "pair"
    address = iface["data"][0] if form == "pair" else 0
    edits = {
        "no_version": lambda: iface.pop("version"),
        "list_shape": lambda: iface.update(shape=list(shape)),
        "no_shape": lambda: iface.pop("shape"),
        "no_typestr": lambda: iface.pop("typestr"),
        "no_data": lambda: iface.pop("data"),
        "shape_negative": lambda: iface.update(shape=(-1, *shape[1:])),
        "shape_huge": lambda: iface.update(shape=(1 << 63, *shape[1:])),
        "shape_overflow": lambda: (iface.pop("strides", None), iface.update(shape=(1 << 40,) * 2)),
        "shape_float": lambda: iface.update(shape=tuple(float(n) for n in shape)),
        "shape_str": lambda: iface.update(shape="shape"),
        "shape_bool": lambda: iface.update(shape=tuple(n > 0 for n in shape)),
        "typestr_garbage": lambda: iface.update(typestr="zz9"),
        "typestr_int": lambda: iface.update(typestr=8),
        "typestr_none": lambda: iface.update(typestr=None),
        "typestr_swapped": lambda: iface.update(typestr=">" + iface["typestr"][1:]),
        "typestr_int_kind": lambda: iface.update(typestr=f"<i{itemsize}"),
        "typestr_complex": lambda: iface.update(typestr=f"<c{2 * itemsize}"),
        "strides_short": lambda: iface.update(strides=_strides(iface)[:-1]),
        "strides_partial": lambda: iface.update(strides=_partial(_strides(iface))),
        "strides_str": lambda: iface.update(strides="strides"),
        "strides_float": lambda: iface.update(strides=tuple(float(s) for s in _strides(iface))),
        "data_short_tuple": lambda: iface.update(data=(address,)),
        "data_float_address": lambda: iface.update(data=(float(address), False)),
        "data_negative": lambda: iface.update(data=(-itemsize, False)),
        "data_huge": lambda: iface.update(data=((1 << 64) + itemsize, False)),
        "data_str": lambda: iface.update(data="data"),
        "data_int": lambda: iface.update(data=12345),
        "mask": lambda: iface.update(mask=np.ones(shape, bool)),
        "offset_negative": lambda: iface.update(offset=-1),
        "offset_beyond": lambda: iface.update(offset=size + itemsize),
        "offset_float": lambda: iface.update(offset=0.5),
    }  # fmt: skip
    if lie in edits:
        edits[lie]()
    if lie == "raises":
        return "refused"
    if lie in ("none", "no_version", "list_shape") or (lie.startswith("offset") and not buffered):
        return "valid"  # a pair's data: NumPy ignores the offset
    if lie == "read_only_pair":
        if form == "pair":
            iface["data"] = (address, True)
            return "read-only"
        return "valid"
    if lie == "no_data":
        return "valid" if form == "own" else "refused"
    if lie == "strides_beyond":
        axis = _first_long_axis(shape)
        if not buffered or axis is None or not numel:
            return "valid"  # a raw address: nothing tells how far it may reach; empty: none
        strides = list(_strides(iface))
        strides[axis] = (size // itemsize + 1) * itemsize
        iface["strides"] = tuple(strides)
        return "refused"
    if lie in ("data_null", "data_misaligned"):
        if form != "pair" or not numel:
            return "valid"
        iface["data"] = (0 if lie == "data_null" else address + 1, False)
        return "refused"
    if lie == "data_small":
        if not buffered or not numel:
            return "valid"
        iface["data"], iface["offset"] = memoryview(bytearray(2)), 0
        return "refused"
    return "refused"


def _partial(strides: tuple[int, ...]) -> tuple[int, ...]:
    """``strides`` with the first one not a whole number of elements."""
    return (strides[0] + 1, *strides[1:])


def _strides(iface: dict) -> tuple[int, ...]:
    shape, itemsize = iface["shape"], np.dtype(iface["typestr"]).itemsize
    if iface.get("strides") is not None:
        return tuple(iface["strides"])
    packed, step = [], itemsize
    for n in reversed(shape):
        packed.append(step)
        step *= n
    return tuple(reversed(packed))


def array_interface(draw, a: np.ndarray) -> Any:
    """``a`` behind ``__array_interface__``, its data in a drawn form, with one drawn lie."""
    lie = draw(st.sampled_from(ALLOWED * 4 + REFUSED))
    form = draw(st.sampled_from(("pair", "buffer", "exact", "own")))
    root, (low, high) = _root(a), _extent(a)
    offset = a.ctypes.data - root.ctypes.data
    iface = {"version": 3, "shape": a.shape, "typestr": a.dtype.str}
    if not a.flags.c_contiguous or draw(st.booleans()):
        iface["strides"] = a.strides
    raw = root.ravel(order="K").view(np.uint8)  # its bytes in memory order, not a copy
    assert np.shares_memory(raw, root) or not root.size
    backing, writable = a, bool(a.flags.writeable)
    if form == "pair":
        iface["data"] = (a.ctypes.data, not writable)
    elif form == "buffer":
        iface["data"], iface["offset"] = memoryview(raw), offset
    elif form == "exact":  # just the bytes the operand reaches
        iface["data"], iface["offset"] = memoryview(raw[offset + low : offset + high]), -low
        raw = raw[offset + low : offset + high]
    size = raw.size
    view = a
    if form == "own":
        obj = OwnBuffer(raw.tobytes())
        iface["data"], iface["offset"] = None, offset
        backing, writable = np.frombuffer(obj, np.uint8), True
        view = np.ndarray(a.shape, a.dtype, obj, offset, a.strides)
    else:
        obj = Interface(iface)
    verdict = _interface_lie(lie, iface, form, size)
    obj.iface = ["not", "a", "dict"] if lie == "not_dict" else iface
    raised = draw(raised_error(lie)) if lie == "raises" else None
    truth = None if verdict == "refused" else _f64(a)
    writable = writable and verdict != "read-only"
    lie = f"interface_{form}_{lie}"
    return mark(obj, backing, truth, lie, view=view, writable=writable, raised=raised)


def cuda_interface(draw, a: np.ndarray) -> Any:
    """``a``'s host memory claimed as device memory through ``__cuda_array_interface__``:
    never usable here, refused before CUDA is asked anything where host arrays are present."""
    lie = draw(st.sampled_from(CUDA_LIES))
    iface = {
        "version": 3, "shape": a.shape, "typestr": a.dtype.str, "strides": a.strides,
        "data": (a.ctypes.data, False), "stream": None,
    }  # fmt: skip
    if lie in ("no_shape", "no_data", "typestr_garbage", "mask", "strides_short"):
        _interface_lie(lie, iface, "pair", a.nbytes)
    elif lie.startswith("stream"):
        iface["stream"] = 0 if lie == "stream_zero" else "stream"
    raised = draw(raised_error(lie)) if lie == "raises" else None
    return mark(CudaInterface(iface), a, None, f"cuda_{lie}", host=False, raised=raised)


# --- DLPack -------------------------------------------------------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]  # fmt: skip


class DLManagedTensor(ctypes.Structure):  # legacy (0.x): the tensor first
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]  # fmt: skip


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor),
    ]  # fmt: skip


new_capsule = ctypes.pythonapi.PyCapsule_New
new_capsule.restype = ctypes.py_object
new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
READ_ONLY, IS_COPIED = 1, 2
DLPACK_LIES = (
    "none", "none", "none", "strides_null", "byte_offset", "no_device_method", "read_only",
    "is_copied", "copy_refused", "ndim_negative", "ndim_huge", "dtype_int", "dtype_complex",
    "dtype_bool", "dtype_bits", "lanes", "device_cuda", "device_other", "device_id_negative",
    "device_mismatch", "major", "data_null", "misaligned", "not_capsule", "used_capsule",
    "raises", "device_raises", "device_garbage",
)  # fmt: skip
DLPACK_VALID = (  # lies a reader may take: the operand is what it says
    "none", "strides_null", "byte_offset", "no_device_method", "read_only", "is_copied",
    "copy_refused",
)  # fmt: skip
_DTYPE_CODES = {"f": 2, "V": 4}  # float, bfloat (ml_dtypes' bfloat16 is "V")


class DLPackProducer:
    """A DLPack producer of one array: ``style`` "versioned" takes DLPack 1.0's keywords and
    exports 1.0 capsules, "legacy" takes ``stream`` only, "bare" no keyword at all."""

    raised = None

    def __init__(self, array: np.ndarray, style: str, lie: str, device: tuple[int, int]):
        self.array, self.style, self.lie, self.device = array, style, lie, device
        self.exports = []  # keeps each capsule's structures alive with the producer

    @property
    def __dlpack_device__(self):
        """The method, absent (AttributeError) for a producer without one."""
        if self.lie == "no_device_method":
            raise AttributeError("__dlpack_device__")
        return self._device

    def _device(self):
        if self.lie == "device_raises":
            raise self.raised
        if self.lie == "device_garbage":
            return "cpu"
        return (1, 0) if self.lie == "device_mismatch" else self.device

    def capsule(self, copy: bool) -> Any:
        """A capsule of ``self.array`` (of a copy of it when ``copy``), telling the lie."""
        a, lie = (self.array.copy() if copy else self.array), self.lie
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        strides = (ctypes.c_int64 * max(a.ndim, 1))(*(s // a.itemsize for s in a.strides))
        code = _DTYPE_CODES[a.dtype.kind]
        bits = 8 * a.itemsize
        dtype = {
            "dtype_int": (0, bits, 1), "dtype_complex": (5, 2 * bits, 1), "dtype_bool": (6, 8, 1),
            "dtype_bits": (code, 128, 1), "lanes": (code, bits, 2),
        }.get(lie, (code, bits, 1))  # fmt: skip
        ndim = {"ndim_negative": -1, "ndim_huge": 65}.get(lie, a.ndim)
        data, offset = a.ctypes.data, 0
        if lie == "byte_offset":
            data, offset = _root(a).ctypes.data, a.ctypes.data - _root(a).ctypes.data
        data = {"data_null": 0, "misaligned": data + 1}.get(lie, data)
        device = {"device_cuda": (2, 0), "device_other": (4, 0), "device_id_negative": (1, -1),
                  "device_mismatch": (2, 0)}.get(lie, self.device)  # fmt: skip
        tensor = DLTensor(
            data=data or None, device=DLDevice(*device), ndim=ndim, dtype=DLDataType(*dtype),
            shape=shape, strides=None if lie == "strides_null" else strides, byte_offset=offset,
        )  # fmt: skip
        flags = {"read_only": READ_ONLY, "is_copied": IS_COPIED}.get(lie, 0) | (IS_COPIED * copy)
        flags |= READ_ONLY * (not a.flags.writeable)  # as NumPy 2 marks its read-only arrays
        if self.style == "versioned":
            managed = DLManagedTensorVersioned(
                2 if lie == "major" else 1, 0, None, None, flags, tensor
            )
            name = b"dltensor_versioned"
        else:
            managed = DLManagedTensor(tensor, None, None)
            name = b"dltensor"
        self.exports.append((a, shape, strides, managed))
        if lie == "not_capsule":
            return "capsule"
        return new_capsule(
            ctypes.addressof(managed), b"used_" + name if lie == "used_capsule" else name, None
        )

    def export(self, copy: Any) -> Any:
        if self.lie == "raises":
            raise self.raised
        if self.lie == "copy_refused" and copy is False:
            raise BufferError("this producer exports only copies")
        return self.capsule(self.lie in ("is_copied", "copy_refused"))


class Versioned(DLPackProducer):
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.export(copy)


class Legacy(DLPackProducer):
    def __dlpack__(self, stream=None):
        return self.export(None)


class Bare(DLPackProducer):
    def __dlpack__(self):
        return self.export(None)


DLPACK_STYLES = {"versioned": Versioned, "legacy": Legacy, "bare": Bare}


def dlpack(draw, a: np.ndarray) -> Any:
    """``a`` through a drawn DLPack producer, with one drawn lie."""
    style = draw(st.sampled_from(("versioned", "versioned", "legacy", "bare")))
    lie = draw(st.sampled_from(DLPACK_LIES))
    if style != "versioned" and lie in ("read_only", "is_copied", "copy_refused", "major"):
        lie = "none"  # DLPack 1.0's flags and keywords
    if lie == "strides_null" and not a.flags.c_contiguous:
        lie = "none"  # packed strides it would read: a lie nothing can tell
    if style != "versioned" and not a.flags.writeable:
        a = np.array(a)  # a legacy capsule cannot say read-only: NumPy exports none
    device = (2, 0) if lie == "device_cuda" else (1, 0)
    producer = DLPACK_STYLES[style](a, style, lie, device)
    valid = lie in DLPACK_VALID or (lie in ("data_null", "misaligned") and not a.size)
    writable = bool(a.flags.writeable) and lie not in ("read_only", "is_copied", "copy_refused")
    raised = draw(raised_error(lie)) if lie in ("raises", "device_raises") else None
    host = lie not in ("device_cuda", "device_mismatch")
    truth = _f64(a) if valid else None
    return mark(
        producer, a, truth, f"dlpack_{style}_{lie}", writable=writable, host=host, raised=raised
    )


class NumpyDLPack:
    """A CPU DLPack producer forwarding to NumPy 2's own ``__dlpack__``."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


# --- NumPy and torch oddities ---------------------------------------------------------------


class UserTensor(torch.Tensor):
    """A user's subclass of torch.Tensor."""


class LyingArray(np.ndarray):
    """An ndarray subclass whose ``shape`` and ``strides`` say 1000 times its memory."""

    @property
    def shape(self):
        return (*np.ndarray.shape.__get__(self), 1000)

    @property
    def strides(self):
        return (*(s * 1000 for s in np.ndarray.strides.__get__(self)), self.itemsize)


class LyingTensor(torch.Tensor):
    """A tensor subclass whose ``shape`` and ``stride()`` say 1000 times its memory."""

    @property
    def shape(self):
        return torch.Size((*torch.Tensor.size(self), 1000))

    def stride(self, *dim):
        return (*(s * 1000 for s in torch.Tensor.stride(self)), 1)


ODDITIES = ("swapped", "bfloat16", "negative_view", "conjugate_view", "torch_subclass",
            "requires_grad", "matrix", "memmap", "masked", "numpy_dlpack", "lying_ndarray",
            "lying_tensor")  # fmt: skip


def oddity(draw, a: np.ndarray) -> Any:
    """``a`` as an odd NumPy or torch array (one of ``ODDITIES``)."""
    kind = draw(st.sampled_from(ODDITIES))
    if kind == "swapped":  # big-endian, any float dtype
        dtype = draw(st.sampled_from((np.float16, np.float32, np.float64, ml_dtypes.bfloat16)))
        swapped = np.asarray(a).astype(np.dtype(dtype).newbyteorder(">"))
        return mark(swapped, swapped, None, kind, numpy_truth=_f64(swapped))
    if kind == "bfloat16":
        b = a.astype(ml_dtypes.bfloat16)
        return mark(b, b, _f64(b), kind)
    if kind in ("negative_view", "conjugate_view"):
        imag = torch.from_numpy(
            -np.asarray(a, np.float64) if kind == "negative_view" else a.astype(np.float64)
        )
        z = torch.complex(torch.zeros_like(imag), imag).to(
            torch.complex64 if a.dtype == np.float32 else torch.complex128
        )
        view = z.conj().imag if kind == "negative_view" else z.conj()
        truth = _f64(a) if kind == "negative_view" else None  # complex: no float operand
        return mark(view, torch.view_as_real(z).numpy(), truth, kind, writable=False)
    if kind == "lying_ndarray":  # read as its memory is, whatever its properties say
        m = np.array(a).view(LyingArray)
        plain = np.ndarray.view(m, np.ndarray)
        return mark(m, plain, _f64(a), kind, view=plain)
    if kind == "lying_tensor":
        t = torch.from_numpy(np.array(a))
        return mark(t.as_subclass(LyingTensor), t.numpy(), _f64(a), kind, view=t)
    if kind in ("torch_subclass", "requires_grad"):
        t = torch.from_numpy(np.array(a))
        t = t.as_subclass(UserTensor) if kind == "torch_subclass" else t.requires_grad_()
        # written in place only where grad mode is off, as torch's rule (the fuzz's is on)
        return mark(t, t.detach().numpy(), _f64(a), kind, writable=kind != "requires_grad")
    if kind == "matrix" and a.ndim == 2:
        m = np.asmatrix(np.array(a))
        return mark(m, m, _f64(a), kind)
    if kind in ("memmap", "matrix"):  # a memmap maps no empty file: an ndarray then
        with tempfile.TemporaryFile() as file:  # the mapping outlives the file's handle
            m = np.memmap(file, a.dtype, "w+", shape=a.shape) if a.size else np.array(a)
        m[...] = a
        return mark(m, m, _f64(a), kind)
    if kind == "masked":
        masked = np.ma.masked_array(np.array(a), mask=np.zeros(a.shape, bool))
        return mark(masked, masked.data, None, kind, numpy_truth=_f64(a))
    wrapper = NumpyDLPack(a)
    return mark(wrapper, a, _f64(a), kind, writable=bool(a.flags.writeable))


FAMILIES = ("interface", "interface", "cuda", "dlpack", "dlpack", "oddity", "oddity")


@st.composite
def produce(draw, a: np.ndarray) -> Any:
    """``a`` (a typed ndarray) in a drawn producer form."""
    family = draw(st.sampled_from(FAMILIES))
    return {"interface": array_interface, "cuda": cuda_interface, "dlpack": dlpack,
            "oddity": oddity}[family](draw, a)  # fmt: skip


@st.composite
def raising(draw, a: np.ndarray) -> Any:
    """``a`` behind a producer whose protocol method raises (``raised_error``): an array or
    CUDA array interface, a DLPack ``__dlpack__`` or ``__dlpack_device__``. In a problem
    otherwise good, a call must let exactly that exception through (``fuzz_arrays``)."""
    family = draw(st.sampled_from(("interface", "cuda", "dlpack", "dlpack_device")))
    iface = {"version": 3, "shape": a.shape, "typestr": a.dtype.str, "strides": a.strides,
             "data": (a.ctypes.data, False)}  # fmt: skip
    if family == "interface":
        obj, lie = Interface(iface), "raises"
    elif family == "cuda":
        obj, lie = CudaInterface(iface), "raises"
    else:
        style = draw(st.sampled_from(("versioned", "legacy", "bare")))
        lie = "raises" if family == "dlpack" else "device_raises"
        obj = DLPACK_STYLES[style](a, style, lie, (1, 0))
    raised = draw(raised_error(lie))
    origin = "own" if isinstance(raised, ProducerError) else type(raised).__name__
    lie = f"raising_{family}_{origin}"
    return mark(obj, a, None, lie, host=family != "cuda", raised=raised)
