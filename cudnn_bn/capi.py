"""The C API of ``include/`` over ctypes values: every function returns an ``infiniStatus_t``.

Handles and descriptors are opaque pointer-sized integers naming Python objects held here;
out-parameters are ctypes pointers (``ctypes.byref(c_void_p())``, ``ctypes.byref(c_size_t())``)
or raw addresses; data pointers are integers, ``c_void_p`` or None. Nothing here raises: an
error becomes its status, and ``last_error()`` tells what was wrong.
"""

import ctypes
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

from .enums import DataType, Status
from .errors import InfiniError
from .ops.batch_norm_backward import BatchNormBackwardDescriptor
from .ops.batch_norm_forward_inference import BatchNormForwardInferenceDescriptor
from .ops.batch_norm_forward_training import BatchNormForwardTrainingDescriptor
from .runtime import Handle, current_handle, set_device
from .tensor import TensorDesc, contiguous_strides

_objects: dict[int, Any] = {}
_next_id = itertools.count(0x1000, 0x10)
_lock = threading.Lock()
_last_error = threading.local()


def last_error() -> str:
    """The message of the last failed call in this thread ("" after a success)."""
    return getattr(_last_error, "message", "")


def _returns_status(func: Callable[..., None]) -> Callable[..., int]:
    @functools.wraps(func)
    def wrapper(*args: Any) -> int:
        try:
            func(*args)
        except InfiniError as exc:
            _last_error.message = str(exc)
            return int(exc.status)
        except Exception as exc:  # a C caller cannot catch Python exceptions
            _last_error.message = f"INTERNAL_ERROR: {type(exc).__name__}: {exc}"
            return int(Status.INTERNAL_ERROR)
        _last_error.message = ""
        return int(Status.SUCCESS)

    return wrapper


