"""torch tensors (and subclasses) as operands, read from their own attributes.

torch's lazy views are resolved: a tensor with the negative or conjugate bit (``z.conj().imag``
is a public one) stores values that must be negated or conjugated on read, which a raw
pointer cannot do. Read, such a tensor is materialized (``resolve_neg``/``resolve_conj``) and
the copy is the operand; written in place, it is refused, since the copy is not the caller's.
Sparse, nested and storage-less (wrapper subclass, fake) tensors have no strided memory to
hand over and are refused.

Written in place, a tensor is held to torch's rule for writes autograd cannot record
(``refuse_grad_write``) and then has its version counter bumped (``version_bump``), so that
autograd raises where a tensor it saved for backward was overwritten.
"""

import functools
import sys
from collections.abc import Callable
from typing import Any

from ..enums import DataType, Device, Status
from ..errors import InfiniError
from .checks import EXPECTED, described
from .operand import Operand


def is_torch(array: Any) -> bool:
    """A torch tensor, a subclass of one, or an object standing in for one (module torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return True
    return type(array).__module__.partition(".")[0] == "torch"


@functools.cache
def torch_dtypes() -> dict[DataType, Any]:
    import torch

    return {
        DataType.F16: torch.float16,
        DataType.BF16: torch.bfloat16,
        DataType.F32: torch.float32,
        DataType.F64: torch.float64,
        DataType.U8: torch.uint8,
        DataType.I8: torch.int8,
    }


@functools.cache
def _from_torch_dtypes() -> dict[Any, DataType]:
    return {torch_dtype: dtype for dtype, torch_dtype in torch_dtypes().items()}


def torch_device(tensor: Any) -> Any:
    """``tensor.device`` as torch's own getter reads it, for a subclass too: a ``device``
    property or ``__torch_function__`` of a subclass is not asked (one that lied would have
    the call placed on one device and allocate on another); a stand-in's (no
    ``torch.Tensor``) as it says."""
    if is_plain(tensor) or not is_tensor(tensor):
        return tensor.device
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.device.__get__(tensor)


def torch_place(name: str, tensor: Any) -> tuple[Device, int]:
    devices = {"cpu": Device.CPU, "cuda": Device.NVIDIA}
    device = torch_device(tensor)
    if device.type not in devices:
        raise InfiniError(
            Status.DEVICE_TYPE_NOT_SUPPORTED, f"{name} is on {device}; expected cpu or cuda"
        )
    return devices[device.type], device.index or 0


def _refuse_layout(name: str, tensor: Any) -> None:
    import torch

    if getattr(tensor, "is_nested", False):
        raise InfiniError(Status.BAD_PARAM, f"{name} is a nested tensor; expected a strided one")
    layout = getattr(tensor, "layout", torch.strided)
    if layout is not torch.strided:
        raise InfiniError(Status.BAD_PARAM, f"{name} has layout {layout}; expected torch.strided")


def _lazy_bits(tensor: Any) -> str:
    """Which of torch's lazy-view bits ``tensor`` has set ("" for none)."""
    bits = [
        bit
        for bit, method in (("negative", "is_neg"), ("conjugate", "is_conj"))
        if getattr(tensor, method, None) is not None and getattr(tensor, method)()
    ]
    return " and ".join(bits)


def _plain(name: str, tensor: Any) -> Any:
    """``tensor``, or for a subclass a plain ``torch.Tensor`` over the same memory, made with
    its ``__torch_function__`` off: a subclass may define ``shape``, ``stride()``, ``dtype``
    ... that say other than its memory holds (a larger shape would be read and written past
    its storage). A subclass without strided storage is BAD_PARAM."""
    import torch

    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not isinstance(tensor, torch.Tensor):
        return tensor  # a plain tensor (or the tests' stand-in for a CUDA one)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.as_subclass(tensor, torch.Tensor)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} is a tensor without strided storage ({exc})"
        ) from None


