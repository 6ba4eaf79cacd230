"""The C API of ``include/`` over ctypes values: every function returns an ``infiniStatus_t``.

``PROTOTYPES`` is the headers' declarations, parameter names and C types in order
(``tests/test_headers.py`` checks it against ``include/``); every function converts its
arguments by it (``c_arguments``) exactly as ctypes would for that C function: Python
numbers and ctypes scalars alike, ``byref``/``pointer``/arrays/addresses for pointers.
Handles and descriptors are opaque pointer-sized values naming Python objects held here,
chosen outside user space so that a handle passed where an address belongs is refused.
Nothing here raises: an error (a refused argument, a wrong argument count, a keyword
argument, which a C function cannot take) becomes its status and ``last_error()`` tells
what was wrong with which argument. A failed create registers nothing. Only the caller's
own ``KeyboardInterrupt`` or ``TimeoutError`` (a signal handler's) passes through.
"""

import ctypes
import functools
import inspect
import itertools
import threading
from collections.abc import Callable
from typing import Any

from .c_arguments import converter, host_address
from .enums import Device, Status
from .errors import InfiniError
from .ops.batch_norm_backward import BatchNormBackwardDescriptor
from .ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from .ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from .runtime import Handle, current_handle, set_device
from .tensor import TensorDesc, contiguous_strides

_HANDLE, _DESC_OUT = "infiniopHandle_t", "infiniopHandle_t *"
_TENSOR = "infiniopTensorDescriptor_t"


def _operator(
    name: str, tensors: tuple[str, ...], written: set[str], attributes: tuple, sizes: tuple
) -> dict[str, tuple[tuple[str, str], ...]]:
    """The prototypes of one operator's functions (its header in ``include/infiniop/ops``):
    the ``written`` ones of ``tensors`` are ``void *``, the others ``const void *``."""
    desc = f"infiniop{name}Descriptor_t"
    buffers = [p for size in sizes for p in ((size, "void *"), (f"{size}_size", "size_t"))]
    data = [(t, "void *" if t in written else "const void *") for t in tensors]
    return {
        f"infiniopCreate{name}Descriptor": (
            ("handle", _HANDLE),
            ("desc_ptr", f"{desc} *"),
            *((f"{t}_desc", _TENSOR) for t in tensors),
        ),
        f"infiniopSet{name}Attributes": (("desc", desc), *attributes),
        **{
            f"infiniopGet{name}{size.capitalize()}Size": (("desc", desc), ("size", "size_t *"))
            for size in sizes
        },
        f"infiniop{name}": (("desc", desc), *buffers, *data, ("stream", "void *")),
        f"infiniopDestroy{name}Descriptor": (("desc", desc),),
    }


_STATS = ("running_mean", "running_var")
PROTOTYPES: dict[str, tuple[tuple[str, str], ...]] = {
    "infinirtSetDevice": (("device", "infiniDevice_t"), ("device_id", "int")),
    "infiniopCreateHandle": (("handle_ptr", _DESC_OUT),),
    "infiniopDestroyHandle": (("handle", _HANDLE),),
    "infiniopCreateTensorDescriptor": (
        ("desc_ptr", "infiniopTensorDescriptor_t *"),
        ("ndim", "size_t"),
        ("shape", "size_t const *"),
        ("strides", "ptrdiff_t const *"),
        ("dtype", "infiniDtype_t"),
    ),
    "infiniopDestroyTensorDescriptor": (("desc", _TENSOR),),
    **_operator(
        "BatchNormBackward",
        ("grad_input", "grad_weight", "grad_bias", "input", "grad_output", "weight", *_STATS),
        {"grad_input", "grad_weight", "grad_bias"},
        (("eps", "double"), ("mode", "int")),
        ("workspace",),
    ),
    **_operator(
        "BatchNormForwardTraining",
        ("output", "saved_mean", "saved_invstd", "input", "weight", "bias", *_STATS),
        {"output", "saved_mean", "saved_invstd", "running_mean", "running_var"},
        (("eps", "double"), ("momentum", "double")),
        ("workspace", "reserve"),
    ),
    **_operator(
        "BatchNormForwardInference",
        ("output", "input", "weight", "bias", *_STATS),
        {"output"},
        (("eps", "double"),),
        ("workspace",),
    ),
}

MAX_NDIM = 64  # a tensor descriptor's axes: more than any operator takes, bounded for reads

_objects: dict[int, Any] = {}
# Opaque values in the upper (kernel) half of the address space: never a caller's address.
_next_id = itertools.count(0xFFFF_8000_0000_1000, 0x10)
_lock = threading.Lock()
_last_error = threading.local()


def last_error() -> str:
    """The message of the last failed call in this thread ("" after a success)."""
    return getattr(_last_error, "message", "")