def _address(value: Any) -> int:
    """An address from an int, None, a ``c_void_p`` or anything with ``.value``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes.c_void_p | ctypes.c_size_t):
        return value.value or 0
    return int(ctypes.cast(value, ctypes.c_void_p).value or 0)


def _store(out: Any, ctype: type, value: int, name: str) -> None:
    """Write ``value`` through the out-parameter ``out`` (byref, pointer or address)."""
    if out is None or (isinstance(out, int) and out == 0):
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    if hasattr(out, "_obj"):  # ctypes.byref(...)
        out._obj.value = value
    elif isinstance(out, int):
        ctype.from_address(out).value = value
    else:
        ctypes.cast(out, ctypes.POINTER(ctype)).contents.value = value


def _register(obj: Any) -> int:
    with _lock:
        key = next(_next_id)
        _objects[key] = obj
    return key


def _lookup(value: Any, kind: type, name: str) -> Any:
    key = _address(value)
    if key == 0:
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    obj = _objects.get(key)
    if not isinstance(obj, kind):
        raise InfiniError(Status.BAD_PARAM, f"{name} ({key:#x}) is not a live {kind.__name__}")
    return obj


def _release(value: Any, kind: type, name: str) -> Any:
    obj = _lookup(value, kind, name)
    with _lock:
        _objects.pop(_address(value), None)
    return obj


def _sequence(values: Any, n: int, name: str) -> tuple[int, ...]:
    if values is None or values == 0:
        raise InfiniError(Status.NULL_POINTER, f"{name} is NULL")
    if isinstance(values, int):
        values = ctypes.cast(values, ctypes.POINTER(ctypes.c_int64))
    elif hasattr(values, "__len__") and len(values) != n:
        raise InfiniError(Status.BAD_PARAM, f"{name} has {len(values)} entries but ndim is {n}")
    return tuple(int(values[i]) for i in range(n))


@_returns_status
def infinirtSetDevice(device: int, device_id: int) -> None:
    set_device(device, device_id)


@_returns_status
def infiniopCreateHandle(handle_ptr: Any) -> None:
    _store(handle_ptr, ctypes.c_void_p, _register(current_handle()), "handle_ptr")


@_returns_status
def infiniopDestroyHandle(handle: Any) -> None:
    _release(handle, Handle, "handle")


@_returns_status
def infiniopCreateTensorDescriptor(
    desc_ptr: Any, ndim: int, shape: Any, strides: Any, dtype: int
) -> None:
    if dtype not in DataType._value2member_map_:
        raise InfiniError(Status.BAD_TENSOR_DTYPE, f"dtype {dtype} is not an infiniDtype_t")
    if ndim < 0:
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"ndim must be >= 0, got {ndim}")
    dims = _sequence(shape, ndim, "shape") if ndim else ()
    if any(d < 0 for d in dims):
        raise InfiniError(Status.BAD_TENSOR_SHAPE, f"shape {dims} has a negative size")
    steps = (
        contiguous_strides(dims)
        if not isinstance(strides, list | tuple) and _address(strides) == 0
        else (_sequence(strides, ndim, "strides") if ndim else ())
    )
    _store(
        desc_ptr, ctypes.c_void_p, _register(TensorDesc(DataType(dtype), dims, steps)), "desc_ptr"
    )


@_returns_status
def infiniopDestroyTensorDescriptor(desc: Any) -> None:
    _release(desc, TensorDesc, "desc")


def _tensor(value: Any, name: str) -> TensorDesc | None:
    return None if _address(value) == 0 else _lookup(value, TensorDesc, name)


def _create(kind: type, handle: Any, desc_ptr: Any, **tensor_descs: Any) -> None:
    """Create a ``kind`` operator descriptor from tensor descriptors named in C order.

    A NULL tensor descriptor reaches the operator as None; the operator says which it needs.
    """
    owner = _lookup(handle, Handle, "handle")
    if desc_ptr is None or (_address(desc_ptr) == 0 and isinstance(desc_ptr, int)):
        raise InfiniError(Status.NULL_POINTER, "desc_ptr is NULL")
    tensors = [_tensor(value, name) for name, value in tensor_descs.items()]
    _store(desc_ptr, ctypes.c_void_p, _register(kind(owner, *tensors)), "desc_ptr")


def _store_size(desc: Any, kind: type, attribute: str, size: Any) -> None:
    """Write a size the ``kind`` descriptor cached (``workspace_size``, ``reserve_size``)."""
    _store(size, ctypes.c_size_t, getattr(_lookup(desc, kind, "desc"), attribute), "size")


def _compute(
    desc: Any, kind: type, workspace: Any, workspace_size: int, *args: Any, stream: Any
) -> None:
    """Run a ``kind`` descriptor: ``args`` are data pointers, or sizes given as ints."""
    descriptor = _lookup(desc, kind, "desc")
    descriptor.compute(
        _address(workspace), int(workspace_size), *map(_address, args), _address(stream)
    )


# --- batch-norm backward -----------------------------------------------------------------------


@_returns_status
def infiniopCreateBatchNormBackwardDescriptor(
    handle: Any,
    desc_ptr: Any,
    grad_input_desc: Any,
    grad_weight_desc: Any,
    grad_bias_desc: Any,
    input_desc: Any,
    grad_output_desc: Any,
    weight_desc: Any,
    running_mean_desc: Any,
    running_var_desc: Any,
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


@_returns_status
def infiniopSetBatchNormBackwardAttributes(desc: Any, eps: float, mode: int) -> None:
    _lookup(desc, BatchNormBackwardDescriptor, "desc").set_attributes(eps, mode)


@_returns_status
def infiniopGetBatchNormBackwardWorkspaceSize(desc: Any, size: Any) -> None:
    _store_size(desc, BatchNormBackwardDescriptor, "workspace_size", size)


@_returns_status
def infiniopBatchNormBackward(
    desc: Any,
    workspace: Any,
    workspace_size: int,
    grad_input: Any,
    grad_weight: Any,
    grad_bias: Any,
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    stream: Any,
) -> None:
    _compute(
        desc,
        BatchNormBackwardDescriptor,
        workspace,
        workspace_size,
        grad_input,
        grad_weight,
        grad_bias,
        input,
        grad_output,
        weight,
        running_mean,
        running_var,
        stream=stream,
    )


@_returns_status
def infiniopDestroyBatchNormBackwardDescriptor(desc: Any) -> None:
    _release(desc, BatchNormBackwardDescriptor, "desc").destroy()


# --- batch-norm forward, training --------------------------------------------------------------


@_returns_status
def infiniopCreateBatchNormForwardTrainingDescriptor(
    handle: Any,
    desc_ptr: Any,
    output_desc: Any,
    saved_mean_desc: Any,
    saved_invstd_desc: Any,
    input_desc: Any,
    weight_desc: Any,
    bias_desc: Any,
    running_mean_desc: Any,
    running_var_desc: Any,
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


@_returns_status
def infiniopSetBatchNormForwardTrainingAttributes(desc: Any, eps: float, momentum: float) -> None:
    _lookup(desc, BatchNormForwardTrainingDescriptor, "desc").set_attributes(
        eps=eps, momentum=momentum
    )


@_returns_status
def infiniopGetBatchNormForwardTrainingWorkspaceSize(desc: Any, size: Any) -> None:
    _store_size(desc, BatchNormForwardTrainingDescriptor, "workspace_size", size)


@_returns_status
def infiniopGetBatchNormForwardTrainingReserveSize(desc: Any, size: Any) -> None:
    _store_size(desc, BatchNormForwardTrainingDescriptor, "reserve_size", size)


@_returns_status
def infiniopBatchNormForwardTraining(
    desc: Any,
    workspace: Any,
    workspace_size: int,
    reserve: Any,
    reserve_size: int,
    output: Any,
    saved_mean: Any,
    saved_invstd: Any,
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    stream: Any,
) -> None:
    _compute(
        desc,
        BatchNormForwardTrainingDescriptor,
        workspace,
        workspace_size,
        reserve,
        int(reserve_size),
        output,
        saved_mean,
        saved_invstd,
        input,
        weight,
        bias,
        running_mean,
        running_var,
        stream=stream,
    )


@_returns_status
def infiniopDestroyBatchNormForwardTrainingDescriptor(desc: Any) -> None:
    _release(desc, BatchNormForwardTrainingDescriptor, "desc").destroy()


# --- batch-norm forward, inference -------------------------------------------------------------


@_returns_status
def infiniopCreateBatchNormForwardInferenceDescriptor(
    handle: Any,
    desc_ptr: Any,
    output_desc: Any,
    input_desc: Any,
    weight_desc: Any,
    bias_desc: Any,
    running_mean_desc: Any,
    running_var_desc: Any,
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


@_returns_status
def infiniopSetBatchNormForwardInferenceAttributes(desc: Any, eps: float) -> None:
    _lookup(desc, BatchNormForwardInferenceDescriptor, "desc").set_attributes(eps=eps)


@_returns_status
def infiniopGetBatchNormForwardInferenceWorkspaceSize(desc: Any, size: Any) -> None:
    _store_size(desc, BatchNormForwardInferenceDescriptor, "workspace_size", size)


@_returns_status
def infiniopBatchNormForwardInference(
    desc: Any,
    workspace: Any,
    workspace_size: int,
    output: Any,
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    stream: Any,
) -> None:
    _compute(
        desc,
        BatchNormForwardInferenceDescriptor,
        workspace,
        workspace_size,
        output,
        input,
        weight,
        bias,
        running_mean,
        running_var,
        stream=stream,
    )


@_returns_status
def infiniopDestroyBatchNormForwardInferenceDescriptor(desc: Any) -> None:
    _release(desc, BatchNormForwardInferenceDescriptor, "desc").destroy()