def from_torch(name: str, tensor: Any, kind: Any) -> Operand:
    """A torch tensor, with torch's dtype, shape, strides, device and data pointer (a
    subclass's as ``_plain`` reads them)."""
    tensor = _plain(name, tensor)
    dtypes = _from_torch_dtypes()
    if tensor.dtype not in dtypes:
        raise InfiniError(Status.BAD_TENSOR_DTYPE, f"{name} has dtype {tensor.dtype}; {EXPECTED}")
    device, device_id = torch_place(name, tensor)
    _refuse_layout(name, tensor)
    owner, readonly = tensor, ""
    if bits := _lazy_bits(tensor):
        owner = tensor.resolve_neg().resolve_conj()
        readonly = f"a torch view with the {bits} bit set (resolve it first)"
    try:
        ptr = owner.data_ptr()
        shape, strides = tuple(owner.shape), tuple(owner.stride())
    except (RuntimeError, NotImplementedError) as exc:
        raise InfiniError(
            Status.BAD_PARAM, f"{name} is a tensor without strided storage ({exc})"
        ) from None
    desc = described(name, dtypes[tensor.dtype], shape, strides, ptr)
    return Operand(device, device_id, desc, ptr, readonly, kind, owner)


@functools.cache
def torch_stream(stream: int, device_index: int) -> Any:
    """torch's object for ``cudaStream_t`` ``stream`` on device ``device_index`` (0: the
    device's default stream). The device matters: torch enters it with the stream."""
    import torch

    if stream == 0:
        return torch.cuda.default_stream(device_index)
    return torch.cuda.ExternalStream(stream, device=device_index)


def is_tensor(array: Any) -> bool:
    """A real ``torch.Tensor`` (or subclass): one with an autograd version counter."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(array, torch.Tensor)


def is_plain(tensor: Any) -> bool:
    """A ``torch.Tensor`` or ``Parameter``, whose attributes run no ``__torch_function__``."""
    import torch

    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


# torch's words for the write it refuses, by what the tensor is (VariableTypeUtils.h)
_LEAF = "a leaf Variable that requires grad is being used in an in-place operation"
_VIEW = "a view of a leaf Variable that requires grad is being used in an in-place operation"
_OUT = "functions with out=... arguments don't support automatic differentiation"


def refuse_grad_write(name: str, tensor: Any) -> None:
    """BAD_PARAM where torch refuses to write ``tensor`` (argument ``name``) in place with no
    gradient recorded for the write: it requires grad while grad mode is enabled. torch's
    ``check_inplace`` refuses a leaf or a view of one; a non-leaf it would rebase onto the
    in-place op's gradient, which this write has none of, so it is refused as torch refuses
    such an ``out=`` tensor (``throw_error_out_requires_grad``) or batch norm's running
    statistics (``check_no_requires_grad``). Under ``no_grad``/``inference_mode`` it passes."""
    import torch

    own = torch._C.TensorBase  # torch's own getters: a subclass's answers are not asked,
    with torch._C.DisableTorchFunctionSubclass():  # by __torch_function__ or a property
        if not (own.requires_grad.__get__(tensor) and torch.is_grad_enabled()):
            return
        base = own._base.__get__(tensor)
        leaf = own.is_leaf.__get__(tensor)
        why = _LEAF if leaf else _VIEW if base is not None and own.is_leaf.__get__(base) else _OUT
    raise InfiniError(
        Status.BAD_PARAM,
        f"{name} requires grad and grad mode is enabled, but autograd cannot record this "
        f"in-place write: torch refuses it ({why}); write it under torch.no_grad(), or give "
        f"{name}.detach()",
    )


@functools.cache
def version_bump() -> Callable[[tuple], None]:
    """A function bumping the version counter of each tensor of a tuple once, as torch's
    in-place ops do (an inference tensor has none: skipped): ``torch._C._increment_version``
    where it takes a tuple (``torch.autograd.graph.increment_version`` only wraps it, at
    0.5 us more a call), else that public function."""
    import torch

    bump = getattr(torch._C, "_increment_version", None)
    try:
        bump(())
    except Exception:  # absent, or taking no tuple
        return torch.autograd.graph.increment_version
    return bump