def _c_function(func: Callable[..., None]) -> Callable[..., int]:
    """``func`` as the C function of its prototype: positional arguments converted by
    ``PROTOTYPES``, the status returned as an int, nothing raised."""
    name = func.__name__
    params = PROTOTYPES[name]
    converters = [(param, converter(c_type)) for param, c_type in params]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            if kwargs:
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} takes positional arguments only, as a C function; "
                    f"got keyword {', '.join(kwargs)}",
                )
            if len(args) != len(params):
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} takes {len(params)} arguments "
                    f"({', '.join(p for p, _ in params)}), got {len(args)}",
                )
            func(
                *(
                    convert(value, param)
                    for (param, convert), value in zip(converters, args, strict=True)
                )
            )
        except InfiniError as exc:
            _last_error.message = str(exc)
            return int(exc.status)
        except TimeoutError:  # the caller's own (a signal handler's), as KeyboardInterrupt
            raise
        except Exception as exc:  # a C caller cannot catch Python exceptions
            _last_error.message = f"INTERNAL_ERROR: {type(exc).__name__}: {exc}"
            return int(Status.INTERNAL_ERROR)
        _last_error.message = ""
        return int(Status.SUCCESS)

    wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_ONLY) for p, _ in params],
        return_annotation=int,
    )
    return wrapper


def _new(out: int, name: str, build: Callable[[], Any]) -> None:
    """Build an object, register it and write its handle through ``out``; a failure
    anywhere leaves nothing registered."""
    if not out:
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    obj = build()
    with _lock:
        key = next(_next_id)
        _objects[key] = obj
    ctypes.c_void_p.from_address(out).value = key


def _lookup(key: int, kind: type, name: str, *, release: bool = False) -> Any:
    """The live ``kind`` object ``key`` names (forgotten when ``release``)."""
    if key == 0:
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    with _lock:
        obj = _objects.get(key)
        if isinstance(obj, kind) and release:
            del _objects[key]
    if not isinstance(obj, kind):
        raise InfiniError(Status.BAD_PARAM, f"{name} ({key:#x}) is not a live {kind.__name__}")
    return obj


@_c_function
def infinirtSetDevice(device: int, device_id: int) -> None:
    set_device(device, device_id)


@_c_function
def infiniopCreateHandle(handle_ptr: int) -> None:
    _new(handle_ptr, "handle_ptr", current_handle)


@_c_function
def infiniopDestroyHandle(handle: int) -> None:
    _lookup(handle, Handle, "handle", release=True)


@_c_function
def infiniopCreateTensorDescriptor(
    desc_ptr: int, ndim: int, shape: Any, strides: Any, dtype: int
) -> None:
    if not desc_ptr:
        raise InfiniError(Status.NULL_POINTER, "desc_ptr is NULL")
    if ndim > MAX_NDIM:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"ndim is {ndim}; at most {MAX_NDIM} axes")
    if shape is None and ndim:
        raise InfiniError(Status.NULL_POINTER, f"shape is NULL but ndim is {ndim}")
    dims = shape(ndim) if shape is not None else ()
    steps = contiguous_strides(dims) if strides is None else strides(ndim)
    _new(desc_ptr, "desc_ptr", lambda: TensorDesc.checked(dtype, dims, steps))


@_c_function
def infiniopDestroyTensorDescriptor(desc: int) -> None:
    _lookup(desc, TensorDesc, "desc", release=True)


def _tensor(value: int, name: str) -> TensorDesc | None:
    return _lookup(value, TensorDesc, name) if value else None


def _create(kind: type, handle: int, desc_ptr: int, **tensor_descs: int) -> None:
    """Create a ``kind`` operator descriptor from tensor descriptors named in C order.

    A NULL tensor descriptor reaches the operator as None; the operator says which it needs.
    """
    owner = _lookup(handle, Handle, "handle")
    if not desc_ptr:
        raise InfiniError(Status.NULL_POINTER, "desc_ptr is NULL")
    tensors = [_tensor(value, name) for name, value in tensor_descs.items()]
    _new(desc_ptr, "desc_ptr", lambda: kind(owner, *tensors))


def _store_size(desc: int, kind: type, attribute: str, size: int) -> None:
    """Write a size the ``kind`` descriptor cached (``workspace_size``, ``reserve_size``)."""
    value = getattr(_lookup(desc, kind, "desc"), attribute)
    if not size:
        raise InfiniError(Status.NULL_POINTER, "size is NULL")
    ctypes.c_size_t.from_address(size).value = value


def _compute_function(name: str, kind: type) -> Callable[..., int]:
    """The C function ``name`` that runs a ``kind`` descriptor: its arguments after ``desc``
    are those of ``kind.compute``, in order. On the CPU every non-NULL data pointer must be
    a host address (the stream is not read there)."""
    pointers = [p for p, c_type in PROTOTYPES[name][1:] if c_type.endswith("void *")]

    def compute(desc: int, *args: int) -> None:
        descriptor = _lookup(desc, kind, "desc")
        if descriptor.handle.device == Device.CPU:
            named = dict(zip((p for p, _ in PROTOTYPES[name][1:]), args, strict=True))
            for param in pointers:
                if named[param] and param != "stream":
                    host_address(named[param], param)
        descriptor.compute(*args)

    compute.__name__ = compute.__qualname__ = name
    return _c_function(compute)


# --- batch-norm backward -----------------------------------------------------------------------


@_c_function
def infiniopCreateBatchNormBackwardDescriptor(
    handle: int,
    desc_ptr: int,
    grad_input_desc: int,
    grad_weight_desc: int,
    grad_bias_desc: int,
    input_desc: int,
    grad_output_desc: int,
    weight_desc: int,
    running_mean_desc: int,
    running_var_desc: int,
) -> None:
    _create(
        BatchNormBackwardDescriptor,
        handle,
        desc_ptr,
        grad_input_desc=grad_input_desc,
        grad_weight_desc=grad_weight_desc,
        grad_bias_desc=grad_bias_desc,
        input_desc=input_desc,
        grad_output_desc=grad_output_desc,
        weight_desc=weight_desc,
        running_mean_desc=running_mean_desc,
        running_var_desc=running_var_desc,
    )


@_c_function
def infiniopSetBatchNormBackwardAttributes(desc: int, eps: float, mode: int) -> None:
    _lookup(desc, BatchNormBackwardDescriptor, "desc").set_attributes(eps, mode)


@_c_function
def infiniopGetBatchNormBackwardWorkspaceSize(desc: int, size: int) -> None:
    _store_size(desc, BatchNormBackwardDescriptor, "workspace_size", size)


infiniopBatchNormBackward = _compute_function(
    "infiniopBatchNormBackward", BatchNormBackwardDescriptor
)


@_c_function
def infiniopDestroyBatchNormBackwardDescriptor(desc: int) -> None:
    _lookup(desc, BatchNormBackwardDescriptor, "desc", release=True).destroy()


# --- batch-norm forward, training --------------------------------------------------------------


@_c_function
def infiniopCreateBatchNormForwardTrainingDescriptor(
    handle: int,
    desc_ptr: int,
    output_desc: int,
    saved_mean_desc: int,
    saved_invstd_desc: int,
    input_desc: int,
    weight_desc: int,
    bias_desc: int,
    running_mean_desc: int,
    running_var_desc: int,
) -> None:
    _create(
        BatchNormForwardTrainingDescriptor,
        handle,
        desc_ptr,
        output_desc=output_desc,
        saved_mean_desc=saved_mean_desc,
        saved_invstd_desc=saved_invstd_desc,
        input_desc=input_desc,
        weight_desc=weight_desc,
        bias_desc=bias_desc,
        running_mean_desc=running_mean_desc,
        running_var_desc=running_var_desc,
    )


@_c_function
def infiniopSetBatchNormForwardTrainingAttributes(desc: int, eps: float, momentum: float) -> None:
    _lookup(desc, BatchNormForwardTrainingDescriptor, "desc").set_attributes(
        eps=eps, momentum=momentum
    )


@_c_function
def infiniopGetBatchNormForwardTrainingWorkspaceSize(desc: int, size: int) -> None:
    _store_size(desc, BatchNormForwardTrainingDescriptor, "workspace_size", size)


@_c_function
def infiniopGetBatchNormForwardTrainingReserveSize(desc: int, size: int) -> None:
    _store_size(desc, BatchNormForwardTrainingDescriptor, "reserve_size", size)


infiniopBatchNormForwardTraining = _compute_function(
    "infiniopBatchNormForwardTraining", BatchNormForwardTrainingDescriptor
)


@_c_function
def infiniopDestroyBatchNormForwardTrainingDescriptor(desc: int) -> None:
    _lookup(desc, BatchNormForwardTrainingDescriptor, "desc", release=True).destroy()


# --- batch-norm forward, inference -------------------------------------------------------------


@_c_function
def infiniopCreateBatchNormForwardInferenceDescriptor(
    handle: int,
    desc_ptr: int,
    output_desc: int,
    input_desc: int,
    weight_desc: int,
    bias_desc: int,
    running_mean_desc: int,
    running_var_desc: int,
) -> None:
    _create(
        BatchNormForwardInferenceDescriptor,
        handle,
        desc_ptr,
        output_desc=output_desc,
        input_desc=input_desc,
        weight_desc=weight_desc,
        bias_desc=bias_desc,
        running_mean_desc=running_mean_desc,
        running_var_desc=running_var_desc,
    )


@_c_function
def infiniopSetBatchNormForwardInferenceAttributes(desc: int, eps: float) -> None:
    _lookup(desc, BatchNormForwardInferenceDescriptor, "desc").set_attributes(eps=eps)


@_c_function
def infiniopGetBatchNormForwardInferenceWorkspaceSize(desc: int, size: int) -> None:
    _store_size(desc, BatchNormForwardInferenceDescriptor, "workspace_size", size)


infiniopBatchNormForwardInference = _compute_function(
    "infiniopBatchNormForwardInference", BatchNormForwardInferenceDescriptor
)


@_c_function
def infiniopDestroyBatchNormForwardInferenceDescriptor(desc: int) -> None:
    _lookup(desc, BatchNormForwardInferenceDescriptor, "desc", release=True).destroy()
